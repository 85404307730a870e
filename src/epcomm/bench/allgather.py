"""``python -m epcomm bench allgather``: one-sided all-gather against NCCL ``all_gather_into_tensor``.

``size`` is the gathered output per rank (nccl-tests convention); each rank contributes ``size / R`` bytes.
Methods: ``nccl`` (``all_gather_into_tensor``, gloo on CPUs), ``epcomm`` (``epcomm.shmem.AllGather``: each
rank puts its shard into every peer and signals, one kernel per call) and, on GPUs, ``epcomm_graph`` (the
same call replayed from a CUDA graph, which its device-side epochs allow). ``*_GBps`` is algorithm
bandwidth (size / time), ``*_busGBps`` bus bandwidth (size * (R-1)/R / time). Results:
``<out>/allgather.{csv,md,png}``."""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist

from .p2p import TIMING_NOTE, bench_parser, fill, finish_worker, format_size, measure, run_bench, tune_copy

log = logging.getLogger(__name__)
# all_gather_into_tensor was renamed all_gather_single (torch 2.13); the GPU machines have an older torch
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _worker(ctx, sizes: list, iters: int, warmup: int, tune: bool, graph: bool) -> Optional[dict]:
    from ..shmem import AllGather, SymmetricHeap

    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    shards = [max(16, (n // world) // 16 * 16) for n in sizes]
    top = max(shards)
    heap = SymmetricHeap(ctx.group, AllGather.heap_bytes(world, top), device=dev)
    ag = AllGather(heap, top)
    src = fill(top, rank, dev)
    out = torch.empty(world * top, dtype=torch.uint8, device=dev)
    cuda = dev.type == "cuda"
    notes = []
    if tune and cuda and heap.copy_config is not None:
        n = min(top, (256 << 20) // world)

        def with_config(cfg, n=n):
            def call():
                ag.config = cfg
                ag(src[:n])
            return call

        best, t = tune_copy(ctx, with_config, n * world)
        ag.config = best
        notes.append(f"tuned at {format_size(n * world)} gathered: {best} ({t.gbps(n * world):.1f} GB/s)")
    base = "nccl" if cuda else "gloo"
    rows = []
    for size, n in zip(sizes, shards):
        s, o = src[:n], out[:world * n]

        def epcomm(s=s, protocol="auto"):
            ag.protocol = protocol
            return ag(s)

        methods = {base: lambda s=s, o=o: _all_gather(o, s, group=ctx.group), "epcomm": epcomm}
        lines = ag.sends_lines(n, s.data_ptr())
        if lines:  # the small-shard protocol was used: also time the direct one
            methods["epcomm_direct"] = lambda s=s: epcomm(s, "direct")
        timings = measure(ctx, methods, [m for m in methods if m != base], iters, warmup, graph)
        total = world * n
        row = {"size": format_size(total), "bytes": total, "shard_bytes": n,
               "protocol": "lines" if lines else "direct"}
        for name, t in timings.items():
            row[f"{name}_us"] = t.median_us
        for name, t in timings.items():
            if not name.endswith(("_iso", "_host")):
                row[f"{name}_GBps"] = t.gbps(total)
                row[f"{name}_busGBps"] = t.gbps(total * (world - 1) / world)
        row["epcomm_vs_" + base] = timings[base].median_us / timings["epcomm"].median_us
        ok = True
        for protocol in ("auto", "direct"):
            got = epcomm(s, protocol)
            heap.check_errors()
            ok = ok and all(torch.equal(got[p], fill(n, p, dev)) for p in range(world))
        row["ok"] = ok
        rows.append(row)
        log.info("bench allgather: %s", row)
    return finish_worker(heap, rank, rows, notes, base)


def main(argv: Optional[list] = None) -> int:
    args = bench_parser("python -m epcomm bench allgather", __doc__, "allgather",
                        "gathered bytes per rank").parse_args(argv)
    notes = [f"{args.world_size} ranks; size = gathered bytes per rank (each rank contributes size/R, rounded down "
             f"to a multiple of 16); {args.iters} iterations after {args.warmup} warm-up. `epcomm` uses the protocol "
             "in `protocol` (`lines`: data and flag in one 8-byte line, for small shards; `direct`: puts into the "
             "peers' outputs after a ready flag, then done flags); `epcomm_direct` forces the direct protocol where "
             "`lines` applies. `epcomm_vs_{base}` = {base} time / epcomm time (device time in a stream). `ok`: the "
             "gathered data was checked (both protocols).", TIMING_NOTE,
             "Target (H200 NVLink): epcomm beats NCCL at sizes <= 1 MiB."]
    return run_bench(args, _worker, "allgather", "epcomm bench allgather: one-sided all-gather", notes,
                     lambda base: [base, "epcomm", "epcomm_graph", "epcomm_direct"])
