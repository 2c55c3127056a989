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
        "unknown key uniep.megakernels = True; allowed keys in [uniep]: backend, config, descriptor_loads, descriptor_stores,",
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


@pytest.mark.parametrize("flag, value", [("steps", "0"), ("steps", "-5"), ("local_batch_size", "0"),
                                         ("local_batch_size", "-1"), ("seq_len", "0")])
def test_sizes_must_be_positive(train, flag, value):
    assert_stopped_with(train(f"--training.{flag}", value), f"training.{flag} = {value} must be >= 1")


def test_triton_backend_needs_gpus(train, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert_stopped_with(train("--uniep.backend", "triton"), "uniep.backend = 'triton' runs on CUDA GPUs")


def test_a_bad_toml_value_can_be_corrected_on_the_command_line(tmp_path, monkeypatch, capsys):
    config = edited_config(tmp_path, 'backend = "auto"', 'backend = "cuda"')
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.chdir(ROOT)
    main(["--check-only", "--job.config_file", str(config), "--uniep.backend", "torch"])
    assert "configuration OK" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # the control: without the override it is refused
        main(["--check-only", "--job.config_file", str(config)])
    assert "uniep.backend = 'cuda' is not allowed" in capsys.readouterr().err


def test_resume_and_overwrite_contradict(train, tmp_path):
    (tmp_path / "checkpoint" / "step-2").mkdir(parents=True)
    assert_stopped_with(
        train("--job.dump_folder", str(tmp_path), "--checkpoint.enable", "--resume", "--overwrite-checkpoints"),
        "--resume and --overwrite-checkpoints contradict each other",
    )
    assert (tmp_path / "checkpoint" / "step-2").is_dir()  # nothing deleted


def test_resume_needs_checkpointing(train, tmp_path):
    assert_stopped_with(train("--job.dump_folder", str(tmp_path), "--resume"),
                        "--resume needs checkpoint.enable = true")


def test_resume_refuses_when_no_step_is_complete(train, tmp_path):
    step = tmp_path / "checkpoint" / "step-2"
    step.mkdir(parents=True)
    (step / "__0_0.distcp").write_bytes(b"shard")  # a save that died before .metadata
    assert_stopped_with(
        train("--job.dump_folder", str(tmp_path), "--checkpoint.enable", "--resume"),
        "--resume: no complete checkpoint in",
    )
    assert (step / "__0_0.distcp").read_bytes() == b"shard"


def test_refusal_names_the_last_step_by_number(train, tmp_path):
    for n in (5, 10):
        (tmp_path / "checkpoint" / f"step-{n}").mkdir(parents=True)
    assert_stopped_with(train("--job.dump_folder", str(tmp_path), "--checkpoint.enable"), "already holds step-10;")


def test_resume_warns_about_an_incomplete_last_step(tmp_path):
    from types import SimpleNamespace

    from recipes.preflight import check_checkpoint_folder, resume_step

    for n, done in ((5, True), (10, False)):
        (tmp_path / "checkpoint" / f"step-{n}").mkdir(parents=True)
        if done:
            (tmp_path / "checkpoint" / f"step-{n}" / ".metadata").write_bytes(b"")
    job = SimpleNamespace(job=SimpleNamespace(dump_folder=str(tmp_path)),
                          checkpoint=SimpleNamespace(enable=True, folder="checkpoint"))
    warning = check_checkpoint_folder(job, resume=True, overwrite=False, is_rank0=True)
    assert "step-10" in warning and "incomplete" in warning and "resuming from step-5" in warning
    assert resume_step(job) == 5


def test_a_config_error_is_one_message_before_torchrun(tmp_path):
    """run_train.sh checks the config once, before torchrun: one line, exit 2, no
    per-rank tracebacks or torchrun failure banner."""
    import subprocess

    result = subprocess.run(
        [str(ROOT / "scripts" / "run_train.sh"), str(CONFIG), "--training.steps", "0"],
        env={**__import__("os").environ, "NPROC": "2"}, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "configuration error" in line]
    assert errors == ["uniep: configuration error: training.steps = 0 must be >= 1"], result.stderr[-2000:]
    assert "ChildFailedError" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("n", ["3", "0"])
def test_microbatches_must_divide_the_local_batch(train, n):
    assert_stopped_with(train("--check-only", "--microbatches", n),
                        f"--microbatches = {n} must be >= 1 and divide training.local_batch_size = 2")


def test_perturb_weights_takes_a_noise_run_number(train):
    assert_stopped_with(train("--check-only", "--perturb-weights", "-1"),
                        "--perturb-weights = -1 must be >= 1 (the noise run's number), or 0 for none")


def test_two_microbatches_keep_the_samples_per_step():
    """Two gradient-accumulation steps of half the batch: the same global batch (2 per
    rank x 2 data-parallel ranks), and the same when it was given."""
    from recipes import preflight

    job = preflight.config_manager(set()).parse_args(["--job.config_file", str(CONFIG)])
    preflight.split_into_microbatches(job, 2, world_size=2)
    assert (job.training.local_batch_size, job.training.global_batch_size) == (1, 4)
    job = preflight.config_manager(set()).parse_args(["--job.config_file", str(CONFIG), "--training.global_batch_size", "8"])
    preflight.split_into_microbatches(job, 2, world_size=2)
    assert (job.training.local_batch_size, job.training.global_batch_size) == (1, 8)
