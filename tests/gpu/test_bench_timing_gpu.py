"""The benchmarks' timing methods on GPUs, on calls whose host work outlasts their device work: an isolated call
(``time_op``) shows the host's work, a call with the host ahead (``time_ahead``) or in a stream (``time_stream``)
hides it, except what comes after a host read (which synchronises the host with its device); a call's kernel time
(``time_kernels``) is its kernel's alone."""

import time

import pytest

from conftest import gpu_count
from epcomm.testing import spawn

HOST_S = 0.004  # the host's work in each call


def _timings(ctx):
    import torch
    import torch.distributed as dist

    from epcomm.bench.timing import _event_us, time_ahead, time_kernels, time_op, time_stream

    flag = torch.ones(1, device=ctx.device)

    def host_then_device():  # the host's work, then a collective
        time.sleep(HOST_S)
        dist.all_reduce(flag, group=ctx.group)

    def read_then_host():  # a collective read by the host, then the host's work, then a kernel
        dist.all_reduce(flag, group=ctx.group)
        flag.item()
        time.sleep(HOST_S)
        flag.mul_(1.0)

    isolated = time_op(host_then_device, ctx.group, ctx.device, iters=5, warmup=2)
    ahead, after_read = time_ahead([host_then_device, read_then_host], ctx.group, ctx.device, iters=5, warmup=2)
    single = time_ahead(host_then_device, ctx.group, ctx.device, iters=3, warmup=1)
    stream = time_stream(host_then_device, ctx.group, ctx.device, iters=5, warmup=2)
    big = torch.ones(64 << 20, device=ctx.device)

    def host_then_kernel():  # the host's work, then one element-wise kernel (not a product: the head start's kernel)
        time.sleep(HOST_S)
        big.mul_(1.0)

    kernel_us = sorted(_event_us(lambda: big.mul_(1.0)) for _ in range(5))[2]
    kernels = time_kernels(host_then_kernel, None, ctx.group, ctx.device, iters=5, warmup=2)
    return isolated, ahead, after_read, single, stream, kernels, kernel_us


@pytest.mark.gpu
def test_gpu_host_ahead_hides_the_host_work_that_an_isolated_call_shows():
    if gpu_count() < 2:
        pytest.skip("needs 2 GPUs (NCCL between two ranks)")
    results = spawn(_timings, 2, device="cuda", timeout_s=300)
    isolated, ahead, after_read, single, stream, kernels, kernel_us = results[0]
    assert results[0][:-1] == results[1][:-1]  # (every rank reports the slowest rank's times)
    us = HOST_S * 1e6
    assert isolated.median_us >= us, isolated  # the device waited for the host's work
    for t in (ahead, single, stream):
        assert t.median_us < us / 2, t  # issued while the device was busy: hidden
    assert after_read.median_us >= us, after_read  # after the host's read the device waits for it again
    assert kernel_us / 2 < kernels.median_us < 2 * kernel_us, (kernels, kernel_us)  # the kernel alone, not the host
