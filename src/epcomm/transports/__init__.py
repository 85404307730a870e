"""Transports, one file each, behind the interface in ``base``; ``create_transport`` picks one."""

from __future__ import annotations

import torch

from ..errors import TransportUnavailableError
from .alltoall import AllToAllTransport
from .base import Capabilities, Transport

TRANSPORTS = {"alltoall": AllToAllTransport}
CHOICES = ("auto", "nvlink", "p2p", "alltoall")


def create_transport(name: str, group, device: torch.device, buffer_id: int, **sizes) -> tuple[Transport, str]:
    """The transport ``name`` (or the best one for this group with ``auto``) and the reason for the choice."""
    if name not in CHOICES:
        raise ValueError(f"Buffer: transport={name!r} is not one of {CHOICES}")
    if name == "auto":
        return AllToAllTransport(group, device, buffer_id), "auto: the portable all_to_all transport"
    if name not in TRANSPORTS:
        raise TransportUnavailableError(f"Buffer: transport {name!r} is not available in this build")
    return TRANSPORTS[name](group, device, buffer_id), f"forced: transport={name!r}"


__all__ = ["Capabilities", "Transport", "AllToAllTransport", "TRANSPORTS", "create_transport"]
