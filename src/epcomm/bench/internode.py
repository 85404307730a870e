"""``python -m epcomm bench internode``: the hierarchical path across domains (nodes) against a flat all_to_all.

The ranks are split into domains of ``--ranks-per-node`` (default: ``EPCOMM_RANKS_PER_NODE``, else what the
probe finds, else half the ranks: simulated nodes on one machine; run it with a per-node ``NCCL_HOSTID`` and
``NCCL_NET=Socket``, which the launcher sets for simulated nodes, or ``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1``, so
that NCCL connects the domains through its network path). In one run, for each routing (``uniform``, and
``group_limited``: each token's experts within at most ``--max-groups`` domains, DeepSeek-V3's node-limited
routing), at DeepSeek's shape (4096 tokens per rank, hidden 7168, top-8, 256 experts) and the low-latency shape
(128 tokens):

* ``hierarchical``: epcomm's Buffer over the domains (``--domain-transport`` within each), in the chunk count it
  measures as fastest (the ``chunks`` column), and ``hierarchical, N chunks`` with each candidate count fixed;
* ``flat alltoall``: epcomm's portable transport over the whole group as one domain (one all_to_all_single of
  the rows, NCCL between every pair of ranks);
* ``nccl-baseline``: the plain NCCL pipeline a framework writes (``epcomm.bench.baseline``);
* ``raw link``: one all_to_all_single over the rail group (the ranks with this rank's local index) of exactly
  the bytes the hierarchical path sends across domains: the inter-domain link's rate on that traffic;
* ``hierarchical, 1 chunk, by phase`` and ``..., 4 chunks, by phase`` (first round, their calls taking turns): where
  a BF16 dispatch's time goes, each part of the call that the transport runs as a leg
  (``HierarchicalTransport.phase_log``: the inter-domain leg with the count exchange and its host read, the packing
  of its rows while the counts travel, the forwarding within the domain with the domain's gather of the counts, the
  chunk agreement; each phase's parts summed per call, as the device ran them and as the host spent them), and the
  host's time split at the count read (up to it; after it; from it to the first rows' collective, and that lead by
  step: ``lead: ...``, the time up to each of ``LEAD_STEPS`` the call reaches, then to the collective), the median of
  the slowest rank; what the parts leave out (the rows' reordering, host gaps) is the rest of the call's time. The
  model's host terms come from these rows (``HostCosts.measured``);
* ``node leg: ...`` (where each simulated node is one GPU, whose node leg moves nothing): the host time of the calls
  an NVLink node's leg makes per chunk, on the one-sided transport over this machine's GPUs as one domain
  (``_node_leg``); the model charges every chunk the larger of that and the simulated node's own leg
  (``HostCosts.with_node_leg``).

Every call is timed isolated (a barrier before each: the device waits for all of the call's host work; the median
over iterations of the slowest rank) and, on GPUs, for ``hierarchical``, ``flat alltoall`` and ``raw link`` (the
rows the targets compare), also as a model's step meets it (``..., host ahead``: ``timing.time_ahead``, the device
busy with earlier work while the host issues the call, as in DeepEP's benchmarks; the three paths' calls of an
operation in turn in each iteration, so that the link's drift weighs on them alike; the chunk tuner's trials run with
the host ahead too, as in a step); ``a model's step`` times the
expert GEMMs between a dispatch and its combine at this shape (how far ahead a step puts the host). A table of the
split-node targets (speed-up over the flat all_to_all, share of the raw link's rate) closes the notes. With
``--rounds N`` the whole measurement runs N times, the implementations interleaved, and each row gives the median
round and the range (a socket link's rate drifts by ~20% within a run). Columns:
crossing rows per token (rows that leave the domain per token: distinct remote domains for the hierarchical path,
distinct remote ranks for the flat ones), crossing MB per rank, and link GB/s (crossing bytes over the call's
time). Then the traffic model (``epcomm.bench.traffic.internode_estimate``) at EP16, EP32 and EP64 from
``--nic-gbps`` (default 50 GB/s per GPU, ConnectX-7 400 Gb/s) and ``--nvlink-gbps`` (the intranode dispatch's
measured rate), beside DeepEP's published internode figures; its host terms are this run's, charged as for an
isolated call and (``(host ahead)`` columns, ``HostCosts.host_ahead``) as in a step, where an exact-mode dispatch's
count exchange is the one timed with the host ahead (the ``..., host ahead`` phase row)."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..testing import run
from ..transports.hierarchical import COUNTS_PHASE, HierarchicalTransport, phase_durations_us
from .report import bench_parser, finish, format_table
from .timing import HostLead, time_ahead, time_op
from .traffic import (DEEPEP_PUBLISHED_LOW_LATENCY, DEEPEP_PUBLISHED_NORMAL, HBM_GBPS, distinct_domains,
                      internode_estimate, row_bytes)


@dataclass(frozen=True)
class InternodeBenchOptions:
    tokens: int
    ll_tokens: int
    hidden: int
    topk: int
    experts: int
    ranks_per_node: Optional[int]
    routings: tuple
    max_groups: int
    domain_transport: str
    iters: int
    rounds: int = 1  # the whole measurement repeated, each row the median of its rounds (links that drift)


CACHED_FP8 = "dispatch FP8, cached handle"
AHEAD = ", host ahead"  # an implementation's rows timed with the host ahead of the device (``time_ahead``)


def _inputs(ctx, opts, routing: str, num_tokens: int, num_domains: int):
    """Every rank's ``(x bf16, topk_idx, topk_weights)`` for ``routing`` (same seed on every rank)."""
    from ..testing.routing import group_limited_topk, make_inputs

    inputs = make_inputs(23, ctx.world_size, num_tokens, opts.hidden, opts.experts, opts.topk)
    if routing == "group_limited":
        gen = torch.Generator().manual_seed(29)
        idxs = [group_limited_topk(num_tokens, opts.experts, opts.topk, num_domains,
                                   min(opts.max_groups, num_domains), generator=gen) for _ in inputs]
    else:
        idxs = [i.topk_idx for i in inputs]
    return [(i.x, idx, i.topk_weights) for i, idx in zip(inputs, idxs)]


def bench_worker(ctx, opts: InternodeBenchOptions) -> list:
    import torch.distributed as dist

    from ..buffer import Buffer
    from ..fp8 import per_token_cast_to_fp8
    from .baseline import baseline_combine, baseline_dispatch

    world = ctx.world_size
    hier = Buffer(ctx.group, transport=opts.domain_transport, ranks_per_node=opts.ranks_per_node)
    if hier.num_domains < 2:
        raise ValueError(f"bench internode: the {world} ranks form one domain; pass --ranks-per-node (a divisor of "
                         f"{world} smaller than it) to split them into simulated nodes")
    D, L = hier.num_domains, hier.local_size
    flat = Buffer(ctx.group, transport="alltoall", ranks_per_node=world)
    rail_group = hier.runtime.rail_group
    rows = []
    phased: set = set()
    base = {"ranks": world, "domains": f"{D}x{L}", "domain leg": hier.runtime.domain.name}

    cuda = ctx.device.type == "cuda"

    def t(fn):
        return time_op(fn, ctx.group, ctx.device, iters=opts.iters, warmup=3)

    def ahead(fn):
        return time_ahead(fn, ctx.group, ctx.device, iters=opts.iters, warmup=3)

    def layout_of(buf, idx, w) -> dict:
        """``Buffer.dispatch``'s layout arguments for top-k ``idx`` with weights ``w``."""
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, opts.experts)
        return dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                    num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)

    def add(routing, impl, op, timing, crossing_rows, kind, n, chunks=""):
        crossing = crossing_rows * n * row_bytes(opts.hidden, kind)
        rows.append({**base, "routing": routing, "impl": impl, "op": op, "chunks": chunks,
                     "time_us": timing.median_us,
                     "crossing rows/token": round(crossing_rows, 3), "crossing MB/rank": round(crossing / 1e6, 2),
                     "link GB/s": timing.gbps(crossing)})

    hier_chunks = ""  # (the chunk count the hierarchical path measured: its host-ahead rows')
    # the chunk trials with the host ahead, as in a model's step (and as the tuner meets them there): products of
    # about TRIAL_LEAD_S before each, longer than a dispatch's host work up to its count read
    trial_lead = None
    if cuda:
        lead = HostLead(ctx.group, ctx.device)
        trial_lead = (lead, lead.products([TRIAL_LEAD_S])[0])
    for routing in [r for _ in range(opts.rounds) for r in opts.routings]:
        data = _inputs(ctx, opts, routing, opts.tokens, D)
        idxs = [d[1] for d in data]
        # the traffic, from the routing: remote domains per token (hierarchical), remote ranks per token (flat)
        own_domain, per_domain = ctx.rank // L, opts.experts // D
        hier_cross = sum(float((distinct_domains(i, opts.experts, D)).sum()) -
                         float(((i >= 0) & (i // per_domain == s // L)).any(1).sum())
                         for s, i in enumerate(idxs)) / (world * opts.tokens)
        flat_cross = sum(float(distinct_domains(i, opts.experts, world).sum()) -
                         float(_same_domain_ranks(i, opts.experts, world, L, s // L).sum())
                         for s, i in enumerate(idxs)) / (world * opts.tokens)
        x, idx, w = (v.to(ctx.device) for v in data[ctx.rank])
        x8 = per_token_cast_to_fp8(x)
        sweep = [(f"hierarchical, {c} chunk{'s' * (c > 1)}", hier, c) for c in HierarchicalTransport.CHUNK_CANDIDATES]
        for name, buf, fixed in [("hierarchical", hier, None), ("flat alltoall", flat, None)] + sweep:
            HierarchicalTransport.pipeline_chunks = fixed  # None: the count the transport measures
            cross = hier_cross if buf is hier else flat_cross
            layout = layout_of(buf, idx, w)
            buf.dispatch(x, **layout)
            tuner = hier.runtime._tuner
            for _ in range(len(tuner.candidates) * tuner.calls + 1):  # time the count it measured, not the trials
                if buf is not hier or hier.runtime._fixed_chunks()[0] or tuner.chosen is not None:
                    break
                if trial_lead is not None:  # (the trials as a step meets them: the host ahead)
                    trial_lead[0].lead(trial_lead[1])
                buf.dispatch(x, **layout)
            chunks = ""
            if buf is hier:  # (the tuner's choice: a count, and whether its calls send a head chunk)
                chunks = fixed or (f"{tuner.chosen}{' + head' if tuner.head else ''}" if tuner.chosen else "")
            if buf is hier and fixed is None:
                hier_chunks = chunks
            for op, kind, call in _target_calls(buf, x, x8, layout):  # (isolated calls)
                add(routing, name, op, t(call), cross, kind, opts.tokens, chunks)
        if routing not in phased:  # where a BF16 dispatch's time goes, in 1 and 4 chunks (the first round only)
            phased.add(routing)
            for (chunks, head), ops in _by_phase(ctx, hier, x, layout_of(hier, idx, w), opts.iters).items():
                rows.extend({**base, "routing": routing, "impl": phased_impl(chunks, head), "op": op,
                             "chunks": chunks, "time_us": us, "crossing rows/token": "", "crossing MB/rank": "",
                             "link GB/s": ""} for op, us in ops.items())
            if len(phased) == 1:  # (host times: one routing's)
                rows.extend({**base, "routing": routing, "impl": NODE_LEG, "op": op, "chunks": 1, "time_us": us,
                             "crossing rows/token": "", "crossing MB/rank": "", "link GB/s": ""}
                            for op, us in _node_leg(ctx, opts, hier, x, idx, w).items())
        HierarchicalTransport.pipeline_chunks = None
        add(routing, "nccl-baseline", "dispatch FP8",
            t(lambda: baseline_dispatch(x8[0], x8[1], idx, w, opts.experts, ctx.group)), flat_cross, "fp8",
            opts.tokens)
        add(routing, "nccl-baseline", "dispatch BF16",
            t(lambda: baseline_dispatch(x, None, idx, w, opts.experts, ctx.group)), flat_cross, "bf16", opts.tokens)
        b_recv, _, _, _, b_handle = baseline_dispatch(x, None, idx, w, opts.experts, ctx.group)
        add(routing, "nccl-baseline", "combine BF16", t(lambda: baseline_combine(b_recv, b_handle, ctx.group)),
            flat_cross, "bf16", opts.tokens)
        del b_recv, b_handle
        # the raw inter-domain link: this rank's crossing rows to each rail peer, in one all_to_all
        hit = torch.zeros(idx.size(0), D + 1, dtype=torch.bool, device=idx.device)
        hit.scatter_(1, torch.where(idx >= 0, idx // per_domain, D), True)
        to_domain = hit[:, :D].sum(0).cpu()
        to_domain[own_domain] = 0
        raw = {}
        for kind in ("fp8", "bf16"):
            rb = row_bytes(opts.hidden, kind)
            send = [int(c) * rb for c in to_domain.tolist()]
            recv = torch.tensor(send, dtype=torch.int64, device=ctx.device)
            got = torch.empty_like(recv)
            dist.all_to_all_single(got, recv, group=rail_group)
            recv_splits = got.tolist()
            src = torch.empty(sum(send), dtype=torch.uint8, device=ctx.device)
            dst = torch.empty(sum(recv_splits), dtype=torch.uint8, device=ctx.device)
            raw[kind] = functools.partial(dist.all_to_all_single, dst, src, recv_splits, send, group=rail_group)
            add(routing, "raw link", raw_op(kind), t(raw[kind]), hier_cross, kind, opts.tokens)
        if cuda:  # the targets' three paths with the host ahead, as a model's step meets the calls, in turn per
            # iteration (the socket link's rate drifts: each weighs on the three alike)
            calls = {b: _target_calls(b, x, x8, layout_of(b, idx, w)) for b in (hier, flat)}
            for (op, kind, h_call), (_, _, f_call) in zip(calls[hier], calls[flat]):
                h_t, f_t, r_t = ahead([h_call, f_call, raw[kind]])
                add(routing, "hierarchical" + AHEAD, op, h_t, hier_cross, kind, opts.tokens, hier_chunks)
                add(routing, "flat alltoall" + AHEAD, op, f_t, flat_cross, kind, opts.tokens)
                add(routing, "raw link" + AHEAD, raw_op(kind, op), r_t, hier_cross, kind, opts.tokens)
            del calls
        # what a chunk costs besides its bytes (host synchronisations, launches): one chunk of a few tokens
        small = _inputs(ctx, opts, routing, 8, D)
        sx, sidx, sw = (v.to(ctx.device) for v in small[ctx.rank])
        HierarchicalTransport.pipeline_chunks = 1
        small_layout = layout_of(hier, sidx, sw)
        add(routing, "hierarchical", "dispatch BF16 (8 tokens, one chunk)",
            t(lambda: hier.dispatch(sx, **small_layout)), 0.0, "bf16", 8, 1)
        HierarchicalTransport.pipeline_chunks = None
        # low latency (FP8 dispatch, BF16 combine)
        ll = _inputs(ctx, opts, routing, opts.ll_tokens, D)
        lx, lidx, lw = (v.to(ctx.device) for v in ll[ctx.rank])
        ll_cross = sum(float(distinct_domains(i, opts.experts, D).sum()) for _, i, _ in ll) / (world * opts.ll_tokens)
        for name, buf in (("hierarchical", hier), ("flat alltoall", flat)):
            recv, _, handle, _, _ = buf.low_latency_dispatch(lx, lidx, opts.ll_tokens, opts.experts, use_fp8=True)
            y = torch.randn(recv[0].shape, device=ctx.device).to(torch.bfloat16)
            add(routing, name, f"low-latency dispatch FP8 ({opts.ll_tokens} tokens)",
                t(lambda: buf.low_latency_dispatch(lx, lidx, opts.ll_tokens, opts.experts, use_fp8=True)),
                ll_cross * (D - 1) / D, "fp8", opts.ll_tokens)  # cast at the source: FP8 rows cross
            add(routing, name, f"low-latency combine BF16 ({opts.ll_tokens} tokens)",
                t(lambda: buf.low_latency_combine(y, lidx, lw, handle)), ll_cross * (D - 1) / D, "bf16",
                opts.ll_tokens)
            del recv, handle, y
    if cuda:  # how far a step's expert GEMMs put the host ahead of a combine (the model's host-ahead rows)
        rows.append({**base, "routing": opts.routings[0], "impl": STEP, "op": EXPERT_GEMMS, "chunks": "",
                     "time_us": t(_expert_gemms(opts, ctx.device)).median_us, "crossing rows/token": "",
                     "crossing MB/rank": "", "link GB/s": ""})
    hier.destroy()
    flat.destroy()
    return _median_of_rounds(rows) if opts.rounds > 1 else rows


TRIAL_LEAD_S = 0.006  # the host's lead before each of the chunk tuner's trials (GPUs)
STEP = "a model's step"
EXPERT_GEMMS = "expert GEMMs (BF16)"
EXPERT_INTERMEDIATE = 2048  # DeepSeek-V3's moe_intermediate_size


def _expert_gemms(opts, device):
    """A step's expert phase at the benchmark's shape, as the device runs it between a dispatch and its combine:
    every received (token, expert) pair (``tokens * topk`` per rank on average, whatever the EP size) through its
    expert's gate/up and down projections (hidden -> 2 x ``EXPERT_INTERMEDIATE`` -> hidden, BF16; one dense
    product each, the grouped GEMMs' FLOPs)."""
    pairs, h, i = opts.tokens * opts.topk, opts.hidden, EXPERT_INTERMEDIATE
    x = torch.randn(pairs, h, device=device, dtype=torch.bfloat16)
    w1 = torch.randn(h, 2 * i, device=device, dtype=torch.bfloat16)
    w2 = torch.randn(i, h, device=device, dtype=torch.bfloat16)
    return lambda: (x @ w1)[:, :i] @ w2


TARGET_OPS = (("dispatch FP8", "fp8"), ("dispatch BF16", "bf16"), ("combine BF16", "bf16"), (CACHED_FP8, "fp8"))


def raw_op(kind: str, beside: str = "") -> str:
    """The raw link's row name for ``kind``'s bytes (``beside``: timed in turn with that operation)."""
    return f"all_to_all {kind.upper()} bytes" + (f", beside {beside}" if beside else "")


def _target_calls(buf, x, x8, layout: dict) -> list:
    """``[(op, kind, call)]`` for ``TARGET_OPS`` on ``buf``: the FP8 and BF16 dispatches, the combine of a BF16
    dispatch's rows and an FP8 dispatch with its cached handle (what DeepEP's published internode figures time)."""
    recv_x, _, _, _, handle, _ = buf.dispatch(x, **layout)  # (in the chunks the transport chose)
    calls = (lambda: buf.dispatch(x8, **layout), lambda: buf.dispatch(x, **layout),
             lambda: buf.combine(recv_x, handle), lambda: buf.dispatch(x8, handle=handle))
    return [(op, kind, call) for (op, kind), call in zip(TARGET_OPS, calls)]


def target_rows(rows: list) -> list:
    """The split-node targets from a run's rows: per routing, timing (isolated calls; the host ahead, where
    measured) and operation, the hierarchical path's time against the flat all_to_all's (the speed-up) and against
    the raw inter-domain link moving the same crossing bytes (its share of the link's rate)."""
    times = {(r["routing"], r["impl"], r["op"]): float(r["time_us"]) for r in rows}
    out = []
    for routing in dict.fromkeys(r["routing"] for r in rows):
        for timing, suffix in (("isolated", ""), ("host ahead", AHEAD)):
            for op, kind in TARGET_OPS:
                hier = times.get((routing, "hierarchical" + suffix, op))
                flat = times.get((routing, "flat alltoall" + suffix, op))
                raw = times.get((routing, "raw link" + suffix, raw_op(kind, op if suffix else "")))
                if hier and flat and raw:
                    out.append({"routing": routing, "timing": timing, "op": op, "hierarchical us": round(hier),
                                "flat alltoall us": round(flat), "speed-up": f"{flat / hier:.2f}x",
                                "raw link us": round(raw), "share of the raw link": f"{raw / hier:.0%}"})
    return out


# chunk counts whose BF16 dispatch is broken down by phase, their calls taking turns: the host's time per call, and
# per further chunk from the difference (over 3 chunks: a single chunk's share of a drift is a third); each with a
# head chunk where the inter-domain leg can send one, and also without (the transport measures both; without a head
# chunk, over a one-sided domain leg, the chunks go through it in one gated call: less host work per chunk)
PHASED_CHUNKS = (1, 4)


def phased_impl(chunks: int, head: bool = True) -> str:
    return f"hierarchical, {chunks} chunk{'s' * (chunks > 1)}{'' if head else ', no head'}, by phase"


def _by_phase(ctx, hier, x, layout: dict, iters: int) -> dict:
    """Where a BF16 dispatch's time goes in each of ``PHASED_CHUNKS`` (``HierarchicalTransport.phase_log``), and the
    host times of its combine and of an FP8 dispatch with its cached handle: ``{(chunks, head): {op: us}}``, the
    median over calls of the slowest rank; where the inter-domain leg can send a head chunk, the calls send one, and
    the first count's is also measured without one (no combine or cached call there); the modes take turns call by
    call (a drift of the host's speed weighs on each alike). On GPUs each mode's count exchange is also timed as a
    model's step meets it (``COUNTS_AHEAD``): the call issued while every rank's device runs the same matrix
    products (``HostLead``, sized from the call's host time), so that the device runs the exchange with the call's
    work before it already enqueued and the ranks lined up (no host gaps, no skew between the ranks' hosts in it).
    Each phase's parts are summed per call, as the device ran them (calls that record CUDA events around them) and
    (``(host)``) as the host spent them (other calls, which record the host's times alone: the events cost the host
    time); the host's milestones (``host_milestones``) split the call's host time at the count read: up to it, and
    after it (of which ``from the count read to the first rows``)."""
    import torch.distributed as dist

    from ..fp8 import per_token_cast_to_fp8
    from ..transports.hierarchical import LEAD_STEPS, host_milestones

    x8 = per_token_cast_to_fp8(x)
    runtime = hier.runtime
    modes = [(c, True) for c in PHASED_CHUNKS]
    if runtime.rail.can_send_ahead(x) and HierarchicalTransport.head_share > 0:
        modes += [(c, False) for c in PHASED_CHUNKS]
    handles, host_s = {}, []
    cuda = ctx.device.type == "cuda"
    for chunks, head in modes:
        HierarchicalTransport.pipeline_chunks, HierarchicalTransport.head_chunk = chunks, head
        recv_x, _, _, _, handle, _ = hier.dispatch(x, **layout)
        if head:
            handles[chunks] = (recv_x, handle)
        if cuda:  # (the host's time of a call, which sizes its head start below)
            torch.cuda.synchronize()
            began = time.perf_counter()
            hier.dispatch(x, **layout)
            host_s.append(time.perf_counter() - began)
            torch.cuda.synchronize()
    # the count exchange as a model's step meets it: the device busy while the host issues the call up to its count
    # read, every rank's device lined up behind the same products (``HostLead``)
    lead = HostLead(ctx.group, ctx.device) if cuda else None
    products = dict(zip(modes, lead.products(host_s))) if cuda else {}
    durations: dict = {m: {} for m in modes}

    def host_time(label: str, got: dict, call) -> None:
        """The host's time of ``call()`` and of each of its parts (``label: the call (host)``, ``label: <phase>
        (host)``): a phase log of host times alone."""
        dist.barrier(group=ctx.group)
        runtime.phase_log, runtime.phase_events = [], False
        began = time.perf_counter()
        call()
        ended = time.perf_counter()
        log, runtime.phase_log, runtime.phase_events = runtime.phase_log, None, True
        got.setdefault(f"{label}: the call (host)", []).append((ended - began) * 1e6)
        for phase, parts in phase_durations_us(log, True).items():
            got.setdefault(f"{label}: {phase} (host)", []).append(sum(parts))
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(max(3, iters)):
        for chunks, head in modes:
            HierarchicalTransport.pipeline_chunks, HierarchicalTransport.head_chunk = chunks, head
            got = durations[(chunks, head)]
            if lead is not None:
                lead.lead(products[(chunks, head)])
                runtime.phase_log, runtime.phase_events = [], True
                hier.dispatch(x, **layout)
                log, runtime.phase_log = runtime.phase_log, None
                got.setdefault(COUNTS_AHEAD, []).append(sum(phase_durations_us(log).get(COUNTS_PHASE, [0.0])))
            for events in (True, False):
                dist.barrier(group=ctx.group)
                runtime.phase_log, runtime.phase_events = [], events
                began = time.perf_counter()
                hier.dispatch(x, **layout)
                ended = time.perf_counter()
                log, runtime.phase_log, runtime.phase_events = runtime.phase_log, None, True
                if events:
                    for phase, parts in phase_durations_us(log).items():
                        got.setdefault(phase, []).append(sum(parts))
                    continue
                got.setdefault("the call (host)", []).append((ended - began) * 1e6)
                marks = host_milestones(log)
                if "counts read" in marks:
                    read = marks["counts read"]
                    got.setdefault(HOST_BEFORE_READ, []).append((read - began) * 1e6)
                    got.setdefault(HOST_AFTER_READ, []).append((ended - read) * 1e6)
                    if "rows issued" in marks:
                        got.setdefault(HOST_LEAD, []).append((marks["rows issued"] - read) * 1e6)
                        # the lead by step: the time up to each step from the one before it (0 where the path has
                        # none; every step in a fixed order, the same on every rank), then to the collective
                        reached, last = {}, read
                        for step, at in marks["lead steps"]:
                            reached[step], last = (at - last) * 1e6, at
                        for step in LEAD_STEPS:
                            got.setdefault(step, []).append(reached.get(step, 0.0))
                        got.setdefault(LEAD_COLLECTIVE, []).append((marks["rows issued"] - last) * 1e6)
                if "device work issued" in marks:
                    got.setdefault(HOST_TAIL, []).append((ended - marks["device work issued"]) * 1e6)
                for phase, parts in phase_durations_us(log, True).items():
                    got.setdefault(phase + " (host)", []).append(sum(parts))
                if ctx.device.type == "cuda":
                    torch.cuda.synchronize()
            if head:
                recv_x, handle = handles[chunks]
                host_time("combine", got, lambda: hier.combine(recv_x, handle))
                host_time(CACHED_FP8, got, lambda: hier.dispatch(x8, handle=handle))
    HierarchicalTransport.pipeline_chunks = HierarchicalTransport.head_chunk = None
    out: dict = {}
    for mode, got in durations.items():
        out[mode] = {}
        for phase, us in got.items():
            op = (phase.replace("combine: ", "combine BF16: ") if phase.startswith(("combine", CACHED_FP8))
                  else f"dispatch BF16: {phase}")
            us = _slowest_median(ctx, us)  # (collective: every rank the same keys in the same order)
            if us or phase not in LEAD_STEPS:  # (a lead step this path does not take: no row)
                out[mode][op] = us
    return out


def _slowest_median(ctx, us: list) -> float:
    """The largest over the ranks of each rank's median of ``us`` (collective), rounded to 0.1."""
    import torch.distributed as dist

    slowest = torch.tensor([float(sorted(us)[len(us) // 2])], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=ctx.group)
    return round(float(slowest), 1)


def _ops_of(rows: list, impl: str) -> dict:
    """``{op: time_us}`` of ``impl``'s rows: uniform routing's, else the first routing's."""
    mine = [r for r in rows if r.get("impl") == impl]
    return {r["op"]: float(r["time_us"]) for r in ([r for r in mine if r["routing"] == "uniform"] or mine)}


NODE_LEG = "node leg: one-sided transport, one domain of these GPUs"
# the node leg's calls (the domain leg's, per chunk), as the one-sided transport makes them and as the path's own
# domain leg made them in the rows by phase (its host time, one chunk)
NODE_LEG_CALLS = (("dispatch", "known-count dispatch (host)", "dispatch BF16: forwarding the tokens (host)"),
                  ("cached", "cached dispatch (host)", f"{CACHED_FP8}: forwarding the cached tokens (host)"),
                  ("combine", "combine (host)", "combine BF16: sums within the domain (host)"))


def _node_leg(ctx, opts, hier, x, idx, w) -> dict:
    """Where each simulated node is one GPU (a one-rank domain leg, which forwards nothing: a copy), the host time of
    the calls an 8-GPU node's leg makes per chunk, as the one-sided NVLink transport issues them over this machine's
    GPUs as one domain: a dispatch with its counts known (what the forwarding calls), a cached dispatch of FP8 rows
    with their scales at their ends, and a combine. ``{op: us}`` (the median of the slowest rank), or nothing where
    the path's domain leg is the one-sided transport already, or the GPUs cannot form such a domain (CPUs, ranks
    sharing a GPU, no P2P)."""
    import torch.distributed as dist

    from ..buffer import Buffer
    from ..core.config import Config
    from ..fp8 import per_token_cast_to_fp8
    from ..transports.base import CombineRequest, DispatchRequest, KnownCounts

    world, dev = ctx.world_size, ctx.device
    if (hier.local_size > 1 or dev.type != "cuda" or torch.cuda.device_count() < world
            or not all(torch.cuda.can_device_access_peer(a, b) for a in range(world) for b in range(world) if a != b)):
        return {}
    buf = Buffer(ctx.group, transport="nvlink", ranks_per_node=world)
    rt = buf.runtime
    per_rank, _, per_expert, itr, _ = buf.get_dispatch_layout(idx, opts.experts)
    recv, _, _, per_expert_list, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=itr,
                                                          num_tokens_per_expert=per_expert, topk_idx=idx,
                                                          topk_weights=w)
    sends = torch.tensor(list(handle.num_tokens_per_rank), device=dev)
    every = [torch.empty_like(sends) for _ in range(world)]
    dist.all_gather(every, sends, group=ctx.group)
    known = KnownCounts(tuple(handle.num_tokens_per_rank), tuple(handle.num_recv_tokens_per_rank),
                        tuple(per_expert_list), num_tokens_max=x.size(0), max_pair=int(torch.stack(every).max()))
    carried = torch.zeros(x.size(0), 2, dtype=torch.float32, device=dev)  # the forwarded rows' sources ride along
    known_req = DispatchRequest(x, carried, idx, w, per_rank, itr, per_expert, opts.experts, 1, 0, None, Config(),
                                None, known=known)
    x8, s8 = per_token_cast_to_fp8(x)
    rows8 = torch.cat([x8.view(torch.uint8), s8.view(torch.uint8)], 1)  # FP8 rows with their scales at their ends
    cached_req = DispatchRequest(rows8, None, None, None, None, None, None, opts.experts, 1, 0, handle, Config(), None)
    combine_req = CombineRequest(recv, handle, None, (), Config())
    calls = {"known-count dispatch (host)": lambda: rt.dispatch(known_req),
             "cached dispatch (host)": lambda: rt.dispatch(cached_req),
             "combine (host)": lambda: rt.combine(combine_req)}
    for call in calls.values():  # (the first calls of a kind compile)
        call()
        call()
    times: dict = {op: [] for op in calls}
    for _ in range(max(3, opts.iters)):
        for op, call in calls.items():
            dist.barrier(group=ctx.group)
            torch.cuda.synchronize()
            began = time.perf_counter()
            call()
            times[op].append((time.perf_counter() - began) * 1e6)
            torch.cuda.synchronize()
    buf.destroy()
    return {op: _slowest_median(ctx, us) for op, us in times.items()}


HOST_BEFORE_READ = "host up to the count read"
HOST_AFTER_READ = "host after the count read"
HOST_LEAD = "host from the count read to the first rows"
LEAD_COLLECTIVE = "lead: the rows' collective issued"  # (the last of the lead's steps: ``LEAD_STEPS`` before it)
HOST_TAIL = "host after the call's device work is issued"
COUNTS_AHEAD = f"{COUNTS_PHASE}{AHEAD}"  # the count exchange's device time in calls issued with the host ahead


def _median_of_rounds(rows: list) -> list:
    """One row per measurement (routing, implementation, operation, chunk count) from its rounds: the median
    time (and the link rate at it), and the range over the rounds."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["routing"], r["impl"], r["op"], r["chunks"]), []).append(r)
    out = []
    for same in groups.values():
        times = sorted(r["time_us"] for r in same)
        mid = sorted(same, key=lambda r: r["time_us"])[(len(same) - 1) // 2]
        out.append({**mid, "time_us range": f"{times[0]:.0f}-{times[-1]:.0f}", "rounds": len(same)})
    return out


def _same_domain_ranks(idx: torch.Tensor, num_experts: int, world: int, local: int, domain: int) -> torch.Tensor:
    """``[N]``: how many distinct ranks of ``domain`` each token's experts live on (rows that stay in the domain
    on the flat path)."""
    per_rank = num_experts // world
    idx = idx.cpu().long()
    hit = torch.zeros(idx.size(0), world + 1, dtype=torch.bool)
    hit.scatter_(1, torch.where(idx >= 0, idx // per_rank, world), True)
    return hit[:, domain * local:(domain + 1) * local].sum(1)


@dataclass(frozen=True)
class HostCosts:
    """The model's costs besides bytes (``internode_estimate``), in us: a dispatch's count exchange before its rows
    cross (``fixed``); the host's time after the count read in a one-chunk dispatch (``dispatch_host``), of which
    ``dispatch_lead`` passes before the first rows' collective, and what each further chunk adds
    (``dispatch_chunk``; None: as much as a whole call); a combine's host time in one chunk and per further chunk
    (it has no count exchange), and a dispatch's with a cached handle (none either)."""

    fixed: float = 0.0
    dispatch_host: float = 0.0
    combine_host: float = 0.0
    dispatch_lead: float = 0.0
    dispatch_chunk: Optional[float] = None
    combine_chunk: Optional[float] = None
    cached_host: float = 0.0
    cached_chunk: Optional[float] = None
    # (call, the one-sided node leg's host us, the path's own domain leg's) per node-leg call, where measured
    # (``_node_leg``): every chunk of that call is charged the larger
    node_leg: tuple = ()
    # a dispatch without a head chunk, where measured (the transport measures calls with and without one): its host
    # time after the count read in one chunk and up to its first rows (each further chunk adds ``dispatch_chunk``),
    # and its own count exchange (None: ``fixed``)
    nohead_host: Optional[float] = None
    nohead_lead: float = 0.0
    nohead_fixed: Optional[float] = None
    # the count exchange as the device runs it with the host ahead (``COUNTS_AHEAD``: the call's work up to the count
    # read already enqueued when the device reaches it, the ranks lined up, as in a model's step), with a head chunk
    # and without; None where not measured (``fixed`` / ``nohead_fixed`` then serve the host-ahead columns too)
    fixed_ahead: Optional[float] = None
    nohead_fixed_ahead: Optional[float] = None
    # the host's time after a dispatch's last device work is issued (its handle; the end of the measured host time),
    # with a head chunk and without: it runs beside the device's last forwarding
    dispatch_tail: float = 0.0
    nohead_tail: Optional[float] = None
    # what each further chunk adds to a dispatch without a head chunk, where measured (over a one-sided domain leg its
    # chunks go through it in one gated call: ``HierarchicalTransport._gated``); None: ``dispatch_chunk``. Such a call
    # in several chunks has a lead and a tail of its own (``nohead_chunks_lead``, ``nohead_chunks_tail``: the gated
    # call's, from the same rows; None: the one-chunk call's)
    nohead_chunk: Optional[float] = None
    nohead_chunks_lead: Optional[float] = None
    nohead_chunks_tail: Optional[float] = None

    def describe(self) -> str:
        def per_chunk(v):
            return "as much" if v is None else f"{v:.0f} us"

        leg = ("; each chunk's node leg charged as the one-sided transport issues it on these GPUs as one domain "
               "where that is slower than the simulated node's one-GPU leg (" + ", ".join(
                   f"{call} {node:.0f} us against {own:.0f}" for call, node, own in self.node_leg) + ")"
               if self.node_leg else "")
        nohead = ("" if self.nohead_host is None else
                  f" (without a head chunk {self.nohead_host:.0f} us, {self.nohead_lead:.0f} us of it before its first "
                  f"rows' collective" + ("" if self.nohead_tail is None else
                                         f" and {self.nohead_tail:.0f} us after its last device work")
                  + ("" if self.nohead_fixed is None else f", after {self.nohead_fixed:.0f} us of count exchange")
                  + ("" if self.nohead_chunk is None else f", {self.nohead_chunk:.0f} us more per further chunk")
                  + ("" if self.nohead_chunks_lead is None else
                     f"; in several chunks {self.nohead_chunks_lead:.0f} us before its first rows' collective")
                  + ("" if self.nohead_chunks_tail is None else
                     f" and {self.nohead_chunks_tail:.0f} us after its last device work")
                  + ")")
        ahead = ("" if self.fixed_ahead is None else
                 f" ({self.fixed_ahead:.0f} us with the host ahead" + ("" if self.nohead_fixed_ahead is None else
                                                                      f", {self.nohead_fixed_ahead:.0f} us without a "
                                                                      f"head chunk") + ")")
        return (f"{self.fixed:.0f} us of count exchange per dispatch before its rows cross{ahead}; a dispatch's host "
                f"time after the count read {self.dispatch_host:.0f} us in one chunk ({self.dispatch_lead:.0f} us of "
                f"it before its first rows' collective, {self.dispatch_tail:.0f} us after its last device work, "
                f"beside its last forwarding){nohead}, {per_chunk(self.dispatch_chunk)} more per further "
                f"chunk; a combine's host time {self.combine_host:.0f} us in one chunk, "
                f"{per_chunk(self.combine_chunk)} more per further chunk; a cached dispatch's "
                f"{self.cached_host:.0f} us in one chunk, {per_chunk(self.cached_chunk)} more per further chunk{leg}")

    def model_args(self, op: str, fixed: Optional[float] = None, head: bool = True, records: float = 1.0) -> dict:
        """``internode_estimate``'s cost arguments for ``op`` (a dispatch, a dispatch with a cached handle, else a
        combine); ``fixed`` replaces the count exchange; ``head``: a dispatch with a head chunk (its rows crossing
        while the counts travel: ``HierarchicalTransport.head_share``), else one without (its own host times where
        measured). Calls without a count read (combine, cached dispatch) are charged their whole host time: nothing
        synchronises the host with its GPU in them. A cached dispatch's rows are written in place (its node leg is
        one-sided: ``HierarchicalTransport._mapped``), not gathered after it; so are an exact-mode dispatch's, every
        chunk's (``HierarchicalTransport._rows_in_place``). The
        device's own passes over the rows (``internode_estimate``'s ``copies``), as the inter-domain leg makes them
        (``AllToAllTransport`` with ``fuse_rows``): an exact-mode dispatch's pack writes each chunk's rows and records
        side by side into the rows it sends (no copy before they cross; its packing runs while the counts travel) and
        copies only the records out after (``records``: their share of the crossing bytes; its one-sided node leg
        reads the rows where they landed, ``rows_as_views``); a cached
        one packs every chunk's rows at once before the first crosses, after putting each token's FP8 scales at the
        end of its row, and its node leg reads the landed rows in place; a combine's node leg writes each chunk's
        partials and weights side by side into the rows the inter-domain leg sends, and the source sums the partials
        where they landed."""
        if "cached" in op:
            return dict(host_us=self.cached_host, host_chunk_us=self.cached_chunk, in_place=True,
                        copies=(0.0, 0.0, 1.0, 1.0 if "FP8" in op else 0.0))
        if "dispatch" in op:
            if not head and self.nohead_host is not None:
                fixed = (self.fixed if self.nohead_fixed is None else self.nohead_fixed) if fixed is None else fixed
                tail = self.dispatch_tail if self.nohead_tail is None else self.nohead_tail
                args = dict(fixed_us=fixed, host_us=self.nohead_host, lead_us=self.nohead_lead,
                            host_chunk_us=self.dispatch_chunk if self.nohead_chunk is None else self.nohead_chunk,
                            in_place=True, copies=(0.0, records, 0.0, 0.0), tail_us=tail)
                if self.nohead_chunks_lead is not None or self.nohead_chunks_tail is not None:
                    # (several chunks: the gated call's own lead and tail; one chunk: the one-chunk call's)
                    args.update(lead_us=self.nohead_lead if self.nohead_chunks_lead is None else
                                self.nohead_chunks_lead,
                                tail_us=tail if self.nohead_chunks_tail is None else self.nohead_chunks_tail,
                                one_chunk=dict(lead_us=self.nohead_lead, tail_us=tail))
                return args
            return dict(fixed_us=self.fixed if fixed is None else fixed, host_us=self.dispatch_host,
                        lead_us=self.dispatch_lead, host_chunk_us=self.dispatch_chunk,
                        head_share=HierarchicalTransport.head_share, copies=(0.0, records, 0.0, 0.0),
                        tail_us=self.dispatch_tail, in_place=True)
        return dict(host_us=self.combine_host, host_chunk_us=self.combine_chunk, copies=(0.0, 1.0, 0.0, 0.0))

    def host_ahead(self) -> "HostCosts":
        """These costs as a model's step meets the calls: the host ahead of its GPU (it issues a call while the GPU
        still runs the step's earlier work), so a call that never synchronises the host (a combine, a cached
        dispatch) costs no host time; an exact-mode dispatch keeps its host time after the count read (the read
        synchronises; its host time before the read is not charged in either case), and its count exchange is the one
        measured with the host ahead where it was (``fixed_ahead``: no rank's host is still issuing the call's work
        when the device reaches the exchange, so neither the host's gaps nor the ranks' skew is in it)."""
        return replace(self, combine_host=0.0, combine_chunk=0.0, cached_host=0.0, cached_chunk=0.0,
                       fixed=self.fixed if self.fixed_ahead is None else self.fixed_ahead,
                       nohead_fixed=self.nohead_fixed if self.nohead_fixed_ahead is None else self.nohead_fixed_ahead)

    def heads(self, op: str) -> tuple:
        """The head options the transport measures for ``op``'s calls (an exact-mode dispatch: with a head chunk and,
        where its host times were measured, without)."""
        return (True, False) if "dispatch" in op and "cached" not in op and self.nohead_host is not None else (True,)

    @classmethod
    def measured(cls, rows: list) -> "HostCosts":
        """From a run's rows by phase (uniform routing, else the first): the count exchange as the device saw it in
        one chunk (its host read included; isolated, and where measured with the host ahead), the dispatch's host
        time after the count read and up to its first rows, the combine's and the cached dispatch's host times, and
        what each further chunk adds (from the difference between the counts of ``PHASED_CHUNKS``)."""
        got = {chunks: _ops_of(rows, phased_impl(chunks)) for chunks in PHASED_CHUNKS}
        c1, cn = PHASED_CHUNKS[0], PHASED_CHUNKS[-1]
        one, last = got[c1], got[cn]
        counts = f"dispatch BF16: {COUNTS_PHASE}"
        if counts not in one:
            return cls()
        after, combine = f"dispatch BF16: {HOST_AFTER_READ}", "combine BF16: the call (host)"
        cached = f"{CACHED_FP8}: the call (host)"
        # (without the host's milestones: the call's host time less its wait for the counts, per chunk)
        host = one.get(after, max(0.0, one.get("dispatch BF16: the call (host)", 0.0) - one[counts]))

        def more(key, base):  # per further chunk
            return max(0.0, last[key] - base) / (cn - c1) if key in last and key in one else None

        ahead = f"dispatch BF16: {COUNTS_AHEAD}"
        costs = cls(one[counts], host, one.get(combine, 0.0), one.get(f"dispatch BF16: {HOST_LEAD}", 0.0),
                    more(after, host), more(combine, one.get(combine, 0.0)), one.get(cached, 0.0),
                    more(cached, one.get(cached, 0.0)), fixed_ahead=one.get(ahead),
                    dispatch_tail=one.get(f"dispatch BF16: {HOST_TAIL}", 0.0))
        nohead, nohead_n = (_ops_of(rows, phased_impl(c, head=False)) for c in (c1, cn))
        if after in nohead:
            costs = replace(costs, nohead_host=nohead[after],
                            nohead_lead=nohead.get(f"dispatch BF16: {HOST_LEAD}", 0.0), nohead_fixed=nohead.get(counts),
                            nohead_tail=nohead.get(f"dispatch BF16: {HOST_TAIL}"),
                            nohead_fixed_ahead=nohead.get(ahead),
                            nohead_chunk=(max(0.0, nohead_n[after] - nohead[after]) / (cn - c1)
                                          if after in nohead_n else None),
                            nohead_chunks_lead=nohead_n.get(f"dispatch BF16: {HOST_LEAD}") if after in nohead_n
                            else None,
                            nohead_chunks_tail=nohead_n.get(f"dispatch BF16: {HOST_TAIL}") if after in nohead_n
                            else None)
        return costs.with_node_leg(rows)

    def with_node_leg(self, rows: list) -> "HostCosts":
        """These costs with every chunk's node leg charged at the larger of the one-sided transport's host time
        (``_node_leg``'s rows, uniform routing or the first) and the path's own domain leg's (the rows by phase in
        one chunk): what an 8-GPU node's leg costs where each simulated node is one GPU. A cached dispatch's is
        charged once per call: over the one-sided transport its node leg is one gated push for all chunks
        (``HierarchicalTransport._mapped``); so is an exact-mode dispatch's without a head chunk where its further
        chunks were measured so (``nohead_chunk``: ``HierarchicalTransport._gated``)."""
        node, own = _ops_of(rows, NODE_LEG), _ops_of(rows, phased_impl(PHASED_CHUNKS[0]))
        fields = {"dispatch": ("dispatch_host", "dispatch_chunk"), "cached": ("cached_host", "cached_chunk"),
                  "combine": ("combine_host", "combine_chunk")}
        costs, seen = self, []
        for call, node_op, own_op in NODE_LEG_CALLS:
            if node_op not in node or own_op not in own:
                continue
            seen.append((call, node[node_op], own[own_op]))
            more = max(0.0, node[node_op] - own[own_op])
            host, chunk = fields[call]
            per_chunk = call != "cached" and getattr(costs, chunk) is not None
            nohead = call == "dispatch" and costs.nohead_host is not None  # (one chunk: one node leg less)
            costs = replace(costs, **{host: getattr(costs, host) + more},
                            **({chunk: getattr(costs, chunk) + more} if per_chunk else {}),
                            **({"nohead_host": costs.nohead_host + more} if nohead else {}))
        return replace(costs, node_leg=tuple(seen))


def best_estimate(opts, ranks: int, gpus_per_node: int, kind: str, nic_gbps: float, nvlink_gbps: float, groups: int,
                  cost_args: dict):
    """The model's estimate (``internode_estimate`` with ``cost_args``) in the chunk count the transport would
    measure as fastest: the fastest of ``HierarchicalTransport.CHUNK_CANDIDATES``. ``cost_args``' ``one_chunk`` (where
    given) replaces some of them for one chunk (a call whose several chunks take another path, ``HostCosts``)."""
    args = dict(cost_args)
    one = args.pop("one_chunk", {})
    return min((internode_estimate(ranks, gpus_per_node, opts.tokens, opts.hidden, opts.topk, opts.experts, kind,
                                   nic_gbps, nvlink_gbps, groups, c, **(dict(args, **one) if c == 1 else args))
                for c in HierarchicalTransport.CHUNK_CANDIDATES), key=lambda e: e.pipelined_us)


def best_of_heads(opts, ranks: int, gpus_per_node: int, kind: str, nic_gbps: float, nvlink_gbps: float, groups: int,
                  costs: "HostCosts", op: str, fixed: Optional[float] = None) -> tuple:
    """``(estimate, head)``: ``best_estimate`` of ``op`` with and (where measured) without a head chunk, the faster,
    as the transport measures both."""
    records = records_share(opts.hidden, opts.topk, kind)
    return min(((best_estimate(opts, ranks, gpus_per_node, kind, nic_gbps, nvlink_gbps, groups,
                               costs.model_args(op, fixed, head, records)), head) for head in costs.heads(op)),
               key=lambda pair: pair[0].pipelined_us)


def records_share(hidden: int, topk: int, kind: str) -> float:
    """An exact-mode dispatch's records (source, FP8 scales, top-k ids and weights) over the crossing bytes of its
    rows as the model counts them (``row_bytes``: the scales are part of a row): what the inter-domain leg still
    copies out after the rows land."""
    from ..core.layout import record_words

    scales = hidden // 128 if kind == "fp8" else 0
    return record_words(scales, topk, True) * 4 / row_bytes(hidden, kind)


def model_rows(opts, nic_gbps: float, nvlink_gbps: float, costs: HostCosts, gpus_per_node: int = 8) -> list:
    """The traffic model at EP16/32/64 (normal mode, FP8 dispatch and BF16 combine, uniform and group-limited
    routing) beside DeepEP's published figures."""
    rows = []
    for ranks in (16, 32, 64):
        for routing, groups in (("uniform", 0), ("group_limited", opts.max_groups)):
            for op, kind in (("dispatch FP8", "fp8"), (CACHED_FP8, "fp8"), ("combine BF16", "bf16")):
                e, head = best_of_heads(opts, ranks, gpus_per_node, kind, nic_gbps, nvlink_gbps, groups, costs, op)
                ahead, _ = best_of_heads(opts, ranks, gpus_per_node, kind, nic_gbps, nvlink_gbps, groups,
                                         costs.host_ahead(), op)
                pub = DEEPEP_PUBLISHED_NORMAL.get(ranks)
                rows.append({"EP": ranks, "routing": routing, "op": op,
                             "crossing rows/token": round(e.crossing_rows_per_token, 2),
                             "network us": round(e.network_us), "forward us": round(e.forward_us),
                             "legs in sequence us": round(e.sequential_us),
                             "NIC share (sequence)": round(e.nic_share(nic_gbps, False), 3),
                             "chunks": e.chunks, "head chunk": ("" if op != "dispatch FP8" else
                                                                "yes" if head else "no"),
                             "chunk ratio": round(e.ratio, 2),
                             "epcomm us (pipelined)": round(e.pipelined_us),
                             "NIC share": round(e.nic_share(nic_gbps), 3),
                             "chunks (host ahead)": ahead.chunks,
                             "epcomm us (host ahead)": round(ahead.pipelined_us),
                             "NIC share (host ahead)": round(ahead.nic_share(nic_gbps), 3),
                             # (DeepEP's dispatch figures are of dispatches with a cached handle: like for like)
                             "DeepEP published RDMA GB/s": ("" if not pub or op == "dispatch FP8" else
                                                            pub[0] if "dispatch" in op else pub[1])})
    return rows


def fixed_for_share(opts, nic_gbps: float, nvlink_gbps: float, costs: HostCosts, ranks: int, share: float) -> str:
    """How the model's FP8 dispatch at ``ranks`` GPUs (uniform routing, the best chunk count) reaches ``share`` of the
    NIC with the host issue times of ``costs``: a sentence naming the largest count exchange (us, in steps of 10)
    that allows it, or the share reached without one."""
    def best(fixed: float) -> float:
        return best_of_heads(opts, ranks, 8, "fp8", nic_gbps, nvlink_gbps, 0, costs, "dispatch",
                             fixed)[0].nic_share(nic_gbps)

    if best(0.0) < share:
        return (f"stays at {best(0.0):.0%} of the NIC even without a count exchange (the host's time after the count "
                f"read bounds it)")
    fixed = 0.0
    while best(fixed + 10.0) >= share and fixed < 1e6:
        fixed += 10.0
    return f"reaches {share:.0%} of the NIC with a count exchange of at most {fixed:.0f} us"


def _override(costs: HostCosts, fixed_us: Optional[float], host_us: Optional[float]) -> HostCosts:
    """``costs`` with the count exchange (``fixed_us``, with a head chunk or without) and every chunk's host time
    (``host_us``, none of it before the first rows nor beside the last forwarding) replaced where given."""
    if fixed_us is not None:
        costs = replace(costs, fixed=fixed_us, nohead_fixed=None, fixed_ahead=None, nohead_fixed_ahead=None)
    if host_us is not None:
        h = host_us
        costs = replace(costs, dispatch_host=h, combine_host=h, dispatch_lead=0.0, dispatch_chunk=h, combine_chunk=h,
                        cached_host=h, cached_chunk=h, nohead_host=None if costs.nohead_host is None else h,
                        nohead_lead=0.0, dispatch_tail=0.0, nohead_tail=None,
                        nohead_chunk=None if costs.nohead_chunk is None else h, nohead_chunks_lead=None,
                        nohead_chunks_tail=None)
    return costs


def main(argv: list[str] | None = None) -> int:
    from .. import env

    parser = bench_parser("python -m epcomm bench internode", __doc__, experts=256, iters=10)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--ll-tokens", type=int, default=128)
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="ranks per domain (default: EPCOMM_RANKS_PER_NODE, else half the ranks)")
    parser.add_argument("--routings", default="uniform,group_limited")
    parser.add_argument("--max-groups", type=int, default=4, help="group-limited routing: domains per token")
    parser.add_argument("--domain-transport", default="auto")
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat the whole measurement; each row is the median of its rounds, with their range")
    parser.add_argument("--nic-gbps", type=float, default=50.0, help="the model's NIC rate per GPU (GB/s)")
    parser.add_argument("--nvlink-gbps", type=float, default=None,
                        help="the model's intranode rate (default: the measured intranode FP8 dispatch of "
                             "benchmarks/results/bench_dispatch_8ranks.md, 322 GB/s)")
    parser.add_argument("--fixed-us", type=float, default=None,
                        help="the model's count exchange per dispatch, before its rows cross (default: this run's)")
    parser.add_argument("--host-us", type=float, default=None,
                        help="the model's host issue time per chunk of a dispatch and of a combine (default: this "
                             "run's)")
    parser.add_argument("--model-only", action="store_true",
                        help="write the traffic model's table (with --fixed-us and --host-us, default 0, or the host "
                             "terms of --costs-from) and run nothing")
    parser.add_argument("--costs-from", default=None, metavar="CSV",
                        help="with --model-only: take the model's count exchange and host terms from an earlier run's "
                             "CSV (its rows by phase), e.g. to model another NIC rate with measured host costs")
    args = parser.parse_args(argv)
    per_node = args.ranks_per_node or env.ranks_per_node() or max(1, args.world_size // 2)
    opts = InternodeBenchOptions(args.tokens, args.ll_tokens, args.hidden, args.topk, args.experts, per_node,
                                 tuple(args.routings.split(",")), args.max_groups, args.domain_transport, args.iters,
                                 max(1, args.rounds))
    if args.costs_from and not args.model_only:
        parser.error("--costs-from goes with --model-only (a run measures its own host costs)")
    if args.model_only:
        if args.costs_from:
            import csv

            with open(args.costs_from, newline="") as f:
                costs = HostCosts.measured(list(csv.DictReader(f)))
            if costs == HostCosts():
                parser.error(f"--costs-from {args.costs_from}: no rows by phase with a count exchange in it (a "
                             f"`python -m epcomm bench internode` CSV from GPUs or CPUs)")
            source = f"host terms of {args.costs_from}"
        else:
            costs, source = HostCosts(), "no host terms"
        costs = _override(costs, args.fixed_us, args.host_us if args.costs_from else args.host_us or 0.0)
        model = model_rows(opts, args.nic_gbps, args.nvlink_gbps or 322.0, costs)
        notes = (f"Traffic model only (epcomm.bench.traffic.internode_estimate): NIC {args.nic_gbps:g} GB/s per GPU, "
                 f"intranode {args.nvlink_gbps or 322.0:g} GB/s, 8 GPUs per node, {source}: {costs.describe()}; "
                 f"DeepEP's published internode figures beside it (H800 + ConnectX-7 400 Gb/s). "
                 "DeepEP published low latency (128 tokens, us, dispatch / combine): "
                 + ", ".join(f"EP{k} {v[0]} / {v[1]}" for k, v in DEEPEP_PUBLISHED_LOW_LATENCY.items()))
        return finish(model, args.name or "internode_model", args.out, "internode traffic model", notes, None,
                      list(model[0].keys()))
    rows = run(bench_worker, args.world_size, opts)[0]
    name = args.name or f"bench_internode_{rows[0]['ranks']}ranks"
    nvlink = args.nvlink_gbps or 322.0
    costs = _override(HostCosts.measured(rows), args.fixed_us, args.host_us)
    model = model_rows(opts, args.nic_gbps, nvlink, costs)
    need = fixed_for_share(opts, args.nic_gbps, nvlink, costs, 64, 0.9)
    cached = best_estimate(opts, 64, 8, "fp8", args.nic_gbps, nvlink, 0, costs.model_args(CACHED_FP8)).nic_share(
        args.nic_gbps)
    targets = target_rows(rows)
    step = _ops_of(rows, STEP).get(EXPERT_GEMMS)
    condition = ("" if step is None else
                 f" It holds where the step's GPU work before a call outlasts the call's host issue time: on this "
                 f"device the expert GEMMs between a dispatch and its combine at this shape take {step:.0f} us "
                 f"(`{STEP}` row), against a combine's host time of {costs.combine_host:.0f} us in one chunk and a "
                 f"cached dispatch's {costs.cached_host:.0f} us; in a training step's backward no call synchronises "
                 f"the host at all (a combine's backward is a cached dispatch, a dispatch's a combine).")
    notes = ("Isolated calls (a barrier before each: the device waits for all of the call's host work), the median "
             "over iterations of the slowest rank"
             + (f"; the whole measurement ran {opts.rounds} times (implementations interleaved): each row is its "
                "median round, with the range over the rounds" if opts.rounds > 1 else "") + ". Rows `..."
             f"{AHEAD}` (GPUs; the paths the targets compare): each call timed as a model's step meets it, the device "
             "busy with matrix products while the host issues the call, the time from the products' end (a barrier "
             "lines the ranks up there) to the call's end (`epcomm.bench.timing.time_ahead`; the three paths' calls "
             "of an operation in turn in each iteration, the raw link's row named after it): the host's work is "
             "hidden up to the first host read (an exact-mode dispatch's count read), as in DeepEP's own benchmarks "
             "(back-to-back calls, its host ahead). Crossing rows "
             "per token: rows that leave their domain per source token (hierarchical: distinct remote domains of the "
             "token's experts; flat: distinct remote ranks; low-latency dispatch rows travel in FP8, cast at the "
             "source). "
             "Link GB/s: those bytes (BF16 2H, FP8 H + 4H/128 per row) per rank over the time. The raw link row moves "
             "exactly the hierarchical path's crossing bytes in one all_to_all over the rail group.\n\n"
             f"Traffic model (NIC {args.nic_gbps:g} GB/s per GPU, intranode {nvlink:g} GB/s, 8 GPUs per node, "
             f"{costs.describe()} (this run's, from the 'by phase' rows, unless given; the host's time before the "
             "count read is not counted: in a model's step the host runs ahead of its GPU there); "
             "DeepEP's published internode figures: H800 + ConnectX-7 400 Gb/s, group-limited routing; chunk ratio: "
             "each chunk's tokens over the previous one's, as the transport sets it from the forwarding's time over "
             f"the network's; the device's own copies of the rows charged at {HBM_GBPS:g} GB/s of HBM, read and "
             "write: an exact-mode dispatch's records copied out after they land (its rows are packed beside them "
             "and forwarded where they landed), a cached dispatch's packing of every chunk before the first "
             "crosses, a combine's sum of the partials where they land). "
             f"With this run's host issue times, the FP8 dispatch at EP64 (uniform routing) {need}; with a cached "
             f"handle (no count exchange: what DeepEP's published dispatch figures time, its tests tuning "
             f"`dispatch(x, handle=...)`) it reaches {cached:.0%}. The columns `(host ahead)` charge the host's time "
             f"as a model's step meets it (DeepEP's timing): a combine and a cached dispatch, which never "
             f"synchronise the host, none; an exact-mode dispatch its host time after the count read, as the other "
             f"columns do.{condition}\n\n"
             + format_table(model, list(model[0].keys())) +
             "\n\nDeepEP published low latency (128 tokens, us, dispatch / combine): "
             + ", ".join(f"EP{k} {v[0]} / {v[1]}" for k, v in DEEPEP_PUBLISHED_LOW_LATENCY.items())
             + ("\n\nThe split-node targets (at least 1.5x the flat all_to_all and 90% of the raw link's rate on the "
                "crossing bytes), from the rows below:\n\n" + format_table(targets) if targets else ""))
    print(format_table(model, list(model[0].keys())))
    if targets:
        print(format_table(targets))
    return finish(rows, name, args.out, "bench internode", notes, None,
                  ["routing", "impl", "op", "time_us", "crossing rows/token", "link GB/s"])
