"""Byte accounting from the actual routing, in the conventions the benchmarks report.

DeepEP's convention ("GB/s (DeepEP)"): the bytes of all token rows a rank *receives*, its own included,
over the call's time; combine counts the same rows as the BF16 dispatch. The NVLink column counts only
rows that cross between GPUs (self-traffic excluded). Low-latency: per selected (token, expert) pair,
dispatch ``H + 4 * H / 128 + 16`` bytes (FP8) or ``2 * H + 16`` (BF16) and combine ``2 * H``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..reference import dispatch_layout


def row_bytes(hidden: int, kind: str) -> int:
    """Bytes of one token row: ``bf16`` 2H, ``fp8`` H + 4H/128 (e4m3 data + float32 scales), ``fp32`` 4H."""
    return {"bf16": 2 * hidden, "fp16": 2 * hidden, "fp32": 4 * hidden, "fp8": hidden + 4 * (hidden // 128)}[kind]


@dataclass(frozen=True)
class NormalTraffic:
    """Rows each rank receives in a normal dispatch: ``recv_rows[r]`` (self included) and ``remote_rows[r]``."""

    recv_rows: tuple
    remote_rows: tuple

    def mean_recv_bytes(self, hidden: int, kind: str) -> float:
        return sum(self.recv_rows) / len(self.recv_rows) * row_bytes(hidden, kind)

    def mean_remote_bytes(self, hidden: int, kind: str) -> float:
        return sum(self.remote_rows) / len(self.remote_rows) * row_bytes(hidden, kind)


def normal_traffic(topk_idxs: Sequence[torch.Tensor], num_experts: int) -> NormalTraffic:
    num_ranks = len(topk_idxs)
    in_rank = [dispatch_layout(t, num_experts, num_ranks).is_token_in_rank for t in topk_idxs]
    recv = [sum(int(in_rank[s][:, r].sum()) for s in range(num_ranks)) for r in range(num_ranks)]
    remote = [recv[r] - int(in_rank[r][:, r].sum()) for r in range(num_ranks)]
    return NormalTraffic(tuple(recv), tuple(remote))


def low_latency_pairs(topk_idxs: Sequence[torch.Tensor]) -> float:
    """Mean number of selected (token, expert) pairs per rank."""
    return sum(int((t >= 0).sum()) for t in topk_idxs) / len(topk_idxs)


def low_latency_bytes(hidden: int, use_fp8: bool) -> tuple[int, int]:
    """(dispatch, combine) bytes per selected (token, expert) pair."""
    return (hidden + 4 * (hidden // 128) + 16) if use_fp8 else (2 * hidden + 16), 2 * hidden
