"""Work issued on a second stream of the device, beside the current one.

The layer can run its shared experts' first half there (``UniEPConfig.shared_experts_stream``;
``uniep.shared_experts.shared_hidden``): its GEMMs then overlap the router's and routed
path's launches that leave the tensor cores idle (router, row copy, SwiGLU, combine,
the sums) and the gaps between launches. Autograd runs each backward on the stream its
forward ran on; that half's backward sums onto the input gradient of the router and the
routed experts, so it follows them. Every launch computes what it computes on one
stream (there, though, the shared experts' launches also compute the router's logits,
``UniEPConfig.shared_experts_stream`` says what that changes).

Both strategies have one interface, ``start(fn, x, *args)`` then ``wait(out)``.
"""

from __future__ import annotations

from typing import Callable

import torch


class OneStream:
    """Everything on the current stream."""

    def start(self, fn: Callable[..., torch.Tensor], x: torch.Tensor, *args) -> torch.Tensor:
        return fn(x, *args)

    def wait(self, out: torch.Tensor) -> torch.Tensor:
        return out


class SideStream:
    """``start`` issues ``fn(x, *args)`` on a side stream of ``x``'s device, after the
    work queued so far on the current stream; ``wait(out)`` makes the current stream
    wait for the side stream before it uses ``out``. One side stream per device, made
    at its first use.

    Memory crossing streams is recorded with the caching allocator, so neither stream
    reuses a block the other may still read: ``x`` (also saved for the backward, which
    reads it on the side stream) and ``out``. ``streams`` is the device's stream API
    (``CudaStreams``; the CPU tests pass a recording stand-in)."""

    def __init__(self, streams):
        self._streams = streams
        self._side: dict[torch.device, object] = {}

    def start(self, fn: Callable[..., torch.Tensor], x: torch.Tensor, *args) -> torch.Tensor:
        side = self._side.get(x.device)
        if side is None:
            side = self._side[x.device] = self._streams.Stream(x.device)
        side.wait_stream(self._streams.current_stream(x.device))
        with self._streams.stream(side):
            out = fn(x, *args)
        self._streams.record(x, side)
        return out

    def wait(self, out: torch.Tensor) -> torch.Tensor:
        current = self._streams.current_stream(out.device)
        current.wait_stream(self._side[out.device])
        self._streams.record(out, current)
        return out


class CudaStreams:
    """``torch.cuda``'s stream API, with ``record(tensor, stream)`` (``Tensor.record_stream``)."""

    Stream = staticmethod(torch.cuda.Stream)
    current_stream = staticmethod(torch.cuda.current_stream)
    stream = staticmethod(torch.cuda.stream)

    @staticmethod
    def record(t: torch.Tensor, stream) -> None:
        t.record_stream(stream)


ONE_STREAM = OneStream()
CUDA_SIDE_STREAM = SideStream(CudaStreams)
