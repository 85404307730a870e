"""The expert-major receive layout and its weighted combine, for every transport.

A transport delivers the received tokens rank-major (one row per token and rank, ``Transport.dispatch``);
``to_expert_major`` turns that into rows grouped by local expert (one row per (token, local slot), every
expert's segment starting at a multiple of ``expert_alignment``, padding rows zero), with the per-row routing
weights and the int32 segment ends (``torch._grouped_mm``'s ``offs``) on the device: one scan kernel per local
expert (``pair_rows``) and one permute kernel (``permute``) on GPUs, torch on CPUs without the Triton
interpreter; no host synchronisation. (The one-sided transports place the rows there themselves,
``NVLinkTransport.dispatch_expert_major``, and use this module for cached dispatches.) ``reduce_pairs`` is
the local half of the combine: per received token, the sum in slot order of its pairs' rows times their weights
(float32, cast once to the rows' dtype), which then travels back as the rank-major combine's row (so a token's
result is, in float32 and rank order, the sum of one such per-rank partial from every rank it went to).

The kernels are in ``epcomm.kernels.expert_major``; the torch versions here are bit-identical to them and are
what CPUs run without the interpreter.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..core.handles import DispatchHandle
from ..core.layout import expert_major_rows
from ..kernels import use_kernels


def _align(t: torch.Tensor, a: int) -> torch.Tensor:
    return (t + a - 1) // a * a


def pair_rows(ids: torch.Tensor, counts: torch.Tensor, weights: Optional[torch.Tensor], rows: int, align: int,
              err: torch.Tensor):
    """Where every (received token, slot) goes in an expert-major tensor of ``rows`` rows.

    ``ids [M, K]`` local expert ids (-1: not here), ``counts [E]`` int32 pairs per local expert (device),
    ``weights [M, K]`` float32 or None. Returns ``(offs [E] int32, pair_row [M, K] int32, row_src [rows] int32,
    row_w [rows] float32 or None)`` (see ``epcomm.kernels.expert_major``). Pairs that find no row (counts
    that disagree with ``ids``, more pairs than ``rows``) are added to ``err[0]`` (int32)."""
    m, k = ids.shape
    e = counts.numel()
    dev = ids.device
    offs = torch.empty(e, dtype=torch.int32, device=dev)
    pair_row = torch.empty(m, k, dtype=torch.int32, device=dev)
    row_src = torch.empty(rows, dtype=torch.int32, device=dev)
    row_w = torch.empty(rows, dtype=torch.float32, device=dev) if weights is not None else None
    if use_kernels(ids):
        from ..kernels.expert_major import launch_pair_rows

        if e == 0:
            pair_row.fill_(-1)
            row_src.fill_(-1)
            if row_w is not None:
                row_w.zero_()
        else:
            launch_pair_rows(ids.contiguous(), counts, weights.contiguous() if weights is not None else None, offs,
                             pair_row, row_src, row_w, err, rows, align)
        return offs, pair_row, row_src, row_w
    flat = ids.reshape(-1).long()
    n = flat.numel()
    cnt = counts.long()
    end = torch.cumsum(_align(cnt, align), 0)
    start = end - _align(cnt, align)
    offs.copy_(end.clamp(max=rows))
    valid = (flat >= 0) & (flat < e)
    key = torch.where(valid, flat, e)
    order = torch.argsort(key * max(n, 1) + torch.arange(n, device=dev))
    actual = torch.bincount(key, minlength=e + 1)
    first = torch.cumsum(actual, 0) - actual
    idx = torch.empty(n, dtype=torch.int64, device=dev)
    idx[order] = torch.arange(n, device=dev) - first[key[order]]
    ec = flat.clamp(0, max(e - 1, 0))
    row = start[ec] + idx if e else idx
    in_count = valid & (idx < cnt[ec]) if e else valid
    ok = in_count & (row < rows)
    pair_row.copy_(torch.where(ok, row, -1).view(m, k))
    err[0] += ((actual[:e] - cnt).abs().sum() + (in_count & ~ok).sum()).to(err.dtype)
    dst = torch.where(ok, row, rows)
    full = torch.full((rows + 1,), -1, dtype=torch.int32, device=dev)
    full.index_copy_(0, dst, torch.arange(n, dtype=torch.int32, device=dev))
    row_src.copy_(full[:rows])
    if row_w is not None:
        wfull = torch.zeros(rows + 1, dtype=torch.float32, device=dev)
        wfull.index_copy_(0, dst, weights.reshape(-1).float())
        row_w.copy_(wfull[:rows])
    return offs, pair_row, row_src, row_w


def permute(src: torch.Tensor, pair_row: torch.Tensor, rows: int, counts: torch.Tensor, align: int) -> torch.Tensor:
    """``src [M, W]`` rank-major rows into a new ``[rows, W]`` tensor at ``pair_row [M, K]``; padding rows of the
    segments of ``counts`` are zero (rows past the last segment: unspecified on GPUs, zero on CPUs)."""
    out = torch.empty(rows, src.size(1), dtype=src.dtype, device=src.device)
    if use_kernels(src) and src.size(1) * src.element_size() % 4 == 0:
        from ..kernels.expert_major import launch_permute

        if counts.numel():
            launch_permute(src.contiguous(), pair_row, out, counts, align)
        return out
    view = torch.uint8 if src.dtype.itemsize == 1 else src.dtype  # index ops lack some dtypes (FP8)
    full = torch.zeros(rows + 1, src.size(1), dtype=view, device=src.device)
    r = pair_row.long()
    s = src.contiguous().view(view)
    for kk in range(r.size(1)):
        dst = torch.where(r[:, kk] >= 0, r[:, kk], rows)
        full.index_copy_(0, dst, s)
    out.view(view).copy_(full[:rows])
    return out


def reduce_pairs(y: torch.Tensor, pair_row: torch.Tensor, weights: Optional[torch.Tensor],
                 values: Optional[torch.Tensor], out_dtype: torch.dtype):
    """The combine's local reduction. ``y [rows, H]`` expert-major rows, ``pair_row [M, K]``, ``weights [rows]``
    float32 or None (unweighted). Returns ``(partial [M, H] of out_dtype, values_out [M, K] float32 or None)``:
    ``partial[m] = cast(sum over k ascending with a row of weights[row] * float(y[row]))`` (float32 from +0.0,
    each product rounded before its add) and ``values_out[m, k] = values[pair_row[m, k]]`` (0.0 without a
    row)."""
    m, k = pair_row.shape
    h = y.size(1)
    partial = torch.empty(m, h, dtype=out_dtype, device=y.device)
    values_out = torch.empty(m, k, dtype=torch.float32, device=y.device) if values is not None else None
    if use_kernels(y) and h >= 1:
        from ..kernels.expert_major import launch_expert_reduce

        launch_expert_reduce(y, pair_row, weights, values, partial, values_out)
        return partial, values_out
    acc = torch.zeros(m, h, dtype=torch.float32, device=y.device)
    zero = torch.zeros((), dtype=torch.float32, device=y.device)
    r = pair_row.long()
    for kk in range(k):
        rk = r[:, kk]
        ok = rk >= 0
        if not bool(ok.any()):
            continue
        safe = rk.clamp(min=0)
        v = y.index_select(0, safe).float()
        if weights is not None:
            v = weights.index_select(0, safe).unsqueeze(1) * v
        acc = acc + torch.where(ok.unsqueeze(1), v, zero)
    partial.copy_(acc)
    if values is not None:
        values_out.copy_(torch.where(r >= 0, values[r.clamp(min=0)] if values.numel() else zero, zero))
    return partial, values_out


def weighted_rows_grad(g: torch.Tensor, y: Optional[torch.Tensor], weights: torch.Tensor, row_src: torch.Tensor):
    """Backward of ``weights[row] * y[row]`` (rows with ``row_src >= 0``; other rows give zeros): ``(grad_y
    [rows, H] = cast(weights * float(g)) in g's dtype, grad_w [rows] float32 = <float(g), float(y)>`` or None
    without ``y``)."""
    rows, h = g.shape
    grad_y = torch.empty_like(g)
    grad_w = torch.empty(rows, dtype=torch.float32, device=g.device) if y is not None else None
    if use_kernels(g):
        from ..kernels.expert_major import launch_weighted_rows_grad

        launch_weighted_rows_grad(g.contiguous(), y.contiguous() if y is not None else None, weights, row_src,
                                  grad_y, grad_w)
        return grad_y, grad_w
    valid = (row_src >= 0).unsqueeze(1)
    zero = torch.zeros((), dtype=torch.float32, device=g.device)
    g32 = torch.where(valid, g.float(), zero)
    grad_y.copy_(torch.where(valid, weights.unsqueeze(1) * g32, zero))
    if y is not None:
        grad_w.copy_(torch.where(valid, g32 * y.float(), zero).sum(1))
    return grad_y, grad_w


# ------------------------------------------------------------------------------------------ transport glue
def to_expert_major(res, req, err: torch.Tensor):
    """A rank-major ``DispatchResult`` of ``req`` (with top-k ids) as its expert-major result: ``recv_x``
    (and scales) ``[rows, ...]``, ``recv_topk_idx`` = the segment ends ``[E_local]`` int32, ``recv_topk_weights``
    = the row weights ``[rows]`` (None without weights), the same per-expert list, and an expert-major handle."""
    from .base import DispatchResult

    h: DispatchHandle = res.handle
    align = req.expert_alignment
    e_local = req.num_experts // h.num_ranks
    if req.num_worst_tokens:
        rows = expert_major_rows(req.num_worst_tokens, e_local, align)
    else:
        rows = sum(res.num_recv_tokens_per_expert_list)
    counts = h.num_recv_tokens_per_expert
    offs, pair_row, row_src, row_w = pair_rows(res.recv_topk_idx, counts, res.recv_topk_weights, rows, align, err)
    x = permute(res.recv_x, pair_row, rows, counts, align)
    scales = permute(res.recv_scales, pair_row, rows, counts, align) if res.recv_scales is not None else None
    handle = dataclasses.replace(h, layout="expert_major", expert_alignment=align, num_recv_rows=rows,
                                 num_topk=pair_row.size(1), expert_offsets=offs, recv_pair_row=pair_row,
                                 recv_row_src=row_src, recv_row_weights=row_w)
    return DispatchResult(x, scales, offs, row_w, res.num_recv_tokens_per_expert_list, handle)


def cached_to_expert_major(res, h: DispatchHandle):
    """A rank-major cached ``DispatchResult`` with the expert-major handle ``h`` as expert-major rows."""
    from .base import DispatchResult

    counts = h.num_recv_tokens_per_expert
    x = permute(res.recv_x, h.recv_pair_row, h.num_recv_rows, counts, h.expert_alignment)
    scales = (permute(res.recv_scales, h.recv_pair_row, h.num_recv_rows, counts, h.expert_alignment)
              if res.recv_scales is not None else None)
    return DispatchResult(x, scales, None, None, None, h)
