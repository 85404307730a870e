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
    out["memory after destroy"] = buf.memory_usage["total"]
    out.update(_arguments(ctx))
    return out


def _arguments(ctx) -> dict:
    """DeepEP's arguments that epcomm implements or rejects, and the memory report of the portable transport."""
    import gc
    import logging

    from epcomm.buffer import Buffer

    out = {}
    try:
        Buffer(ctx.group, low_latency_mode=True)
        out["low_latency_mode without storage"] = "no exception"
    except ValueError as exc:
        out["low_latency_mode without storage"] = str(exc)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("epcomm").addHandler(handler)
    kept = Buffer(ctx.group, explicitly_destroy=True)
    kept.destroy()
    del kept
    forgotten = Buffer(ctx.group, explicitly_destroy=True)
    del forgotten
    gc.collect()
    logging.getLogger("epcomm").removeHandler(handler)
    out["explicitly_destroy"] = [r.getMessage() for r in records]
    buf = Buffer(ctx.group)
    before = buf.memory_usage
    x = torch.randn(3, 128).to(torch.bfloat16)
    idx = torch.tensor([[0, 1]] * 3) % (2 * ctx.world_size)
    _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, 4, 2 * ctx.world_size)
    buf.get_next_low_latency_combine_buffer(handle)
    out["memory"] = (before, buf.memory_usage)
    buf.destroy()
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
        assert out["destroy"] == "no exception" and out["memory after destroy"] == 0
        assert out["low_latency_mode without storage"].startswith("Buffer: low_latency_mode=True needs "
                                                                   "num_rdma_bytes > 0")
        assert len(out["explicitly_destroy"]) == 1 and "explicitly_destroy=True and collected without destroy()" \
            in out["explicitly_destroy"][0], out["explicitly_destroy"]
        before, after = out["memory"]
        assert before == dict(normal_symmetric=0, low_latency_symmetric=0, low_latency_zero_copy=0, pinned_host=0,
                              total=0), before
        zero_copy = 2 * 4 * 2 * 128 * 2  # [E_local, R * T, H] bf16
        assert after["low_latency_zero_copy"] == zero_copy and after["total"] == zero_copy, after


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
    order.enter(comm, waited=compute)  # the communication stream has just waited for the current one
    assert comm.waited == [1], comm.waited


# ---------------------------------------------------------------------------------------------------------
# compilation out of the timeout (one-sided transport under the Triton interpreter)
# ---------------------------------------------------------------------------------------------------------
_WAITING_KERNELS = ("exchange_kernel", "dispatch_kernel", "_barrier_kernel", "combine_push_kernel",
                    "ll_dispatch_kernel", "ll_combine_kernel")


def _one_sided(ctx):
    """The one-sided transport under the interpreter. Records, per rank, when each kernel variant (the kernel and
    its constexprs, as on a GPU) is first met (compiled without running, or at a launch) and when the rank meets
    the others at a host barrier.

    Phase 1 (``num_nvl_bytes=0``, no warm-up): no normal-mode storage until the first dispatch, which sizes it
    for what it can need (not 1 GiB); the first call of each kind compiles its waiting kernels and passes a
    barrier before any of them runs (compile time differs between ranks and must not count against the device
    timeout; on main they compiled inside their launches).
    Phase 2 (low latency, another shape, after Buffer.warmup): no call meets a new variant, the storage does not
    grow, and a zero-copy combine reads the buffer it handed out in place. Phase 3: a larger shape grows the
    storage (its first call: the documented point); the next call of the warmed-up shape compiles again (the
    kernels' offsets moved) before the ranks meet, not inside its launches.
    Returns (failures, {phase: events or facts})."""
    import torch.distributed as dist
    from triton.runtime.interpreter import InterpretedFunction

    from epcomm.buffer import Buffer
    from epcomm.testing.checks import LowLatencyCase, check_low_latency
    from epcomm.testing.routing import make_inputs
    from epcomm.transports.nvlink import NVLinkTransport

    seen, events = set(), []
    run, barrier = InterpretedFunction.run, dist.barrier

    def logged_run(self, *args, grid, warmup, **kwargs):
        key = (self.fn.__name__, repr(sorted(kwargs.items())))
        if key not in seen:
            seen.add(key)
            events.append(("compile" if warmup else "launch", key[0]))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    def logged_barrier(*args, **kwargs):
        events.append(("barrier", ""))
        return barrier(*args, **kwargs)

    def ll_case(hidden, max_tokens, zero_copy=False):
        case = LowLatencyCase(num_tokens=(max_tokens, 1), max_tokens=max_tokens, hidden=hidden, num_experts=4,
                              topk=2, use_fp8=False, zero_copy=zero_copy, seed=hidden + max_tokens)
        failures.extend(check_low_latency(ctx, buf, case).failures)

    InterpretedFunction.run, dist.barrier = logged_run, logged_barrier
    failures, out = [], {}
    try:
        buf = Buffer(ctx.group, transport=NVLinkTransport)
        out["memory at construction"] = buf.memory_usage["normal_symmetric"]
        mine = make_inputs(3, 2, (6, 3), 128, 4, 2, "uniform", torch.bfloat16)[ctx.rank]
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(mine.topk_idx, 4)
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(
            mine.x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=mine.topk_idx, topk_weights=mine.topk_weights)
        buf.dispatch(mine.x, handle=handle)
        buf.combine(recv_x, handle, topk_weights=recv_w)
        ll_case(128, 6)
        buf.check_errors()
        out["memory sized by the first dispatch"] = buf.memory_usage["normal_symmetric"]
        out["phase 1"] = list(events)
        buf.destroy()

        buf = Buffer(ctx.group, transport=NVLinkTransport, num_nvl_bytes=1 << 20)
        buf.warmup(256, 4, 2, num_max_dispatch_tokens_per_rank=6, use_fp8=(False,))
        warmed = buf.memory_usage["low_latency_symmetric"]
        events.clear()
        launched = []
        ll_run = buf.runtime._ll._run
        buf.runtime._ll._run = lambda launch, args, *rest: launched.append(args[0].data_ptr()) or ll_run(
            launch, args, *rest)
        ll_case(256, 6, zero_copy=True)
        buf.check_errors()
        zero_copy = {t.data_ptr() for t in buf.runtime._ll._zero_copy.values()}
        out["phase 2"] = (sorted({n for kind, n in events if kind == "launch"}),
                          buf.memory_usage["low_latency_symmetric"] - warmed, launched[-1] in zero_copy)
        ll_case(256, 12)
        events.clear()
        ll_case(256, 6)
        buf.check_errors()
        out["phase 3"] = (list(events), buf.memory_usage["low_latency_symmetric"] > warmed)
        buf.destroy()
    finally:
        InterpretedFunction.run, dist.barrier = run, barrier
    return failures, out


def _compiled_before_the_ranks_met(events, kernels) -> list:
    """The waiting kernels in ``kernels`` whose first variant was met at a launch, or not followed by a barrier
    before its first launch (empty: every one compiled, then the ranks met, then it ran)."""
    bad = []
    for name in kernels:
        first = next(i for i, (kind, n) in enumerate(events) if n == name)
        launched = next((i for i, (kind, n) in enumerate(events) if n == name and kind == "launch"), len(events))
        if events[first][0] != "compile" or ("barrier", "") not in events[first:launched]:
            bad.append(name)
    return bad


def test_one_sided_compiles_ahead_sizes_by_need_and_reads_zero_copy_in_place(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for failures, out in spawn(_one_sided, 2, device="cpu", timeout_s=600):
        assert failures == [], failures
        assert out["memory at construction"] == 0
        assert 1 << 20 <= out["memory sized by the first dispatch"] < 2 << 20, out  # 1 GiB before
        assert _compiled_before_the_ranks_met(out["phase 1"], _WAITING_KERNELS) == [], out["phase 1"]
        late, grown, in_place = out["phase 2"]
        assert late == [] and grown == 0 and in_place, out["phase 2"]  # warm-up compiled and sized everything
        events, grew = out["phase 3"]
        assert grew and _compiled_before_the_ranks_met(events, _WAITING_KERNELS[-2:]) == [], events
