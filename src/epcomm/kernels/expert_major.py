"""Triton kernels of the expert-major receive layout (``Buffer.dispatch(..., layout="expert_major")``) and of
its weighted combine.

Vocabulary (one receiving rank; ``M`` received tokens in rank-major order, ``K`` top-k slots, ``E`` local
experts, alignment ``A``, ``rows`` rows of the expert-major tensor):

* segments: expert ``e`` owns rows ``[start_e, start_e + align(count_e))`` where ``count_e`` is its number
  of (token, slot) pairs and ``start_e`` the sum of the aligned counts of the experts before it; rows
  ``start_e + count_e ..`` of a segment are padding (zeros);
* ``offs [E]`` int32: the segments' ends (``torch._grouped_mm``'s ``offs``), clamped to ``rows``;
* ``pair_row [M, K]`` int32: the expert-major row of (received token m, slot k), -1 when slot k's expert
  is not local; inside a segment pairs are in (m, k) order, i.e. by source rank, then source token;
* ``row_src [rows]`` int32: ``m * K + k`` of every row, -1 on padding rows and past the last segment.

``pair_rows_kernel`` computes ``pair_row``, ``offs``, ``row_src`` and the per-row routing weight;
``permute_kernel`` moves rank-major rows (any 4-byte-word payload: bf16/fp16/fp32 rows, FP8 rows, scales)
into their expert-major rows and zeroes the padding; ``expert_reduce_kernel`` is the combine's local
reduction (per received token: its pairs' rows times their weights, added in slot order in float32 from
+0.0 with each product rounded first, cast once); ``weighted_rows_grad_kernel`` is the backward of that
weighting (``w * g`` and ``<g, y>`` per row). None of them synchronises with the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .ep import _copy_rows_em, _publish, _push_tokens, _receive_stream, _row_tile
from .launch import cdiv, launch, next_pow2
from .numerics import f32_to_bf16_rne
from .shmem import arrive_last, fence_sys, wait_all_ge
from .shmem_codes import ERR_DONE_TIMEOUT

_K_ERR_DONE = tl.constexpr(ERR_DONE_TIMEOUT)


@triton.jit
def _segment(counts_ptr, e, num_experts, align, BLOCK_E: tl.constexpr):
    """``(start, count, aligned count)`` of expert ``e``'s segment (segments of aligned counts in expert
    order)."""
    ec = tl.arange(0, BLOCK_E)
    cnt = tl.load(counts_ptr + ec, mask=ec < num_experts, other=0)
    al = (cnt + align - 1) // align * align
    start = tl.sum(tl.where(ec < e, al, 0), axis=0)
    count = tl.sum(tl.where(ec == e, cnt, 0), axis=0)
    return start, count, (count + align - 1) // align * align


@triton.jit
def _open_segment(counts_ptr, offs_ptr, e, num_experts, align, rows, BLOCK_E: tl.constexpr,
                  AT_ZERO: tl.constexpr = False):
    """Expert ``e``'s segment (``_segment``) with its end, capped at ``rows``, stored in ``offs[e]``: ``(start,
    count, end)``. ``AT_ZERO``: the segment starts at row 0 (a sender's pair indices)."""
    start, count, acount = _segment(counts_ptr, e, num_experts, align, BLOCK_E)
    if AT_ZERO:
        start = start * 0
    end = start + acount
    tl.store(offs_ptr + e, tl.minimum(end, rows).to(tl.int32))
    return start, count, end


@triton.jit
def _close_segment(row_src_ptr, row_w_ptr, e, num_experts, start, count, end, placed, rows, HAS_W: tl.constexpr,
                   BLOCK: tl.constexpr):
    """Padding meta (``_fill_meta``) after the ``placed`` pairs of expert ``e``'s segment, up to its end (for the
    last expert, up to ``rows``)."""
    hi = tl.where(e == num_experts - 1, rows, tl.minimum(end, rows))
    _fill_meta(row_src_ptr, row_w_ptr, tl.minimum(start + tl.minimum(placed, count), rows), hi, HAS_W, BLOCK)


@triton.jit
def _fill_meta(row_src_ptr, row_w_ptr, lo, hi, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    """``row_src = -1`` and ``row_w = 0`` on rows ``[lo, hi)``."""
    rb = tl.arange(0, BLOCK)
    r0 = lo
    while r0 < hi:
        r = r0 + rb
        m = r < hi
        tl.store(row_src_ptr + r, tl.full([BLOCK], -1, tl.int32), mask=m)
        if HAS_W:
            tl.store(row_w_ptr + r, tl.zeros([BLOCK], tl.float32), mask=m)
        r0 += BLOCK


@triton.jit(do_not_specialize=["num_pairs", "rows"])
def pair_rows_kernel(ids_ptr, counts_ptr, w_ptr, offs_ptr, pair_row_ptr, row_src_ptr, row_w_ptr, err_ptr,
                     num_pairs, rows, num_experts, align, HAS_W: tl.constexpr, WRITE_ROWS: tl.constexpr,
                     BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, LOCAL_INDEX: tl.constexpr = False):
    """Program ``e`` (one per expert) scans ``ids [L]`` (the flattened ``[M, K]`` local expert ids, int32 or
    int64, -1: not here) in order and gives its ``j``-th match the row ``start_e + j`` (``pair_row``; also
    ``row_src[row] = j`` and, with ``HAS_W``, ``row_w[row] = w[j]``); program 0 writes -1 for ids outside
    ``[0, E)``. ``counts [E]`` int32 must count the matches: pairs beyond ``count_e`` or beyond ``rows``
    (an inconsistent count table, a too small ``num_worst_tokens``) get no row and are added to ``err[0]``,
    as is a count that no pair fills. Padding rows of the segment (and, for the last expert, every row
    past it) get ``row_src = -1`` and ``row_w = 0``. ``LOCAL_INDEX``: ``pair_row`` gets the index ``j`` itself
    (the sender's pair index of the one-sided expert-major dispatch)."""
    e = tl.program_id(0)
    start, count, end = _open_segment(counts_ptr, offs_ptr, e, num_experts, align, rows, BLOCK_E, LOCAL_INDEX)
    jb = tl.arange(0, BLOCK)
    carry = tl.zeros([], tl.int32)
    over = tl.zeros([], tl.int32)
    j0 = 0
    while j0 < num_pairs:
        j = j0 + jb
        live = j < num_pairs
        v = tl.load(ids_ptr + j, mask=live, other=-1)
        match = live & (v == e)
        idx = carry + tl.cumsum(match.to(tl.int32), axis=0) - 1
        row = start + idx
        ok = match & (idx < count) & (row < rows)
        tl.store(pair_row_ptr + j, tl.where(ok, row, -1), mask=match)
        if e == 0:
            tl.store(pair_row_ptr + j, tl.full([BLOCK], -1, tl.int32), mask=live & ((v < 0) | (v >= num_experts)))
        if WRITE_ROWS:
            tl.store(row_src_ptr + row, j, mask=ok)
            if HAS_W:
                tl.store(row_w_ptr + row, tl.load(w_ptr + j, mask=ok, other=0.0), mask=ok)
        over += tl.sum((match & (idx < count) & (row >= rows)).to(tl.int32), axis=0)
        carry += tl.sum(match.to(tl.int32), axis=0)
        j0 += BLOCK
    bad = tl.abs(carry - count) + over
    if bad > 0:
        tl.atomic_add(err_ptr, bad)
    if WRITE_ROWS:
        _close_segment(row_src_ptr, row_w_ptr, e, num_experts, start, count, end, carry, rows, HAS_W, BLOCK)


LOCAL_HEAD = 8  # summary words of local_pairs_kernel before the per-expert counts
_K_LOCAL_HEAD = tl.constexpr(LOCAL_HEAD)


@triton.jit(do_not_specialize=["n", "rows", "cap"])
def local_pairs_kernel(ids_ptr, counts_ptr, w_ptr, itr_ptr, per_rank_ptr, offs_ptr, pair_row_ptr, pair_row_t_ptr,
                       row_src_ptr, row_w_ptr, recv_src_ptr, summary_ptr, deferred_ptr, n, rows, cap, num_experts,
                       align, K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                       HAS_W: tl.constexpr, DEFER: tl.constexpr):
    """The expert-major placement of a one-rank group, where every valid pair is local. Program ``e`` (one per
    expert) scans ``ids [N, K]`` (int64/int32 expert ids, -1: none) in (token, slot) order and gives its ``j``-th
    match the row ``start_e + j`` of segments of aligned ``counts [E]`` (the layout's, int32). A token with any
    valid slot is received, as ``m``, its rank among such tokens (``m < cap``). Writes ``pair_row [cap, K]`` (by
    received token) and ``pair_row_t [N, K]`` (by token; what a permute of ``x`` reads), ``row_src[row] = m * K +
    k``, ``row_w[row] = w[t, k]`` (``HAS_W``), ``offs [E]``, padding meta (``row_src = -1``, ``row_w = 0``) up to
    ``rows``; program 0 writes -1 for the other slots, ``recv_src[m] = (t, 0)`` and the summary: ``[0]`` received
    tokens, ``[1]`` ids outside ``[-1, E)``, ``[2]`` tokens where ``itr [N]`` (int8) or ``per_rank[0]``
    disagrees with the ids, ``[3]`` pairs that found no row (counts that disagree with the ids, more than
    ``rows``), ``[4]`` received tokens beyond ``cap``; ``[LOCAL_HEAD + e]`` the pairs expert ``e`` found.
    ``DEFER``: the error words are also added to ``deferred[0]`` (calls without a host read)."""
    e = tl.program_id(0)
    start, count, end = _open_segment(counts_ptr, offs_ptr, e, num_experts, align, rows, BLOCK_E)
    tb = tl.arange(0, BLOCK_T)
    kc = tl.arange(0, BLOCK_K)
    km = kc < K
    carry = tl.zeros([], tl.int32)  # this expert's pairs so far
    mcarry = tl.zeros([], tl.int32)  # received tokens so far
    over = tl.zeros([], tl.int32)
    bad_ids = tl.zeros([], tl.int32)
    bad_layout = tl.zeros([], tl.int32)
    t0 = 0
    while t0 < n:
        t = t0 + tb
        live = t < n
        lk = live[:, None] & km[None, :]
        v = tl.load(ids_ptr + t[:, None].to(tl.int64) * K + kc[None, :], mask=lk, other=-1)
        valid = lk & (v >= 0) & (v < num_experts)
        tok = tl.max(valid.to(tl.int32), axis=1)  # [BLOCK_T] 1 where the token has a valid slot
        m = mcarry + tl.cumsum(tok, axis=0) - 1
        match = lk & (v == e)
        mi = match.to(tl.int32)
        per_tok = tl.sum(mi, axis=1)
        idx = carry + (tl.cumsum(per_tok, axis=0) - per_tok)[:, None] + tl.cumsum(mi, axis=1) - 1
        row = start + idx
        placed = match & (idx < count) & (m < cap)[:, None]
        ok = placed & (row < rows)
        prow = tl.where(ok, row, -1)
        tl.store(pair_row_t_ptr + t[:, None].to(tl.int64) * K + kc[None, :], prow, mask=match)
        tl.store(pair_row_ptr + m[:, None].to(tl.int64) * K + kc[None, :], prow, mask=match & (m < cap)[:, None])
        tl.store(row_src_ptr + row, m[:, None] * K + kc[None, :], mask=ok)
        if HAS_W:
            tl.store(row_w_ptr + row, tl.load(w_ptr + t[:, None].to(tl.int64) * K + kc[None, :], mask=ok, other=0.0),
                     mask=ok)
        over += tl.sum(tl.sum((placed & (row >= rows)).to(tl.int32), axis=1), axis=0)
        if e == 0:
            other = lk & ~valid
            keep = (m < cap)[:, None]
            tl.store(pair_row_t_ptr + t[:, None].to(tl.int64) * K + kc[None, :], tl.full([BLOCK_T, BLOCK_K], -1,
                     tl.int32), mask=other)
            tl.store(pair_row_ptr + m[:, None].to(tl.int64) * K + kc[None, :], tl.full([BLOCK_T, BLOCK_K], -1,
                     tl.int32), mask=other & keep & (tok > 0)[:, None])
            got = live & (tok > 0) & (m < cap)
            tl.store(recv_src_ptr + m.to(tl.int64) * 2, t, mask=got)
            tl.store(recv_src_ptr + m.to(tl.int64) * 2 + 1, tl.zeros([BLOCK_T], tl.int32), mask=got)
            bad_ids += tl.sum(tl.sum((lk & ((v < -1) | (v >= num_experts))).to(tl.int32), axis=1), axis=0)
            in_rank = tl.load(itr_ptr + t, mask=live, other=0) != 0
            bad_layout += tl.sum((live & (in_rank != (tok > 0))).to(tl.int32), axis=0)
        carry += tl.sum(per_tok, axis=0)
        mcarry += tl.sum(tok, axis=0)
        t0 += BLOCK_T
    lost = tl.abs(carry - count) + over
    tl.store(summary_ptr + _K_LOCAL_HEAD + e, carry)
    if lost > 0:
        tl.atomic_add(summary_ptr + 3, lost)
        if DEFER:
            tl.atomic_add(deferred_ptr, lost)
    if e == 0:
        bad_layout += (mcarry != tl.load(per_rank_ptr)).to(tl.int32)
        beyond = tl.maximum(mcarry - cap, 0)
        tl.store(summary_ptr, mcarry)
        tl.store(summary_ptr + 1, bad_ids)
        tl.store(summary_ptr + 2, bad_layout)
        tl.store(summary_ptr + 4, beyond)
        if DEFER:
            tl.atomic_add(deferred_ptr, bad_ids + bad_layout + beyond)
    _close_segment(row_src_ptr, row_w_ptr, e, num_experts, start, count, end, carry, rows, HAS_W, 256)


@triton.jit
def _padding_rows(counts_ptr, e, num_experts, align, rows, BLOCK_E: tl.constexpr):
    """Expert ``e``'s padding rows ``[lo, hi)`` in an expert-major layout of ``rows`` rows."""
    start, count, acount = _segment(counts_ptr, e, num_experts, align, BLOCK_E)
    return tl.minimum(start + count, rows), tl.minimum(start + acount, rows)


@triton.jit
def _zero_tiles(out_ptr, r, live, XW: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Zero the ``XW``-word rows ``r`` (int64 ``[ROWS]``, ``live`` masks them) of ``out_ptr``."""
    for c0 in tl.static_range(0, XW, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        tl.store(out_ptr + r[:, None] * XW + cols[None, :], tl.zeros([ROWS, BLOCK], tl.int32),
                 mask=live[:, None] & (cols < XW)[None, :])


@triton.jit(do_not_specialize=["num_src", "rows", "num_row_progs"])
def permute_kernel(src_ptr, pair_row_ptr, out_ptr, counts_ptr, num_src, rows, num_experts, align, num_row_progs,
                   XW: tl.constexpr, K: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                   BLOCK_E: tl.constexpr, VEC: tl.constexpr):
    """Programs ``[0, num_row_progs)``: copy every row ``m`` of ``src [M, XW]`` (int32 words) to rows
    ``pair_row[m, :]`` (>= 0) of ``out [rows, XW]``, reading it once. Program ``num_row_progs + e``: zero
    expert ``e``'s padding rows."""
    pid = tl.program_id(0)
    if pid < num_row_progs:
        rr = tl.arange(0, ROWS)
        m0 = pid * ROWS
        while m0 < num_src:
            m = (m0 + rr).to(tl.int64)
            live = m < num_src
            for c0 in tl.static_range(0, XW, BLOCK):
                v, cols, cm = _row_tile(src_ptr, m, live, c0, XW, BLOCK, VEC)
                for k in tl.static_range(K):
                    r = tl.load(pair_row_ptr + m * K + k, mask=live, other=-1).to(tl.int64)
                    tl.store(out_ptr + r[:, None] * XW + cols[None, :], v, mask=(r >= 0)[:, None] & cm[None, :])
            m0 += num_row_progs * ROWS
    else:
        lo, hi = _padding_rows(counts_ptr, pid - num_row_progs, num_experts, align, rows, BLOCK_E)
        rr = tl.arange(0, ROWS)
        r0 = lo
        while r0 < hi:
            r = (r0 + rr).to(tl.int64)
            _zero_tiles(out_ptr, r, r < hi, XW, ROWS, BLOCK)
            r0 += ROWS


@triton.jit(do_not_specialize=["num_src"])
def expert_reduce_kernel(y_ptr, pair_row_ptr, w_ptr, v_ptr, out_ptr, vout_ptr, num_src, hidden, y_stride,
                         out_stride, K: tl.constexpr, HAS_W: tl.constexpr, HAS_V: tl.constexpr,
                         OUT_BF16: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program ``(p, c)``: columns block ``c`` of received tokens ``m = p, p + P, ...``:
    ``out[m] = cast(sum over k ascending with pair_row[m, k] >= 0 of w[row] * float(y[row]))`` from +0.0
    (launched without FMA contraction, so each product is rounded before its add); without ``HAS_W`` the
    rows are added as they are. With ``HAS_V`` the programs of block 0 also gather ``vout[m, k] =
    v[pair_row[m, k]]`` (0.0 where there is no row)."""
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cm = cols < hidden
    kc = tl.arange(0, BLOCK_K)
    m = tl.program_id(0).to(tl.int64)
    while m < num_src:
        acc = tl.zeros([BLOCK], tl.float32)
        for k in tl.static_range(K):  # unrolled: the K row loads are independent and issue together
            r = tl.load(pair_row_ptr + m * K + k).to(tl.int64)
            ok = r >= 0
            v = tl.load(y_ptr + r * y_stride + cols, mask=cm & ok, other=0.0).to(tl.float32)
            if HAS_W:
                v = tl.load(w_ptr + r, mask=ok, other=0.0) * v
            acc += v  # a masked slot adds +0.0, which leaves acc (never -0.0: it starts at +0.0) unchanged
        if OUT_BF16:
            res = f32_to_bf16_rne(acc)
        else:
            res = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + m * out_stride + cols, res, mask=cm)
        if HAS_V:
            if tl.program_id(1) == 0:
                rs = tl.load(pair_row_ptr + m * K + kc, mask=kc < K, other=-1)
                vals = tl.load(v_ptr + rs, mask=rs >= 0, other=0.0)
                tl.store(vout_ptr + m * K + kc, vals, mask=kc < K)
        m += tl.num_programs(0)


@triton.jit(do_not_specialize=["rows"])
def weighted_rows_grad_kernel(g_ptr, y_ptr, w_ptr, row_src_ptr, gy_ptr, gw_ptr, rows, hidden, HAS_DOT: tl.constexpr,
                              OUT_BF16: tl.constexpr, BLOCK: tl.constexpr):
    """Backward of ``w[row] * y[row]`` for every row with ``row_src >= 0`` (other rows: zeros):
    ``gy[row] = cast(w[row] * float(g[row]))`` and, with ``HAS_DOT``, ``gw[row] = <float(g[row]),
    float(y[row])>`` (float32, summed by blocks of columns)."""
    row = tl.program_id(0).to(tl.int64)
    cb = tl.arange(0, BLOCK)
    while row < rows:
        valid = tl.load(row_src_ptr + row) >= 0
        wk = tl.load(w_ptr + row, mask=valid, other=0.0)
        dot = tl.zeros([BLOCK], tl.float32)
        c0 = 0
        while c0 < hidden:
            cols = c0 + cb
            cm = cols < hidden
            g = tl.load(g_ptr + row * hidden + cols, mask=cm & valid, other=0.0).to(tl.float32)
            gy = wk * g
            if OUT_BF16:
                gy_out = f32_to_bf16_rne(gy)
            else:
                gy_out = gy.to(gy_ptr.dtype.element_ty)
            tl.store(gy_ptr + row * hidden + cols, gy_out, mask=cm)
            if HAS_DOT:
                dot += g * tl.load(y_ptr + row * hidden + cols, mask=cm & valid, other=0.0).to(tl.float32)
            c0 += BLOCK
        if HAS_DOT:
            tl.store(gw_ptr + row, tl.sum(dot, axis=0))
        row += tl.num_programs(0)


# ---------------------------------------------------------------------------------------------------------
# The one-sided transports' expert-major dispatch (``epcomm.transports.nvlink``): the sender adds to every
# record the index of each of its pairs among its own pairs of that expert (``pidx``, ``pair_rows_kernel`` with
# ``LOCAL_INDEX``); the receiver knows, from the count matrix the exchange all-gathered, where each source's
# pairs of each local expert start (``em_table_kernel``), so its copy-out stores every received row straight into
# its expert-major rows (``_copy_rows_em``): no rank-major copy, no permute pass.
# ---------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["rows"])
def em_table_kernel(mat_ptr, base_ptr, offs_ptr, err_ptr, rank, rows, align, TW: tl.constexpr, R: tl.constexpr,
                    E_LOCAL: tl.constexpr, BLOCK_E: tl.constexpr):
    """One program. ``mat [R_src, R_dst, TW]`` int32 (word ``2 + e``: the source's pairs for expert e of the
    destination); writes ``base [R, E_LOCAL]`` int32, the first row of source s's pairs of expert e (segments of
    aligned totals in expert order, sources in rank order inside), and ``offs [E_LOCAL]`` (segment ends, clamped to
    ``rows``); adds 1 to ``err[0]`` when the segments need more than ``rows`` rows (``num_worst_tokens``)."""
    ec = tl.arange(0, BLOCK_E)
    em = ec < E_LOCAL
    tot = tl.zeros([BLOCK_E], tl.int32)
    for s in tl.static_range(R):
        tot += tl.load(mat_ptr + (s * R + rank) * TW + 2 + ec, mask=em, other=0)
    al = (tot + align - 1) // align * align
    end = tl.cumsum(al, axis=0)
    tl.store(offs_ptr + ec, tl.minimum(end, rows), mask=em)
    run = end - al
    for s in tl.static_range(R):
        tl.store(base_ptr + s * E_LOCAL + ec, run, mask=em)
        run += tl.load(mat_ptr + (s * R + rank) * TW + 2 + ec, mask=em, other=0)
    if tl.sum(al, axis=0) > rows:
        tl.atomic_add(err_ptr, 1)


@triton.jit(do_not_specialize=["t_begin", "t_end", "cap", "num_push", "out_rows", "rows_out", "timeout"])
def em_dispatch_kernel(x_ptr, scales_ptr, s_stride_t, s_stride_c, topk_ptr, w_ptr, itr_ptr, pos_ptr, first_ptr,
                       pidx_ptr, bases_ptr, area_off, meta_off, prog_off, epoch_ptr, t_begin, t_end, cap, rank, world,
                       num_push, area_ptr, meta_ptr, prog_ptr, err_ptr, prefix_ptr, out_x_ptr,
                       out_s_ptr, out_w_ptr, out_src_ptr, row_src_ptr, pair_row_ptr, em_base_ptr, out_rows, rows_out,
                       timeout, XW: tl.constexpr, W: tl.constexpr, NS: tl.constexpr, K: tl.constexpr,
                       E_LOCAL: tl.constexpr, R: tl.constexpr, R_POW2: tl.constexpr, TOK: tl.constexpr,
                       BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SCALES: tl.constexpr,
                       HAS_W: tl.constexpr, SINGLE_ROUND: tl.constexpr, VEC: tl.constexpr, USE_PTX: tl.constexpr,
                       USE_TIMER: tl.constexpr, PMAX: tl.constexpr, SIG: tl.constexpr, ROWS: tl.constexpr):
    """``epcomm.kernels.ep.dispatch_kernel`` (the same push, progress words and receive protocol; see there), with
    records carrying the pair indices and receiving programs that copy into the expert-major outputs
    (``_copy_rows_em``) instead of rank-major rows. Launched cooperatively like it (every program resident)."""
    pid = tl.program_id(0)
    tag = tl.load(epoch_ptr) << 32
    if pid < num_push:
        _push_tokens(pid, num_push, pid, num_push, x_ptr, scales_ptr, s_stride_t, s_stride_c, topk_ptr, w_ptr,
                     itr_ptr, pos_ptr, first_ptr, bases_ptr, area_off, meta_off, prog_off, tag, t_begin, t_end, cap,
                     rank, world, XW, W, NS, K, E_LOCAL, R, R_POW2, TOK, BLOCK, BLOCK_S, BLOCK_K, HAS_SCALES, True,
                     HAS_W, SINGLE_ROUND, VEC, USE_PTX, PMAX, SIG, pidx_ptr, True)
    else:
        _receive_stream(pid, num_push, world, prog_ptr, tag, timeout, err_ptr, rank, prefix_ptr, out_rows, cap,
                        area_ptr, meta_ptr, out_x_ptr, out_s_ptr, out_src_ptr, out_w_ptr, out_src_ptr, row_src_ptr,
                        pair_row_ptr, em_base_ptr, rows_out, XW, W, NS, K, E_LOCAL, ROWS, BLOCK_K, BLOCK_S, HAS_SCALES,
                        True, HAS_W, VEC, USE_PTX, USE_TIMER, PMAX, True)


@triton.jit(do_not_specialize=["t_begin", "t_end", "cap"])
def em_push_kernel(x_ptr, scales_ptr, s_stride_t, s_stride_c, topk_ptr, w_ptr, itr_ptr, pos_ptr, first_ptr, rows_ptr,
                   pidx_ptr, bases_ptr, area_off, meta_off, hdr_off, arrive_off, epoch_ptr, counter_ptr, t_begin, t_end,
                   cap, rank, world, XW: tl.constexpr, W: tl.constexpr, NS: tl.constexpr, K: tl.constexpr,
                   E_LOCAL: tl.constexpr, R: tl.constexpr, R_POW2: tl.constexpr, TOK: tl.constexpr,
                   BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SCALES: tl.constexpr,
                   HAS_W: tl.constexpr, SINGLE_ROUND: tl.constexpr, VEC: tl.constexpr, USE_PTX: tl.constexpr):
    """``epcomm.kernels.ep.dispatch_push_kernel`` with the pair indices in the records (bounded local passes:
    ``em_copyout_kernel`` copies afterwards)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    _push_tokens(pid, nprog, pid, nprog, x_ptr, scales_ptr, s_stride_t, s_stride_c, topk_ptr, w_ptr, itr_ptr,
                 pos_ptr, first_ptr, bases_ptr, area_off, meta_off, 0, 0, t_begin, t_end, cap, rank, world, XW, W, NS,
                 K, E_LOCAL, R, R_POW2, TOK, BLOCK, BLOCK_S, BLOCK_K, HAS_SCALES, True, HAS_W, SINGLE_ROUND, VEC,
                 USE_PTX, 1, 0, pidx_ptr, True)
    fence_sys(USE_PTX)
    tl.debug_barrier()
    if arrive_last(counter_ptr, nprog) != 0:
        _publish(bases_ptr, first_ptr, rows_ptr, hdr_off, arrive_off, epoch_ptr, rank, world, R_POW2, True,
                 SINGLE_ROUND, USE_PTX)


@triton.jit(do_not_specialize=["out_rows", "rows_out", "cap", "timeout"])
def em_copyout_kernel(area_ptr, meta_ptr, hdr_ptr, bases_ptr, arrive_off, epoch_ptr, err_ptr, prefix_ptr, out_x_ptr,
                      out_s_ptr, out_w_ptr, out_src_ptr, row_src_ptr, pair_row_ptr, em_base_ptr, out_rows, rows_out,
                      cap, rank, world, timeout, XW: tl.constexpr, W: tl.constexpr, NS: tl.constexpr,
                      K: tl.constexpr, E_LOCAL: tl.constexpr, R: tl.constexpr, R_POW2: tl.constexpr,
                      ROWS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
                      HAS_SCALES: tl.constexpr, HAS_W: tl.constexpr, VEC: tl.constexpr, USE_PTX: tl.constexpr,
                      USE_TIMER: tl.constexpr):
    """``epcomm.kernels.ep.dispatch_copyout_kernel`` into the expert-major outputs (``_copy_rows_em``)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    wait_all_ge(tl.load(bases_ptr + rank), arrive_off, world, tl.load(epoch_ptr), timeout, err_ptr, _K_ERR_DONE,
                rank, R_POW2, USE_PTX, USE_TIMER)
    tl.debug_barrier()
    for s in tl.static_range(R):
        first = tl.load(hdr_ptr + s * 2)
        rows = tl.load(hdr_ptr + s * 2 + 1)
        out0 = tl.load(prefix_ptr + s) + first
        rows = tl.minimum(tl.minimum(rows, cap), tl.maximum(out_rows - out0, 0))  # past cap: not sent
        _copy_rows_em(area_ptr, meta_ptr, out_x_ptr, out_s_ptr, out_w_ptr, out_src_ptr, row_src_ptr, pair_row_ptr,
                      em_base_ptr, s, s * cap, out0, pid * ROWS, rows, nprog * ROWS, rows_out, XW, W, NS, K, E_LOCAL,
                      ROWS, BLOCK, BLOCK_K, BLOCK_S, HAS_SCALES, HAS_W, VEC)


@triton.jit(do_not_specialize=["rows"])
def em_pad_kernel(out_x_ptr, out_s_ptr, row_src_ptr, row_w_ptr, counts_ptr, rows, num_experts, align,
                  XW: tl.constexpr, NS: tl.constexpr, HAS_SCALES: tl.constexpr, HAS_W: tl.constexpr,
                  ROWS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr):
    """Program ``e``: zero expert e's padding rows (``out_x`` words, scales) and give them ``row_src = -1``,
    ``row_w = 0``; the last program does the same for the meta of every row past the last segment."""
    e = tl.program_id(0)
    lo, hi = _padding_rows(counts_ptr, e, num_experts, align, rows, BLOCK_E)
    rr = tl.arange(0, ROWS)
    scols = tl.arange(0, BLOCK_S)
    r0 = lo
    while r0 < hi:
        r = (r0 + rr).to(tl.int64)
        live = r < hi
        _zero_tiles(out_x_ptr, r, live, XW, ROWS, BLOCK)
        if HAS_SCALES:
            tl.store(out_s_ptr + r[:, None] * NS + scols[None, :], tl.zeros([ROWS, BLOCK_S], tl.int32),
                     mask=live[:, None] & (scols < NS)[None, :])
        r0 += ROWS
    _fill_meta(row_src_ptr, row_w_ptr, lo, hi, HAS_W, 256)
    if e == num_experts - 1:
        _fill_meta(row_src_ptr, row_w_ptr, hi, rows, HAS_W, 256)


# ---------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------
def _programs(device: torch.device, work: int, per_sm: int = 8) -> int:
    from .shmem import num_sms

    return max(1, min(work, num_sms(device) * per_sm))


def launch_pair_rows(ids: torch.Tensor, counts: torch.Tensor, weights: Optional[torch.Tensor], offs: torch.Tensor,
                     pair_row: torch.Tensor, row_src: Optional[torch.Tensor], row_w: Optional[torch.Tensor],
                     err: torch.Tensor, rows: int, align: int, local_index: bool = False) -> None:
    """``pair_rows_kernel`` over ``ids [M, K]`` (int32/int64, contiguous) with ``counts [E]`` int32; writes
    ``offs [E]``, ``pair_row [M, K]`` int32, and (when ``row_src`` is given) ``row_src [rows]`` int32 and
    ``row_w [rows]`` float32 from ``weights [M, K]`` float32; inconsistencies are added to ``err[0]``
    (int32)."""
    e = counts.numel()
    if e == 0:
        return
    write = row_src is not None
    has_w = write and weights is not None
    launch(pair_rows_kernel, (e,), ids, counts, weights if has_w else counts, offs, pair_row,
           row_src if write else pair_row, row_w if has_w else counts, err, ids.numel(), rows, e, align,
           HAS_W=has_w, WRITE_ROWS=write, BLOCK=1024, BLOCK_E=max(16, next_pow2(e)), LOCAL_INDEX=local_index,
           num_warps=4)


def launch_local_pairs(ids: torch.Tensor, counts: torch.Tensor, weights: Optional[torch.Tensor], itr: torch.Tensor,
                       per_rank: torch.Tensor, offs: torch.Tensor, pair_row: torch.Tensor, pair_row_t: torch.Tensor,
                       row_src: torch.Tensor, row_w: Optional[torch.Tensor], recv_src: torch.Tensor,
                       summary: torch.Tensor, deferred: Optional[torch.Tensor], rows: int, align: int) -> None:
    """``local_pairs_kernel``: ``ids [N, K]``, ``counts [E]`` int32, ``weights [N, K]`` float32 or None, ``itr
    [N]`` int8/bool, ``per_rank [1]`` int32; writes ``offs [E]``, ``pair_row [cap, K]``, ``pair_row_t [N, K]``,
    ``row_src [rows]``, ``row_w [rows]``, ``recv_src [cap, 2]`` (int32) and ``summary [LOCAL_HEAD + E]`` int32
    (zeroed by the caller); with ``deferred`` (int32 ``[1]``) the errors are added to it as well."""
    n, k = ids.shape
    e = counts.numel()
    has_w = weights is not None
    launch(local_pairs_kernel, (e,), ids, counts, weights if has_w else counts, itr.view(torch.int8), per_rank, offs,
           pair_row, pair_row_t, row_src, row_w if has_w else counts, recv_src, summary,
           deferred if deferred is not None else summary, n, rows, pair_row.size(0), e, align, K=k,
           BLOCK_K=max(2, next_pow2(k)), BLOCK_T=max(16, 4096 // next_pow2(k)), BLOCK_E=max(16, next_pow2(e)),
           HAS_W=has_w, DEFER=deferred is not None, num_warps=8)


def launch_permute(src: torch.Tensor, pair_row: torch.Tensor, out: torch.Tensor, counts: torch.Tensor,
                   align: int) -> None:
    """``permute_kernel``: rows of ``src [M, W]`` (any dtype, rows a multiple of 4 bytes) into ``out [rows, W]``
    (same dtype) at ``pair_row [M, K]``; padding rows of the segments of ``counts`` zeroed."""
    m, rows = src.size(0), out.size(0)
    xw = src.size(1) * src.element_size() // 4
    if rows == 0 or xw == 0:
        return
    k = pair_row.size(1)
    e = counts.numel()
    rows_per = 4
    progs = _programs(src.device, cdiv(max(m, 1), rows_per)) if m else 0
    src_words = src.view(torch.int32) if m else out.view(torch.int32)
    block = max(16, min(1024, next_pow2(xw)))
    launch(permute_kernel, (progs + e,), src_words, pair_row, out.view(torch.int32), counts, m, rows, e, align,
           progs, XW=xw, K=k, ROWS=rows_per, BLOCK=block, BLOCK_E=max(16, next_pow2(e)), VEC=xw % 4 == 0,
           num_warps=4)


def launch_expert_reduce(y: torch.Tensor, pair_row: torch.Tensor, weights: Optional[torch.Tensor],
                         values: Optional[torch.Tensor], out: torch.Tensor, values_out: Optional[torch.Tensor]) -> None:
    """``expert_reduce_kernel``: ``out [M, H]`` from ``y [rows, H]`` (unit column stride), ``pair_row [M, K]``,
    optional row weights ``[rows]`` float32; optional ``values [rows]`` float32 gathered into ``values_out
    [M, K]``."""
    m, h = out.shape
    if m == 0 or h == 0:
        return
    k = pair_row.size(1)
    block = min(1024, next_pow2(h))
    col_blocks = cdiv(h, block)
    progs = _programs(out.device, m, per_sm=max(1, 16 // col_blocks))
    y_in = y if y.size(0) else out  # nothing to read: every pair_row is -1
    dummy = pair_row
    launch(expert_reduce_kernel, (progs, col_blocks), y_in, pair_row, weights if weights is not None else dummy,
           values if values is not None else dummy, out, values_out if values_out is not None else dummy, m, h,
           y_in.stride(0), out.stride(0), K=k, HAS_W=weights is not None, HAS_V=values_out is not None,
           OUT_BF16=out.dtype == torch.bfloat16, BLOCK=block, BLOCK_K=max(16, next_pow2(k)),
           num_warps=4 if block >= 512 else 1, enable_fp_fusion=False)


def launch_weighted_rows_grad(g: torch.Tensor, y: Optional[torch.Tensor], weights: torch.Tensor,
                              row_src: torch.Tensor, grad_y: torch.Tensor, grad_w: Optional[torch.Tensor]) -> None:
    """``weighted_rows_grad_kernel`` over ``rows`` rows of contiguous ``g``, ``y``, ``grad_y [rows, H]``."""
    rows, h = g.shape
    if rows == 0:
        return
    block = min(1024, next_pow2(max(h, 1)))
    dot = y is not None and grad_w is not None
    launch(weighted_rows_grad_kernel, (_programs(g.device, rows),), g, y if dot else g, weights, row_src, grad_y,
           grad_w if dot else weights, rows, h, HAS_DOT=dot, OUT_BF16=grad_y.dtype == torch.bfloat16, BLOCK=block,
           num_warps=4)


# ------------------------------------------------------------------------------- one-sided expert-major launchers
@dataclass(frozen=True)
class ExpertMajorTargets:
    """Outputs of a one-sided expert-major dispatch: ``out_x [rows, XW]`` int32 view, ``out_s [rows, NS]`` int32
    view of the scales (or None), ``out_w [rows]`` float32 (or None), ``row_src [rows]`` int32, ``pair_row [M, K]``
    int32, ``out_src [M, 2]`` int32 (source token, source rank of the received tokens), ``base [R, E_local]`` int32
    (``em_table_kernel``), ``pidx [N, K]`` int32 (the sender's pair indices), ``rows`` = rows of ``out_x``."""

    out_x: torch.Tensor
    out_s: Optional[torch.Tensor]
    out_w: Optional[torch.Tensor]
    row_src: torch.Tensor
    pair_row: torch.Tensor
    out_src: torch.Tensor
    base: torch.Tensor
    pidx: torch.Tensor
    rows: int


def launch_em_table(mat: torch.Tensor, base: torch.Tensor, offs: torch.Tensor, err: torch.Tensor, rank: int,
                    rows: int, align: int) -> None:
    """``em_table_kernel`` over the count matrix ``mat [R, R, TW]`` int32."""
    r, _, tw = mat.shape
    e = base.size(1)
    launch(em_table_kernel, (1,), mat, base, offs, err, rank, rows, align, TW=tw, R=r, E_LOCAL=e,
           BLOCK_E=max(16, next_pow2(e)), num_warps=4)


def launch_em_pad(t: ExpertMajorTargets, counts: torch.Tensor, align: int) -> None:
    """``em_pad_kernel``: zero the padding rows of ``t``'s segments (``counts [E_local]`` int32), fill their meta."""
    e = counts.numel()
    xw = t.out_x.size(1)
    ns = t.out_s.size(1) if t.out_s is not None else 0
    launch(em_pad_kernel, (e,), t.out_x, t.out_s if ns else t.row_src, t.row_src,
           t.out_w if t.out_w is not None else t.row_src, counts, t.rows, e, align, XW=max(xw, 1), NS=max(ns, 1),
           HAS_SCALES=ns > 0, HAS_W=t.out_w is not None, ROWS=4, BLOCK=max(16, min(1024, next_pow2(xw))),
           BLOCK_E=max(16, next_pow2(e)), BLOCK_S=max(16, next_pow2(ns)), num_warps=4)


def launch_em_round(*, x, scales, topk_idx, topk_weights, itr, pos, first, rows_ptr, bases, area_off: int,
                    meta_off: int, hdr_off: int, arrive_off: int, prog, prog_off: int, epoch, counter, err, prefix,
                    hdr, area_rows, meta_rows, t_begin: int, t_end: int, cap: int, rank: int, world: int,
                    num_experts: int, grid: int, tokens_per_step: int, use_ptx: bool, single_round: bool,
                    strict: bool, num_recv: int, timeout: int, targets: ExpertMajorTargets, dummy,
                    progress_slots: int, signal_tokens: int) -> None:
    """One round of the one-sided expert-major dispatch: ``em_dispatch_kernel`` (``grid`` pushing programs plus
    ``grid`` receiving programs per source), or with ``strict`` ``em_push_kernel`` then ``em_copyout_kernel`` on
    ``grid`` programs; the arguments are those of ``epcomm.kernels.ep.launch_push`` and the copy-out."""
    from .ep import _COOPERATIVE, PUSH_WARPS, _StreamingGrid, chunk_block, pow2_block, record_words, scale_args

    n = x.size(0)
    xw = x.size(1) * x.element_size() // 4
    ns = scales.size(1) if scales is not None else 0
    k = topk_idx.size(1)
    has_w = topk_weights is not None
    e_local = max(1, num_experts // world)
    x_words = x.view(torch.int32) if n else torch.empty(1, xw, dtype=torch.int32, device=x.device)
    push = (x_words, *scale_args(scales, dummy), topk_idx,
            topk_weights if has_w else dummy, itr.view(torch.int8), pos, first)
    t = targets

    def some(v):  # the kernels take a dummy for an absent or empty output
        return v if v is not None and v.numel() else dummy

    outs = (some(t.out_x), some(t.out_s), some(t.out_w), some(t.out_src), some(t.row_src), some(t.pair_row), t.base)
    shape = dict(XW=xw, W=record_words(ns, k, has_w, True), NS=ns, K=k, E_LOCAL=e_local, R=world,
                 R_POW2=max(2, next_pow2(world)))
    common = dict(BLOCK_S=pow2_block(ns), BLOCK_K=pow2_block(k), HAS_SCALES=ns > 0, HAS_W=has_w, VEC=xw % 4 == 0,
                  USE_PTX=use_ptx)
    if not strict:
        if not 1 <= grid <= progress_slots:
            raise ValueError(f"launch_em_round: {grid} pushing programs; a streaming dispatch runs 1..{progress_slots}")
        # receivers wait for the pushers of their launch: a cooperative launch, as many receivers as fit beside them
        launch(em_dispatch_kernel, _StreamingGrid(grid, world, grid),
               *push, t.pidx, bases, area_off, meta_off, prog_off, epoch, t_begin, t_end, cap, rank, world, grid,
               area_rows, meta_rows, prog, err, prefix, *outs, num_recv, t.rows, timeout, **shape,
               TOK=tokens_per_step, BLOCK=chunk_block(xw, tokens_per_step), SINGLE_ROUND=single_round,
               USE_TIMER=use_ptx, PMAX=progress_slots, SIG=max(1, signal_tokens // tokens_per_step), ROWS=4,
               num_warps=PUSH_WARPS, **(_COOPERATIVE if use_ptx else {}), **common)
        return
    launch(em_push_kernel, (grid,), *push, rows_ptr, t.pidx, bases, area_off, meta_off, hdr_off, arrive_off, epoch,
           counter, t_begin, t_end, cap, rank, world, **shape, TOK=tokens_per_step,
           BLOCK=chunk_block(xw, tokens_per_step), SINGLE_ROUND=single_round, num_warps=PUSH_WARPS, **common)
    launch(em_copyout_kernel, (grid,), area_rows, meta_rows, hdr, bases, arrive_off, epoch, err, prefix, *outs,
           num_recv, t.rows, cap, rank, world, timeout, **shape, ROWS=8, BLOCK=1024, USE_TIMER=use_ptx, num_warps=16,
           **common)
