"""Transports, one file each, behind the interface in ``base``; ``create_transport`` picks one."""

from __future__ import annotations

import inspect

import torch

from .. import env
from ..errors import TransportUnavailableError
from .alltoall import AllToAllTransport
from .base import Capabilities, Transport
from .nvlink import NVLinkTransport, P2PTransport

TRANSPORTS = {"alltoall": AllToAllTransport, "nvlink": NVLinkTransport, "p2p": P2PTransport}
CHOICES = ("auto", "nvlink", "p2p", "alltoall")


def create_transport(name: str, group, device: torch.device, buffer_id: int, **sizes) -> tuple[Transport, str]:
    """The transport ``name`` (or the best one for this group with ``auto``) and the reason for the choice.

    ``EPCOMM_TRANSPORT`` overrides ``name`` for the whole process. ``auto`` probes the group once
    (``epcomm.topology.probe``, collective, cached per group) and takes the first of nvlink, p2p, alltoall that
    the hardware runs and this build registers in ``TRANSPORTS``; ``alltoall`` needs no probe. A forced
    transport the hardware cannot run, or that this build lacks, raises TransportUnavailableError naming the
    missing capability and the ranks. ``sizes`` (num_nvl_bytes, num_rdma_bytes) reach the transports whose
    constructors take them."""
    if isinstance(name, type) and issubclass(name, Transport):  # a transport class, used as given
        return _construct(name, group, device, buffer_id, sizes), f"transport class {name.__name__} given"
    if name not in CHOICES:
        raise ValueError(f"Buffer: transport={name!r} is not one of {CHOICES} (or a Transport subclass)")
    override = env.transport_override()
    requested, source = (override, f"EPCOMM_TRANSPORT={override}") if override else (name, f"transport={name!r}")
    if requested == "alltoall":
        return _construct(TRANSPORTS["alltoall"], group, device, buffer_id, sizes), f"forced by {source}"
    from ..topology import choose_transport, probe

    report = probe(group, device)
    try:
        chosen, reason = choose_transport(report, requested, available=tuple(TRANSPORTS))
    except TransportUnavailableError as exc:
        raise TransportUnavailableError(f"Buffer ({source}): {exc}") from None
    if requested != "auto":
        reason = f"{source}: {reason}"
    return _construct(TRANSPORTS[chosen], group, device, buffer_id, sizes), reason


def _construct(cls, group, device: torch.device, buffer_id: int, sizes: dict) -> Transport:
    """``cls(group, device, buffer_id, **the sizes its constructor accepts)``."""
    params = inspect.signature(cls).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return cls(group, device, buffer_id, **{k: v for k, v in sizes.items() if takes_all or k in params})


__all__ = ["Capabilities", "Transport", "AllToAllTransport", "NVLinkTransport", "P2PTransport", "TRANSPORTS",
           "create_transport"]
