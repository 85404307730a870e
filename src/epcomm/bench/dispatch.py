"""``python -m epcomm bench dispatch``: normal-mode dispatch and combine, side by side in one run.

For each routing (uniform, skewed) it measures, at the given shape (default 4096 tokens per rank, hidden
7168, top-8, 256 experts):
  * every requested epcomm transport: dispatch FP8, dispatch BF16, combine BF16 (whole calls, with the
    layout given as DeepEP's benchmarks do), the cached dispatch (handle reuse: no layout exchange), and
    ``get_dispatch_layout``; on GPUs also the cached dispatches and the combine in a stream of calls (device
    time per call) and by the summed durations of their kernels (kernel-only), and graph replays;
  * the plain NCCL pipeline a user would write (``epcomm.bench.baseline``), layout included;
  * the copy-engine ceiling: every rank copies its rows for every peer straight into the peer's memory
    with ``copy_`` (one stream per peer), the same bytes as the dispatch.
GB/s (DeepEP) = mean bytes of rows received per rank, its own included, over the median time; NVLink GB/s
counts only rows that cross GPUs."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..testing import run
from .report import bench_parser, finish
from .timing import time_graph, time_kernels, time_op, time_stream
from .traffic import normal_traffic, row_bytes


@dataclass(frozen=True)
class DispatchBenchOptions:
    tokens: int
    hidden: int
    topk: int
    experts: int
    routings: tuple
    transports: tuple
    iters: int
    num_sms: Optional[int]
    configs: tuple = ()  # (num_sms, tokens per step) pairs (None: the defaults) swept for the one-sided transports
    strict_sms: Optional[bool] = None  # Config.strict_sms of every epcomm call


def _copy_engine_ceiling(ctx, in_rank: torch.Tensor, hidden_bytes: int, iters: int):
    """Time copying every rank's outgoing rows into its peers' memory with the copy engine."""
    try:
        from ..shmem import SymmetricHeap
    except ImportError:
        return None
    num_ranks = ctx.world_size
    counts = in_rank.sum(0).tolist()
    all_counts = [None] * num_ranks
    torch.distributed.all_gather_object(all_counts, counts, group=ctx.group)
    recv_rows = [sum(all_counts[s][r] for s in range(num_ranks)) for r in range(num_ranks)]
    heap = SymmetricHeap(ctx.group, max(recv_rows) * hidden_bytes + (1 << 20))
    dst = heap.empty((max(recv_rows), hidden_bytes), torch.uint8)
    src = torch.empty(in_rank.size(0), hidden_bytes, dtype=torch.uint8, device=ctx.device).random_()
    streams = [torch.cuda.Stream(ctx.device) for _ in range(num_ranks)]
    # rank s writes its rows for rank r after the rows of ranks < s
    offsets = [sum(all_counts[p][r] for p in range(ctx.rank)) for r in range(num_ranks)]
    peers = [heap.peer_tensor(dst, r) for r in range(num_ranks)]
    rows = [src[: counts[r]] for r in range(num_ranks)]

    def copy_all():
        cur = torch.cuda.current_stream()
        for r in range(num_ranks):
            peer = (ctx.rank + r) % num_ranks
            streams[peer].wait_stream(cur)
            with torch.cuda.stream(streams[peer]):
                peers[peer][offsets[peer]:offsets[peer] + counts[peer]].copy_(rows[peer])
        for s in streams:
            cur.wait_stream(s)

    timing = time_op(copy_all, ctx.group, ctx.device, iters=iters, warmup=3)
    heap.destroy()
    return timing


def bench_worker(ctx, opts: DispatchBenchOptions) -> list:
    from ..buffer import Buffer, Config
    from ..fp8 import per_token_cast_to_fp8
    from ..testing.routing import make_inputs
    from .baseline import baseline_combine, baseline_dispatch

    if opts.num_sms is not None:
        Buffer.set_num_sms(opts.num_sms)
    rows = []
    shape = f"{opts.tokens}x{opts.hidden} top{opts.topk}/{opts.experts}"
    for routing in opts.routings:
        inputs = make_inputs(7, ctx.world_size, opts.tokens, opts.hidden, opts.experts, opts.topk, routing)
        traffic = normal_traffic([i.topk_idx for i in inputs], opts.experts)
        mine = inputs[ctx.rank].to(ctx.device)
        x, idx, w = mine.x, mine.topk_idx, mine.topk_weights
        x_fp8 = per_token_cast_to_fp8(x)
        del inputs

        def add(impl, op, timing, kind):
            if timing is None:
                return
            rows.append({
                "routing": routing, "impl": impl, "op": op, "shape": shape, "ranks": ctx.world_size,
                "time_us": timing.median_us, "min_us": timing.min_us,
                "GB/s (DeepEP)": timing.gbps(traffic.mean_recv_bytes(opts.hidden, kind)) if kind else float("nan"),
                "NVLink GB/s": timing.gbps(traffic.mean_remote_bytes(opts.hidden, kind)) if kind else float("nan"),
            })

        def failed(impl, what, exc):  # a measurement a transport cannot give is reported, not skipped
            rows.append({"routing": routing, "impl": impl, "op": f"{what} failed: {exc}"[:160], "shape": shape,
                         "ranks": ctx.world_size, "time_us": float("nan"), "min_us": float("nan"),
                         "GB/s (DeepEP)": float("nan"), "NVLink GB/s": float("nan")})

        def t(fn):
            return time_op(fn, ctx.group, ctx.device, iters=opts.iters, warmup=3)

        def s(fn):
            return time_stream(fn, ctx.group, ctx.device, iters=opts.iters, warmup=3)

        def k(fn):  # every kernel the call launches, as in s(): their summed durations
            return time_kernels(fn, None, ctx.group, ctx.device, iters=opts.iters, warmup=3)

        for transport in opts.transports:
            buf = Buffer(ctx.group, transport=transport)
            one_sided = buf.runtime.capabilities().one_sided
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, opts.experts)
            layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                          topk_idx=idx, topk_weights=w)
            graphs = ctx.device.type == "cuda" and buf.runtime.capabilities().sync_free_normal
            worst = ctx.world_size * opts.tokens  # the most rows a rank can receive
            gbuf = buf  # the graph rows' Buffer: num_worst_tokens gives every source a region of `worst` rows,
            if graphs and one_sided:  # ~3.8 GB at 8 ranks and this shape, more than the default buffer
                need = Buffer.get_normal_size_hint(worst, row_bytes(opts.hidden, "bf16") + 12 * opts.topk,
                                                   ctx.world_size)  # a BF16 row, its top-k ids and weights
                gbuf = Buffer(ctx.group, transport=transport, num_nvl_bytes=need)
            for conf in (opts.configs if one_sided and opts.configs else ((opts.num_sms, 6),)):
                cfg = None if conf is None else Config(conf[0], conf[1], max(conf[1], 256))  # None: the defaults
                ccfg = cfg  # the combine's
                if opts.strict_sms is not None:
                    cfg = replace(cfg or Buffer.get_dispatch_config(ctx.world_size), strict_sms=opts.strict_sms)
                    ccfg = replace(ccfg or Buffer.get_combine_config(ctx.world_size), strict_sms=opts.strict_sms)
                label = ("default config" if conf is None else f"sms={conf[0]} tok={conf[1]}") + (
                    " strict_sms" if opts.strict_sms else "")
                name = f"epcomm-{buf.transport}" + (f" {label}" if one_sided else "")
                recv_x, _, _, _, handle, _ = buf.dispatch(x, **layout, config=cfg)
                add(name, "get_dispatch_layout", t(lambda: buf.get_dispatch_layout(idx, opts.experts)), None)
                add(name, "dispatch FP8", t(lambda: buf.dispatch(x_fp8, **layout, config=cfg)), "fp8")
                add(name, "dispatch BF16", t(lambda: buf.dispatch(x, **layout, config=cfg)), "bf16")
                add(name, "dispatch FP8 cached", t(lambda: buf.dispatch(x_fp8, handle=handle, config=cfg)), "fp8")
                add(name, "dispatch BF16 cached", t(lambda: buf.dispatch(x, handle=handle, config=cfg)), "bf16")
                add(name, "combine BF16", t(lambda: buf.combine(recv_x, handle, config=ccfg)), "bf16")
                if ctx.device.type == "cuda":  # DeepEP's method: cached handle, a stream of calls, L2 flushed
                    add(name, "dispatch FP8 cached (stream)",
                        s(lambda: buf.dispatch(x_fp8, handle=handle, config=cfg)), "fp8")
                    add(name, "dispatch BF16 cached (stream)", s(lambda: buf.dispatch(x, handle=handle, config=cfg)),
                        "bf16")
                    add(name, "combine BF16 (stream)", s(lambda: buf.combine(recv_x, handle, config=ccfg)), "bf16")
                    kernel_rows = (
                        ("dispatch FP8 cached (kernel)", lambda: buf.dispatch(x_fp8, handle=handle, config=cfg), "fp8"),
                        ("dispatch BF16 cached (kernel)", lambda: buf.dispatch(x, handle=handle, config=cfg), "bf16"),
                        ("combine BF16 (kernel)", lambda: buf.combine(recv_x, handle, config=ccfg), "bf16"))
                    for op, fn, kind in kernel_rows:
                        try:
                            add(name, op, k(fn), kind)
                        except Exception as exc:  # noqa: BLE001 - e.g. a profiler that lists no kernels
                            failed(name, op, exc)

                def layout_and_dispatch():
                    pr, _, pe, ir, _ = buf.get_dispatch_layout(idx, opts.experts)
                    buf.dispatch(x_fp8, num_tokens_per_rank=pr, is_token_in_rank=ir, num_tokens_per_expert=pe,
                                 topk_idx=idx, topk_weights=w, config=cfg)

                add(name, "layout + dispatch FP8", t(layout_and_dispatch), "fp8")
                if graphs:
                    def graph_step(fp8=False):
                        r = gbuf.dispatch(x_fp8 if fp8 else x, **layout, config=cfg, num_worst_tokens=worst)
                        return r

                    try:
                        add(name, "dispatch FP8 (graph, num_worst_tokens)",
                            time_graph(lambda: graph_step(True), ctx.group, ctx.device, iters=opts.iters), "fp8")
                        add(name, "dispatch BF16 (graph, num_worst_tokens)",
                            time_graph(graph_step, ctx.group, ctx.device, iters=opts.iters), "bf16")
                        g_recv, _, _, _, g_handle, _ = graph_step()
                        add(name, "combine BF16 (graph, num_worst_tokens)",
                            time_graph(lambda: gbuf.combine(g_recv, g_handle, config=ccfg), ctx.group, ctx.device,
                                       iters=opts.iters), "bf16")
                        del g_recv, g_handle
                    except Exception as exc:  # noqa: BLE001 - a transport that cannot be captured is reported
                        failed(name, "graph capture", exc)
                del recv_x, handle
            if gbuf is not buf:
                gbuf.destroy()
            buf.destroy()

        add("nccl-baseline", "dispatch FP8",
            t(lambda: baseline_dispatch(x_fp8[0], x_fp8[1], idx, w, opts.experts, ctx.group)), "fp8")
        add("nccl-baseline", "dispatch BF16",
            t(lambda: baseline_dispatch(x, None, idx, w, opts.experts, ctx.group)), "bf16")
        b_recv, _, _, _, b_handle = baseline_dispatch(x, None, idx, w, opts.experts, ctx.group)
        add("nccl-baseline", "combine BF16", t(lambda: baseline_combine(b_recv, b_handle, ctx.group)), "bf16")
        del b_recv, b_handle
        if ctx.device.type == "cuda":
            from ..core.layout import compute_dispatch_layout

            in_rank = compute_dispatch_layout(idx, opts.experts, ctx.world_size)[2]
            for kind in ("fp8", "bf16"):
                add("copy-engine", f"ceiling {kind.upper()}",
                    _copy_engine_ceiling(ctx, in_rank, row_bytes(opts.hidden, kind), opts.iters), kind)
    return rows


def _plot(rows, path):
    import matplotlib.pyplot as plt

    ops = [r for r in rows if r["routing"] == "uniform" and r["GB/s (DeepEP)"] == r["GB/s (DeepEP)"]]
    labels = [f"{r['impl']}\n{r['op']}" for r in ops]
    fig, ax = plt.subplots(figsize=(max(6, len(ops) * 0.9), 4))
    ax.bar(range(len(ops)), [r["GB/s (DeepEP)"] for r in ops])
    ax.set_xticks(range(len(ops)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("GB/s (DeepEP convention)")
    ax.set_title(f"dispatch/combine, {ops[0]['ranks']} ranks, {ops[0]['shape']}" if ops else "")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("python -m epcomm bench dispatch", __doc__, experts=256, iters=20)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--routings", default="uniform,skewed")
    parser.add_argument("--num-sms", type=int, default=None,
                        help="Buffer.set_num_sms for every config (default: the traffic model's choice per call)")
    parser.add_argument("--configs", default="default",
                        help="one-sided transports: comma-separated num_sms:tokens_per_step pairs to sweep; "
                             "'default' uses Buffer.get_dispatch_config / get_combine_config")
    parser.add_argument("--strict-sms", action="store_true",
                        help="Config.strict_sms=True: the local passes too keep to num_sms (default: the Buffer's rule)")
    args = parser.parse_args(argv)
    opts = DispatchBenchOptions(args.tokens, args.hidden, args.topk, args.experts, tuple(args.routings.split(",")),
                                tuple(args.transports.split(",")), args.iters, args.num_sms,
                                tuple(None if c == "default" else tuple(int(v) for v in c.split(":"))
                                      for c in args.configs.split(",") if c), True if args.strict_sms else None)
    rows = run(bench_worker, args.world_size, opts)[0]
    name = args.name or f"bench_dispatch_{rows[0]['ranks']}ranks"
    notes = ("GB/s (DeepEP) = mean over ranks of the bytes of all rows a rank receives (its own included) / median "
             "time of the per-iteration max across ranks. NVLink GB/s counts only rows that cross GPUs. Row bytes: "
             "BF16 2H, FP8 H + 4H/128. Plain rows time an isolated call (a barrier before each: host work "
             "included); '(stream)' rows time a call in a steady stream of cached calls with the L2 flushed "
             "between them, as DeepEP's own benchmark does (device time per call; see epcomm.bench.timing); "
             "'(kernel)' rows time the same stream by the summed durations of the GPU kernels each call launches, "
             "read from the profiler (kernel-only: waits for peers inside the kernels included, launch gaps "
             "and host work not); "
             "'(graph)' rows replay a captured call. epcomm dispatch rows exclude the layout call (DeepEP's convention); "
             "'layout + dispatch' and the NCCL baseline include it. Copy-engine: each rank copy_()s its rows "
             "for every peer into that peer's memory, one stream per peer.")
    return finish(rows, name, args.out, "bench dispatch", notes, _plot, ["routing", "impl", "op", "time_us", "GB/s (DeepEP)", "NVLink GB/s"])
