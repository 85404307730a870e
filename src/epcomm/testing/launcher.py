"""One multi-process launcher for tests, the demo and the benchmarks.

``spawn(fn, world_size, ...)`` starts ``world_size`` processes (on CPUs forked from a server that imported torch
once, the ``forkserver`` start method, each worker taking the caller's environment before it imports anything else:
a CPU launch then costs ~0.1 s instead of ~1.5 s per rank; on GPUs fresh processes, ``spawn``), joins them in
one ``torch.distributed`` group (``cpu:gloo,cuda:nccl`` on GPUs, ``gloo`` on CPUs) on a free loopback port,
gives each log line a ``[rank N]`` prefix, calls ``fn(ctx, *args, **kwargs)`` in every process and returns
the per-rank results in rank order. A worker's exception is re-raised in the parent with the worker's
traceback; a worker that does not finish in ``timeout_s`` fails the launch with a message naming the ranks
still running. ``run`` does the same, except that under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) it joins
the existing job in this process instead of spawning.

``fn`` must be importable by name (a module-level function): it is pickled to the workers.

Ranks sharing a GPU: with ``EPCOMM_RANKS_PER_GPU=N`` (N > 1) the launcher starts up to N ranks on each GPU, so
that the one-sided transports' kernels can be tested with 2-8 ranks on a machine with fewer GPUs. NCCL refuses
two ranks on one GPU, so such a group is ``cpu:gloo,cuda:gloo``, and the symmetric heap maps its peers through
CUDA IPC instead of torch symmetric memory. The ranks' kernels wait for each other, so they must run at the same
time: start an MPS server first (``nvidia-cuda-mps-control -d``; each rank then gets ``1/N`` of the SMs,
``epcomm.env.set_gpu_share``); without one the GPU time-slices between the ranks' processes, which is correct
but takes milliseconds per synchronisation. Timings taken this way are not those of NVLink.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import random
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from .. import env
from ..errors import EpcommError, EpcommTimeoutError

log = logging.getLogger(__name__)


class WorkerError(EpcommError):
    """A worker process raised; the message carries its rank and traceback."""


@dataclass(frozen=True)
class WorkerContext:
    """What a worker function receives: its rank, the group size, its device and the process group."""

    rank: int
    world_size: int
    device: torch.device
    group: Any  # torch.distributed.ProcessGroup

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, chosen below Linux's ephemeral range (32768-60999):
    a port the kernel hands out for outgoing connections (NCCL's and gloo's own, many per job) can be taken
    between this check and the rendezvous server's bind (seen: EADDRINUSE)."""
    for port in random.Random().sample(range(20000, 32000), 64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_rank_slots() -> int:
    """How many ranks the launcher can place on this machine's GPUs: GPUs x ``EPCOMM_RANKS_PER_GPU``."""
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return n_gpus * env.ranks_per_gpu()


def resolve_device(device: str, world_size: int) -> str:
    """``auto`` -> ``cuda`` when every rank has a GPU (one each, or a share of one under
    ``EPCOMM_RANKS_PER_GPU``), else ``cpu``; ``cuda`` is checked."""
    slots = gpu_rank_slots()
    if device == "auto":
        return "cuda" if slots >= world_size and world_size > 0 else "cpu"
    if device == "cuda" and slots < world_size:
        n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise ValueError(f"launcher: device='cuda' needs {world_size} GPUs, this machine has {n_gpus} (and "
                         f"EPCOMM_RANKS_PER_GPU={env.ranks_per_gpu()} ranks may share one); use device='cpu', fewer "
                         f"ranks, or EPCOMM_RANKS_PER_GPU to place several ranks on one GPU")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"launcher: device={device!r} must be 'auto', 'cpu' or 'cuda'")
    return device


def gpu_placement(local_rank: int, local_world_size: int, n_gpus: int, ranks_per_gpu: int,
                  ranks_per_node: int = 0) -> tuple:
    """``(device index, ranks on that GPU)`` for ``local_rank`` of a host's ``local_world_size`` ranks placed
    round-robin on its ``n_gpus`` visible GPUs. Ranks count as sharing a GPU only when ``ranks_per_gpu`` > 1
    asks for it: a job whose processes each see one GPU (``CUDA_VISIBLE_DEVICES``) shares nothing. Simulated nodes
    (``ranks_per_node``, ``EPCOMM_RANKS_PER_NODE``) of more ranks than GPUs, on shared GPUs: each node's ranks on
    one GPU, node after node round-robin, since one-sided ranks that share GPUs must stay on one GPU
    (``core.device.split_shared_group``)."""
    if n_gpus < 1:
        raise ValueError(f"launcher: no CUDA device for rank {local_rank}")
    if ranks_per_gpu > 1 and n_gpus < ranks_per_node < local_world_size:
        gpus = [(r // ranks_per_node) % n_gpus for r in range(local_world_size)]
    else:
        gpus = [r % n_gpus for r in range(local_world_size)]
    gpu = gpus[local_rank]
    return gpu, (gpus.count(gpu) if ranks_per_gpu > 1 else 1)


def _setup_logging(rank: int) -> None:
    logging.basicConfig(level=env.log_level(), force=True,
                        format=f"[rank {rank}] %(asctime)s %(name)s %(levelname)s: %(message)s")


def init_worker(rank: int, world_size: int, device_kind: str, timeout_s: float) -> WorkerContext:
    """Join the process group from the torchrun-style variables already in the environment."""
    env.set_safe_gpu_defaults()
    # one process per rank on one host: share the cores instead of oversubscribing them (spinning OpenMP
    # threads of several processes on the same cores can slow CPU work by orders of magnitude)
    torch.set_num_threads(max(1, min(8, (os.cpu_count() or 1) // max(1, world_size))))
    per_node = env.ranks_per_node()
    if device_kind == "cuda" and per_node and per_node < world_size:
        env.set_simulated_host(rank // per_node)  # simulated nodes: NCCL connects them through its network path
    if device_kind == "cuda":
        launched = env.distributed_env() or {}
        local_rank = int(launched.get("LOCAL_RANK") or rank)
        gpu, shared = gpu_placement(local_rank, int(launched.get("LOCAL_WORLD_SIZE") or world_size),
                                    torch.cuda.device_count(), env.ranks_per_gpu(), per_node or 0)
        env.set_gpu_share(shared)  # before this process's CUDA context exists
        device = torch.device("cuda", gpu)
        torch.cuda.set_device(device)
        if shared > 1:  # NCCL refuses two ranks on one GPU
            backend, kwargs = "cpu:gloo,cuda:gloo", {}
        else:
            backend, kwargs = "cpu:gloo,cuda:nccl", {"device_id": device}
    else:
        device = torch.device("cpu")
        backend = "gloo"
        kwargs = {}
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return WorkerContext(rank=rank, world_size=world_size, device=device, group=dist.group.WORLD)


def _forked_worker(rank: int, environ: dict, payload: bytes, results: Any) -> None:
    """A CPU worker forked from the forkserver: it takes the launching process's environment first (the server's is
    older), then unpickles its function and arguments, whose modules import the kernels under that environment.
    ``rank`` travels beside the payload, so that a payload that cannot be unpickled is reported as this rank's."""
    env.adopt(environ)
    try:
        work = pickle.loads(payload)
    except BaseException:  # noqa: BLE001 - back to the parent, which names this rank
        results.put((rank, "error", traceback.format_exc()))
        return
    _worker_main(rank, *work, results)


def _worker_main(rank: int, world_size: int, port: int, device_kind: str, timeout_s: float,
                 fn: Callable, args: tuple, kwargs: dict, results: Any) -> None:
    env.set_distributed_env(rank, world_size, port)
    _setup_logging(rank)
    try:
        try:
            ctx = init_worker(rank, world_size, device_kind, timeout_s)
        except BaseException as exc:  # noqa: BLE001
            if "EADDRINUSE" in str(exc) or "address already in use" in str(exc).lower():
                results.put((rank, "port_taken", traceback.format_exc()))
                return
            raise
        out = fn(ctx, *args, **kwargs)
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def spawn(fn: Callable, world_size: int, *args: Any, device: str = "auto", timeout_s: float | None = None,
          **kwargs: Any) -> list:
    """Run ``fn(ctx, *args, **kwargs)`` in ``world_size`` new processes; return their results by rank.

    Raises WorkerError (with the worker's traceback) if any worker raised or died, and EpcommTimeoutError
    naming the unfinished ranks if they did not all finish within ``timeout_s`` (default: 4x
    ``EPCOMM_TIMEOUT_S``)."""
    if world_size < 1:
        raise ValueError(f"spawn: world_size={world_size} must be >= 1")
    device_kind = resolve_device(device, world_size)
    timeout_s = float(timeout_s if timeout_s is not None else 4 * env.timeout_s())
    for attempt in range(3):  # the rendezvous port taken before the server bound it: again on another port
        try:
            return _spawn_once(fn, world_size, args, kwargs, device_kind, timeout_s)
        except _PortTaken as exc:
            if attempt == 2:
                raise WorkerError(f"spawn: the rendezvous port was taken three times:\n{exc}") from None
            log.warning("spawn: rendezvous port taken, retrying on another one")
    raise AssertionError("unreachable")


class _PortTaken(Exception):
    """Rank 0 could not bind the rendezvous port (another process took it after ``free_port``)."""


def _spawn_once(fn: Callable, world_size: int, args: tuple, kwargs: dict, device_kind: str, timeout_s: float) -> list:
    port = free_port()
    if device_kind == "cpu":  # forked from a server that has imported torch once: ~1 s less per rank than spawn
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch"])
        results = ctx.Queue()
        environ = env.snapshot()
        payload = pickle.dumps((world_size, port, device_kind, timeout_s, fn, args, kwargs))  # (the same for all)
        procs = [ctx.Process(target=_forked_worker, name=f"epcomm-rank{r}", args=(r, environ, payload, results))
                 for r in range(world_size)]
    else:  # (CUDA: spawn, a fresh process)
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [ctx.Process(target=_worker_main, name=f"epcomm-rank{r}",
                             args=(r, world_size, port, device_kind, timeout_s, fn, args, kwargs, results))
                 for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}
    taken = None
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) + len(errors) < world_size:
            try:
                rank, status, payload = results.get(timeout=0.5)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in out and r not in errors]
                for r in dead:
                    errors[r] = f"process exited with code {procs[r].exitcode} before reporting a result"
                if errors:
                    break
                if time.monotonic() > deadline:
                    pending = [r for r in range(world_size) if r not in out]
                    raise EpcommTimeoutError(f"spawn: ranks {pending} of {world_size} did not finish "
                                             f"{getattr(fn, '__name__', fn)} within {timeout_s:.0f} s")
                continue
            if status == "port_taken":
                taken = payload
                errors[rank] = payload
                break
            (out if status == "ok" else errors)[rank] = payload
            if errors:
                break
    finally:
        if errors or len(out) < world_size:
            for p in procs:
                if p.is_alive():
                    p.terminate()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if taken is not None:
        raise _PortTaken(taken)
    if errors:
        first = min(errors)
        others = sorted(set(errors) - {first})
        raise WorkerError(f"spawn: rank {first} of {world_size} failed in {getattr(fn, '__name__', fn)}"
                          + (f" (ranks {others} failed too)" if others else "")
                          + f":\n{errors[first]}")
    return [out[r] for r in range(world_size)]


def run(fn: Callable, world_size: int | None = None, *args: Any, device: str = "auto",
        timeout_s: float | None = None, **kwargs: Any) -> list:
    """Like ``spawn``, but under torchrun joins the running job instead and returns ``[own result]``."""
    launched = env.distributed_env()
    if launched is None:
        return spawn(fn, world_size or 1, *args, device=device, timeout_s=timeout_s, **kwargs)
    rank, size = int(launched["RANK"]), int(launched["WORLD_SIZE"])
    if world_size not in (None, size):
        log.warning("run: --world-size %s ignored, torchrun started %s ranks", world_size, size)
    _setup_logging(rank)
    device_kind = "cuda" if (device != "cpu" and torch.cuda.is_available()) else "cpu"
    ctx = init_worker(rank, size, device_kind, float(timeout_s or 4 * env.timeout_s()))
    try:
        return [fn(ctx, *args, **kwargs)]
    finally:
        dist.destroy_process_group()
