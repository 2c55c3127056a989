"""Bad input stops `python -m recipes.train` before any process group or model work,
with one message naming the setting, its value and what is allowed."""

from pathlib import Path

import pytest

from recipes.train import main

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "train_configs" / "qwen3_moe_debug.toml"


class Result:
    def __init__(self, returncode, output):
        self.returncode, self.output = returncode, output


@pytest.fixture
def train(monkeypatch, capsys):
    """Run the entry point in this process (its checks come before any process group)."""

    def run(*args, config=CONFIG, world_size=2):
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
        monkeypatch.chdir(ROOT)
        with pytest.raises(SystemExit) as stop:
            main(["--job.config_file", str(config), *args])
        captured = capsys.readouterr()
        code = stop.value.code
        message = code if isinstance(code, str) else ""
        return Result(1 if isinstance(code, str) else code, captured.out + captured.err + message)

    return run


def assert_stopped_with(result, message):
    assert result.returncode != 0, result.output
    assert message in result.output, result.output
    assert "Starting job" not in result.output  # the Trainer never started


def edited_config(tmp_path, old, new):
    text = CONFIG.read_text()
    assert old in text
    path = tmp_path / "edited.toml"
    path.write_text(text.replace(old, new))
    return path


def test_unknown_uniep_key(train, tmp_path):
    config = edited_config(tmp_path, 'transport = "all_to_all"', 'transport = "all_to_all"\nmegakernels = true')
    assert_stopped_with(
        train(config=config),
        "unknown key uniep.megakernels = True; allowed keys in [uniep]: backend, config, gemm_block_k,",
    )


def test_wrong_type_in_uniep_table(train, tmp_path):
    config = edited_config(tmp_path, 'backend = "auto"', "backend = 1")
    assert_stopped_with(train(config=config), "uniep.backend = 1 is not allowed; allowed values: 'auto', 'torch', 'triton'")


def test_bad_uniep_value_on_the_command_line(train):
    assert_stopped_with(train("--uniep.transport", "nccl"), "invalid choice 'nccl' for argument '--uniep.transport'")


def test_ep_degree_must_divide_experts(train):
    assert_stopped_with(
        train("--parallelism.expert_parallel_degree", "3"),
        "parallelism.expert_parallel_degree = 3 must divide the number of experts (64)",
    )


def test_megakernel_transport_needs_gpus_of_one_node(train, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on CI, also on a GPU host
    assert_stopped_with(
        train("--uniep.transport", "megakernel"),
        "uniep.transport = 'megakernel' needs CUDA GPUs (symmetric memory); this machine has none",
    )


def test_ep_degree_must_divide_world_size(train):
    assert_stopped_with(
        train("--parallelism.expert_parallel_degree", "4", world_size=2),
        "parallelism.expert_parallel_degree = 4 must divide the world size (2 processes)",
    )


def test_missing_data_path(train, tmp_path):
    missing = str(tmp_path / "nowhere" / "*.jsonl")
    assert_stopped_with(
        train("--training.dataset", "jsonl", "--training.dataset_path", missing),
        f"training.dataset_path = {missing!r}: no jsonl files there",
    )


def test_missing_tokenizer(train, tmp_path):
    assert_stopped_with(
        train("--model.hf_assets_path", str(tmp_path)),
        f"model.hf_assets_path = {str(tmp_path)!r}: no tokenizer.json",
    )


def test_existing_checkpoint_folder_is_not_written_over(train, tmp_path):
    (tmp_path / "checkpoint" / "step-10").mkdir(parents=True)
    assert_stopped_with(
        train("--job.dump_folder", str(tmp_path), "--checkpoint.enable"),
        "already holds step-10; pass --resume to continue from it, --overwrite-checkpoints to delete it",
    )
    assert (tmp_path / "checkpoint" / "step-10").is_dir()


def test_missing_config_file(train, tmp_path):
    assert_stopped_with(train(config=tmp_path / "none.toml"), "none.toml': no such file")


@pytest.mark.parametrize("config", sorted((ROOT / "train_configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_parse(config):
    """Every shipped TOML parses through TorchTitan with the [uniep] section, names a
    registered model flavor, and its EP degree divides that flavor's experts."""
    from torchtitan.config import ConfigManager
    from torchtitan.protocols.train_spec import get_train_spec

    from recipes import preflight
    from recipes.models import register_all
    from uniep import UniEPConfig

    register_all()
    toml = preflight.check_toml(str(config))
    job = ConfigManager().parse_args(["--job.config_file", str(config)])
    assert job.uniep == UniEPConfig.from_dict(toml["uniep"])
    spec = get_train_spec(job.model.name)
    moe_args = spec.model_args[job.model.flavor].moe_args
    assert moe_args.num_experts % job.parallelism.expert_parallel_degree == 0


def test_megakernel_placement(monkeypatch):
    """The expert-parallel group of the megakernel fits in a node or is whole nodes."""
    import torch

    from recipes.preflight import PreflightError, check_megakernel_placement

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(PreflightError, match="needs CUDA GPUs"):
        check_megakernel_placement(2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    for ep in (2, 4, 8, 16, 32):
        check_megakernel_placement(ep)
    for ep in (3, 6, 12):
        with pytest.raises(PreflightError, match=f"expert_parallel_degree = {ep} must divide or be a multiple of the 8"):
            check_megakernel_placement(ep)
