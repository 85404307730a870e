"""Timing shared by every benchmark: events after warm-up, per-iteration max across ranks, median.

On CUDA each iteration starts after a device-side barrier (a one-element all_reduce) and is timed with
CUDA events on the current stream; on CPUs with ``time.perf_counter`` after a gloo barrier. The per-rank
times are all-gathered once at the end; each iteration's time is the slowest rank's; the statistic is the
median over iterations."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Timing:
    """Microseconds: median, min and max over iterations of the max across ranks, and their count."""

    median_us: float
    min_us: float
    max_us: float
    iters: int

    def gbps(self, nbytes: float) -> float:
        """``nbytes`` over the median time, in GB/s (1e9 bytes per second)."""
        return nbytes / (self.median_us * 1e-6) / 1e9 if self.median_us > 0 else float("nan")


def _barrier(group, device: torch.device) -> None:
    if device.type == "cuda":
        flag = torch.ones(1, device=device)
        dist.all_reduce(flag, group=group)
    else:
        dist.barrier(group=group)


def time_op(fn: Callable[[], object], group, device: torch.device, iters: int = 20, warmup: int = 5,
            flush_l2: bool = True, setup: Callable[[], object] | None = None) -> Timing:
    """Time ``fn()`` (which must be collective when it communicates) on every rank of ``group``.
    ``setup()``, if given, runs before each iteration, outside the timed region."""
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    cuda = device.type == "cuda"
    scratch = torch.empty(256 << 20, dtype=torch.uint8, device=device) if cuda and flush_l2 else None
    times = []
    for _ in range(iters):
        if setup is not None:
            setup()
        if scratch is not None:
            scratch.zero_()  # evict the previous iteration's data from L2
        _barrier(group, device)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    local = torch.tensor(times, dtype=torch.float64, device=device if cuda else "cpu")
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    per_iter_max = torch.stack(gathered).max(dim=0).values.tolist()
    return Timing(statistics.median(per_iter_max), min(per_iter_max), max(per_iter_max), iters)


def capture_graph(fn: Callable[[], object], warmup: int = 1) -> tuple:
    """Warm ``fn`` up on a side stream, then capture one call of it in a CUDA graph. Returns ``(graph,
    outputs of the captured call)``; ``graph.replay()`` reruns it on whatever the inputs hold then."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def time_graph(fn: Callable[[], object], group, device: torch.device, iters: int = 50, warmup: int = 3) -> Timing:
    """Capture ``fn()`` in a CUDA graph once and time its replays like ``time_op``."""
    graph, _ = capture_graph(fn, warmup)
    return time_op(graph.replay, group, device, iters=iters, warmup=warmup)
