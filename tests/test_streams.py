"""The shared experts on a side stream (``uniep.streams``, a CUDA branch): here with a
stand-in stream API that logs what the layer asks of it, in the Triton interpreter.
The layer must fork the side stream after the current stream's work, run the shared
experts' first half inside it, record the memory that crosses streams, run the
router and routed experts meanwhile (computing the router's logits itself), and wait
for the side stream before the sum; the bits stay those of one stream where the router
computes its logits too."""

import pytest
import torch

from uniep import UniEPConfig, UniEPMoE
from uniep.shared_experts import MODULE_SHARED_EXPERTS, FusedSharedExperts
from uniep.streams import CUDA_SIDE_STREAM, ONE_STREAM, SideStream

# What a correct forward asks of the stream API, in order (names of _Streams's log).
EXPECTED = ["side waits current", "enter side", "shared experts", "exit side", "record x on side",
            "routed experts", "current waits side", "record out on current"]


class _Stream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits {other.name}")


class _Streams:
    """A stream API (``uniep.streams.CudaStreams``'s interface) that only logs."""

    def __init__(self, log):
        self.log = log
        self.current = _Stream("current", log)
        self.inside = self.current

    def Stream(self, device):
        return _Stream("side", self.log)

    def current_stream(self, device):
        return self.inside

    def stream(self, s):
        streams = self

        class _Context:
            def __enter__(self):
                streams.log.append(f"enter {s.name}")
                streams.inside = s

            def __exit__(self, *exc):
                streams.log.append(f"exit {s.name}")
                streams.inside = streams.current

        return _Context()

    def record(self, t, s):
        self.log.append(f"record {'x' if t.data_ptr() == self.x_ptr else 'out'} on {s.name}")


class _NoWait(SideStream):
    """Deliberately wrong: the sum does not wait for the side stream."""

    def wait(self, out):
        return out


def _layer():
    torch.manual_seed(0)
    layer = UniEPMoE(24, 16, 4, 2, num_shared_experts=2, config=UniEPConfig(backend="triton"))
    layer.init_weights(0.05)
    return layer


def _logged_call(monkeypatch, layer, streams_class, x, grad):
    import uniep.shared_experts as shared_experts

    log = []
    streams = _Streams(log)
    layer._shared = FusedSharedExperts(streams_class(streams), router_logits=False)
    shared, routed = shared_experts.shared_hidden, layer.experts.forward
    monkeypatch.setattr(shared_experts, "shared_hidden", lambda *a: log.append("shared experts") or shared(*a))
    monkeypatch.setattr(layer.experts, "forward", lambda *a: log.append("routed experts") or routed(*a))
    xi = x.clone().requires_grad_(True)
    streams.x_ptr = xi.data_ptr()
    return log, _fwd_bwd(layer, xi, grad)


def _fwd_bwd(layer, xi, grad):
    """Output, input gradient and parameter gradients of one forward+backward on ``xi``."""
    layer.zero_grad(set_to_none=True)
    out = layer(xi)
    out.backward(grad)
    return [out.detach(), xi.grad] + [p.grad.clone() for _, p in sorted(layer.named_parameters())]


@pytest.mark.parametrize("streams_class, right", [(SideStream, True), (_NoWait, False)])
def test_the_layer_overlaps_its_shared_experts_on_a_side_stream(monkeypatch, streams_class, right):
    layer = _layer()
    x, grad = torch.randn(2, 9, 24), torch.randn(2, 9, 24)
    layer._shared = FusedSharedExperts(ONE_STREAM, router_logits=False)  # as on the side stream
    one_stream = _fwd_bwd(layer, x.clone().requires_grad_(True), grad)

    log, side = _logged_call(monkeypatch, layer, streams_class, x, grad)
    assert (log == EXPECTED) == right, log
    assert all(torch.equal(a, b) for a, b in zip(one_stream, side))


def test_the_side_stream_is_chosen_on_cuda_only(monkeypatch):
    """The config's switch takes effect where the experts run on Triton on CUDA; on the
    CPU (even on Triton's interpreter) and on the PyTorch backend everything stays on one stream."""
    for backend, device, chosen in (("triton", "cuda", CUDA_SIDE_STREAM), ("triton", "cpu", ONE_STREAM),
                                    ("torch", "cuda", ONE_STREAM)):
        monkeypatch.setattr(UniEPMoE, "_device_type", lambda self, device=device: device)
        layer = UniEPMoE(24, 16, 4, 2, num_shared_experts=1,
                         config=UniEPConfig(backend=backend, shared_experts_stream=True))
        streams = getattr(layer._shared, "streams", ONE_STREAM)
        assert streams is chosen, (backend, device)
        assert (layer._shared is MODULE_SHARED_EXPERTS) == (backend == "torch"), backend
        assert getattr(layer._shared, "router_logits", False) == (backend == "triton" and device == "cpu")
        layer.config = UniEPConfig(backend=backend)
        assert getattr(layer._shared, "streams", ONE_STREAM) is ONE_STREAM
        assert getattr(layer._shared, "router_logits", False) == (backend == "triton")
