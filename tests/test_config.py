import pytest

from tests.helpers import FakeGroup, answer_for_fake_groups
from uniep import UniEPConfig, UniEPConfigError, UniEPMoE
from uniep.paths import build_expert_path
from uniep.paths.torch_path import TorchPath
from uniep.paths.triton_path import TritonAllToAllPath, TritonPath


def test_defaults_round_trip():
    config = UniEPConfig()
    assert UniEPConfig.from_dict(config.to_dict()) == config
    assert UniEPConfig.from_dict(None) == config


def test_from_dict_sets_values():
    assert UniEPConfig.from_dict({"backend": "torch"}).backend == "torch"


@pytest.mark.parametrize(
    "table, message",
    [
        # unknown key: named, with the allowed keys
        ({"backendd": "torch"},
         r"unknown key uniep\.backendd = 'torch'; allowed keys in \[uniep\]: backend, config, descriptor_loads, descriptor_stores, "),
        # value outside a Literal: named, with allowed values
        ({"transport": "nccl"}, r"uniep\.transport = 'nccl' is not allowed; allowed values: 'all_to_all'"),
        # wrong type for an enum field
        ({"backend": 3}, r"uniep\.backend = 3 is not allowed; allowed values: 'auto', 'torch', 'triton'"),
        # tile sizes must be powers of two the kernels support
        ({"gemm_block_m": 96}, r"uniep\.gemm_block_m = 96 is not allowed; allowed values: \(16, 32, 64, 128, 256\)"),
        ({"wgrad_num_warps": 3}, r"uniep\.wgrad_num_warps = 3 is not allowed; allowed values: \(1, 2, 4, 8, 16\)"),
        ({"gemm_num_stages": 0}, r"uniep\.gemm_num_stages = 0 is not allowed; allowed values: 1\.\.8"),
        ({"gemm_few_rows_num_stages": 9},
         r"uniep\.gemm_few_rows_num_stages = 9 is not allowed; allowed values: 0 \(gemm_num_stages\), 1\.\.8"),
        ({"gemm_prefetch_steps": 17},
         r"uniep\.gemm_prefetch_steps = 17 is not allowed; allowed values: 0 \(off\), 1\.\.16"),
        ({"num_programs": -1}, r"uniep\.num_programs = -1 must be >= 0"),
        # bool is not an int
        ({"gemm_block_n": True}, r"uniep\.gemm_block_n = True must be an integer"),
    ],
)
def test_bad_tables_are_rejected_with_the_field_named(table, message):
    with pytest.raises(UniEPConfigError, match=message):
        UniEPConfig.from_dict(table)


def test_direct_construction_validates():
    with pytest.raises(UniEPConfigError, match=r"backend = 'cuda' is not allowed"):
        UniEPConfig(backend="cuda")


def test_auto_backend_picks_triton_only_on_cuda(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    answer_for_fake_groups(monkeypatch.setattr)
    config = UniEPConfig()
    assert isinstance(build_expert_path(config, None, 8, False, "cuda"), TritonPath)
    assert isinstance(build_expert_path(config, FakeGroup(2), 8, False, "cuda"), TritonAllToAllPath)
    assert isinstance(build_expert_path(config, None, 8, False, "cpu"), TorchPath)
    assert build_expert_path(config, FakeGroup(4), 8, False, "cpu").ep_size == 4


def test_triton_backend_refused_where_it_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(UniEPConfigError, match=r"backend = 'triton' runs on CUDA; got device 'cpu'"):
        build_expert_path(UniEPConfig(backend="triton"), None, 8, False, "cpu")
    # at construction, from the weights' device, not at the first forward
    with pytest.raises(UniEPConfigError, match=r"backend = 'triton' runs on CUDA; got device 'cpu'"):
        UniEPMoE(16, 8, 8, 2, config=UniEPConfig(backend="triton"))
    assert isinstance(build_expert_path(UniEPConfig(backend="triton"), None, 8, False, "cuda"), TritonPath)


def test_expert_parallel_degree_must_divide_the_experts(monkeypatch):
    answer_for_fake_groups(monkeypatch.setattr)
    with pytest.raises(UniEPConfigError, match="expert-parallel degree 3 does not divide num_experts = 8"):
        build_expert_path(UniEPConfig(), FakeGroup(3), 8, False, "cpu")
