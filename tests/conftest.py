import importlib.util
import os

import pytest
import torch

# Without a GPU, Triton kernels run in its interpreter; it must be chosen before the
# kernels are defined (at import).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def uniep_cache_dir(tmp_path_factory):
    """Device peaks and tuning choices go to a fresh folder, not the user's cache."""
    path = tmp_path_factory.mktemp("uniep_cache")
    os.environ["UNIEP_CACHE_DIR"] = str(path)
    return path

# The library's tests run without TorchTitan installed; these test the recipes (they
# import TorchTitan) and are then left out.
RECIPE_TESTS = [
    "test_bench_scripts.py", "test_cpu_shims.py", "test_failure_behaviour.py", "test_models.py", "test_moe_load.py",
    "test_moe_parity.py", "test_parity.py", "test_preflight.py", "test_slurm.py", "test_train_cpu.py",
]
if importlib.util.find_spec("torchtitan") is None:
    collect_ignore = RECIPE_TESTS
else:
    from recipes.cpu import apply_cpu_shims

    # TorchTitan's own MoE (the reference) needs the CPU shims to run without CUDA.
    apply_cpu_shims()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def deepseek_runs(tmp_path_factory):
    """Debug DeepSeek-V3 trainings (torchrun, 2 CPU processes, 20 steps) shared by the
    end-to-end and parity tests, as {name: dump folder}:

    - uniep: UniEP layers, EP = 2, checkpoint every 10 steps;
    - resumed: the same job stopped after step 10 (its LR schedule still planned for 20
      steps, like an interrupted job), then resumed with --resume;
    - torchtitan: TorchTitan's own MoE (EP = 1: its EP needs a GPU kernel);
    - perturbed_lr: UniEP with twice the learning rate (a planted difference), and
      ``[uniep] config = "auto"`` (on CPU it resolves the schedule without using it);
    - torchtitan_noise1, torchtitan_noise2: the parity tool's two noise runs of the
      TorchTitan run (``loss_parity.py run --noise-runs 2``: twice the CPU threads, each
      batch as two gradient-accumulation microbatches, the initial weights one ulp away,
      a different sample each; changes of rounding, not math);
    - wrong_scores: UniEP with every router score scaled by 0.98 (``tests.wrong_variant``).
    """
    from recipes.parity_cli import noise_args, tomllib
    from tests.training import ROOT, run_train

    root = tmp_path_factory.mktemp("deepseek_runs")
    config = "deepseek_v3_debug.toml"
    checkpointing = ["--checkpoint.enable", "--checkpoint.interval", "10"]
    noise = ("torchtitan_noise1", "torchtitan_noise2")
    runs = {name: root / name for name in ("uniep", "resumed", "torchtitan", "perturbed_lr", *noise, "wrong_scores")}
    run_train(config, runs["uniep"], *checkpointing)
    run_train(config, runs["resumed"], *checkpointing, "--training.steps", "10", "--lr_scheduler.total_steps", "20")
    run_train(config, runs["resumed"], *checkpointing, "--resume")
    titan = ("--model.name", "titan_deepseek_v3", "--parallelism.expert_parallel_degree", "1")
    run_train(config, runs["torchtitan"], *titan)
    run_train(config, runs["perturbed_lr"], "--optimizer.lr", "1.6e-3", "--uniep.config", "auto")
    with open(ROOT / "train_configs" / config, "rb") as f:
        toml = tomllib.load(f)
    for number, name in enumerate(noise, start=1):
        run_train(config, runs[name], *noise_args(toml, list(titan), number), threads=2)
    run_train(config, runs["wrong_scores"], "--experimental.custom_import", "tests.wrong_variant")
    return runs
