"""Triton kernels of the one-sided normal-mode dispatch and combine (``epcomm.transports.nvlink``).

Memory layout (every rank's symmetric heap, same offsets everywhere):
  * ``mat``  int32 ``[R_src, R_dst, C]``: every rank's count table, all-gathered by ``exchange_counts``;
  * ``area`` int32 ``[R * cap, XW]`` rows and ``area_meta`` int32 ``[R * cap, W]`` records: the dispatch
    receive area, one region of ``cap`` rows per source rank;
  * ``hdr``  int32 ``[R, 2]``: per source, (first pair index, rows) of the current round;
  * ``arrive`` int64 ``[R]``: per source, the epoch of the last round it finished writing here.
Ordering (see ``epcomm.kernels.shmem``): payload is written with plain stores by all programs; each program
fences (``fence_sys``) and arrives on a local counter; the last one writes the headers and release-stores the
epoch into ``arrive[rank]`` of every destination (single writer per flag, no remote atomics, so the same code
runs over PCIe P2P without native atomics). Receivers acquire-poll their ``arrive`` flags with a timeout that
records an error instead of hanging. Every round starts with a barrier (``block_barrier``) so a sender never
overwrites an area its receiver has not consumed yet.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .shmem import arrive_last, block_barrier, fence_sys, st_release, wait_all_ge
from .shmem_codes import ERR_BARRIER_TIMEOUT, ERR_DONE_TIMEOUT

_K_ERR_BARRIER = tl.constexpr(ERR_BARRIER_TIMEOUT)
_K_ERR_DONE = tl.constexpr(ERR_DONE_TIMEOUT)


@triton.jit
def exchange_counts_kernel(table_ptr, bases_ptr, mat_off, flags_off, epoch_ptr, err_ptr, rank, world, timeout,
                           N_WORDS: tl.constexpr, R: tl.constexpr, R_POW2: tl.constexpr, BLOCK: tl.constexpr,
                           USE_PTX: tl.constexpr, USE_TIMER: tl.constexpr):
    """Put this rank's count table (``n_words`` int32) into slot ``rank`` of every peer's ``mat``, then
    barrier: afterwards every rank's ``mat`` holds every rank's table. One program."""
    for peer in tl.static_range(R):
        dst = (tl.load(bases_ptr + peer) + mat_off + rank * N_WORDS * 4).to(tl.pointer_type(tl.int32))
        for c0 in tl.static_range(0, N_WORDS, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            m = cols < N_WORDS
            tl.store(dst + cols, tl.load(table_ptr + cols, mask=m), mask=m)
    block_barrier(bases_ptr, flags_off, epoch_ptr, err_ptr, rank, world, timeout, _K_ERR_BARRIER, R_POW2,
                  USE_PTX, USE_TIMER)


@triton.jit
def barrier_kernel(bases_ptr, flags_off, epoch_ptr, err_ptr, rank, world, timeout, R_POW2: tl.constexpr,
                   USE_PTX: tl.constexpr, USE_TIMER: tl.constexpr):
    """A barrier across the group (one program); bumps the epoch."""
    block_barrier(bases_ptr, flags_off, epoch_ptr, err_ptr, rank, world, timeout, _K_ERR_BARRIER, R_POW2,
                  USE_PTX, USE_TIMER)


@triton.jit
def _publish(bases_ptr, hdr_vals_ptr, hdr_off, arrive_off, epoch_ptr, rank, world, R_POW2: tl.constexpr,
             HAS_HDR: tl.constexpr, USE_PTX: tl.constexpr):
    """Called by the last program: write the round headers, then release the epoch to every peer."""
    fence_sys(USE_PTX)
    epoch = tl.load(epoch_ptr)
    peers = tl.arange(0, R_POW2)
    live = peers < world
    safe = tl.where(live, peers, rank)
    base = tl.load(bases_ptr + safe)
    if HAS_HDR:
        h = (base + hdr_off + rank * 8).to(tl.pointer_type(tl.int32))
        tl.store(h, tl.load(hdr_vals_ptr + safe * 2), mask=live)
        tl.store(h + 1, tl.load(hdr_vals_ptr + safe * 2 + 1), mask=live)
        fence_sys(USE_PTX)
        tl.debug_barrier()
    flag = (base + arrive_off + rank * 8).to(tl.pointer_type(tl.int64))
    st_release(flag, tl.zeros([R_POW2], tl.int64) + epoch, USE_PTX)


@triton.jit
def dispatch_push_kernel(x_ptr, meta_ptr, slot_ptr, area_row_ptr, hdr_vals_ptr, bases_ptr, area_off, meta_off,
                         hdr_off, arrive_off, epoch_ptr, counter_ptr, t_begin, t_end, rank, world,
                         XW: tl.constexpr, W: tl.constexpr, R: tl.constexpr, R_POW2: tl.constexpr,
                         TOK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, VEC: tl.constexpr,
                         USE_PTX: tl.constexpr):
    """Token-major push: each program takes a contiguous range of tokens, ``TOK`` at a time, reads each row
    once and stores it (and its metadata record) into every destination whose ``area_row`` is >= 0.

    x_ptr: int32 ``[N, XW]`` rows; meta_ptr: int32 ``[S, W]`` records in send order; slot_ptr: int64
    ``[N, R]`` record row of (token, destination) or -1; area_row_ptr: int64 ``[N, R]`` row in the
    destination's area for this round or -1; hdr_vals_ptr: int32 ``[R, 2]`` this round's (first, rows) per
    destination."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    per = tl.cdiv(tl.cdiv(t_end - t_begin, nprog), TOK) * TOK
    lo = t_begin + pid * per
    hi = tl.minimum(lo + per, t_end)
    mcols = tl.arange(0, BLOCK_M)
    toks = tl.arange(0, TOK)
    t0 = lo
    while t0 < hi:  # (a while loop: the interpreter cannot run for loops with run-time bounds)
        t = (t0 + toks).to(tl.int64)
        live = t < hi
        for c0 in tl.static_range(0, XW, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            if VEC:
                cols = tl.max_contiguous(tl.multiple_of(cols, 4), 4)
            cm = cols < XW
            v = tl.load(x_ptr + t[:, None] * XW + cols[None, :], mask=live[:, None] & cm[None, :])
            for r in tl.static_range(R):
                a = tl.load(area_row_ptr + t * R + r, mask=live, other=-1)
                dst = (tl.load(bases_ptr + r) + area_off + a * (XW * 4)).to(tl.pointer_type(tl.int32))
                tl.store(dst[:, None] + cols[None, :], v, mask=(a >= 0)[:, None] & cm[None, :])
        for r in tl.static_range(R):
            a = tl.load(area_row_ptr + t * R + r, mask=live, other=-1)
            s = tl.load(slot_ptr + t * R + r, mask=a >= 0, other=0)
            mm = (a >= 0)[:, None] & (mcols < W)[None, :]
            mv = tl.load(meta_ptr + s[:, None] * W + mcols[None, :], mask=mm)
            dst = (tl.load(bases_ptr + r) + meta_off + a * (W * 4)).to(tl.pointer_type(tl.int32))
            tl.store(dst[:, None] + mcols[None, :], mv, mask=mm)
        t0 += TOK
    fence_sys(USE_PTX)
    tl.debug_barrier()
    if arrive_last(counter_ptr, nprog) != 0:
        _publish(bases_ptr, hdr_vals_ptr, hdr_off, arrive_off, epoch_ptr, rank, world, R_POW2, True, USE_PTX)


@triton.jit
def dispatch_copyout_kernel(area_ptr, meta_ptr, hdr_ptr, bases_ptr, arrive_off, epoch_ptr, err_ptr, recv_prefix_ptr,
                            out_x_ptr, out_scales_ptr, out_idx_ptr, out_w_ptr, out_src_ptr, out_rows, cap, rank, world,
                            timeout, XW: tl.constexpr, W: tl.constexpr, NS: tl.constexpr, K: tl.constexpr,
                            R: tl.constexpr, R_POW2: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                            BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SCALES: tl.constexpr,
                            HAS_TOPK: tl.constexpr, HAS_W: tl.constexpr, VEC: tl.constexpr,
                            USE_PTX: tl.constexpr, USE_TIMER: tl.constexpr):
    """Wait for every source's round, then copy its rows from the area into the outputs and unpack the
    records: ``out_src`` int32 ``[M, 2]`` (source token, source rank), scales, int64 local top-k ids,
    float32 weights. Source ``s``'s rows of this round land at ``recv_prefix[s] + first``; rows past
    ``out_rows`` (an overflowing ``num_worst_tokens``, reported by the host side) are dropped. Programs take
    ``ROWS`` rows at a time, cycling over every source's rows (a local copy: launch many programs)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    wait_all_ge(tl.load(bases_ptr + rank), arrive_off, world, tl.load(epoch_ptr), timeout, err_ptr, _K_ERR_DONE,
                rank, R_POW2, USE_TIMER)
    tl.debug_barrier()
    kcols = tl.arange(0, BLOCK_K)
    scols = tl.arange(0, BLOCK_S)
    rr = tl.arange(0, ROWS)
    for s in tl.static_range(R):
        first = tl.load(hdr_ptr + s * 2)
        rows = tl.load(hdr_ptr + s * 2 + 1)
        out0 = tl.load(recv_prefix_ptr + s) + first
        rows = tl.minimum(rows, tl.maximum(out_rows - out0, 0))
        i0 = pid * ROWS
        while i0 < rows:
            i = i0 + rr
            live = i < rows
            src = (s * cap + i).to(tl.int64)
            dst = (out0 + i).to(tl.int64)
            for c0 in tl.static_range(0, XW, BLOCK):
                cols = c0 + tl.arange(0, BLOCK)
                if VEC:
                    cols = tl.max_contiguous(tl.multiple_of(cols, 4), 4)
                m = live[:, None] & (cols < XW)[None, :]
                v = tl.load(area_ptr + src[:, None] * XW + cols[None, :], mask=m)
                tl.store(out_x_ptr + dst[:, None] * XW + cols[None, :], v, mask=m)
            rec = meta_ptr + src * W
            tl.store(out_src_ptr + dst * 2, tl.load(rec, mask=live), mask=live)
            tl.store(out_src_ptr + dst * 2 + 1, tl.load(rec + 1, mask=live), mask=live)
            if HAS_SCALES:
                sm = live[:, None] & (scols < NS)[None, :]
                tl.store(out_scales_ptr + dst[:, None] * NS + scols[None, :],
                         tl.load(rec[:, None] + 2 + scols[None, :], mask=sm), mask=sm)
            if HAS_TOPK:
                km = live[:, None] & (kcols < K)[None, :]
                ids = tl.load(rec[:, None] + 2 + NS + kcols[None, :], mask=km)
                tl.store(out_idx_ptr + dst[:, None] * K + kcols[None, :], ids.to(tl.int64), mask=km)
                if HAS_W:
                    wv = tl.load(rec[:, None] + 2 + NS + K + kcols[None, :], mask=km).to(tl.float32, bitcast=True)
                    tl.store(out_w_ptr + dst[:, None] * K + kcols[None, :], wv, mask=km)
            i0 += nprog * ROWS


@triton.jit
def combine_push_kernel(x_ptr, w_ptr, src_rank_ptr, dst_row_ptr, bases_ptr, area_off, w_off, arrive_off,
                        epoch_ptr, counter_ptr, num_rows, rank, world, XW: tl.constexpr, K: tl.constexpr,
                        R_POW2: tl.constexpr, TOK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
                        HAS_W: tl.constexpr, VEC: tl.constexpr, USE_PTX: tl.constexpr):
    """Send every received row back: row ``m`` goes to rank ``src_rank[m]``'s combine area at
    ``dst_row[m]`` (-1: not in this round); with weights, its ``K`` top-k weights too. ``TOK`` rows at a
    time per program."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    per = tl.cdiv(tl.cdiv(num_rows, nprog), TOK) * TOK
    lo = pid * per
    hi = tl.minimum(lo + per, num_rows)
    kcols = tl.arange(0, BLOCK_K)
    toks = tl.arange(0, TOK)
    m0 = lo
    while m0 < hi:
        m = (m0 + toks).to(tl.int64)
        live = m < hi
        a = tl.load(dst_row_ptr + m, mask=live, other=-1)
        ok = a >= 0
        base = tl.load(bases_ptr + tl.load(src_rank_ptr + m, mask=ok, other=0))
        dst = (base + area_off + a * (XW * 4)).to(tl.pointer_type(tl.int32))
        for c0 in tl.static_range(0, XW, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            if VEC:
                cols = tl.max_contiguous(tl.multiple_of(cols, 4), 4)
            cm = ok[:, None] & (cols < XW)[None, :]
            tl.store(dst[:, None] + cols[None, :], tl.load(x_ptr + m[:, None] * XW + cols[None, :], mask=cm), mask=cm)
        if HAS_W:
            wd = (base + w_off + a * (K * 4)).to(tl.pointer_type(tl.float32))
            km = ok[:, None] & (kcols < K)[None, :]
            tl.store(wd[:, None] + kcols[None, :], tl.load(w_ptr + m[:, None] * K + kcols[None, :], mask=km), mask=km)
        m0 += TOK
    fence_sys(USE_PTX)
    tl.debug_barrier()
    if arrive_last(counter_ptr, nprog) != 0:
        _publish(bases_ptr, bases_ptr, 0, arrive_off, epoch_ptr, rank, world, R_POW2, False, USE_PTX)


@triton.jit
def wait_arrivals_kernel(bases_ptr, arrive_off, epoch_ptr, err_ptr, rank, world, timeout, R_POW2: tl.constexpr,
                         USE_TIMER: tl.constexpr):
    """Wait until every rank released this round's epoch into ``arrive`` (one program)."""
    wait_all_ge(tl.load(bases_ptr + rank), arrive_off, world, tl.load(epoch_ptr), timeout, err_ptr, _K_ERR_DONE,
                rank, R_POW2, USE_TIMER)
