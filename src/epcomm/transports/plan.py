"""The device-side send plan shared by the copy-based transports: where every (token, destination) pair
goes and the int32 record that travels with it. No host synchronisation."""

from __future__ import annotations

import torch

from .base import DispatchRequest


def exclusive_cumsum(t: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cumsum(t, dim=dim) - t


def send_plan(req: DispatchRequest, counts: torch.Tensor, capacity: int, rank: int, num_ranks: int,
              errors: torch.Tensor):
    """Where every (token, destination) pair goes in the send area, computed on the device.

    Exact mode (``capacity == 0``): rank ``r``'s rows start after the rows of ranks ``< r``.
    Padded mode: rank ``r``'s rows start at ``r * capacity``; pairs past the capacity are counted as
    overflow (added to ``errors[0]``). Returns ``slot [N, R]`` (row in the send area or -1), ``send_idx``
    (token of every row; rows nothing lands on point at token 0), ``meta`` (the int32 record of every row:
    source token, source rank, scales, local top-k ids, weights) and ``pos [N, R]`` (index of the token
    among this rank's tokens for that destination)."""
    e_local = req.num_experts // num_ranks
    itr, dev = req.is_token_in_rank, req.x.device
    n = itr.size(0)
    pos = torch.cumsum(itr, dim=0, dtype=torch.int64) - 1
    ranks = torch.arange(num_ranks, device=dev)
    if capacity:
        base, rows = ranks * capacity, num_ranks * capacity
        fits = itr & (pos < capacity)
        errors[0] += (itr & ~fits).sum(dtype=torch.int32)
    else:
        base, rows = exclusive_cumsum(counts[:, 0].long(), 0), n * num_ranks
        fits = itr
    slot = torch.where(fits, base + pos, -1)
    dest = torch.where(fits, slot, rows).flatten()  # row ``rows`` is a discard row
    tokens = torch.arange(n, device=dev).unsqueeze(1).expand(n, num_ranks)
    send_idx = torch.zeros(rows + 1, dtype=torch.int64, device=dev)
    send_idx.index_copy_(0, dest, tokens.reshape(-1))
    # per-(token, destination) record: [source token | source rank | scales | local top-k ids | weights]
    cols = [tokens.to(torch.int32).unsqueeze(2),
            torch.full((n, num_ranks, 1), rank, dtype=torch.int32, device=dev)]
    if req.x_scales is not None:
        sc = req.x_scales.contiguous().view(torch.int32)
        cols.append(sc.unsqueeze(1).expand(n, num_ranks, sc.size(1)))
    if req.topk_idx is not None:
        idx = req.topk_idx.long().unsqueeze(1)  # [N, 1, K]
        local = idx - (ranks * e_local).view(1, num_ranks, 1)
        mine = (idx >= 0) & (local >= 0) & (local < e_local)
        cols.append(torch.where(mine, local, -1).to(torch.int32))
        if req.topk_weights is not None:
            cols.append(torch.where(mine, req.topk_weights.unsqueeze(1), 0.0).view(torch.int32))
    width = sum(c.size(2) for c in cols)
    pairs = torch.cat(cols, dim=2).view(n * num_ranks, width)
    meta = torch.empty(rows + 1, pairs.size(1), dtype=torch.int32, device=dev)
    meta.index_copy_(0, dest, pairs)
    return slot, send_idx[:rows], meta[:rows], pos
