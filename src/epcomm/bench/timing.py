"""Timing shared by every benchmark: events after warm-up, per-iteration max across ranks, median.

Three ways to time a call on the device, all with CUDA events on the current stream after warm-up, the per-rank times
all-gathered once at the end, each iteration's time the slowest rank's, the statistic the median over
iterations:

* ``time_op`` (an isolated call): each iteration starts after a device-side barrier (a one-element
  all_reduce); the time runs from the barrier to the end of the call's last kernel, so it includes the
  host work of the call that the device waits for. On CPUs: ``time.perf_counter`` after a gloo barrier.
  On GPUs the warm-up lasts at least ``WARMUP_S`` seconds: such host-bound times depend on how long the
  host has been busy.
* ``time_stream`` (a steady stream of calls, DeepEP's method): a chain of matrix products gives the host a
  head start, a barrier lines the ranks up, then the iterations are enqueued back to back (an L2 flush
  between them when asked) and each call is bracketed by its own events. The host is ahead of the device,
  so this measures what the device spends per call: the kernels, the waits for peers and the gaps between
  launches, not the host work. It needs calls without host synchronisation (cached handles,
  ``num_worst_tokens``, low-latency calls).
* ``time_ahead`` (a call as a model's step meets it): before each iteration the device is kept busy (matrix
  products, ~1.5 times the host's time per call) while the host issues the call, and a barrier after those
  products lines the ranks up; the time runs from there to the end of the call. So the host's work that the device
  would not wait for in a step is hidden (all of it for calls that never synchronise: a cached dispatch, a combine),
  and a call that reads counts on the host still makes the device wait for the host from that read on. DeepEP's
  published figures are timed so (``tests/utils.py``'s ``bench``: back-to-back calls bracketed by events, its host
  ahead; or ``bench_kineto``: kernel time alone).

``time_kernels`` times the same stream by the summed duration of each call's GPU kernels, read from the profiler
(what DeepEP's benchmarks report): the waits for peers inside the kernels count, the gaps between launches do not.
``time_host`` measures the other side: how long the host takes to issue one call.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence, Union

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


# seconds of back-to-back calls before an isolated call is timed on a GPU: on the GPU hosts the same call measured
# right after start-up took up to 1.6x longer than after other calls had kept the host busy (benchmarks/NOTES.md)
WARMUP_S = 0.3


def _barrier(group, device: torch.device) -> None:
    if device.type == "cuda":
        flag = torch.ones(1, device=device)
        dist.all_reduce(flag, group=group)
    else:
        dist.barrier(group=group)


def time_op(fn: Callable[[], object], group, device: torch.device, iters: int = 20, warmup: int = 5,
            flush_l2: bool = True, setup: Callable[[], object] | None = None,
            warmup_s: float = WARMUP_S) -> Timing:
    """Time ``fn()`` (which must be collective when it communicates) on every rank of ``group``.
    ``setup()``, if given, runs before each iteration, outside the timed region. The warm-up runs ``warmup``
    calls, then on CUDA as many more as fill about ``warmup_s`` seconds (the same count on every rank)."""

    def one():
        if setup is not None:
            setup()
        fn()

    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    for _ in range(warmup):
        one()
    if cuda and warmup_s > 0 and warmup > 0:  # host-bound calls: time them on a host that has been busy a while
        torch.cuda.synchronize(device)
        per_call = (time.perf_counter() - t0) / max(warmup, 1)
        more = torch.tensor([min(int(warmup_s / max(per_call, 1e-6)), 10_000)], dtype=torch.int64, device=device)
        dist.all_reduce(more, op=dist.ReduceOp.MAX, group=group)
        for _ in range(int(more.item())):
            one()
    scratch = torch.empty(256 << 20, dtype=torch.uint8, device=device) if cuda and flush_l2 else None
    times = []
    for _ in range(iters):
        if setup is not None:
            setup()
        if scratch is not None:
            scratch.zero_()  # evict the previous iteration's data from L2
        _barrier(group, device)
        if cuda:
            times.append(_event_us(fn))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return _gather(times, group, device)


def _event_us(fn: Callable[[], object]) -> float:
    """Microseconds of ``fn()`` on the current stream, between two CUDA events (waits for its end)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def _product_us(a: torch.Tensor) -> float:
    """Microseconds of one product ``a @ a`` on the device (the first one, which pays for library start-up, not
    counted; at least 1)."""
    a @ a
    return max(_event_us(lambda: [a @ a for _ in range(4)]) / 4, 1.0)


def _host_s(call: Callable[[], object], device: torch.device, warmup: int) -> float:
    """Seconds the host takes to issue ``call``: after ``warmup`` calls, the longest of as many more (at least one),
    each made with the device idle (a call that reads counts on the host counts its wait: a longer head start)."""
    for _ in range(warmup):
        call()
    most = 0.0
    for _ in range(max(warmup, 1)):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        call()
        most = max(most, time.perf_counter() - t0)
    return most


def _in_stream(one: Callable[[], None], group, device: torch.device, iters: int, warmup: int, flush_l2: bool,
               each: Callable[[int], None]) -> int:
    """Warm ``one`` up (``_host_s``), give the host a head start over ``iters`` calls (``HostLead``), then run
    ``each(i)`` (which calls ``one``) for ``i < iters`` back to back, flushing L2 before each when asked, and wait
    for the device (CUDA only). Returns how many calls of ``one`` the warm-up made."""
    host_s = _host_s(one, device, warmup) + (60e-6 if flush_l2 else 0.0)
    torch.cuda.synchronize(device)
    scratch = torch.empty(256 << 20, dtype=torch.uint8, device=device) if flush_l2 else None
    lead = HostLead(group, device)
    lead.lead(lead.products([host_s * iters])[0])
    for i in range(iters):
        if scratch is not None:
            scratch.zero_()
        each(i)
    torch.cuda.synchronize(device)
    return warmup + max(warmup, 1)


class HostLead:
    """Keeps the device busy while the host runs ahead, as a model's step's earlier work does (``time_ahead``; the
    internode benchmark's chunk trials): ``lead(n)`` enqueues ``n`` matrix products and then a barrier that lines the
    ranks up after them; ``products(seconds)`` says how many cover 1.5 times each of ``seconds`` (the largest count of
    any rank: collective, like ``lead``). CUDA only."""

    def __init__(self, group, device: torch.device) -> None:
        self.group, self.device = group, device
        self.a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
        self.product_s = _product_us(self.a) * 1e-6

    def products(self, seconds: Sequence[float]) -> list:
        n = torch.tensor([int(1.5 * s / self.product_s) + 2 for s in seconds], dtype=torch.int64, device=self.device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.group)
        return n.tolist()

    def lead(self, products: int) -> None:
        _barrier(self.group, self.device)
        for _ in range(products):
            self.a @ self.a
        _barrier(self.group, self.device)  # (after every rank's products: what follows starts together)


def time_ahead(fn: Union[Callable[[], object], Sequence[Callable[[], object]]], group, device: torch.device,
               iters: int = 20, warmup: int = 3):
    """Time ``fn()`` (collective) with the host ahead of the device (see the module docstring); CUDA only. ``fn`` may
    be a sequence of calls: each iteration then times each in turn (a link whose rate drifts weighs on each alike),
    and a list of Timings is returned. Each call's head start (``HostLead``) is sized from the host's time per call in
    the warm-up (the slowest rank's: every rank enqueues the same products, so that the barrier after them lines the
    ranks up rather than waiting for one)."""
    if device.type != "cuda":
        raise ValueError("time_ahead: needs a CUDA device (use time_op on CPUs)")
    calls = list(fn) if isinstance(fn, (list, tuple)) else [fn]
    host = [_host_s(call, device, warmup) for call in calls]
    lead = HostLead(group, device)
    products = lead.products(host)
    times: list = [[] for _ in calls]
    for _ in range(iters):
        for call, n, got in zip(calls, products, times):
            lead.lead(n)
            got.append(_event_us(call))
    timings = [_gather(got, group, device) for got in times]
    return timings if isinstance(fn, (list, tuple)) else timings[0]


def time_stream(fn: Union[Callable[[], object], Sequence[Callable[[], object]]], group, device: torch.device,
                iters: int = 20, warmup: int = 3, flush_l2: bool = True):
    """Time ``fn()`` as one call of a steady stream (see the module docstring); CUDA only, and ``fn`` must
    not synchronise with the host. ``fn`` may be a sequence of phases (a hook's send and receive): each
    iteration runs them in turn, each bracketed by its own events, and a tuple of Timings is returned."""
    if device.type != "cuda":
        raise ValueError("time_stream: needs a CUDA device (use time_op on CPUs)")
    phases = tuple(fn) if isinstance(fn, (tuple, list)) else (fn,)

    def one():
        for f in phases:
            f()

    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in phases]
              for _ in range(iters)]

    def each(i):
        for f, (start, end) in zip(phases, events[i]):
            start.record()
            f()
            end.record()

    _in_stream(one, group, device, iters, warmup, flush_l2, each)
    timings = tuple(_gather([it[i][0].elapsed_time(it[i][1]) * 1e3 for it in events], group, device)
                    for i in range(len(phases)))
    return timings if isinstance(fn, (tuple, list)) else timings[0]


def _kernels(events, name=None) -> list:
    """``(start, name, duration us)`` of the GPU kernels (called ``name``, if given) among ``torch.profiler``
    events: the kernel events (CUDA device type), or where the profiler lists none, the kernels that its CPU
    events carry (each kernel is counted once either way)."""
    found = [(e.time_range.start, e.name, e.time_range.elapsed_us()) for e in events
             if e.device_type == torch.autograd.DeviceType.CUDA and name in (None, e.name)]
    if not found:
        found = [(e.time_range.start, k.name, k.duration) for e in events
                 for k in (getattr(e, "kernels", None) or ()) if name in (None, k.name)]
    return found


def kernel_durations(events, name: str) -> list:
    """Durations in microseconds, in start order, of the GPU kernels called ``name`` among ``torch.profiler``
    events (read as ``_kernels`` does)."""
    return [d for _, _, d in sorted(_kernels(events, name))]


def kernel_names(events) -> dict:
    """``{name: launches}`` of the GPU kernels among ``torch.profiler`` events (read as ``_kernels`` does)."""
    names = [n for _, n, _ in _kernels(events)]
    return {n: names.count(n) for n in sorted(set(names))}


def per_call_kernel_us(events, launches: dict, calls: int) -> list:
    """Each of ``calls`` consecutive calls' kernel time: the summed durations of its kernels, where every call
    launched ``launches[name]`` kernels called ``name`` (and the events hold exactly those of the ``calls``)."""
    total = [0.0] * calls
    for name, per in launches.items():
        durations = kernel_durations(events, name)
        if len(durations) != per * calls:
            raise ValueError(f"time_kernels: found {len(durations)} launches of kernel {name!r} in {calls} calls, "
                             f"expected {per} per call; the call must launch the same kernels every time "
                             f"(kernels seen: {kernel_names(events)})")
        for i in range(calls):
            total[i] += sum(durations[i * per:(i + 1) * per])
    return total


def time_kernels(fn: Callable[[], object], kernels: Union[None, str, Sequence[str]], group, device: torch.device,
                 iters: int = 20, warmup: int = 3, flush_l2: bool = True) -> Timing:
    """Kernel time of one call, the measure DeepEP's benchmarks read from the profiler: the calls run as in
    ``time_stream`` (host ahead, back to back) under ``torch.profiler``, and each call's time is the summed
    duration of its GPU kernels (waits for peers inside them included; launch gaps, events and host work not);
    per-iteration max across ranks, median. ``kernels``: the names of the kernels a call launches, or None for
    all of them (found by profiling one call alone after warm-up); every call must launch the same ones."""
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        raise ValueError("time_kernels: needs a CUDA device (use time_op on CPUs)")
    if kernels is None:
        fn()
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize(device)
        launches = kernel_names(prof.events())
        if not launches:
            raise ValueError("time_kernels: the call launched no GPU kernel")
    else:
        launches = {k: 1 for k in ((kernels,) if isinstance(kernels, str) else kernels)}
    # the warm-up runs under the profiler too: the head start must cover the host's time per call as profiled
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        warm = _in_stream(fn, group, device, iters, warmup, flush_l2, lambda i: fn())
    return _gather(per_call_kernel_us(prof.events(), launches, iters + warm)[warm:], group, device)


def time_host(fn: Callable[[], object], group, device: torch.device, iters: int = 20, warmup: int = 3) -> Timing:
    """Host time of one call: microseconds until ``fn()`` returns, with the device idle before each call
    (what a call costs the CPU, whatever the device then does); per-iteration max across ranks, median."""
    for _ in range(warmup):
        fn()
    cuda = device.type == "cuda"
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize(device)
        _barrier(group, device)
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    if cuda:
        torch.cuda.synchronize(device)
    return _gather(times, group, device)


def _gather(times: list, group, device: torch.device) -> Timing:
    """All-gather the per-rank times; each iteration's is the slowest rank's; median, min, max."""
    cuda = device.type == "cuda"
    local = torch.tensor(times, dtype=torch.float64, device=device if cuda else "cpu")
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    per_iter_max = torch.stack(gathered).max(dim=0).values.tolist()
    return Timing(statistics.median(per_iter_max), min(per_iter_max), max(per_iter_max), len(times))


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


def time_graph(fn: Callable[[], object], group, device: torch.device, iters: int = 50, warmup: int = 3,
               stream: bool = False, calls: int = 1) -> Timing:
    """Capture ``calls`` calls of ``fn()`` in one CUDA graph and time its replays like ``time_op`` (``stream``:
    like ``time_stream``); the times are per call (a replay's over ``calls``): with several calls per graph the
    fixed cost of a replay and of its timing is shared, as in a decode step's graph with many layers."""
    if calls < 1:
        raise ValueError(f"time_graph: calls must be at least 1, got {calls}")

    def many():
        for _ in range(calls - 1):
            fn()
        return fn()

    graph, _ = capture_graph(many, warmup)
    timing = (time_stream if stream else time_op)(graph.replay, group, device, iters=iters, warmup=warmup)
    return Timing(timing.median_us / calls, timing.min_us / calls, timing.max_us / calls, timing.iters)
