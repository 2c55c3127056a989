"""Checks that run before any process group or model work, each failing with one clear
message that names the setting, its value and what is allowed."""

from __future__ import annotations

import glob
import os
import shutil
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

from recipes import data
from uniep import UniEPConfig, UniEPConfigError
from uniep.paths import ranks_per_node, runs_triton


class PreflightError(ValueError):
    pass


def job_setting(toml: dict, args: list[str], section: str, key: str, default=None):
    """A job setting as TorchTitan will see it: the last ``--section.key value`` (or
    ``=value``, ``-`` for ``_``) on the command line, else the TOML's, else ``default``."""
    value = toml.get(section, {}).get(key, default)
    flags = {f"--{section}.{key}", f"--{section}.{key.replace('_', '-')}"}
    for i, arg in enumerate(args):
        flag, eq, inline = arg.partition("=")
        if flag in flags:
            value = inline if eq else (args[i + 1] if i + 1 < len(args) else value)
    return value


def config_file_from_args(args: list[str]) -> str | None:
    return job_setting({}, args, "job", "config_file")


def overridden_uniep_keys(args: list[str]) -> set[str]:
    """``[uniep]`` keys given on the command line (``--uniep.key value`` or ``=value``)."""
    keys = set()
    for arg in args:
        if arg.startswith("--uniep."):
            keys.add(arg[len("--uniep."):].partition("=")[0].replace("-", "_").removeprefix("no_"))
    return keys


def config_manager(overridden: set[str]):
    """TorchTitan's ConfigManager, except that ``[uniep]`` keys given on the command line
    are left out of the TOML's defaults: TorchTitan builds the TOML's section before it
    applies the command line, so a bad TOML value could not be corrected there."""
    from torchtitan.config import ConfigManager

    class _Manager(ConfigManager):
        def _maybe_load_toml(self, args):
            values = super()._maybe_load_toml(args)
            if values and isinstance(values.get("uniep"), dict):
                values["uniep"] = {k: v for k, v in values["uniep"].items() if k not in overridden}
            return values

    return _Manager()


def check_toml(path: str, overridden: set[str] = frozenset()) -> dict:
    """The TOML must exist and parse, and its ``[uniep]`` table must be valid, except for
    the ``overridden`` keys (the command line replaces them; the merged config is
    checked when it is built)."""
    if not Path(path).is_file():
        raise PreflightError(f"--job.config_file {path!r}: no such file")
    with open(path, "rb") as f:
        try:
            table = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise PreflightError(f"{path}: not valid TOML: {e}") from None
    try:
        UniEPConfig.from_dict({k: v for k, v in (table.get("uniep") or {}).items() if k not in overridden})
    except UniEPConfigError as e:
        raise PreflightError(f"{path}: {e}") from None
    return table


def resolve_embedded_tokenizer(args: list[str], toml: dict) -> list[str]:
    """Replace ``hf_assets_path = "embedded"`` by the shipped folder before TorchTitan
    parses the config (it warns about paths that do not exist)."""
    value = job_setting(toml, args, "model", "hf_assets_path")
    if value == data.EMBEDDED_TOKENIZER:
        return [*args, "--model.hf_assets_path", data.tokenizer_path(value)]
    return args


def check_job(job_config, train_spec, world_size: int) -> None:
    """EP degree, data and tokenizer paths, against the parsed job config."""
    par = job_config.parallelism
    ep = par.expert_parallel_degree
    flavor = job_config.model.flavor
    if flavor not in train_spec.model_args:
        raise PreflightError(
            f"model.flavor = {flavor!r} is not a flavor of {job_config.model.name}; "
            f"allowed: {', '.join(train_spec.model_args)}"
        )
    moe_args = getattr(train_spec.model_args[flavor], "moe_args", None)
    for name in ("steps", "local_batch_size", "seq_len"):
        value = getattr(job_config.training, name)
        if value < 1:
            raise PreflightError(f"training.{name} = {value} must be >= 1")
    check_backend(job_config.uniep.backend)
    if ep < 1:
        raise PreflightError(f"parallelism.expert_parallel_degree = {ep} must be >= 1")
    if ep > 1 and moe_args is not None and moe_args.num_experts % ep != 0:
        raise PreflightError(
            f"parallelism.expert_parallel_degree = {ep} must divide the number of experts "
            f"({moe_args.num_experts}) of {job_config.model.name} flavor {flavor!r}"
        )
    if world_size % ep != 0:
        raise PreflightError(
            f"parallelism.expert_parallel_degree = {ep} must divide the world size ({world_size} processes)"
        )
    if ep > 1 and job_config.uniep.transport == "megakernel":
        check_megakernel_placement(ep)
    dataset = job_config.training.dataset
    path = job_config.training.dataset_path
    if dataset in data.LOCAL_FILE_DATASETS and not (path and glob.glob(path)):
        raise PreflightError(
            f"training.dataset_path = {path!r}: no {dataset} files there "
            f"(dataset {dataset!r} reads local files; give a file, folder glob or pattern)"
        )
    if path and dataset not in data.LOCAL_FILE_DATASETS and "://" not in path and not os.path.exists(path):
        raise PreflightError(f"training.dataset_path = {path!r}: no such file or folder")
    tokenizer = data.tokenizer_path(job_config.model.hf_assets_path)
    if not (Path(tokenizer) / "tokenizer.json").is_file():
        raise PreflightError(
            f"model.hf_assets_path = {job_config.model.hf_assets_path!r}: no tokenizer.json in "
            f"{tokenizer!r} (use {data.EMBEDDED_TOKENIZER!r} for the shipped tokenizer)"
        )


def split_into_microbatches(job_config, microbatches: int, world_size: int) -> None:
    """Each rank's batch as ``microbatches`` gradient-accumulation steps of
    ``local_batch_size / microbatches`` samples: the same samples per optimizer step and,
    since TorchTitan divides every microbatch's summed loss by the step's token count,
    the same step in exact arithmetic; in floating point the GEMM shapes and the
    gradient sums differ by rounding (the parity tool's noise runs use this)."""
    from torchtitan.distributed import ParallelDims

    local = job_config.training.local_batch_size
    if microbatches < 1 or local % microbatches:
        raise PreflightError(
            f"--microbatches = {microbatches} must be >= 1 and divide training.local_batch_size = {local}"
        )
    par = job_config.parallelism
    dims = ParallelDims(dp_replicate=par.data_parallel_replicate_degree, dp_shard=par.data_parallel_shard_degree,
                        cp=par.context_parallel_degree, tp=par.tensor_parallel_degree, pp=par.pipeline_parallel_degree,
                        ep=par.expert_parallel_degree, etp=par.expert_tensor_parallel_degree, world_size=world_size)
    batch_degree = dims.dp_replicate * dims.dp_shard  # TorchTitan's "batch" mesh
    if job_config.training.global_batch_size < 0:
        job_config.training.global_batch_size = local * batch_degree
    job_config.training.local_batch_size = local // microbatches


def check_backend(backend: str) -> None:
    """``backend = 'triton'`` runs on CUDA GPUs (the Triton interpreter stands in on CPU
    test machines)."""
    import torch

    if backend == "triton" and not runs_triton("cuda" if torch.cuda.is_available() else "cpu"):
        raise PreflightError(
            "uniep.backend = 'triton' runs on CUDA GPUs; this machine has none: use uniep.backend = 'auto' or 'torch'"
        )


def check_megakernel_placement(ep: int) -> None:
    """The megakernel reaches its peers through symmetric memory: CUDA GPUs of one node.
    The expert-parallel group (consecutive ranks) must fit in a node or be whole nodes
    (then the hierarchical transport joins the nodes with an all-to-all)."""
    import torch

    if not torch.cuda.is_available():
        raise PreflightError(
            "uniep.transport = 'megakernel' needs CUDA GPUs (symmetric memory); this machine has none: "
            "use uniep.transport = 'all_to_all'"
        )
    per_node = ranks_per_node()
    if per_node % ep and ep % per_node:
        raise PreflightError(
            f"uniep.transport = 'megakernel' needs the expert-parallel group inside one node or made of "
            f"whole nodes: parallelism.expert_parallel_degree = {ep} must divide or be a multiple of the "
            f"{per_node} processes per node (or use uniep.transport = 'all_to_all')"
        )


def _step_number(path: Path) -> int:
    try:
        return int(path.name.removeprefix("step-"))
    except ValueError:
        return -1


def existing_checkpoints(job_config) -> list[Path]:
    """The ``step-N`` folders of the job's checkpoint folder, by step number."""
    folder = Path(job_config.job.dump_folder) / job_config.checkpoint.folder
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.glob("step-*") if _step_number(p) >= 0), key=_step_number)


def complete(step_folder: Path) -> bool:
    """A save finished: DCP writes ``.metadata`` last."""
    return (step_folder / ".metadata").is_file()


def resume_step(job_config) -> int | None:
    """The step a ``--resume`` run continues from (its last complete checkpoint), or None."""
    done = [p for p in existing_checkpoints(job_config) if complete(p)] if job_config.checkpoint.enable else []
    return _step_number(done[-1]) if done else None


def check_checkpoint_folder(job_config, *, resume: bool, overwrite: bool, is_rank0: bool) -> str | None:
    """An existing checkpoint folder is never written over unless asked: ``resume``
    continues from its last complete step, ``overwrite`` deletes it first (rank 0 only,
    before any rank can join the process group). Returns a warning to log, if any.

    Refused: both flags at once; ``resume`` with checkpointing off; ``resume`` where
    step folders exist but none is complete (it would start again from step 1 and
    write over them)."""
    if resume and overwrite:
        raise PreflightError(
            "--resume and --overwrite-checkpoints contradict each other (continue from the checkpoints, or "
            "delete them?); pass one (scripts/slurm/train.sbatch always passes --resume)"
        )
    if resume and not job_config.checkpoint.enable:
        raise PreflightError(
            "--resume needs checkpoint.enable = true (checkpointing is off in this config, so there is nothing "
            "to resume from); add --checkpoint.enable or leave out --resume"
        )
    found = existing_checkpoints(job_config) if job_config.checkpoint.enable else []
    if not found:
        return None
    folder = found[0].parent
    if overwrite:
        if is_rank0:
            shutil.rmtree(folder)
        return f"--overwrite-checkpoints: deleted {folder} ({', '.join(p.name for p in found)})"
    if not resume:
        raise PreflightError(
            f"checkpoint folder {str(folder)!r} already holds {found[-1].name}; pass --resume to "
            "continue from it, --overwrite-checkpoints to delete it, or set a new job.dump_folder"
        )
    done = [p for p in found if complete(p)]
    if not done:
        raise PreflightError(
            f"--resume: no complete checkpoint in {str(folder)!r} ({', '.join(p.name for p in found)} "
            "lack .metadata: a save was interrupted); refusing to start again from step 1 over them. "
            "Move them away, or start over with --overwrite-checkpoints (without --resume)"
        )
    skipped = [p.name for p in found if _step_number(p) > _step_number(done[-1])]
    if skipped:
        return (f"--resume: {', '.join(skipped)} in {folder} is incomplete (no .metadata: a save was "
                f"interrupted); resuming from {done[-1].name}")
    return None
