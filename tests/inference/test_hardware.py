"""The GPU catalog: datasheet figures, lookups by key or nvidia-smi name, discovery matching."""

from __future__ import annotations

import pytest

from inference.errors import InputError
from inference.hardware import GPU_CATALOG, get_gpu, match_gpu


@pytest.mark.parametrize(
    ("key", "bandwidth_gb_s", "fp16_tflops", "compute_capability"),
    [
        ("v100-sxm2-16gb", 900, 125, "7.0"),
        ("v100-sxm2-32gb", 900, 125, "7.0"),
        ("v100-pcie-16gb", 900, 112, "7.0"),
        ("v100-pcie-32gb", 900, 112, "7.0"),
        ("t4", 320, 65, "7.5"),
        ("a10", 600, 125, "8.6"),
        ("l40s", 864, 362, "8.9"),
        ("a100-sxm4-40gb", 1555, 312, "8.0"),
        ("a100-sxm4-80gb", 2039, 312, "8.0"),
        ("h100-sxm5-80gb", 3350, 989, "9.0"),
        ("h100-pcie-80gb", 2000, 756, "9.0"),
        ("h200-sxm-141gb", 4800, 989, "9.0"),
    ],
)
def test_it_carries_the_datasheet_figures(key, bandwidth_gb_s, fp16_tflops, compute_capability):
    spec = GPU_CATALOG[key]
    assert (spec.bandwidth_gb_s, spec.fp16_tflops, spec.compute_capability) == (
        bandwidth_gb_s,
        fp16_tflops,
        compute_capability,
    )


def test_it_links_sxm2_v100s_by_nvlink_and_pcie_v100s_by_pcie_only():
    assert GPU_CATALOG["v100-sxm2-32gb"].nvlink_gb_s == 300
    assert GPU_CATALOG["v100-pcie-32gb"].nvlink_gb_s is None
    assert GPU_CATALOG["v100-pcie-32gb"].pcie_gb_s == 16


def test_it_keys_every_catalog_entry_by_its_own_key():
    assert all(key == spec.key for key, spec in GPU_CATALOG.items())


def test_it_describes_a_v100_as_volta_sm_70_without_bf16():
    v100 = get_gpu("v100-sxm2-32gb")
    assert (v100.cc_tuple, v100.sm_arch, v100.is_volta, v100.supports_bf16) == ((7, 0), "sm_70", True, False)
    assert v100.bf16_tflops is None


def test_it_describes_an_a100_as_sm_80_with_bf16():
    a100 = get_gpu("a100-sxm4-80gb")
    assert (a100.sm_arch, a100.is_volta, a100.supports_bf16) == ("sm_80", False, True)


def test_it_does_not_count_a_turing_t4_as_volta():
    assert get_gpu("t4").is_volta is False


def test_it_computes_memory_bytes_in_binary_units():
    assert get_gpu("v100-pcie-16gb").memory_bytes == 16 * 2**30


def test_it_finds_a_gpu_by_catalog_key():
    assert get_gpu("v100-sxm2-32gb").key == "v100-sxm2-32gb"


def test_it_finds_a_gpu_by_its_nvidia_smi_name():
    assert get_gpu("Tesla V100-SXM2-32GB").key == "v100-sxm2-32gb"


def test_it_finds_a_gpu_by_its_nvidia_smi_name_without_the_vendor_prefix():
    assert get_gpu("V100-SXM2-32GB").key == "v100-sxm2-32gb"


def test_it_finds_a_gpu_ignoring_case_and_spacing():
    assert get_gpu("  tesla   v100-pcie-16gb ").key == "v100-pcie-16gb"


def test_it_rejects_an_unknown_gpu_naming_the_gpu_field():
    with pytest.raises(InputError) as caught:
        get_gpu("x")
    assert caught.value.field == "gpu"
    assert "unknown GPU 'x'" in caught.value.message


def test_it_lists_the_known_gpus_when_the_name_is_unknown():
    with pytest.raises(InputError) as caught:
        get_gpu("rtx-4090")
    assert all(key in caught.value.message for key in GPU_CATALOG)


@pytest.mark.parametrize(
    ("smi_name", "memory_mib", "key"),
    [
        ("Tesla V100-SXM2-32GB", 32510, "v100-sxm2-32gb"),
        ("Tesla V100-SXM2-16GB", 16160, "v100-sxm2-16gb"),
        ("Tesla V100-PCIE-16GB", 16160, "v100-pcie-16gb"),
        ("Tesla V100-PCIE-32GB", 32510, "v100-pcie-32gb"),
        ("NVIDIA A100-SXM4-80GB", 81920, "a100-sxm4-80gb"),
        ("NVIDIA A100-SXM4-40GB", 40960, "a100-sxm4-40gb"),
        ("NVIDIA H100 80GB HBM3", 81559, "h100-sxm5-80gb"),
        ("NVIDIA H100 PCIe", 81559, "h100-pcie-80gb"),
        ("NVIDIA H200", 143771, "h200-sxm-141gb"),
        ("NVIDIA L40S", 46068, "l40s"),
        ("NVIDIA A10", 23028, "a10"),
        ("Tesla T4", 15360, "t4"),
    ],
)
def test_it_matches_what_nvidia_smi_prints_to_a_catalog_entry(smi_name, memory_mib, key):
    spec = match_gpu(smi_name, memory_mib)
    assert spec is not None
    assert spec.key == key


def test_it_matches_every_catalog_entry_by_its_own_nvidia_smi_names():
    for spec in GPU_CATALOG.values():
        assert all(match_gpu(name) is spec for name in spec.nvidia_smi_names)


def test_it_uses_memory_to_pick_the_32gb_v100_when_the_name_omits_the_size():
    spec = match_gpu("Tesla V100-SXM2", memory_mib=32510)
    assert spec is not None
    assert spec.key == "v100-sxm2-32gb"


def test_it_uses_memory_to_pick_the_16gb_v100_when_the_name_omits_the_size():
    spec = match_gpu("Tesla V100-PCIE", memory_mib=16160)
    assert spec is not None
    assert spec.key == "v100-pcie-16gb"


def test_it_reads_the_size_from_an_unlisted_v100_board_name():
    spec = match_gpu("Tesla V100-SXM2 32GB")
    assert spec is not None
    assert spec.key == "v100-sxm2-32gb"


@pytest.mark.parametrize(
    ("smi_name", "memory_mib", "key", "power_limit_w"),
    [
        ("Tesla V100-SXM3-32GB", 32510, "v100-sxm3-32gb", 350),
        ("Tesla V100-DGXS-16GB", 16155, "v100-dgxs-16gb", 300),
        ("Tesla V100-DGXS-32GB", 32475, "v100-dgxs-32gb", 300),
        ("Tesla V100-SXM2-32GB-LS", 32494, "v100-sxm2-32gb-ls", 250),
        ("V100-SXM2-32GB-LS", 32494, "v100-sxm2-32gb-ls", 250),
        ("Tesla V100-SXM2-16GB", 16160, "v100-sxm2-16gb", 300),
        ("Tesla V100-PCIE-32GB", 32510, "v100-pcie-32gb", 250),
        ("Tesla V100S-PCIE-32GB", 32510, "v100s-pcie-32gb", 250),
    ],
)
def test_it_tells_the_v100_variants_apart_with_their_power_limits(smi_name, memory_mib, key, power_limit_w):
    spec = match_gpu(smi_name, memory_mib)

    assert spec is not None
    assert (spec.key, spec.power_limit_w) == (key, power_limit_w)


def test_it_names_a_source_for_every_v100_row():
    v100s = [spec for spec in GPU_CATALOG.values() if spec.key.startswith("v100")]

    assert len(v100s) == 9
    assert all(spec.source and spec.nvlink_links is not None for spec in v100s)


def test_it_does_not_guess_between_variants_without_memory():
    assert match_gpu("Tesla V100-SXM2") is None


def test_it_does_not_match_an_unknown_gpu():
    assert match_gpu("NVIDIA GeForce RTX 4090", memory_mib=24564) is None


def test_it_does_not_match_an_a10g_to_the_a10():
    assert match_gpu("NVIDIA A10G", memory_mib=23028) is None


def test_it_rejects_a_board_whose_memory_contradicts_its_family():
    # An H100 NVL (94 GB) is not the 80 GB H100 SXM5 of the catalog.
    assert match_gpu("NVIDIA H100 NVL", memory_mib=95830) is None
