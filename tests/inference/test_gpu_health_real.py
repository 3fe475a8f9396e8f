"""GPU health on real outputs collected from public sources (tests/fixtures/gpu/real/, each with its
source on its first line) and on odd inputs derived from real ones in the test itself."""

from __future__ import annotations

import datetime as dt
import subprocess

import pytest

from inference.gpu_health import (
    HEALTH_FIELDS,
    XID_TABLE,
    GpuContext,
    HealthState,
    HealthThresholds,
    Sample,
    evaluate,
    judge_xid,
    parse_kernel_log,
    read_health_table,
    read_sample,
)
from tests.helpers.real_gpu import REAL_GPU, real_gpu_output
from tests.helpers.samples import nvidia_smi_sample

AT = dt.datetime(2026, 12, 2, 3, 30, tzinfo=dt.UTC)


def answering(at: dt.datetime, xids: tuple = ()) -> Sample:
    """A sample in which GPU 0 answered (the real H100 row), carrying these kernel-log events."""
    return Sample(at=at, gpus=read_health_table(real_gpu_output(H100)).gpus, xids=xids)


H100 = "health-h100-wide-csv-r590-load.csv"
H100_MIG = "health-h100-mig-wide-csv-r590-load.csv"
# The committed 8×V100 node (inference/data/nvidia_smi/), as the agent reads it (noheader, nounits).
V100_NODE = "health_v100_sxm2_8x_healthy.csv"


def judged(text: str, *, at: dt.datetime = AT, xids: str = "", **context) -> dict[int, object]:
    """Every GPU the text names, judged from one sample of it (buses from the rows themselves)."""
    table = read_health_table(text)
    sample = Sample(
        at=at, gpus=table.gpus, problems=table.problems, lost=table.lost, xids=tuple(parse_kernel_log(xids))
    )
    buses = {g.index: g.pci_bus_id for g in table.gpus} | {
        p.index: "" for p in table.problems if p.index is not None
    }
    return {i: evaluate(GpuContext(i, bus, **context), sample) for i, bus in sorted(buses.items())}


def with_cell(
    text: str, *, row: int, column: str, value: str, fields: tuple[str, ...] = HEALTH_FIELDS
) -> str:
    """Derived input: the real (or committed) text with one cell of one row replaced."""
    lines = text.splitlines()
    cells = lines[row].split(", ")
    cells[fields.index(column)] = value
    lines[row] = ", ".join(cells)
    return "\n".join(lines) + "\n"


def wide_cell(text: str, column: str, value: str) -> str:
    """Derived input: the wide real capture (header + one row) with one named cell replaced."""
    header, row = text.splitlines()[:2]
    names = header.split(", ")
    cells = row.split(", ")
    cells[names.index(column)] = value
    return f"{header}\n{', '.join(cells)}\n"


# --- The health CSV: per row, per value ---------------------------------------------------------------


def test_it_reads_a_wide_real_capture_where_index_sits_in_the_middle_of_212_columns():
    (gpu,) = read_health_table(real_gpu_output(H100)).gpus
    assert (gpu.index, gpu.name, gpu.pci_bus_id) == (0, "NVIDIA H100 80GB HBM3", "00000000:00:09.0")
    assert (gpu.utilization_gpu_pct, gpu.memory_used_mib, gpu.power_draw_w) == (100, 19818, 631.95)
    assert (gpu.sm_clock_mhz, gpu.max_sm_clock_mhz, gpu.throttle_mask) == (1980, 1980, 0)
    assert gpu.remapped_rows_pending is False and gpu.unknown_fields == ()
    assert evaluate(GpuContext(0, gpu.pci_bus_id), Sample(at=AT, gpus=(gpu,))).state == HealthState.HEALTHY


def test_it_reads_a_capture_kept_with_its_source_note_above_the_header():
    (gpu,) = read_health_table((REAL_GPU / H100).read_text()).gpus  # the file as committed, note line and all
    assert gpu.index == 0 and gpu.power_draw_w == 631.95


def test_it_reads_the_wide_capture_behind_a_utf8_bom():
    text = "\ufeff" + real_gpu_output(H100)  # derived: as an editor on Windows saves it
    (gpu,) = read_health_table(text).gpus
    assert gpu.index == 0 and gpu.temperature_c == 59


def test_it_calls_mig_hidden_utilization_and_row_remapping_unknown_not_healthy():
    (verdict,) = judged(real_gpu_output(H100_MIG)).values()
    assert verdict.state == HealthState.UNKNOWN
    (finding,) = verdict.findings
    assert finding.code == "readings_unknown" and "MIG" in finding.message
    assert "utilization.gpu" in finding.message and "remapped_rows.pending" in finding.message


def test_the_drivers_recovery_action_column_is_honoured_when_the_query_carries_it():
    assert read_health_table(real_gpu_output(H100)).gpus[0].recovery_action == "None"  # nothing to do
    (verdict,) = judged(wide_cell(real_gpu_output(H100), "gpu_recovery_action", "Reset")).values()  # derived
    assert verdict.state == HealthState.DEGRADED and verdict.findings[0].code == "driver_recovery_action"
    (reboot,) = judged(wide_cell(real_gpu_output(H100), "gpu_recovery_action", "Reboot")).values()
    assert reboot.state == HealthState.LOST


def test_a_gpu_that_requires_a_reset_is_degraded_and_the_other_seven_stay_healthy():
    text = with_cell(nvidia_smi_sample(V100_NODE), row=3, column="ecc.errors.uncorrected.volatile.total",
                     value="[GPU requires reset]")  # fmt: skip
    result = judged(text)
    assert result[3].state == HealthState.DEGRADED
    assert (
        result[3].findings[0].code == "driver_requires_reset"
        and "reset the GPU" in result[3].findings[0].message
    )
    assert {i: v.state for i, v in result.items() if i != 3} == dict.fromkeys(
        [0, 1, 2, 4, 5, 6, 7], "healthy"
    )


def test_a_row_the_driver_fills_with_requires_reset_still_costs_only_that_gpu():
    lines = nvidia_smi_sample(V100_NODE).splitlines()
    lines[6] = ", ".join(["[GPU requires reset]"] * len(HEALTH_FIELDS))  # derived: even its index
    table = read_health_table("\n".join(lines) + "\n")
    sample = Sample(at=AT, gpus=table.gpus, problems=table.problems)
    verdict = evaluate(GpuContext(6, "00000000:89:00.0"), sample)
    assert verdict.state == HealthState.DEGRADED and verdict.findings[0].code == "driver_requires_reset"
    assert evaluate(GpuContext(5, "00000000:86:00.0"), sample).state == HealthState.HEALTHY


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("ecc.errors.uncorrected.volatile.total", "[Insufficient Permissions]"),
        ("ecc.errors.uncorrected.volatile.total", "[Unknown Error]"),
        ("temperature.gpu", "ERR!"),
        ("power.draw", "inf"),
        ("power.draw", "nan"),
        ("temperature.gpu", "6553"),
        ("utilization.gpu", "400"),
        ("memory.used", "99999"),  # above memory.total (32768)
    ],
)
def test_one_unreadable_value_is_unknown_for_that_field_only(column, value):
    result = judged(with_cell(nvidia_smi_sample(V100_NODE), row=5, column=column, value=value))
    assert result[5].state == HealthState.UNKNOWN
    assert column in result[5].reading.unknown_fields
    assert all(v.state == HealthState.HEALTHY for i, v in result.items() if i != 5)


@pytest.mark.parametrize(
    "damage",
    [
        lambda row: row[: len(row) // 2],  # truncated
        lambda row: row + ", 16",  # an extra column
        lambda row: row.replace("Tesla V100-SXM2-32GB", "Tesla V100, SXM2"),  # an unquoted comma in the name
        lambda row: row.replace("300.00", "300,00"),  # a decimal comma
    ],
    ids=["truncated", "extra-column", "comma-in-name", "decimal-comma"],
)
def test_an_unreadable_row_costs_only_its_own_gpu_and_never_marks_another_lost(damage):
    lines = nvidia_smi_sample(V100_NODE).splitlines()
    lines[7] = damage(lines[7])  # derived: the last row damaged
    result = judged("\n".join(lines) + "\n")
    assert result[7].state == HealthState.UNKNOWN and result[7].findings[0].code == "unreadable_row"
    assert "Tesla" not in result[7].findings[0].message  # the why names the line, never quotes it
    assert all(v.state == HealthState.HEALTHY for i, v in result.items() if i != 7)


def test_a_row_whose_index_cannot_be_read_leaves_the_missing_gpu_unknown_not_lost():
    lines = nvidia_smi_sample(V100_NODE).splitlines()
    lines[4] = "x" + lines[4]  # derived: GPU 4's index cell damaged
    table = read_health_table("\n".join(lines) + "\n")
    sample = Sample(at=AT, gpus=table.gpus, problems=table.problems)
    verdict = evaluate(GpuContext(4, "00000000:85:00.0"), sample)
    assert verdict.state == HealthState.UNKNOWN and verdict.findings[0].code == "unreadable_row"


def test_a_repeated_gpu_index_is_reported_not_silently_accepted():
    lines = nvidia_smi_sample(V100_NODE).splitlines()
    table = read_health_table("\n".join([*lines, lines[2]]) + "\n")  # derived: GPU 2 printed twice
    assert len(table.gpus) == 8 and [(p.index, p.line) for p in table.problems] == [(2, 9)]
    assert judged("\n".join([*lines, lines[2]]) + "\n")[2].findings[0].code == "duplicate_row"


def test_the_why_of_a_failed_query_does_not_quote_a_csv_data_row():
    rows = nvidia_smi_sample("health_v100_sxm2_8x_gpu4_missing.csv")

    def run(argv, **kwargs):
        if argv[0] == "dmesg":
            return subprocess.CompletedProcess(argv, 1, "", "")
        return subprocess.CompletedProcess(argv, 15, rows, "")

    sample = read_sample(timeout_s=3, run=run)
    assert sample.error == "nvidia-smi exited with status 15"
    lost = evaluate(GpuContext(4, "00000000:85:00.0"), sample)
    assert lost.state == HealthState.LOST and "GPU-" not in lost.findings[0].message


# --- A driver that does not know a field --------------------------------------------------------------


def test_a_field_the_driver_does_not_know_is_dropped_and_the_query_asked_again():
    """Derived: the real H200 row without the remapped_rows columns, as a driver without them answers."""
    real = nvidia_smi_sample("h200_sxm_1x_health_r580_noheader.csv").splitlines()[0].split(", ")
    kept = [
        cell
        for field, cell in zip(HEALTH_FIELDS, real, strict=True)
        if not field.startswith("remapped_rows.")
    ]
    asked: list[str] = []

    def run(argv, **kwargs):
        if argv[0] == "dmesg":
            return subprocess.CompletedProcess(argv, 1, "", "")
        asked.append(argv[1])
        unknown = next((f for f in argv[1].split("=")[1].split(",") if f.startswith("remapped_rows.")), None)
        if unknown:
            return subprocess.CompletedProcess(
                argv, 2, "", f'Field "{unknown}" is not a valid field to query.\n\n'
            )
        return subprocess.CompletedProcess(argv, 0, ", ".join(kept) + "\n", "")

    sample = read_sample(timeout_s=3, run=run)
    assert sample.error == "" and len(asked) == 5
    assert sample.unsupported_fields == (
        "remapped_rows.correctable",
        "remapped_rows.uncorrectable",
        "remapped_rows.pending",
        "remapped_rows.failure",
    )
    (gpu,) = sample.gpus
    assert (gpu.index, gpu.power_draw_w, gpu.pcie_width_max) == (0, 82.12, 16)
    verdict = evaluate(GpuContext(0, gpu.pci_bus_id), sample)
    assert verdict.state == HealthState.HEALTHY
    assert verdict.findings[-1].code == "checks_unknown" and "row remapping" in verdict.findings[-1].message


# --- Throttling as nvml.h defines it ------------------------------------------------------------------


def test_a_card_holding_its_power_limit_under_load_is_not_warned():
    text = wide_cell(real_gpu_output(H100), "clocks_event_reasons.active", "0x0000000000000004")
    text = wide_cell(text, "power.draw [W]", "695.20 W")  # derived: sw_power_cap at 99 % of 700 W
    (verdict,) = judged(text, throttled_since=AT - dt.timedelta(minutes=30)).values()
    assert verdict.state == HealthState.HEALTHY and verdict.findings == () and verdict.throttled_since is None


def test_a_power_brake_clamping_every_gpu_under_load_is_a_degraded_platform_fault_not_heat():
    text = wide_cell(real_gpu_output(H100), "clocks_event_reasons.active", "0x0000000000000088")
    text = wide_cell(text, "clocks.current.sm [MHz]", "86 MHz")  # derived: the brake at 86 of 1,980 MHz
    text = wide_cell(text, "temperature.gpu", "29")
    (verdict,) = judged(text).values()
    assert verdict.state == HealthState.DEGRADED
    (finding,) = verdict.findings
    assert (
        finding.code == "node_clock_clamp"
        and "power brake" in finding.message
        and "fans" not in finding.message
    )


def test_a_power_brake_on_one_card_is_a_power_warning_once_sustained():
    text = with_cell(nvidia_smi_sample(V100_NODE), row=2, column="clocks_throttle_reasons.active",
                     value="0x0000000000000088")  # fmt: skip
    result = judged(text, throttled_since=AT - dt.timedelta(minutes=6))
    assert result[2].state == HealthState.WARNING and result[2].findings[0].code == "power_brake"
    assert "PSU" in result[2].findings[0].message and "fans" not in result[2].findings[0].message
    assert result[0].state == HealthState.HEALTHY


# --- Kernel logs: formats, times, the Xid table -------------------------------------------------------


def test_it_reads_dmesg_t_stamps_and_judges_application_xids_healthy_and_contained_ecc_a_warning():
    events = parse_kernel_log(real_gpu_output("xid-dmesg-T-akash-support-244.txt"))
    assert [(x.pci_bus_id, x.code) for x in events] == [
        ("0000:00:05", 43), ("0000:00:05", 43), ("0000:00:07", 31), ("0000:00:08", 94),
    ]  # fmt: skip
    assert events[3].at == dt.datetime(2024, 8, 9, 13, 32, 56, tzinfo=dt.UTC)
    verdict = evaluate(
        GpuContext(0, "00000000:00:08.0"), answering(dt.datetime(2024, 8, 9, 14, tzinfo=dt.UTC), events)
    )
    codes = {f.code: f.level for f in verdict.findings}
    assert codes["xid_94"] == "warning" and "RST: No" in next(
        f.message for f in verdict.findings if f.code == "xid_94"
    )
    assert judge_xid(43, events[0].detail).level == "healthy"


def test_it_places_seconds_since_boot_with_the_boot_time_and_ages_the_events_out():
    log = real_gpu_output("xid-dmesg-uptime-chia-gigahorse-301.txt")
    assert {x.at for x in parse_kernel_log(log)} == {None}
    booted = dt.datetime(2024, 4, 7, 0, 0, tzinfo=dt.UTC)
    events = parse_kernel_log(log, boot_time=booted)
    assert events[1].code == 62 and events[1].at == booted + dt.timedelta(seconds=14370.687545)
    fresh = answering(booted + dt.timedelta(hours=4, minutes=30), tuple(events))
    verdict = evaluate(GpuContext(0, "00000000:0A:00.0"), fresh)
    assert verdict.state == HealthState.DEGRADED  # Xid 62: the micro-controller halted
    xid_45 = next(f for f in verdict.findings if f.code == "xid_45")
    assert "8 times" in xid_45.message and "03:59:30" in xid_45.message and "03:59:57" in xid_45.message
    later = answering(booted + dt.timedelta(hours=6), tuple(events))
    assert evaluate(GpuContext(0, "00000000:0A:00.0"), later).state == HealthState.HEALTHY


def test_it_reads_mig_attributed_lines_and_honours_the_drivers_reset_flag():
    events = parse_kernel_log(real_gpu_output("xid-mig-94-95-open-gpu-kernel-modules-source.txt"))
    assert [(x.code, x.gpu_instance) for x in events] == [(94, 5), (94, None), (95, None)]
    assert judge_xid(94, events[0].detail).level == "warning"
    rst = judge_xid(95, events[2].detail)
    assert rst.level == "degraded" and "RST: Yes" in rst.why


def test_it_reads_the_old_format_without_pci_and_a_journal_stamp():
    """Derived from the real dmesg -T line of Xid 31: re-stamped as the journal prints it, and with the
    address as drivers before ~2015 printed it (no `PCI:`)."""
    real = real_gpu_output("xid-dmesg-T-akash-support-244.txt").splitlines()[7]
    line = "Aug  5 03:54:13 node4 kernel: " + real.split("] ", 1)[1].replace(
        "(PCI:0000:00:07)", "(0000:00:07)"
    )
    (event,) = parse_kernel_log(line, now=dt.datetime(2024, 8, 6, tzinfo=dt.UTC))
    assert (event.pci_bus_id, event.code, event.at) == (
        "0000:00:07",
        31,
        dt.datetime(2024, 8, 5, 3, 54, 13, tzinfo=dt.UTC),
    )


def test_the_drivers_xid_154_verdict_decides_and_an_nvlink_149_drains_the_peers():
    (event,) = parse_kernel_log(real_gpu_output("xid-talos-154-open-gpu-kernel-modules-446.txt"))
    assert event.at == dt.datetime(2026, 4, 22, 21, 30, 51, tzinfo=dt.UTC)
    sample = answering(event.at + dt.timedelta(minutes=1), (event,))
    verdict = evaluate(GpuContext(0, "00000000:0B:00.0"), sample)
    assert verdict.state == HealthState.DEGRADED and "GPU Reset Required" in verdict.findings[0].message
    reboot = "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)"  # derived: 0x2
    assert judge_xid(154, reboot).level == "lost"
    nvlink = parse_kernel_log(real_gpu_output("xid-kmsg-149-gpud-1174.txt"))
    assert (
        judge_xid(149, nvlink[0].detail).level == "degraded" and "NVLink peers" in judge_xid(149, "").action
    )


def test_every_xid_row_has_a_source_and_the_gpu_fatal_ones_are_never_healthy():
    required = {
        13,
        31,
        32,
        43,
        45,
        48,
        61,
        62,
        63,
        64,
        68,
        69,
        74,
        79,
        92,
        94,
        95,
        109,
        119,
        120,
        121,
        140,
        143,
        149,
        154,
    }
    assert required <= set(XID_TABLE)
    assert all(
        rule.source.startswith("https://docs.nvidia.com/deploy/xid-errors/") for rule in XID_TABLE.values()
    )
    assert {code: XID_TABLE[code].level for code in (119, 120, 62, 74, 149, 154)} == dict.fromkeys(
        (119, 120, 62, 74, 149, 154), "degraded"
    )
    assert XID_TABLE[79].level == "lost" and HealthThresholds().xid_window_minutes == 60
