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


def timeout_s() -> float:
    """Seconds a wait may last before it raises (``EPCOMM_TIMEOUT_S``, default 60)."""
    value = _get("EPCOMM_TIMEOUT_S")
    if value is None:
        return 60.0
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"EPCOMM_TIMEOUT_S={value!r} is not a number of seconds") from None
    if seconds <= 0:
        raise ValueError(f"EPCOMM_TIMEOUT_S={value!r} must be positive")
    return seconds


def log_level() -> str:
    """Level name for the ``epcomm`` logger (``EPCOMM_LOG_LEVEL``, default WARNING)."""
    return (_get("EPCOMM_LOG_LEVEL") or "WARNING").strip().upper()


def distributed_env() -> dict[str, str] | None:
    """The torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) when this
    process was started by a launcher such as torchrun, else None."""
    if _get("RANK") is None or _get("WORLD_SIZE") is None:
        return None
    return {k: os.environ.get(k, "") for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}


def set_distributed_env(rank: int, world_size: int, port: int, addr: str = "127.0.0.1") -> None:
    """Write the torchrun-style variables for a worker this process starts (used by the launcher)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR=addr, MASTER_PORT=str(port))


def set_safe_gpu_defaults() -> None:
    """Keep NVLink multicast off in NCCL, torch symmetric memory and NVSHMEM unless the user chose otherwise.
    Multicast objects are not used by epcomm; leaving them off avoids driver paths that are fragile on
    shared machines."""
    for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                        ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(name, value)


# Variables that belong to CUDA and NCCL, not to epcomm: read here only to report them (topology probe, doctor).
_NCCL_REPORTED = ("NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE", "NCCL_NVLS_ENABLE",
                  "NCCL_SOCKET_IFNAME", "NCCL_NET")


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
