"""The environment probe reads vLLM's own kernel architectures from its shared objects."""

from pathlib import Path

from inference.cuda_archs import missing_kernels
from inference.env_probe import build_advice, fatbin_archs, probe_environment, vllm_kernel_archs
from tests.helpers.vllm_install import fake_vllm_install, fatbin_elf


def test_it_reads_the_sm_numbers_of_the_cubins_and_ptx_in_a_fatbinary_section():
    assert fatbin_archs(fatbin_elf(["sm_80", "sm_75", "compute_90"])) == ["sm_75", "sm_80", "compute_90"]


def test_it_finds_no_kernels_in_a_shared_object_without_a_fatbinary():
    assert fatbin_archs(fatbin_elf([])) == []
    assert fatbin_archs(b"not an ELF at all") == []


def test_it_reads_each_kernel_library_of_a_vllm_package(tmp_path: Path):
    (tmp_path / "_C.abi3.so").write_bytes(fatbin_elf(["sm_75", "sm_80"]))
    (tmp_path / "_moe_C.abi3.so").write_bytes(fatbin_elf(["sm_70", "sm_80"]))
    (tmp_path / "cpu_only.so").write_bytes(fatbin_elf(["sm_90"]))  # not one of vLLM's kernel libraries
    assert vllm_kernel_archs(tmp_path) == {
        "_C.abi3.so": ["sm_75", "sm_80"],
        "_moe_C.abi3.so": ["sm_70", "sm_80"],
    }


def test_it_probes_torchs_arch_list_and_vllms_own_kernels_of_an_install(tmp_path: Path):
    python = fake_vllm_install(tmp_path, vllm_version="0.19.1", kernel_archs=["sm_75", "sm_80"])
    facts = probe_environment(str(python))
    assert facts.vllm_version == "0.19.1" and facts.torch_cuda_version == "12.6"
    assert "sm_70" in facts.arch_list
    assert facts.kernel_archs == {"_C.abi3.so": ["sm_75", "sm_80"]}


def test_it_advises_an_installable_volta_combination_with_its_command():
    advice = build_advice(["sm_70"])
    assert "vLLM 0.19.1 with torch 2.10" in advice and "0.8.5" in advice
    assert "pip install vllm==0.19.1" in advice


def test_it_counts_a_cubin_for_later_gpus_of_its_major_version_only():
    # vLLM 0.19.1's _C_stable_libtorch.abi3.so carries sm_80 but no sm_86 and no PTX: it runs on an A10.
    assert missing_kernels(["sm_70", "sm_80", "sm_90"], ["8.6", "7.0"]) == []
    assert missing_kernels(["sm_75", "sm_80"], ["7.0", "9.0"]) == ["sm_70", "sm_90"]
