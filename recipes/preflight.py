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

from uniep import UniEPConfig, UniEPConfigError
from uniep.transport import ranks_per_node

from recipes import data


class PreflightError(ValueError):
    pass


def config_file_from_args(args: list[str]) -> str | None:
    for i, arg in enumerate(args):
        key, _, value = arg.partition("=")
        if key in ("--job.config_file", "--job.config-file"):
            return value or (args[i + 1] if i + 1 < len(args) else None)
    return None


def check_toml(path: str) -> dict:
    """The TOML must exist and parse, and its ``[uniep]`` table must be valid."""
    if not Path(path).is_file():
        raise PreflightError(f"--job.config_file {path!r}: no such file")
    with open(path, "rb") as f:
        try:
            table = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise PreflightError(f"{path}: not valid TOML: {e}") from None
    try:
        UniEPConfig.from_dict(table.get("uniep"))
    except UniEPConfigError as e:
        raise PreflightError(f"{path}: {e}") from None
    return table


def resolve_embedded_tokenizer(args: list[str], toml: dict) -> list[str]:
    """Replace ``hf_assets_path = "embedded"`` by the shipped folder before TorchTitan
    parses the config (it warns about paths that do not exist)."""
    value = toml.get("model", {}).get("hf_assets_path")
    for i, arg in enumerate(args):
        key, _, inline = arg.partition("=")
        if key in ("--model.hf_assets_path", "--model.hf-assets-path"):
            value = inline or (args[i + 1] if i + 1 < len(args) else None)
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


def existing_checkpoints(job_config) -> list[Path]:
    if not job_config.checkpoint.enable:
        return []
    folder = Path(job_config.job.dump_folder) / job_config.checkpoint.folder
    return sorted(folder.glob("step-*")) if folder.is_dir() else []


def check_checkpoint_folder(job_config, *, resume: bool, overwrite: bool, is_rank0: bool) -> None:
    """An existing checkpoint folder is never written over unless asked: ``resume``
    continues from its last step, ``overwrite`` deletes it first (rank 0 only, before
    any rank can join the process group)."""
    found = existing_checkpoints(job_config)
    if not found:
        return
    folder = found[0].parent
    if overwrite:
        if is_rank0:
            shutil.rmtree(folder)
        return
    if not resume:
        raise PreflightError(
            f"checkpoint folder {str(folder)!r} already holds {found[-1].name}; pass --resume to "
            "continue from it, --overwrite-checkpoints to delete it, or set a new job.dump_folder"
        )
