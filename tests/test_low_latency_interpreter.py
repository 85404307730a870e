"""Low-latency dispatch/combine of the one-sided transports (``epcomm.transports.low_latency``) without a GPU.

Under the Triton interpreter, CPU processes share a symmetric heap in shared memory, so the same kernels
run as on GPUs (one program after another), checked bit-exact against the reference: FP8 (per-128 scales,
round_scale, UE8M0) and BF16 payloads, hooks, zero-copy, ``out=``, empty ranks, -1 slots, one expert per
rank, repeated calls that alternate the double buffers, two micro-batches with hooks pending, two Buffers
alternating, the fused one-kernel form, storage sized by the size hint, and a missing peer turning into an
error. Without the interpreter: the FP8 conversion helper, the launcher's argument order against Triton's
own binding, and the kernels compiled for sm_90 (PTX checked for vector accesses, release/acquire and the
absence of FMA in the combine)."""

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from epcomm.testing import spawn  # noqa: E402
from epcomm.testing.checks import LowLatencyCase, run_cases  # noqa: E402
from epcomm.transports.nvlink import NVLinkTransport  # noqa: E402

NVL = {"num_nvl_bytes": 1 << 20}


class FusedNVLinkTransport(NVLinkTransport):
    """The nvlink transport with one fused kernel per plain low-latency call, as on GPUs (grid 1 here)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._ll._fused = True


def _assert_clean(results):
    problems = [f"rank {r}: {label}: {fails}" for r, res in enumerate(results) for label, fails in res]
    assert not problems, "\n".join(problems)


CASES = [
    # an empty rank; FP8 with float32 scales
    LowLatencyCase(num_tokens=(5, 0, 7), max_tokens=8, hidden=256, num_experts=6, topk=3, seed=51),
    # BF16, -1 slots, fewer local experts than top-k (C = T * E_local), hook + zero-copy + out
    LowLatencyCase(num_tokens=6, max_tokens=6, hidden=384, num_experts=9, topk=4, use_fp8=False, hook=True,
                   zero_copy=True, use_out=True, routing="dropped", seed=52),
    # UE8M0 with a partial last word (5 groups), hook
    LowLatencyCase(num_tokens=(4, 8, 2), max_tokens=8, hidden=640, num_experts=12, topk=2, round_scale=True,
                   use_ue8m0=True, hook=True, seed=53),
    # one local expert, top-1, power-of-two scales, skewed routing
    LowLatencyCase(num_tokens=3, max_tokens=5, hidden=128, num_experts=3, topk=1, round_scale=True,
                   routing="skewed", seed=54),
    # the first case again with new data: same parity area reused two calls later
    LowLatencyCase(num_tokens=(5, 0, 7), max_tokens=8, hidden=256, num_experts=6, topk=3, use_out=True, seed=55),
    LowLatencyCase(num_tokens=(0, 0, 0), max_tokens=4, hidden=128, num_experts=6, topk=2, seed=56),
    # more than 8 tokens per rank: hooks, -1 slots, an empty rank; then every rank with tokens
    LowLatencyCase(num_tokens=(11, 0, 9), max_tokens=12, hidden=256, num_experts=6, topk=3, routing="dropped",
                   hook=True, seed=57),
    LowLatencyCase(num_tokens=(12, 10, 3), max_tokens=12, hidden=128, num_experts=6, topk=2, seed=58),
]


def test_low_latency_matches_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _assert_clean(spawn(run_cases, 3, CASES, NVLinkTransport, NVL, device="cpu", timeout_s=600))


# ---------------------------------------------------------------------------------------------------------
# patterns: micro-batches, two Buffers, the fused kernel, the size hint, the FP8 helper
# ---------------------------------------------------------------------------------------------------------
def _reference(inputs, case_kw, num_experts):
    from epcomm import reference

    return reference.low_latency_dispatch([i.x for i in inputs], [i.topk_idx for i in inputs], num_experts,
                                          case_kw.get("use_fp8", True), case_kw.get("round_scale", False),
                                          case_kw.get("use_ue8m0", False))


def _expert_outputs(ref, e_local, max_tokens, hidden, rank, use_fp8):
    """Every rank's stand-in expert outputs (as check_low_latency makes them) and this rank's y."""
    from epcomm.fp8 import per_token_cast_back

    ys = []
    for d in ref:
        per_e = []
        for e in range(e_local):
            rows = d.x[e]
            if use_fp8:
                rows = per_token_cast_back(rows, d.scales[e]) if rows.numel() else rows.to(torch.bfloat16)
            per_e.append((rows.float() * (1.0 + 0.125 * e)).to(torch.bfloat16))
        ys.append(per_e)
    num_ranks = len(ref)
    y = torch.full((e_local, num_ranks * max_tokens, hidden), float("nan"), dtype=torch.bfloat16)
    for e in range(e_local):
        y[e, :ref[rank].count[e]] = ys[rank][e]
    return ys, y


def _check_dispatch(res, tag, recv, count, handle, ref_r, use_fp8):
    from epcomm.testing.checks import same_bits

    data, scales = recv if use_fp8 else (recv, None)
    if not same_bits(count, torch.tensor(ref_r.count, dtype=torch.int32)):
        res.append(f"{tag}: recv_count {count.tolist()} != {ref_r.count}")
    for e, c in enumerate(ref_r.count):
        if not same_bits(data[e, :c], ref_r.x[e]):
            res.append(f"{tag}: recv_x[{e}] differs")
        if scales is not None and not same_bits(scales[e, :c], ref_r.scales[e]):
            res.append(f"{tag}: scales[{e}] differ")
        if not same_bits(handle.src_info[e, :c].long(), ref_r.src_idx[e]):
            res.append(f"{tag}: src_info[{e}] differs")
        if bool((handle.src_info[e, c:] != -1).any()):
            res.append(f"{tag}: src_info[{e}] is not -1 past the count")


def _patterns(ctx):
    """Two micro-batches with hooks, two Buffers alternating, the fused kernel and the size hint."""
    from epcomm import reference
    from epcomm.buffer import Buffer
    from epcomm.testing.checks import same_bits
    from epcomm.testing.routing import make_inputs

    rank, num_ranks, dev = ctx.rank, ctx.world_size, ctx.device
    problems = []
    t_max, hidden, num_experts, topk = 6, 256, 8, 3
    e_local = num_experts // num_ranks

    def step_inputs(seed, n=(5, 3)):
        return make_inputs(seed, num_ranks, n, hidden, num_experts, topk, "uniform", torch.bfloat16)

    def on_dev(inputs):
        return inputs[rank].to(dev)

    def combine_ref(inputs, ref, ys):
        return reference.low_latency_combine(ys, ref, [i.topk_idx for i in inputs], [i.topk_weights for i in inputs],
                                             num_experts)[rank]

    # (1) two micro-batches, every result pending through a hook, twice (parities of both kinds reused)
    buf = Buffer(ctx.group, transport=NVLinkTransport, **NVL)
    for layer in range(2):
        mbs = [step_inputs(100 + 10 * layer + mb) for mb in range(2)]
        kws = [dict(use_fp8=True), dict(use_fp8=False)]
        disp = [buf.low_latency_dispatch(on_dev(mb).x, on_dev(mb).topk_idx, t_max, num_experts,
                                         return_recv_hook=True, **kw) for mb, kw in zip(mbs, kws)]
        outs = []
        for i, (mb, kw, (recv, count, handle, _, hook)) in enumerate(zip(mbs, kws, disp)):
            hook()
            ref = _reference(mb, kw, num_experts)
            _check_dispatch(problems, f"layer {layer} micro-batch {i}", recv, count, handle, ref[rank],
                            kw["use_fp8"])
            ys, y = _expert_outputs(ref, e_local, t_max, hidden, rank, kw["use_fp8"])
            combined, _, chook = buf.low_latency_combine(y.to(dev), on_dev(mb).topk_idx, on_dev(mb).topk_weights,
                                                         handle, return_recv_hook=True)
            outs.append((combined, chook, combine_ref(mb, ref, ys)))
        for i, (combined, chook, want) in enumerate(outs):
            chook()
            chook()  # a second call does nothing
            if not same_bits(combined, want):
                problems.append(f"layer {layer} micro-batch {i}: combine differs")
    buf.check_errors()

    # (2) two Buffers alternating call by call, one of them fused (one kernel per call, grid 1 here)
    bufs = [buf, Buffer(ctx.group, transport=FusedNVLinkTransport, **NVL)]
    for it in range(3):
        steps = [step_inputs(200 + 2 * it + b, n=(6, 0) if it == 1 else (2, 6)) for b in range(2)]
        got = [bufs[b].low_latency_dispatch(on_dev(steps[b]).x, on_dev(steps[b]).topk_idx, t_max, num_experts,
                                            round_scale=True) for b in range(2)]
        combined = []
        for b in range(2):
            recv, count, handle, _, _ = got[b]
            ref = _reference(steps[b], dict(round_scale=True), num_experts)
            _check_dispatch(problems, f"two buffers {it}.{b}", recv, count, handle, ref[rank], True)
            ys, y = _expert_outputs(ref, e_local, t_max, hidden, rank, True)
            bufs[b].get_next_low_latency_combine_buffer(handle).copy_(y.to(dev))
            out = buf_out = torch.empty(steps[b][rank].x.shape, dtype=torch.bfloat16, device=dev)
            c, _, _ = bufs[b].low_latency_combine(None, on_dev(steps[b]).topk_idx, on_dev(steps[b]).topk_weights,
                                                  handle, zero_copy=True, out=out)
            combined.append((c, buf_out, combine_ref(steps[b], ref, ys)))
        for b, (c, out, want) in enumerate(combined):
            if c.data_ptr() != out.data_ptr() or not same_bits(c, want):
                problems.append(f"two buffers {it}.{b}: combine differs")
    for b in bufs:
        b.destroy()

    # (3) storage sized by the hint: BF16 and FP8 calls of that shape need no more
    from epcomm.core.layout import get_low_latency_rdma_size_hint

    hint = get_low_latency_rdma_size_hint(t_max, hidden, num_ranks, num_experts, topk)
    buf = Buffer(ctx.group, transport=NVLinkTransport, num_rdma_bytes=hint, **NVL)
    for seed, use_fp8 in ((300, True), (301, False), (302, True)):
        inputs = step_inputs(seed)
        recv, count, handle, _, _ = buf.low_latency_dispatch(on_dev(inputs).x, on_dev(inputs).topk_idx, t_max,
                                                             num_experts, use_fp8=use_fp8)
        ref = _reference(inputs, dict(use_fp8=use_fp8), num_experts)
        _check_dispatch(problems, f"hint-sized {seed}", recv, count, handle, ref[rank], use_fp8)
    heaps = len(buf.runtime._ll._heaps)
    if heaps != 1:
        problems.append(f"storage sized by get_low_latency_rdma_size_hint grew: {heaps} heaps")
    buf.destroy()
    return [("patterns", problems)] if problems else []


def test_low_latency_patterns(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _assert_clean(spawn(_patterns, 2, device="cpu", timeout_s=600))


# ---------------------------------------------------------------------------------------------------------
# a missing peer
# ---------------------------------------------------------------------------------------------------------
def _missing_peer(ctx):
    """A peer that does not make the call: the receive must time out, record it and report it, not hang. The error
    is sticky on the rank that saw it (the next call, an event wait and ``check_errors`` raise it) until every rank
    calls ``clean_low_latency_buffer``, after which calls are correct again. First rank 1 skips a dispatch (rank 0
    receives it through a hook); then (new Buffer) both dispatch and rank 1 skips the combine. Returns rank 0's
    ``(first message, later messages)`` per case and the problems found after the recovery. (Both ranks make a
    dispatch and a combine first: the first call of a kind meets on the host, see test_hardening.py.)"""
    from epcomm import reference
    from epcomm.buffer import Buffer
    from epcomm.core.layout import get_low_latency_rdma_size_hint
    from epcomm.errors import EpcommError
    from epcomm.testing.checks import same_bits
    from epcomm.testing.routing import make_inputs

    hint = get_low_latency_rdma_size_hint(4, 128, 2, 4, 2)  # storage made now: no collective in the calls
    inputs = make_inputs(7, 2, 3, 128, 4, 2, "uniform", torch.bfloat16)
    mine = inputs[ctx.rank].to(ctx.device)
    messages, problems = [], []
    short = os.environ["EPCOMM_TIMEOUT_S"]  # the waits that must time out; the others get time to spare
    for skip in ("dispatch", "combine"):
        os.environ["EPCOMM_TIMEOUT_S"] = "30"
        buf = Buffer(ctx.group, transport=NVLinkTransport, num_rdma_bytes=hint, **NVL)
        warm = buf.low_latency_dispatch(mine.x, mine.topk_idx, 4, 4, use_fp8=False)  # first calls: both ranks
        buf.low_latency_combine(warm[0], mine.topk_idx, mine.topk_weights, warm[2])
        event = buf.get_dispatch_layout(mine.topk_idx, 4)[4]
        os.environ["EPCOMM_TIMEOUT_S"] = short
        first, later = "", []
        try:
            if skip == "combine" or ctx.rank == 0:
                recv, _, handle, _, hook = buf.low_latency_dispatch(mine.x, mine.topk_idx, 4, 4, use_fp8=False,
                                                                   return_recv_hook=skip == "dispatch")
                if hook is not None:
                    hook()
            if skip == "combine" and ctx.rank == 0:
                buf.low_latency_combine(recv, mine.topk_idx, mine.topk_weights, handle)
            if ctx.rank == 0:
                buf.check_errors()
        except EpcommError as exc:  # on CPUs the failing call (or hook) raises itself; on GPUs check_errors
            first = str(exc)
        if ctx.rank == 0:
            for call in (lambda: buf.low_latency_dispatch(mine.x, mine.topk_idx, 4, 4), event.current_stream_wait,
                         buf.check_errors):
                try:
                    call()
                    later.append("no exception")
                except EpcommError as exc:
                    later.append(str(exc))
        torch.distributed.barrier(group=ctx.group)
        os.environ["EPCOMM_TIMEOUT_S"] = "30"
        buf.clean_low_latency_buffer(4, 128, 4)  # every rank: the recovery
        recv, count, handle, _, _ = buf.low_latency_dispatch(mine.x, mine.topk_idx, 4, 4, use_fp8=False)
        ref = _reference(inputs, dict(use_fp8=False), 4)
        _check_dispatch(problems, f"after clean_low_latency_buffer ({skip} skipped)", recv, count, handle,
                        ref[ctx.rank], False)
        ys, y = _expert_outputs(ref, 2, 4, 128, ctx.rank, False)
        combined, _, _ = buf.low_latency_combine(y.to(ctx.device), mine.topk_idx, mine.topk_weights, handle)
        want = reference.low_latency_combine(ys, ref, [i.topk_idx for i in inputs], [i.topk_weights for i in inputs],
                                             4)[ctx.rank]
        if not same_bits(combined, want):
            problems.append(f"after clean_low_latency_buffer ({skip} skipped): combine differs")
        buf.check_errors()
        buf.destroy()
        messages.append((first, later))
    return messages, problems


def _assert_missing_peer(results):
    (dispatch, combine), problems = results[0]
    assert not problems and not results[1][1], (problems, results[1][1])
    for (first, later), what, where in ((dispatch, "dispatch", "low_latency_dispatch hook"),
                                        (combine, "combine", "low_latency_combine")):
        assert "rank 0: low-latency receive timed out" in first, first
        assert f"rank 1's {what} rows of call 1" in first and "clean_low_latency_buffer() on every rank" in first
        assert first.startswith((f"Buffer.{where}:", "Buffer.check_errors:")), first
        assert [m.split(":")[0] for m in later] == ["Buffer.low_latency_dispatch", "EventOverlap.current_stream_wait",
                                                    "Buffer.check_errors"], later
        assert all(f"rank 1's {what} rows of call 1" in m for m in later), later


def test_missing_peer_times_out(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("EPCOMM_TIMEOUT_S", "0.2")
    _assert_missing_peer(spawn(_missing_peer, 2, device="cpu", timeout_s=300))


def _repeated_ids(ctx):
    """Every token selects expert 0 twice (ids within a token must be distinct): 2 * T rows per source arrive
    for one expert, whose output holds R * T; the first R * T (source 0's, in order) are kept and the rest
    are reported as dropped, not written past the expert's rows. The Buffer does not return such a result: the
    call raises (on GPUs: the next interaction with the Buffer), so the rows are read from the transport."""
    from epcomm.buffer import Buffer
    from epcomm.errors import EpcommError
    from epcomm.transports.base import LowLatencyDispatchRequest

    t = 4
    x = torch.randn(t, 128).to(torch.bfloat16)
    idx = torch.zeros(t, 2, dtype=torch.int64)
    buf = Buffer(ctx.group, transport=NVLinkTransport, **NVL)
    res = buf.runtime.low_latency_dispatch(LowLatencyDispatchRequest(x, idx, t, 4, False, False, False, False, None))
    messages = []
    calls = (buf.check_errors, lambda: buf.low_latency_dispatch(x, idx[:, :1], t, 4)) if ctx.rank == 0 else ()
    for call in calls:  # rank 0's second call raises before it launches: rank 1 must not make it
        try:
            call()
        except EpcommError as exc:
            messages.append(str(exc))
    out = (res.handle.recv_count.tolist(), res.handle.src_info[0].tolist(), messages)
    torch.distributed.barrier(group=ctx.group)
    buf.destroy()
    return out


def test_repeated_expert_ids_drop_rows_and_say_so(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    (count0, src0, msgs0), (count1, _, msgs1) = spawn(_repeated_ids, 2, device="cpu", timeout_s=300)
    assert count0 == [8, 0] and count1 == [0, 0], (count0, count1)
    assert src0 == [0, 0, 1, 1, 2, 2, 3, 3], src0  # source 0's rows, token order
    assert len(msgs0) == 2 and msgs0[0].startswith("Buffer.check_errors:"), msgs0
    assert msgs0[1].startswith("Buffer.low_latency_dispatch:"), msgs0  # sticky: the next call raises too
    assert all("rank 0: 8 low-latency rows did not fit" in m and "distinct" in m for m in msgs0), msgs0
    assert msgs1 == [], msgs1  # rank 1 received nothing wrong


def _precast(ctx):
    """Pre-cast FP8 input (what the hierarchical path forwards): e4m3 rows and float32 scales cast by
    ``epcomm.fp8`` go through the one-sided kernel's PRECAST variant and the portable transport as they are, for
    per-128 scales, power-of-two scales and UE8M0 (a partial last word): the same bits as a call that casts."""
    from epcomm.buffer import Buffer
    from epcomm.fp8 import per_token_cast_to_fp8
    from epcomm.testing.routing import make_inputs
    from epcomm.transports.alltoall import AllToAllTransport
    from epcomm.transports.base import LowLatencyDispatchRequest

    t_max, hidden, num_experts, topk = 5, 640, 6, 3
    inputs = make_inputs(61, ctx.world_size, (4, 0, 5), hidden, num_experts, topk, "dropped", torch.bfloat16)
    mine = inputs[ctx.rank].to(ctx.device)
    problems = []
    for transport, kw in ((NVLinkTransport, NVL), (AllToAllTransport, {})):
        buf = Buffer(ctx.group, transport=transport, **kw)
        for round_scale, ue8m0 in ((False, False), (True, False), (True, True)):
            xq, scales = per_token_cast_to_fp8(mine.x, round_scale)
            res = buf.runtime.low_latency_dispatch(LowLatencyDispatchRequest(
                xq, mine.topk_idx, t_max, num_experts, True, round_scale, ue8m0, False, None, x_scales=scales))
            ref = _reference(inputs, dict(round_scale=round_scale, use_ue8m0=ue8m0), num_experts)[ctx.rank]
            _check_dispatch(problems, f"{transport.__name__} round={round_scale} ue8m0={ue8m0}",
                            (res.recv_x, res.recv_scales), res.recv_count, res.handle, ref, True)
        torch.distributed.barrier(group=ctx.group)
        buf.destroy()
    return problems


def test_precast_input_is_stored_as_it_is(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for rank, problems in enumerate(spawn(_precast, 3, device="cpu", timeout_s=600)):
        assert problems == [], (rank, problems)


def test_precast_input_is_checked():
    from epcomm.core.validate import check_precast
    from epcomm.fp8 import per_token_cast_to_fp8

    xq, scales = per_token_cast_to_fp8(torch.randn(3, 256), True, False)
    check_precast("f", xq, scales, True)
    for args, error, match in (((xq, scales, False), ValueError, "f: pre-cast FP8 input .* needs use_fp8=True"),
                               ((xq.float(), scales, True), TypeError, "f: pre-cast x must be a float8_e4m3fn"),
                               ((xq, scales[:, :1], True), TypeError, r"scales must be float32 \[3, 2\]"),
                               ((xq, scales.view(torch.int32), True), TypeError, "scales must be float32"),
                               ((xq, scales.t().contiguous().t(), True), ValueError, "must be contiguous")):
        with pytest.raises(error, match=match):
            check_precast("f", *args)


# ---------------------------------------------------------------------------------------------------------
# without the interpreter
# ---------------------------------------------------------------------------------------------------------
def _interpreted(fn) -> bool:
    return type(fn).__name__ == "InterpretedFunction"


def test_fp8_conversion_helper_matches_torch():
    """f32_to_e4m3_bits (run in a subprocess under the interpreter) against torch, on every class of value."""
    import subprocess
    import sys

    code = r"""
import torch, triton, triton.language as tl
from epcomm.kernels.low_latency import f32_to_e4m3_bits
@triton.jit
def k(x_ptr, o_ptr, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(o_ptr + o, f32_to_e4m3_bits(tl.load(x_ptr + o)))
g = torch.Generator().manual_seed(0)
special = torch.tensor([0.0, -0.0, 448.0, -448.0, 464.0, 479.9, 480.0, 1e9, float("inf"), float("-inf"),
                        float("nan"), 2.0 ** -6, 2.0 ** -7, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -11, 1e-40, -1e-30,
                        1.0625, 1.1875, 17.0, 19.0, -0.0087890625])
x = torch.cat([special, torch.randn(4096, generator=g) * 100, torch.randn(4096, generator=g) * 1e-3,
               (torch.rand(4096, generator=g) - 0.5) * 960])
n = 1 << (x.numel() - 1).bit_length()
x = torch.cat([x, torch.zeros(n - x.numel())])
out = torch.empty(n, dtype=torch.uint8)
k[(1,)](x, out, N=n)
want = x.to(torch.float8_e4m3fn).view(torch.uint8)
bad = (out != want).nonzero().flatten()
print("BAD", [(float(x[i]), int(out[i]), int(want[i])) for i in bad[:5]], int(bad.numel()))
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("0"), proc.stdout


def _sample_args():
    from epcomm.core.layout import low_latency_area

    t, h, k, e, r = 128, 7168, 8, 288, 4
    e_l = e // r
    lay = low_latency_area(t, h, r, e_l, k, h, h // 128)
    common = dict(RANK=1, R=r, R_P=4, T=t, K=k, E_L=e_l, E_LP=128, H=h, OFF_FLAG=9216, USE_PTX=True, USE_TIMER=True,
                  num_warps=8)
    disp = dict(common, K_P=8, KPER=4, FP8=True, ROUND=False, UE8M0=False, PRECAST=False, XW=h // 4, XWP=2048,
                SW=h // 128, SWP=64, G4P=16, C=lay["cap"], OFF_D=9472, D_BYTES=lay["dispatch_bytes"],
                OFF_PAY=lay["pay"], OFF_SCL=lay["scl"], OFF_META=lay["meta"], OFF_CNT=lay["cnt"], JB=1024, EB=8,
                ROWS=4, FB=1024)
    comb = dict(common, HWP=4096, OFF_C=9472 + 2 * lay["dispatch_bytes"], C_BYTES=lay["combine_bytes"], ROWS=2,
                BC=2048)
    x = torch.empty(t, h, dtype=torch.bfloat16)
    idx = torch.empty(t, k, dtype=torch.int64)
    w = torch.empty(t, k, dtype=torch.float32)
    i32, i64 = torch.empty(8, dtype=torch.int32), torch.empty(8, dtype=torch.int64)
    d_args = (x, i64, idx, torch.empty(8, dtype=torch.float8_e4m3fn), torch.empty(8), i32, i64, i64, t, 3, 1 << 40,
              10 ** 10)
    c_args = (x, idx, w, x, i32, i64, i64, t, 3, 1 << 40, 10 ** 10)
    return disp, comb, d_args, c_args


def test_launcher_passes_arguments_in_signature_order():
    """The cached fast launch passes exactly what Triton's binder hands the compiled kernel."""
    from epcomm.kernels import low_latency as K

    if _interpreted(K.ll_dispatch_kernel):
        pytest.skip("kernels are interpreted in this process")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature
        backend = make_backend(GPUTarget("cuda", 90, 32))
    except Exception as e:  # noqa: BLE001 - another Triton version's internals
        pytest.skip(f"cannot drive Triton's binder offline here: {e}")
    disp, comb, d_args, c_args = _sample_args()
    for stage, args in ((K.dispatch_launcher(disp), d_args), (K.combine_launcher(comb), c_args)):
        kernel = stage.launcher.kernel
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        for send, recv in ((True, True), (True, False), (False, True)):
            bound, _, _ = binder(*args, **stage.kwargs(send, recv))
            assert list(bound.values()) == list(stage.launcher.arguments(args, stage.kwargs(send, recv)))


def test_kernels_compile_for_sm90():
    """The GPU code path through Triton's real compiler (no GPU needed): vector accesses, the ordering
    instructions, and no FMA in the combine's reduction."""
    from epcomm.kernels import low_latency as K

    if _interpreted(K.ll_dispatch_kernel):
        pytest.skip("kernels are interpreted in this process")
    from conftest import sm90_compiler

    compile_for = sm90_compiler()
    disp, comb, d_args, c_args = _sample_args()
    ptx = compile_for(K.ll_dispatch_kernel, d_args, dict(disp, DO_SEND=True, DO_RECV=True)).asm["ptx"]
    for needle in ("st.global.v4", "ld.global.cg.v4", "fence.acq_rel.sys", "st.release.sys", "ld.acquire.sys.global",
                   "%globaltimer", "div.rn.f32"):
        assert needle in ptx, f"dispatch PTX lacks {needle}"
    ptx = compile_for(K.ll_combine_kernel, c_args, dict(comb, DO_SEND=True, DO_RECV=True,
                                                        enable_fp_fusion=False)).asm["ptx"]
    for needle in ("st.global.v4", "ld.global.cg.v4", "st.release.sys", "ld.acquire.sys.global", "mul.rn.f32"):
        assert needle in ptx, f"combine PTX lacks {needle}"
    assert "fma" not in ptx, "the combine's products must be rounded before the add (no FMA)"
