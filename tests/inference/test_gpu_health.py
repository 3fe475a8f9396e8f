"""GPU health telemetry: nvidia-smi health fixtures and kernel logs parsed, rules applied."""

from __future__ import annotations

import datetime as dt
import subprocess

import pytest

from inference.gpu_health import (
    HEALTH_COMMAND,
    HEALTH_FIELDS,
    GpuContext,
    HealthState,
    HealthThresholds,
    Sample,
    evaluate,
    parse_health_csv,
    parse_kernel_log,
    read_health_table,
    read_sample,
    same_pci_device,
    throttle_reason_names,
)
from tests.helpers.samples import nvidia_smi_sample

AT = dt.datetime(2026, 12, 2, 3, 30, tzinfo=dt.UTC)
V100_BUS = [
    "00000000:06:00.0",
    "00000000:07:00.0",
    "00000000:0A:00.0",
    "00000000:0B:00.0",
    "00000000:85:00.0",
    "00000000:86:00.0",
    "00000000:89:00.0",
    "00000000:8A:00.0",
]


def sample_of(name: str, *, at: dt.datetime = AT, xids: str = "") -> Sample:
    return Sample(
        at=at, gpus=tuple(parse_health_csv(nvidia_smi_sample(name))), xids=tuple(parse_kernel_log(xids))
    )


def verdicts(sample: Sample, **kwargs) -> dict[int, object]:
    return {i: evaluate(GpuContext(i, bus, **kwargs), sample) for i, bus in enumerate(V100_BUS)}


def test_it_asks_for_the_fields_the_h200_capture_used():
    assert HEALTH_COMMAND[1] == "--query-gpu=" + ",".join(HEALTH_FIELDS)
    assert HEALTH_COMMAND[2] == "--format=csv,noheader,nounits"
    assert len(HEALTH_FIELDS) == 32


def test_it_parses_a_healthy_v100_sxm2_node_and_finds_nothing_wrong():
    gpus = parse_health_csv(nvidia_smi_sample("health_v100_sxm2_8x_healthy.csv"))
    assert [g.index for g in gpus] == list(range(8))
    busy, idle = gpus[0], gpus[7]
    assert busy.name == "Tesla V100-SXM2-32GB" and busy.persistence_mode is True
    assert (busy.utilization_gpu_pct, busy.memory_used_mib, busy.temperature_c) == (87, 29834, 61)
    assert (busy.power_draw_w, busy.power_limit_w, busy.sm_clock_mhz) == (211.45, 300.0, 1530)
    assert busy.throttle_reasons == () and idle.throttle_reasons == ("gpu_idle",)
    assert busy.remapped_rows_pending is None  # Volta retires pages; row remapping is Ampere's
    assert gpus[3].retired_pages_single_bit == 1 and gpus[3].retired_pages_pending is False
    assert {v.state for v in verdicts(sample_of("health_v100_sxm2_8x_healthy.csv")).values()} == {
        HealthState.HEALTHY
    }


def test_it_finds_an_uncorrectable_ecc_error_and_calls_the_gpu_degraded():
    result = verdicts(sample_of("health_v100_sxm2_8x_ecc_uncorrectable.csv"))
    assert result[3].state == HealthState.DEGRADED
    finding = result[3].findings[0]
    assert finding.code == "ecc_uncorrectable"
    assert "2 uncorrectable ECC errors" in finding.message and "2026-12-02 03:30:00 UTC" in finding.message
    assert "reset" in finding.message
    assert all(result[i].state == HealthState.HEALTHY for i in range(8) if i != 3)


def test_it_finds_a_pending_page_retirement():
    result = verdicts(sample_of("health_v100_sxm2_8x_retirement_pending.csv"))
    assert result[5].state == HealthState.DEGRADED
    assert [f.code for f in result[5].findings] == ["retirement_pending", "ecc_history"]
    assert "retired_pages.pending = Yes" in result[5].findings[0].message


def test_it_decodes_throttle_reasons_and_warns_only_when_sustained():
    gpus = parse_health_csv(nvidia_smi_sample("health_v100_sxm2_8x_throttling.csv"))
    assert gpus[2].throttle_reasons == ("sw_thermal_slowdown", "hw_thermal_slowdown")
    assert gpus[6].throttle_reasons == ("sw_power_cap",)
    sample = sample_of("health_v100_sxm2_8x_throttling.csv")
    fresh = evaluate(GpuContext(2, V100_BUS[2]), sample)
    assert fresh.state == HealthState.WARNING  # 89 °C is hot, even before throttling counts
    assert [f.code for f in fresh.findings] == ["hot"] and fresh.throttled_since == AT
    long_ago = AT - dt.timedelta(minutes=6)
    thermal = evaluate(GpuContext(2, V100_BUS[2], throttled_since=long_ago), sample)
    assert [f.code for f in thermal.findings] == ["thermal_throttling", "hot"]
    assert "for 6 min" in thermal.findings[0].message and "fans" in thermal.findings[0].message
    # GPU 6 draws 299.87 of its 300 W under full load with sw_power_cap set: running at its limit is
    # normal, not a fault (issue 34), and is not counted as throttling.
    power = evaluate(GpuContext(6, V100_BUS[6], throttled_since=long_ago), sample)
    assert power.state == HealthState.HEALTHY and power.throttled_since is None
    context = GpuContext(2, V100_BUS[2], throttled_since=long_ago)
    lenient = evaluate(context, sample, limits=HealthThresholds(throttle_minutes=10))
    assert [f.code for f in lenient.findings] == ["hot"] and lenient.throttled_since == long_ago


def test_it_reads_unknown_throttle_bits_by_value():
    assert throttle_reason_names(0x1000 | 0x4) == ("sw_power_cap", "bit_0x1000")
    assert throttle_reason_names(None) == ()


def test_it_calls_a_gpu_missing_from_the_output_lost():
    result = verdicts(sample_of("health_v100_sxm2_8x_gpu4_missing.csv"))
    assert result[4].state == HealthState.LOST
    assert result[4].findings[0].code == "no_answer" and "not GPU 4" in result[4].findings[0].message
    assert all(result[i].state == HealthState.HEALTHY for i in range(8) if i != 4)


def test_it_warns_about_a_narrow_pcie_link_but_not_an_idle_generation_downshift():
    sample = Sample(at=AT, gpus=tuple(parse_health_csv(nvidia_smi_sample("health_v100_pcie_4x_x8_link.csv"))))
    buses = ["00000000:3B:00.0", "00000000:5E:00.0", "00000000:AF:00.0", "00000000:D8:00.0"]
    result = [evaluate(GpuContext(i, bus), sample) for i, bus in enumerate(buses)]
    assert result[1].state == HealthState.WARNING
    assert result[1].findings[0].code == "pcie_link_narrow"
    assert "x8 of its x16" in result[1].findings[0].message
    assert sample.gpus[2].pcie_gen == 1 and result[2].state == HealthState.HEALTHY


def test_it_reads_na_and_not_supported_as_none():
    (gpu,) = parse_health_csv(nvidia_smi_sample("health_na_not_supported.csv"))
    assert gpu.persistence_mode is False
    assert gpu.power_draw_w is None and gpu.power_limit_w is None and gpu.memory_temperature_c is None
    assert gpu.throttle_mask is None and gpu.ecc_uncorrected_volatile is None
    assert gpu.retired_pages_pending is None and gpu.pcie_width == 16
    assert evaluate(GpuContext(0, gpu.pci_bus_id), Sample(at=AT, gpus=(gpu,))).state == HealthState.HEALTHY


def test_it_reports_a_row_with_the_wrong_number_of_values_against_its_own_gpu():
    table = read_health_table("0, GPU-x, 00000000:06:00.0\n")
    assert table.gpus == () and [(p.index, p.reason) for p in table.problems] == [
        (0, "line 1 has 3 values where 32 were asked for")
    ]


def test_it_parses_xid_events_from_dmesg_with_and_without_absolute_times():
    iso = parse_kernel_log(nvidia_smi_sample("kernel_log_xid_dmesg_iso.txt"))
    assert [(x.pci_bus_id, x.code) for x in iso] == [
        ("0000:0b:00", 13),
        ("0000:0b:00", 48),
        ("0000:0b:00", 63),
        ("0000:85:00", 79),
    ]
    assert iso[3].at == dt.datetime(2026, 12, 2, 3, 17, 52, tzinfo=dt.UTC)
    assert iso[3].detail == "pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
    (plain,) = parse_kernel_log(nvidia_smi_sample("kernel_log_xid_dmesg_plain.txt"))
    assert (plain.code, plain.at) == (79, None)
    assert same_pci_device("0000:85:00", "00000000:85:00.0")
    assert not same_pci_device("0000:85:00", "00000000:86:00.0")


def test_it_turns_xid_79_into_lost_and_memory_xids_into_degraded_until_cleared():
    log = nvidia_smi_sample("kernel_log_xid_dmesg_iso.txt")
    sample = sample_of("health_v100_sxm2_8x_healthy.csv", xids=log)
    result = verdicts(sample)
    assert result[4].state == HealthState.LOST and result[4].findings[0].code == "xid_79"
    assert "03:17:52" in result[4].findings[0].message
    assert result[3].state == HealthState.DEGRADED
    assert [f.code for f in result[3].findings] == ["xid_48", "xid_63"]  # 13 is older than the hour
    assert result[0].state == HealthState.HEALTHY  # Xid 13 is the application's fault, not the GPU's
    cleared = evaluate(GpuContext(4, V100_BUS[4], cleared_at=AT - dt.timedelta(minutes=5)), sample)
    assert cleared.state == HealthState.HEALTHY
    stale = evaluate(GpuContext(4, V100_BUS[4]), sample, limits=HealthThresholds(xid_window_minutes=5))
    assert stale.state == HealthState.HEALTHY


def _runner(stdout: str = "", returncode: int = 0, raises: Exception | None = None):
    def run(argv, **kwargs):
        assert kwargs["timeout"] == 3
        if raises is not None:
            raise raises
        if argv[0] == "dmesg":
            return subprocess.CompletedProcess(argv, 1, "", "dmesg: read kernel buffer failed")
        return subprocess.CompletedProcess(argv, returncode, stdout, "")

    return run


def test_it_samples_with_a_bounded_timeout_and_takes_a_hung_driver_as_no_answer():
    hung = read_sample(timeout_s=3, run=_runner(raises=subprocess.TimeoutExpired("nvidia-smi", 3)))
    assert hung.gpus == () and hung.error == "nvidia-smi did not answer within 3 s"
    assert evaluate(GpuContext(0, V100_BUS[0]), hung).state == HealthState.LOST
    missing = read_sample(timeout_s=3, run=_runner(raises=FileNotFoundError()))
    assert missing.unavailable and evaluate(GpuContext(0, V100_BUS[0]), missing).state == HealthState.UNKNOWN
    partial = read_sample(
        timeout_s=3,
        run=_runner(nvidia_smi_sample("health_v100_sxm2_8x_gpu4_missing.csv"), returncode=15),
    )
    assert len(partial.gpus) == 7 and "status 15" in partial.error and partial.xids == ()
    lost = evaluate(GpuContext(4, V100_BUS[4]), partial)
    assert lost.state == HealthState.LOST and "status 15" in lost.findings[0].message


def test_the_command_prints_one_judged_sample_and_keeps_the_raw_output(tmp_path, monkeypatch, capsys):
    import json

    from inference.gpu_health import main
    from tests.helpers.agents import FakeNvidiaSmi

    smi = FakeNvidiaSmi(tmp_path / "bin")
    smi.show("health_v100_sxm2_8x_retirement_pending.csv")
    monkeypatch.setenv("PATH", smi.path)
    assert main(["--timeout", "5", "--raw", str(tmp_path / "raw.csv")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [v["state"] for v in report["verdicts"]].count("degraded") == 1
    assert report["gpus"][5]["retired_pages_pending"] is True
    raw = (tmp_path / "raw.csv").read_text()
    assert raw == nvidia_smi_sample("health_v100_sxm2_8x_retirement_pending.csv")


# --- The real H200 capture (driver 580.159.04; inference/data/nvidia_smi/README.md) ------------------------


def test_it_parses_the_real_h200_capture_the_agent_way_and_with_a_header():
    (bare,) = parse_health_csv(nvidia_smi_sample("h200_sxm_1x_health_r580_noheader.csv"))
    assert (bare.index, bare.name, bare.pci_bus_id) == (0, "NVIDIA H200", "00000000:00:06.0")
    assert bare.persistence_mode is True and bare.throttle_reasons == ("gpu_idle",)
    assert (bare.memory_used_mib, bare.memory_total_mib, bare.temperature_c, bare.memory_temperature_c) == (
        0,
        143771,
        38,
        36,
    )
    assert (bare.power_draw_w, bare.power_limit_w) == (82.12, 700.0)
    assert (bare.sm_clock_mhz, bare.memory_clock_mhz, bare.max_sm_clock_mhz) == (345, 3201, 1980)
    assert bare.ecc_uncorrected_volatile == 0 and bare.ecc_corrected_aggregate == 0
    # HBM3e remaps rows instead of retiring pages: the page fields are [N/A], the row fields numbers.
    assert (bare.retired_pages_single_bit, bare.retired_pages_double_bit, bare.retired_pages_pending) == (
        None,
        None,
        None,
    )
    assert (bare.remapped_rows_correctable, bare.remapped_rows_pending, bare.remapped_rows_failure) == (
        0,
        False,
        False,
    )
    assert (bare.pcie_gen, bare.pcie_gen_max, bare.pcie_width, bare.pcie_width_max) == (5, 5, 16, 16)
    verdict = evaluate(GpuContext(0, bare.pci_bus_id), Sample(at=AT, gpus=(bare,)))
    assert verdict.state == HealthState.HEALTHY and verdict.findings == ()

    # With a header the driver prints three fields under their current names and units after numbers.
    (headed,) = parse_health_csv(nvidia_smi_sample("h200_sxm_1x_health_r580.csv"))
    assert headed.sm_clock_mhz == 345 and headed.memory_clock_mhz == 3201 and headed.throttle_mask == 1
    assert headed.power_draw_w == 82.10 and headed.memory_used_mib == 0
    assert headed.to_dict() | {"power_draw_w": 82.12} == bare.to_dict()


def test_a_header_without_a_field_leaves_that_reading_unknown():
    header, row = nvidia_smi_sample("h200_sxm_1x_health_r580.csv").splitlines()[:2]
    (gpu,) = parse_health_csv(header.replace("pcie.link.width.max", "x") + "\n" + row + "\n")
    assert gpu.pcie_width_max is None and gpu.pcie_width == 16


def test_a_child_that_outlives_its_timeout_is_killed_and_the_call_returns(tmp_path):
    import time

    from inference.gpu_health import bounded_run

    began = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        bounded_run(["sh", "-c", "sleep 30 & sleep 30"], timeout=0.5)
    assert time.monotonic() - began < 5
    assert bounded_run(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout=5).returncode == 3
