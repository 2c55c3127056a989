"""Ranks write their torchrun error file whole or not at all.

TorchTitan's ``Trainer.train`` is decorated with torch elastic's ``@record``: a rank
whose training raises writes the exception to its error file (``open(path, "w")``, then
``json.dump``). When one rank dies (killed, out of memory), its peers raise at once on
the broken collective and start writing, and at the same moment torchrun's agent sends
every surviving rank SIGTERM. A rank killed between the open and the dump leaves an
empty file; the agent then reads it with ``json.load`` and itself dies on a
``JSONDecodeError`` instead of reporting which rank failed and how (seen in CI: the
summary naming ``local_rank: 1`` and ``SIGKILL`` never came).

``write_error_files_whole()`` makes every ``ErrorHandler`` in the process write to a
temporary file beside the error file and rename it into place: the agent finds the
whole report or none (then it reports the rank's exit signal, as for a killed rank).
"""

from __future__ import annotations

import os

from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

_record_exception = ErrorHandler.record_exception  # torch elastic's own writer (its format)


class _ToPath(ErrorHandler):
    """torch elastic's handler, writing to a path of our choice."""

    def __init__(self, path: str):
        self.path = path

    def _get_error_file_path(self) -> str:
        return self.path


def _record_exception_whole(self: ErrorHandler, e: BaseException) -> None:
    path = self._get_error_file_path()
    if not path:
        return _record_exception(self, e)
    partial = f"{path}.{os.getpid()}.partial"
    _record_exception(_ToPath(partial), e)
    os.replace(partial, path)


def write_error_files_whole() -> None:
    """Patch ``ErrorHandler.record_exception`` (class-wide, so the handlers that
    ``@record`` captured at TorchTitan's import are covered too). Idempotent."""
    ErrorHandler.record_exception = _record_exception_whole
