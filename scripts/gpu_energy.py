"""The GPU's energy counter, and a layer timed while the GPU runs at its power limit.

An H200 draws up to its enforced power limit (700 W on ours); a GEMM-heavy layer called
back to back reaches it within a second, and the SM clock then drops (1980 MHz to
1140-1500 MHz, seen with ``nvidia-smi``), more for the layer that draws more power. A
run of a dozen calls after an idle moment (``back_to_back_cuda_ms``) is timed mostly at
the full clock; training runs for hours at the limit, where the time a call takes is
about the energy it needs divided by the limit. ``sustained`` times that regime and
reads the energy it took.

The counter is NVML's total energy (millijoules since the driver loaded), read through
the driver's own library with ``ctypes`` (no Python package needed); where that library
or the counter is missing, ``EnergyMeter.open`` returns None and only time is measured.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from typing import Callable

NVML_LIBRARY = "libnvidia-ml.so.1"
NVML_CLOCK_SM = 1


class EnergyMeter:
    """One GPU's NVML energy counter, power limit and SM clock."""

    def __init__(self, nvml, handle) -> None:
        self._nvml, self._handle = nvml, handle

    @classmethod
    def open(cls, index: int = 0, library: str = NVML_LIBRARY) -> "EnergyMeter | None":
        """The meter of GPU ``index`` (NVML's numbering), or None where NVML or its
        energy counter is not available."""
        try:
            nvml = ctypes.CDLL(library)
        except OSError:
            return None
        handle = ctypes.c_void_p()
        if nvml.nvmlInit_v2() != 0 or nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
            return None
        meter = cls(nvml, handle)
        return meter if meter.millijoules() is not None else None

    def millijoules(self) -> int | None:
        """Energy since the driver loaded, mJ (None if the counter cannot be read)."""
        value = ctypes.c_ulonglong()
        if self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle, ctypes.byref(value)) != 0:
            return None
        return value.value

    def power_limit_watts(self) -> float | None:
        value = ctypes.c_uint()
        if self._nvml.nvmlDeviceGetEnforcedPowerLimit(self._handle, ctypes.byref(value)) != 0:
            return None
        return value.value / 1000

    def sm_clock_mhz(self) -> int | None:
        value = ctypes.c_uint()
        if self._nvml.nvmlDeviceGetClockInfo(self._handle, NVML_CLOCK_SM, ctypes.byref(value)) != 0:
            return None
        return value.value


@dataclass
class Sustained:
    ms_per_call: float
    joules_per_call: float | None
    """None without a meter."""
    min_sm_clock_mhz: int | None
    """The lowest SM clock read during the timed calls (about one read per 50 ms)."""

    @property
    def watts(self) -> float | None:
        return None if self.joules_per_call is None else self.joules_per_call / self.ms_per_call * 1e3


def sustained(step: Callable[[], None], seconds: float, meter: EnergyMeter | None,
              synchronize: Callable[[], None], heat_seconds: float = 1.0) -> Sustained:
    """``step()`` called back to back for ``heat_seconds`` (untimed: the GPU reaches its
    power limit), then for about ``seconds`` more, timed with the host's clock between two
    synchronizations, and the energy the counter saw in that time."""
    if seconds <= 0 or heat_seconds < 0:
        raise ValueError(f"sustained: seconds = {seconds} must be > 0 and heat_seconds = {heat_seconds} >= 0")
    synchronize()
    t0 = time.perf_counter()
    calls = 0
    while calls < 1 or time.perf_counter() - t0 < heat_seconds:
        step()
        calls += 1
        if calls % 4 == 0:
            synchronize()  # the host must not queue the heating calls far ahead
    synchronize()
    per_call = (time.perf_counter() - t0) / calls
    calls = max(3, round(seconds / per_call))
    clock_every = max(1, round(0.05 / per_call))
    clocks = []
    start_mj = None if meter is None else meter.millijoules()
    t0 = time.perf_counter()
    for i in range(calls):
        step()
        if meter is not None and i % clock_every == 0:
            clocks.append(meter.sm_clock_mhz())
    synchronize()
    elapsed = time.perf_counter() - t0
    end_mj = None if meter is None else meter.millijoules()
    joules = None if start_mj is None or end_mj is None else (end_mj - start_mj) / 1e3 / calls
    clocks = [c for c in clocks if c is not None]
    return Sustained(elapsed * 1e3 / calls, joules, min(clocks) if clocks else None)
