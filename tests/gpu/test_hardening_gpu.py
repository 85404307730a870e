"""Production hardening on GPUs: device errors of calls without host synchronisation become exceptions at the next
interaction with the Buffer (an overflowing num_worst_tokens on every transport); calls of one Buffer on two streams
are ordered; two Buffers on two streams, and calls beside long GEMMs on another stream, finish (bit-exact, or with
an error naming a rank, never a hang); compilation stays out of the device timeouts; and a soak of 10^4 mixed calls
(normal, cached, num_worst_tokens, low latency plain / hook / async, CUDA-graph replays where the group can capture,
a GEMM running on another stream) is bit-exact in every call with flat memory. The CPU side of the same guarantees:
tests/test_hardening.py and tests/test_hardening_device.py."""

import random

import pytest
import torch

from conftest import gpu_count, gpu_ranks
from epcomm.testing import spawn
from test_hardening import _raises


def _need(n: int) -> None:
    if gpu_ranks() < n:
        pytest.skip(f"needs {n} GPU ranks, found {gpu_ranks()}")


# ---------------------------------------------------------------------------------------------------------
# sticky errors of calls without host synchronisation
# ---------------------------------------------------------------------------------------------------------
def _sticky(ctx, transport, bad_input="worst"):
    """A low-latency call whose rows overflow (each token selecting a peer's expert twice) and a normal dispatch
    without host synchronisation with bad input (``bad_input``: "worst", too few num_worst_tokens; "ids", invalid
    expert ids) return without an error (unless the device finished them before their exit check); once the device
    finished them (``torch.cuda.synchronize()``, nothing of epcomm's), the next call raises, and so does every later
    one. ``clean_low_latency_buffer`` on every rank recovers from the first, not from the second."""
    from epcomm.buffer import Buffer
    from epcomm.testing.checks import LowLatencyCase, check_low_latency

    world, dev = ctx.world_size, ctx.device
    out = {}
    buf = Buffer(ctx.group, transport=transport)
    x = torch.randn(8, 128, device=dev).to(torch.bfloat16)
    twice = torch.full((8, 2), (ctx.rank + 1) % world, dtype=torch.int64, device=dev)
    out["overflowing call"] = _raises(lambda: buf.low_latency_dispatch(x, twice, 8, world))
    torch.cuda.synchronize()
    out["next call"] = _raises(lambda: buf.low_latency_dispatch(x, twice[:, :1], 8, world))
    out["check_errors"] = _raises(buf.check_errors)
    buf.clean_low_latency_buffer(8, 128, world)
    case = LowLatencyCase(num_tokens=(8, 3), max_tokens=8, hidden=256, num_experts=2 * world, topk=2, seed=7)
    out["after clean"] = check_low_latency(ctx, buf, case).failures
    idx = (torch.arange(64, device=dev) % world).unsqueeze(1)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, world)
    xs = torch.randn(64, 128, device=dev).to(torch.bfloat16)
    if bad_input == "worst":  # too few num_worst_tokens (the one-sided push drops the rows past them)
        bad = dict(num_worst_tokens=2)
    else:  # an invalid expert id in a call without host synchronisation
        bad = dict(num_worst_tokens=64 * world, topk_idx=idx.clone().fill_(world), num_tokens_per_expert=per_expert)
    out["bad sync-free dispatch"] = _raises(lambda: buf.dispatch(xs, num_tokens_per_rank=per_rank,
                                                                 is_token_in_rank=in_rank, **bad))
    torch.cuda.synchronize()
    out["next normal call"] = _raises(lambda: buf.get_dispatch_layout(idx, world))
    buf.clean_low_latency_buffer(8, 128, world)
    out["after clean (normal error)"] = _raises(lambda: buf.get_dispatch_layout(idx, world))
    buf.destroy()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("transport,bad_input", [("nvlink", "worst"), ("nvlink", "ids"), ("alltoall", "worst")])
def test_gpu_errors_of_sync_free_calls_raise_at_the_next_call(transport, bad_input):
    _need(2)
    for rank, out in enumerate(spawn(_sticky, 2, transport, bad_input, device="cuda", timeout_s=300)):
        # nothing synchronised: the call itself raises only if the device got there before its exit check
        assert out["overflowing call"] == "no exception" or "did not fit" in out["overflowing call"], out
        assert out["next call"].startswith("Buffer.low_latency_dispatch: a call failed on the device"), out
        assert f"rank {rank}:" in out["next call"] and "did not fit" in out["next call"], out
        assert out["check_errors"].startswith("Buffer.check_errors: a call failed"), out
        assert out["after clean"] == [], out
        assert out["bad sync-free dispatch"] == "no exception" or "a call failed" in out["bad sync-free dispatch"]
        assert out["next normal call"].startswith("Buffer.get_dispatch_layout: a call failed on the device"), out
        assert "destroy the Buffer on every rank" in out["next normal call"], out
        assert out["after clean (normal error)"].startswith("Buffer.get_dispatch_layout: a call failed"), out


# ---------------------------------------------------------------------------------------------------------
# two streams, one Buffer
# ---------------------------------------------------------------------------------------------------------
def _two_streams(ctx, transport, rounds: int = 100):
    """Each round keeps the current stream busy (a sleep kernel), then makes an ``async_finish`` call (on the
    communication stream, which waits for the sleep) and at once a plain call of other data (on the current
    stream): unordered, both would start when the sleep ends and share the Buffer's storage and counters.
    Low-latency dispatch and combine, and cached normal dispatch; every result checked bit for bit."""
    from epcomm import reference
    from epcomm.buffer import Buffer
    from epcomm.testing.routing import make_inputs

    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    t_max, hidden, num_experts, topk = 16, 512, 8 * world, 4
    buf = Buffer(ctx.group, transport=transport)
    sets = [make_inputs(60 + i, world, t_max, hidden, num_experts, topk, "uniform", torch.bfloat16) for i in range(2)]
    mine = [s[rank].to(dev) for s in sets]
    refs = [reference.low_latency_dispatch([i.x for i in s], [i.topk_idx for i in s], num_experts, use_fp8=False)
            for s in sets]
    ys = [[[(xe.float() * 0.5).to(torch.bfloat16) for xe in r.x] for r in ref] for ref in refs]
    want = [reference.low_latency_combine(y, ref, [i.topk_idx for i in s], [i.topk_weights for i in s],
                                          num_experts)[rank].to(dev) for y, ref, s in zip(ys, refs, sets)]
    normal_ref = [reference.dispatch([i.x for i in s], [i.topk_idx for i in s], num_experts)[rank].recv_x.to(dev)
                  for s in sets]
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(mine[0].topk_idx, num_experts)
    handle = buf.dispatch(mine[0].x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                          num_tokens_per_expert=per_expert, topk_idx=mine[0].topk_idx)[4]
    same_layout = [(mine[0].x.float() * f).to(torch.bfloat16) for f in (0.5, -2.0)]
    normal_want = [(normal_ref[0].float() * f).to(torch.bfloat16) for f in (0.5, -2.0)]
    bad = torch.zeros((), dtype=torch.int64, device=dev)

    def differ(a, b):
        return (a.view(torch.int16) != b.view(torch.int16)).sum()

    for _ in range(rounds):
        torch.cuda._sleep(2_000_000)
        got = [buf.low_latency_dispatch(m.x, m.topk_idx, t_max, num_experts, use_fp8=False, async_finish=a)
               for m, a in zip(mine, (True, False))]
        got[0][3].current_stream_wait()
        for j, ref in enumerate(refs):
            recv, count = got[j][0], got[j][1]
            bad += (count.cpu() != torch.tensor(ref[rank].count, dtype=torch.int32)).sum().to(dev)
            for e, c in enumerate(ref[rank].count):
                bad += differ(recv[e, :c], ref[rank].x[e].to(dev))
        y_in = [torch.zeros_like(got[j][0]) for j in range(2)]
        for j in range(2):
            for e, c in enumerate(refs[j][rank].count):
                y_in[j][e, :c] = ys[j][rank][e].to(dev)
        torch.cuda._sleep(2_000_000)
        comb = [buf.low_latency_combine(y_in[j], mine[j].topk_idx, mine[j].topk_weights, got[j][2],
                                        async_finish=j == 0) for j in range(2)]
        comb[0][1].current_stream_wait()
        bad += differ(comb[0][0], want[0]) + differ(comb[1][0], want[1])
        torch.cuda._sleep(2_000_000)
        first = buf.dispatch(same_layout[0], handle=handle, previous_event=buf.capture(), async_finish=True)
        second = buf.dispatch(same_layout[1], handle=handle)
        first[5].current_stream_wait()
        bad += differ(first[0], normal_want[0]) + differ(second[0], normal_want[1])
    torch.cuda.synchronize()
    buf.check_errors()
    buf.destroy()
    return int(bad)


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["nvlink", "alltoall"])
def test_gpu_two_streams_one_buffer(transport, monkeypatch):
    _need(2)
    monkeypatch.setenv("EPCOMM_TIMEOUT_S", "20")
    assert spawn(_two_streams, 2, transport, device="cuda", timeout_s=600) == [0, 0]


# ---------------------------------------------------------------------------------------------------------
# two Buffers on two streams; long GEMMs beside the calls (co-residency)
# ---------------------------------------------------------------------------------------------------------
def _two_buffers(ctx, transport, rounds: int):
    """Two Buffers of the same group, each on its own stream, each making a low-latency dispatch (64 tokens, hidden
    7168, 32 experts, top-4, BF16) and combine per round, both streams enqueued back to back ``rounds`` times with
    no synchronisation. Kernels of the two Buffers may wait for each other across ranks (each GPU may run the other
    Buffer's kernel first), so a round may end in a timeout error instead of results; it must end either way.
    Every result is compared bit for bit on the device. Returns (the first error's message or None, mismatching
    elements per Buffer, rounds made)."""
    import torch.distributed as dist

    from epcomm import reference
    from epcomm.buffer import Buffer
    from epcomm.errors import EpcommError
    from epcomm.testing.routing import make_inputs

    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    t_max, hidden, num_experts, topk = 64, 7168, 32, 4
    e_local = num_experts // world
    bufs = [Buffer(ctx.group, transport=transport) for _ in range(2)]
    streams = [torch.cuda.Stream(dev) for _ in range(2)]
    mine, want_recv, mask, y_in, want = [], [], [], [], []
    for j in range(2):
        inputs = make_inputs(90 + j, world, t_max, hidden, num_experts, topk, "uniform", torch.bfloat16)
        ref = reference.low_latency_dispatch([i.x for i in inputs], [i.topk_idx for i in inputs], num_experts,
                                             use_fp8=False)
        ys = [[(xe.float() * (1.0 + 0.25 * e)).to(torch.bfloat16) for e, xe in enumerate(r.x)] for r in ref]
        full = torch.zeros(e_local, world * t_max, hidden, dtype=torch.bfloat16)
        rows = torch.zeros(e_local, world * t_max, 1, dtype=torch.bool)
        y = torch.zeros_like(full)
        for e, c in enumerate(ref[rank].count):
            full[e, :c], rows[e, :c], y[e, :c] = ref[rank].x[e], True, ys[rank][e]
        mine.append(inputs[rank].to(dev))
        want_recv.append(full.to(dev))
        mask.append(rows.to(dev))
        y_in.append(y.to(dev))
        want.append(reference.low_latency_combine(ys, ref, [i.topk_idx for i in inputs],
                                                  [i.topk_weights for i in inputs], num_experts)[rank].to(dev))
    bad = torch.zeros(2, dtype=torch.int64, device=dev)
    error, made = None, 0
    torch.cuda.synchronize()  # the inputs are on the device before the streams read them
    try:
        for made in range(1, rounds + 1):
            for j in range(2):
                with torch.cuda.stream(streams[j]):
                    recv, _, handle, _, _ = bufs[j].low_latency_dispatch(mine[j].x, mine[j].topk_idx, t_max,
                                                                         num_experts, use_fp8=False)
                    bad[j] += ((recv.view(torch.int16) != want_recv[j].view(torch.int16)) & mask[j]).sum()
                    combined, _, _ = bufs[j].low_latency_combine(y_in[j], mine[j].topk_idx, mine[j].topk_weights,
                                                                 handle)
                    bad[j] += (combined.view(torch.int16) != want[j].view(torch.int16)).sum()
    except EpcommError as exc:
        error = str(exc)
    torch.cuda.synchronize()
    for b in bufs:
        try:
            b.check_errors()
        except EpcommError as exc:
            error = error or str(exc)
    dist.barrier(group=ctx.group)
    for b in bufs:
        try:
            b.destroy()
        except EpcommError:
            pass  # reported above
    return error, bad.tolist(), made


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["nvlink", "alltoall"])
def test_gpu_two_buffers_on_two_streams_finish(transport, monkeypatch):
    """300 rounds (see ``_two_buffers``): bit-exact, or an error that names the rank and what it waited for; never a
    hang (a short device timeout, and the launcher's limit on the whole run)."""
    _need(2)
    monkeypatch.setenv("EPCOMM_TIMEOUT_S", "10")
    for rank, (error, bad, made) in enumerate(spawn(_two_buffers, 2, transport, 300, device="cuda",
                                                    timeout_s=900)):
        if error is None:
            assert made == 300 and bad == [0, 0], f"rank {rank}: mismatching elements per Buffer {bad}"
        else:  # a timeout between the Buffers' kernels: it must say so
            assert "a call failed on the device" in error and "rank" in error and "timed out" in error, error


def _beside_gemms(ctx, transport: str, rounds: int):
    """Each round queues three 8192^3 BF16 GEMMs on another stream (nothing waits for them; each holds every SM it
    can get for milliseconds), then makes a normal dispatch + combine, a num_worst_tokens one and a low-latency
    dispatch + combine (plain and hook) on the current stream, every result compared bit for bit on the device.
    Returns (mismatches per operation of ``_Soak``, rounds)."""
    from epcomm.buffer import Buffer

    dev = ctx.device
    buf = Buffer(ctx.group, transport=transport)
    soak = _Soak(ctx, buf, False)
    side = torch.cuda.Stream(dev)
    a = torch.randn(8192, 8192, device=dev).to(torch.bfloat16)
    c = torch.empty_like(a)
    for op in ("normal", "worst", "ll", "ll_hook"):  # first calls (compilation, storage) before the GEMMs
        _run_op(soak, op, 0)
    torch.cuda.synchronize()
    for r in range(rounds):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                torch.matmul(a, a, out=c)
        for op in ("normal", "worst", "ll", "ll_hook"):
            _run_op(soak, op, r % 2)
    torch.cuda.synchronize()
    buf.check_errors()
    bad = soak.bad.tolist()
    buf.destroy()
    return bad, rounds


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["nvlink", "alltoall"])
def test_gpu_calls_beside_long_gemms(transport, monkeypatch):
    _need(2)
    monkeypatch.setenv("EPCOMM_TIMEOUT_S", "30")
    for rank, (bad, rounds) in enumerate(spawn(_beside_gemms, 2, transport, 20, device="cuda", timeout_s=900)):
        assert rounds == 20 and not any(bad), f"rank {rank}: mismatching elements per operation {bad}"


# ---------------------------------------------------------------------------------------------------------
# compilation out of the timeout
# ---------------------------------------------------------------------------------------------------------
def _slow_compiler(ctx, transport, warm: bool):
    """Rank 1's Triton compiles everything 3 s slower (its compile function is patched; Triton's disk cache
    does not help, every kernel goes through it once per process) while the device timeout is 1.5 s. First calls
    of normal and low-latency mode (or, with ``warm``, calls after ``Buffer.warmup``) must not time out."""
    import time

    from triton.runtime.jit import JITFunction

    from epcomm.buffer import Buffer
    from epcomm.testing.checks import LowLatencyCase, NormalCase, check_low_latency, check_normal

    if ctx.rank == 1:
        original = JITFunction._do_compile

        def slow(self, *args, **kwargs):
            time.sleep(3.0)
            return original(self, *args, **kwargs)

        JITFunction._do_compile = slow
    buf = Buffer(ctx.group, transport=transport)
    normal = NormalCase(num_tokens=(256, 100), hidden=1024, num_experts=16, topk=4, dtype="fp8", seed=81)
    ll = LowLatencyCase(num_tokens=(32, 7), max_tokens=32, hidden=1024, num_experts=16, topk=4, hook=True, seed=82)
    if warm:
        buf.warmup(1024, 16, 4, 256, dtypes=("fp8",), num_max_dispatch_tokens_per_rank=32, use_fp8=(True,))
    failures = check_normal(ctx, buf, normal).failures + check_low_latency(ctx, buf, ll).failures
    buf.check_errors()
    buf.destroy()
    return failures


@pytest.mark.gpu
@pytest.mark.parametrize("warm", [False, True])
@pytest.mark.parametrize("transport", ["nvlink"])
def test_gpu_compilation_stays_out_of_the_timeout(transport, warm, monkeypatch):
    _need(2)
    monkeypatch.setenv("EPCOMM_TIMEOUT_S", "1.5")
    assert spawn(_slow_compiler, 2, transport, warm, device="cuda", timeout_s=900) == [[], []]


# ---------------------------------------------------------------------------------------------------------
# soak
# ---------------------------------------------------------------------------------------------------------
class _Soak:
    """The data, expected results and device-side mismatch counters of one rank's soak (see ``_soak``)."""

    def __init__(self, ctx, buf, graphs: bool):
        from epcomm import reference
        from epcomm.testing.routing import make_inputs

        self.ctx, self.buf, self.dev, self.rank = ctx, buf, ctx.device, ctx.rank
        world = ctx.world_size
        self.e, self.k, self.h, self.t = 8 * world, 4, 512, 32
        tokens = [96 - 37 * (r % 2) for r in range(world)]  # uneven, every rank with tokens
        self.normal = []
        for seed in (1, 2):
            inputs = make_inputs(300 + seed, world, tokens, self.h, self.e, self.k, "uniform", torch.bfloat16)
            ref = reference.dispatch([i.x for i in inputs], [i.topk_idx for i in inputs], self.e,
                                     [i.topk_weights for i in inputs])
            ys = [(r.recv_x.float() * (1.0 + 0.5 * s)).to(torch.bfloat16) for s, r in enumerate(ref)]
            combined, combined_w = reference.combine(ys, ref, tokens, [r.recv_topk_weights for r in ref],
                                                     None, torch.bfloat16)[self.rank]
            x2 = [(i.x.float() * 0.5 - 1.0).to(torch.bfloat16) for i in inputs]
            cached = reference.dispatch(x2, [i.topk_idx for i in inputs], self.e)[self.rank].recv_x
            mine, r = inputs[self.rank].to(self.dev), ref[self.rank]
            self.normal.append(dict(
                x=mine.x, idx=mine.topk_idx, w=mine.topk_weights, x2=x2[self.rank].to(self.dev),
                recv_x=r.recv_x.to(self.dev), recv_idx=r.recv_topk_idx.to(self.dev),
                recv_w=r.recv_topk_weights.to(self.dev), y=ys[self.rank].to(self.dev), combined=combined.to(self.dev),
                combined_w=combined_w.to(self.dev), cached=cached.to(self.dev), handle=None,
                worst=max(x.recv_x.size(0) for x in ref) + 3))
        self.ll = []
        for seed, fp8 in ((1, True), (2, False)):
            inputs = make_inputs(400 + seed, world, [self.t - 9 * (r % 3) for r in range(world)], self.h, self.e,
                                 self.k, "uniform", torch.bfloat16)
            ref = reference.low_latency_dispatch([i.x for i in inputs], [i.topk_idx for i in inputs], self.e, fp8)
            ys = [[(xe.float() * (1.0 + 0.125 * e) if not fp8 else
                    _dequant(xe, se) * (1.0 + 0.125 * e)).to(torch.bfloat16) for e, (xe, se) in
                   enumerate(zip(r.x, r.scales))] for r in ref]
            want = reference.low_latency_combine(ys, ref, [i.topk_idx for i in inputs],
                                                 [i.topk_weights for i in inputs], self.e)[self.rank]
            e_local = self.e // world
            y = torch.zeros(e_local, world * self.t, self.h, dtype=torch.bfloat16)
            for e in range(e_local):
                y[e, :ref[self.rank].count[e]] = ys[self.rank][e]
            mine, r = inputs[self.rank].to(self.dev), ref[self.rank]
            self.ll.append(dict(x=mine.x, idx=mine.topk_idx, w=mine.topk_weights, fp8=fp8, count=r.count,
                                rows=[xe.to(self.dev) for xe in r.x], y=y.to(self.dev), combined=want.to(self.dev),
                                scales=[se.to(self.dev) if se is not None else None for se in r.scales]))
        self.bad = torch.zeros(16, dtype=torch.int64, device=self.dev)  # mismatches per operation
        self.graphs = self._capture() if graphs else {}

    def differ(self, slot: int, got, want) -> None:
        """Count (on the device, no synchronisation) the elements of ``got`` whose bits differ from ``want``."""
        view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
        self.bad[slot] += (got.reshape(-1).view(view) != want.reshape(-1).view(view)).sum()

    # ------------------------------------------------------------------ operations (each returns its calls)
    def normal_call(self, d: int, overlap: bool) -> int:
        s, buf = self.normal[d], self.buf
        kw = dict(previous_event=buf.capture(), async_finish=True) if overlap else {}
        per_rank, _, per_expert, in_rank, ev = buf.get_dispatch_layout(s["idx"], self.e, **kw)
        ev.current_stream_wait()
        kw = dict(previous_event=buf.capture(), async_finish=True) if overlap else {}
        recv_x, recv_idx, recv_w, _, handle, ev = buf.dispatch(
            s["x"], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=s["idx"], topk_weights=s["w"], **kw)
        ev.current_stream_wait()
        s["handle"] = handle
        for slot, got, want in ((0, recv_x, s["recv_x"]), (1, recv_idx, s["recv_idx"]), (2, recv_w, s["recv_w"])):
            self.differ(slot, got, want)
        kw = dict(previous_event=buf.capture(), async_finish=True) if overlap else {}
        combined, combined_w, ev = buf.combine(s["y"], handle, topk_weights=recv_w, **kw)
        ev.current_stream_wait()
        self.differ(3, combined, s["combined"])
        self.differ(4, combined_w, s["combined_w"])
        return 3

    def cached_call(self, d: int) -> int:
        s = self.normal[d]
        if s["handle"] is None:
            return self.normal_call(d, False)
        self.differ(5, self.buf.dispatch(s["x2"], handle=s["handle"])[0], s["cached"])
        return 1

    def worst_call(self, d: int, static=None) -> tuple:
        s, buf = self.normal[d], self.buf
        x, idx, w = static if static is not None else (s["x"], s["idx"], s["w"])
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, self.e)
        recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
            topk_weights=w, num_worst_tokens=s["worst"])
        m = s["recv_x"].size(0)
        y = torch.zeros(s["worst"], self.h, dtype=torch.bfloat16, device=self.dev)
        y[:m] = s["y"]
        combined, combined_w, _ = buf.combine(y, handle, topk_weights=recv_w)
        return recv_x, recv_idx, combined, combined_w

    def check_worst(self, d: int, outs) -> None:
        s = self.normal[d]
        recv_x, recv_idx, combined, combined_w = outs
        m = s["recv_x"].size(0)
        self.differ(6, recv_x[:m], s["recv_x"])
        self.differ(6, recv_idx[:m], s["recv_idx"])
        self.bad[6] += (recv_idx[m:] != -1).sum()
        self.differ(7, combined, s["combined"])
        self.differ(7, combined_w, s["combined_w"])

    def ll_call(self, d: int, mode: str, static=None) -> tuple:
        s, buf = self.ll[d], self.buf
        x, idx, w = static if static is not None else (s["x"], s["idx"], s["w"])
        hook, overlap = mode == "hook", mode == "async"
        recv, count, handle, ev, h = buf.low_latency_dispatch(x, idx, self.t, self.e, use_fp8=s["fp8"],
                                                              async_finish=overlap, return_recv_hook=hook)
        if h is not None:
            h()
        ev.current_stream_wait()
        combined, ev, h = buf.low_latency_combine(s["y"], idx, w, handle, async_finish=overlap, return_recv_hook=hook)
        if h is not None:
            h()
        ev.current_stream_wait()
        return recv, count, combined

    def check_ll(self, d: int, outs) -> None:
        s = self.ll[d]
        recv, count, combined = outs
        data, scales = recv if s["fp8"] else (recv, None)
        self.differ(8, count, torch.tensor(s["count"], dtype=torch.int32, device=self.dev))
        for e, c in enumerate(s["count"]):
            self.differ(9, data[e, :c], s["rows"][e])
            if scales is not None:
                self.differ(9, scales[e, :c], s["scales"][e])
        self.differ(10, combined, s["combined"])

    # ------------------------------------------------------------------ graphs
    def _capture(self) -> dict:
        """One CUDA graph per kind: a num_worst_tokens dispatch + combine and a low-latency dispatch + combine,
        each on static inputs that a replay reads (data set 0's shapes; every set has the same)."""
        from epcomm.bench.timing import capture_graph

        graphs = {}
        for kind, data in (("worst", self.normal[0]), ("ll", self.ll[1])):
            static = tuple(t.clone() for t in (data["x"], data["idx"], data["w"]))
            fn = (lambda st=static: self.worst_call(0, st)) if kind == "worst" else (
                lambda st=static: self.ll_call(1, "plain", st))
            graph, outs = capture_graph(fn)
            graphs[kind] = (graph, static, outs)
        return graphs

    def replay(self, kind: str) -> int:
        graph, static, outs = self.graphs[kind]
        for t in outs:  # poisoned: a replay that wrote nothing would fail the check
            for u in (t if isinstance(t, tuple) else (t,)):
                u.view(torch.uint8).fill_(0xFF)
        graph.replay()
        if kind == "worst":
            self.check_worst(0, outs)
        else:
            self.check_ll(1, outs)
        return 4


def _dequant(x, scales):
    from epcomm.fp8 import per_token_cast_back

    return per_token_cast_back(x, scales) if x.numel() else x.to(torch.bfloat16)


def _memory(dev) -> int:
    """Bytes of live tensors once every call finished (a tiny allocation lets the allocator release blocks whose
    streams have moved on)."""
    if dev.type != "cuda":  # the soak's logic can be tried on CPU processes (no allocator statistics)
        return 0
    torch.cuda.synchronize(dev)
    torch.empty(1, device=dev)
    return torch.cuda.memory_allocated(dev)


def _soak(ctx, transport: str, graphs: bool, gemm: bool, calls: int = 10_000):
    """``calls`` Buffer calls in a random mix drawn with one seed on every rank (the ranks make the same calls):
    normal dispatch + combine (plain, and async with ``previous_event``), cached dispatch, num_worst_tokens
    dispatch + combine, low-latency dispatch + combine (FP8 and BF16; plain, hook, async), and graph replays of
    the num_worst_tokens and low-latency steps; every 8th operation a 2048^2 BF16 GEMM is queued on another
    stream that nothing waits for. Every result is compared bit for bit on the device (no synchronisation);
    memory is sampled at four points after the warm-up. Returns (mismatches per operation, memory samples,
    Buffer.memory_usage samples, calls made)."""
    from epcomm.buffer import Buffer

    dev = ctx.device
    buf = Buffer(ctx.group, transport=transport)
    soak = _Soak(ctx, buf, graphs and dev.type == "cuda")
    side = torch.cuda.Stream(dev) if gemm else None
    a = torch.randn(2048, 2048, device=dev).to(torch.bfloat16) if gemm else None
    ops = ["normal", "normal_async", "cached", "worst", "ll", "ll_hook", "ll_async"]
    ops += list(soak.graphs)
    rng = random.Random(20260101)
    made, samples, usage, step = 0, [], [], 0
    for op in ops:  # warm-up: every operation once (compilation, storage, graphs' first replays)
        made += _run_op(soak, op, 0)
    if side is not None:  # the GEMM's first call on its stream makes cuBLAS's workspace: part of the warm-up
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            a = (a @ a).mul_(1e-3)
        torch.cuda.synchronize(dev)
    mark, every = made, max(1, (calls - made) // 4)
    while made < calls:
        if made >= mark:  # four samples from the end of the warm-up on, and one at the end
            samples.append(_memory(dev))
            usage.append(buf.memory_usage["total"])
            mark += every
        if side is not None and step % 8 == 0:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                a = (a @ a).mul_(1e-3)
        made += _run_op(soak, rng.choice(ops), rng.randrange(2))
        step += 1
    samples.append(_memory(dev))
    usage.append(buf.memory_usage["total"])
    buf.check_errors()
    bad = soak.bad.tolist()
    buf.destroy()
    return bad, samples, usage, made


def _run_op(soak: _Soak, op: str, d: int) -> int:
    if op in ("normal", "normal_async"):
        return soak.normal_call(d, op == "normal_async")
    if op == "cached":
        return soak.cached_call(d)
    if op == "worst":
        soak.check_worst(d, soak.worst_call(d))
        return 4
    if op.startswith("ll"):
        soak.check_ll(d, soak.ll_call(d, op[3:] or "plain"))
        return 2
    return soak.replay(op)


@pytest.mark.gpu
@pytest.mark.parametrize("transport,gemm", [("nvlink", True), ("nvlink", False), ("alltoall", True)])
def test_gpu_soak(transport, gemm, monkeypatch):
    """10^4 mixed calls, bit-exact, flat memory (see ``_soak``)."""
    _need(2)
    monkeypatch.setenv("EPCOMM_TIMEOUT_S", "30")
    graphs = not (transport == "alltoall" and 2 > gpu_count())  # gloo (ranks sharing a GPU) cannot capture
    for rank, (bad, samples, usage, made) in enumerate(spawn(_soak, 2, transport, graphs, gemm, device="cuda",
                                                             timeout_s=1800)):
        assert made >= 10_000
        assert not any(bad), f"rank {rank}: mismatching elements per operation {bad}"
        assert max(samples) - min(samples) <= 1 << 20, f"rank {rank}: allocated bytes drifted: {samples}"
        assert len(set(usage)) == 1, f"rank {rank}: Buffer.memory_usage changed: {usage}"
