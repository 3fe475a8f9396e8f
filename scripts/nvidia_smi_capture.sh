#!/usr/bin/env bash
# Issue 25's capture: nvidia-smi health fields byte for byte, -q, dmesg readability, wall time.
# Usage: bash scripts/nvidia_smi_capture.sh <outdir> <fields file> (issue 25's list: one comma-separated line)
set -u
O=${1:?outdir}; FIELDS_FILE=${2:?fields file}; mkdir -p "$O"
F=$(tr -d ' \n' < "$FIELDS_FILE"); M="$O/b_meta.txt"; : > "$M"
for fmt in csv csv,noheader,nounits; do
  f=$F; name=h200_sxm_1x_health_r580.csv; [ "$fmt" != csv ] && name=h200_sxm_1x_health_r580_noheader.csv
  for try in 1 2 3 4 5 6 7 8 9 10; do
    t0=$(date +%s%N); nvidia-smi --query-gpu="$f" --format=$fmt > "$O/$name" 2> "$O/err.txt"; rc=$?; t1=$(date +%s%N)
    echo "format=$fmt try=$try rc=$rc wall_ms=$(( (t1-t0)/1000000 ))" >> "$M"
    if [ $rc -eq 0 ]; then echo "fields=$f" >> "$M"; break; fi
    echo "stdout: $(cat "$O/$name")" >> "$M"; echo "stderr: $(cat "$O/err.txt")" >> "$M"
    bad=$(cat "$O/$name" "$O/err.txt" | grep -o '"[a-z_.]*"' | head -1 | tr -d '"')
    [ -z "$bad" ] && break
    echo "refused: $bad" >> "$M"; f=$(echo ",$f," | sed "s/,$bad,/,/" | sed 's/^,//; s/,$//')
  done
done
for i in 1 2 3; do t0=$(date +%s%N); nvidia-smi --query-gpu="$f" --format=csv,noheader,nounits > /dev/null 2>&1; t1=$(date +%s%N); echo "repeat wall_ms=$(( (t1-t0)/1000000 ))" >> "$M"; done
nvidia-smi -q > "$O/h200_sxm_1x_q_r580.txt" 2>&1; echo "nvidia-smi -q rc=$?" >> "$M"
dmesg > /tmp/dmesg.txt 2> /tmp/dmesg.err; echo "dmesg rc=$? lines=$(wc -l < /tmp/dmesg.txt) err=$(head -c 300 /tmp/dmesg.err)" >> "$M"
echo "dmesg first lines:" >> "$M"; head -5 /tmp/dmesg.txt >> "$M"; grep -i -E 'xid|nvrm' /tmp/dmesg.txt | tail -5 >> "$M"
rm -f "$O/err.txt"; cat "$M"
