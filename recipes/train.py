"""Training entry point: ``python -m recipes.train --job.config_file X.toml [overrides]``.

Run it under torchrun (``scripts/run_train.sh`` does). On top of TorchTitan's own flags
it takes ``--resume`` (continue from an existing checkpoint folder) and
``--overwrite-checkpoints`` (delete it first); without either, an existing checkpoint
folder stops the run before it starts. ``--microbatches N`` splits each rank's batch
into N gradient-accumulation steps (the same step in exact arithmetic, other rounding:
the parity tool's noise runs). ``--perturb-weights N`` moves every initial weight one
unit in the last place, up or down by a hash of its bits and ``N`` (``recipes.perturb``:
the noise runs' perturbation of a run's rounding), after any seed checkpoint is loaded
and never on a resumed run. ``--check-only`` runs the checks alone, in one
process, and exits (0, or 2 with the error): ``scripts/run_train.sh`` calls it before
torchrun starts, so a bad config gives one message, not one per rank.
"""

from __future__ import annotations

import argparse
import os
import sys

from recipes.cpu import apply_cpu_shims

CONFIG_ERROR = 2
"""Exit status of a configuration error (caught before any process group starts)."""


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--overwrite-checkpoints", action="store_true")
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--perturb-weights", type=int, default=0)
    ours, titan_args = parser.parse_known_args(argv)

    apply_cpu_shims()
    from torchtitan.protocols.train_spec import get_train_spec
    from torchtitan.tools.logging import init_logger, logger
    from torchtitan.train import Trainer

    from recipes import preflight
    from recipes.error_file import write_error_files_whole
    from recipes.loss_log import start_loss_log
    from recipes.models import register_all

    init_logger()
    register_all()
    rank0 = int(os.environ.get("RANK", "0")) == 0 and not ours.check_only
    try:
        config_file = preflight.config_file_from_args(titan_args)
        overridden = preflight.overridden_uniep_keys(titan_args)
        toml = preflight.check_toml(config_file, overridden) if config_file is not None else {}
        titan_args = preflight.resolve_embedded_tokenizer(titan_args, toml)
        job_config = preflight.config_manager(overridden).parse_args(titan_args)
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        preflight.check_job(job_config, get_train_spec(job_config.model.name), world_size)
        if ours.microbatches != 1:
            preflight.split_into_microbatches(job_config, ours.microbatches, world_size)
        if ours.perturb_weights < 0:
            raise ValueError(f"--perturb-weights = {ours.perturb_weights} must be >= 1 (the noise run's number), "
                             "or 0 for none")
        warning = preflight.check_checkpoint_folder(
            job_config, resume=ours.resume, overwrite=ours.overwrite_checkpoints, is_rank0=rank0,
        )
    except ValueError as e:
        print(f"uniep: configuration error: {e}", file=sys.stderr)
        sys.exit(CONFIG_ERROR)
    if ours.check_only:
        print(f"uniep: configuration OK ({config_file})")
        return
    if warning:
        logger.warning(warning)
    if rank0:
        moved = start_loss_log(job_config.job.dump_folder, preflight.resume_step(job_config) if ours.resume else None)
        if moved:
            logger.warning(moved)

    import torch

    write_error_files_whole()  # a peer's failure must reach torchrun's summary (recipes.error_file)
    trainer = None
    try:
        trainer = Trainer(job_config)
        if ours.perturb_weights:
            perturb_after_load(trainer, ours.perturb_weights, logger)
        trainer.train()
        # TorchTitan's rank 0 sleeps after the last step while the others go on to tear
        # down the process group; gloo then aborted a rank in CI. Leave together.
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
    finally:
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    logger.info("Process group destroyed")


def perturb_after_load(trainer, seed: int, logger) -> None:
    """Perturb the weights right after ``trainer.train()`` loads its checkpoint (a seed
    checkpoint's weights, or none), unless that load resumed a run."""
    from recipes.perturb import perturb_model_

    load = trainer.checkpointer.load

    def load_then_perturb(*args, **kwargs):
        loaded = load(*args, **kwargs)
        if trainer.step == 0:
            moved = perturb_model_(trainer.model_parts, seed)
            logger.info(f"--perturb-weights {seed}: {moved} weights on this rank moved one ulp")
        else:
            logger.warning(f"--perturb-weights {seed}: resumed at step {trainer.step}; weights left as loaded")
        return loaded

    trainer.checkpointer.load = load_then_perturb


if __name__ == "__main__":
    main()
