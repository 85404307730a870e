"""The oracle: every rank's expected outputs, computed in one process with plain torch.

Every transport is tested against these functions. They are written to be obviously right rather than fast
(Python loops over ranks and experts, vectorised over tokens). Conventions they define:

* normal dispatch: a token travels once to every rank that holds one of its experts; rank ``r`` receives
  the tokens of rank 0, then rank 1, ..., each group in source-token order. ``recv_topk_idx`` holds local
  expert ids (``global - r * E_local``) and -1 for experts of other ranks, whose weights are 0.
* normal combine: for every token, the rows the ranks send back are converted to float32 and added in
  ascending rank order starting from +0.0, then ``bias[0]`` and ``bias[1]`` (float32), then one cast to the
  output dtype. Top-k weights are summed the same way. Bit-exact for any transport that adds in that order.
* low-latency dispatch: one row per selected (token, slot); rank ``r``'s expert ``e`` receives the rows of
  rank 0, then rank 1, ..., each group ordered by (source token, slot). FP8 rows are cast per token by
  ``epcomm.fp8.per_token_cast_to_fp8`` on the sender. Across domains (``local_size``) the groups come in the order
  (source's local index, source's domain) instead; ``src_rank`` / ``src_idx`` are the true source rank and token.
* low-latency combine: ``sum over slots k ascending of  w[t, k] * float32(y)`` with the product rounded to
  float32 before the add (no fused multiply-add), starting from +0.0, then one cast to bfloat16.
* expert-major dispatch (``layout="expert_major"``): one row per received (token, slot) whose expert is local;
  local expert ``e``'s rows form a segment that starts at the sum of the earlier experts' counts, each rounded
  up to ``expert_alignment``, ordered by source rank, source token, slot, followed by zero rows (padding) up
  to the aligned count.
* expert-major combine: on every rank, for every token it received, the float32 sum in slot order, from +0.0,
  of ``w[row] * float32(y[row])`` (product rounded first) over the token's rows there, cast once to the rows'
  dtype (the per-rank partial); then the normal combine of those partials (rank order, biases, one cast).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..fp8 import per_token_cast_to_fp8

__all__ = ["Layout", "DispatchOut", "LowLatencyOut", "ExpertMajorOut", "dispatch_layout", "dispatch", "combine",
           "expert_major_dispatch", "expert_major_combine", "low_latency_dispatch", "low_latency_combine",
           "align_up"]


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class Layout:
    """``num_tokens_per_rank [R]`` int32, ``num_tokens_per_expert [E]`` int32, ``is_token_in_rank [N, R]``
    bool."""

    num_tokens_per_rank: torch.Tensor
    num_tokens_per_expert: torch.Tensor
    is_token_in_rank: torch.Tensor


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> Layout:
    """Layout of one rank's ``topk_idx [N, K]`` (-1 = no selection)."""
    experts_per_rank = num_experts // num_ranks
    n = topk_idx.size(0)
    per_expert = torch.zeros(num_experts, dtype=torch.int32)
    in_rank = torch.zeros(n, num_ranks, dtype=torch.bool)
    idx = topk_idx.cpu().long()
    for k in range(idx.size(1)):
        col = idx[:, k]
        valid = col >= 0
        per_expert += torch.bincount(col[valid], minlength=num_experts).to(torch.int32)
        rows = torch.nonzero(valid).flatten()
        in_rank[rows, col[valid] // experts_per_rank] = True
    return Layout(in_rank.sum(0).to(torch.int32), per_expert, in_rank)


@dataclass(frozen=True)
class DispatchOut:
    """What rank ``r`` receives in a normal dispatch. ``recv_x [M, H]`` (and ``recv_scales [M, S]`` for
    FP8), ``recv_topk_idx [M, K]`` int64 local ids, ``recv_topk_weights [M, K]`` float32,
    ``num_recv_tokens_per_expert [E_local]`` (aligned), ``recv_src_rank``/``recv_src_idx [M]`` int64."""

    recv_x: torch.Tensor
    recv_scales: Optional[torch.Tensor]
    recv_topk_idx: Optional[torch.Tensor]
    recv_topk_weights: Optional[torch.Tensor]
    num_recv_tokens_per_expert: list
    recv_src_rank: torch.Tensor
    recv_src_idx: torch.Tensor
    # internode: (inter-domain leg output, domain leg output, ranks per domain, the order that sorts the domain leg's
    # rows by source rank and token)
    hierarchy: Optional[tuple] = None


def dispatch(xs: Sequence[torch.Tensor], topk_idxs: Sequence[torch.Tensor], num_experts: int,
             topk_weights: Optional[Sequence[torch.Tensor]] = None,
             x_scales: Optional[Sequence[torch.Tensor]] = None, expert_alignment: int = 1,
             local_size: Optional[int] = None) -> list[DispatchOut]:
    """Every rank's normal-dispatch result from every rank's ``x [N_s, H]``, ``topk_idx [N_s, K]``.
    ``local_size`` < the number of ranks: the hierarchical path across domains of that many ranks (module
    docstring)."""
    num_ranks = len(xs)
    if local_size is not None and local_size < num_ranks:
        return _hierarchical_dispatch(xs, topk_idxs, num_experts, topk_weights, x_scales, expert_alignment,
                                      local_size)
    e_local = num_experts // num_ranks
    layouts = [dispatch_layout(t, num_experts, num_ranks) for t in topk_idxs]
    outs = []
    for r in range(num_ranks):
        xr, sr, ir, wr, src_rank, src_idx = [], [], [], [], [], []
        for s in range(num_ranks):
            rows = torch.nonzero(layouts[s].is_token_in_rank[:, r]).flatten()
            xr.append(xs[s].cpu()[rows])
            if x_scales is not None:
                sr.append(x_scales[s].cpu()[rows])
            idx = topk_idxs[s].cpu().long()[rows]
            local = idx - r * e_local
            mine = (idx >= 0) & (local >= 0) & (local < e_local)
            ir.append(torch.where(mine, local, torch.full_like(local, -1)))
            if topk_weights is not None:
                w = topk_weights[s].cpu().float()[rows]
                wr.append(torch.where(mine, w, torch.zeros_like(w)))
            src_rank.append(torch.full((rows.numel(),), s, dtype=torch.int64))
            src_idx.append(rows.to(torch.int64))
        recv_idx = torch.cat(ir)
        counts = [int((recv_idx == e).sum()) for e in range(e_local)]
        outs.append(DispatchOut(
            recv_x=torch.cat(xr), recv_scales=torch.cat(sr) if x_scales is not None else None,
            recv_topk_idx=recv_idx, recv_topk_weights=torch.cat(wr) if topk_weights is not None else None,
            num_recv_tokens_per_expert=[align_up(c, expert_alignment) for c in counts],
            recv_src_rank=torch.cat(src_rank), recv_src_idx=torch.cat(src_idx)))
    return outs


def combine(recv_xs: Sequence[torch.Tensor], dispatched: Sequence[DispatchOut], num_tokens: Sequence[int],
            recv_topk_weights: Optional[Sequence[torch.Tensor]] = None,
            biases: Optional[Sequence[Sequence[torch.Tensor]]] = None,
            out_dtype: Optional[torch.dtype] = None) -> list[tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """Every rank's normal-combine result. ``recv_xs[r] [M_r, H]`` are the rows rank ``r`` sends back
    (aligned with ``dispatched[r]``); ``biases[s]`` is a list of 0-2 ``[N_s, H]`` tensors for rank ``s``.
    Outputs of a hierarchical ``dispatch`` are combined the hierarchical way (module docstring)."""
    num_ranks = len(recv_xs)
    hidden = recv_xs[0].size(1)
    out_dtype = out_dtype or recv_xs[0].dtype
    if dispatched[0].hierarchy is not None:
        return _hierarchical_combine(recv_xs, dispatched, num_tokens, recv_topk_weights, biases, out_dtype)
    outs = []
    for s in range(num_ranks):
        acc = torch.zeros(num_tokens[s], hidden, dtype=torch.float32)
        wacc = None
        if recv_topk_weights is not None:
            wacc = torch.zeros(num_tokens[s], recv_topk_weights[0].size(1), dtype=torch.float32)
        for r in range(num_ranks):
            sel = dispatched[r].recv_src_rank == s
            rows = dispatched[r].recv_src_idx[sel]
            acc[rows] += recv_xs[r].cpu()[sel].float()
            if wacc is not None:
                wacc[rows] += recv_topk_weights[r].cpu()[sel].float()
        for b in (biases[s] if biases is not None else ()):
            acc += b.cpu().float()
        outs.append((acc.to(out_dtype), wacc))
    return outs


@dataclass(frozen=True)
class ExpertMajorOut:
    """What rank ``r`` receives in an expert-major dispatch. ``recv_x [rows, H]`` (zero padding rows; and
    ``recv_scales [rows, S]`` for FP8), ``row_weights [rows]`` float32 (0 on padding; None without weights),
    ``row_recv``/``row_slot``/``row_src_rank``/``row_src_idx [rows]`` int64 (the rank-major received row, the
    slot, the source rank and token of every row; -1 on padding), ``offsets [E_local]`` int32 (segment ends),
    ``counts`` (pairs per local expert), ``pair_row [M, K]`` int64 (row of every (received token, slot), -1 if
    not local) and the rank-major result ``rank_major``."""

    recv_x: torch.Tensor
    recv_scales: Optional[torch.Tensor]
    row_weights: Optional[torch.Tensor]
    row_recv: torch.Tensor
    row_slot: torch.Tensor
    row_src_rank: torch.Tensor
    row_src_idx: torch.Tensor
    offsets: torch.Tensor
    counts: list
    pair_row: torch.Tensor
    rank_major: DispatchOut


def expert_major_dispatch(xs: Sequence[torch.Tensor], topk_idxs: Sequence[torch.Tensor], num_experts: int,
                          topk_weights: Optional[Sequence[torch.Tensor]] = None,
                          x_scales: Optional[Sequence[torch.Tensor]] = None,
                          expert_alignment: int = 1, local_size: Optional[int] = None) -> list[ExpertMajorOut]:
    """Every rank's expert-major dispatch result (the exact row count: no ``num_worst_tokens`` tail); with
    ``local_size`` from the hierarchical dispatch (the same rows; its combine adds the domains' partials)."""
    outs = []
    for d in dispatch(xs, topk_idxs, num_experts, topk_weights, x_scales, local_size=local_size):
        idx = d.recv_topk_idx
        m, k = idx.shape
        e_local = num_experts // len(xs)
        pair_row = torch.full((m, k), -1, dtype=torch.int64)
        start = 0
        segs = []
        for e in range(e_local):
            mm, kk = torch.nonzero(idx == e, as_tuple=True)  # row-major: (received token, slot) order
            pair_row[mm, kk] = start + torch.arange(mm.numel())
            segs.append((start, mm, kk))
            start += align_up(mm.numel(), expert_alignment)
        rows = start
        row_recv = torch.full((rows,), -1, dtype=torch.int64)
        row_slot = torch.full((rows,), -1, dtype=torch.int64)
        for s0, mm, kk in segs:
            row_recv[s0:s0 + mm.numel()] = mm
            row_slot[s0:s0 + mm.numel()] = kk
        real = row_recv >= 0
        safe = row_recv.clamp(min=0)

        def take(t):  # rows of t (any dtype, 2-D) into their expert-major rows, zeros elsewhere
            b = t.contiguous().view(torch.uint8)
            out = torch.zeros(rows, b.size(1), dtype=torch.uint8)
            out[real] = b[safe[real]]
            return out.view(t.dtype)

        row_w = None
        if d.recv_topk_weights is not None:
            row_w = torch.zeros(rows, dtype=torch.float32)
            row_w[real] = d.recv_topk_weights[safe[real], row_slot[real]]
        counts = [int(mm.numel()) for _, mm, _ in segs]
        offsets = torch.tensor([s0 + align_up(c, expert_alignment) for (s0, _, _), c in zip(segs, counts)],
                               dtype=torch.int32)
        outs.append(ExpertMajorOut(
            recv_x=take(d.recv_x), recv_scales=take(d.recv_scales) if d.recv_scales is not None else None,
            row_weights=row_w, row_recv=row_recv, row_slot=row_slot,
            row_src_rank=torch.where(real, d.recv_src_rank[safe], -1),
            row_src_idx=torch.where(real, d.recv_src_idx[safe], -1), offsets=offsets, counts=counts,
            pair_row=pair_row, rank_major=d))
    return outs


def expert_major_combine(ys: Sequence[torch.Tensor], dispatched: Sequence[ExpertMajorOut], num_tokens: Sequence[int],
                         row_weights: Optional[Sequence[Optional[torch.Tensor]]] = None,
                         row_values: Optional[Sequence[torch.Tensor]] = None,
                         biases: Optional[Sequence[Sequence[torch.Tensor]]] = None,
                         out_dtype: Optional[torch.dtype] = None) -> list[tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """Every rank's expert-major combine. ``ys[r] [rows_r, H]`` are rank ``r``'s expert outputs (in
    ``dispatched[r]`` row order; padding rows are not read); ``row_weights[r] [rows_r]`` the weights (None:
    unweighted); ``row_values[r] [rows_r]`` float32 values returned to their (token, slot) (the combined
    ``[N, K]`` values are the second item)."""
    partials, values = [], []
    for r, (y, d) in enumerate(zip(ys, dispatched)):
        m, k = d.pair_row.shape
        acc = torch.zeros(m, y.size(1), dtype=torch.float32)
        w = row_weights[r] if row_weights is not None else None
        for kk in range(k):
            rows = d.pair_row[:, kk]
            sel = rows >= 0
            v = y.cpu()[rows[sel]].float()
            if w is not None:
                v = w.cpu().float()[rows[sel]].unsqueeze(1) * v
            acc[sel] = acc[sel] + v
        partials.append(acc.to(y.dtype))
        if row_values is not None:
            val = torch.zeros(m, k, dtype=torch.float32)
            sel = d.pair_row >= 0
            val[sel] = row_values[r].cpu().float()[d.pair_row[sel]]
            values.append(val)
    return combine(partials, [d.rank_major for d in dispatched], num_tokens, values if row_values is not None else None,
                   biases, out_dtype)


@dataclass(frozen=True)
class LowLatencyOut:
    """What rank ``r`` receives in a low-latency dispatch: for each local expert ``e``, ``count[e]`` rows
    ``x[e] [count[e], H]`` (bf16, or fp8 with ``scales[e] [count[e], H/128]``) and their sources
    ``src_rank[e]``, ``src_idx[e]`` (int64: global source rank and its token). Each source rank's rows of an
    expert are one block; ``source_order`` lists the source ranks in the order of their blocks.
    """

    count: list
    x: list
    scales: list
    src_rank: list
    src_idx: list
    hierarchy: Optional[tuple] = None  # internode: (inter-domain leg output, ranks per domain, domain leg output)
    source_order: tuple = ()


def low_latency_dispatch(xs: Sequence[torch.Tensor], topk_idxs: Sequence[torch.Tensor], num_experts: int,
                         use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                         local_size: Optional[int] = None) -> list[LowLatencyOut]:
    """Every rank's low-latency dispatch result (only the valid rows of each expert). ``local_size`` < the
    number of ranks: the hierarchical path (module docstring): each rank's expert rows come from its domain's
    forwarding ranks in local-index order, each forwarding rank's in (source domain, token) order, so the source
    blocks are in the order (local index, domain). The FP8 cast happens here where the rows are forwarded (the
    transport casts at the source: the same function, so the same bits)."""
    num_ranks = len(xs)
    if local_size is not None and local_size < num_ranks:
        L = local_size
        D = _domains(num_ranks, L)
        rail = _rail_dispatch(xs, topk_idxs, num_experts, L)
        outs: list = [None] * num_ranks
        for d in range(D):
            members = list(range(d * L, (d + 1) * L))
            inner = low_latency_dispatch([rail[r].recv_x for r in members], [rail[r].recv_topk_idx for r in members],
                                         num_experts // D, use_fp8, round_scale, use_ue8m0)
            for l, o in enumerate(inner):
                # the forwarding rank (local index lp) and its row i -> the global source rank and token
                pairs = [list(zip(sr.tolist(), si.tolist())) for sr, si in zip(o.src_rank, o.src_idx)]
                src_rank = [torch.tensor([int(rail[d * L + lp].recv_src_rank[i]) * L + lp for lp, i in pe],
                                         dtype=torch.int64) for pe in pairs]
                src_idx = [torch.tensor([int(rail[d * L + lp].recv_src_idx[i]) for lp, i in pe], dtype=torch.int64)
                           for pe in pairs]
                outs[d * L + l] = LowLatencyOut(o.count, o.x, o.scales, src_rank, src_idx, (rail[d * L + l], L, o),
                                                tuple(s * L + lp for lp in range(L) for s in range(D)))
        return outs
    e_local = num_experts // num_ranks
    casted = []
    for x in xs:
        x = x.cpu()
        casted.append(per_token_cast_to_fp8(x, round_scale, use_ue8m0) if use_fp8 else (x, None))
    outs = []
    for r in range(num_ranks):
        count, xe, se, sre, sie = [], [], [], [], []
        for e in range(e_local):
            g = r * e_local + e
            rows_x, rows_s, src_r, src_i = [], [], [], []
            for s in range(num_ranks):
                idx = topk_idxs[s].cpu().long()
                tok, _slot = torch.nonzero(idx == g, as_tuple=True)  # row-major: (token, slot) order
                rows_x.append(casted[s][0][tok])
                if casted[s][1] is not None:
                    rows_s.append(casted[s][1][tok])
                src_r.append(torch.full((tok.numel(),), s, dtype=torch.int64))
                src_i.append(tok.to(torch.int64))
            count.append(sum(t.numel() for t in src_i))
            xe.append(torch.cat(rows_x))
            se.append(torch.cat(rows_s) if rows_s else None)
            sre.append(torch.cat(src_r))
            sie.append(torch.cat(src_i))
        outs.append(LowLatencyOut(count, xe, se, sre, sie, None, tuple(range(num_ranks))))
    return outs


def low_latency_combine(ys: Sequence[Sequence[torch.Tensor]], dispatched: Sequence[LowLatencyOut],
                        topk_idxs: Sequence[torch.Tensor], topk_weights: Sequence[torch.Tensor],
                        num_experts: int, out_dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    """Every rank's low-latency combine. ``ys[r][e] [count, H]`` are rank ``r``'s expert-``e`` outputs for
    the rows it received (in ``dispatched[r]`` order). Expert ids within a token must be distinct. Outputs of a
    hierarchical dispatch: each forwarding rank combines its domain's rows (``out_dtype`` partials), then every
    source adds its domains' partials in FP32 in domain order and casts once."""
    num_ranks = len(ys)
    if dispatched[0].hierarchy is not None:
        L = dispatched[0].hierarchy[1]
        D = _domains(num_ranks, L)
        rail = [d.hierarchy[0] for d in dispatched]
        weights = _rail_dispatch(topk_weights, topk_idxs, num_experts, L)  # every token's weights at its forwarders
        partial: list = [None] * num_ranks
        for d in range(D):
            members = list(range(d * L, (d + 1) * L))
            inner = low_latency_combine([ys[r] for r in members], [dispatched[r].hierarchy[2] for r in members],
                                        [rail[r].recv_topk_idx for r in members],
                                        [weights[r].recv_x for r in members], num_experts // D, out_dtype)
            for l, p in enumerate(inner):
                partial[d * L + l] = p
        out: list = [None] * num_ranks
        for l in range(L):
            members = [d * L + l for d in range(D)]
            for d, (o, _) in enumerate(combine([partial[r] for r in members], [rail[r] for r in members],
                                               [int(topk_idxs[r].size(0)) for r in members], out_dtype=out_dtype)):
                out[d * L + l] = o
        return out
    e_local = num_experts // num_ranks
    hidden = next(y.size(1) for yr in ys for y in yr)
    max_tokens = max(int(t.size(0)) for t in topk_idxs)
    # row_of[r][e, s, t]: the row of (source rank s, token t) in rank r's expert e, -1 if none
    row_of = []
    for r in range(num_ranks):
        m = torch.full((e_local, num_ranks, max(max_tokens, 1)), -1, dtype=torch.int64)
        for e in range(e_local):
            d = dispatched[r]
            m[e, d.src_rank[e], d.src_idx[e]] = torch.arange(d.count[e])
        row_of.append(m)
    outs = []
    for s in range(num_ranks):
        idx = topk_idxs[s].cpu().long()
        w = topk_weights[s].cpu().float()
        n = idx.size(0)
        acc = torch.zeros(n, hidden, dtype=torch.float32)
        tokens = torch.arange(n)
        for k in range(idx.size(1)):
            g = idx[:, k]
            for r in range(num_ranks):
                sel = (g >= 0) & (g // e_local == r)
                if not bool(sel.any()):
                    continue
                e = g[sel] % e_local
                rows = row_of[r][e, s, tokens[sel]]
                y = torch.stack([ys[r][int(ei)][int(ri)] for ei, ri in zip(e, rows)]).cpu().float()
                prod = w[sel, k].unsqueeze(1) * y
                acc[sel] = acc[sel] + prod
        outs.append(acc.to(out_dtype))
    return outs


# ------------------------------------------------------------------------------------------------ internode
def _domains(num_ranks: int, local_size: int) -> int:
    if local_size < 1 or num_ranks % local_size:
        raise ValueError(f"reference: local_size={local_size} must divide the {num_ranks} ranks")
    return num_ranks // local_size


def _rail_dispatch(xs, topk_idxs, num_experts, L, topk_weights=None, x_scales=None):
    """The inter-domain leg: per local index, a dispatch among that index's ranks (one per domain), each domain's
    experts counting as its rank's."""
    num_ranks = len(xs)
    D = _domains(num_ranks, L)
    out: list = [None] * num_ranks
    for l in range(L):
        members = [d * L + l for d in range(D)]
        pick = (lambda seq: None if seq is None else [seq[r] for r in members])
        for d, o in enumerate(dispatch(pick(xs), pick(topk_idxs), num_experts, pick(topk_weights), pick(x_scales))):
            out[d * L + l] = o
    return out


def _hierarchical_dispatch(xs, topk_idxs, num_experts, topk_weights, x_scales, expert_alignment, local_size):
    """The inter-domain leg (a dispatch among the ranks with one local index, each domain's experts counting as
    its rail peer's) and then, in every domain, a dispatch of the rows its ranks received (domain-local expert
    ids) among the domain's ranks."""
    num_ranks, L = len(xs), local_size
    D = _domains(num_ranks, L)
    rail = _rail_dispatch(xs, topk_idxs, num_experts, L, topk_weights, x_scales)
    outs: list = [None] * num_ranks
    for d in range(D):
        members = list(range(d * L, (d + 1) * L))
        fwd = [rail[r] for r in members]
        inner = dispatch([f.recv_x for f in fwd], [f.recv_topk_idx for f in fwd], num_experts // D,
                         [f.recv_topk_weights for f in fwd] if topk_weights is not None else None,
                         [f.recv_scales for f in fwd] if x_scales is not None else None, expert_alignment)
        for l, o in enumerate(inner):
            src_rank = torch.tensor([int(fwd[lp].recv_src_rank[i]) * L + lp
                                     for lp, i in zip(o.recv_src_rank.tolist(), o.recv_src_idx.tolist())],
                                    dtype=torch.int64)
            src_idx = torch.tensor([int(fwd[lp].recv_src_idx[i])
                                    for lp, i in zip(o.recv_src_rank.tolist(), o.recv_src_idx.tolist())],
                                   dtype=torch.int64)
            # the rows in the order of the intranode path: by source rank, then source token
            order = torch.argsort(src_rank * (1 << 32) + src_idx)
            pick = (lambda t: None if t is None else t[order])
            outs[d * L + l] = DispatchOut(o.recv_x[order], pick(o.recv_scales), pick(o.recv_topk_idx),
                                          pick(o.recv_topk_weights), o.num_recv_tokens_per_expert, src_rank[order],
                                          src_idx[order], (rail[d * L + l], o, L, order))
    return outs


def _hierarchical_combine(recv_xs, dispatched, num_tokens, recv_topk_weights, biases, out_dtype):
    """Each domain first adds the rows of its ranks per forwarded row (a combine within the domain, FP32 in rank
    order, cast once to ``out_dtype``: the partial that crosses between domains), then every source adds its
    domains' partials (FP32 in domain order), the biases, and casts once."""
    num_ranks = len(recv_xs)
    rail = [d.hierarchy[0] for d in dispatched]
    inner = [d.hierarchy[1] for d in dispatched]
    L = dispatched[0].hierarchy[2]
    D = num_ranks // L
    partial: list = [None] * num_ranks
    partial_w: list = [None] * num_ranks
    for d in range(D):
        members = list(range(d * L, (d + 1) * L))
        def legs_order(t, r):  # the domain leg's row order from the intranode order
            out = torch.empty_like(t)
            out[dispatched[r].hierarchy[3]] = t
            return out

        outs = combine([legs_order(recv_xs[r], r) for r in members], [inner[r] for r in members],
                       [rail[r].recv_x.size(0) for r in members],
                       [legs_order(recv_topk_weights[r], r) for r in members] if recv_topk_weights is not None
                       else None, None, out_dtype)
        for l, (p, pw) in enumerate(outs):
            partial[d * L + l], partial_w[d * L + l] = p, pw
    result: list = [None] * num_ranks
    for l in range(L):
        members = [d * L + l for d in range(D)]
        outs = combine([partial[r] for r in members], [rail[r] for r in members], [num_tokens[r] for r in members],
                       [partial_w[r] for r in members] if recv_topk_weights is not None else None,
                       [biases[r] for r in members] if biases is not None else None, out_dtype)
        for d, o in enumerate(outs):
            result[d * L + l] = o
    return result

