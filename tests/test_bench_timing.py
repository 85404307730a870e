"""The benchmarks' timing helpers on CPU processes: each iteration counts the slowest rank, the statistic is
the median, and host time is measured around the call only."""

import time

from epcomm.testing import spawn


def _timings(ctx):
    from epcomm.bench.timing import time_host, time_op

    def call():  # rank 1 is the slow one: every rank must report its time
        time.sleep(0.002 if ctx.rank == 1 else 0.0002)

    return time_op(call, ctx.group, ctx.device, iters=5, warmup=1), time_host(call, ctx.group, ctx.device, iters=5,
                                                                               warmup=1)


def test_time_op_and_time_host_report_the_slowest_rank():
    results = spawn(_timings, 2, device="cpu", timeout_s=120)
    for op, host in results:
        for t in (op, host):
            assert t.iters == 5 and t.min_us <= t.median_us <= t.max_us
            assert 2000 <= t.median_us < 50000, t  # rank 1's 2 ms, on every rank
    assert results[0] == results[1]  # every rank computes the same statistics


def test_kernel_durations_pick_one_kernel_in_start_order():
    """time_kernels' reading of profiler events: the named kernel's durations in start order, from the kernel
    events, or from the kernels that CPU events carry where there are no kernel events (never both)."""
    from types import SimpleNamespace as NS

    import pytest
    import torch

    from epcomm.bench.timing import kernel_durations, time_kernels, time_stream

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def span(start, us):
        return NS(start=start, elapsed_us=lambda: us)

    events = [NS(device_type=cuda, name="ll_combine_kernel", time_range=span(30, 9.0)),
              NS(device_type=cuda, name="ll_dispatch_kernel", time_range=span(20, 7.5)),
              NS(device_type=cuda, name="other", time_range=span(5, 1.0)),
              NS(device_type=cuda, name="ll_dispatch_kernel", time_range=span(10, 6.0)),
              NS(device_type=cpu, name="ll_dispatch_kernel", time_range=span(1, 99.0),
                 kernels=[NS(name="ll_dispatch_kernel", duration=6.0)])]
    assert kernel_durations(events, "ll_dispatch_kernel") == [6.0, 7.5]
    launches = [NS(device_type=cpu, name="cuLaunchKernelEx", time_range=span(t, 3.0),
                   kernels=[NS(name="ll_dispatch_kernel", duration=d)]) for t, d in ((20, 7.0), (10, 5.0))]
    assert kernel_durations(launches + events[2:3], "ll_dispatch_kernel") == [5.0, 7.0]
    assert kernel_durations(events, "ll_combine_kernel") == [9.0]
    assert kernel_durations(events, "missing") == []
    with pytest.raises(ValueError, match="^time_kernels: needs a CUDA device"):
        time_kernels(lambda: None, "k", None, torch.device("cpu"))
    with pytest.raises(ValueError, match="^time_stream: needs a CUDA device"):
        time_stream(lambda: None, None, torch.device("cpu"))
    from epcomm.bench.timing import time_graph

    with pytest.raises(ValueError, match="^time_graph: calls must be at least 1, got 0"):
        time_graph(lambda: None, None, torch.device("cpu"), calls=0)


def test_per_call_kernel_time_sums_each_calls_kernels():
    """time_kernels with several kernels per call: a call's time is the sum of its kernels' durations, in start
    order; a kernel launched a different number of times than the calls need is an error naming what was seen."""
    from types import SimpleNamespace as NS

    import pytest
    import torch

    from epcomm.bench.timing import kernel_names, per_call_kernel_us

    cuda = torch.autograd.DeviceType.CUDA

    def k(name, start, us):
        return NS(device_type=cuda, name=name, time_range=NS(start=start, elapsed_us=lambda: us))

    # two calls: barrier, push, reduce, reduce (the reduce launched twice per call); a flush kernel between them
    events = [k("flush", 0, 50.0), k("barrier", 1, 2.0), k("push", 2, 100.0), k("reduce", 3, 10.0),
              k("reduce", 4, 11.0), k("flush", 5, 50.0), k("barrier", 6, 3.0), k("push", 7, 90.0),
              k("reduce", 8, 12.0), k("reduce", 9, 13.0)]
    assert kernel_names(events) == {"barrier": 2, "flush": 2, "push": 2, "reduce": 4}
    launches = {"barrier": 1, "push": 1, "reduce": 2}
    assert per_call_kernel_us(events, launches, 2) == [123.0, 118.0]
    with pytest.raises(ValueError, match=r"^time_kernels: found 4 launches of kernel 'reduce' in 2 calls, expected 1"):
        per_call_kernel_us(events, {"reduce": 1}, 2)
    with pytest.raises(ValueError, match=r"found 0 launches of kernel 'gone'.*kernels seen: \{'barrier': 2"):
        per_call_kernel_us(events, {"gone": 1}, 2)
