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

from .p2p import bench_parser, fill, finish_worker, format_size, run_bench, tune_copy
from .timing import time_graph, time_op

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
        methods = {base: lambda s=s, o=o: _all_gather(o, s, group=ctx.group),
                   "epcomm": lambda s=s: ag(s)}
        timings = {name: time_op(fn, ctx.group, dev, iters=iters, warmup=warmup) for name, fn in methods.items()}
        if graph and cuda:
            try:
                timings["epcomm_graph"] = time_graph(methods["epcomm"], ctx.group, dev, iters=iters, warmup=warmup)
            except Exception as e:  # noqa: BLE001 - report, keep benchmarking
                log.warning("bench allgather: capture failed at %d bytes: %s", n, e)
        total = world * n
        row = {"size": format_size(total), "bytes": total, "shard_bytes": n}
        for name, t in timings.items():
            row[f"{name}_us"] = t.median_us
        for name, t in timings.items():
            row[f"{name}_GBps"] = t.gbps(total)
            row[f"{name}_busGBps"] = t.gbps(total * (world - 1) / world)
        row["epcomm_vs_" + base] = timings[base].median_us / timings["epcomm"].median_us
        got = ag(s)
        heap.check_errors()
        row["ok"] = all(torch.equal(got[p], fill(n, p, dev)) for p in range(world))
        rows.append(row)
        log.info("bench allgather: %s", row)
    return finish_worker(heap, rank, rows, notes, base)


def main(argv: Optional[list] = None) -> int:
    args = bench_parser("python -m epcomm bench allgather", __doc__, "allgather",
                        "gathered bytes per rank").parse_args(argv)
    notes = [f"{args.world_size} ranks; size = gathered bytes per rank (each rank contributes size/R, rounded down "
             f"to a multiple of 16). Median of the per-iteration max over ranks, {args.iters} iterations after "
             f"{args.warmup} warm-up. `epcomm_vs_{{base}}` = {{base}} time / epcomm time. `ok`: the gathered data "
             "was checked.",
             "Target (H200 NVLink): epcomm beats NCCL at sizes <= 1 MiB."]
    return run_bench(args, _worker, "allgather", "epcomm bench allgather: one-sided all-gather", notes,
                     lambda base: [base, "epcomm", "epcomm_graph"])
