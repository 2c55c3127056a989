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
        ({"backendd": "torch"}, r"unknown key uniep\.backendd = 'torch'; allowed keys in \[uniep\]: backend, transport"),
        # value outside a Literal: named, with allowed values
        ({"transport": "nccl"}, r"uniep\.transport = 'nccl' is not allowed; allowed values: 'all_to_all'"),
        # wrong type for an enum field
        ({"backend": 3}, r"uniep\.backend = 3 is not allowed; allowed values: 'auto', 'torch'"),
    ],
)
def test_bad_tables_are_rejected_with_the_field_named(table, message):
    with pytest.raises(UniEPConfigError, match=message):
        UniEPConfig.from_dict(table)


def test_direct_construction_validates():
    with pytest.raises(UniEPConfigError, match=r"backend = 'cuda' is not allowed"):
        UniEPConfig(backend="cuda")
