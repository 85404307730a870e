"""Typed communication handles (frozen dataclasses) in place of DeepEP's tuples.

A handle records the layout of one dispatch so that a later combine (or a cached dispatch, which is also
combine's backward) can reuse it without recomputing or synchronising. It belongs to the Buffer that made
it: using it with another Buffer raises."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass(frozen=True, eq=False)
class DispatchHandle:
    """Layout of one normal dispatch.

    Sender side (this rank's tokens):
        num_tokens: N, rows of the dispatched ``x``.
        is_token_in_rank: ``[N, R]`` bool.
        num_tokens_per_rank: host tuple of R ints (None when the call made no host synchronisation).
    Receiver side (rows this rank received):
        num_recv_tokens: M, rows of ``recv_x`` (``num_worst_tokens`` when that was given).
        num_recv_tokens_per_rank: host tuple of R ints, rows from each source rank (None without host sync).
        num_recv_tokens_per_expert: ``[E_local]`` int32 on the device, not aligned.
        recv_src_rank, recv_src_idx: ``[M]`` int32, source rank and source token of every received row
            (-1 on padding rows past the real count).
    Transport-private state is in ``state``.
    """

    buffer_id: int
    transport: str
    num_ranks: int
    num_experts: int
    num_tokens: int
    hidden: int
    is_token_in_rank: torch.Tensor
    num_tokens_per_rank: Optional[tuple]
    num_recv_tokens: int
    num_recv_tokens_per_rank: Optional[tuple]
    num_recv_tokens_per_expert: torch.Tensor
    recv_src_rank: torch.Tensor
    recv_src_idx: torch.Tensor
    num_worst_tokens: int = 0
    state: Any = field(default=None, repr=False)


@dataclass(frozen=True, eq=False)
class LowLatencyHandle:
    """Layout of one low-latency dispatch.

    num_max_dispatch_tokens_per_rank: T; hidden: H; num_experts: E; num_ranks: R; num_tokens, num_topk: the
        sender's ``topk_idx`` shape.
    src_info: ``[E_local, R * T]`` int32, the source token of each received row (-1 past ``recv_count``).
    layout_range: ``[E_local, R, 2]`` int32, for every local expert and source rank the (first row, count)
        of that rank's rows.
    recv_count: ``[E_local]`` int32, rows received per local expert.
    Transport-private state is in ``state``.
    """

    buffer_id: int
    transport: str
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    num_ranks: int
    num_tokens: int
    num_topk: int
    src_info: torch.Tensor
    layout_range: torch.Tensor
    recv_count: torch.Tensor
    state: Any = field(default=None, repr=False)
