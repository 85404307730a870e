"""The multi-process launcher: results by rank, worker errors re-raised, stuck workers time out."""

import os
import time

import pytest
import torch.distributed as dist

from epcomm.errors import EpcommTimeoutError
from epcomm.testing import WorkerError, spawn


def _rank_info(ctx, scale):
    return (ctx.rank * scale, ctx.world_size, dist.get_world_size(), str(ctx.device))


def _fail_on_rank_one(ctx):
    if ctx.rank == 1:
        raise ValueError("boom from worker")
    dist.barrier()  # rank 0 would wait for ever without the launcher's clean-up
    return "unreachable"


def _sleep_forever(ctx):
    time.sleep(3600)


def test_results_in_rank_order():
    assert spawn(_rank_info, 3, 10, device="cpu") == [(0, 3, 3, "cpu"), (10, 3, 3, "cpu"), (20, 3, 3, "cpu")]


def test_worker_error_is_reraised_with_traceback():
    with pytest.raises(WorkerError, match="rank 1 of 2") as info:
        spawn(_fail_on_rank_one, 2, device="cpu", timeout_s=60)
    assert "ValueError: boom from worker" in str(info.value)
    assert "_fail_on_rank_one" in str(info.value)


def _not_rebuilt():
    raise RuntimeError("cannot be rebuilt in the worker")


class _BreaksInTheWorker:
    """Pickles in the parent; unpickling it (in the worker) raises."""

    def __reduce__(self):
        return (_not_rebuilt, ())


def test_argument_that_cannot_be_unpickled_names_the_rank():
    with pytest.raises(WorkerError, match=r"spawn: rank [01] of 2 failed") as info:
        spawn(_rank_info, 2, _BreaksInTheWorker(), device="cpu", timeout_s=60)
    assert "cannot be rebuilt in the worker" in str(info.value)


def _env_value(ctx, name):
    import os

    return os.environ.get(name)


def test_workers_take_the_callers_environment(monkeypatch):
    """CPU workers are forked from a server started at the first launch: each takes the environment of the call that
    starts it (set after the server started, removed again), not the server's."""
    monkeypatch.delenv("EPCOMM_LAUNCHER_PROBE", raising=False)
    assert spawn(_env_value, 2, "EPCOMM_LAUNCHER_PROBE", device="cpu", timeout_s=120) == [None, None]
    monkeypatch.setenv("EPCOMM_LAUNCHER_PROBE", "7")
    assert spawn(_env_value, 2, "EPCOMM_LAUNCHER_PROBE", device="cpu", timeout_s=120) == ["7", "7"]
    monkeypatch.delenv("EPCOMM_LAUNCHER_PROBE")
    assert spawn(_env_value, 1, "EPCOMM_LAUNCHER_PROBE", device="cpu", timeout_s=120) == [None]


def test_stuck_worker_times_out():
    t0 = time.monotonic()
    with pytest.raises(EpcommTimeoutError, match=r"ranks \[0, 1\] of 2 did not finish _sleep_forever"):
        spawn(_sleep_forever, 2, device="cpu", timeout_s=8)
    assert time.monotonic() - t0 < 40


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size=0"):
        spawn(_rank_info, 0, 1)
    with pytest.raises(ValueError, match="device='cuda' needs"):
        spawn(_rank_info, 64, 1, device="cuda")


def test_taken_rendezvous_port_is_retried(monkeypatch):
    """The port free_port found can be taken before rank 0's rendezvous server binds it: spawn starts again on
    another port instead of failing (seen on GPU hosts, where NCCL's connections use ephemeral ports)."""
    import socket

    from epcomm.testing import launcher

    busy = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    ports = [busy.getsockname()[1]]
    real = launcher.free_port

    def first_busy():
        ports.append(real())
        return ports[0] if len(ports) == 2 else ports[-1]

    monkeypatch.setattr(launcher, "free_port", first_busy)
    try:
        assert spawn(_rank_info, 2, 1, device="cpu", timeout_s=120) == [(0, 2, 2, "cpu"), (1, 2, 2, "cpu")]
    finally:
        busy.close()
    assert len(ports) == 3  # the busy port, then a free one
    assert 20000 <= real() < 32000


@pytest.mark.parametrize("local_world,n_gpus,per_gpu,per_node,expect", [
    (4, 4, 4, 0, [(0, 1), (1, 1), (2, 1), (3, 1)]),      # one rank per GPU
    (4, 1, 4, 0, [(0, 4)] * 4),                          # every rank on the one GPU
    (3, 2, 2, 0, [(0, 2), (1, 1), (0, 2)]),              # round-robin: GPU 0 holds ranks 0 and 2
    (8, 3, 3, 0, [(0, 3), (1, 3), (2, 2), (0, 3), (1, 3), (2, 2), (0, 3), (1, 3)]),
    (8, 1, 1, 0, [(0, 1)] * 8),                          # each process sees one GPU (CUDA_VISIBLE_DEVICES): no sharing
    (8, 2, 4, 4, [(0, 4)] * 4 + [(1, 4)] * 4),          # simulated nodes larger than the GPUs: a node on one GPU
    (8, 2, 4, 2, [(0, 4), (1, 4)] * 4),                  # nodes that fit the GPUs: each node's ranks on distinct GPUs
    (8, 4, 2, 4, [(0, 2), (1, 2), (2, 2), (3, 2)] * 2),
    (6, 2, 3, 3, [(0, 3)] * 3 + [(1, 3)] * 3),
])
def test_gpu_placement(local_world, n_gpus, per_gpu, per_node, expect):
    """Where the launcher puts each rank; a simulated node's ranks never share GPUs and span several at once."""
    from epcomm.core.device import split_shared_group
    from epcomm.testing.launcher import gpu_placement

    got = [gpu_placement(r, local_world, n_gpus, per_gpu, per_node) for r in range(local_world)]
    assert got == expect
    if per_node:
        nodes = [[g for g, _ in got[i:i + per_node]] for i in range(0, local_world, per_node)]
        assert not any(split_shared_group(n) for n in nodes), nodes
    with pytest.raises(ValueError, match="no CUDA device"):
        gpu_placement(0, local_world, 0, per_gpu)


def test_split_shared_group():
    from epcomm.core.device import split_shared_group

    assert split_shared_group([0, 1, 0, 1]) and split_shared_group([0, 0, 1])
    assert not split_shared_group([0, 1, 2, 3]) and not split_shared_group([1, 1, 1]) and not split_shared_group([2])


def test_ranks_per_gpu_setting(monkeypatch):
    """EPCOMM_RANKS_PER_GPU lets the launcher place several ranks on one GPU; bad values name the variable."""
    from epcomm import env
    from epcomm.testing import launcher

    monkeypatch.setattr(launcher.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(launcher.torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("EPCOMM_RANKS_PER_GPU", raising=False)
    assert env.ranks_per_gpu() == 1 and launcher.gpu_rank_slots() == 1
    assert launcher.resolve_device("auto", 4) == "cpu"
    with pytest.raises(ValueError, match="EPCOMM_RANKS_PER_GPU to place several ranks"):
        launcher.resolve_device("cuda", 4)
    monkeypatch.setenv("EPCOMM_RANKS_PER_GPU", "4")
    assert launcher.gpu_rank_slots() == 4
    assert launcher.resolve_device("auto", 4) == "cuda" and launcher.resolve_device("cuda", 4) == "cuda"
    assert launcher.resolve_device("auto", 5) == "cpu"
    for bad in ("0", "9", "two"):
        monkeypatch.setenv("EPCOMM_RANKS_PER_GPU", bad)
        with pytest.raises(ValueError, match="EPCOMM_RANKS_PER_GPU"):
            env.ranks_per_gpu()


def test_gpu_share_sets_mps_percentage_unless_chosen(monkeypatch):
    from epcomm import env

    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    env.set_gpu_share(1)
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in os.environ
    env.set_gpu_share(3)
    assert os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "33"
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "50")
    env.set_gpu_share(4)
    assert os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"


@pytest.mark.parametrize("backend,expect", [("cpu:gloo,cuda:nccl", "cuda:0"), ("cpu:gloo,cuda:gloo", "cuda:0"),
                                            ("nccl", "cuda:0"), ("gloo", "cpu")])
def test_default_device_follows_the_groups_cuda_backend(monkeypatch, backend, expect):
    """A group that carries CUDA tensors (NCCL, or gloo mapped to cuda: for ranks sharing a GPU) makes Buffer and
    MoE default to the current GPU; a CPU-only gloo group keeps them on the CPU."""
    from epcomm.core import device as device_mod

    monkeypatch.setattr(device_mod.dist, "get_backend", lambda group: backend)
    monkeypatch.setattr(device_mod.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(device_mod.torch.cuda, "current_device", lambda: 0)
    assert str(device_mod.default_device(None)) == expect
