"""The one-sided low-latency path on GPUs (``epcomm.transports.low_latency``), beyond the Buffer suite's
LowLatencyCase/GraphCase runs (tests/gpu/test_buffer_gpu.py, transport "nvlink"): a missing peer becomes an
exception after the timeout, the interpreter suite's patterns (two micro-batches with hooks, two Buffers,
zero-copy, the size hint) with the real kernels, and one CUDA graph holding two micro-batches with hooks on
one Buffer and a plain step on a second Buffer, replayed with new data, and hundreds of calls issued ahead of
the device."""

import pytest
import torch

from conftest import gpu_ranks
from epcomm.testing import spawn
from test_low_latency_interpreter import _assert_clean, _assert_missing_peer, _missing_peer, _patterns


def _need(n: int) -> None:
    if gpu_ranks() < n:
        pytest.skip(f"needs {n} GPUs, found {gpu_ranks()}")


@pytest.mark.gpu
def test_gpu_missing_peer_times_out(monkeypatch):
    _need(2)
    monkeypatch.setenv("EPCOMM_TIMEOUT_S", "2")
    _assert_missing_peer(spawn(_missing_peer, 2, device="cuda", timeout_s=300))


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_gpu_low_latency_patterns(world_size):
    _need(world_size)
    _assert_clean(spawn(_patterns, world_size, device="cuda", timeout_s=400))


def _graph_micro_batches(ctx, replays: int = 4, transport="nvlink", buffer_kwargs=None):
    """On CPUs (the interpreter: no graphs) the step runs eagerly for every 'replay', to check this test."""
    from epcomm import reference
    from epcomm.buffer import Buffer
    from epcomm.testing.checks import same_bits
    from epcomm.testing.routing import make_inputs

    rank, num_ranks, dev = ctx.rank, ctx.world_size, ctx.device
    t_max, hidden, num_experts, topk = 16, 512, 8 * num_ranks, 4
    e_local = num_experts // num_ranks
    n = t_max - rank  # fixed per rank, different across ranks
    bufs = [Buffer(ctx.group, transport=transport, **(buffer_kwargs or {})) for _ in range(2)]

    def data(seed):
        return make_inputs(seed, num_ranks, [t_max - r for r in range(num_ranks)], hidden, num_experts, topk,
                           "uniform", torch.bfloat16)

    static = [data(0)[rank].to(dev) for _ in range(3)]  # micro-batches 0, 1 on buffer 0; one step on buffer 1
    xs = [s.x.clone() for s in static]
    idxs = [s.topk_idx.clone() for s in static]
    ws = [s.topk_weights.clone() for s in static]
    fp8 = [True, False, False]

    def stand_in(rows):  # any elementwise function of the received rows
        return (rows.float() * 0.5).to(torch.bfloat16)

    def step():
        d = [bufs[0].low_latency_dispatch(xs[mb], idxs[mb], t_max, num_experts, use_fp8=fp8[mb],
                                          return_recv_hook=True) for mb in range(2)]
        for mb in range(2):
            d[mb][4]()
        c = [bufs[0].low_latency_combine(stand_in(d[mb][0][0] if fp8[mb] else d[mb][0]), idxs[mb], ws[mb], d[mb][2],
                                         return_recv_hook=True) for mb in range(2)]
        for mb in range(2):
            c[mb][2]()
        recv2, count2, handle2, _, _ = bufs[1].low_latency_dispatch(xs[2], idxs[2], t_max, num_experts, use_fp8=False)
        out2, _, _ = bufs[1].low_latency_combine(stand_in(recv2), idxs[2], ws[2], handle2)
        return [(d[0][0], d[0][1]), (d[1][0], d[1][1]), (recv2, count2)], [c[0][0], c[1][0], out2]

    graph = None
    if dev.type == "cuda":
        from epcomm.bench.timing import capture_graph

        graph, (disp, comb) = capture_graph(step)
    problems = []
    for it in range(1, replays + 1):
        steps = [data(100 * it + j) for j in range(3)]
        for j in range(3):
            xs[j].copy_(steps[j][rank].x)
            idxs[j].copy_(steps[j][rank].topk_idx)
            ws[j].copy_(steps[j][rank].topk_weights)
        if graph is not None:
            graph.replay()
            torch.cuda.synchronize()
        else:
            disp, comb = step()
        for j in range(3):
            inputs = steps[j]
            ref = reference.low_latency_dispatch([i.x for i in inputs], [i.topk_idx for i in inputs], num_experts,
                                                 use_fp8=fp8[j])
            recv, count = disp[j]
            data_, scales = recv if fp8[j] else (recv, None)
            if not same_bits(count, torch.tensor(ref[rank].count, dtype=torch.int32)):
                problems.append(f"replay {it} step {j}: recv_count")
            for e in range(e_local):
                c = ref[rank].count[e]
                if not same_bits(data_[e, :c], ref[rank].x[e]) or (
                        scales is not None and not same_bits(scales[e, :c], ref[rank].scales[e])):
                    problems.append(f"replay {it} step {j}: recv_x[{e}]")
            ys = [[stand_in(xe) for xe in r.x] for r in ref]
            want = reference.low_latency_combine(ys, ref, [i.topk_idx for i in inputs],
                                                 [i.topk_weights for i in inputs], num_experts)[rank]
            if not same_bits(comb[j], want):
                problems.append(f"replay {it} step {j}: combine")
    assert n == xs[0].size(0)
    for b in bufs:
        b.destroy()
    return [("graph micro-batches", problems)] if problems else []


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_gpu_graph_two_micro_batches_and_two_buffers(world_size):
    _need(world_size)
    _assert_clean(spawn(_graph_micro_batches, world_size, device="cuda", timeout_s=400))


def _stress(ctx, num_tokens: int, hook: bool, calls: int = 200):
    """Many calls without a host synchronisation: ``calls`` dispatch + combine pairs, then ``calls``
    combines back to back with the last handle (each reuses storage two calls later); errors recorded on the
    device and the last results against the reference."""
    from epcomm import reference
    from epcomm.buffer import Buffer
    from epcomm.testing.checks import same_bits
    from epcomm.testing.routing import make_inputs

    t_max, hidden, num_experts, topk = 128, 1024, 32 * ctx.world_size, 8
    inputs = make_inputs(9, ctx.world_size, num_tokens, hidden, num_experts, topk, "uniform", torch.bfloat16)
    mine = inputs[ctx.rank].to(ctx.device)
    ref = reference.low_latency_dispatch([i.x for i in inputs], [i.topk_idx for i in inputs], num_experts,
                                         use_fp8=False)
    want = reference.low_latency_combine([r.x for r in ref], ref, [i.topk_idx for i in inputs],
                                         [i.topk_weights for i in inputs], num_experts)[ctx.rank]
    buf = Buffer(ctx.group, transport="nvlink")
    problems = []

    def call(kind, *args, **kwargs):
        fn = buf.low_latency_dispatch if kind == "dispatch" else buf.low_latency_combine
        out = fn(*args, return_recv_hook=hook, **kwargs)
        if hook:
            out[-1]()
        return out

    for _ in range(calls):
        recv, count, handle, _, _ = call("dispatch", mine.x, mine.topk_idx, t_max, num_experts, use_fp8=False)
        combined = call("combine", recv, mine.topk_idx, mine.topk_weights, handle)[0]
    for _ in range(calls):
        combined = call("combine", recv, mine.topk_idx, mine.topk_weights, handle)[0]
    torch.cuda.synchronize()
    try:
        buf.check_errors()
    except Exception as exc:  # noqa: BLE001 - reported with the rank
        problems.append(str(exc))
    if not same_bits(count, torch.tensor(ref[ctx.rank].count, dtype=torch.int32)):
        problems.append("recv_count differs")
    if not same_bits(combined, want):
        problems.append("combine differs")
    buf.destroy()
    return [(f"stress {num_tokens} tokens, hook={hook}", problems)] if problems else []


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("num_tokens,hook", [(1, False), (8, True), (128, False)])
def test_gpu_stress_back_to_back_calls(world_size, num_tokens, hook, monkeypatch):
    """No hang and no wrong result over hundreds of calls issued ahead of the device (what a decode loop and
    the benchmarks do); a lost flag would show as a recorded timeout, a stall as the launcher's time limit."""
    _need(world_size)
    monkeypatch.setenv("EPCOMM_TIMEOUT_S", "10")
    _assert_clean(spawn(_stress, world_size, num_tokens, hook, device="cuda", timeout_s=300))
