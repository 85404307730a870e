"""Typed communication handles (frozen dataclasses) in place of DeepEP's tuples.

A handle records the layout of one dispatch so that a later combine (or a cached dispatch, which is also
combine's backward) can reuse it without recomputing or synchronising. It belongs to the Buffer that made
it: using it with another Buffer raises."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch


def evolve(record: Any, **changes: Any) -> Any:
    """``dataclasses.replace(record, **changes)`` without running ``__init__`` (nor ``__post_init__``): a copy of a
    frozen dataclass instance with ``changes`` set. For the records a call makes and copies many times (requests,
    results, handles, their states), whose fields were checked when first made: ``replace`` costs ~5-10 us of host
    time a copy on the GPU machines, this ~1-2 us, and an exact-mode dispatch across domains makes a dozen copies.
    Only the fields are copied (not what a ``cached_property`` kept of the original). Raises TypeError for a name that
    is not one of the record's fields."""
    fields = type(record).__dataclass_fields__
    for name in changes:
        if name not in fields:
            raise TypeError(f"evolve: {type(record).__name__} has no field {name!r}")
    out = object.__new__(type(record))
    out.__dict__.update({name: value for name, value in record.__dict__.items() if name in fields})
    out.__dict__.update(changes)
    return out


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
    Expert-major receive (``layout == "expert_major"``, ``Buffer.dispatch(..., layout="expert_major")``); the
    fields above still describe the received tokens (rank-major, one per token and rank), these the rows:
        expert_alignment: A, every expert's segment starts at a multiple of it.
        num_recv_rows: rows of the expert-major ``recv_x`` (``sum of align(count_e, A)``, or with
            ``num_worst_tokens`` W: ``W + E_local * (A - 1)``).
        num_topk: K of the dispatch.
        expert_offsets: ``[E_local]`` int32 on the device, the end row of every expert's segment (aligned,
            cumulative): the ``offs`` of ``torch._grouped_mm``; expert e's rows are ``offsets[e-1] ..
            offsets[e] - 1`` (``offsets[-1] = 0``), its first ``num_recv_tokens_per_expert[e]`` real, the rest
            zero padding.
        recv_pair_row: ``[M, K]`` int32, the expert-major row of every (received token, slot), -1 where the
            slot's expert is on another rank (or the slot is -1).
        recv_row_src: ``[num_recv_rows]`` int32, ``m * K + k`` of every row (received token m, slot k), -1 on
            padding rows.
        recv_row_weights: ``[num_recv_rows]`` float32 routing weight of every row (0 on padding), or None
            when the dispatch had no ``topk_weights``: the weights an expert-major combine applies by
            default.
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
    layout: str = "rank_major"
    expert_alignment: int = 1
    num_recv_rows: int = 0
    num_topk: int = 0
    expert_offsets: Optional[torch.Tensor] = field(default=None, repr=False)
    recv_pair_row: Optional[torch.Tensor] = field(default=None, repr=False)
    recv_row_src: Optional[torch.Tensor] = field(default=None, repr=False)
    recv_row_weights: Optional[torch.Tensor] = field(default=None, repr=False)

    @property
    def expert_major(self) -> bool:
        return self.layout == "expert_major"


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
