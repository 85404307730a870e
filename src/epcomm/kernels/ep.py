"""Triton kernels of the one-sided normal-mode dispatch and combine (``epcomm.transports.nvlink``).

Per call the host launches two kernels for a dispatch (exchange; ``dispatch_kernel``, whose receiving
programs copy rows out while its pushing programs run; with bounded local passes, ``dispatch_push_kernel``
then ``dispatch_copyout_kernel``) and four for a combine (barrier (``epcomm.kernels.shmem``), push, wait,
ordered reduce (``epcomm.kernels.reduce``)); everything else (layout checks, positions, metadata records,
offsets) is computed inside them, because every extra host-side operation costs tens of microseconds.

Symmetric layout (same offsets on every rank):
  * ``mat``  int32 ``[R_src, R_dst, TW]``: every rank's count table (``[tokens to dst, own token count,
    tokens per expert of dst]``), all-gathered by ``exchange_kernel``;
  * ``area`` the receive area: ``[R * cap, XW]`` int32 rows then ``[R * cap, W]`` int32 records, one region
    of ``cap`` rows per source rank (dispatch); ``[R * cap, XW]`` rows then ``[R * cap, K]`` weights per
    expert rank (combine);
  * ``hdr`` int32 ``[R, 2]``: per source, (first pair index, rows) of the current round;
  * ``arrive`` int64 ``[R]``: per source, the epoch of the last round it finished writing here;
  * ``flags`` int64 ``[R]``: barrier flags.
A record is ``[source token, source rank, scales (NS words), local top-k ids (K), weights (K)]``.

Ordering (see ``epcomm.kernels.shmem``): payload is written with plain stores by all programs; each program
fences (``fence_sys``) and arrives on a local counter; the last one writes the round headers and
release-stores the epoch into ``arrive[rank]`` of every destination. Flags have one writer each and no
remote atomics are used, so the same kernels run over PCIe P2P without native atomics. Receivers
acquire-poll with a timeout that records an error instead of hanging. Every round starts with a barrier so
that a sender never overwrites an area its receiver has not consumed yet.

Summary vector written by ``exchange_kernel`` (int32, read once by the host in exact mode, kept on the
device otherwise): ``[num_recv, max_pair, max_tokens, bad_topk, bad_layout, err code, err peer, err seen,
recv_prefix (R), recv_from (R), sent (R), tokens per local expert (E_local)]``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import triton
import triton.language as tl

from ..core.layout import record_words  # (the records' width: the launchers here and their callers use it)
from .launch import cdiv, launch, next_pow2
from .numerics import pick
from .shmem import (arrive_last, barrier_enter, block_barrier, fence_sys, record_error, st_release, wait_after,
                    wait_all_ge)
from .shmem_codes import CMP_AFTER, ERR_BARRIER_TIMEOUT, ERR_DONE_TIMEOUT, ERR_GATE_TIMEOUT

_K_ERR_BARRIER = tl.constexpr(ERR_BARRIER_TIMEOUT)
_K_ERR_DONE = tl.constexpr(ERR_DONE_TIMEOUT)
_K_ERR_GATE = tl.constexpr(ERR_GATE_TIMEOUT)
_K_CMP_AFTER = tl.constexpr(CMP_AFTER)

SUMMARY_HEAD = 8  # summary words before recv_prefix
_K_SUMMARY_HEAD = tl.constexpr(SUMMARY_HEAD)
PUSH_WARPS = 8  # warps per push program (dispatch and combine)


@triton.jit(do_not_specialize=["n"])
def layout_kernel(topk_ptr, itr_ptr, per_rank_ptr, per_expert_ptr, n, E, E_LOCAL, K: tl.constexpr,
                  R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """DeepEP's ``get_dispatch_layout`` in one kernel: ``is_token_in_rank [N, R]`` (int8), and with atomics
    ``num_tokens_per_rank [R]`` and ``num_tokens_per_expert [E]`` (int32, zeroed by the caller). Entries
    outside ``[0, E)`` select nothing (they are reported by the dispatch)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    kc = tl.arange(0, BLOCK_K)
    live = t < n
    m = live[:, None] & (kc < K)[None, :]
    idx = tl.load(topk_ptr + t.to(tl.int64)[:, None] * K + kc[None, :], mask=m, other=-1).to(tl.int32)
    valid = m & (idx >= 0) & (idx < E)
    tl.atomic_add(per_expert_ptr + tl.where(valid, idx, 0), tl.full(idx.shape, 1, tl.int32), mask=valid,
                  sem="relaxed")
    _in_rank(itr_ptr, t.to(tl.int64), live, idx, valid, E_LOCAL, R, per_rank_ptr)


@triton.jit
def _in_rank(itr_ptr, rows, live, ids, valid, e_local, R: tl.constexpr, per_rank_ptr=None):
    """Whether each of the rows ``rows`` (int64, ``live`` the mask of those to store) has one of its ``ids [., K]``
    (those ``valid``) on rank ``r`` (``e_local`` experts a rank): ``itr [., R]`` int8; with ``per_rank [R]`` int32 the
    rows to each rank added to it."""
    dest = tl.where(valid, ids // e_local, R)
    for r in tl.static_range(R):
        inr = tl.max((dest == r).to(tl.int32), axis=1)
        tl.store(itr_ptr + rows * R + r, inr.to(tl.int8), mask=live)
        if per_rank_ptr is not None:
            tl.atomic_add(per_rank_ptr + r, tl.sum(tl.where(live, inr, 0), axis=0), sem="relaxed")


@triton.jit(do_not_specialize=["m", "stride", "cstride", "col", "chunk", "chunks", "L", "D", "local", "e_local"])
def rows_in_place_kernel(counts_ptr, map_ptr, summary_ptr, m, stride, cstride, col, chunk, chunks, L, D, local,
                         e_local, LP: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr, EP: tl.constexpr,
                         SUMMARY: tl.constexpr):
    """``map [M]`` int64: the output row of each of the ``M`` rows of chunk ``chunk`` of ``chunks``. A chunk's rows
    come in blocks by ``f``, then ``d`` (``f < L``, ``d < D``); the output holds every chunk's rows by ``d``, then
    ``f``, then chunk (each block of a chunk after the same block of the chunks before it). Block ``(f, d)`` of chunk
    ``c`` has ``counts[f * stride + c * cstride + col + d * L]`` rows (int32). Every program makes the ``[L, D]``
    tables of block starts (prefix sums over all chunks' blocks, and over this chunk's in its own order), then maps
    its ``BLOCK`` rows. With ``SUMMARY`` program 0 also writes ``summary`` int32: the summary ``exchange_kernel`` will
    find in the domain leg of chunk ``chunk`` on the rank of local index ``local`` (its ``expected``, ``CHECK``), made
    from the same counts: forwarding rank ``f``'s row of the chunk holds at column 0 its rows, at ``1 + g`` its rows
    for rank ``g`` of the domain, at ``1 + L + e`` its rows for the domain's expert ``e`` (``e_local`` per rank)."""
    f = tl.arange(0, LP)
    d = tl.arange(0, DP)
    ok = (f < L)[:, None] & (d < D)[None, :]
    at = counts_ptr + f[:, None] * stride + col + d[None, :] * L
    total = tl.zeros([LP, DP], tl.int32)
    before = tl.zeros([LP, DP], tl.int32)
    n = tl.zeros([LP, DP], tl.int32)
    c = 0
    while c < chunks:
        got = tl.load(at + c * cstride, mask=ok, other=0)
        total += got
        before += tl.where(c < chunk, got, 0)
        n += tl.where(c == chunk, got, 0)
        c += 1
    row_sum = tl.sum(n, axis=1)
    src_start = (tl.cumsum(row_sum, axis=0) - row_sum)[:, None] + tl.cumsum(n, axis=1) - n  # by f, then d
    col_sum = tl.sum(total, axis=0)
    dst_start = (tl.cumsum(col_sum, axis=0) - col_sum)[None, :] + tl.cumsum(total, axis=0) - total + before
    lo = tl.reshape(src_start, [LP * DP])
    hi = tl.reshape(src_start + n, [LP * DP])
    shift = tl.reshape(dst_start - src_start, [LP * DP])
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = (r[:, None] >= lo[None, :]) & (r[:, None] < hi[None, :])  # (empty blocks hold no row)
    dst = r + tl.sum(tl.where(inside, shift[None, :], 0), axis=1)
    tl.store(map_ptr + r, dst.to(tl.int64), mask=r < m)
    if SUMMARY:
        if tl.program_id(0) == 0:
            _summary_of(counts_ptr, summary_ptr, chunk, chunk + 1, stride, cstride, L, local, e_local, LP, EP)


@triton.jit
def _summary_of(counts_ptr, summary_ptr, c0, c1, stride, cstride, L, local, e_local, LP: tl.constexpr,
                EP: tl.constexpr):
    """Write at ``summary`` int32 the summary ``exchange_kernel`` would find in the domain leg of chunks ``[c0, c1)``
    together (one chunk: that chunk's call; several: their merged call, whose ``max_pair`` and ``max_tokens`` are the
    chunks' sums, as ``merge_cached`` makes them) on the rank of local index ``local``, from the domain's gathered
    counts (``rows_in_place_kernel``): forwarding rank ``f``'s row of chunk ``c`` at ``counts + f * stride + c *
    cstride`` holds at column 0 its rows, at ``1 + g`` its rows for rank ``g`` of the domain, at ``1 + L + e`` its rows
    for the domain's expert ``e`` (``e_local`` per rank)."""
    f = tl.arange(0, LP)
    fm = f < L
    e = tl.arange(0, EP)
    em = e < e_local
    recv = tl.zeros([LP], tl.int32)
    sent = tl.zeros([LP], tl.int32)
    per_expert = tl.zeros([EP], tl.int32)
    max_pair = tl.zeros([], tl.int32)
    max_tokens = tl.zeros([], tl.int32)
    c = c0
    while c < c1:
        row = counts_ptr + c * cstride + f * stride  # forwarding rank f's row of chunk c
        recv += tl.load(row + 1 + local, mask=fm, other=0)
        sent += tl.load(counts_ptr + c * cstride + local * stride + 1 + f, mask=fm, other=0)
        pairs = tl.load(row[:, None] + 1 + f[None, :], mask=fm[:, None] & fm[None, :], other=0)
        per_expert += tl.sum(tl.load(row[:, None] + 1 + L + local * e_local + e[None, :],
                                     mask=fm[:, None] & em[None, :], other=0), axis=0)
        max_pair += tl.max(tl.max(pairs, axis=1), axis=0)
        max_tokens += tl.max(tl.load(row, mask=fm, other=0), axis=0)
        c += 1
    recv_total = tl.sum(recv, axis=0)
    h = tl.arange(0, _K_SUMMARY_HEAD)  # (the error words, which the check skips, zero)
    tl.store(summary_ptr + h, tl.where(h == 0, recv_total, tl.where(h == 1, max_pair,
                                                               tl.where(h == 2, max_tokens, 0))))
    tl.store(summary_ptr + _K_SUMMARY_HEAD + f, tl.cumsum(recv, axis=0) - recv, mask=fm)
    tl.store(summary_ptr + _K_SUMMARY_HEAD + L + f, recv, mask=fm)
    tl.store(summary_ptr + _K_SUMMARY_HEAD + 2 * L + f, sent, mask=fm)
    tl.store(summary_ptr + _K_SUMMARY_HEAD + 3 * L + e, per_expert, mask=em)


@triton.jit(do_not_specialize=["m", "stride", "cstride", "col", "chunks", "L", "D", "local", "e_local", "slen"])
def rows_merged_kernel(counts_ptr, map_ptr, back_ptr, summary_ptr, m, stride, cstride, col, chunks, L, D, local,
                       e_local, slen, LP: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr, EP: tl.constexpr):
    """The row maps of an exact-mode dispatch whose domain leg moves all ``chunks`` chunks in one gated call
    (``rows_in_place_kernel``'s tables, all chunks at once), ``M`` rows each: ``map`` int64, the output row of each row
    that call receives (by forwarding rank ``f``, then chunk, then source domain ``d``: each forwarder's chunks one
    after another), and ``back`` int64, the output row of each row of the chunks' own orders one after another (chunk
    ``c``'s rows by ``f``, then ``d``, after the earlier chunks' rows: what each chunk's own call would have received,
    the order its combine takes). The output holds every chunk's rows by ``d``, then ``f``, then chunk. Program ``c <
    chunks`` also writes chunk ``c``'s summary at ``summary + c * slen``, program ``chunks`` the merged call's at
    ``summary + chunks * slen`` (``_summary_of``); the grid has ``chunks + 1`` programs at least."""
    f = tl.arange(0, LP)
    d = tl.arange(0, DP)
    ok = (f < L)[:, None] & (d < D)[None, :]
    at = counts_ptr + f[:, None] * stride + col + d[None, :] * L
    total = tl.zeros([LP, DP], tl.int32)
    c = 0
    while c < chunks:
        total += tl.load(at + c * cstride, mask=ok, other=0)
        c += 1
    row_total = tl.sum(total, axis=1)
    row_base = tl.cumsum(row_total, axis=0) - row_total  # the merged call's rows: by f first
    col_sum = tl.sum(total, axis=0)
    dst_base = (tl.cumsum(col_sum, axis=0) - col_sum)[None, :] + tl.cumsum(total, axis=0) - total
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    to_map = tl.zeros([BLOCK], tl.int32)
    to_back = tl.zeros([BLOCK], tl.int32)
    before = tl.zeros([LP, DP], tl.int32)  # the earlier chunks' rows of each block
    own_base = tl.zeros([], tl.int32)  # the earlier chunks' rows
    c = 0
    while c < chunks:
        n = tl.load(at + c * cstride, mask=ok, other=0)
        row_sum = tl.sum(n, axis=1)
        in_row = tl.cumsum(n, axis=1) - n
        dst = dst_base + before
        own = own_base + (tl.cumsum(row_sum, axis=0) - row_sum)[:, None] + in_row
        merged = (row_base + tl.sum(before, axis=1))[:, None] + in_row
        lo = tl.reshape(own, [LP * DP])
        hi = tl.reshape(own + n, [LP * DP])
        inside = (r[:, None] >= lo[None, :]) & (r[:, None] < hi[None, :])
        to_back += tl.sum(tl.where(inside, tl.reshape(dst - own, [LP * DP])[None, :], 0), axis=1)
        lo = tl.reshape(merged, [LP * DP])
        hi = tl.reshape(merged + n, [LP * DP])
        inside = (r[:, None] >= lo[None, :]) & (r[:, None] < hi[None, :])
        to_map += tl.sum(tl.where(inside, tl.reshape(dst - merged, [LP * DP])[None, :], 0), axis=1)
        before += n
        own_base += tl.sum(row_sum, axis=0)
        c += 1
    live = r < m
    tl.store(map_ptr + r, (r + to_map).to(tl.int64), mask=live)
    tl.store(back_ptr + r, (r + to_back).to(tl.int64), mask=live)
    pid = tl.program_id(0)
    if pid < chunks:
        _summary_of(counts_ptr, summary_ptr + pid * slen, pid, pid + 1, stride, cstride, L, local, e_local, LP, EP)
    if pid == chunks:
        _summary_of(counts_ptr, summary_ptr + pid * slen, 0, chunks, stride, cstride, L, local, e_local, LP, EP)


@triton.jit
def _merged_needs(counts_ptr, out_ptr, chunks, L, stride, align, LP: tl.constexpr):
    """``merged_needs_kernel``'s work, by one program (shared with ``counts_read_kernel``)."""
    f = tl.arange(0, LP)
    ok = f < L
    both = ok[:, None] & ok[None, :]
    land = tl.zeros([LP], tl.int32)
    recv = tl.zeros([LP], tl.int32)
    pair = tl.zeros([], tl.int32)
    most = tl.zeros([], tl.int32)
    c = 0
    while c < chunks:
        row = counts_ptr + (f * chunks + c) * stride
        rows = tl.load(row, mask=ok, other=0)
        per = tl.load(row[:, None] + 1 + f[None, :], mask=both, other=0)  # [forwarder, rank]
        land += (rows + align - 1) // align * align
        recv += tl.sum(per, axis=0)
        pair += tl.max(tl.max(per, axis=1), axis=0)
        most += tl.max(rows, axis=0)
        c += 1
    tl.store(out_ptr, tl.max(land, axis=0))
    tl.store(out_ptr + 1, tl.max(recv, axis=0))
    tl.store(out_ptr + 2, pair)
    tl.store(out_ptr + 3, most)


@triton.jit(do_not_specialize=["chunks", "L", "stride"])
def merged_needs_kernel(counts_ptr, out_ptr, chunks, L, stride, align, LP: tl.constexpr):
    """What the domain leg of an exact-mode dispatch's chunks merged into one gated call needs, from the domain's
    gathered counts ``[L * chunks, W]`` int32 (forwarder ``f``'s chunk ``c`` in row ``f * chunks + c``: its rows, then
    its rows for each rank of the domain, ...), into ``out [4]`` int32: the rows landing on the forwarder that lands
    the most, each chunk's from a multiple of ``align``; the rows the rank that receives the most gets; the merged
    call's max_pair (per chunk the most rows any forwarder sends any rank, summed) and num_tokens_max (per chunk the
    most rows any forwarder forwards, summed). One program."""
    _merged_needs(counts_ptr, out_ptr, chunks, L, stride, align, LP)


@triton.jit(do_not_specialize=["D", "C", "L", "V"])
def counts_gather_row_kernel(recv_ptr, row_ptr, D, C, L, V, BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr):
    """The row an exact-mode dispatch's count exchange gathers over the domain, from what the rail peers sent: ``recv
    [D, C, V + 2]`` int32 (contiguous; source domain ``d``'s chunk ``c``: its ``V`` sums, its chunk's first token, its
    tokens) into ``row [C, V + 1 + D L]`` int32 (contiguous): per chunk the sums over the source domains, the most
    tokens of any rail peer (chunk 0's last column, the same in every chunk), then the rows each source domain sends
    each rank of this domain (``recv[d, c, 1 + g]`` at ``V + 1 + d L + g``). One program per chunk."""
    c = tl.program_id(0)
    v = tl.arange(0, BLOCK_V)
    okv = v < V
    acc = tl.zeros([BLOCK_V], tl.int32)
    most = tl.zeros([], tl.int32)
    d = 0
    while d < D:
        acc += tl.load(recv_ptr + (d * C + c) * (V + 2) + v, mask=okv, other=0)
        most = tl.maximum(most, tl.load(recv_ptr + d * C * (V + 2) + V + 1))
        d += 1
    out = row_ptr + c * (V + 1 + D * L)
    tl.store(out + v, acc, mask=okv)
    tl.store(out + V, most)
    s = tl.arange(0, BLOCK_S)
    oks = s < D * L
    got = tl.load(recv_ptr + ((s // L) * C + c) * (V + 2) + 1 + s % L, mask=oks, other=0)
    tl.store(out + V + 1 + s, got, mask=oks)


@triton.jit(do_not_specialize=["n_every", "stride", "sstride", "D", "C", "L", "has_bad", "needs", "align"])
def counts_read_kernel(every_ptr, n_every, stride, send_ptr, recv_ptr, sstride, D, C, L, bad_ptr, has_bad, needs,
                       align, words_ptr, BLOCK: tl.constexpr, BLOCK_DC: tl.constexpr, LP: tl.constexpr):
    """The words an exact-mode dispatch's host reads after its count exchange, into ``words`` int32: the domain's
    gathered counts (``every``, ``n_every`` words, rows ``stride`` apart and contiguous), this rank's sends and
    receives over the rail (column 0 of ``send`` and ``recv``, ``[D, C, sstride]`` int32), then (``needs`` != 0) the
    four numbers ``merged_needs_kernel`` makes, then the bad top-k id count (``bad [1]`` int32 where ``has_bad`` != 0,
    else 0). Programs copy ``BLOCK`` words of ``every`` each; program 0 also writes the rest. The flags are runtime
    integers: one variant for every call of a shape."""
    pid = tl.program_id(0)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    ok = i < n_every
    tl.store(words_ptr + i, tl.load(every_ptr + i, mask=ok, other=0), mask=ok)
    if pid == 0:
        k = tl.arange(0, BLOCK_DC)
        okk = k < D * C
        tl.store(words_ptr + n_every + k, tl.load(send_ptr + k * sstride, mask=okk, other=0), mask=okk)
        tl.store(words_ptr + n_every + D * C + k, tl.load(recv_ptr + k * sstride, mask=okk, other=0), mask=okk)
        at = n_every + 2 * D * C
        if needs != 0:
            _merged_needs(every_ptr, words_ptr + at, C, L, stride, align, LP)
        at += 4 * (needs != 0).to(tl.int32)
        tl.store(words_ptr + at, tl.load(bad_ptr, mask=has_bad != 0, other=0))


@triton.jit(do_not_specialize=["rec_stride", "r0", "m", "rows", "chunk", "sstride", "cstride", "e_local", "e_dom",
                             "sends_stride", "gstride", "value"])
def forward_layout_kernel(rec_ptr, rec_stride, r0, m, rows, starts_ptr, chunk, sstride, cstride, carried_ptr, idx_ptr,
                          w_ptr, itr_ptr, deferred_ptr, e_local, e_dom, pos_ptr, local_ptr, sends_ptr, sends_stride,
                          gathered_ptr, gstride, flag_ptr, bounds_ptr, value, ticket_ptr, NS: tl.constexpr,
                          K: tl.constexpr, L: tl.constexpr, LP: tl.constexpr, HAS_W: tl.constexpr,
                          BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                          USE_PTX: tl.constexpr):
    """One chunk of a gated exact-mode dispatch's domain leg made ready, once its rows have landed, in one launch: every
    program unpacks ``BLOCK`` rows' records (below); the last to finish (``arrive_last`` on ``ticket [chunk]`` int32,
    zero before the launch, zero again after it) then makes the chunk's positions and releases its flag
    (``_forward_positions``).

    The records: one chunk's landed inter-domain rows made into the domain leg's input, rows ``[r0, r0 +
    rows)`` of the merged input, the first ``m`` of them real (their received records: those rows of ``rec [., W]``
    int32, ``rec_stride`` words apart, ``record_words`` layout), the rest padding (no destination). Writes each real
    row's ``carried [., NS + 2]`` int32 words (its scales, then its source domain and its source token within the
    source's x: the record's token plus the chunk's first token on that source, ``starts[src * sstride + chunk *
    cstride]``), its top-k ids ``idx [., K]`` int64 (this domain's, ``[0, e_dom)`` or -1) and weights ``w [., K]``
    (int32 words), and every row's ``itr [., L]`` int8 (whether one of its ids is on rank ``g`` of the domain,
    ``e_local`` experts a rank); ids outside ``[-1, e_dom)`` are counted into ``deferred [1]`` int32 (a deferred error,
    as the exchange kernel counts them)."""
    i = r0 + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < r0 + rows
    live = i < r0 + m
    i64 = i.to(tl.int64)
    rec = rec_ptr + i64 * rec_stride
    tok = tl.load(rec, mask=live, other=0)
    src = tl.load(rec + 1, mask=live, other=0)
    first = tl.load(starts_ptr + src * sstride + chunk * cstride, mask=live, other=0)
    out = carried_ptr + i64 * (NS + 2)
    if NS > 0:
        s = tl.arange(0, BLOCK_S)
        sm = live[:, None] & (s < NS)[None, :]
        tl.store(out[:, None] + s[None, :], tl.load(rec[:, None] + 2 + s[None, :], mask=sm), mask=sm)
    tl.store(out + NS, src, mask=live)
    tl.store(out + NS + 1, tok + first, mask=live)
    kc = tl.arange(0, BLOCK_K)
    km = live[:, None] & (kc < K)[None, :]
    ids = tl.load(rec[:, None] + 2 + NS + kc[None, :], mask=km, other=-1)
    tl.store(idx_ptr + i64[:, None] * K + kc[None, :], ids.to(tl.int64), mask=km)
    if HAS_W:
        tl.store(w_ptr + i64[:, None] * K + kc[None, :], tl.load(rec[:, None] + 2 + NS + K + kc[None, :], mask=km),
                 mask=km)
    bad = tl.sum(tl.sum((km & ((ids < -1) | (ids >= e_dom))).to(tl.int32), axis=1), axis=0)
    if bad > 0:
        tl.atomic_add(deferred_ptr, bad)
    _in_rank(itr_ptr, i64, inside, ids, km & (ids >= 0) & (ids < e_dom), e_local, L)
    fence_sys(USE_PTX)  # (the block's rows written, then its ticket: the last program's acquire sees every block's)
    tl.debug_barrier()
    if arrive_last(ticket_ptr + chunk, tl.num_programs(0)) != 0:
        _forward_positions(itr_ptr, pos_ptr, local_ptr, sends_ptr, sends_stride, gathered_ptr, gstride, chunk,
                           deferred_ptr, flag_ptr, bounds_ptr, value, r0, m, rows, L, LP, BLOCK_T, USE_PTX)


@triton.jit
def _running_positions(itr_ptr, pos_ptr, t_first, n, base, R, RP: tl.constexpr, BLOCK_T: tl.constexpr, local_ptr=None,
                       m=0):
    """Positions by a running count per destination over blocks of ``BLOCK_T`` tokens: for tokens ``[t_first, t_first
    + n)`` of ``itr [., R]`` int8, ``pos [., R]`` int32 = ``base [RP]`` plus how many of the tokens before it (from
    ``t_first``) go to that destination; ``local [m, R]`` int32 (where given), the same without ``base`` for the
    first ``m`` of them, indexed from 0. Returns the tokens to each destination ``[RP]`` int32."""
    rc = tl.arange(0, RP)
    rm = rc < R
    carry = tl.zeros([RP], tl.int32)
    tb = tl.arange(0, BLOCK_T)
    t0 = 0
    while t0 < n:
        t = t0 + tb
        mk = (t < n)[:, None] & rm[None, :]
        at = (t_first + t).to(tl.int64)[:, None] * R + rc[None, :]
        v = tl.load(itr_ptr + at, mask=mk, other=0).to(tl.int32)
        excl = tl.cumsum(v, axis=0) + carry[None, :] - v
        tl.store(pos_ptr + at, excl + base[None, :], mask=mk)
        if local_ptr is not None:
            tl.store(local_ptr + t.to(tl.int64)[:, None] * R + rc[None, :], excl, mask=mk & (t < m)[:, None])
        carry += tl.sum(v, axis=0)
        t0 += BLOCK_T
    return carry


@triton.jit
def _forward_positions(itr_ptr, pos_ptr, local_ptr, sends_ptr, sends_stride, gathered_ptr, gstride, chunk, deferred_ptr,
                       flag_ptr, bounds_ptr, value, r0, m, rows, L: tl.constexpr, LP: tl.constexpr,
                       BLOCK_T: tl.constexpr, USE_PTX: tl.constexpr):
    """One program, once every row of the chunk is unpacked (``forward_layout_kernel``): each row's positions among this
    rank's rows for each rank of the domain, ``pos [., L]`` int32 in the merged call (after this rank's rows to that
    rank in the earlier chunks) and ``local [m, L]`` int32 in the chunk's own (the chunk's rows ``[r0, r0 + rows)`` of
    the merged input, the first ``m`` real, their ``itr [., L]`` int8); this chunk's rows to each rank into ``sends +
    chunk * sends_stride`` int32, checked against the counts this rank's row of the domain's gathered counts promised
    (``gathered + chunk * gstride + 1 + g``, every chunk's row ``gstride`` words after the one before: a difference is
    counted into ``deferred``, as the exchange kernel's ``CHECK``); writes the chunk's rows' bounds in the merged input
    into ``bounds[chunk]`` and ``bounds[chunk + 1]`` (int32, the gated push's: the next chunk writes the same value at
    ``chunk + 1``); then releases ``value`` into the chunk's flag ``flag[chunk]`` (int64): the gated push
    (``dispatch_kernel``'s ``GATED``) takes the chunk's rows from here on."""
    g = tl.arange(0, LP)
    gm = g < L
    before = tl.zeros([LP], tl.int32)
    c = 0
    while c < chunk:
        before += tl.load(gathered_ptr + c * gstride + 1 + g, mask=gm, other=0)
        c += 1
    carry = _running_positions(itr_ptr, pos_ptr, r0, rows, before, L, LP, BLOCK_T, local_ptr, m)
    tl.store(sends_ptr + chunk * sends_stride + g, carry, mask=gm)
    want = tl.load(gathered_ptr + chunk * gstride + 1 + g, mask=gm, other=0)
    wrong = tl.sum(((carry != want) & gm).to(tl.int32), axis=0)
    if wrong > 0:
        tl.atomic_add(deferred_ptr, wrong)
    tl.store(bounds_ptr + chunk, r0)
    tl.store(bounds_ptr + chunk + 1, r0 + rows)
    tl.debug_barrier()
    fence_sys(USE_PTX)
    st_release(flag_ptr + chunk, tl.full([], value, tl.int64), USE_PTX)


@triton.jit
def _positions_and_checks(per_rank_ptr, itr_ptr, topk_ptr, pos_ptr, n, num_experts, K: tl.constexpr,
                          R: tl.constexpr, R_POW2: tl.constexpr, HAS_TOPK: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    """One program: ``pos [N, R]`` int32 (index of each token among this rank's tokens for each
    destination), whether ``num_tokens_per_rank`` disagrees with ``is_token_in_rank`` (count of ranks), and
    the number of expert ids outside ``[-1, num_experts)``. Returns ``(num_tokens_per_rank [R_POW2],
    bad_layout, bad_topk)``."""
    rcols = tl.arange(0, R_POW2)
    carry = _running_positions(itr_ptr, pos_ptr, 0, n, tl.zeros([R_POW2], tl.int32), R, R_POW2, BLOCK_T)
    per_rank = tl.load(per_rank_ptr + rcols, mask=rcols < R, other=0)
    bad_layout = tl.sum(((carry != per_rank) & (rcols < R)).to(tl.int32), axis=0)
    bad_topk = tl.zeros([], tl.int32)
    if HAS_TOPK:
        kc = tl.arange(0, BLOCK_K)
        tb = tl.arange(0, BLOCK_T)
        t0 = 0
        while t0 < n:
            t = t0 + tb
            m = (t < n)[:, None] & (kc < K)[None, :]
            idx = tl.load(topk_ptr + t.to(tl.int64)[:, None] * K + kc[None, :], mask=m, other=-1)
            bad_topk += tl.sum((m & ((idx < -1) | (idx >= num_experts))).to(tl.int32))
            t0 += BLOCK_T
    return per_rank, bad_layout, bad_topk


@triton.jit(do_not_specialize=["n", "timeout"])
def exchange_kernel(per_rank_ptr, per_expert_ptr, itr_ptr, topk_ptr, pos_ptr, summary_ptr, mat_ptr, bases_ptr,
                    mat_off, flags_off, epoch_ptr, err_ptr, expected_ptr, deferred_ptr, n, num_experts, rank, world,
                    timeout, E_LOCAL: tl.constexpr, TW: tl.constexpr, K: tl.constexpr, R: tl.constexpr,
                    R_POW2: tl.constexpr, HAS_EXPERTS: tl.constexpr, HAS_TOPK: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, USE_PTX: tl.constexpr,
                    USE_TIMER: tl.constexpr, CHECK: tl.constexpr = False):
    """One program: put this rank's count table into every peer's ``mat[rank]``; meanwhile compute
    ``pos [N, R]`` (index of each token among this rank's tokens for each destination), check the layout
    and the expert ids; barrier; then write the summary (see the module docstring). ``CHECK`` (counts the host
    knew beforehand, ``expected`` int32 the summary it made of them, its error words zero): add to ``deferred [1]``
    int32 the summary's words that differ from it (the error words aside) and the bad ids and layout entries
    found, as a call without host synchronisation reports bad input."""
    ecols = tl.arange(0, BLOCK_E)
    rcols = tl.arange(0, R_POW2)
    for q in tl.static_range(R):  # every peer q gets this rank's whole table: mat[rank, p, :] for all p
        base = tl.load(bases_ptr + q) + mat_off
        for p in tl.static_range(R):
            dst = (base + ((rank * R + p) * TW) * 4).to(tl.pointer_type(tl.int32))
            # the table for destination p: [tokens to p, own token count, tokens per expert of p]
            tl.store(dst, tl.load(per_rank_ptr + p))
            tl.store(dst + 1, n)
            if HAS_EXPERTS:
                em = ecols < E_LOCAL
                tl.store(dst + 2 + ecols, tl.load(per_expert_ptr + p * E_LOCAL + ecols, mask=em), mask=em)
    per_rank, bad_layout, bad_topk = _positions_and_checks(per_rank_ptr, itr_ptr, topk_ptr, pos_ptr, n, num_experts,
                                                           K, R, R_POW2, HAS_TOPK, BLOCK_T, BLOCK_K)
    block_barrier(bases_ptr, flags_off, epoch_ptr, err_ptr, rank, world, timeout, _K_ERR_BARRIER, R_POW2,
                  USE_PTX, USE_TIMER)
    # the whole matrix is here now
    src = rcols
    sm = src < R
    recv_from = tl.load(mat_ptr + (src * R + rank) * TW, mask=sm, other=0)
    prefix = tl.cumsum(recv_from, axis=0) - recv_from
    max_pair = tl.zeros([], tl.int32)
    max_tokens = tl.zeros([], tl.int32)
    for s in tl.static_range(R):
        row = tl.load(mat_ptr + (s * R + rcols) * TW, mask=sm, other=0)
        max_pair = tl.maximum(max_pair, tl.max(row, axis=0))
        max_tokens = tl.maximum(max_tokens, tl.load(mat_ptr + (s * R) * TW + 1))
    total = tl.sum(recv_from, axis=0)
    tl.store(summary_ptr + 0, total)
    tl.store(summary_ptr + 1, max_pair)
    tl.store(summary_ptr + 2, max_tokens)
    tl.store(summary_ptr + 3, bad_topk)
    tl.store(summary_ptr + 4, bad_layout)
    tl.store(summary_ptr + 5, tl.load(err_ptr).to(tl.int32))
    tl.store(summary_ptr + 6, tl.load(err_ptr + 2).to(tl.int32))
    tl.store(summary_ptr + 7, tl.load(err_ptr + 5).to(tl.int32))
    tl.store(summary_ptr + 8 + src, prefix, mask=sm)
    tl.store(summary_ptr + 8 + R + src, recv_from, mask=sm)
    tl.store(summary_ptr + 8 + 2 * R + src, per_rank, mask=sm)
    if HAS_EXPERTS:
        em = ecols < E_LOCAL
        acc = tl.zeros([BLOCK_E], tl.int32)
        for s in tl.static_range(R):
            acc += tl.load(mat_ptr + (s * R + rank) * TW + 2 + ecols, mask=em, other=0)
        tl.store(summary_ptr + 8 + 3 * R + ecols, acc, mask=em)
    if CHECK:
        wrong = bad_topk + bad_layout
        wrong += (total != tl.load(expected_ptr)).to(tl.int32)
        wrong += (max_pair != tl.load(expected_ptr + 1)).to(tl.int32)
        wrong += (max_tokens != tl.load(expected_ptr + 2)).to(tl.int32)
        for j in tl.static_range(3):  # prefix, received from, sent
            got = prefix if j == 0 else recv_from if j == 1 else per_rank
            want = tl.load(expected_ptr + 8 + j * R + src, mask=sm, other=0)
            wrong += tl.sum(((got != want) & sm).to(tl.int32), axis=0)
        if HAS_EXPERTS:
            want = tl.load(expected_ptr + 8 + 3 * R + ecols, mask=em, other=0)
            wrong += tl.sum(((acc != want) & em).to(tl.int32), axis=0)
        tl.atomic_add(deferred_ptr, wrong)


@triton.jit(do_not_specialize=["n"])
def plan_kernel(per_rank_ptr, per_expert_ptr, itr_ptr, topk_ptr, pos_ptr, table_ptr, first_ptr, checks_ptr, errors_ptr,
                n, num_experts, E_LOCAL: tl.constexpr, K: tl.constexpr, R: tl.constexpr, R_POW2: tl.constexpr,
                HAS_EXPERTS: tl.constexpr, HAS_TOPK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """The portable transport's send plan in one program: positions and checks (``checks [4]``: bad layout,
    bad expert ids, and the two words of ``errors`` (the transport's deferred error counts), so that one
    read of the host brings them all), the ``[R, 1 + E_local]`` count table its all_to_all exchanges, and ``first [R]`` =
    minus the first send row of every destination (so ``dispatch_push_kernel`` in local mode writes token t's
    row for r at ``pos[t, r] - first[r]``)."""
    per_rank, bad_layout, bad_topk = _positions_and_checks(per_rank_ptr, itr_ptr, topk_ptr, pos_ptr, n, num_experts,
                                                           K, R, R_POW2, HAS_TOPK, BLOCK_T, BLOCK_K)
    rcols = tl.arange(0, R_POW2)
    rm = rcols < R
    tl.store(first_ptr + rcols, -(tl.cumsum(per_rank, axis=0) - per_rank), mask=rm)
    tl.store(table_ptr + rcols * (1 + E_LOCAL), per_rank, mask=rm)
    if HAS_EXPERTS:
        ecols = tl.arange(0, BLOCK_E)
        em = ecols < E_LOCAL
        for p in tl.static_range(R):
            tl.store(table_ptr + p * (1 + E_LOCAL) + 1 + ecols, tl.load(per_expert_ptr + p * E_LOCAL + ecols, mask=em),
                     mask=em)
    tl.store(checks_ptr, bad_layout)
    tl.store(checks_ptr + 1, bad_topk)
    tl.store(checks_ptr + 2, tl.load(errors_ptr))
    tl.store(checks_ptr + 3, tl.load(errors_ptr + 1))


@triton.jit
def _publish(bases_ptr, hdr_first_ptr, hdr_rows_ptr, hdr_off, arrive_off, epoch_ptr, rank, world,
             R_POW2: tl.constexpr, HAS_HDR: tl.constexpr, FIRST_ZERO: tl.constexpr, USE_PTX: tl.constexpr):
    """Called by the last program: write the round headers, then release the epoch to every peer."""
    fence_sys(USE_PTX)
    epoch = tl.load(epoch_ptr)
    peers = tl.arange(0, R_POW2)
    live = peers < world
    safe = tl.where(live, peers, rank)
    base = tl.load(bases_ptr + safe)
    if HAS_HDR:
        h = (base + hdr_off + rank * 8).to(tl.pointer_type(tl.int32))
        if FIRST_ZERO:
            tl.store(h, tl.zeros([R_POW2], tl.int32), mask=live)
        else:
            tl.store(h, tl.load(hdr_first_ptr + safe), mask=live)
        tl.store(h + 1, tl.load(hdr_rows_ptr + safe), mask=live)
        fence_sys(USE_PTX)
        tl.debug_barrier()
    flag = (base + arrive_off + rank * 8).to(tl.pointer_type(tl.int64))
    st_release(flag, tl.zeros([R_POW2], tl.int64) + epoch, USE_PTX)


@triton.jit
def _dest_row(itr_ptr, pos_ptr, first_ptr, t, live, r, rank, cap, R: tl.constexpr, SINGLE_ROUND: tl.constexpr):
    """For tokens ``t``: whether each goes to rank ``r`` and its row ``rank * cap + pos[t, r] - first[r]`` in
    that rank's area (``first`` is 0 in a single round). A row past the ``cap`` rows of this rank's region (more
    rows than an overflowing ``num_worst_tokens``) goes nowhere: nothing is written out of the region. ``cap`` 0:
    one unbounded region (the portable transport's local packing)."""
    go = live & (tl.load(itr_ptr + t * R + r, mask=live, other=0) != 0)
    a = tl.load(pos_ptr + t * R + r, mask=go, other=0)
    if not SINGLE_ROUND:
        a -= tl.load(first_ptr + r)
    go = go & ((a < cap) | (cap == 0))
    return go, (rank * cap + a).to(tl.int64)


@triton.jit
def _dest_end(itr_ptr, pos_ptr, t_last, rcols, R: tl.constexpr):
    """Per destination ``rcols``: the position just past the last of tokens ``<= t_last`` that go there
    (``pos[t_last, r] + is_token_in_rank[t_last, r]``); 0 when ``t_last < 0``."""
    ok = (rcols < R) & (t_last >= 0)
    t = tl.maximum(t_last, 0).to(tl.int64)
    p = tl.load(pos_ptr + t * R + rcols, mask=ok, other=0)
    return p + (tl.load(itr_ptr + t * R + rcols, mask=ok, other=0) != 0).to(tl.int32)


@triton.jit
def _progress(bases_ptr, prog_off, row, slot, value, rank, world, R_POW2: tl.constexpr, USE_PTX: tl.constexpr):
    """Release ``value [R_POW2]`` (one per destination) into word ``slot`` of this rank's progress ``row`` in
    every destination's heap (``prog`` int64 ``[R_src, PMAX + 2, 2]`` at ``prog_off``, see
    ``dispatch_kernel``). Lanes past ``world`` write their (different) values into the row's spare pair of
    this rank's own heap, never into a live lane's word."""
    peers = tl.arange(0, R_POW2)
    live = peers < world
    base = tl.load(bases_ptr + tl.where(live, peers, rank))
    word = tl.where(live, row * 2 + slot, row * 2 + 2)
    st_release((base + prog_off + word * 8).to(tl.pointer_type(tl.int64)), value, USE_PTX)


@triton.jit
def _row_tile(ptr, rows, live, c0, XW: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr,
              STRIDE: tl.constexpr = 0):
    """Columns ``[c0, c0 + BLOCK)`` of the ``XW``-word rows ``rows`` (int64 ``[ROWS]``, ``live`` masks them) of
    ``ptr``, rows ``STRIDE`` words apart (0: ``XW``): ``(tile [ROWS, BLOCK], cols, cols < XW)``, the columns marked
    4-aligned runs with ``VEC``."""
    cols = c0 + tl.arange(0, BLOCK)
    if VEC:
        cols = tl.max_contiguous(tl.multiple_of(cols, 4), 4)
    cm = cols < XW
    if STRIDE > 0:
        p = ptr + rows[:, None] * STRIDE + cols[None, :]
    else:
        p = ptr + rows[:, None] * XW + cols[None, :]
    return tl.load(p, mask=live[:, None] & cm[None, :]), cols, cm


@triton.jit
def _push_tokens(pid, nprog, slot, nslots, x_ptr, scales_ptr, s_stride_t, s_stride_c, topk_ptr, w_ptr, itr_ptr,
                 pos_ptr, first_ptr, bases_ptr, area_off, meta_off, prog_off, tag, t_begin, t_end, cap, rank, world,
                 XW: tl.constexpr, W: tl.constexpr, NS: tl.constexpr, K: tl.constexpr, E_LOCAL: tl.constexpr,
                 R: tl.constexpr, R_POW2: tl.constexpr, TOK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr,
                 BLOCK_K: tl.constexpr, HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr, HAS_W: tl.constexpr,
                 SINGLE_ROUND: tl.constexpr, VEC: tl.constexpr, USE_PTX: tl.constexpr, PMAX: tl.constexpr,
                 SIG: tl.constexpr, pidx_ptr=None, HAS_PIDX: tl.constexpr = False, XS: tl.constexpr = 0,
                 DST_RS: tl.constexpr = 0, t_base=0):
    """Program ``pid`` of ``nprog`` pushes its contiguous range of tokens ``[t_begin, t_end)``, ``TOK`` at a
    time: reads each row once and stores it, with its record, into every destination it goes to, at row
    ``rank * cap + pos[t, r] - first[r]`` of that destination's area. ``SIG > 0`` (streaming dispatch) also
    reports progress to every destination in its progress ``slot`` (``pid``, or in a gated dispatch one slot per
    chunk and program, ``nslots`` in all): first ``begin = tag | pos[lo, r]``, then every ``SIG`` steps and
    at the end ``end = tag | pos past the tokens pushed so far`` (bit 31 set on the last), each after a
    fence so that it publishes the rows before it (slot 0 also announces ``nslots`` and ``first``).
    ``HAS_PIDX`` (expert-major dispatch, ``epcomm.kernels.expert_major``): records end with K more words,
    ``pidx [N, K]`` int32 (each pair's index among this rank's pairs of its expert). ``XS``: the rows of ``x`` are
    that many words apart (0: ``XW``, contiguous). ``DST_RS`` (a pack into one local buffer): each destination row is
    that many words, its row's words then its record's (at ``meta_off``, the row's end) side by side; 0: rows ``XW``
    and records ``W`` words apart in their own areas. A record's source token is ``t - t_base`` (a gated dispatch's:
    the token's index within its chunk)."""
    per = tl.cdiv(tl.cdiv(t_end - t_begin, nprog), TOK) * TOK
    lo = t_begin + pid * per
    hi = tl.minimum(lo + per, t_end)
    toks = tl.arange(0, TOK)
    scols = tl.arange(0, BLOCK_S)
    kc = tl.arange(0, BLOCK_K)
    rcols = tl.arange(0, R_POW2)
    if DST_RS > 0:  # rows and records side by side in one buffer's rows
        row_bytes = DST_RS * 4
        rec_bytes = DST_RS * 4
    else:
        row_bytes = XW * 4
        rec_bytes = W * 4
    row = rank * (PMAX + 2)  # this rank's row of progress words at each destination (pairs of int64)
    if SIG > 0:
        if slot == 0:
            _progress(bases_ptr, prog_off, row, 0, tl.zeros([R_POW2], tl.int64) + tag + nslots, rank, world, R_POW2,
                      USE_PTX)
            if SINGLE_ROUND:
                fr = tl.zeros([R_POW2], tl.int64)
            else:
                fr = tl.load(first_ptr + rcols, mask=rcols < R, other=0).to(tl.int64)
            _progress(bases_ptr, prog_off, row, 1, tag + fr, rank, world, R_POW2, USE_PTX)
        start = _dest_end(itr_ptr, pos_ptr, tl.where(hi > lo, lo - 1, -1), rcols, R)  # pos[lo, r]; 0 when empty
        _progress(bases_ptr, prog_off, row, (2 + slot) * 2, tag + start.to(tl.int64), rank, world, R_POW2, USE_PTX)
    t0 = lo
    steps = 0
    while t0 < hi:  # (a while loop: the interpreter cannot run for loops with run-time bounds)
        t = (t0 + toks).to(tl.int64)
        live = t < hi
        for c0 in tl.static_range(0, XW, BLOCK):
            v, cols, cm = _row_tile(x_ptr, t, live, c0, XW, BLOCK, VEC, XS)
            for r in tl.static_range(R):
                go, a = _dest_row(itr_ptr, pos_ptr, first_ptr, t, live, r, rank, cap, R, SINGLE_ROUND)
                dst = (tl.load(bases_ptr + r) + area_off + a * row_bytes).to(tl.pointer_type(tl.int32))
                if VEC:  # heap bases and areas are 256-byte aligned, rows 16: 16-byte stores of the loaded layout
                    dst = tl.multiple_of(dst, 16)  # (measured 1-3% faster here; not in _push_rows, see there)
                tl.store(dst[:, None] + cols[None, :], v, mask=go[:, None] & cm[None, :])
        if HAS_SCALES:
            sm = live[:, None] & (scols < NS)[None, :]
            sv = tl.load(scales_ptr + t[:, None] * s_stride_t + scols[None, :] * s_stride_c, mask=sm)
        if HAS_TOPK:
            km = live[:, None] & (kc < K)[None, :]
            idx = tl.load(topk_ptr + t[:, None] * K + kc[None, :], mask=km, other=-1).to(tl.int32)
            if HAS_W:
                wv = tl.load(w_ptr + t[:, None] * K + kc[None, :], mask=km, other=0.0)
            if HAS_PIDX:
                pv = tl.load(pidx_ptr + t[:, None] * K + kc[None, :], mask=km, other=-1)
        for r in tl.static_range(R):
            go, a = _dest_row(itr_ptr, pos_ptr, first_ptr, t, live, r, rank, cap, R, SINGLE_ROUND)
            rec = (tl.load(bases_ptr + r) + meta_off + a * rec_bytes).to(tl.pointer_type(tl.int32))
            tl.store(rec, (t - t_base).to(tl.int32), mask=go)
            tl.store(rec + 1, tl.zeros([TOK], tl.int32) + rank, mask=go)
            if HAS_SCALES:
                tl.store(rec[:, None] + 2 + scols[None, :], sv, mask=go[:, None] & (scols < NS)[None, :])
            if HAS_TOPK:
                local = idx - r * E_LOCAL
                mine = (idx >= 0) & (local >= 0) & (local < E_LOCAL)
                gm = go[:, None] & (kc < K)[None, :]
                tl.store(rec[:, None] + 2 + NS + kc[None, :], tl.where(mine, local, -1), mask=gm)
                if HAS_W:
                    wr = tl.where(mine, wv, 0.0).to(tl.int32, bitcast=True)
                    tl.store(rec[:, None] + 2 + NS + K + kc[None, :], wr, mask=gm)
                if HAS_PIDX:  # expert-major: the pair indices after the weights
                    poff = 2 + NS + K
                    if HAS_W:
                        poff += K
                    tl.store(rec[:, None] + poff + kc[None, :], pv, mask=gm)
        t0 += TOK
        steps += 1
        if SIG > 0:
            if (steps % SIG == 0) & (t0 < hi):
                fence_sys(USE_PTX)
                tl.debug_barrier()
                end = _dest_end(itr_ptr, pos_ptr, t0 - 1, rcols, R).to(tl.int64)
                _progress(bases_ptr, prog_off, row, (2 + slot) * 2 + 1, tag + end, rank, world, R_POW2, USE_PTX)
    if SIG > 0:
        fence_sys(USE_PTX)
        tl.debug_barrier()
        end = _dest_end(itr_ptr, pos_ptr, tl.where(hi > lo, hi - 1, -1), rcols, R).to(tl.int64)
        last = tag + end + (tl.full([], 1, tl.int64) << 31)
        _progress(bases_ptr, prog_off, row, (2 + slot) * 2 + 1, last, rank, world, R_POW2, USE_PTX)


@triton.jit(do_not_specialize=["t_begin", "t_end", "cap"])
def dispatch_push_kernel(x_ptr, scales_ptr, s_stride_t, s_stride_c, topk_ptr, w_ptr, itr_ptr, pos_ptr,
                         first_ptr, rows_ptr, bases_ptr, area_off, meta_off, hdr_off, arrive_off, epoch_ptr,
                         counter_ptr, t_begin, t_end, cap, rank, world, XW: tl.constexpr, W: tl.constexpr,
                         NS: tl.constexpr, K: tl.constexpr, E_LOCAL: tl.constexpr, R: tl.constexpr,
                         R_POW2: tl.constexpr, TOK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr,
                         BLOCK_K: tl.constexpr, HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr,
                         HAS_W: tl.constexpr, SINGLE_ROUND: tl.constexpr, VEC: tl.constexpr,
                         USE_PTX: tl.constexpr, PUBLISH: tl.constexpr = True, DST_RS: tl.constexpr = 0):
    """Token-major push (``_push_tokens``) by every program, then the last one publishes the round (headers
    and epoch, for ``dispatch_copyout_kernel``).

    x_ptr: int32 ``[N, XW]``; scales_ptr: int32 words, ``[N, NS]`` with the given strides; topk_ptr ``[N, K]``
    (int64 or int32); w_ptr float32 ``[N, K]``; itr_ptr int8 ``[N, R]``; pos_ptr int32 ``[N, R]``;
    first_ptr/rows_ptr int32 ``[R]``: this round's first pair index and rows per destination (with
    SINGLE_ROUND, first is 0 and rows_ptr is num_tokens_per_rank). With ``PUBLISH=False`` it only packs
    (every ``bases`` entry is one local buffer: the portable transport's send area) and signals nobody; ``DST_RS``:
    as ``_push_tokens``."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    _push_tokens(pid, nprog, pid, nprog, x_ptr, scales_ptr, s_stride_t, s_stride_c, topk_ptr, w_ptr, itr_ptr,
                 pos_ptr, first_ptr, bases_ptr, area_off, meta_off, 0, 0, t_begin, t_end, cap, rank, world, XW, W, NS,
                 K, E_LOCAL, R, R_POW2, TOK, BLOCK, BLOCK_S, BLOCK_K, HAS_SCALES, HAS_TOPK, HAS_W, SINGLE_ROUND, VEC,
                 USE_PTX, 1, 0, DST_RS=DST_RS)
    if PUBLISH:
        fence_sys(USE_PTX)
        tl.debug_barrier()
        if arrive_last(counter_ptr, nprog) != 0:
            _publish(bases_ptr, first_ptr, rows_ptr, hdr_off, arrive_off, epoch_ptr, rank, world, R_POW2, True,
                     SINGLE_ROUND, USE_PTX)


@triton.jit
def _row_records(meta_ptr, out_src_ptr, src0, dst0, i0, hi, W: tl.constexpr, ROWS: tl.constexpr, map_ptr=None,
                 MAPPED: tl.constexpr = False):
    """The copy-outs' step over rows ``i = i0 .. i0 + ROWS - 1`` below ``hi``: area row ``src0 + i`` is output row
    ``dst0 + i`` (with ``MAPPED``: row ``map[dst0 + i]``, ``map`` int64 ``[M]``); stores its record's (source token,
    source rank) into ``out_src [M, 2]``. Returns ``(live, src, dst, rec)`` (the mask, int64 area and output rows,
    record pointers)."""
    i = i0 + tl.arange(0, ROWS)
    live = i < hi
    src = (src0 + i).to(tl.int64)
    dst = (dst0 + i).to(tl.int64)
    if MAPPED:
        dst = tl.load(map_ptr + dst, mask=live, other=0)
    rec = meta_ptr + src * W
    tl.store(out_src_ptr + dst * 2, tl.load(rec, mask=live), mask=live)
    tl.store(out_src_ptr + dst * 2 + 1, tl.load(rec + 1, mask=live), mask=live)
    return live, src, dst, rec


@triton.jit
def _copy_rows(area_ptr, meta_ptr, out_x_ptr, out_scales_ptr, out_idx_ptr, out_w_ptr, out_src_ptr, src0, dst0, lo,
               hi, step, XW: tl.constexpr, W: tl.constexpr, NS: tl.constexpr, K: tl.constexpr, ROWS: tl.constexpr,
               BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SCALES: tl.constexpr,
               HAS_TOPK: tl.constexpr, HAS_W: tl.constexpr, VEC: tl.constexpr, COPY_X: tl.constexpr, map_ptr=None,
               MAPPED: tl.constexpr = False):
    """Rows ``i`` of ``[lo, hi)``, ``ROWS`` at a time from ``lo`` in strides of ``step``: copy area row
    ``src0 + i`` to output row ``dst0 + i`` (``map[dst0 + i]`` with ``MAPPED``) (with ``COPY_X``) and unpack its
    record: ``out_src`` int32 ``[M, 2]`` (source token, source rank), scales, int64 local top-k ids, float32
    weights."""
    kcols = tl.arange(0, BLOCK_K)
    scols = tl.arange(0, BLOCK_S)
    i0 = lo
    while i0 < hi:
        live, src, dst, rec = _row_records(meta_ptr, out_src_ptr, src0, dst0, i0, hi, W, ROWS, map_ptr, MAPPED)
        if COPY_X:
            for c0 in tl.static_range(0, XW, BLOCK):
                v, cols, cm = _row_tile(area_ptr, src, live, c0, XW, BLOCK, VEC)
                tl.store(out_x_ptr + dst[:, None] * XW + cols[None, :], v, mask=live[:, None] & cm[None, :])
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
        i0 += step


@triton.jit
def _copy_rows_em(area_ptr, meta_ptr, out_x_ptr, out_s_ptr, out_w_ptr, out_src_ptr, row_src_ptr, pair_row_ptr,
                  base_ptr, s, src0, dst0, lo, hi, step, rows_out, XW: tl.constexpr, W: tl.constexpr,
                  NS: tl.constexpr, K: tl.constexpr, E_LOCAL: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SCALES: tl.constexpr, HAS_W: tl.constexpr,
                  VEC: tl.constexpr):
    """Rows ``i`` of ``[lo, hi)`` of source ``s`` (``ROWS`` at a time, strides of ``step``): area row ``src0 + i``
    is received token ``m = dst0 + i``. Writes ``out_src[m]`` (source token, source rank) and, for every slot k
    whose record says local id e >= 0 and pair index p >= 0, the row ``base[s, e] + p`` (if below ``rows_out``)
    of ``out_x`` (and scales), ``out_w`` (the slot's weight), ``row_src`` (``m * K + k``), and ``pair_row[m, k]``
    (-1 for the other slots)."""
    kc = tl.arange(0, BLOCK_K)
    scols = tl.arange(0, BLOCK_S)
    poff = 2 + NS + K
    if HAS_W:
        poff += K
    i0 = lo
    while i0 < hi:
        live, src, dst, rec = _row_records(meta_ptr, out_src_ptr, src0, dst0, i0, hi, W, ROWS)
        km = live[:, None] & (kc < K)[None, :]
        ids = tl.load(rec[:, None] + 2 + NS + kc[None, :], mask=km, other=-1)
        pidx = tl.load(rec[:, None] + poff + kc[None, :], mask=km, other=-1)
        ok = km & (ids >= 0) & (ids < E_LOCAL) & (pidx >= 0)
        row = tl.load(base_ptr + s * E_LOCAL + ids, mask=ok, other=0) + pidx
        ok = ok & (row < rows_out)
        row = tl.where(ok, row, -1)
        tl.store(pair_row_ptr + dst[:, None] * K + kc[None, :], row, mask=km)
        row64 = row.to(tl.int64)
        tl.store(row_src_ptr + row64, (dst[:, None] * K + kc[None, :]).to(tl.int32), mask=ok)
        if HAS_W:
            wv = tl.load(rec[:, None] + 2 + NS + K + kc[None, :], mask=ok).to(tl.float32, bitcast=True)
            tl.store(out_w_ptr + row64, wv, mask=ok)
        if HAS_SCALES:
            sm = live[:, None] & (scols < NS)[None, :]
            sv = tl.load(rec[:, None] + 2 + scols[None, :], mask=sm)
            for k in tl.static_range(K):
                rk = tl.sum(tl.where(kc[None, :] == k, row64, 0), axis=1)
                tl.store(out_s_ptr + rk[:, None] * NS + scols[None, :], sv, mask=(rk >= 0)[:, None] & sm)
        for c0 in tl.static_range(0, XW, BLOCK):
            v, cols, cm = _row_tile(area_ptr, src, live, c0, XW, BLOCK, VEC)
            for k in tl.static_range(K):
                rk = tl.sum(tl.where(kc[None, :] == k, row64, 0), axis=1)
                tl.store(out_x_ptr + rk[:, None] * XW + cols[None, :], v, mask=(rk >= 0)[:, None] & cm[None, :])
        i0 += step


@triton.jit(do_not_specialize=["out_rows", "cap", "timeout"])
def dispatch_copyout_kernel(area_ptr, meta_ptr, hdr_ptr, bases_ptr, arrive_off, epoch_ptr, err_ptr, prefix_ptr,
                            out_x_ptr, out_scales_ptr, out_idx_ptr, out_w_ptr, out_src_ptr, out_rows, cap, rank,
                            world, timeout, XW: tl.constexpr, W: tl.constexpr, NS: tl.constexpr, K: tl.constexpr,
                            R: tl.constexpr, R_POW2: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                            BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SCALES: tl.constexpr,
                            HAS_TOPK: tl.constexpr, HAS_W: tl.constexpr, VEC: tl.constexpr,
                            USE_PTX: tl.constexpr, USE_TIMER: tl.constexpr, ONE_SIDED: tl.constexpr = True):
    """Wait for every source's round, then copy its rows from the area into the outputs and unpack the
    records (``_copy_rows``). Source ``s``'s rows of this round land at ``prefix[s] + first``; rows past
    ``out_rows`` or past the ``cap`` rows of a region (an overflowing ``num_worst_tokens``, reported on the host
    side; the push sent no row past ``cap``) are dropped. Programs take
    ``ROWS`` rows at a time, cycling over every source's rows (a local copy: launch many programs).
    ``ONE_SIDED=False`` (the portable transport, whose all_to_all already put the rows in place): no wait,
    no rows to copy, one region of ``out_rows`` records to unpack (``R`` must be 1)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if ONE_SIDED:
        wait_all_ge(tl.load(bases_ptr + rank), arrive_off, world, tl.load(epoch_ptr), timeout, err_ptr, _K_ERR_DONE,
                    rank, R_POW2, USE_PTX, USE_TIMER)
        tl.debug_barrier()
    for s in tl.static_range(R):
        if ONE_SIDED:
            first = tl.load(hdr_ptr + s * 2)
            rows = tl.load(hdr_ptr + s * 2 + 1)
            out0 = tl.load(prefix_ptr + s) + first
            rows = tl.minimum(tl.minimum(rows, cap), tl.maximum(out_rows - out0, 0))  # past cap: not sent
        else:
            rows = out_rows
            out0 = 0
        _copy_rows(area_ptr, meta_ptr, out_x_ptr, out_scales_ptr, out_idx_ptr, out_w_ptr, out_src_ptr, s * cap, out0,
                   pid * ROWS, rows, nprog * ROWS, XW, W, NS, K, ROWS, BLOCK, BLOCK_K, BLOCK_S, HAS_SCALES, HAS_TOPK,
                   HAS_W, VEC, ONE_SIDED)


@triton.jit
def _await(ptr, value, timeout, err_ptr, rank, peer, slot, USE_PTX: tl.constexpr, USE_TIMER: tl.constexpr):
    """Wait until the progress word at ``ptr`` carries ``value``'s epoch (its high 32 bits, compared exactly)
    and low 32 bits at least ``value``'s (``wait_after``: acquire loads, one when it already holds, a timeout
    otherwise), then return the word's low 32 bits, or -1 after a timeout. A word of another epoch never
    satisfies the wait (an error is recorded if it is already past this one), so a stale or early word cannot
    end it and nothing spins without the timeout."""
    word = wait_after(ptr, value, timeout, err_ptr, _K_ERR_DONE, rank, peer, slot, USE_PTX, USE_TIMER)
    ok = ((word - value) >= 0) & ((word >> 32) == (value >> 32))
    if ((word - value) >= 0) & ((word >> 32) != (value >> 32)):  # a later epoch than this round's
        record_error(err_ptr, _K_ERR_DONE, rank, peer, slot, value, word, _K_CMP_AFTER)
    low = word & 0xFFFFFFFF
    return tl.where(ok, low, -1)


@triton.jit
def _receive_stream(pid, num_push, world, prog_ptr, tag, timeout, err_ptr, rank, prefix_ptr, out_rows, cap, area_ptr,
                    meta_ptr, out_x_ptr, out_scales_ptr, out_idx_ptr, out_w_ptr, out_src_ptr, row_src_ptr, pair_row_ptr,
                    em_base_ptr, rows_out, XW: tl.constexpr, W: tl.constexpr, NS: tl.constexpr, K: tl.constexpr,
                    E_LOCAL: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
                    HAS_SCALES: tl.constexpr, HAS_IDX: tl.constexpr, HAS_W: tl.constexpr, VEC: tl.constexpr,
                    USE_PTX: tl.constexpr, USE_TIMER: tl.constexpr, PMAX: tl.constexpr, EM: tl.constexpr,
                    map_ptr=None, MAPPED: tl.constexpr = False):
    """The receiving half of a streaming dispatch (``dispatch_kernel``; ``em_dispatch_kernel`` with ``EM``):
    program ``pid >= num_push`` is receiving program ``j = pid - num_push`` and takes source ``s = j // nrp``
    (``nrp = (programs - num_push) // world`` per source, spare ones exit), waits for each of the sender's programs
    ``p = q, q + nrp, ...`` and copies every newly reported stretch of rows into the outputs: rank-major rows and
    unpacked records (``_copy_rows``; with ``MAPPED`` to the rows ``map`` names), or with ``EM`` the expert-major
    rows of their pairs (``_copy_rows_em``; ``row_src``, ``pair_row``, ``em_base``, ``rows_out``)."""
    nrp = (tl.num_programs(0) - num_push) // world  # receiving programs per source
    j = pid - num_push
    s = j // nrp
    q = j % nrp
    if s < world:
        row = prog_ptr + s * (PMAX + 2) * 2
        nsend = _await(row, tag, timeout, err_ptr, rank, s, -1, USE_PTX, USE_TIMER)
        first = _await(row + 1, tag, timeout, err_ptr, rank, s, -1, USE_PTX, USE_TIMER)
        ok = (nsend >= 0) & (first >= 0)
        base = tl.load(prefix_ptr + s)
        p = q
        while ok & (p < nsend):
            start = _await(row + (2 + p) * 2, tag, timeout, err_ptr, rank, s, p, USE_PTX, USE_TIMER)
            ok = start >= 0
            copied = start
            fin = tl.zeros([], tl.int64)
            while ok & (fin == 0):
                word = _await(row + (2 + p) * 2 + 1, tag + copied + 1, timeout, err_ptr, rank, s, p, USE_PTX,
                              USE_TIMER)
                ok = word >= 0
                fin = (word >> 31) & 1
                end = tl.where(ok, word & 0x7FFFFFFF, copied)
                hi = tl.minimum(tl.minimum(end, out_rows - base), first + cap)  # rows past the region: not sent
                if EM:
                    _copy_rows_em(area_ptr, meta_ptr, out_x_ptr, out_scales_ptr, out_w_ptr, out_src_ptr, row_src_ptr,
                                  pair_row_ptr, em_base_ptr, s, s * cap - first, base, copied, hi, ROWS, rows_out,
                                  XW, W, NS, K, E_LOCAL, ROWS, 1024, BLOCK_K, BLOCK_S, HAS_SCALES, HAS_W, VEC)
                else:
                    _copy_rows(area_ptr, meta_ptr, out_x_ptr, out_scales_ptr, out_idx_ptr, out_w_ptr, out_src_ptr,
                               s * cap - first, base, copied, hi, ROWS, XW, W, NS, K, ROWS, 1024, BLOCK_K, BLOCK_S,
                               HAS_SCALES, HAS_IDX, HAS_W, VEC, True, map_ptr, MAPPED)
                copied = end
            p += nrp


@triton.jit(do_not_specialize=["t_begin", "t_end", "cap", "num_push", "out_rows", "timeout", "gate_value",
                             "num_chunks"])
def dispatch_kernel(x_ptr, scales_ptr, s_stride_t, s_stride_c, topk_ptr, w_ptr, itr_ptr, pos_ptr, first_ptr,
                    bases_ptr, area_off, meta_off, prog_off, epoch_ptr, t_begin, t_end, cap, rank, world, num_push,
                    area_ptr, meta_ptr, prog_ptr, err_ptr, prefix_ptr, out_x_ptr, out_scales_ptr,
                    out_idx_ptr, out_w_ptr, out_src_ptr, out_rows, timeout, bounds_ptr, gate_ptr, gate_value,
                    num_chunks, map_ptr, XW: tl.constexpr, W: tl.constexpr,
                    NS: tl.constexpr, K: tl.constexpr, E_LOCAL: tl.constexpr, R: tl.constexpr, R_POW2: tl.constexpr,
                    TOK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
                    HAS_SCALES: tl.constexpr, HAS_TOPK: tl.constexpr, HAS_W: tl.constexpr, HAS_IDX: tl.constexpr,
                    SINGLE_ROUND: tl.constexpr, VEC: tl.constexpr, USE_PTX: tl.constexpr, USE_TIMER: tl.constexpr,
                    PMAX: tl.constexpr, SIG: tl.constexpr, ROWS: tl.constexpr, GATED: tl.constexpr = False,
                    MAPPED: tl.constexpr = False, XS: tl.constexpr = 0):
    """Streaming dispatch: push and receive in one launch, so that received rows are copied out while the
    pushes are still running.

    Programs ``[0, num_push)`` push (``_push_tokens`` with progress reports); the others receive, ``nrp =
    (programs - num_push) // world`` per source (spare ones exit): program ``num_push + s * nrp + q`` receives
    from source ``s``: for each of the sender's programs ``p = q, q + nrp, ...`` (the sender announces how many
    it runs), they wait for its ``begin`` word, then copy each newly reported stretch of rows ``[copied, end)``
    into the outputs (``_copy_rows``) until the ``end`` word carries the last-report bit. Received rows of
    source ``s`` with global position ``g`` go to output row ``prefix[s] + g``; rows at or past ``out_rows``,
    and rows past the ``cap`` of the source's region, are dropped: they were not sent (an overflowing
    ``num_worst_tokens``, reported on the host side).

    ``GATED`` (a gated dispatch: rows that another stream is still writing into ``x``, chunk after chunk): the
    tokens come in ``num_chunks`` chunks, ``[bounds[c], bounds[c + 1])`` (int32 ``[num_chunks + 1]``); every pushing
    program waits for chunk ``c``'s flag (int64 ``gate[c]``, released by whoever wrote the chunk's rows) to reach
    ``gate_value`` before it pushes its share of that chunk, chunk after chunk, each share reported in its own
    progress slot (``c * num_push + pid``, ``num_chunks * num_push`` slots announced): to the receivers each share is
    one more sending program, so the receive side is unchanged; each record's source token is its index within its
    chunk (the merged push of an exact-mode dispatch's chunks: each chunk's own handle reads it). A flag that does not
    come in time is recorded (``ERR_GATE_TIMEOUT``, slot = the chunk) and the program stops: it reports nothing more,
    so that the receivers of the chunks it did not push time out too (naming this rank) instead of taking rows that
    never came; nothing waits forever.

    ``MAPPED``: the received row that would go to output row ``g`` goes to row ``map[g]`` instead (int64 ``[M]``, a
    permutation: the caller's order of the rows, with no gather after the call). ``XS``: rows of ``x`` that many
    words apart (0: contiguous).

    Progress words (int64, this rank's heap, ``prog`` ``[R_src, PMAX + 2, 2]``; every word has one writer,
    the sender): ``[s, 0, :]`` = (programs of s, first position of s's round), ``[s, 2 + p, :]`` = (begin,
    end) of s's program p. Each word is ``epoch << 32 | value``: the epoch's low 32 bits are this round's
    barrier epoch (equal on every rank), compared exactly (``_await``), so words of other rounds never satisfy a
    wait, whatever the epoch's wrap, and the words need no reset (CUDA-graph replays work).

    A receiving program may wait for a pushing program of the same launch (its own rank's rows): on GPUs the
    kernel is launched cooperatively with a grid that fits the GPU at once (``launch_push``), so every pushing
    program runs whatever else holds SMs. The Triton interpreter runs programs in id order, pushers first."""
    pid = tl.program_id(0)
    tag = tl.load(epoch_ptr) << 32
    if pid < num_push:
        if GATED:
            c = 0
            came = tl.full([], 1, tl.int32)
            while (c < num_chunks) & (came != 0):
                seen = wait_after(gate_ptr + c, gate_value, timeout, err_ptr, _K_ERR_GATE, rank, rank, c, USE_PTX,
                                  USE_TIMER)
                came = ((seen - gate_value) >= 0).to(tl.int32)
                if came != 0:
                    _push_tokens(pid, num_push, c * num_push + pid, num_chunks * num_push, x_ptr, scales_ptr,
                                 s_stride_t, s_stride_c, topk_ptr, w_ptr, itr_ptr, pos_ptr, first_ptr, bases_ptr,
                                 area_off, meta_off, prog_off, tag, tl.load(bounds_ptr + c),
                                 tl.load(bounds_ptr + c + 1), cap, rank, world, XW, W, NS, K, E_LOCAL, R, R_POW2, TOK,
                                 BLOCK, BLOCK_S, BLOCK_K, HAS_SCALES, HAS_TOPK, HAS_W, SINGLE_ROUND, VEC, USE_PTX,
                                 PMAX, SIG, None, False, XS, 0, tl.load(bounds_ptr + c))
                c += 1
        else:
            _push_tokens(pid, num_push, pid, num_push, x_ptr, scales_ptr, s_stride_t, s_stride_c, topk_ptr, w_ptr,
                         itr_ptr, pos_ptr, first_ptr, bases_ptr, area_off, meta_off, prog_off, tag, t_begin, t_end,
                         cap, rank, world, XW, W, NS, K, E_LOCAL, R, R_POW2, TOK, BLOCK, BLOCK_S, BLOCK_K, HAS_SCALES,
                         HAS_TOPK, HAS_W, SINGLE_ROUND, VEC, USE_PTX, PMAX, SIG, None, False, XS)
    else:
        _receive_stream(pid, num_push, world, prog_ptr, tag, timeout, err_ptr, rank, prefix_ptr, out_rows, cap,
                        area_ptr, meta_ptr, out_x_ptr, out_scales_ptr, out_idx_ptr, out_w_ptr, out_src_ptr, out_src_ptr,
                        out_src_ptr, out_src_ptr, 0, XW, W, NS, K, E_LOCAL, ROWS, BLOCK_K, BLOCK_S, HAS_SCALES,
                        HAS_IDX, HAS_W, VEC, USE_PTX, USE_TIMER, PMAX, False, map_ptr, MAPPED)


@triton.jit
def _push_rows(x_ptr, w_ptr, base, area_off, w_off, m, a, ok, kcols, XW: tl.constexpr, K: tl.constexpr,
               BLOCK: tl.constexpr, HAS_W: tl.constexpr, VEC: tl.constexpr):
    """Store rows ``m`` of ``x [M, XW]`` (int32 words; and of ``w [M, K]`` with ``HAS_W``) where ``ok``, into
    rows ``a`` of the area at ``base + area_off`` (weights at ``base + w_off``) of one peer (``base``: a
    scalar heap base, or one per row)."""
    # no alignment hint on dst: the compiler then stores 4-byte words after a shared-memory layout change, which
    # this push does ~25% faster than 16-byte stores of the loaded layout (benchmarks/NOTES.md, row 43)
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


@triton.jit(do_not_specialize=["num_rows", "cap", "timeout"])
def combine_push_kernel(x_ptr, w_ptr, src_ptr, prefix_ptr, dst_row_ptr, bases_ptr, area_off, w_off, flags_off,
                        arrive_off, epoch_ptr, counter_ptr, err_ptr, num_rows, cap, rank, world, timeout,
                        XW: tl.constexpr, K: tl.constexpr, R_POW2: tl.constexpr, TOK: tl.constexpr,
                        BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, HAS_W: tl.constexpr, SINGLE_ROUND: tl.constexpr,
                        VEC: tl.constexpr, INTERLEAVE: tl.constexpr, USE_PTX: tl.constexpr,
                        USE_TIMER: tl.constexpr):
    """One round of the combine, between two barriers: send every received row back to its source rank
    (``src_ptr``: int32 ``[M, 2]`` source token, source rank; ``prefix_ptr``: int32 ``[2R]``, the first row
    and the row count of each source): single round, to row ``rank * cap + m - prefix[source]`` of the
    source's area; otherwise to ``dst_row[m]`` (-1: not in this round). With weights, its ``K`` top-k weights
    too. Rows from this rank itself stay where they are: the reduce reads them from ``x``
    (``epcomm.kernels.reduce.OwnRows``).

    Entry: every program passes the barrier of epoch ``*epoch_ptr + 1`` (``barrier_enter`` on the flags at
    ``flags_off``) before its first store, so no rank writes into an area whose owner may still read it (the
    previous reduce or dispatch). Exit: the last program to finish stores the epoch, releases it into every
    rank's ``arrive`` slot and waits until every rank released it here: when the kernel ends, every row of
    this round is in this rank's area (one launch instead of a barrier, the push and a wait). After a
    timeout a program stores nothing (the error record names the missing rank).

    Work split: ``INTERLEAVE=False``, program ``p`` pushes the ``p``-th contiguous slice of all rows (sorted by
    source, so each program writes to one or two peers); ``INTERLEAVE=True``, program ``p`` takes the
    ``p``-th slice of every remote source's rows and each step moves ``TOK`` rows to each peer in turn, program
    ``p`` starting ``p`` peers further on (every program writes to every peer, as the token-major dispatch push
    does, and at any moment the programs spread over the peers)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    kcols = tl.arange(0, BLOCK_K)
    toks = tl.arange(0, TOK)
    epoch = tl.load(epoch_ptr) + 1
    entered = barrier_enter(bases_ptr, flags_off, epoch, err_ptr, rank, world, timeout, _K_ERR_BARRIER, R_POW2,
                            USE_PTX, USE_TIMER) != 0
    if INTERLEAVE:
        rs = tl.arange(0, R_POW2)
        first = tl.load(prefix_ptr + rs, mask=rs < world, other=0)
        count = tl.load(prefix_ptr + world + rs, mask=(rs < world) & (rs != rank), other=0)
        per_s = tl.cdiv(tl.cdiv(count, nprog), TOK) * TOK
        lo_s = first + pid * per_s
        # within the rows there are and, in a single round, within the cap rows of this rank's region at the source
        # (the prefix of an overflowing num_worst_tokens dispatch counts rows that were never received)
        end_s = tl.minimum(first + count, num_rows)
        if SINGLE_ROUND:
            end_s = tl.minimum(end_s, first + cap)
        hi_s = tl.minimum(lo_s + per_s, end_s)
        steps = tl.where(entered, tl.max(tl.where(hi_s > lo_s, tl.cdiv(hi_s - lo_s, TOK), 0)), 0)
        j = 0
        while j < steps:
            d = 0
            while d < world - 1:
                s = (rank + 1 + (pid + d) % (world - 1)) % world  # programs start on different peers
                m = (pick(lo_s, rs, s) + j * TOK + toks).to(tl.int64)
                ok = m < pick(hi_s, rs, s)
                if SINGLE_ROUND:
                    a = rank * cap + m - pick(first, rs, s)
                else:
                    a = tl.load(dst_row_ptr + m, mask=ok, other=-1)
                    ok = ok & (a >= 0)
                _push_rows(x_ptr, w_ptr, tl.load(bases_ptr + s), area_off, w_off, m, a, ok, kcols, XW, K, BLOCK,
                           HAS_W, VEC)
                d += 1
            j += 1
    else:
        per = tl.cdiv(tl.cdiv(num_rows, nprog), TOK) * TOK
        lo = pid * per
        hi = tl.where(entered, tl.minimum(lo + per, num_rows), lo)
        m0 = lo
        while m0 < hi:
            m = (m0 + toks).to(tl.int64)
            live = m < hi
            s = tl.load(src_ptr + m * 2 + 1, mask=live, other=-1)
            ok = live & (s >= 0) & (s != rank)
            s = tl.where(ok, s, 0)
            if SINGLE_ROUND:
                a = rank * cap + m - tl.load(prefix_ptr + s, mask=ok, other=0)
            else:
                a = tl.load(dst_row_ptr + m, mask=ok, other=-1)
                ok = ok & (a >= 0)
            _push_rows(x_ptr, w_ptr, tl.load(bases_ptr + s, mask=ok, other=0), area_off, w_off, m, a, ok, kcols, XW,
                       K, BLOCK, HAS_W, VEC)
            m0 += TOK
    fence_sys(USE_PTX)
    tl.debug_barrier()
    if arrive_last(counter_ptr, nprog) != 0:  # every program has read the old epoch: store the new one
        tl.store(epoch_ptr, epoch)
        _publish(bases_ptr, bases_ptr, bases_ptr, 0, arrive_off, epoch_ptr, rank, world, R_POW2, False, False,
                 USE_PTX)
        wait_all_ge(tl.load(bases_ptr + rank), arrive_off, world, epoch, timeout, err_ptr, _K_ERR_DONE, rank, R_POW2,
                    USE_PTX, USE_TIMER)


# ---------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------
def pow2_block(v: int) -> int:
    """A power-of-two block size >= v (at least 16)."""
    return max(16, next_pow2(max(v, 1)))


def chunk_block(words: int, tokens_per_step: int, tile: int = 16384) -> int:
    """Columns (int32 words) a push kernel moves per load: the whole row (padded to a power of two) when
    ``tokens_per_step`` rows of it fit a ``tile``-word register tile, else the tile split over the rows.
    Each step issues one tile of loads before its stores: the more bytes per step, the less the push waits
    on load latency (measured: the combine push, one store per load, was load-latency bound with 4 KiB
    per row and step)."""
    return max(256, min(next_pow2(max(words, 1)), tile // max(tokens_per_step, 1)))


def launch_layout(topk_idx, num_experts: int, num_ranks: int, per_rank, per_expert, itr) -> None:
    """``layout_kernel`` over ``topk_idx [N, K]`` into zeroed ``per_rank``/``per_expert`` and ``itr``."""
    n, k = topk_idx.shape
    if n:
        import torch

        launch(layout_kernel, (cdiv(n, 64),), topk_idx, itr.view(torch.int8), per_rank, per_expert, n, num_experts,
               num_experts // num_ranks, K=k, R=num_ranks, BLOCK_T=64, BLOCK_K=pow2_block(k))


def launch_rows_in_place(counts, row_map, stride: int, col: int, L: int, D: int, chunk: int = 0, chunks: int = 1,
                         cstride: int = 0, summary=None, local: int = 0, e_local: int = 0) -> None:
    """``rows_in_place_kernel`` into ``row_map [M]`` int64 (launched for ``M = 0`` too: every rank compiles the same
    variant), and into ``summary [SUMMARY_HEAD + 3 L + e_local]`` int32 where given."""
    lp, dp = next_pow2(max(L, 2)), next_pow2(max(D, 2))
    block = max(16, min(1024, 16384 // (lp * dp)))
    m = row_map.numel()
    launch(rows_in_place_kernel, (max(1, cdiv(m, block)),), counts, row_map,
           summary if summary is not None else row_map, m, stride, cstride, col, chunk, chunks, L, D, local, e_local,
           LP=lp, DP=dp, BLOCK=block, EP=next_pow2(max(e_local, 2)), SUMMARY=summary is not None)


def summary_words(L: int, e_local: int) -> int:
    """Words of a domain-leg summary of ``L`` ranks with ``e_local`` experts each (``_summary_of``), rounded up to 4:
    several side by side each start 16-byte aligned (as a tensor of their own would)."""
    return -(-(SUMMARY_HEAD + 3 * L + max(e_local, 1)) // 4) * 4


def summary_per_expert(summary, L: int, e_local: int):
    """The rows a rank receives per local expert (``[e_local]`` int32, a view), from a domain-leg summary of ``L``
    ranks (``_summary_of``'s layout, the exchange kernel's)."""
    b = SUMMARY_HEAD + 3 * L
    return summary[b:b + e_local]


def launch_rows_merged(counts, row_map, back, summaries, stride: int, col: int, L: int, D: int, chunks: int,
                       cstride: int, local: int, e_local: int) -> None:
    """``rows_merged_kernel`` into ``row_map`` and ``back`` (``[M]`` int64 each) and ``summaries [chunks + 1,
    summary_words(L, e_local)]`` int32."""
    lp, dp = next_pow2(max(L, 2)), next_pow2(max(D, 2))
    block = max(16, min(1024, 16384 // (lp * dp)))
    m = row_map.numel()
    launch(rows_merged_kernel, (max(chunks + 1, cdiv(m, block)),), counts, row_map, back, summaries, m, stride,
           cstride, col, chunks, L, D, local, e_local, summaries.stride(0), LP=lp, DP=dp, BLOCK=block,
           EP=next_pow2(max(e_local, 2)))


def launch_merged_needs(counts, out, L: int, chunks: int, align: int) -> None:
    """``merged_needs_kernel`` of the domain's gathered counts ``counts [L * chunks, W]`` int32 (rows contiguous) into
    ``out [4]`` int32, on the current stream."""
    launch(merged_needs_kernel, (1,), counts, out, chunks, L, counts.stride(0), align, LP=next_pow2(max(L, 2)))


def launch_counts_gather_row(recv, row, L: int) -> None:
    """``counts_gather_row_kernel``: the row the count exchange gathers over the domain, ``row [C, V + 1 + D L]``
    int32, from what the rail peers sent, ``recv [D, C, V + 2]`` int32 (both contiguous), on the current stream."""
    D, C, V2 = recv.shape
    launch(counts_gather_row_kernel, (C,), recv, row, D, C, L, V2 - 2, BLOCK_V=next_pow2(max(V2 - 2, 2)),
           BLOCK_S=next_pow2(max(D * L, 2)))


def launch_counts_read(every, send, recv, bad, words, L: int, chunks: int, needs: bool, align: int) -> None:
    """``counts_read_kernel``: the words the host reads after the count exchange, into ``words`` int32 (``every.numel()
    + 2 D C + (4 if needs) + 1``), from the domain's gathered counts ``every [L * chunks, W]`` int32 (None: none, and
    no needs; the rail's words alone), the rail's ``send`` and ``recv [D, chunks, S]`` int32 (contiguous) and ``bad``
    (a one-word int32 tensor, or None: 0), on the current stream."""
    D = send.size(0)
    if every is None and needs:
        raise ValueError("launch_counts_read: the needs are made from the gathered counts: pass every")
    n = 0 if every is None else every.numel()
    block = 1024
    launch(counts_read_kernel, (max(1, cdiv(n, block)),), send if every is None else every, n,
           0 if every is None else every.stride(0), send, recv, send.stride(1), D,
           chunks, L, bad if bad is not None else words, int(bad is not None), int(needs), align, words,
           BLOCK=block, BLOCK_DC=next_pow2(max(D * chunks, 2)), LP=next_pow2(max(L, 2)))


def launch_forward_layout(records, r0: int, m: int, rows: int, starts, chunk: int, carried, idx, w, itr, pos, local,
                          sends, gathered, deferred, flags, bounds, value: int, e_local: int, e_dom: int,
                          tickets) -> None:
    """One chunk of a gated exact-mode dispatch's domain leg made ready on the current stream, once its rows have
    landed, by one launch of ``forward_layout_kernel``: its records unpacked over its ``rows`` rows of the merged input
    from ``r0`` (``m`` of them real; ``records [., W]`` int32, every chunk's, any row stride; ``starts [D, C]`` int32,
    any strides; the merged ``carried`` int32 view, ``idx`` int64, ``w`` int32 view or None, ``itr`` int8 view), then,
    by its last program, the positions (``pos`` merged, ``local [m, L]`` the chunk's own, ``sends [C, >= L]`` int32,
    ``gathered``: this rank's rows of the domain's gathered counts from chunk 0, ``[C, W]`` int32, its rows
    contiguous), the chunk's bounds into ``bounds [C + 1]`` int32 (the gated push's ``Gate.bounds``: no copy from the
    host) and ``value`` released into ``flags[chunk]``. ``tickets [>= C]`` int32, zero before the call's first chunk:
    each launch's programs count themselves in ``tickets[chunk]``."""
    k, ns = idx.size(1), carried.size(1) - 2
    L = itr.size(1)
    dummy = deferred
    launch(forward_layout_kernel, (max(1, cdiv(rows, 64)),), records, records.stride(0), r0, m, rows, starts, chunk,
           starts.stride(0), starts.stride(1), carried, idx, w if w is not None else dummy, itr, deferred, e_local,
           e_dom, pos, local, sends, sends.stride(0), gathered, gathered.stride(0), flags, bounds, value, tickets,
           NS=ns, K=k, L=L, LP=next_pow2(max(L, 2)), HAS_W=w is not None, BLOCK=64, BLOCK_S=pow2_block(ns),
           BLOCK_K=pow2_block(k), BLOCK_T=256, USE_PTX=itr.is_cuda, num_warps=4)


def launch_unpack_records(records, out_scales, out_idx, out_w, out_src, num_scales: int, num_topk: int) -> None:
    """Split received records ``[M, W]`` int32 (``record_words`` layout) into ``out_src [M, 2]`` int32, scales
    ``[M, num_scales]`` (4-byte dtype), ``out_idx [M, K]`` int64 and ``out_w [M, K]`` float32 (each None to
    skip), with one launch of ``dispatch_copyout_kernel`` in unpack-only mode."""
    import torch

    m, w = records.shape
    if not m:
        return
    dummy = records
    launch(dispatch_copyout_kernel, (max(1, min(4096, cdiv(m, 16))),),
        dummy, records, dummy, dummy, 0, dummy, dummy, dummy, dummy,
        out_scales.view(torch.int32) if out_scales is not None else dummy,
        out_idx if out_idx is not None else dummy, out_w if out_w is not None else dummy, out_src, m, m, 0, 1, 0,
        XW=1, W=w, NS=num_scales, K=max(num_topk, 1), R=1, R_POW2=2, ROWS=16, BLOCK=16,
        BLOCK_K=pow2_block(num_topk), BLOCK_S=pow2_block(num_scales), HAS_SCALES=out_scales is not None,
        HAS_TOPK=out_idx is not None, HAS_W=out_w is not None, VEC=False, USE_PTX=False, USE_TIMER=False,
        ONE_SIDED=False, num_warps=4)


@dataclass(frozen=True)
class ReceiveSide:
    """What the receiving programs of a streaming dispatch (``dispatch_kernel``) need: the local area
    (``area_rows [R * cap, XW]`` / ``meta_rows [R * cap, W]`` int32 views), the progress words ``prog`` (int64
    ``[R, PROGRESS_SLOTS + 2, 2]``, heap offset ``prog_off``), the error record, ``prefix [R]`` int32 (first
    output row of each source), the outputs (``out_x`` int32 view ``[M, XW]``, scales ``[M, NS]`` int32
    view, ``out_idx [M, K]`` int64, ``out_w [M, K]`` float32, ``out_src [M, 2]`` int32; None to skip),
    ``out_rows`` = M, ``timeout`` (``timeout_units``) and ``programs`` per source; ``row_map``: None, or int64
    ``[M]``, the output row of each row that would otherwise go to row ``g`` (``dispatch_kernel``'s ``MAPPED``)."""

    area_rows: object
    meta_rows: object
    prog: object
    prog_off: int
    err: object
    prefix: object
    out_x: object
    out_scales: object
    out_idx: object
    out_w: object
    out_src: object
    out_rows: int
    timeout: int
    programs: int
    row_map: object = None


PROGRESS_SLOTS = 256  # most pushing programs a streaming dispatch runs (progress words per source)
SIGNAL_TOKENS = 32  # a streaming push reports progress after about this many tokens


@dataclass(frozen=True)
class Gate:
    """The chunks of a gated dispatch (``dispatch_kernel`` with ``GATED``), whose input rows another stream is still
    writing: ``bounds`` int32 ``[chunks + 1]`` (device) token bounds of the chunks; ``flags`` int64 ``[>= chunks]``
    (device), chunk ``c``'s released to ``value`` once its rows are written."""

    bounds: object
    flags: object
    value: int
    chunks: int


def launch_push(*, x, scales, topk_idx, topk_weights, itr, pos, first, rows, bases, area_off: int, meta_off: int,
                hdr_off: int, arrive_off: int, epoch, counter, t_begin: int, t_end: int, cap: int, rank: int,
                world: int, num_experts: int, grid: int, tokens_per_step: int, use_ptx: bool, single_round: bool,
                publish: bool, dummy, receive: Optional[ReceiveSide] = None, gate: Optional[Gate] = None,
                limit: int = 0, row_words: int = 0) -> None:
    """``dispatch_push_kernel`` for rows of ``x [N, H]`` (any dtype; rows a multiple of 4 bytes), optional
    ``scales [N, S]`` (4-byte dtype, any strides), ``topk_idx``/``topk_weights [N, K]``; with ``receive``,
    the streaming ``dispatch_kernel`` instead (``grid`` pushing programs, at most ``PROGRESS_SLOTS``, plus
    ``receive.programs`` receiving programs per source, fewer where they would not fit the GPU at once: the
    kernel is launched cooperatively); with ``gate`` as well, gated (``Gate``: ``grid`` times its chunks at most
    ``PROGRESS_SLOTS``); ``limit``: the most programs the streaming launch may hold at once (0: as many as fit), so
    that other streams' kernels (a gated dispatch's writers) keep the rest of the GPU. The streaming kernel reads rows
    of ``x`` with any row stride (a multiple of 4 bytes; e.g. the first columns of wider rows), the others contiguous
    ones (``x`` is copied where it is not). ``row_words`` (the pushing kernel without ``publish``: a pack): each
    destination row that many int32 words (a multiple of 4: 16-byte rows for the vector stores), its row then its
    record at ``meta_off`` side by side; 0: rows and records in their own areas."""
    import torch

    n = x.size(0)
    xw = x.size(1) * x.element_size() // 4
    xs = x.stride(0) * x.element_size() // 4 if x.dim() == 2 and x.size(1) else xw
    if xs != xw and (receive is None or x.stride(1) != 1):
        x, xs = x.contiguous(), xw
    ns = scales.size(1) if scales is not None else 0
    k = topk_idx.size(1) if topk_idx is not None else 0
    has_w = topk_weights is not None
    x_words = x.view(torch.int32) if n else torch.empty(1, xw, dtype=torch.int32, device=x.device)
    push_args = (x_words, *scale_args(scales, dummy), topk_idx if k else dummy, topk_weights if has_w else dummy,
                 itr.view(torch.int8), pos, first)
    meta = _push_meta(xw, ns, k, has_w, num_experts, world, tokens_per_step, single_round, use_ptx, xs % 4 == 0)
    if row_words and (receive is not None or publish or row_words % 4 or row_words < xw + meta["W"]):
        raise ValueError(f"launch_push: row_words={row_words} packs rows of {xw} and records of {meta['W']} words side "
                         f"by side (a multiple of 4 at least their sum), without receive or publish")
    if receive is None:
        launch(dispatch_push_kernel, (grid,), *push_args, rows, bases, area_off, meta_off, hdr_off, arrive_off, epoch,
               counter, t_begin, t_end, cap, rank, world, PUBLISH=publish, DST_RS=row_words, **meta)
        return
    slots = grid * (gate.chunks if gate is not None else 1)
    if not 1 <= slots <= PROGRESS_SLOTS:
        raise ValueError(f"launch_push: {grid} pushing programs{f' in {gate.chunks} chunks' if gate else ''}; a "
                         f"streaming dispatch reports progress in 1..{PROGRESS_SLOTS} slots")
    rv = receive
    out = [t if t is not None else dummy for t in (rv.out_x, rv.out_scales, rv.out_idx, rv.out_w, rv.out_src)]
    gated = (gate.bounds, gate.flags, gate.value, gate.chunks) if gate is not None else (dummy, dummy, 0, 1)
    # receivers wait for the pushers of their launch: a cooperative launch, as many receivers as fit beside them
    launch(dispatch_kernel, _StreamingGrid(grid, world, rv.programs, limit),
        *push_args, bases, area_off, meta_off, rv.prog_off, epoch, t_begin, t_end, cap, rank, world, grid,
        rv.area_rows, rv.meta_rows, rv.prog, rv.err, rv.prefix, *out, rv.out_rows, rv.timeout, *gated,
        rv.row_map if rv.row_map is not None else dummy, HAS_IDX=rv.out_idx is not None, USE_TIMER=use_ptx,
        PMAX=PROGRESS_SLOTS, SIG=max(1, SIGNAL_TOKENS // tokens_per_step), ROWS=4,
        GATED=gate is not None, MAPPED=rv.row_map is not None, XS=xs if xs != xw else 0,
        **(_COOPERATIVE if use_ptx else {}), **meta)


def scale_args(scales, dummy) -> tuple:
    """``(scales as int32 words or dummy, row stride, column stride)``: ``scales`` as the push kernels take them
    (``(dummy, 0, 0)`` without scales). Only strides Triton compiles one variant for reach a kernel: column-major scales
    (DeepEP's layout, whose column stride is the token count: Triton specialises on it being 1 or a multiple of 16)
    are copied to rows first; a stride that is never used and that torch may report as anything (one scale per
    token: its column's; no token or one: a row's reported as 0) takes a contiguous tensor's, so that such calls (an
    empty rank, one scale per token) launch the variant of the others. A new variant would be compiled and loaded in
    the middle of a call, where loading waits for the device (``transports.faults``). A view's row stride (the rows
    of a wider buffer) is kept."""
    import torch

    if scales is None or not scales.size(1):
        return dummy, 0, 0
    ns = scales.size(1)
    if ns > 1 and scales.stride(1) != 1 and scales.size(0) > 1:
        scales = scales.contiguous()
    s1 = scales.stride(1) if ns > 1 else 1
    return scales.view(torch.int32), (scales.stride(0) if scales.size(0) > 1 or scales.stride(0) else ns * s1), s1


@functools.lru_cache(maxsize=256)
def _push_meta(xw: int, ns: int, k: int, has_w: bool, num_experts: int, world: int, tokens_per_step: int,
               single_round: bool, use_ptx: bool, stride_vec: bool = True) -> dict:
    """The push kernels' constexprs and options for a call's shape (the same dict for every call of it: launches
    read it and never change it)."""
    return dict(XW=xw, W=record_words(ns, k, has_w), NS=ns, K=max(k, 1), E_LOCAL=max(1, num_experts // world), R=world,
                R_POW2=max(2, next_pow2(world)), TOK=tokens_per_step, BLOCK=chunk_block(xw, tokens_per_step),
                BLOCK_S=pow2_block(ns), BLOCK_K=pow2_block(k), HAS_SCALES=ns > 0, HAS_TOPK=k > 0, HAS_W=has_w,
                SINGLE_ROUND=single_round, VEC=xw % 4 == 0 and stride_vec, USE_PTX=use_ptx, num_warps=PUSH_WARPS)


# a streaming dispatch on GPUs: all programs resident at once, 2 per SM (uncapped, ptxas gives it 121-128 registers)
_COOPERATIVE = dict(launch_cooperative_grid=True, maxnreg=128)


@dataclass(frozen=True)
class _StreamingGrid:
    """The grid of a streaming dispatch (``dispatch_kernel``) as a function of the programs the GPU holds at once
    (``resident``, None: no limit): ``push`` pushing programs and up to ``recv`` receiving programs per source, as
    many as fit beside the pushers (the kernel takes its receivers per source from the grid), in at most ``limit``
    programs where given (a gated dispatch, whose input's writers need the rest of the GPU)."""

    push: int
    world: int
    recv: int
    limit: int = 0

    def __call__(self, resident: Optional[int]) -> tuple:
        if self.limit:
            resident = self.limit if resident is None else min(resident, self.limit)
        recv = self.recv if resident is None else min(self.recv, (resident - self.push) // self.world)
        if recv < 1:
            raise ValueError(f"Buffer.dispatch: {self.push} pushing programs and one receiving program per rank "
                             f"({self.world}) do not fit the GPU at once (it holds {resident} programs of the "
                             f"dispatch kernel); pass a smaller Config.num_sms, or Config(strict_sms=True)")
        return (self.push + self.world * recv,)
