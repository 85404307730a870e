"""The device a process group communicates on."""

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
