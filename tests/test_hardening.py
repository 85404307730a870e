"""Production hardening on CPU processes: device errors are sticky and loud (every later call, hook and event
wait raises; ``clean_low_latency_buffer`` recovers low-latency state), calls of one Buffer are ordered across
streams, compilation stays out of the device timeouts, storage is sized by what calls need and reported, and
arguments DeepEP gives meaning to are implemented or rejected. The one-sided transport's side of the same
guarantees is in test_nvlink_interpreter.py and test_low_latency_interpreter.py (missing peers), the GPU side in
tests/gpu/test_hardening_gpu.py."""

import pytest
import torch

from epcomm.testing import spawn


def _raises(call) -> str:
    """The message of the EpcommError ``call()`` raises ("no exception" if none)."""
    from epcomm.errors import EpcommError

    try:
        call()
    except EpcommError as exc:
        return str(exc)
    return "no exception"


def _sticky_portable(ctx):
    """The portable transport: rows that overflow their slots (low latency: each token selecting one expert twice;
    normal: ``num_worst_tokens`` too small) are recorded on the device; the failing call (on CPUs; on GPUs at the
    latest the next interaction) and every later call, hook and event wait raise, naming the rank. Low-latency
    failures are reset by ``clean_low_latency_buffer`` on every rank, normal-mode ones stay until the Buffer is
    destroyed. Returns {step: message or problem list}."""
    from epcomm.buffer import Buffer
    from epcomm.testing.checks import LowLatencyCase, NormalCase, check_low_latency, check_normal

    rank, world = ctx.rank, ctx.world_size
    out = {}
    buf = Buffer(ctx.group, transport="alltoall")
    x = torch.randn(4, 128).to(torch.bfloat16)
    good_idx = torch.arange(4).remainder(world).unsqueeze(1)  # one expert per rank, top-1
    twice = torch.full((4, 2), (rank + 1) % world, dtype=torch.int64)  # a peer's expert, twice per token
    event = buf.get_dispatch_layout(good_idx, world)[4]
    _, _, _, _, hook = buf.low_latency_dispatch(x, good_idx, 4, world, return_recv_hook=True)
    out["overflowing call"] = _raises(lambda: buf.low_latency_dispatch(x, twice, 4, world))
    out["pending hook"] = _raises(hook)
    out["event wait"] = _raises(event.current_stream_wait)
    out["normal call"] = _raises(lambda: buf.get_dispatch_layout(good_idx, world))
    out["check_errors"] = [_raises(buf.check_errors), _raises(buf.check_errors)]
    buf.clean_low_latency_buffer(4, 128, world)
    cases = [LowLatencyCase(num_tokens=(3, 4), max_tokens=4, hidden=128, num_experts=2 * world, topk=2, seed=5),
             NormalCase(num_tokens=(5, 0), hidden=64, num_experts=2 * world, topk=2, worst=True, seed=6)]
    out["after clean"] = [f for c in cases for f in
                          (check_low_latency if isinstance(c, LowLatencyCase) else check_normal)(ctx, buf, c).failures]
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(good_idx, world)
    out["too few worst tokens"] = _raises(lambda: buf.dispatch(x, num_tokens_per_rank=per_rank,
                                                               is_token_in_rank=in_rank, num_worst_tokens=1))
    buf.clean_low_latency_buffer(4, 128, world)  # resets low-latency state only
    out["normal error after clean"] = _raises(lambda: buf.low_latency_dispatch(x, good_idx, 4, world))
    out["destroy"] = _raises(buf.destroy)  # already raised: destroy does not raise it again
    return out


def test_device_errors_are_sticky_and_loud():
    results = spawn(_sticky_portable, 2, device="cpu")
    for rank, out in enumerate(results):
        ll = f"rank {rank}: 4 low-latency rows did not fit their slots"
        assert out["overflowing call"].startswith("Buffer.low_latency_dispatch: a call failed on the device (" + ll)
        assert "clean_low_latency_buffer() on every rank" in out["overflowing call"]
        for step, fn in (("pending hook", "Buffer.low_latency_dispatch hook"),
                         ("event wait", "EventOverlap.current_stream_wait"), ("normal call", "Buffer.get_dispatch_layout")):
            assert out[step].startswith(f"{fn}: a call failed on the device ({ll}"), (step, out[step])
        assert all(m.startswith("Buffer.check_errors: a call failed") and ll in m for m in out["check_errors"])
        assert out["after clean"] == [], out["after clean"]
        worst = f"rank {rank}: 3 received rows did not fit num_worst_tokens"
        assert out["too few worst tokens"].startswith(f"Buffer.dispatch: a call failed on the device ({worst}")
        assert "destroy the Buffer on every rank" in out["too few worst tokens"]
        assert out["normal error after clean"].startswith("Buffer.low_latency_dispatch: a call failed") and \
            worst in out["normal error after clean"]
        assert out["destroy"] == "no exception"


class _FakeStream:
    def __init__(self, handle: int, capturing: bool = False) -> None:
        self.cuda_stream, self.capturing, self.waited = handle, capturing, []

    def wait_stream(self, other) -> None:
        self.waited.append(other.cuda_stream)


def test_stream_order_waits_for_the_previous_calls_stream(monkeypatch):
    """A call on another stream than the Buffer's previous call waits for that stream; never across a capture."""
    from epcomm.buffer import events

    monkeypatch.setattr(events, "_capturing", lambda stream: stream.capturing)
    order = events.StreamOrder()
    compute, comm, other, graph = _FakeStream(1), _FakeStream(2), _FakeStream(3), _FakeStream(4, capturing=True)
    for stream in (compute, compute, comm, comm, compute, other, graph):
        order.enter(stream)
    assert compute.waited == [2] and comm.waited == [1] and other.waited == [1], (compute.waited, comm.waited)
    assert graph.waited == []  # the first captured call does not wait for an eager stream
    graph2 = _FakeStream(5, capturing=True)
    order.enter(graph2)
    assert graph2.waited == [4]  # within one capture the streams are ordered
    order.enter(compute)
    assert compute.waited == [2]  # an eager call while the capture goes on cannot wait for it
    graph2.capturing = False  # the capture ended
    order.enter(graph2)
    order.enter(compute)
    assert graph2.waited == [4, 1] and compute.waited == [2, 5]
