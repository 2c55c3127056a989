import pytest

from uniep import UniEPConfig, UniEPConfigError


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
         r"unknown key uniep\.backendd = 'torch'; allowed keys in \[uniep\]: backend, config, descriptor_loads, gemm_block_k, "),
        # value outside a Literal: named, with allowed values
        ({"transport": "nccl"}, r"uniep\.transport = 'nccl' is not allowed; allowed values: 'all_to_all'"),
        # wrong type for an enum field
        ({"backend": 3}, r"uniep\.backend = 3 is not allowed; allowed values: 'auto', 'torch', 'triton'"),
        # tile sizes must be powers of two the kernels support
        ({"gemm_block_m": 96}, r"uniep\.gemm_block_m = 96 is not allowed; allowed values: \(16, 32, 64, 128, 256\)"),
        ({"wgrad_num_warps": 3}, r"uniep\.wgrad_num_warps = 3 is not allowed; allowed values: \(1, 2, 4, 8, 16\)"),
        ({"gemm_num_stages": 0}, r"uniep\.gemm_num_stages = 0 is not allowed; allowed values: 1\.\.8"),
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


def test_auto_backend_picks_triton_only_on_cuda_with_one_rank(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    config = UniEPConfig()
    assert config.resolved_backend("cuda", 1) == "triton"
    assert config.resolved_backend("cuda", 2) == "triton"  # Triton experts over all_to_all
    assert config.resolved_backend("cpu", 1) == "torch"


def test_triton_backend_refused_where_it_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(UniEPConfigError, match=r"backend = 'triton' runs on CUDA; got device 'cpu'"):
        UniEPConfig(backend="triton").resolved_backend("cpu", 1)
    assert UniEPConfig(backend="triton").resolved_backend("cuda", 4) == "triton"
