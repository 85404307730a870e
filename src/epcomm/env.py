"""Every environment variable epcomm reads is read here, and only here.

Values are read at call time (not cached at import) so that tests and launchers can set them per process.

| variable | meaning | default |
|---|---|---|
| ``EPCOMM_TRANSPORT`` | force the transport for every Buffer of the process (``auto``, ``nvlink``, ``p2p``, ``alltoall``) | unset: the Buffer's own argument |
| ``EPCOMM_DEBUG`` | ``1``: per-phase timings and extra checks are logged | ``0`` |
| ``EPCOMM_VALIDATE`` | ``cheap`` (checks that cost no host sync, plus those folded into syncs the call makes anyway), ``full`` (every check, host syncs allowed), ``off`` | ``cheap`` |
| ``EPCOMM_TIMEOUT_S`` | seconds any host or device wait may last before it raises | ``60`` |
| ``EPCOMM_LOG_LEVEL`` | level of the ``epcomm`` logger (``INFO``, ``DEBUG`` ...) | ``WARNING`` |
| ``EPCOMM_COMMIT`` | the commit recorded in benchmark results where the checkout has no git metadata | unset: ``git rev-parse`` |
| ``EPCOMM_RANKS_PER_NODE`` | ranks per node (NVLink domain) of every ``Buffer``, instead of what the topology probe finds (consecutive ranks form a node); on one machine it splits the ranks into simulated nodes, and the test launcher then gives each simulated node its own ``NCCL_HOSTID`` | unset: the probe's |
| ``EPCOMM_INTERNODE_CHUNKS`` | how many chunks a normal-mode call across nodes is pipelined in (a whole number from 1 to 16), instead of the count its first calls measure as fastest | unset: measured |
| ``EPCOMM_RAIL_NCCL`` | ``1``: between simulated nodes of ranks that share GPUs (gloo for their CUDA collectives), the inter-domain groups over NCCL all the same, and each domain's group too where no two of its ranks share a GPU (testing: NCCL between the nodes on one or two GPUs; small calls only: DeepSeek-sized ones stalled, and with 4 ranks on one GPU also 512 x 2048) | unset |
| ``EPCOMM_RANKS_PER_GPU`` | how many ranks the launcher may place on one GPU (more than 1: testing the one-sided kernels on a machine with fewer GPUs than ranks; see ``epcomm.testing.launcher``) | ``1`` |
"""

from __future__ import annotations

import os

_TRANSPORTS = ("auto", "nvlink", "p2p", "alltoall")
_VALIDATE = ("off", "cheap", "full")


def _get(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def transport_override() -> str | None:
    """The transport forced for the whole process by ``EPCOMM_TRANSPORT``, or None."""
    value = _get("EPCOMM_TRANSPORT")
    if value is None:
        return None
    value = value.strip().lower()
    if value not in _TRANSPORTS:
        raise ValueError(f"EPCOMM_TRANSPORT={value!r} is not one of {_TRANSPORTS}; unset it or pick one of those")
    return value


def debug() -> bool:
    """True when ``EPCOMM_DEBUG`` is set to a true value (1, true, yes, on)."""
    return (_get("EPCOMM_DEBUG") or "0").strip().lower() in ("1", "true", "yes", "on")


def validate_level() -> str:
    """How much input checking to do: ``off``, ``cheap`` or ``full`` (``EPCOMM_VALIDATE``)."""
    value = (_get("EPCOMM_VALIDATE") or "cheap").strip().lower()
    if value not in _VALIDATE:
        raise ValueError(f"EPCOMM_VALIDATE={value!r} is not one of {_VALIDATE}")
    return value


def _number(name: str, default, parse, valid, expect: str):
    """``name`` parsed with ``parse`` and checked with ``valid`` (``default`` when unset); errors say ``expect``."""
    value = _get(name)
    if value is None:
        return default
    try:
        number = parse(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not {expect}; unset it or give {expect}") from None
    if not valid(number):
        raise ValueError(f"{name}={value!r} must be {expect}")
    return number


def timeout_s() -> float:
    """Seconds a wait may last before it raises (``EPCOMM_TIMEOUT_S``, default 60)."""
    return _number("EPCOMM_TIMEOUT_S", 60.0, float, lambda s: s > 0, "a positive number of seconds")


def internode_chunks() -> int | None:
    """The pipelined chunks of a normal-mode call across nodes forced by ``EPCOMM_INTERNODE_CHUNKS``, or None
    (the hierarchical transport measures its first calls)."""
    return _number("EPCOMM_INTERNODE_CHUNKS", None, int, lambda n: 1 <= n <= 16, "a whole number from 1 to 16")


def ranks_per_gpu() -> int:
    """How many ranks ``epcomm.testing`` may place on one GPU (``EPCOMM_RANKS_PER_GPU``, default 1)."""
    return _number("EPCOMM_RANKS_PER_GPU", 1, int, lambda n: 1 <= n <= 8, "a whole number from 1 to 8")


def rail_nccl() -> bool:
    """``EPCOMM_RAIL_NCCL=1``: the hierarchical transport's inter-domain groups over NCCL even where the group's CUDA
    collectives are gloo's (ranks sharing GPUs, split into simulated nodes: each node has its own ``NCCL_HOSTID``, so
    NCCL takes its ranks for other hosts' and connects them through its network path); then also the domain groups
    whose ranks are on distinct GPUs (4 ranks on 2 GPUs in nodes of 2: each node's count gather over NVLink, as on a
    real node, not gloo's ~1 ms; ``transports.hierarchical.domain_backend``). Testing only, and small calls
    only: DeepSeek-sized calls (4 ranks on 2 GPUs) stalled until the device's timeout, with the early node leg or
    without it (likely: NCCL's kernels and the one-sided ones waiting on the device for other processes' kernels on
    the shared GPU; not pinned down)."""
    return _get("EPCOMM_RAIL_NCCL") == "1"


def ranks_per_node() -> int | None:
    """Ranks per node (domain) forced by ``EPCOMM_RANKS_PER_NODE``, or None (the topology probe decides)."""
    return _number("EPCOMM_RANKS_PER_NODE", None, int, lambda n: n >= 1, "a positive whole number")


def set_simulated_host(node: int) -> None:
    """For a worker of simulated node ``node`` (``EPCOMM_RANKS_PER_NODE`` on one machine): unless the user chose
    otherwise, a per-node ``NCCL_HOSTID``, so that NCCL treats the simulated nodes as separate hosts and connects
    them through its network transport. Must run before the process creates NCCL communicators."""
    os.environ.setdefault("NCCL_HOSTID", f"epcomm-simulated-node-{node}")


def set_gpu_share(ranks_on_gpu: int) -> None:
    """For a worker that shares its GPU with ``ranks_on_gpu - 1`` other ranks: unless the user chose otherwise,
    an MPS server (if one runs) gives each of them an equal share of the SMs
    (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``), so that every rank's kernels fit on the GPU at the same time.
    Without an MPS server the variable has no effect. Must run before the process creates its CUDA context."""
    if ranks_on_gpu > 1:
        os.environ.setdefault("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", str(100 // ranks_on_gpu))


def log_level() -> str:
    """Level name for the ``epcomm`` logger (``EPCOMM_LOG_LEVEL``, default WARNING)."""
    return (_get("EPCOMM_LOG_LEVEL") or "WARNING").strip().upper()


def distributed_env() -> dict[str, str] | None:
    """The torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
    when this process was started by a launcher such as torchrun, else None."""
    if _get("RANK") is None or _get("WORLD_SIZE") is None:
        return None
    return {k: os.environ.get(k, "") for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                               "MASTER_PORT")}


def snapshot() -> dict:
    """This process's environment, for a worker the launcher starts (``adopt`` applies it there)."""
    return dict(os.environ)


def adopt(environ: dict) -> None:
    """Make this process's environment ``environ`` (a worker started from a process other than the launching one,
    whose environment it would otherwise inherit)."""
    os.environ.clear()
    os.environ.update(environ)


def set_distributed_env(rank: int, world_size: int, port: int, addr: str = "127.0.0.1") -> None:
    """Write the torchrun-style variables for a worker this process starts (used by the launcher)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR=addr, MASTER_PORT=str(port))


def set_safe_gpu_defaults() -> None:
    """Keep NVLink multicast off in NCCL, torch symmetric memory and NVSHMEM unless the user chose otherwise.
    Multicast objects are not used by epcomm; leaving them off avoids driver paths that are fragile on
    shared machines."""
    for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                        ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(name, value)


# Variables that belong to CUDA and NCCL, not to epcomm: read here only to report them (topology probe, doctor).
_NCCL_REPORTED = ("NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE", "NCCL_NVLS_ENABLE",
                  "NCCL_SOCKET_IFNAME", "NCCL_NET", "NCCL_HOSTID")


def cuda_visible_devices() -> str | None:
    """``CUDA_VISIBLE_DEVICES`` as set, or None (reported by the topology probe, never changed)."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def nccl_settings() -> dict[str, str]:
    """The NCCL variables that shape intranode and network paths (``NCCL_P2P_DISABLE``, ``NCCL_P2P_LEVEL``,
    ``NCCL_SHM_DISABLE``, ``NCCL_IB_DISABLE``, ``NCCL_NVLS_ENABLE``, ``NCCL_SOCKET_IFNAME``, ``NCCL_NET``)
    that are set, by name; ``epcomm doctor`` prints them next to its hints."""
    return {name: os.environ[name] for name in _NCCL_REPORTED if name in os.environ}


def commit_override() -> str | None:
    """``EPCOMM_COMMIT``: the commit to record in benchmark results (a copied tree, whose git may be absent or
    stale); when set it wins over git."""
    return _get("EPCOMM_COMMIT")
