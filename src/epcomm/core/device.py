"""The device a process group communicates on, a name of a device that every process of the host agrees on, and
which groups of ranks sharing GPUs a one-sided heap can map."""

from __future__ import annotations

import torch
import torch.distributed as dist


def default_device(group) -> torch.device:
    """The current CUDA device when ``group`` communicates CUDA tensors (NCCL, or a backend mapped to ``cuda:``
    such as ``cpu:gloo,cuda:gloo`` for ranks that share a GPU), else the CPU."""
    backend = str(dist.get_backend(group)).lower()
    if ("nccl" in backend or "cuda:" in backend) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def device_uuid(device: torch.device) -> str:
    """A name of ``device`` that is the same in every process of the host (the GPU's UUID; ``cpu`` for the CPU)."""
    if device.type != "cuda":
        return "cpu"
    return str(torch.cuda.get_device_properties(device).uuid)


def split_shared_group(gpus: list) -> bool:
    """Whether a group whose ranks are on ``gpus`` (one GPU name or index per rank) both shares a GPU and spans
    several: its symmetric heap would map another GPU's memory through CUDA IPC, which that GPU's kernels cannot
    reach (an illegal address on H200s, even with peer access enabled), so the heap refuses it."""
    return 1 < len(set(gpus)) < len(gpus)
