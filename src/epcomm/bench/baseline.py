"""What a user writes with NCCL today: the plain ``all_to_all_single`` MoE pipeline, for comparison.

Dispatch: layout with torch ops, counts exchanged with an all_to_all and copied to the host, then
``index_select`` + ``all_to_all_single`` for the payload, the FP8 scales, the top-k ids and the top-k
weights (one collective each). Combine: the reverse ``all_to_all_single`` and ``index_add_`` into FP32.
Nothing here is used by epcomm itself; it exists so that benchmarks measure the baseline in the same run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class BaselineHandle:
    send_idx: torch.Tensor
    send_splits: list
    recv_splits: list
    num_tokens: int


def baseline_dispatch(x: torch.Tensor, scales: Optional[torch.Tensor], topk_idx: torch.Tensor,
                      topk_weights: torch.Tensor, num_experts: int, group) -> tuple:
    num_ranks = dist.get_world_size(group)
    experts_per_rank = num_experts // num_ranks
    dest = torch.where(topk_idx >= 0, topk_idx // experts_per_rank, num_ranks)
    in_rank = torch.zeros(x.size(0), num_ranks + 1, dtype=torch.bool, device=x.device)
    in_rank.scatter_(1, dest, True)
    in_rank = in_rank[:, :num_ranks]
    send_counts = in_rank.sum(0).to(torch.int64)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    send_idx = torch.nonzero(in_rank.t())[:, 1]
    num_recv = sum(recv_splits)

    def move(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty(num_recv, *t.shape[1:], dtype=t.dtype, device=t.device)
        src = t.index_select(0, send_idx)
        if t.dtype == torch.float8_e4m3fn:
            dist.all_to_all_single(out.view(torch.uint8), src.view(torch.uint8), recv_splits, send_splits, group=group)
        else:
            dist.all_to_all_single(out, src, recv_splits, send_splits, group=group)
        return out

    recv_x = move(x)
    recv_scales = move(scales) if scales is not None else None
    recv_idx = move(topk_idx)
    recv_w = move(topk_weights)
    return recv_x, recv_scales, recv_idx, recv_w, BaselineHandle(send_idx, send_splits, recv_splits, x.size(0))


def baseline_combine(y: torch.Tensor, handle: BaselineHandle, group) -> torch.Tensor:
    back = torch.empty(len(handle.send_idx), y.size(1), dtype=y.dtype, device=y.device)
    dist.all_to_all_single(back, y, handle.send_splits, handle.recv_splits, group=group)
    out = torch.zeros(handle.num_tokens, y.size(1), dtype=torch.float32, device=y.device)
    out.index_add_(0, handle.send_idx, back.float())
    return out.to(y.dtype)
