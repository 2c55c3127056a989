"""UniEPConfig: every knob of a UniEP layer, with validation.

A config is built directly, from a dict, or from the ``[uniep]`` table of a TOML job
file. Bad values are rejected before any work starts, with a message that names the
field, the value given and the values allowed.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Literal, Mapping

Backend = Literal["auto", "torch"]
Transport = Literal["all_to_all"]


class UniEPConfigError(ValueError):
    """A UniEP setting is unknown, of the wrong type, or out of range."""


@dataclass(frozen=True)
class UniEPConfig:
    backend: Backend = "auto"
    """Compute path of the expert block. ``torch``: plain-PyTorch reference path
    (deterministic, runs anywhere). ``auto``: the fastest path available on the device
    (today: ``torch`` everywhere)."""

    transport: Transport = "all_to_all"
    """How rows move between expert-parallel ranks. ``all_to_all``: torch.distributed
    all-to-all of rows in plan order (NCCL on GPU, gloo on CPU). Ignored when the
    expert-parallel degree is 1."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            _check_value(f.name, getattr(self, f.name), hints[f.name])

    @classmethod
    def from_dict(cls, table: Mapping[str, Any] | None, *, where: str = "uniep") -> "UniEPConfig":
        """Build from a dict (e.g. a TOML ``[uniep]`` table). ``where`` prefixes field
        names in error messages."""
        table = dict(table or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(table) - known)
        if unknown:
            raise UniEPConfigError(
                f"unknown key {where}.{unknown[0]} = {table[unknown[0]]!r}; "
                f"allowed keys in [{where}]: {', '.join(sorted(known))}"
            )
        try:
            return cls(**table)
        except UniEPConfigError as e:
            raise UniEPConfigError(f"{where}.{e}") from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def resolved_backend(self, device_type: str) -> str:
        """The compute path used on ``device_type`` ("cpu", "cuda", ...)."""
        return "torch" if self.backend == "auto" else self.backend


def _check_value(name: str, value: Any, hint: Any) -> None:
    if typing.get_origin(hint) is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise UniEPConfigError(
                f"{name} = {value!r} is not allowed; allowed values: "
                + ", ".join(repr(a) for a in allowed)
            )
        return
    # bool is an int subclass: reject True where a number is expected and vice versa.
    if hint is bool and not isinstance(value, bool):
        raise UniEPConfigError(f"{name} = {value!r} must be a bool (true/false)")
    if hint is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise UniEPConfigError(f"{name} = {value!r} must be an integer")
