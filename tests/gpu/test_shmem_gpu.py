"""epcomm.shmem on GPUs (2, 4 and 8 ranks, NVLink): the CPU suite's cases with real sizes, the SM and copy
engine paths, CUDA graphs, native P2P atomics, and timeouts that must become exceptions, not hangs.

The cases live in ``epcomm.shmem.checks`` (shared with the CPU tests); each test spawns one process per GPU.
Sizes go from 4 bytes to 1 GiB, unaligned lengths and addresses included."""

from __future__ import annotations

import pytest
import torch

from epcomm.shmem import checks
from epcomm.testing import spawn

from conftest import gpu_count, gpu_ranks, splits_shared_gpus

NGPU = gpu_count()
pytestmark = pytest.mark.gpu
RANKS = [pytest.param(n, marks=[pytest.mark.skipif(gpu_ranks() < n, reason=f"needs {n} GPUs, found {NGPU}"),
                                 pytest.mark.skipif(gpu_ranks() >= n and splits_shared_gpus(n, n),
                                                    reason=f"{n} ranks would share GPUs and span several")],
                      id=f"{n}gpu")
         for n in (2, 4, 8)]

# (bytes, byte offset): offset 1/3 makes both addresses unaligned (the byte-wise kernel path)
SMALL_CASES = ((4, 0), (5, 0), (17, 1), (255, 3), (4096, 0), (65537, 0), ((1 << 20) + 3, 1), (1 << 20, 0))
LARGE_CASES = ((64 << 20, 0), ((64 << 20) + 12, 0), (1 << 30, 0), ((1 << 30) - 7, 0))


def _failures(results) -> list:
    out = []
    for r, res in enumerate(results):
        items = res.items() if "failures" not in res else [("", res)]
        for name, v in items:
            out += [f"rank {r} {name}: {f}" for f in v["failures"]]
    return out


def _one_of_each(ctx, large: bool) -> dict:
    """Everything in one spawn per world size (each spawn costs CUDA + NCCL start-up)."""
    results = {"validation": checks.check_validation(ctx),
               "put_get": checks.check_put_get(ctx, SMALL_CASES + (LARGE_CASES if large else ())),
               "typed": checks.check_typed(ctx),
               "signals": checks.check_signals(ctx, rounds=5, nbytes=1 << 20),
               "barrier": checks.check_barrier(ctx, rounds=6),
               "allgather": checks.check_allgather(ctx, shard_bytes=(16, 1000, 1001, 4096, 1 << 18, 1 << 20,
                                                                     (1 << 20) + 16, 16 << 20), rounds=3, graph=True,
                                                         small_shard_bytes=1 << 18),
               "graph": checks.check_graph_put_barrier(ctx, nbytes=1 << 20, replays=5)}
    return results


@pytest.mark.parametrize("world", RANKS)
def test_put_get_signal_wait_barrier_allgather(world):
    """ring put/get from 4 B to 1 GiB with both engines, typed tensors and the peer table, signals with every
    comparison, fused put+signal all-to-all, remote atomic adds, barrier ordering, all-gather (eager and
    CUDA-graph replays), a captured put+barrier graph."""
    results = spawn(_one_of_each, world, True, device="cuda", timeout_s=600)
    failures = _failures(results)
    assert not failures, "\n".join(failures[:40])
    # H200 NVLink has native P2P atomics (DEVICE.md): the remote add path must have run, not been refused
    assert all(r["signals"]["atomics"] for r in results), "p2p_atomics_supported said no on an NVLink machine"


@pytest.mark.parametrize("world", RANKS)
def test_missing_signal_times_out(world):
    """A wait nobody signals raises EpcommTimeoutError (rank, slot, expected, seen) within its timeout, a
    nonblocking one is reported by check_errors(), the heap keeps working, and a barrier rank 0 skips times
    out on the others."""
    results = spawn(checks.check_timeouts, world, 0.5, device="cuda", timeout_s=300)
    failures = _failures(results)
    assert not failures, "\n".join(failures)


def _attribute_worker(ctx):
    from epcomm.shmem.p2p import _p2p_attribute, p2p_access_supported, p2p_atomics_supported

    peer = (ctx.device.index + 1) % torch.cuda.device_count()
    return {"raw": _p2p_attribute(3, ctx.device.index, peer), "atomics": p2p_atomics_supported(ctx.device.index, peer),
            "access": p2p_access_supported(ctx.device.index, peer)}


@pytest.mark.skipif(NGPU < 2, reason=f"needs 2 GPUs, found {NGPU}")
def test_p2p_attribute_query_works():
    """cudaDeviceGetP2PAttribute answers here (through cuda.bindings or libcuda), agreeing with torch."""
    out = spawn(_attribute_worker, 2, device="cuda", timeout_s=120)
    for o in out:
        assert o["raw"] in (0, 1), o
        assert o["atomics"] == bool(o["raw"]) and o["access"], o
