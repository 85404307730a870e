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
