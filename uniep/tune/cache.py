"""On-disk cache of measured schedule choices.

One JSON file (``<cache dir>/tune-cache.json``) maps a key — device name, expert-parallel
degree, layer shape and 4096-token bucket — to the knobs measured fastest there, with
the measured and predicted times. Entries of another device, EP degree, shape or bucket
are never used. The cache dir is ``$UNIEP_CACHE_DIR`` or ``~/.cache/uniep``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

TOKEN_BUCKET = 4096


def cache_dir() -> Path:
    return Path(os.environ.get("UNIEP_CACHE_DIR") or Path.home() / ".cache" / "uniep")


def token_bucket(tokens: int) -> int:
    """Tokens rounded up to a multiple of 4096 (at least 4096)."""
    return max(1, -(-tokens // TOKEN_BUCKET)) * TOKEN_BUCKET


@dataclass(frozen=True)
class MoEShape:
    dim: int
    hidden: int
    experts: int
    top_k: int

    def key(self) -> str:
        return f"D{self.dim}-H{self.hidden}-E{self.experts}-K{self.top_k}"


def entry_key(device_name: str, ep_size: int, shape: MoEShape, tokens: int) -> str:
    return f"{device_name}|ep{ep_size}|{shape.key()}|T{token_bucket(tokens)}"


class TuneCache:
    def __init__(self, path: Path | None = None):
        self.path = path or cache_dir() / "tune-cache.json"

    def _read(self) -> dict:
        return json.loads(self.path.read_text()) if self.path.is_file() else {}

    def lookup(self, device_name: str, ep_size: int, shape: MoEShape, tokens: int) -> dict | None:
        """The cached entry (``{"knobs", "measured_ms", "predicted_ms"}``) or None."""
        return self._read().get(entry_key(device_name, ep_size, shape, tokens))

    def store(self, device_name: str, ep_size: int, shape: MoEShape, tokens: int, entry: dict) -> None:
        table = self._read()
        table[entry_key(device_name, ep_size, shape, tokens)] = entry
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
        tmp.replace(self.path)  # atomic: concurrent readers never see half a file
