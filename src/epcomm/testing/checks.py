"""Correctness cases run inside a worker: a Buffer against the reference, every rank checking its own
outputs (each rank rebuilds all ranks' inputs from the seed). Used by the tests, the demo and the GPU
script, so the CPU and GPU suites check the same things."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

import torch

from .. import reference
from ..fp8 import per_token_cast_back, per_token_cast_to_fp8
from .routing import make_inputs

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16, "fp8": torch.bfloat16}
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    """Bit-exact equality (dtype, shape and every bit), CPU copies compared."""
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.numel() == 0:
        return True
    view = _INT_VIEW[a.element_size()]
    return torch.equal(a.view(view), b.view(view))


def describe_mismatch(name: str, got: Optional[torch.Tensor], want: Optional[torch.Tensor]) -> str:
    if got is None or want is None:
        return f"{name}: got {'None' if got is None else 'a tensor'}, want {'None' if want is None else 'a tensor'}"
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{name}: got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"
    g, w = got.detach().cpu().float(), want.detach().cpu().float()
    bad = ~((g == w) | (g.isnan() & w.isnan()))
    first = tuple(int(i) for i in torch.nonzero(bad)[0]) if bad.any() else None
    return f"{name}: {int(bad.sum())} of {g.numel()} elements differ (first at {first})"


@dataclass(frozen=True)
class NormalCase:
    """One normal dispatch -> combine case. ``num_tokens`` is per rank (an int, or a tuple repeated over
    the ranks)."""

    num_tokens: object = 64
    hidden: int = 256
    num_experts: int = 8
    topk: int = 2
    routing: str = "uniform"
    dtype: str = "bf16"  # bf16 | fp8 | fp32 | fp16
    expert_alignment: int = 1
    worst: bool = False  # num_worst_tokens = the largest possible receive count
    bias: int = 0  # number of bias tensors (0, 1, 2)
    column_major_scales: bool = False
    with_topk: bool = True
    overlap: bool = False  # previous_event + async_finish: the calls run on the communication stream
    strict_sms: Optional[bool] = None  # Config.strict_sms of the dispatch and the combine
    seed: int = 0

    def label(self) -> str:
        return (f"N={self.num_tokens} H={self.hidden} E={self.num_experts} K={self.topk} {self.routing} "
                f"{self.dtype} align={self.expert_alignment} worst={self.worst} bias={self.bias}"
                + (" overlap" if self.overlap else ""))


@dataclass
class CaseResult:
    label: str
    failures: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def expect(self, name: str, got, want) -> None:
        if not same_bits(got, want):
            self.failures.append(describe_mismatch(name, got, want))

    def expect_eq(self, name: str, got, want) -> None:
        if got != want:
            self.failures.append(f"{name}: got {got!r}, want {want!r}")


def _combine_input(rows: torch.Tensor, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """A deterministic stand-in for the experts: scale the received rows by a per-rank factor."""
    return (rows.float() * (1.0 + 0.5 * rank)).to(dtype)


def _worst(wanted: bool, most: int, local: int, inputs) -> int:
    """The ``num_worst_tokens`` a case passes: 0, or a few rows more than the most any rank receives (``most``);
    across domains (``local`` ranks each, fewer than the group) at least ``R * N``, since it then also bounds each
    rank's tokens by ``num_worst_tokens // R``."""
    if not wanted:
        return 0
    worst = max(most, 1) + 3
    return max(worst, len(inputs) * max(i.x.size(0) for i in inputs)) if local < len(inputs) else worst


def check_normal(ctx, buf, case: NormalCase) -> CaseResult:
    """Layout, dispatch, cached dispatch and combine on ``buf`` against the reference."""
    res = CaseResult(case.label())
    num_ranks, rank, dev = ctx.world_size, ctx.rank, ctx.device
    dtype = _DTYPES[case.dtype]
    inputs = make_inputs(case.seed, num_ranks, case.num_tokens, case.hidden, case.num_experts, case.topk,
                         case.routing, dtype)
    fp8 = case.dtype == "fp8"
    casted = [per_token_cast_to_fp8(i.x) for i in inputs] if fp8 else None
    mine = inputs[rank].to(dev)
    if fp8:
        data, scales = casted[rank][0].to(dev), casted[rank][1].to(dev)
        if case.column_major_scales:
            scales = scales.t().contiguous().t()
        x = (data, scales)
    else:
        x = mine.x

    # layout
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(mine.topk_idx, case.num_experts)
    ref_layout = reference.dispatch_layout(inputs[rank].topk_idx, case.num_experts, num_ranks)
    res.expect("num_tokens_per_rank", per_rank, ref_layout.num_tokens_per_rank)
    res.expect("num_tokens_per_expert", per_expert, ref_layout.num_tokens_per_expert)
    res.expect("is_token_in_rank", in_rank, ref_layout.is_token_in_rank)
    local = getattr(buf, "local_size", num_ranks)
    if local < num_ranks:  # tokens per domain (node): a token counts once per domain
        want_rdma = ref_layout.is_token_in_rank.view(-1, num_ranks // local, local).any(2).sum(0, dtype=torch.int32)
        res.expect("num_tokens_per_rdma_rank", per_rdma, want_rdma)
    else:
        res.expect_eq("num_tokens_per_rdma_rank", per_rdma, None)

    ref = reference.dispatch([c[0] if fp8 else i.x for c, i in zip(casted or [None] * num_ranks, inputs)],
                             [i.topk_idx for i in inputs], case.num_experts,
                             [i.topk_weights for i in inputs] if case.with_topk else None,
                             [c[1] for c in casted] if fp8 else None, case.expert_alignment, local)
    max_recv = max(r.recv_x.size(0) for r in ref)
    worst = _worst(case.worst, max_recv, local, inputs)
    stream_kw = dict(previous_event=buf.capture(), async_finish=True) if case.overlap else {}
    if case.strict_sms is not None:
        stream_kw["config"] = replace(buf.get_dispatch_config(ctx.world_size), strict_sms=case.strict_sms)
    recv_x, recv_idx, recv_w, per_expert_list, handle, event = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert if case.with_topk else None,
        topk_idx=mine.topk_idx if case.with_topk else None,
        topk_weights=mine.topk_weights if case.with_topk else None,
        expert_alignment=case.expert_alignment, num_worst_tokens=worst, **stream_kw)
    event.current_stream_wait()
    mine_ref = ref[rank]
    m = mine_ref.recv_x.size(0)
    got_x, got_s = recv_x if fp8 else (recv_x, None)
    res.expect_eq("recv rows", got_x.size(0), worst or m)
    res.expect("recv_x", got_x[:m], mine_ref.recv_x)
    if fp8:
        res.expect("recv_x_scales", got_s[:m], mine_ref.recv_scales)
    if case.with_topk:
        res.expect("recv_topk_idx", recv_idx[:m], mine_ref.recv_topk_idx)
        res.expect("recv_topk_weights", recv_w[:m], mine_ref.recv_topk_weights)
        if worst:
            res.expect_eq("padding recv_topk_idx all -1", bool((recv_idx[m:] == -1).all()), True)
            counts = [int(v) for v in handle.num_recv_tokens_per_expert.cpu()]
            want = [int((mine_ref.recv_topk_idx == e).sum()) for e in range(case.num_experts // num_ranks)]
            res.expect_eq("handle.num_recv_tokens_per_expert", counts, want)
        else:
            res.expect_eq("num_recv_tokens_per_expert_list", per_expert_list, mine_ref.num_recv_tokens_per_expert)
    res.expect("handle.recv_src_idx", handle.recv_src_idx[:m].long(), mine_ref.recv_src_idx)
    res.expect("handle.recv_src_rank", handle.recv_src_rank[:m].long(), mine_ref.recv_src_rank)

    # cached dispatch of new data with the same layout
    x2_all = [(i.x.float() * 0.5 - 1.0).to(i.x.dtype) for i in inputs]
    if fp8:
        c2 = [per_token_cast_to_fp8(v) for v in x2_all]
        x2 = (c2[rank][0].to(dev), c2[rank][1].to(dev))
    else:
        x2 = x2_all[rank].to(dev)
    cached = buf.dispatch(x2, handle=handle)
    ref2 = reference.dispatch([c[0] for c in c2] if fp8 else x2_all, [i.topk_idx for i in inputs],
                              case.num_experts, None, [c[1] for c in c2] if fp8 else None, local_size=local)
    got2 = cached[0][0] if fp8 else cached[0]
    res.expect("cached recv_x", got2[:m], ref2[rank].recv_x)
    if fp8:
        res.expect("cached recv_x_scales", cached[0][1][:m], ref2[rank].recv_scales)
    res.expect_eq("cached mode returns no handle", cached[4], None)

    # combine: each rank sends back a per-rank scaling of what it received (rows past m are padding)
    out_dtype = torch.bfloat16 if fp8 else dtype
    rows_all = [(per_token_cast_back(r.recv_x, r.recv_scales, out_dtype) if fp8 else r.recv_x) for r in ref]
    ys = [_combine_input(rows, r, out_dtype) for r, rows in enumerate(rows_all)]
    y = torch.empty(worst or m, case.hidden, dtype=out_dtype)
    y[:m] = ys[rank]
    if worst:
        y[m:] = float("nan")  # padding rows must not leak into the sum
    gen = torch.Generator().manual_seed(case.seed + 17)
    biases = [[torch.randn(inputs[s].x.size(0), case.hidden, generator=gen).to(out_dtype) for _ in range(case.bias)]
              for s in range(num_ranks)]
    bias = None if not case.bias else (biases[rank][0].to(dev) if case.bias == 1 else
                                       tuple(b.to(dev) for b in biases[rank]))
    w_in = None
    if case.with_topk:
        w_in = torch.zeros(worst or m, case.topk)
        w_in[:m] = ref[rank].recv_topk_weights
    stream_kw = dict(previous_event=buf.capture(), async_finish=True) if case.overlap else {}
    if case.strict_sms is not None:
        stream_kw["config"] = replace(buf.get_combine_config(ctx.world_size), strict_sms=case.strict_sms)
    combined, combined_w, event = buf.combine(y.to(dev), handle,
                                              topk_weights=w_in.to(dev) if w_in is not None else None, bias=bias,
                                              **stream_kw)
    event.current_stream_wait()
    want = reference.combine(ys, ref, [i.x.size(0) for i in inputs],
                             [r.recv_topk_weights for r in ref] if case.with_topk else None,
                             biases if case.bias else None, out_dtype)
    res.expect("combined_x", combined, want[rank][0])
    if case.with_topk:
        res.expect("combined_topk_weights", combined_w, want[rank][1])

    # round trip: sending back exactly what arrived (one domain: x times the number of ranks the token went to)
    if not fp8 and not worst:
        back, _, _ = buf.combine(recv_x, handle)
        want = reference.combine([r.recv_x for r in ref], ref, [i.x.size(0) for i in inputs], out_dtype=dtype)
        res.expect("round trip", back, want[rank][0])
        if local == num_ranks:
            k = in_rank.sum(1, keepdim=True).float().cpu()
            res.expect("round trip is x times the ranks", back, (inputs[rank].x.float() * k).to(dtype))
    return res


@dataclass(frozen=True)
class ExpertMajorCase:
    """One expert-major dispatch -> weighted combine case (``layout="expert_major"``); fields as ``NormalCase``.
    ``worst``: ``num_worst_tokens`` = a bound on the (token, local expert) pairs a rank receives."""

    num_tokens: object = 32
    hidden: int = 128
    num_experts: int = 8
    topk: int = 2
    routing: str = "uniform"
    dtype: str = "bf16"  # bf16 | fp8 | fp32 | fp16
    expert_alignment: int = 8
    worst: bool = False
    bias: int = 0
    with_weights: bool = True
    strict_sms: Optional[bool] = None  # Config.strict_sms of the dispatch
    seed: int = 0

    def label(self) -> str:
        return (f"EM N={self.num_tokens} H={self.hidden} E={self.num_experts} K={self.topk} {self.routing} "
                f"{self.dtype} align={self.expert_alignment} worst={self.worst} bias={self.bias} "
                f"weights={self.with_weights}" + (f" strict={self.strict_sms}" if self.strict_sms is not None else ""))


def expert_stand_in(rows: torch.Tensor, row_expert: torch.Tensor, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """A deterministic stand-in for the experts of an expert-major tensor: scale each row by a factor of its
    rank and local expert (``row_expert``, -1 on padding)."""
    factor = 1.0 + 0.5 * rank + 0.25 * row_expert.clamp(min=0).float()
    return (rows.float() * factor.unsqueeze(1)).to(dtype)


def check_expert_major(ctx, buf, case: ExpertMajorCase) -> CaseResult:
    """Expert-major dispatch, its cached repeat and the weighted combine (weighted by the dispatched weights,
    by given weights, unweighted; with per-row values and biases) on ``buf`` against the reference."""
    res = CaseResult(case.label())
    num_ranks, rank, dev = ctx.world_size, ctx.rank, ctx.device
    e_local = case.num_experts // num_ranks
    dtype = _DTYPES[case.dtype]
    fp8 = case.dtype == "fp8"
    inputs = make_inputs(case.seed, num_ranks, case.num_tokens, case.hidden, case.num_experts, case.topk,
                         case.routing, dtype)
    casted = [per_token_cast_to_fp8(i.x) for i in inputs] if fp8 else None
    mine = inputs[rank].to(dev)
    x = (casted[rank][0].to(dev), casted[rank][1].to(dev)) if fp8 else mine.x
    weights = [i.topk_weights for i in inputs] if case.with_weights else None
    local = getattr(buf, "local_size", num_ranks)
    ref = reference.expert_major_dispatch([c[0] for c in casted] if fp8 else [i.x for i in inputs],
                                          [i.topk_idx for i in inputs], case.num_experts, weights,
                                          [c[1] for c in casted] if fp8 else None, case.expert_alignment, local)
    mine_ref = ref[rank]
    rows = mine_ref.recv_x.size(0)
    worst = _worst(case.worst, max(sum(r.counts) for r in ref), local, inputs)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(mine.topk_idx, case.num_experts)
    config = (replace(buf.get_dispatch_config(num_ranks), strict_sms=case.strict_sms)
              if case.strict_sms is not None else None)
    recv_x, offsets, row_w, per_expert_list, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=mine.topk_idx, topk_weights=mine.topk_weights if case.with_weights else None,
        expert_alignment=case.expert_alignment, num_worst_tokens=worst, layout="expert_major", config=config)
    total = worst + e_local * (case.expert_alignment - 1) if worst else rows
    got_x, got_s = recv_x if fp8 else (recv_x, None)
    res.expect_eq("handle.layout", handle.layout, "expert_major")
    res.expect_eq("rows", (got_x.size(0), handle.num_recv_rows), (total, total))
    res.expect("recv_x", got_x[:rows], mine_ref.recv_x)
    if fp8:
        res.expect("recv_x scales", got_s[:rows], mine_ref.recv_scales)
    res.expect("recv_expert_offsets", offsets, mine_ref.offsets)
    res.expect("handle.expert_offsets", handle.expert_offsets, mine_ref.offsets)
    if case.with_weights:
        res.expect("recv_row_weights", row_w[:rows], mine_ref.row_weights)
        res.expect_eq("recv_row_weights past the segments are 0", bool((row_w[rows:] == 0).all()), True)
    else:
        res.expect_eq("recv_row_weights without topk_weights", row_w, None)
    k = case.topk
    want_src = torch.where(mine_ref.row_recv >= 0, mine_ref.row_recv * k + mine_ref.row_slot, -1).to(torch.int32)
    res.expect("handle.recv_row_src", handle.recv_row_src[:rows], want_src)
    res.expect_eq("recv_row_src past the segments is -1", bool((handle.recv_row_src[rows:] == -1).all()), True)
    m = mine_ref.pair_row.size(0)
    res.expect("handle.recv_pair_row", handle.recv_pair_row[:m], mine_ref.pair_row.to(torch.int32))
    if worst:
        res.expect_eq("pair_row of padding tokens is -1", bool((handle.recv_pair_row[m:] == -1).all()), True)
        res.expect_eq("per-expert list with num_worst_tokens", per_expert_list, [])
    else:
        res.expect_eq("num_recv_tokens_per_expert_list", per_expert_list,
                      [reference.align_up(c, case.expert_alignment) for c in mine_ref.counts])
    res.expect("handle.num_recv_tokens_per_expert", handle.num_recv_tokens_per_expert,
               torch.tensor(mine_ref.counts, dtype=torch.int32))

    # cached dispatch of new data: expert-major rows again
    x2_all = [(i.x.float() * 0.5 - 1.0).to(i.x.dtype) for i in inputs]
    c2 = [per_token_cast_to_fp8(v) for v in x2_all] if fp8 else None
    x2 = (c2[rank][0].to(dev), c2[rank][1].to(dev)) if fp8 else x2_all[rank].to(dev)
    cached = buf.dispatch(x2, handle=handle)
    ref2 = reference.expert_major_dispatch([c[0] for c in c2] if fp8 else x2_all, [i.topk_idx for i in inputs],
                                           case.num_experts, None, [c[1] for c in c2] if fp8 else None,
                                           case.expert_alignment, local)
    got2 = cached[0][0] if fp8 else cached[0]
    res.expect_eq("cached rows", got2.size(0), total)
    res.expect("cached recv_x", got2[:rows], ref2[rank].recv_x)
    if fp8:
        res.expect("cached recv_x scales", cached[0][1][:rows], ref2[rank].recv_scales)

    # weighted combines: expert stand-in per row, NaN where nothing may be read (padding, the tail)
    out_dtype = torch.bfloat16 if fp8 else dtype
    ys = []
    for r, d in enumerate(ref):
        rows_r = per_token_cast_back(d.recv_x, d.recv_scales, out_dtype) if fp8 else d.recv_x
        expert = torch.bucketize(torch.arange(d.recv_x.size(0)), d.offsets.long(), right=True)
        y_r = expert_stand_in(rows_r, torch.where(d.row_recv >= 0, expert, -1), r, out_dtype)
        ys.append(torch.where((d.row_recv >= 0).unsqueeze(1), y_r, torch.full((), float("nan"), dtype=out_dtype)))
    y = torch.full((total, case.hidden), float("nan"), dtype=out_dtype)
    y[:rows] = ys[rank]
    gen = torch.Generator().manual_seed(case.seed + 23)
    biases = [[torch.randn(inputs[s].x.size(0), case.hidden, generator=gen).to(out_dtype) for _ in range(case.bias)]
              for s in range(num_ranks)]
    bias = None if not case.bias else tuple(b.to(dev) for b in biases[rank])
    values = [torch.randn(d.recv_x.size(0), generator=gen) for d in ref]
    given = [torch.rand(d.recv_x.size(0), generator=gen) + 0.5 for d in ref]
    n_tokens = [i.x.size(0) for i in inputs]

    def padded(t):
        out = torch.zeros(total, dtype=torch.float32)
        out[:rows] = t
        return out.to(dev)

    for label, kw, ref_w in (
            ("weighted by the dispatch", {}, [d.row_weights for d in ref] if case.with_weights else None),
            ("given row_weights", {"row_weights": padded(given[rank])}, given),
            ("unweighted", {"weighted": False}, None)):
        combined, combined_v, _ = buf.combine(y.to(dev), handle, topk_weights=padded(values[rank]), bias=bias, **kw)
        want = reference.expert_major_combine(ys, ref, n_tokens, ref_w, values, biases if case.bias else None,
                                              out_dtype)
        res.expect(f"combined_x ({label})", combined, want[rank][0])
        res.expect(f"combined values ({label})", combined_v, want[rank][1])
    return res


@dataclass(frozen=True)
class LowLatencyCase:
    num_tokens: object = 8  # per rank, <= max_tokens
    max_tokens: int = 16
    hidden: int = 256
    num_experts: int = 8
    topk: int = 2
    routing: str = "uniform"
    use_fp8: bool = True
    round_scale: bool = False
    use_ue8m0: bool = False
    hook: bool = False
    zero_copy: bool = False
    use_out: bool = False
    seed: int = 0

    def label(self) -> str:
        return (f"LL N={self.num_tokens}/T={self.max_tokens} H={self.hidden} E={self.num_experts} K={self.topk} "
                f"{self.routing} fp8={self.use_fp8} round={self.round_scale} ue8m0={self.use_ue8m0} "
                f"hook={self.hook} zero_copy={self.zero_copy} out={self.use_out}")


def low_latency_ranges(ref_out, e: int) -> list:
    """``[[first row, count]]`` of every source rank's block of local expert ``e`` in a reference low-latency
    result (``epcomm.reference.LowLatencyOut``): the blocks follow its ``source_order`` (rank order, or across domains
    (local index, domain)); a source without rows has its block, empty, where it would be."""
    src = ref_out.src_rank[e]
    out, row = [None] * len(ref_out.source_order), 0
    for s in ref_out.source_order:
        cnt = int((src == s).sum())
        out[s] = [row, cnt]
        row += cnt
    return out


def check_low_latency(ctx, buf, case: LowLatencyCase) -> CaseResult:
    """Low-latency dispatch and combine on ``buf`` against the reference."""
    res = CaseResult(case.label())
    num_ranks, rank, dev = ctx.world_size, ctx.rank, ctx.device
    e_local = case.num_experts // num_ranks
    inputs = make_inputs(case.seed, num_ranks, case.num_tokens, case.hidden, case.num_experts, case.topk,
                         case.routing, torch.bfloat16)
    mine = inputs[rank].to(dev)
    recv_x, recv_count, handle, _, hook = buf.low_latency_dispatch(
        mine.x, mine.topk_idx, case.max_tokens, case.num_experts, use_fp8=case.use_fp8,
        round_scale=case.round_scale, use_ue8m0=case.use_ue8m0, return_recv_hook=case.hook)
    res.expect_eq("hook returned", hook is not None, case.hook)
    if hook is not None:
        hook()
    ref = reference.low_latency_dispatch([i.x for i in inputs], [i.topk_idx for i in inputs], case.num_experts,
                                         case.use_fp8, case.round_scale, case.use_ue8m0,
                                         getattr(buf, "local_size", num_ranks))
    mine_ref = ref[rank]
    data, scales = recv_x if case.use_fp8 else (recv_x, None)
    res.expect_eq("recv_x shape", tuple(data.shape), (e_local, num_ranks * case.max_tokens, case.hidden))
    res.expect("recv_count", recv_count, torch.tensor(mine_ref.count, dtype=torch.int32))
    for e in range(e_local):
        c = mine_ref.count[e]
        res.expect(f"recv_x[{e}]", data[e, :c], mine_ref.x[e])
        if scales is not None:
            res.expect(f"recv_scales[{e}]", scales[e, :c], mine_ref.scales[e])
        res.expect(f"src_info[{e}]", handle.src_info[e, :c].long(), mine_ref.src_idx[e])
        res.expect_eq(f"layout_range[{e}]", handle.layout_range[e].tolist(), low_latency_ranges(mine_ref, e))

    # combine: expert stand-in = dequantised rows scaled per expert; padding rows NaN
    ys = []
    for r in range(num_ranks):
        d = ref[r]
        per_e = []
        for e in range(e_local):
            rows = d.x[e]
            if case.use_fp8:
                rows = per_token_cast_back(rows, d.scales[e], torch.bfloat16) if rows.numel() else rows.to(torch.bfloat16)
            per_e.append((rows.float() * (1.0 + 0.125 * e)).to(torch.bfloat16))
        ys.append(per_e)
    y = torch.full((e_local, num_ranks * case.max_tokens, case.hidden), float("nan"), dtype=torch.bfloat16)
    for e in range(e_local):
        y[e, :mine_ref.count[e]] = ys[rank][e]
    if case.zero_copy:
        buf.get_next_low_latency_combine_buffer(handle).copy_(y.to(dev))
        x_in = None
    else:
        x_in = y.to(dev)
    out = torch.full((mine.x.size(0), case.hidden), float("nan"), dtype=torch.bfloat16, device=dev) \
        if case.use_out else None
    combined, _, hook = buf.low_latency_combine(x_in, mine.topk_idx, mine.topk_weights, handle,
                                                zero_copy=case.zero_copy, return_recv_hook=case.hook, out=out)
    if hook is not None:
        hook()
    want = reference.low_latency_combine(ys, ref, [i.topk_idx for i in inputs], [i.topk_weights for i in inputs],
                                         case.num_experts)
    res.expect("low_latency combined_x", combined, want[rank])
    if out is not None:
        res.expect_eq("combine wrote into out", combined.data_ptr() == out.data_ptr(), True)
    return res


@dataclass(frozen=True)
class GraphCase:
    """A step captured once in a CUDA graph and replayed with new data: normal mode (layout, dispatch with
    ``num_worst_tokens``, expert stand-in, combine) or low-latency mode (dispatch, stand-in, combine)."""

    low_latency: bool = False
    num_tokens: int = 64
    hidden: int = 256
    num_experts: int = 16
    topk: int = 4
    replays: int = 3
    seed: int = 40
    expert_major: bool = False  # normal mode with layout="expert_major" (num_worst_tokens: a pairs bound)
    use_fp8: bool = False  # low latency: an FP8 dispatch (the stand-in expert reads the e4m3 values as bf16)
    use_ue8m0: bool = False  # with use_fp8: UE8M0 scales

    def label(self) -> str:
        kind = "LL" if self.low_latency else "expert-major" if self.expert_major else "normal"
        fp8 = f" fp8 ue8m0={self.use_ue8m0}" if self.use_fp8 else ""
        return f"graph {kind}{fp8} N={self.num_tokens} H={self.hidden} E={self.num_experts} K={self.topk}"


def check_graph(ctx, buf, case: GraphCase) -> CaseResult:
    """Capture once, replay ``case.replays`` times with fresh inputs, compare each replay to the reference."""
    res = CaseResult(case.label())
    if ctx.device.type != "cuda":
        res.failures.append("graph cases need CUDA")
        return res
    num_ranks, rank, dev = ctx.world_size, ctx.rank, ctx.device
    data = [make_inputs(case.seed + i, num_ranks, case.num_tokens, case.hidden, case.num_experts, case.topk,
                        "uniform", torch.bfloat16) for i in range(case.replays + 1)]
    x_s, idx_s, w_s = (t.to(dev).clone() for t in (data[0][rank].x, data[0][rank].topk_idx,
                                                   data[0][rank].topk_weights))
    worst = case.num_tokens * num_ranks
    e_local = case.num_experts // num_ranks
    if case.expert_major:
        worst = case.num_tokens * num_ranks * min(case.topk, e_local)  # every pair a rank can receive

    def step():
        if case.expert_major:
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx_s, case.num_experts)
            recv_x, offs, row_w, _, handle, _ = buf.dispatch(
                x_s, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=idx_s, topk_weights=w_s, num_worst_tokens=worst, expert_alignment=8, layout="expert_major")
            combined, _, _ = buf.combine(recv_x * 2, handle)
            return recv_x, combined, offs, row_w
        if case.low_latency:
            recv, _, handle, _, _ = buf.low_latency_dispatch(x_s, idx_s, case.num_tokens, case.num_experts,
                                                             use_fp8=case.use_fp8, round_scale=case.use_ue8m0,
                                                             use_ue8m0=case.use_ue8m0)
            data, scales = recv if case.use_fp8 else (recv, None)
            combined, _, _ = buf.low_latency_combine(data.to(torch.bfloat16) * 2, idx_s, w_s, handle)
            return data, combined, scales, handle.src_info, handle.layout_range
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx_s, case.num_experts)
        recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
            x_s, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=idx_s, topk_weights=w_s, num_worst_tokens=worst)
        combined, combined_w, _ = buf.combine(recv_x * 2, handle, topk_weights=recv_w)
        return recv_x, combined, combined_w, recv_idx, in_rank

    from ..bench.timing import capture_graph

    graph, outs = capture_graph(step)
    for i in range(1, case.replays + 1):
        mine = data[i][rank]
        x_s.copy_(mine.x)
        idx_s.copy_(mine.topk_idx)
        w_s.copy_(mine.topk_weights)
        graph.replay()
        torch.cuda.synchronize()
        xs, idxs, ws = [d.x for d in data[i]], [d.topk_idx for d in data[i]], [d.topk_weights for d in data[i]]
        local = getattr(buf, "local_size", num_ranks)
        if case.expert_major:
            ref = reference.expert_major_dispatch(xs, idxs, case.num_experts, ws, expert_alignment=8, local_size=local)
            rows = ref[rank].recv_x.size(0)
            res.expect(f"replay {i} recv_x", outs[0][:rows], ref[rank].recv_x)
            res.expect(f"replay {i} offsets", outs[2], ref[rank].offsets)
            res.expect(f"replay {i} row weights", outs[3][:rows], ref[rank].row_weights)
            ys = [(r.recv_x.float() * 2).to(torch.bfloat16) for r in ref]
            want = reference.expert_major_combine(ys, ref, [x.size(0) for x in xs], [r.row_weights for r in ref])
            res.expect(f"replay {i} combined", outs[1], want[rank][0])
        elif case.low_latency:
            ref = reference.low_latency_dispatch(xs, idxs, case.num_experts, case.use_fp8, case.use_ue8m0,
                                                 case.use_ue8m0, local_size=local)
            for e in range(case.num_experts // num_ranks):
                c = ref[rank].count[e]
                res.expect(f"replay {i} recv_x[{e}]", outs[0][e, :c], ref[rank].x[e])
                if case.use_fp8:
                    res.expect(f"replay {i} recv_scales[{e}]", outs[2][e, :c], ref[rank].scales[e])
                res.expect(f"replay {i} src_info[{e}]", outs[3][e, :c].long(), ref[rank].src_idx[e])
                res.expect_eq(f"replay {i} layout_range[{e}]", outs[4][e].tolist(), low_latency_ranges(ref[rank], e))
            ys = [[(xe.to(torch.bfloat16).float() * 2).to(torch.bfloat16) for xe in r.x] for r in ref]
            want = reference.low_latency_combine(ys, ref, idxs, ws, case.num_experts)
            res.expect(f"replay {i} combined", outs[1], want[rank])
        else:
            ref = reference.dispatch(xs, idxs, case.num_experts, ws, local_size=local)
            m = ref[rank].recv_x.size(0)
            res.expect(f"replay {i} recv_x", outs[0][:m], ref[rank].recv_x)
            res.expect(f"replay {i} recv_topk_idx", outs[3][:m], ref[rank].recv_topk_idx)
            want = reference.combine([(r.recv_x.float() * 2).to(torch.bfloat16) for r in ref], ref,
                                     [x.size(0) for x in xs], [r.recv_topk_weights for r in ref])[rank]
            res.expect(f"replay {i} combined", outs[1], want[0])
            res.expect(f"replay {i} combined weights", outs[2], want[1])
    return res


def run_cases(ctx, cases: Sequence, transport="alltoall", buffer_kwargs: Optional[dict] = None,
              before_destroy: Optional[Callable] = None) -> list:
    """Worker entry: run every case on one Buffer; return ``[(label, failures)]`` for the failing ones.
    ``before_destroy(buffer)`` runs after the last case (e.g. to read ``buffer.memory_usage``).

    A case that raises is not caught: the ranks would no longer agree on which collective comes next, so
    the exception ends the worker and the launcher stops every rank (the message names the case)."""
    from ..buffer import Buffer

    buf = Buffer(ctx.group, transport=transport, **(buffer_kwargs or {}))
    failed = []
    for case in cases:
        check = (check_low_latency if isinstance(case, LowLatencyCase) else
                 check_graph if isinstance(case, GraphCase) else
                 check_expert_major if isinstance(case, ExpertMajorCase) else check_normal)
        try:
            result = check(ctx, buf, case)
        except Exception as exc:
            raise RuntimeError(f"case {case.label()!r} raised on rank {ctx.rank}") from exc
        if not result.ok:
            failed.append((result.label, result.failures))
    if before_destroy is not None:
        before_destroy(buf)
    buf.destroy()
    return failed
