"""``python -m epcomm bench low-latency``: decode-sized dispatch/combine.

For each token count (default 1, 8, 32, 128, 256 per rank) at hidden 7168, top-8, 288 experts, FP8
dispatch and BF16 combine, for every requested transport: plain calls, the hook halves (send returns,
``hook()`` receives), a stream of calls timed by events and (one-sided transports) by the duration of each
call's kernel, a CUDA-graph replay of dispatch + combine, graph replays of each alone, and graphs of 8
calls (or steps) timed per call (GPUs).
Per-call time is the median of the per-iteration max across ranks. GB/s counts per selected (token,
expert): dispatch H + 4H/128 + 16 bytes, combine 2H."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..testing import run
from .report import bench_parser, finish
from .timing import time_graph, time_kernels, time_op, time_stream
from .traffic import low_latency_bytes, low_latency_pairs


GRAPH_CALLS = 8  # calls captured in one graph for the per-call graph rows (a decode step's graph has many layers)


@dataclass(frozen=True)
class LowLatencyBenchOptions:
    token_counts: tuple
    hidden: int
    topk: int
    experts: int
    transports: tuple
    iters: int


def bench_worker(ctx, opts: LowLatencyBenchOptions) -> list:
    from ..buffer import Buffer
    from ..testing.routing import make_inputs

    rows = []
    max_tokens = max(opts.token_counts)
    for transport in opts.transports:
        buf = Buffer(ctx.group, transport=transport)
        impl = f"epcomm-{buf.transport}"
        for n in opts.token_counts:
            inputs = make_inputs(11, ctx.world_size, n, opts.hidden, opts.experts, opts.topk)
            pairs = low_latency_pairs([i.topk_idx for i in inputs])
            disp_b, comb_b = low_latency_bytes(opts.hidden, True)
            mine = inputs[ctx.rank].to(ctx.device)
            x, idx, w = mine.x, mine.topk_idx, mine.topk_weights

            def dispatch(hook=False):
                return buf.low_latency_dispatch(x, idx, max_tokens, opts.experts, use_fp8=True,
                                                return_recv_hook=hook)

            recv, _, handle, _, _ = dispatch()
            y = torch.randn(recv[0].shape, device=ctx.device).to(torch.bfloat16)

            def combine(hook=False):
                return buf.low_latency_combine(y, idx, w, handle, return_recv_hook=hook)

            def t(fn, setup=None):
                return time_op(fn, ctx.group, ctx.device, iters=opts.iters, warmup=3, flush_l2=False, setup=setup)

            pending = {}

            def send_dispatch():
                pending["hook"] = dispatch(hook=True)[4]

            def send_combine():
                pending["hook"] = combine(hook=True)[2]

            def recv():
                pending.pop("hook")()

            measured = [
                ("dispatch", t(dispatch), pairs * disp_b),
                ("combine", t(combine), pairs * comb_b),
                ("dispatch send (hook)", t(send_dispatch), None),
                ("dispatch recv (hook)", t(recv, setup=send_dispatch), None),
                ("combine send (hook)", t(send_combine), None),
                ("combine recv (hook)", t(recv, setup=send_combine), None),
            ]
            if ctx.device.type == "cuda":  # DeepEP's method: a stream of calls, the host ahead of the device
                def st(fn):
                    return time_stream(fn, ctx.group, ctx.device, iters=opts.iters, flush_l2=False)

                measured.append(("dispatch (stream)", st(dispatch), pairs * disp_b))
                measured.append(("combine (stream)", st(combine), pairs * comb_b))
                if buf.runtime.capabilities().one_sided:  # one kernel per call: its duration, as DeepEP reports
                    measured.append(("dispatch (kernel)", time_kernels(dispatch, "ll_dispatch_kernel", ctx.group,
                                                                       ctx.device, iters=opts.iters, flush_l2=False),
                                     pairs * disp_b))
                    measured.append(("combine (kernel)", time_kernels(combine, "ll_combine_kernel", ctx.group,
                                                                      ctx.device, iters=opts.iters, flush_l2=False),
                                     pairs * comb_b))
                d_send, d_recv = st((send_dispatch, recv))
                c_send, c_recv = st((send_combine, recv))
                measured += [("dispatch send (hook, stream)", d_send, None),
                             ("dispatch recv (hook, stream)", d_recv, None),
                             ("combine send (hook, stream)", c_send, None),
                             ("combine recv (hook, stream)", c_recv, None)]

                def step():
                    r, _, h, _, _ = buf.low_latency_dispatch(x, idx, max_tokens, opts.experts, use_fp8=True)
                    buf.low_latency_combine(y, idx, w, h)

                g_handle = buf.low_latency_dispatch(x, idx, max_tokens, opts.experts, use_fp8=True)[2]

                def g_dispatch():
                    return buf.low_latency_dispatch(x, idx, max_tokens, opts.experts, use_fp8=True)

                def g_combine():
                    return buf.low_latency_combine(y, idx, w, g_handle)

                # (row, function, in a stream, calls per graph, bytes per call)
                graphs = [("dispatch + combine (graph)", step, False, 1, pairs * (disp_b + comb_b)),
                          ("dispatch (graph, stream)", g_dispatch, True, 1, pairs * disp_b),
                          ("combine (graph, stream)", g_combine, True, 1, pairs * comb_b),
                          (f"dispatch + combine (graph of {GRAPH_CALLS}, per step)", step, True, GRAPH_CALLS,
                           pairs * (disp_b + comb_b)),
                          (f"dispatch (graph of {GRAPH_CALLS}, per call)", g_dispatch, True, GRAPH_CALLS,
                           pairs * disp_b),
                          (f"combine (graph of {GRAPH_CALLS}, per call)", g_combine, True, GRAPH_CALLS,
                           pairs * comb_b)]
                for op, fn, in_stream, calls, nbytes in graphs:
                    try:
                        measured.append((op, time_graph(fn, ctx.group, ctx.device, iters=opts.iters * 2,
                                                        stream=in_stream, calls=calls), nbytes))
                    except Exception as exc:  # noqa: BLE001 - record that the transport cannot be captured
                        rows.append({"impl": impl, "tokens": n, "op": op, "time_us": float("nan"),
                                     "GB/s": float("nan"), "note": f"capture failed: {exc}"})
            for op, timing, nbytes in measured:
                rows.append({"impl": impl, "tokens": n, "op": op, "time_us": timing.median_us,
                             "GB/s": timing.gbps(nbytes) if nbytes else float("nan"), "note": ""})
        buf.destroy()
    for r in rows:
        r.update(ranks=ctx.world_size, hidden=opts.hidden, topk=opts.topk, experts=opts.experts)
    return rows


def _plot(rows, path):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for impl in sorted({r["impl"] for r in rows}):
        for op in ("dispatch", "combine", "dispatch + combine (graph)"):
            pts = [(r["tokens"], r["time_us"]) for r in rows if r["impl"] == impl and r["op"] == op
                   and r["time_us"] == r["time_us"]]
            if pts:
                ax.plot(*zip(*sorted(pts)), marker="o", label=f"{impl} {op}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("time (us)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("python -m epcomm bench low-latency", __doc__, experts=288, iters=50)
    parser.add_argument("--tokens", default="1,8,32,128,256", help="tokens per rank, comma-separated")
    args = parser.parse_args(argv)
    opts = LowLatencyBenchOptions(tuple(int(v) for v in args.tokens.split(",")), args.hidden, args.topk,
                                  args.experts, tuple(args.transports.split(",")), args.iters)
    rows = run(bench_worker, args.world_size, opts)[0]
    name = args.name or f"bench_low_latency_{rows[0]['ranks']}ranks"
    notes = ("Per-call time: median over iterations of the max across ranks (CUDA events). GB/s per selected "
             "(token, expert): dispatch H + 4H/128 + 16 bytes, combine 2H. Plain rows time an isolated call (a "
             "barrier before each, host work included). '(stream)' rows time each call of a stream enqueued while "
             "the device is busy, as DeepEP's benchmark does (device time per call, waits for peers included; see "
             "epcomm.bench.timing). Hook rows time the send call and the hook() call separately. '(graph)' replays a "
             "captured dispatch + combine as an isolated call; '(graph, stream)' rows replay a captured dispatch, "
             f"or a captured combine, in a stream of replays; '(graph of {GRAPH_CALLS}, per call)' rows capture "
             f"{GRAPH_CALLS} calls (or dispatch + combine steps) in one graph and divide a replay's time by "
             f"{GRAPH_CALLS} (the replay's fixed cost "
             "shared, as in a decode step's graph with many layers). '(kernel)' rows: the '(stream)' calls timed by "
             "the duration of each call's one GPU kernel, read from the profiler as DeepEP's benchmarks do (waits for "
             "peers inside the kernel included; launch gaps, events and host work not).")
    return finish(rows, name, args.out, "bench low-latency", notes, _plot, ["impl", "tokens", "op", "time_us", "GB/s", "note"])
