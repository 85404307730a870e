"""``python -m epcomm bench p2p``: one-sided put/get against NCCL send/recv and the copy engine.

Ranks are paired (0<->1, 2<->3, ...) and both directions of every pair run at once. For every size each
method moves ``size`` bytes from each rank to its partner:

* ``nccl``: ``batch_isend_irecv`` send + recv (gloo on CPUs);
* ``ce``: the copy engine, ``peer_tensor(dst, partner).copy_(src)``;
* ``put``: ``SymmetricHeap.put`` (SM-driven Triton copy storing over NVLink);
* ``get``: ``SymmetricHeap.get`` (SM-driven, loading the partner's heap).

On GPUs the epcomm methods and the copy engine are also timed as CUDA-graph replays (``*_graph``: no
launch overhead). GB/s = size / median time (the slowest rank of each iteration), per direction. Before the
sweep the SM copy configuration (block bytes, warps, programs per SM) is tuned at a large size, separately
for put and get (``--no-tune`` keeps the default). Results: ``<out>/p2p.{csv,md,png}``."""

from __future__ import annotations

import argparse
import logging
import math
import re
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..testing import run
from .report import write_results
from .timing import time_graph, time_host, time_op, time_stream

log = logging.getLogger(__name__)

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """``"16K"`` -> 16384 (binary units K/M/G, optional ``B``/``iB``)."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"parse_size: {text!r} is not a size like 4096, 16K, 64MiB or 1G")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def parse_sizes(text: str) -> list[int]:
    """``"16K:1G"`` (powers of two from 16 KiB to 1 GiB) or ``"4,17,16K"`` (a list) -> byte counts."""
    if ":" in text:
        lo, hi = (parse_size(x) for x in text.split(":", 1))
        if lo <= 0 or hi < lo:
            raise ValueError(f"parse_sizes: {text!r} must be LOW:HIGH with 0 < LOW <= HIGH")
        out, n = [], lo
        while n <= hi:
            out.append(n)
            n *= 2
        return out
    sizes = [parse_size(x) for x in text.split(",") if x.strip()]
    if not sizes or min(sizes) <= 0:
        raise ValueError(f"parse_sizes: {text!r} must list positive sizes")
    return sizes


def format_size(n: int) -> str:
    """4096 -> ``4 KiB``; sizes that are not whole units stay in bytes."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def fill(n: int, rank: int, device: torch.device) -> torch.Tensor:
    """Cheap deterministic uint8 ``[n]`` per rank (any rank can rebuild any other's)."""
    return ((torch.arange(n, device=device, dtype=torch.int64) * (2 * rank + 3) + rank) % 251).to(torch.uint8)


def plot_gbps(methods: Sequence[str], title: str):
    """A ``write_results`` plot callback: GB/s of every ``<method>_GBps`` column against ``bytes``."""

    def plot(rows, path):
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 5))
        x = [r["bytes"] for r in rows]
        for m in methods:
            y = [r.get(f"{m}_GBps", float("nan")) for r in rows]
            if all(isinstance(v, float) and math.isnan(v) for v in y):
                continue
            ax.plot(x, y, marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes")
        ax.set_ylabel("GB/s")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)

    return plot


def tune_copy(ctx, fn_for_config, nbytes: int, iters: int = 5) -> tuple:
    """Time ``fn_for_config(cfg)()`` for a grid of ``CopyConfig``s at ``nbytes``; returns ``(best config,
    its Timing)``. Every rank sees the same timings (max across ranks), so every rank picks the same."""
    from ..kernels.shmem import CopyConfig

    best = None
    for block in (8192, 16384, 32768):
        for warps in (4, 8, 16):
            if block // (16 * 32 * warps) < 1:
                continue
            for per_sm in (1, 2, 4):
                cfg = CopyConfig(block_bytes=block, num_warps=warps, programs_per_sm=per_sm)
                t = time_op(fn_for_config(cfg), ctx.group, ctx.device, iters=iters, warmup=2)
                log.info("tune %s: %.1f us (%.1f GB/s)", cfg, t.median_us, t.gbps(nbytes))
                if best is None or t.median_us < best[1].median_us:
                    best = (cfg, t)
    return best


TIMING_NOTE = ("Columns per method: `_us` = device time per call in a stream of calls (the host enqueues ahead, "
               "each call bracketed by its own CUDA events, L2 flushed between calls; DeepEP's method), "
               "`_graph_us` = the same for CUDA-graph replays, `_iso_us` = an isolated call after a device barrier "
               "(includes host time the device waits for), `_host_us` = host time to issue one call. Each: median "
               "over iterations of the max over ranks. GB/s from `_us` and `_graph_us`.")


def measure(ctx, methods: dict, graph_names: Sequence[str], iters: int, warmup: int, graph: bool) -> dict:
    """Every timing of every method (``name -> fn``): ``name`` (stream), ``name_iso``, ``name_host`` and, on
    GPUs for ``graph_names``, ``name_graph`` (stream of replays); CPUs: ``name`` is the isolated time."""
    dev = ctx.device
    out = {}
    for name, fn in methods.items():
        if dev.type != "cuda":
            out[name] = time_op(fn, ctx.group, dev, iters=iters, warmup=warmup)
            continue
        out[name] = time_stream(fn, ctx.group, dev, iters=iters, warmup=warmup)
        out[f"{name}_iso"] = time_op(fn, ctx.group, dev, iters=iters, warmup=warmup)
        out[f"{name}_host"] = time_host(fn, ctx.group, dev, iters=iters, warmup=warmup)
    if graph and dev.type == "cuda":
        for name in graph_names:
            try:
                out[f"{name}_graph"] = time_graph(methods[name], ctx.group, dev, iters=iters, warmup=warmup,
                                                  stream=True)
            except Exception as e:  # noqa: BLE001 - report, keep benchmarking
                log.warning("bench: %s in a CUDA graph failed: %s", name, e)
    return out


def _worker(ctx, sizes: list, iters: int, warmup: int, tune: bool, graph: bool) -> Optional[dict]:
    from ..shmem import SymmetricHeap, heap_bytes_for

    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    if world % 2:
        raise ValueError(f"bench p2p: world size {world} must be even (ranks are paired 0<->1, 2<->3, ...)")
    partner = rank ^ 1
    top = max(sizes)
    heap = SymmetricHeap(ctx.group, heap_bytes_for([((top,), torch.uint8)]), device=dev)
    inbox = heap.empty(top, torch.uint8)
    src = fill(top, rank, dev)
    dst = torch.empty(top, dtype=torch.uint8, device=dev)
    recv = torch.empty(top, dtype=torch.uint8, device=dev)
    cuda = dev.type == "cuda"
    put_cfg = get_cfg = heap.copy_config
    notes = []
    if tune and cuda and put_cfg is not None:
        n = min(top, 256 << 20)
        put_cfg, tp = tune_copy(ctx, lambda c: (lambda: heap.put(inbox[:n], src[:n], partner, config=c)), n)
        get_cfg, tg = tune_copy(ctx, lambda c: (lambda: heap.get(dst[:n], inbox[:n], partner, config=c)), n)
        notes.append(f"tuned at {format_size(n)}: put {put_cfg} ({tp.gbps(n):.1f} GB/s), "
                     f"get {get_cfg} ({tg.gbps(n):.1f} GB/s)")
    base = "nccl" if cuda else "gloo"
    rows = []
    for n in sizes:
        s, d, r, box = src[:n], dst[:n], recv[:n], inbox[:n]
        peer_box = heap.peer_tensor(box, partner)

        def two_sided(s=s, r=r):
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, s, partner, ctx.group),
                                           dist.P2POp(dist.irecv, r, partner, ctx.group)])
            for q in reqs:
                q.wait()

        methods = {base: two_sided, "ce": lambda s=s, pb=peer_box: pb.copy_(s),
                   "put": lambda s=s, box=box: heap.put(box, s, partner, config=put_cfg),
                   "get": lambda d=d, box=box: heap.get(d, box, partner, config=get_cfg)}
        row = {"size": format_size(n), "bytes": n}
        timings = measure(ctx, methods, ("ce", "put", "get"), iters, warmup, graph)
        for name, t in timings.items():
            row[f"{name}_us"] = t.median_us
        for name, t in timings.items():
            if not name.endswith(("_iso", "_host")):
                row[f"{name}_GBps"] = t.gbps(n)
        row["put_vs_" + base] = row["put_GBps"] / row[f"{base}_GBps"]
        row["put_vs_ce"] = row["put_GBps"] / row["ce_GBps"]
        # the data really arrived: after a barrier the partner's bytes are in this rank's inbox
        heap.put(box, s, partner, config=put_cfg)
        heap.barrier()
        ok = bool(torch.equal(box, fill(n, partner, dev)))
        heap.get(d, box, partner, config=get_cfg)
        heap.barrier()
        row["ok"] = ok and bool(torch.equal(d, s))
        rows.append(row)
        log.info("bench p2p: %s", row)
    return finish_worker(heap, rank, rows, notes, base)


def finish_worker(heap, rank: int, rows: list, notes: list, base: str) -> Optional[dict]:
    """Destroy the heap; rank 0 hands its rows back to ``run_bench``, the others None."""
    heap.destroy()
    return {"rows": rows, "notes": notes, "base": base} if rank == 0 else None


def bench_parser(prog: str, doc: str, name: str, sizes_help: str) -> argparse.ArgumentParser:
    """The options every one-sided benchmark takes (p2p, allgather)."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    default_ws = torch.cuda.device_count() if torch.cuda.device_count() >= 2 else 2
    parser.add_argument("--world-size", type=int, default=default_ws, help="ranks (default: GPUs, or 2)")
    parser.add_argument("--out", default="benchmarks/results", help=f"directory for {name}.csv/.md/.png")
    parser.add_argument("--sizes", default=None,
                        help=sizes_help + ": LOW:HIGH powers of two or a comma list (default 16K:1G on GPUs, "
                        "16K:1M on CPUs)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-tune", action="store_true", help="skip tuning the SM copy configuration")
    parser.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph timings")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    return parser


def run_bench(args, worker, name: str, title: str, notes: list, methods_of) -> int:
    """Spawn (or join torchrun with) ``worker(ctx, sizes, iters, warmup, tune, graph)``, write rank 0's
    ``{"rows", "notes", "base"}`` with ``write_results`` and return 1 if a row failed its data check."""
    on_gpu = args.device != "cpu" and torch.cuda.device_count() >= args.world_size
    sizes = parse_sizes(args.sizes or ("16K:1G" if on_gpu else "16K:1M"))
    out = run(worker, args.world_size, sizes, args.iters, args.warmup, not args.no_tune, not args.no_graph,
              device=args.device, timeout_s=3600)
    result = out[0]
    if result is None:  # torchrun, not rank 0
        return 0
    base = result["base"]
    text = "\n".join([line.format(base=base) for line in notes] + result["notes"])
    name = f"{name}_{args.world_size}ranks"  # the 2- and 4-rank tables live side by side
    paths = write_results(result["rows"], name, args.out, title, notes=text,
                          plot=plot_gbps(methods_of(base), f"{name}: GB/s"))
    print("\n".join(paths))
    bad = [r["size"] for r in result["rows"] if not r["ok"]]
    if bad:
        print(f"bench {name}: data check failed at {bad}")
        return 1
    return 0


def main(argv: Optional[list] = None) -> int:
    args = bench_parser("python -m epcomm bench p2p", __doc__, "p2p", "bytes per direction").parse_args(argv)
    notes = [f"Pairs 0<->1, 2<->3, ... both directions at once; {args.world_size} ranks; {args.iters} iterations "
             f"after {args.warmup} warm-up. GB/s = bytes per direction / time. `ok`: the data put and got was "
             "checked.", TIMING_NOTE,
             "Targets (H200 NVLink): put >= NCCL at every size, >= 1.5x NCCL for 16 KiB..1 MiB, within 10% of the "
             "copy engine at >= 64 MiB."]
    return run_bench(args, _worker, "p2p", "epcomm bench p2p: one-sided put/get", notes,
                     lambda base: [base, "ce", "put", "get", "ce_graph", "put_graph", "get_graph"])
