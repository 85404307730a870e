"""Ordered row reduction: the combine epilogue of every copy-based transport.

``out[t] = cast(sum over r = 0..R-1 with a row for (t, r) of float32(buf[row]) + bias0[t] + bias1[t])``,
added in that order starting from +0.0, so results are bit-identical to ``epcomm.reference.combine``.
The row of (t, r) comes from a slot table (``reduce_rows``) or from the layout itself (``reduce_from_layout``:
``r * cap + pos[t, r] - first[r]`` where ``is_token_in_rank[t, r]``), which saves building the table; there,
the rows of one rank ``r = self_rank`` may come from a second tensor instead (``self_x`` row ``self_base[r] +
pos[t, r]``: the one-sided combine reads its own rows where they are instead of sending them to itself).
One program handles one token and one block of columns; each row of ``buf`` is read once. With weights, the
programs of column block 0 also reduce the token's top-k weights the same way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .launch import cdiv, launch, next_pow2
from .numerics import f32_to_bf16_rne


@triton.jit(do_not_specialize=["cap", "t_begin", "t_end", "self_rank", "self_rows"])
def _reduce_kernel(buf_ptr, slot_ptr, itr_ptr, pos_ptr, first_ptr, cap, t_begin, t_end, b0_ptr, b1_ptr, out_ptr,
                   wbuf_ptr, wout_ptr, hidden, buf_stride, b0_stride, b1_stride, out_stride, wout_stride, self_ptr,
                   self_w_ptr, self_base_ptr, self_rank, self_stride, self_rows, NUM_SLOTS: tl.constexpr,
                   FROM_LAYOUT: tl.constexpr, FIRST_ZERO: tl.constexpr, HAS_B0: tl.constexpr, HAS_B1: tl.constexpr,
                   HAS_W: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr, OUT_BF16: tl.constexpr,
                   BLOCK: tl.constexpr, PERSISTENT: tl.constexpr = False, HAS_SELF: tl.constexpr = False):
    """Program ``(p, c)`` reduces columns block ``c`` of token ``t_begin + p``; ``PERSISTENT``: of tokens
    ``t_begin + p``, ``t_begin + p + P``, ... below ``t_end`` (a grid of ``P`` programs per column block,
    to keep the kernel on a bounded number of SMs)."""
    if PERSISTENT:
        token = (t_begin + tl.program_id(0)).to(tl.int64)
        while token < t_end:
            _reduce_one(buf_ptr, slot_ptr, itr_ptr, pos_ptr, first_ptr, cap, token, b0_ptr, b1_ptr, out_ptr,
                        wbuf_ptr, wout_ptr, hidden, buf_stride, b0_stride, b1_stride, out_stride, wout_stride,
                        self_ptr, self_w_ptr, self_base_ptr, self_rank, self_stride, self_rows, NUM_SLOTS, FROM_LAYOUT,
                        FIRST_ZERO, HAS_B0, HAS_B1, HAS_W, K, BLOCK_K, OUT_BF16, BLOCK, HAS_SELF)
            token += tl.num_programs(0)
    else:
        _reduce_one(buf_ptr, slot_ptr, itr_ptr, pos_ptr, first_ptr, cap, (t_begin + tl.program_id(0)).to(tl.int64),
                    b0_ptr, b1_ptr, out_ptr, wbuf_ptr, wout_ptr, hidden, buf_stride, b0_stride, b1_stride,
                    out_stride, wout_stride, self_ptr, self_w_ptr, self_base_ptr, self_rank, self_stride, self_rows,
                    NUM_SLOTS, FROM_LAYOUT, FIRST_ZERO, HAS_B0, HAS_B1, HAS_W, K, BLOCK_K, OUT_BF16, BLOCK, HAS_SELF)


@triton.jit
def _reduce_one(buf_ptr, slot_ptr, itr_ptr, pos_ptr, first_ptr, cap, token, b0_ptr, b1_ptr, out_ptr,
                wbuf_ptr, wout_ptr, hidden, buf_stride, b0_stride, b1_stride, out_stride, wout_stride, self_ptr,
                self_w_ptr, self_base_ptr, self_rank, self_stride, self_rows, NUM_SLOTS: tl.constexpr,
                FROM_LAYOUT: tl.constexpr,
                FIRST_ZERO: tl.constexpr, HAS_B0: tl.constexpr, HAS_B1: tl.constexpr, HAS_W: tl.constexpr,
                K: tl.constexpr, BLOCK_K: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK: tl.constexpr,
                HAS_SELF: tl.constexpr):
    """One token's columns block ``program_id(1)``: the ordered FP32 sum of its rows, plus the biases."""
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < hidden
    kc = tl.arange(0, BLOCK_K)
    do_w = HAS_W & (tl.program_id(1) == 0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    wacc = tl.zeros([BLOCK_K], dtype=tl.float32)
    for r in tl.static_range(NUM_SLOTS):
        if FROM_LAYOUT:
            present = tl.load(itr_ptr + token * NUM_SLOTS + r) != 0
            p = tl.load(pos_ptr + token * NUM_SLOTS + r)
            rel = p
            if not FIRST_ZERO:
                rel -= tl.load(first_ptr + r)
            # a row past the cap rows of rank r's region was never sent (an overflowing num_worst_tokens, an error
            # recorded by the dispatch): read nothing there; cap 0: one unbounded region
            present = present & ((rel < cap) | (cap == 0))
            slot = tl.where(present, r * cap + rel, -1).to(tl.int64)
        else:
            slot = tl.load(slot_ptr + token * NUM_SLOTS + r).to(tl.int64)
        row_ptr = buf_ptr + slot * buf_stride
        w_row_ptr = wbuf_ptr + slot * K
        if HAS_SELF:  # (only with FROM_LAYOUT) rank self_rank's rows come from self_ptr, rows [0, self_rows)
            srow = (tl.load(self_base_ptr + self_rank) + p).to(tl.int64)
            row_ptr = tl.where(r == self_rank, self_ptr + srow * self_stride, row_ptr)
            w_row_ptr = tl.where(r == self_rank, self_w_ptr + srow * K, w_row_ptr)
            slot = tl.where((r == self_rank) & (srow >= self_rows), -1, slot)
        # a masked-out slot adds +0.0, which leaves acc unchanged (acc is never -0.0: it starts at +0.0)
        v = tl.load(row_ptr + cols, mask=col_mask & (slot >= 0), other=0.0)
        acc += v.to(tl.float32)
        if do_w:
            wacc += tl.load(w_row_ptr + kc, mask=(kc < K) & (slot >= 0), other=0.0)
    if HAS_B0:
        acc += tl.load(b0_ptr + token * b0_stride + cols, mask=col_mask, other=0.0).to(tl.float32)
    if HAS_B1:
        acc += tl.load(b1_ptr + token * b1_stride + cols, mask=col_mask, other=0.0).to(tl.float32)
    if OUT_BF16:
        result = f32_to_bf16_rne(acc)
    else:
        result = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + token * out_stride + cols, result, mask=col_mask)
    if do_w:
        tl.store(wout_ptr + token * wout_stride + kc, wacc, mask=kc < K)


def _launch(buf, slot, itr, pos, first, cap, t_begin, t_end, bias, out, w_buf, w_out, num_slots, programs=None,
            own=None):
    hidden = buf.size(1)
    n = t_end - t_begin
    if n <= 0 or hidden == 0:
        return out
    _check_strides("reduce_from_layout" if slot is None else "reduce_rows", buf, out, bias, w_buf, w_out, own)
    if buf.size(0) == 0:  # nothing came back: the sum is the bias alone (one zero row, of the same row stride: the
        # same kernel variant as the calls that receive rows)
        buf = torch.zeros(1, max(buf.stride(0), hidden), dtype=buf.dtype, device=buf.device)[:, :hidden]
    b0 = bias[0] if len(bias) > 0 else None
    b1 = bias[1] if len(bias) > 1 else None
    k = w_out.size(1) if w_out is not None else 1
    dummy = out
    if programs is None:  # one program per (token, 1024 columns): the whole GPU
        block = min(1024, next_pow2(hidden))
        grid, warps = (n, cdiv(hidden, block)), 4 if block >= 512 else 1
    else:  # at most ``programs`` programs, each looping over tokens with whole rows (up to 8192 columns)
        block = min(8192, next_pow2(hidden))
        col_blocks = cdiv(hidden, block)
        grid, warps = (max(1, min(n, programs // col_blocks)), col_blocks), 16 if block >= 4096 else 4
    launch(_reduce_kernel, grid,
        buf, slot if slot is not None else dummy, itr if itr is not None else dummy,
        pos if pos is not None else dummy, first if first is not None else dummy, cap, t_begin, t_end,
        b0 if b0 is not None else dummy, b1 if b1 is not None else dummy, out,
        w_buf if w_buf is not None else dummy, w_out if w_out is not None else dummy, hidden, buf.stride(0),
        b0.stride(0) if b0 is not None else 0, b1.stride(0) if b1 is not None else 0, out.stride(0),
        w_out.stride(0) if w_out is not None else k, own.x if own is not None else dummy,
        own.w if own is not None and own.w is not None else dummy,
        own.base if own is not None else dummy, own.rank if own is not None else -1,
        own.x.stride(0) if own is not None else 0, own.x.size(0) if own is not None else 0,
        HAS_SELF=own is not None, NUM_SLOTS=num_slots, FROM_LAYOUT=slot is None, FIRST_ZERO=first is None,
        HAS_B0=b0 is not None, HAS_B1=b1 is not None, HAS_W=w_out is not None, K=k, BLOCK_K=max(16, next_pow2(k)),
        OUT_BF16=out.dtype == torch.bfloat16, BLOCK=block, PERSISTENT=programs is not None, num_warps=warps)
    return out


def _check_strides(fn, buf, out, bias, w_buf, w_out, own) -> None:
    """The kernel reads rows at any row stride but columns one element apart, and weights rows ``K`` apart (their
    row stride is not a kernel argument): anything else would read the wrong elements, so it is refused."""
    rows = {"buf": buf, "out": out, **{f"bias[{i}]": b for i, b in enumerate(bias)}}
    if own is not None:
        rows["own.x"] = own.x
    for name, t in rows.items():
        if t.dim() != 2 or (t.size(1) > 1 and t.stride(1) != 1):
            raise ValueError(f"{fn}: {name} (shape {tuple(t.shape)}, strides {t.stride()}) must be 2-D rows with "
                             "unit column stride; pass .contiguous() rows or a row-strided view of them")
    k = w_out.size(1) if w_out is not None else 0
    for name, t in (("w_buf", w_buf), ("own.w", own.w if own is not None else None)):
        if t is not None and t.size(0) > 1 and (t.dim() != 2 or t.size(1) != k or t.stride() != (k, 1)):
            raise ValueError(f"{fn}: {name} (shape {tuple(t.shape)}, strides {t.stride()}) must be contiguous "
                             f"[rows, {k}] weights (row stride {k}, the weights' width of w_out); pass .contiguous()")
    if w_out is not None and w_out.size(1) > 1 and w_out.stride(1) != 1:
        raise ValueError(f"{fn}: w_out (strides {w_out.stride()}) must have unit column stride")


@dataclass(frozen=True)
class OwnRows:
    """Where ``reduce_from_layout`` reads the rows of rank ``rank`` instead of the receive buffer: ``x [M, H]``
    (same dtype as the buffer, unit column stride) row ``base[rank] + pos[t, rank]`` (``base``: int32 ``[R]`` on
    the device, e.g. the receive prefix), and their weights from ``w [M, K]`` float32 (None without weights). The
    whole ``base`` is passed, not a one-element slice of it: a slice's address alignment would differ between
    ranks and make each rank compile its own kernel variant."""

    x: torch.Tensor
    w: Optional[torch.Tensor]
    base: torch.Tensor
    rank: int


def reduce_rows(buf: torch.Tensor, slot: torch.Tensor, bias: tuple = (), out_dtype: Optional[torch.dtype] = None,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``buf [S, H]`` rows, ``slot [N, R]`` int32/int64 row numbers (-1 = absent), up to two ``[N, H]``
    biases -> ``out [N, H]`` of ``out_dtype`` (default ``buf.dtype``)."""
    n, num_slots = slot.shape
    if out is None:
        out = torch.empty(n, buf.size(1), dtype=out_dtype or buf.dtype, device=buf.device)
    return _launch(buf, slot.contiguous(), None, None, None, 0, 0, n, bias, out, None, None, num_slots)


def reduce_from_layout(buf: torch.Tensor, is_token_in_rank: torch.Tensor, pos: torch.Tensor, cap: int,
                       t_begin: int, t_end: int, bias: tuple, out: torch.Tensor, first: Optional[torch.Tensor] = None,
                       w_buf: Optional[torch.Tensor] = None, w_out: Optional[torch.Tensor] = None,
                       programs: Optional[int] = None, own: Optional[OwnRows] = None) -> torch.Tensor:
    """Reduce tokens ``[t_begin, t_end)`` into ``out [N, H]`` (and their weights from ``w_buf [S, K]`` into
    ``w_out [N, K]``), the row of (t, r) being ``r * cap + pos[t, r] - first[r]`` (``first`` None: 0)
    where ``is_token_in_rank[t, r]`` (int8/bool ``[N, R]``, ``pos`` int32 ``[N, R]``). ``programs``: at most
    that many programs (persistent over tokens; None: one program per token and column block). ``own``: the rows
    of one rank come from elsewhere (``OwnRows``)."""
    itr = is_token_in_rank.view(torch.int8) if is_token_in_rank.dtype == torch.bool else is_token_in_rank
    return _launch(buf, None, itr, pos, first, cap, t_begin, t_end, bias, out, w_buf, w_out, itr.size(1), programs,
                   own)
