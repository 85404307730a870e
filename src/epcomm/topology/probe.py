"""``probe(group)``: every rank collects its ``LocalFacts``, the group exchanges them with one
``all_gather_object``, every rank builds the same ``TopologyReport``. Cached per (group, device)."""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..core.device import default_device
from ..errors import EpcommError
from .collect import collect_local_facts
from .report import TopologyReport, build_report

log = logging.getLogger(__name__)

_cache: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def probe(group: Optional[Any] = None, device: Optional[torch.device] = None, *,
          refresh: bool = False) -> TopologyReport:
    """The topology of ``group``'s ranks, identical on every rank.

    Collective: every rank of ``group`` must call it (the first time for a (group, device); later calls return
    the cached report without communicating, and every rank's cache is in the same state as long as the ranks
    make the same calls).

    Arguments:
        group: the process group (default: the world group).
        device: the device this rank communicates on (default: the current CUDA device for NCCL groups, CPU
            otherwise). A CPU device touches no CUDA API.
        refresh: probe again even if a report is cached (collective).

    Returns:
        TopologyReport: per rank (host, device, SMs, PCI bus id, software), per pair (link, P2P access, native
        atomics, NVLink), symmetric memory and NVSHMEM availability; every missing capability with its reason.
    """
    if not dist.is_initialized():
        raise EpcommError("probe: torch.distributed is not initialised; call init_process_group first")
    group = group if group is not None else dist.group.WORLD
    device = torch.device(device) if device is not None else default_device(group)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = str(device)
    with _lock:
        cached = _cache.get(group, {}).get(key)
    if cached is not None and not refresh:
        return cached
    facts = collect_local_facts(dist.get_rank(group), device)
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, facts, group=group)
    report = build_report(gathered, backend=str(dist.get_backend(group)))
    with _lock:
        _cache.setdefault(group, {})[key] = report
    log.debug("probe: %d ranks on %d host(s), device %s", report.world_size, report.num_hosts, report.device_type)
    return report


def clear_cache() -> None:
    """Forget every cached report (the next ``probe`` of each group communicates again)."""
    with _lock:
        _cache.clear()
