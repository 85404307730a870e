"""The hierarchical (internode) path on CPU processes over gloo: ranks split into simulated nodes (domains) with
``ranks_per_node``, every mode against the reference (which composes the same two legs), the domain finding, the
agreement check of the first call and a rank that never joins the inter-domain leg."""

import pytest

from epcomm.testing import spawn
from epcomm.testing.checks import ExpertMajorCase, run_cases
from epcomm.topology.domains import find_domains
from test_buffer import low_latency_cases, normal_cases


def _assert_clean(results):
    problems = [f"rank {r}: {label}: {fails}" for r, res in enumerate(results) for label, fails in res]
    assert not problems, "\n".join(problems)


def internode_cases(world_size: int) -> list:
    """The Buffer suite's cases: uneven and empty ranks, FP8, bias, alignment, num_worst_tokens, skewed routing,
    everything to one expert (domains that receive nothing), -1 slots, a dispatch without top-k ids; and the
    expert-major layout (exact and num_worst_tokens)."""
    uneven = (0, 9, 23, 5)
    return normal_cases(world_size) + low_latency_cases(world_size) + [
        ExpertMajorCase(num_tokens=uneven, hidden=128, num_experts=24, topk=4, dtype="fp8", routing="dropped",
                        expert_alignment=4, bias=1, seed=41),
        ExpertMajorCase(num_tokens=17, hidden=40, num_experts=24, topk=5, dtype="fp32", worst=True, seed=42)]


def _cases_in_chunks(ctx, cases, local, chunks, ratio=None):
    from epcomm.transports.hierarchical import HierarchicalTransport

    HierarchicalTransport.pipeline_chunks, HierarchicalTransport.chunk_ratio = chunks, ratio
    failed = run_cases(ctx, cases, "alltoall", {"ranks_per_node": local})
    wrong = _ll_true_sources(ctx, local)
    return failed + ([("low-latency handle's true sources", wrong)] if wrong else [])


@pytest.mark.parametrize("domains,local,chunks,ratio", [(2, 2, 4, None), (3, 2, None, None), (2, 3, 3, 0.5),
                                                         (4, 1, 4, 0.5), (2, 2, 1, None)])
def test_hierarchical_matches_reference(domains, local, chunks, ratio):
    """Every case at several splits, and with the normal-mode calls moved in 1, 3 or 4 pipelined chunks (even, or
    each half the previous one's tokens), or in the counts the transport tries while it measures which is fastest
    (None); then the low-latency handle's true sources (``_ll_true_sources``)."""
    world = domains * local
    _assert_clean(spawn(_cases_in_chunks, world, internode_cases(world), local, chunks, ratio, device="cpu",
                        timeout_s=600))


def _ll_true_sources(ctx, local, transport="alltoall"):
    """Hierarchical low-latency dispatches; every received row's source rank (from the ``layout_range`` block it lies
    in) and token (``src_info``) against what every rank's routing sends to each local expert, computed here."""
    from dataclasses import replace

    from epcomm.buffer import Buffer
    from epcomm.testing.routing import make_inputs

    world, rank = ctx.world_size, ctx.rank
    buf = Buffer(ctx.group, transport=transport, ranks_per_node=local)
    num_experts, problems = 2 * world, []
    for num_tokens, t_max, routing, hook, seed in (((3, 0, 5, 2, 4, 1), 5, "dropped", False, 71),
                                                   ((6, 2, 0), 6, "skewed", True, 72),
                                                   (4, 4, "one_expert", False, 73)):
        inputs = make_inputs(seed, world, num_tokens, 128, num_experts, 3, routing)
        mine = inputs[rank].to(ctx.device)
        _, count, handle, _, hook_fn = buf.low_latency_dispatch(mine.x, mine.topk_idx, t_max, num_experts,
                                                                use_fp8=seed % 2 == 1, return_recv_hook=hook)
        if hook_fn is not None:
            hook_fn()
        count, handle = count.cpu(), replace(handle, src_info=handle.src_info.cpu(),
                                             layout_range=handle.layout_range.cpu())
        tag = f"{routing} T={t_max}"
        if tuple(handle.layout_range.shape) != (2, world, 2) or tuple(handle.src_info.shape) != (2, world * t_max):
            problems.append(f"{tag}: shapes {tuple(handle.layout_range.shape)} {tuple(handle.src_info.shape)}")
            continue
        for e in range(2):
            g = rank * 2 + e
            want = sorted((s, t) for s in range(world)
                          for t in (inputs[s].topk_idx == g).any(1).nonzero()[:, 0].tolist())
            c, ranges = int(count[e]), handle.layout_range[e].tolist()
            got, blocks = [], sorted((b, n) for b, n in ranges if n)
            for s, (b, n) in enumerate(ranges):
                tokens = handle.src_info[e, b:b + n].tolist()
                got += [(s, t) for t in tokens]
                if tokens != sorted(tokens):
                    problems.append(f"{tag}: expert {g}: source {s}'s tokens out of order: {tokens}")
            if c != len(want) or sorted(got) != want:
                problems.append(f"{tag}: expert {g}: count {c}, rows {sorted(got)}, want {want}")
            if [b for b, _ in blocks] != [sum(n for _, n in blocks[:i]) for i in range(len(blocks))]:
                problems.append(f"{tag}: expert {g}: blocks {ranges} do not tile the {c} rows")
            if bool((handle.src_info[e, c:] != -1).any()):
                problems.append(f"{tag}: expert {g}: src_info is not -1 past the count")
    buf.destroy()
    return problems


def _chunk_count(ctx, per_chunk_s: float, head_chunk=None):
    """Exact-mode dispatches across 2 domains while every chunk's inter-domain leg costs ``per_chunk_s`` more (a
    slow link's fixed cost): each call checked against the reference while the transport measures, then the
    count it chose and how it describes it (``head_chunk``: ``HierarchicalTransport.head_chunk``)."""
    import time

    from epcomm.transports.hierarchical import HierarchicalTransport

    HierarchicalTransport.head_chunk = head_chunk

    from epcomm.buffer import Buffer
    from epcomm.testing.checks import NormalCase, check_normal

    buf = Buffer(ctx.group, transport="alltoall", ranks_per_node=2)
    rt = buf.runtime
    rail = rt.rail.dispatch

    def slow_rail(*args, **kwargs):
        time.sleep(per_chunk_s)
        return rail(*args, **kwargs)

    rt.rail.dispatch = slow_rail
    case = NormalCase(num_tokens=(40, 33, 0, 17), hidden=64, num_experts=8, topk=3, dtype="bf16", seed=5)
    failures, calls = [], 0
    while rt._tuner.chosen is None and calls < 30 and "(EPCOMM_INTERNODE_CHUNKS)" not in rt.chunks_description():
        failures += check_normal(ctx, buf, case).failures
        calls += 1
    failures += check_normal(ctx, buf, case).failures  # in the chosen count
    out = (failures, rt._tuner.chosen, rt._tuner.seen, rt.chunks_description(), buf.runtime.describe())
    buf.destroy()
    return out


def _host_reads(ctx, transport, chunks):
    """An exact-mode dispatch (after a first one) at a fixed chunk count, checked against the reference while every
    host read of counts and every collective is counted: ``(failures, host reads, collectives by name)``."""
    import collections

    import torch.distributed as dist

    from epcomm.buffer import Buffer
    from epcomm.testing.checks import NormalCase, check_normal
    from epcomm.transports import alltoall, faults, hierarchical, nvlink
    from epcomm.transports.hierarchical import HierarchicalTransport

    HierarchicalTransport.pipeline_chunks = chunks
    buf = Buffer(ctx.group, transport=transport, ranks_per_node=2)
    case = NormalCase(num_tokens=(13, 0, 21, 8), hidden=128, num_experts=8, topk=3, dtype="fp8", seed=9)
    failures = check_normal(ctx, buf, case).failures
    reads, calls = [0], collections.Counter()
    saved = {"host_list": faults.host_list, "read_later": alltoall.AllToAllTransport._read_later,
             "faults.read_later": faults.read_later,
             **{n: getattr(dist, n) for n in ("all_to_all_single", "all_gather_into_tensor", "all_gather_single",
                                              "all_reduce", "all_gather") if hasattr(dist, n)}}

    def counted(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return run

    def host_list(*args, **kwargs):
        reads[0] += 1
        return saved["host_list"](*args, **kwargs)

    def read_later(self, t):
        reads[0] += 1
        return saved["read_later"](self, t)

    def read_later_of_faults(*args, **kwargs):
        reads[0] += 1
        return saved["faults.read_later"](*args, **kwargs)

    faults.host_list, nvlink.host_list, alltoall.AllToAllTransport._read_later = host_list, host_list, read_later
    faults.read_later = read_later_of_faults
    for name in saved:
        if name not in ("host_list", "read_later", "faults.read_later"):
            setattr(dist, name, counted(name, saved[name]))
    gather = hierarchical._all_gather_single
    hierarchical._all_gather_single = counted("all_gather_single", gather)
    before = dict(calls)
    failures += check_normal(ctx, buf, case).failures
    hierarchical._all_gather_single = gather
    for name, fn in saved.items():
        if name not in ("host_list", "read_later", "faults.read_later"):
            setattr(dist, name, fn)
    faults.host_list, nvlink.host_list, alltoall.AllToAllTransport._read_later = (saved["host_list"],) * 2 + (
        saved["read_later"],)
    faults.read_later = saved["faults.read_later"]
    buf.destroy()
    return failures, reads[0], {k: v - before.get(k, 0) for k, v in calls.items()}


@pytest.mark.parametrize("chunks", [1, 3])
def test_both_legs_counts_in_one_exchange(chunks):
    """An exact-mode dispatch learns both legs' counts of every chunk in one exchange and reads them once: the legs
    make no count exchange or host read of their own (``KnownCounts``), so the domain leg's launches need not wait
    for the inter-domain rows. Counted over the check's dispatch, cached dispatch and two combines (which read
    nothing)."""
    for failures, reads, calls in spawn(_host_reads, 4, "alltoall", chunks, device="cpu", timeout_s=300):
        assert failures == [], failures
        assert reads == 1, (reads, calls)  # the dispatch's one read; combines and cached dispatches read nothing
        assert calls.get("all_gather_single") == 1, calls  # the domain's sums


def _lead_marks(ctx, chunks):
    """One exact-mode dispatch of ``chunks`` chunks (no head) with a phase log: ``(the host's milestones, the first
    rows' leg's begin, the rows' collectives marked after the read, the leg's hook after the log is dropped)``."""
    from epcomm.buffer import Buffer
    from epcomm.testing.routing import make_inputs
    from epcomm.transports.hierarchical import COLLECTIVE_MILESTONE, ROWS_PHASE, HierarchicalTransport, host_milestones

    HierarchicalTransport.pipeline_chunks, HierarchicalTransport.head_chunk = chunks, False
    buf = Buffer(ctx.group, transport="alltoall", ranks_per_node=2)
    mine = make_inputs(9, ctx.world_size, 13, 64, 8, 3)[ctx.rank]
    layout = buf.get_dispatch_layout(mine.topk_idx, 8)
    kw = dict(num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
              topk_idx=mine.topk_idx, topk_weights=mine.topk_weights)
    buf.dispatch(mine.x, **kw)
    rt = buf.runtime
    rt.phase_log = []
    buf.dispatch(mine.x, **kw)
    log, rt.phase_log = rt.phase_log, None
    marks = host_milestones(log)
    rows = min(began for phase, _, _, _, began in log if phase == ROWS_PHASE)
    issued = [began for phase, _, _, _, began in log if phase == COLLECTIVE_MILESTONE and began > marks["counts read"]]
    hook = rt.rail.on_collective
    buf.destroy()
    return marks, rows, issued, hook


@pytest.mark.parametrize("chunks", [1, 2])
def test_lead_ends_at_the_rows_collective(chunks):
    """The benchmarks' lead (the host's time from the count read to the first rows' collective, ``host_milestones``)
    ends where the inter-domain leg issues that collective (``AllToAllTransport.on_collective``, set while a phase
    log is kept), after the rows' leg began (its request's views and checks are in the lead), one mark per chunk;
    the steps marked within it (``LEAD_STEPS``) come in the order the call reaches them."""
    from epcomm.transports.hierarchical import LEAD_COUNTS, LEAD_REQUEST

    for marks, rows, issued, hook in spawn(_lead_marks, 4, chunks, device="cpu", timeout_s=300):
        assert len(issued) >= chunks and marks["rows issued"] == min(issued), (marks, issued)
        assert marks["counts read"] < rows <= marks["rows issued"], (marks, rows)
        assert hook is None
        # the lead's steps, in the order reached within it: the counts taken from the read, then the chunk's request
        # (this path's: the portable domain leg takes no gated call, and on CPUs no stream is switched)
        steps = marks["lead steps"]
        assert [s for s, _ in steps] == [LEAD_COUNTS, LEAD_REQUEST], steps
        assert marks["counts read"] <= steps[0][1] <= steps[1][1] <= marks["rows issued"], (marks, steps)


def _packed_ahead(ctx, chunks, head_share):
    """Exact-mode dispatches with the inter-domain leg on its kernel path (the Triton interpreter here), checked
    against the reference while the order of the leg's local work and the count read is recorded: ``(failures,
    events)``, events ``"prepared"`` (what ``Transport.prepare`` made of a chunk), ``"copied"`` (the counts' copy to
    the host issued), ``"read"`` (the host's read of that copy), ``"planned"`` (a plan kernel of the leg), ``"sent
    ahead"`` and ``"received ahead"`` (the head chunk's rows sent, and made a result once the counts are known)."""
    from epcomm.buffer import Buffer
    from epcomm.testing.checks import NormalCase, check_normal
    from epcomm.transports import alltoall, faults
    from epcomm.transports.hierarchical import HierarchicalTransport

    HierarchicalTransport.pipeline_chunks = chunks
    HierarchicalTransport.head_share = head_share
    buf = Buffer(ctx.group, transport="alltoall", ranks_per_node=2)
    case = NormalCase(num_tokens=(11, 0, 17, 6), hidden=128, num_experts=8, topk=3, dtype="fp8", routing="dropped",
                      bias=1, seed=13)
    failures = check_normal(ctx, buf, case).failures  # first call of its kind
    rail, events = buf.runtime.rail, []  # (the domain leg is a portable transport too: its calls are not recorded)
    saved = (alltoall.AllToAllTransport.prepare, alltoall.AllToAllTransport._plan_gpu, faults.read_later,
             alltoall.AllToAllTransport.send_ahead, alltoall.AllToAllTransport.receive_ahead)

    def send_ahead(self, req, capacity):
        out = saved[3](self, req, capacity)
        events.append("sent ahead")
        return out

    def receive_ahead(self, ahead, known):
        events.append("received ahead")
        return saved[4](self, ahead, known)

    def prepare(self, req):
        out = saved[0](self, req)
        if self is rail:
            events.append("prepared" if out is not None else "nothing prepared")
        return out

    def plan_gpu(self, req, ctl):
        if self is rail:
            events.append("planned")
        return saved[1](self, req, ctl)

    def read_later(*args, **kwargs):
        events.append("copied")
        read = saved[2](*args, **kwargs)

        def recorded():
            events.append("read")
            return read()

        return recorded

    alltoall.AllToAllTransport.prepare, faults.read_later = prepare, read_later
    alltoall.AllToAllTransport._plan_gpu = plan_gpu
    alltoall.AllToAllTransport.send_ahead, alltoall.AllToAllTransport.receive_ahead = send_ahead, receive_ahead
    rt = buf.runtime
    domain_combine, outer_combine, chunk_handles = rt.domain.combine, rt.combine, []

    def outer(req):  # (the combined handle's domain-leg handles, one per chunk)
        chunk_handles[:] = req.handle.state.domain
        return outer_combine(req)

    def combine(req):  # the combine's chunks, in the order it sums them (their places in the handle)
        events.append(("summed", req.x.size(0), [h is req.handle for h in chunk_handles].index(True)))
        return domain_combine(req)

    rt.combine, rt.domain.combine = outer, combine
    try:
        failures += check_normal(ctx, buf, case).failures
    finally:
        (alltoall.AllToAllTransport.prepare, alltoall.AllToAllTransport._plan_gpu, faults.read_later,
         alltoall.AllToAllTransport.send_ahead, alltoall.AllToAllTransport.receive_ahead) = saved
    buf.destroy()
    return failures, events


@pytest.mark.parametrize("chunks,head_share", [(1, 0.125), (1, 0.0), (3, 0.0)])
def test_rail_rows_packed_while_the_counts_travel(chunks, head_share, monkeypatch):
    """The inter-domain leg's plan and pack kernels (local work) of every chunk are enqueued before the count read,
    after the counts' copy to the host (the read waits for the counts alone, not for the packing), and the leg's
    dispatch uses them (no second plan): once the counts are read only the rows' collective is left before the rows
    cross. The head chunk (the second dispatch of a Buffer; 3 slots per domain here, 17 tokens at most in the first)
    is planned, packed and sent once the counts' copy is issued (the read waits for the counts, not for the host's
    work on the head), before the other chunks are prepared, and made a result after the read. One chunk without a
    head (``_first_rows``): the inter-domain leg's own counts copied first, then its packing, then the domain's
    counts, read in that order (the rows issued between the two reads). A combine sums the chunks smallest first.
    Bit-exact against the reference, FP8 with dropped slots and an empty rank."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for failures, events in spawn(_packed_ahead, 4, chunks, head_share, device="cpu", timeout_s=600):
        assert failures == [], failures
        # the check's dispatch: the counts' copy, (the head sent,) one prepared chunk each (with a plan), then its one
        # count read (and the head's result); nothing planned after
        head = head_share > 0
        expected = ["copied"] + (["planned", "sent ahead"] if head else []) + ["planned", "prepared"] * chunks + \
            ["read"] + (["received ahead"] if head else [])
        if chunks == 1 and not head:  # (the leg's words, its packing, the domain's counts; then both read)
            expected = ["copied", "planned", "prepared", "copied", "read", "read"]
        assert events[:len(expected)] == expected, events
        assert "planned" not in events[len(expected):] and "sent ahead" not in events[len(expected):], events
        # the combines sum their chunks in the same order on every rank, smallest first by plan: a head chunk of 3
        # tokens before the one chunk after it (up to 14 tokens); else the last chunk first
        summed = [e[2] for e in events if isinstance(e, tuple)]  # (the check's combine)
        assert summed == ([0, 1] if head else list(reversed(range(chunks)))), events


def _variants_after_the_first_call(ctx, transport, warm):
    """Exact-mode calls (dispatch, cached dispatch, combine; checked against the reference) on one Buffer: a first
    round, then rounds whose token counts change (odd counts, a rank that becomes empty and one that stops being, the
    head chunk, empty chunks): ``([(round, kernel, what differs from its earlier variants, where)], the checks'
    failures)`` for every kernel variant (``kernels.launch.Launcher``'s key: Triton's specialisation) first launched
    after the first round. In 3 chunks; with ``warm``, the first round is ``Buffer.warmup`` of the calls' shape, the
    chunk count is the tuner's (its first calls try 1, 2 and 4 chunks) and the last two rounds' cached dispatches go
    through the chunks one by one (as where the domain's storage cannot hold the merged rows)."""
    import traceback

    from epcomm.buffer import Buffer
    from epcomm.kernels import launch as L
    from epcomm.testing.checks import NormalCase, check_normal
    from test_hardening_device import _variant  # (the intranode counterpart's key of a variant)

    from epcomm.transports.hierarchical import HierarchicalTransport

    HierarchicalTransport.pipeline_chunks = None if warm else 3  # (the tuner's counts: other kinds of call)
    seen, new, stage = set(), [], [0]
    orig = L.Launcher.__call__

    def call(self, grid, args, kwargs):
        key = _variant(self, args, kwargs)
        if key not in seen:
            if stage[0]:  # what differs from the nearest variant of this kernel launched so far
                def diff(o):
                    return ([(k, v, dict(o[1]).get(k)) for k, v in key[1] if dict(o[1]).get(k) != v]
                            + [(i, a, b) for i, (a, b) in enumerate(zip(key[2], o[2])) if a != b])

                near = min((diff(o) for o in seen if o[0] == key[0]), key=len, default=key[1:])
                new.append((stage[0], key[0], near, [f"{f.name}:{f.lineno}" for f in traceback.extract_stack()
                                                     if "/epcomm/" in f.filename][-6:]))
            seen.add(key)
        return orig(self, grid, args, kwargs)

    L.Launcher.__call__ = call
    try:
        if transport == "nvlink":  # (the class: its kernels under the interpreter, on a heap in shared memory)
            from epcomm.transports.nvlink import NVLinkTransport

            buf = Buffer(ctx.group, transport=NVLinkTransport, num_nvl_bytes=1 << 23, ranks_per_node=2)
        else:
            buf = Buffer(ctx.group, transport=transport, ranks_per_node=2)
        failures = []
        plans = [(9, 5, 13, 6), (12, 0, 7, 16), (3, 10, 0, 9), (16, 16, 16, 1), (1, 2, 3, 4), (0, 7, 5, 11),
                 (13, 1, 8, 0)]
        if warm:
            buf.warmup(128, 8, 3, 8, dtypes=("fp8",))
            stage[0] = 1
        for i, tokens in enumerate(plans):
            if warm and i == len(plans) - 2:  # storage that cannot hold the merged rows: the chunks one by one
                buf.runtime.domain.merge_cached = lambda *args, **kwargs: None
            case = NormalCase(num_tokens=tokens, hidden=128, num_experts=8, topk=3, dtype="fp8", routing="dropped",
                              seed=40 + stage[0])
            failures += check_normal(ctx, buf, case).failures
            stage[0] += 1
        buf.destroy()
    finally:
        L.Launcher.__call__ = orig
    return new, failures


@pytest.mark.parametrize("transport,warm", [("alltoall", False), ("nvlink", True)])
def test_no_kernel_variant_first_launched_after_the_first_call(transport, warm, monkeypatch):
    """Across nodes, no kernel variant is first launched after a Buffer's first calls (or, ``warm``, after
    ``Buffer.warmup``, whatever chunk count the tuner then tries): a variant is compiled and its module loaded at its
    first launch, and loading waits for the device, so behind a collective that hangs (a peer lost) the host would
    block where no timeout reaches it. Token counts that change between calls (chunk bounds, the head chunk, empty
    chunks and empty ranks) must not select new variants (pointer alignment, integer widths, strides); interpreter
    runs of both legs' kernels, 2 nodes of 2 ranks, FP8 with dropped slots."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for new, failures in spawn(_variants_after_the_first_call, 4, transport, warm, device="cpu", timeout_s=900):
        assert failures == [], failures
        assert new == [], new


def _fused_rows(ctx):
    """The portable transport with and without ``fuse_rows`` (rows with their records or weights in one all_to_all):
    each checked against the reference, and its all_to_all calls counted."""
    import torch.distributed as dist

    from epcomm.buffer import Buffer
    from epcomm.testing.checks import NormalCase, check_normal

    case = NormalCase(num_tokens=(7, 0, 12), hidden=128, num_experts=6, topk=2, dtype="fp8", bias=1, seed=21)
    a2a, out = dist.all_to_all_single, []
    for fused in (False, True):
        buf = Buffer(ctx.group, transport="alltoall")
        buf.runtime.fuse_rows = fused
        calls = [0]

        def counted(*args, **kwargs):
            calls[0] += 1
            return a2a(*args, **kwargs)

        dist.all_to_all_single = counted
        try:
            out.append((check_normal(ctx, buf, case).failures, calls[0]))
        finally:
            dist.all_to_all_single = a2a
        buf.destroy()
    return out


def test_rows_and_records_in_one_collective():
    """``AllToAllTransport.fuse_rows`` (set on the inter-domain leg): the same results as one all_to_all per tensor,
    with fewer collectives (a dispatch's rows and records, an FP8 cached dispatch's rows and scales, a combine's rows
    and weights: one each)."""
    for (plain, plain_calls), (fused, fused_calls) in spawn(_fused_rows, 3, device="cpu", timeout_s=300):
        assert plain == [] and fused == [], (plain, fused)
        # the count exchange, then rows + records, FP8 rows + scales, rows + weights: 7 collectives, fused 4
        assert (plain_calls, fused_calls) == (7, 4), (plain_calls, fused_calls)


def test_parts_side_by_side_are_sent_as_they_are():
    """``_side_by_side``: parts that fill one buffer's rows in order without a gap (a combine's partials and weights as
    the one-sided node leg writes them; an exact dispatch's rows and records as its pack writes them, with up to 15
    bytes of padding after them) are that buffer's rows, sent without a copy, with one row or none too; parts apart,
    out of order, with a gap or of other row counts are not (nor need rows of none be: nothing to copy)."""
    import torch

    from epcomm.transports.alltoall import _side_by_side

    for n in (1, 5):
        buf = torch.arange(n * 40, dtype=torch.int64).to(torch.uint8).view(n, 40)
        x = torch.as_strided(buf.view(torch.bfloat16), (n, 12), (20, 1))
        w = torch.as_strided(buf.view(torch.float32), (n, 4), (10, 1), 6)
        got = _side_by_side([x, w])
        assert got is not None and got.data_ptr() == buf.data_ptr() and tuple(got.shape) == (n, 40), n
        assert torch.equal(got, buf) and got.is_contiguous()
        assert _side_by_side([w, x]) is None  # (out of order)
        assert _side_by_side([x, torch.as_strided(buf.view(torch.float32), (n, 3), (10, 1), 7)]) is None  # (a gap)
        # padding after the last part, less than 16 bytes (an exact dispatch's rows and records packed in 16-byte
        # rows): the whole rows, padding too; 16 bytes or more: not
        got = _side_by_side([x, torch.as_strided(buf.view(torch.float32), (n, 3), (10, 1), 6)])
        assert got is not None and tuple(got.shape) == (n, 40) and torch.equal(got, buf), n
        assert _side_by_side([torch.as_strided(buf.view(torch.bfloat16), (n, 4), (20, 1)),
                              torch.as_strided(buf.view(torch.float32), (n, 2), (10, 1), 2)]) is None  # (24 bytes)
    buf = torch.zeros(4, 40, dtype=torch.uint8)
    x = torch.as_strided(buf.view(torch.bfloat16), (4, 12), (20, 1))
    assert _side_by_side([x, torch.zeros(4, 4)]) is None  # (another buffer)
    assert _side_by_side([x, torch.as_strided(buf.view(torch.float32), (3, 4), (10, 1), 6)]) is None  # (3 rows)


def _one_rank(ctx):
    """The portable transport over a group of one rank (a domain of one GPU): every mode against the reference while
    its all_to_all calls are counted."""
    import torch.distributed as dist

    from epcomm.testing.checks import LowLatencyCase, NormalCase, run_cases

    cases = [NormalCase(num_tokens=9, hidden=128, num_experts=4, topk=2, dtype="fp8", routing="dropped", bias=1,
                        seed=22),
             NormalCase(num_tokens=5, hidden=64, num_experts=4, topk=3, dtype="bf16", worst=True, seed=23),
             LowLatencyCase(num_tokens=6, max_tokens=8, hidden=128, num_experts=4, topk=2, hook=True, seed=24)]
    a2a, calls = dist.all_to_all_single, [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return a2a(*args, **kwargs)

    dist.all_to_all_single = counted
    try:
        failed = run_cases(ctx, cases, "alltoall", {})
    finally:
        dist.all_to_all_single = a2a
    return failed, calls[0]


@pytest.mark.parametrize("kernels", [False, True])
def test_one_rank_group_moves_nothing(kernels, monkeypatch):
    """A group of one rank (the domain leg where a node has one GPU, as in the 2-1 split): the portable transport's
    rows are its received rows, with no collective and no copy around one, on the torch path and on the kernel path
    (the Triton interpreter here); dispatch, cached dispatch and combine (FP8, -1 slots, bias, num_worst_tokens) and a
    low-latency dispatch and combine with a receive hook (its deferred collectives' works) against the reference."""
    if kernels:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    failed, calls = spawn(_one_rank, 1, device="cpu", timeout_s=300)[0]
    assert failed == [], failed
    assert calls == 0, calls


def _rail_per_expert(ctx):
    """An exact-mode dispatch in 2 chunks: each chunk's inter-domain handle's received per-expert counts (taken from
    the count exchange's sums on the device, no host copy) against the pairs its rail peers' routing sends to each
    of this domain's experts in that chunk, computed here; and the domain's portable leg fusing rows and records."""
    from epcomm.buffer import Buffer
    from epcomm.testing.routing import make_inputs
    from epcomm.transports.hierarchical import HierarchicalTransport

    HierarchicalTransport.pipeline_chunks, HierarchicalTransport.chunk_ratio = 2, 1.0
    local, num_experts, n = 2, 16, 9
    buf = Buffer(ctx.group, transport="alltoall", ranks_per_node=local)
    rt = buf.runtime
    e_dom = num_experts // rt.num_domains
    problems = []
    for routing in ("skewed", "dropped"):  # (dropped: -1 slots)
        inputs = make_inputs(31, ctx.world_size, n, 64, num_experts, 3, routing)
        mine = inputs[ctx.rank]
        lay = buf.get_dispatch_layout(mine.topk_idx, num_experts)
        handle = buf.dispatch(mine.x, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                              num_tokens_per_expert=lay[2], topk_idx=mine.topk_idx, topk_weights=mine.topk_weights)[4]
        bounds = handle.state.bounds
        # (at a multiple of 4 tokens: 3 top-k weights of 4 bytes and a row of 4 ranks' bools per token)
        if len(bounds) != 2 or bounds[0][0] != 0 or bounds[1] != (bounds[0][1], n) or bounds[0][1] != 8:
            problems.append(f"chunk bounds {bounds}")
        for c, (a, b) in enumerate(bounds):
            want = [0] * e_dom
            for s in rt.rail_ranks:  # this rank's rail peers (itself included), every one with n tokens
                ids = inputs[s].topk_idx[a:b]
                for e in range(e_dom):
                    want[e] += int((ids == rt.domain_index * e_dom + e).sum())
            got = handle.state.rail[c].num_recv_tokens_per_expert.tolist()
            if got != want:
                problems.append(f"{routing}, chunk {c}: per-expert {got}, want {want}")
    if not rt.domain.fuse_rows:
        problems.append("the domain's portable leg moves rows and records in separate collectives")
    buf.destroy()
    HierarchicalTransport.pipeline_chunks, HierarchicalTransport.chunk_ratio = None, None
    return problems


def test_rail_per_expert_counts_from_the_exchange():
    """The inter-domain leg's received per-expert counts come from the count exchange's device sums: right in every
    chunk (skewed routing; dropped routing, with -1 slots), and the domain's portable leg fuses its rows and
    records."""
    for problems in spawn(_rail_per_expert, 4, device="cpu", timeout_s=300):
        assert problems == [], problems


def test_known_counts_from_the_exchange():
    """How a rank reads both legs' counts from the one exchange's host list (``_Counts``: the inter-domain leg's at
    once, the domain leg's when first asked): 2 domains of 2 ranks, 1 chunk, 4 experts per domain; and
    ``KnownCounts`` refuses counts that cannot be."""
    import numpy as np

    from epcomm.transports.base import DispatchRequest, KnownCounts
    from epcomm.transports.hierarchical import _Counts

    def read(host, C, L, D, e_dom, l):  # ([(rail, domain, sources)] per chunk, most tokens)
        counts = _Counts(host, C, L, D, e_dom, l)
        return ([(counts.rail_known(c), d, s) for c, (d, s) in enumerate(counts.domain)],
                _Counts.most_of(np.asarray(host), C, L, D, e_dom))

    # the domain's gathered rows per forwarding rank f: [tokens it forwards, rows to rank 0, rows to rank 1,
    # pairs per expert of the domain (4), the most tokens of its rail peers, rows from source domain 0 to rank 0 and
    # to rank 1, from source domain 1 to rank 0 and to rank 1]; then this rank's rail sends [D] and receives [D]
    every = [[5, 3, 4, 1, 2, 3, 4, 9, 1, 3, 2, 1], [6, 2, 5, 5, 6, 7, 8, 12, 0, 4, 2, 1]]
    host = every[0] + every[1] + [7, 8] + [2, 3]
    assert "domain" not in vars(_Counts(host, 1, 2, 2, 4, 0))  # (made when first asked: after the rows' collective)
    # the read as the device's words (a numpy int32 array): chunk 0's request takes its counts from the flat words,
    # without the [L, C, W] array (made when first asked) or the most tokens (the next call's head: ``most_of``)
    counts = _Counts(np.array(host, dtype=np.int32), 1, 2, 2, 4, 0)
    assert counts.rail_known(0) == KnownCounts((7, 8), (2, 3), (1, 2, 3, 4))
    assert not {"_every", "domain"} & set(vars(counts))
    assert _Counts.most_of(counts._host, 1, 2, 2, 4) == 12 and counts.domain == _Counts(host, 1, 2, 2, 4, 0).domain
    ((rail, domain, sources),), most = read(host, 1, 2, 2, 4, 0)
    assert most == 12
    assert rail == KnownCounts((7, 8), (2, 3), (1, 2, 3, 4))
    assert domain == KnownCounts((3, 4), (3, 2), (1 + 5, 2 + 6), num_tokens_max=6, max_pair=5)
    assert domain.num_recv_tokens == 5
    assert sources == (1, 2, 0, 2)  # (by forwarder, then source domain)
    ((_, domain1, sources1),), _ = read(host, 1, 2, 2, 4, 1)  # the same gather read by local index 1
    assert domain1 == KnownCounts((2, 5), (4, 5), (3 + 7, 4 + 8), num_tokens_max=6, max_pair=5)
    assert sources1 == (3, 1, 4, 1)
    # several chunks, domains and forwarders: every count from its definition
    import random

    rng = random.Random(5)
    C, L, D, e_dom = 3, 3, 4, 6
    V = 2 + L + e_dom
    W = V + D * L
    host = [rng.randrange(40) for _ in range(L * C * W + 2 * D * C)]
    at = lambda f, c, i: host[(f * C + c) * W + i]  # noqa: E731 - forwarder f's row of chunk c
    sends, recvs = host[L * C * W:L * C * W + D * C], host[L * C * W + D * C:]
    for l in range(L):
        known, most = read(host, C, L, D, e_dom, l)
        assert most == max(at(f, 0, V - 1) for f in range(L))
        for c, (rail, domain, sources) in enumerate(known):
            assert sources == tuple(at(f, c, V + d * L + l) for f in range(L) for d in range(D))
            assert rail == KnownCounts(tuple(sends[d * C + c] for d in range(D)),
                                       tuple(recvs[d * C + c] for d in range(D)),
                                       tuple(at(l, c, 1 + L + e) for e in range(e_dom)))
            assert domain == KnownCounts(
                tuple(at(l, c, 1 + j) for j in range(L)), tuple(at(f, c, 1 + l) for f in range(L)),
                tuple(sum(at(f, c, 1 + L + l * (e_dom // L) + e) for f in range(L)) for e in range(e_dom // L)),
                num_tokens_max=max(at(f, c, 0) for f in range(L)),
                max_pair=max(at(f, c, 1 + j) for f in range(L) for j in range(L)))
        # a gated call's: the merged domain call's bounds from the host lists alone (before ``domain`` is made), and
        # each chunk's inter-domain request and landing rows made when first asked
        counts = _Counts(host, C, L, D, e_dom, l)
        assert "domain" not in vars(counts)
        counts.with_legs([DispatchRequest(*([None] * 13)) for _ in range(C)], None)
        for c, (rail, _, _) in enumerate(known):
            assert sum(counts.rail_lists(c)[1]) == rail.num_recv_tokens  # (the rows it lands: _gated_first)
        assert [counts.rail(c).known for c in (2, 0, 1)] == [known[c][0] for c in (2, 0, 1)]
        assert counts.rail(1) is counts.rail(1)  # (made once)
    with pytest.raises(ValueError, match=r"^KnownCounts: one non-negative count per rank"):
        KnownCounts((1, 2), (3,), ())
    with pytest.raises(ValueError, match=r"^KnownCounts: "):
        KnownCounts((1, -2), (3, 0), ())


_ROWS_IN_PLACE = """
import random
import torch
from epcomm.kernels.ep import SUMMARY_HEAD, launch_merged_needs, launch_rows_merged, summary_words
from epcomm.transports.base import KnownCounts
from epcomm.transports.hierarchical import LANDING_ROWS, _Counts, _canonical_order, _rows_in_place
from epcomm.transports.nvlink import _known_summary

rng = random.Random(3)
for L, D in ((2, 2), (3, 2), (1, 4), (4, 3), (2, 1), (8, 8), (5, 7)):
    for chunks in (1, 2, 4):
        # this rank's rows from source rank d * L + f in chunk c (the source's tokens of chunk c come after chunk
        # c - 1's)
        sources = [[rng.choice((0, 0, 1, 2, 5, 9)) for _ in range(L * D)] for _ in range(chunks)]
        # the domain's gathered counts [L * chunks, W]: other columns first (random), then by source domain, then rank
        col0 = rng.randrange(0, 6)
        counts = torch.randint(-5, 50, (L * chunks, col0 + D * L), dtype=torch.int32)
        local = rng.randrange(L)
        for c in range(chunks):
            for f in range(L):
                for d in range(D):
                    counts[f * chunks + c, col0 + d * L + local] = sources[c][f * D + d]
        # every chunk's rows (each by forwarder, then source domain), chunk after chunk: source rank and token
        src_rank = torch.tensor([d * L + f for c in range(chunks) for f in range(L) for d in range(D)
                                 for _ in range(sources[c][f * D + d])], dtype=torch.int64)
        token = torch.tensor([sum(sources[e][f * D + d] for e in range(c)) + i for c in range(chunks) for f in range(L)
                              for d in range(D) for i in range(sources[c][f * D + d])], dtype=torch.int64)
        # the stable sort by source rank keeps each source's tokens in order (chunk after chunk)
        want = _canonical_order(src_rank, L * D)[1]
        got = []
        for c in range(chunks):
            part = torch.full((sum(sources[c]),), -7, dtype=torch.int64)
            _rows_in_place(counts, part, col0 + local, L, D, c, chunks)
            got.append(part)
        got = torch.cat(got)
        assert got.tolist() == want.tolist(), (L, D, chunks, sources)
        # the chunks merged into one call (launch_rows_merged): ``back`` is the chunks' maps one after another, and
        # the merged call's rows (by forwarder, then chunk, then source domain) land where their chunk's map puts them
        back, merged = torch.full_like(got, -7), torch.full_like(got, -7)
        summaries = torch.empty(chunks + 1, summary_words(L, 1), dtype=torch.int32)
        launch_rows_merged(counts, merged, back, summaries, counts.stride(0) * chunks, col0 + local, L, D, chunks,
                           counts.stride(0), local, 1)
        assert back.tolist() == got.tolist(), (L, D, chunks)
        first = [sum(sum(sources[e]) for e in range(c)) for c in range(chunks)]  # each chunk's first row in ``back``
        assert merged.tolist() == [
            got[first[c] + sum(sources[c][:f * D]) + i].item() for f in range(L) for c in range(chunks)
            for i in range(sum(sources[c][f * D:(f + 1) * D]))], (L, D, chunks)
        out = torch.empty_like(src_rank)
        out[got] = src_rank * 1000 + token
        assert out.tolist() == sorted(out.tolist()), (L, D, chunks)
        # the same launch's summary of the domain leg's counts, as the host makes it from the counts it read: the
        # gathered rows laid out as _exchange_counts gathers them ([rows, rows per rank, rows per expert of the
        # domain, the most tokens], then the sources' columns), random counts
        for e_local in (1, 3):
            V = 2 + L + e_local * L
            every = torch.randint(0, 40, (L * chunks, V + D * L), dtype=torch.int32)
            host = every.view(-1).tolist() + [0] * (2 * D * chunks)
            domain = _Counts(host, chunks, L, D, e_local * L, local).domain
            for c in range(chunks):
                summary = torch.full((SUMMARY_HEAD + 3 * L + e_local,), -7, dtype=torch.int32)
                _rows_in_place(every, torch.empty(0, dtype=torch.int64), V + local, L, D, c, chunks, summary, local,
                               e_local)
                assert summary.tolist() == _known_summary(domain[c][0], L, e_local, True), (L, D, chunks, c)
            # and the merged launch's: each chunk's, then the merged call's (the chunks' counts summed, as
            # _gated sums the chunks' KnownCounts)
            m = sum(sum(d[1]) for d in domain)
            summaries = torch.full((chunks + 1, summary_words(L, e_local)), -7, dtype=torch.int32)
            maps = (torch.empty(m, dtype=torch.int64), torch.empty(m, dtype=torch.int64))
            launch_rows_merged(every, *maps, summaries, every.stride(0) * chunks, V + local, L, D, chunks,
                               every.stride(0), local, e_local)
            # into maps longer than the rows (a call issued before its count read, sized by bounds): the same maps
            longer = (torch.full((m + 37,), -7, dtype=torch.int64), torch.full((m + 37,), -7, dtype=torch.int64))
            launch_rows_merged(every, *longer, summaries, every.stride(0) * chunks, V + local, L, D, chunks,
                               every.stride(0), local, e_local)
            assert [t[:m].tolist() for t in longer] == [t.tolist() for t in maps], (L, D, chunks)
            # what that call's domain leg needs (_Counts.needs): the same numbers from every rank's reading of the
            # counts, each the largest over the domain's ranks or the chunks' sums of the domain leg's bounds (the same
            # on every rank), made on the device (launch_merged_needs) and read after the sends and receives
            views = [_Counts(host, chunks, L, D, e_local * L, g) for g in range(L)]
            land = max(sum(-(-every[f * chunks + c, 0].item() // 16) * 16 for c in range(chunks)) for f in range(L))
            recv = max(sum(sum(d[0].num_recv_tokens_per_rank) for d in v.domain) for v in views)
            want = (land, recv) + tuple(sum(getattr(d[0], k) for d in domain) for k in ("max_pair", "num_tokens_max"))
            needs = torch.full((4,), -7, dtype=torch.int32)
            launch_merged_needs(every, needs, L, chunks, LANDING_ROWS)
            assert tuple(needs.tolist()) == want, (L, D, chunks, needs, want)
            read = _Counts(host + needs.tolist() + [0], chunks, L, D, e_local * L, local, True)
            assert read.needs() == want and read.domain == views[local].domain, (L, D, chunks)
            # what a gated call's result takes without the domain's KnownCounts: rows per chunk, per-expert totals
            for v in views:
                rows, per_expert = v.received()
                assert rows == [sum(d[1]) for d in v.domain], (L, D, chunks)
                assert per_expert == [sum(t) for t in zip(*(d[0].num_recv_tokens_per_expert for d in v.domain))]
            known = [d[0] for d in domain]
            total = KnownCounts(*(tuple(map(sum, zip(*(getattr(k, f) for k in known)))) for f in (
                "num_tokens_per_rank", "num_recv_tokens_per_rank", "num_recv_tokens_per_expert")),
                num_tokens_max=sum(k.num_tokens_max for k in known), max_pair=sum(k.max_pair for k in known))
            for c, k in enumerate(known + [total]):
                want = _known_summary(k, L, e_local, True)
                assert summaries[c, :len(want)].tolist() == want, (L, D, chunks, c)
print("ok")
"""


_COUNT_WORDS = """
import random
import numpy as np
import torch
from epcomm.transports.hierarchical import _Counts, _gather_row, _read_words

rng = random.Random(5)
for L, D, C, e_dom in ((1, 2, 1, 4), (2, 2, 2, 6), (3, 2, 4, 9), (8, 8, 4, 32), (5, 7, 3, 7), (4, 3, 1, 128)):
    V = 1 + L + e_dom  # (the sums' columns; then each chunk's first token and the source's tokens)
    send = torch.randint(0, 60, (D, C, V + 2), dtype=torch.int32)
    recv = torch.randint(0, 60, (D, C, V + 2), dtype=torch.int32)
    row = _gather_row(recv, L, True)
    assert row.tolist() == _gather_row(recv, L, False).tolist(), (L, D, C)
    every = torch.randint(0, 90, (L * C, row.size(1)), dtype=torch.int32)  # (the domain's gathered rows)
    for needs in (False, True):
        for bad in (None, torch.tensor(rng.randrange(1, 9), dtype=torch.int32)):
            words = _read_words(every, send, recv, bad, L, needs, True)
            assert words.tolist() == _read_words(every, send, recv, bad, L, needs, False).tolist(), (L, D, C, needs)
            # a gated call's first read: the inter-domain leg's words alone, as the full read has them
            rail = _read_words(None, send, recv, bad, L, False, True)
            assert rail.tolist() == _read_words(None, send, recv, bad, L, False, False).tolist(), (L, D, C)
            n = every.numel()
            assert rail.tolist() == words[n:n + 2 * D * C].tolist() + [words[-1].item()], (L, D, C, needs)
            assert words[-1].item() == (0 if bad is None else bad.item())
            # as the host reads them: the same counts from the words as from a list
            a, b = (_Counts(w, C, L, D, e_dom, L - 1, needs) for w in (words.numpy().copy(), words.tolist()))
            assert a._needs == b._needs and a.domain == b.domain
            assert _Counts.most_of(a._host, C, L, D, e_dom) == _Counts.most_of(b._host, C, L, D, e_dom)
            assert [a.rail_known(c) for c in range(C)] == [b.rail_known(c) for c in range(C)]
print("ok")
"""


def test_count_words_by_kernels():
    """The count exchange's gathered row and the words the host reads (``_gather_row``, ``_read_words``), made by
    their two kernels (``launch_counts_gather_row``, ``launch_counts_read``: the interpreter here) as by torch
    operations: the same words for 1-8 ranks a domain, 2-8 domains, 1-4 chunks, with and without the needs and the bad
    id count; and the same counts read from them (``_Counts``) as from a list."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _COUNT_WORDS], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_early_bounds_cover_the_needs_seen():
    """``early_bounds``: each of a call's four needs (landing rows, received rows, max_pair, tokens) bounded by the
    largest of the earlier calls' with the margin, rounded up to 16 rows and 16 more, so that every need seen fits."""
    from epcomm.transports.hierarchical import early_bounds

    seen = [(100, 50, 7, 30), (120, 40, 9, 10), (0, 0, 0, 0)]
    assert early_bounds(seen, 0.125) == (160, 80, 32, 64)
    assert early_bounds([(0, 0, 0, 0)], 0.125) == (16, 16, 16, 16)
    for margin in (0.0, 0.125, 0.5):
        got = early_bounds(seen, margin)
        assert all(b % 16 == 0 and b >= max(s[i] for s in seen) * (1 + margin) for i, b in enumerate(got)), got


@pytest.mark.parametrize("backend,early", [
    ("cpu:gloo,cuda:nccl", True), ("nccl", True), ("cpu:gloo,cuda:gloo", False), ("gloo", False)])
def test_early_issue_by_default(backend, early):
    """``early_issue_by_default``: the domain leg goes before the count read by default only where the inter-domain
    collectives are NCCL's (the host never waits in them), whatever ``CUDA_DEVICE_MAX_CONNECTIONS`` says."""
    from epcomm.transports.hierarchical import _early_off_reason, early_issue_by_default

    assert early_issue_by_default(backend) is early
    assert (_early_off_reason(backend) is None) is early


@pytest.mark.parametrize("backend,forced,cuda,rail", [
    ("cpu:gloo,cuda:gloo", True, True, "cpu:gloo,cuda:nccl"), ("cpu:gloo,cuda:gloo", False, True, None),
    ("cpu:gloo,cuda:nccl", True, True, None), ("nccl", True, True, None), ("gloo", True, False, None)])
def test_rail_backend(backend, forced, cuda, rail, monkeypatch):
    """``rail_backend``: the inter-domain groups keep the group's backend unless ``EPCOMM_RAIL_NCCL=1`` asks for NCCL
    where the group's CUDA collectives are gloo's (ranks sharing GPUs) on a CUDA device; ``env.rail_nccl`` reads it."""
    from epcomm import env
    from epcomm.transports.hierarchical import rail_backend

    assert rail_backend(backend, forced, cuda) == rail
    monkeypatch.setenv("EPCOMM_RAIL_NCCL", "1" if forced else "0")
    assert env.rail_nccl() is forced


@pytest.mark.parametrize("rail,gpus,own", [
    ("cpu:gloo,cuda:nccl", ["GPU-a", "GPU-b"], "cpu:gloo,cuda:nccl"), ("cpu:gloo,cuda:nccl", ["GPU-a", "GPU-a"], None),
    ("cpu:gloo,cuda:nccl", ["GPU-a", "GPU-b", "GPU-a"], None), (None, ["GPU-a", "GPU-b"], None)])
def test_domain_backend(rail, gpus, own):
    """``domain_backend``: a domain group goes over NCCL with the rail groups (``EPCOMM_RAIL_NCCL``) only where no two
    of its ranks share a GPU (NCCL refuses them); otherwise it keeps the group's backend."""
    from epcomm.transports.hierarchical import domain_backend

    assert domain_backend(rail, gpus) == own


def test_rows_in_place_is_the_canonical_order():
    """``_rows_in_place`` (its kernel under the interpreter): where each row of each chunk of a dispatch's domain leg
    (by forwarding rank, then source domain, then token) lands in the intranode path's order (by source rank, then
    token, chunk after chunk) is the permutation the stable sort by source rank finds (``_canonical_order``'s
    ``back``), read from the domain's gathered counts as the device holds them (this rank's column of each source
    domain in each chunk's row), in 1, 2 and 4 chunks, with empty blocks, empty calls and up to 8 x 8 ranks; and the
    domain leg's summary the same launch writes is the one the host makes of the counts it read (``_known_summary``
    of ``_Counts.domain``). The chunks merged into one gated call (``launch_rows_merged``): the chunks' maps one after
    another, the merged call's map (its rows by forwarder, then chunk), each chunk's summary and the merged one; what
    that call needs, made on the device (``launch_merged_needs``) as the host makes it (``_Counts.needs``), and what
    its result takes of the counts (``_Counts.received``)."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _ROWS_IN_PLACE], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


_FORWARD_LAYOUT = """
import torch
from epcomm.kernels.ep import launch_forward_layout, record_words

torch.manual_seed(4)
L, D, C, e_dom, k, ns = 3, 2, 2, 6, 3, 2
W = record_words(ns, k, True)
for m, pad, bad in ((13, 3, False), (0, 0, False), (16, 0, False), (9, 7, True)):
    r0, rows = 16, m + pad  # chunk 1 of 2: its rows from row 16 of the merged input
    total = r0 + rows + 4
    recs = torch.zeros(total, W + 3, dtype=torch.int32)  # (records of any row stride)
    ids = torch.randint(-1, e_dom, (total, k), dtype=torch.int32)
    recs[:, 0] = torch.randint(0, 50, (total,))
    recs[:, 1] = torch.randint(0, D, (total,))
    recs[:, 2:2 + ns] = torch.randint(-1000, 1000, (total, ns))
    recs[:, 2 + ns:2 + ns + k] = ids
    recs[:, 2 + ns + k:2 + ns + 2 * k] = torch.rand(total, k).view(torch.int32)
    if bad:
        recs[r0 + 2, 2 + ns] = e_dom  # an id outside the domain's experts
    starts = torch.randint(0, 100, (C, D), dtype=torch.int32).t()  # [D, C], any strides
    real = slice(r0, r0 + m)
    dest = [[any(0 <= int(i) < e_dom and int(i) // (e_dom // L) == g for i in recs[r, 2 + ns:2 + ns + k])
             for g in range(L)] for r in range(r0, r0 + m)]
    sends_now = [sum(d[g] for d in dest) for g in range(L)]
    gathered = torch.randint(0, 30, (C, 8), dtype=torch.int32)
    gathered[1, 1:1 + L] = torch.tensor(sends_now)
    if bad:
        gathered[1, 1] += 1  # a count that differs from the rows' layout
    carried = torch.full((total, ns + 2), -7, dtype=torch.int32)
    idx = torch.full((total, k), -7, dtype=torch.int64)
    w = torch.full((total, k), -7, dtype=torch.int32)
    itr = torch.full((total, L), 5, dtype=torch.int8)
    pos = torch.full((total, L), -7, dtype=torch.int32)
    local = torch.full((m, L), -7, dtype=torch.int32)
    sends = torch.full((C, 4), -7, dtype=torch.int32)
    deferred = torch.zeros(1, dtype=torch.int32)
    flags = torch.zeros(4, dtype=torch.int64)
    bounds = torch.full((C + 1,), -7, dtype=torch.int32)
    tickets = torch.zeros(C, dtype=torch.int32)
    launch_forward_layout(recs[:, :W], r0, m, rows, starts, 1, carried, idx, w, itr, pos, local, sends, gathered,
                          deferred, flags, bounds, 41, e_dom // L, e_dom, tickets)
    assert tickets.tolist() == [0, 0], tickets  # (every program counted itself; the last reset the count)
    assert bounds.tolist() == [-7, r0, r0 + rows]  # (its first row and the next chunk's; chunk 0 writes bounds[0])
    got = recs[real]
    assert carried[real, :ns].tolist() == got[:, 2:2 + ns].tolist()
    assert carried[real, ns].tolist() == got[:, 1].tolist()
    assert carried[real, ns + 1].tolist() == (got[:, 0] + starts[got[:, 1].long(), 1]).tolist()
    assert idx[real].tolist() == got[:, 2 + ns:2 + ns + k].tolist()
    assert w[real].tolist() == got[:, 2 + ns + k:W].tolist()
    want_itr = torch.tensor(dest, dtype=torch.int8).view(m, L)
    assert itr[real].tolist() == want_itr.tolist() and (itr[r0 + m:r0 + rows] == 0).all()
    excl = (want_itr.int().cumsum(0) - want_itr.int())
    assert local.tolist() == excl.tolist()
    assert pos[real].tolist() == (excl + gathered[0, 1:1 + L]).tolist()
    assert sends[1, :L].tolist() == sends_now and flags[1].item() == 41 and flags[0].item() == 0
    # untouched outside the chunk's rows
    assert (carried[:r0] == -7).all() and (idx[:r0] == -7).all() and (pos[:r0] == -7).all() and (itr[:r0] == 5).all()
    assert deferred.item() == (2 if bad else 0), deferred
print("ok")
"""


def test_forward_layout_of_a_landed_chunk():
    """``launch_forward_layout`` (its one kernel under the interpreter, the positions made by its last program), which
    makes one chunk of a gated exact-mode dispatch ready for the domain leg once its rows land: each row's scales,
    source domain and source token (its record's plus the chunk's first token on that source), top-k ids and weights
    unpacked from records of any row stride into the merged input at the chunk's rows; every row's layout within the
    domain (padding rows none); its positions in the merged call (after this rank's earlier chunks' rows) and in the
    chunk's own; its sends; its bounds in the merged input (the gated push's); the chunk's flag released. An id outside
    the domain and sends that differ from the counts promised are counted as deferred errors; an empty chunk still
    releases its flag."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FORWARD_LAYOUT], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def _domain_counts_after_the_rows(ctx, chunks):
    """One exact-mode dispatch in ``chunks`` chunks over the one-sided domain leg (interpreter): the order in which the
    host issued the collectives and first asked for the domain leg's counts."""
    import torch.distributed as dist

    from epcomm.buffer import Buffer
    from epcomm.testing.checks import NormalCase, check_normal
    from epcomm.transports import hierarchical
    from epcomm.transports.nvlink import NVLinkTransport

    hierarchical.HierarchicalTransport.pipeline_chunks, hierarchical.HierarchicalTransport.head_chunk = chunks, False
    events, a2a, domain = [], dist.all_to_all_single, hierarchical._Counts.domain.func

    def counted(*args, **kwargs):
        events.append("all_to_all")
        return a2a(*args, **kwargs)

    def asked(self):
        events.append("domain counts")
        return domain(self)

    dist.all_to_all_single = counted
    hierarchical._Counts.domain = hierarchical.functools.cached_property(asked)
    hierarchical._Counts.domain.__set_name__(hierarchical._Counts, "domain")
    buf = Buffer(ctx.group, transport=NVLinkTransport, num_nvl_bytes=1 << 23, ranks_per_node=2)
    case = NormalCase(num_tokens=(9, 4, 0, 7), hidden=64, num_experts=8, topk=3, dtype="bf16", seed=91)
    buf.runtime.phase_log = []  # (and the gated call's lead by step: ``host_milestones``)
    try:
        failures = check_normal(ctx, buf, case).failures
    finally:
        dist.all_to_all_single = a2a
    log = buf.runtime.phase_log
    marks = hierarchical.host_milestones(log)
    steps = [step for step, _ in marks["lead steps"]]
    # (the node's gathered counts read after the first rows' collective: the last part of their phase, the read)
    domain_read = max(began for phase, _, _, _, began in log if phase == hierarchical.DOMAIN_COUNTS_PHASE)
    buf.runtime.phase_log = None
    buf.destroy()
    return failures, events, steps, domain_read > marks["rows issued"] > marks["counts read"]


@pytest.mark.parametrize("chunks", [1, 2])
def test_domain_counts_made_after_the_first_rows_collective(chunks, monkeypatch):
    """An exact-mode dispatch asks for the domain leg's counts (``_Counts.domain``) only after the inter-domain leg's
    first rows' collective is issued (the count all_to_all, then the rows' all_to_all, then the counts): the host's
    lead from the count read to the first rows holds only what that collective needs; its steps (``LEAD_STEPS``) are
    marked in the order the call reaches them; and a gated call (2 chunks) or a one-chunk call on the inter-domain
    leg's kernel path (``_first_rows``) reads the node's gathered counts (``DOMAIN_COUNTS_PHASE``) only after that
    collective, the count read the first rows wait for being the inter-domain leg's words alone."""
    from epcomm.transports.hierarchical import LEAD_COUNTS, LEAD_LANDING, LEAD_REQUEST, LEAD_STREAM

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for failures, events, steps, read_after in spawn(_domain_counts_after_the_rows, 4, chunks, device="cpu",
                                                     timeout_s=600):
        assert failures == [], failures
        first = events.index("domain counts")
        assert events[:first].count("all_to_all") >= 2, events  # (the counts', then the first rows')
        # the lead by step (the benchmarks' ``lead: ...`` rows), in the order reached
        assert steps == [LEAD_COUNTS, LEAD_LANDING, LEAD_STREAM, LEAD_REQUEST], steps
        # the inter-domain leg's words read first, the first rows issued, then the node's gathered counts read
        assert read_after, "the node's counts were read before the first rows' collective"


def _in_place_cases(ctx, chunks, gated):
    """Exact-mode dispatches in ``chunks`` chunks over the one-sided domain leg (its kernels under the interpreter):
    four of the Buffer suite's normal cases and one with -1 slots against the reference (dispatch, combine, cached
    dispatch), and how many chunks wrote their rows in place (``gated``: how many calls merged their chunks into one
    gated call of the domain leg)."""
    import torch

    from epcomm.transports import hierarchical
    from epcomm.transports.nvlink import NVLinkTransport

    from epcomm.transports.base import DispatchRequest

    H = hierarchical.HierarchicalTransport
    H.pipeline_chunks, H.head_chunk, H.gated_exact = chunks, False, gated
    made, calls = hierarchical._rows_in_place, [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return made(*args, **kwargs)

    hierarchical._rows_in_place = counted
    merged, merges, lazy = H._gated, [0], [0]

    def merging(self, *args, **kwargs):
        out = merged(self, *args, **kwargs)
        got = out[0]
        merges[0] += got is not None
        if got is not None:  # (its handles, both legs', not made yet: made when a combine or cached dispatch asks)
            st = got.handle.state
            # and what the domain leg's handles are made from holds none of the call's inter-domain requests (their
            # packed rows): a handle lives until its combine, or a training step's backward
            kept = [c.cell_contents for c in st.domain_handles.__closure__ or ()]
            counts = [k for k in kept if isinstance(k, hierarchical._Counts)]
            requests = [c.cell_contents for h in st.rail_handles for c in getattr(h, "__closure__", None) or ()
                        if isinstance(c.cell_contents, DispatchRequest)]
            lazy[0] += (all(callable(h) for h in st.rail_handles) and callable(st.domain_handles) and len(counts) == 1
                        and not counts[0]._legs and not counts[0]._rails and counts[0]._per_expert is None
                        and not requests)
        return out

    H._gated = merging
    # (and the combines' partials written side by side into the rows the inter-domain leg sends as they are)
    from epcomm.testing.checks import NormalCase
    from epcomm.transports import alltoall

    # (and the dispatches' pack writing rows and records side by side into the rows the inter-domain leg sends)
    found, sent, packed = alltoall._side_by_side, [0], [0]

    def side_by_side(parts):
        got = found(parts)
        sent[0] += got is not None
        packed[0] += got is not None and parts[0].dtype == torch.int32  # (a dispatch's: rows as int32 words)
        return got

    alltoall._side_by_side = side_by_side
    # (and the dispatches' rows read where they landed: the inter-domain leg's rows a view of the rows with their
    # records, not copied out)
    received, views = alltoall.AllToAllTransport._received, [0]

    def seen(self, req, recv_x, *args, **kwargs):
        views[0] += recv_x.size(0) > 0 and recv_x.stride(0) > recv_x.size(1)
        return received(self, req, recv_x, *args, **kwargs)

    alltoall.AllToAllTransport._received = seen
    cases = [c for i, c in enumerate(normal_cases(ctx.world_size)) if i in (1, 2, 3, 7)] + [
        NormalCase(num_tokens=(6, 0, 11, 3), hidden=72, num_experts=24, topk=3, dtype="bf16", routing="dropped",
                   bias=1, seed=81)]  # (-1 slots)
    return (run_cases(ctx, cases, NVLinkTransport, {"ranks_per_node": 2, "num_nvl_bytes": 1 << 23}), calls[0],
            sent[0] - packed[0], views[0], packed[0], merges[0], lazy[0])


@pytest.mark.parametrize("chunks,gated", [(1, False), (3, True)])
def test_rows_written_in_place(monkeypatch, chunks, gated):
    """An exact-mode dispatch whose domain leg is the one-sided transport writes every row of every chunk where the
    intranode path's order puts it, all chunks into one set of outputs (no sort, no gather after the call); its combine
    and cached dispatches (which read the domain leg's own order) match the reference too: uneven and empty ranks, FP8
    with column-major scales, skewed routing, a domain that receives nothing, bias, alignment, a dispatch without top-k
    ids, -1 slots. The combines' node leg writes each chunk's partials and weights side by side into the rows the
    inter-domain leg sends as they are, and the node leg reads the dispatches' rows where they landed (a view, beside
    their records). ``gated``: the chunks of every call with top-k ids go through the domain leg in one gated call
    (``HierarchicalTransport._gated``; each chunk's layout and positions made as its rows land), and each chunk's own
    handle serves its combine and the cached dispatches, both legs' handles made when first asked. (Several chunks one
    by one, which a call with a head chunk or one the gated path refuses takes:
    ``test_gated_call_refused_by_fixed_storage_goes_chunk_by_chunk`` here, the GPU suites with a head chunk.)"""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for failed, calls, sent, views, packed, merges, lazy in spawn(_in_place_cases, 4, chunks, gated, device="cpu",
                                                                  timeout_s=900):
        assert failed == [], failed
        assert sent >= 2 and packed >= 4, (sent, packed)
        if gated:  # (a call without top-k ids goes by ranks: then too)
            assert merges >= 5 and calls == 0 and lazy == merges, (merges, calls, lazy)
        else:
            assert merges == 0 and calls >= 4 * chunks and views >= 4, (merges, calls, views)


def _gated_with_a_late_rank(ctx):
    """Two gated exact-mode dispatches in 2 chunks over the one-sided domain leg (interpreter), one right after the
    other (no other call of the domain leg between them), rank 1 of each domain starting the second's domain-leg call
    late (after its rows have crossed): the second's failures against the reference."""
    import time

    from epcomm.buffer import Buffer
    from epcomm.testing.checks import NormalCase, check_normal
    from epcomm.testing.routing import make_inputs
    from epcomm.transports import hierarchical
    from epcomm.transports.nvlink import NVLinkTransport

    H = hierarchical.HierarchicalTransport
    H.pipeline_chunks, H.head_chunk, H.gated_exact = 2, False, True
    buf = Buffer(ctx.group, transport=NVLinkTransport, ranks_per_node=2, num_nvl_bytes=1 << 23)
    case = NormalCase(num_tokens=(9, 4, 7, 5), hidden=64, num_experts=8, topk=3, dtype="bf16", seed=93)
    check_normal(ctx, buf, case)  # (its kernels compiled, the ranks met)
    mine = make_inputs(94, ctx.world_size, case.num_tokens, 64, 8, 3)[ctx.rank]
    per_rank, _, per_expert, itr, _ = buf.get_dispatch_layout(mine.topk_idx, 8)
    buf.dispatch(mine.x, num_tokens_per_rank=per_rank, is_token_in_rank=itr, num_tokens_per_expert=per_expert,
                 topk_idx=mine.topk_idx, topk_weights=mine.topk_weights)
    forward = NVLinkTransport.dispatch

    def late(self, req):
        if req.positions is not None and self.rank == 1:
            time.sleep(1.5)
        return forward(self, req)

    NVLinkTransport.dispatch = late
    failures = check_normal(ctx, buf, NormalCase(num_tokens=(9, 4, 7, 5), hidden=64, num_experts=8, topk=3,
                                                 dtype="bf16", seed=95)).failures
    buf.destroy()
    return failures


def _gated_refused(ctx):
    """Exact-mode dispatches in 3 chunks over the one-sided domain leg (interpreter) whose fixed storage holds each
    chunk's rows (in rounds) but not the chunks merged: the failures against the reference and how many calls the
    gated path refused (``_gated`` returned no result, its first chunk's rows landed: they go on chunk by chunk)."""
    from epcomm.testing.checks import NormalCase
    from epcomm.transports import hierarchical
    from epcomm.transports.nvlink import NVLinkTransport

    H = hierarchical.HierarchicalTransport
    H.pipeline_chunks, H.head_chunk, H.gated_exact = 3, False, True
    merged, refused = H._gated, [0]

    def counted(self, *args, **kwargs):
        got, landed = merged(self, *args, **kwargs)
        refused[0] += got is None and landed is not None  # (refused with its first chunk's rows landed)
        return got, landed

    H._gated = counted
    cases = [NormalCase(num_tokens=(40, 33, 0, 38), hidden=64, num_experts=8, topk=3, dtype="bf16", seed=97),
             NormalCase(num_tokens=(29, 41, 36, 17), hidden=128, num_experts=8, topk=2, dtype="fp8",
                        routing="dropped", seed=98)]
    return run_cases(ctx, cases, NVLinkTransport, {"ranks_per_node": 2, "num_nvl_bytes": 8192}), refused[0]


def test_gated_call_refused_by_fixed_storage_goes_chunk_by_chunk(monkeypatch):
    """Where the domain's storage is fixed (``num_nvl_bytes``) and cannot hold the merged call's rows in one round,
    every rank of the domain refuses the gated path at the same call and the chunks go through the domain leg one by
    one (in rounds), matching the reference (an empty rank, FP8 with -1 slots)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for failed, refused in spawn(_gated_refused, 4, device="cpu", timeout_s=600):
        assert failed == [], failed
        assert refused >= 2, refused


def test_gated_call_waits_for_a_late_rank(monkeypatch):
    """A gated domain-leg call (``DispatchRequest.positions``: no count exchange) starts its epoch with a barrier, as
    every one-sided call does: a rank whose peer starts its call late (right after an earlier call of the same shape)
    takes no rows of the earlier call for this one's (the earlier epoch's progress words never satisfy its waits)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for failed in spawn(_gated_with_a_late_rank, 4, device="cpu", timeout_s=600):
        assert failed == [], failed


@pytest.mark.parametrize("head_chunk", [None, True])
def test_chunk_count_is_measured_and_agreed(head_chunk):
    """With a fixed cost per chunk, the measured count is 1 chunk, the same on every rank (they agree on the
    slowest rank's times), and every call while measuring (each of ``CHUNK_CANDIDATES``) matches the reference; also
    where calls are told to send a head chunk (``head_chunk=True``: measured under the tuner's candidates without one,
    as the leg cannot send one here)."""
    from epcomm.transports.hierarchical import HierarchicalTransport as H

    results = spawn(_chunk_count, 4, 0.03, head_chunk, device="cpu", timeout_s=600)
    for rank, (failures, chosen, seen, text, described) in enumerate(results):
        assert failures == [], (rank, failures)
        assert chosen == 1, (rank, text)
        assert seen == len(H.CHUNK_CANDIDATES) * H.TUNE_CALLS, (rank, seen)
        assert "measured fastest" in text and "normal-mode chunks: 1 chunk, measured" in described, text
        assert described.endswith("gated node leg before the count read: off (GPUs only)"), described


def test_chunk_count_candidates_take_turns():
    """The tuner's schedule: the candidates in turn, one dispatch each per round (1 first), the first round not
    timed; then the agreement on the slowest rank's medians."""
    import torch

    from epcomm.transports.hierarchical import _ChunkTuner

    tuner = _ChunkTuner((1, 2, 4), 3, torch.device("cpu"))
    tuner.offer_head(False)  # (an inter-domain leg that cannot send a head: the counts alone)
    order, timed = [], []
    for _ in range(9):
        candidate = tuner.next(None, "test")
        order.append(candidate)
        timing = tuner.start(candidate, 8)
        timed.append(timing is not None)
        if timing is not None:
            if candidate[0] == 1:  # a one-chunk call of 8 tokens begun at 0: its counts read at 1, rows 1 -> 5,
                timing = (timing[0], 0.0, timing[2], timing[3])  # forwarding 5 -> 6 (0.25 of the rows' time)
                timing[2].extend([1.0, 5.0, 6.0])
            tuner.stop(timing)
    assert order == [(1, False), (2, False), (4, False)] * 3 and timed == [False] * 3 + [True] * 6
    assert {c: len(t) for c, t in tuner.times.items()} == {(1, False): 2, (2, False): 2, (4, False): 2}
    assert tuner.ratios == [0.25, 0.25]
    # the link moved 8 bytes of rows in 5 time units, 1 of them the count round trip: 1.6 bytes while the counts travel
    assert tuner.reaches == [1.6, 1.6] and tuner.reach is None
    agreed = []  # what the ranks agree on: each count's median time, the forwarding / rows ratio, the reach, largest
    assert tuner.next(lambda mine: agreed.append(mine.tolist()) or [30.0, 10.0, 20.0, 0.7, 100.0], "test") == (2, False)
    assert len(agreed[0]) == 5 and agreed[0][3] == 0.25 and agreed[0][4] == 1.6
    assert tuner.ratio == 0.7 and tuner.start((2, False)) is None and tuner.reach == 100.0 and tuner.chosen == 2
    assert tuner.describe().startswith("2 chunks, measured fastest") and "head" not in tuner.describe()


@pytest.mark.parametrize("head_gain", [0.02, 0.2])
def test_head_chunk_is_measured_with_each_count(head_gain):
    """Where the inter-domain leg can send a head chunk, every chunk count is measured without and with one (the
    simpler first) and the head is kept only where it is faster by more than CHUNK_GAIN: it costs the host a chunk's
    work after the count read, which pays only where the round trip it hides is longer."""
    import torch

    from epcomm.transports.hierarchical import _ChunkTuner

    tuner = _ChunkTuner((1, 2), 2, torch.device("cpu"))
    tuner.offer_head(True)
    order = []
    for _ in range(8):
        candidate = tuner.next(None, "test")
        order.append(candidate)
        timing = tuner.start(candidate, 8)
        if timing is not None:
            tuner.stop(timing)
    assert order == [(1, False), (1, True), (2, False), (2, True)] * 2
    tuner.offer_head(True)  # (again: no change once measuring)
    assert len(tuner.candidates) == 4
    times = [100.0, 100.0 * (1 - head_gain), 99.0, 97.0, 0.5, float("nan")]
    assert tuner.next(lambda mine: times, "test") == (1, head_gain > 0.05)
    assert tuner.describe().startswith("1 chunk with a head chunk, measured" if head_gain > 0.05
                                       else "1 chunk, measured fastest")
    assert "2 chunks with a head chunk: 97 us" in tuner.describe()


def test_head_chunk_bounded_by_the_measured_reach():
    """The head chunk's slots: a quarter of the previous call's largest token count until the link's reach (bytes of
    rows moved during a count round trip) is agreed; then at most HEAD_MARGIN times the reach's rows of this call's
    row size (a small call after a large one pads no more than a few round trips' worth), and none where the quarter
    is under half of them (its own collective would cost more than it hides)."""
    from types import SimpleNamespace

    from epcomm.transports.hierarchical import HEAD_MARGIN, HierarchicalTransport, head_bounds

    assert HEAD_MARGIN == 3.0 and head_bounds(100.0) == (50, 300) and head_bounds(0.1) == (1, 1)
    assert HierarchicalTransport.head_share == 0.25
    fake = SimpleNamespace(_tuner=SimpleNamespace(reach=None))
    slots = lambda s, row: HierarchicalTransport._head_slots(fake, s, row)  # noqa: E731
    assert [slots(s, 7392) for s in (0, 2, 1024, 4096)] == [0, 2, 1024, 4096]  # not yet bounded
    fake._tuner.reach = 200 * 7392.0  # e.g. 4096 FP8 rows in 15 ms, 0.73 ms of them the count round trip
    assert [slots(s, 7392) for s in (0, 2, 99, 100, 512, 1024)] == [0, 0, 0, 100, 512, 600]
    assert [slots(s, 14336) for s in (51, 52, 1024)] == [0, 52, 310]  # BF16 rows: twice the bytes, half the rows


def test_chunks_shrink_by_the_measured_ratio():
    """Where the forwarding is faster than the rows' transfer, chunks shrink by that ratio (at least
    CHUNK_RATIO_FLOOR): each chunk's forwarding hides behind the next one's transfer; otherwise they are even. The
    bounds cover the tokens in order, whatever the ratio."""
    import torch

    from epcomm.core.layout import chunk_bounds, chunk_shares, token_alignment
    from epcomm.kernels.launch import one_variant
    from epcomm.transports.hierarchical import CHUNK_RATIO_FLOOR, chunk_ratio, split_description

    assert CHUNK_RATIO_FLOOR == 0.25 and split_description(0.5) == "each 0.50 times the previous one's tokens"
    assert chunk_ratio(0.1) == 0.25 and chunk_ratio(0.26) == 0.26 and chunk_ratio(0.8) == 0.8
    assert chunk_ratio(1.3) == 1.0
    assert chunk_ratio(float("inf")) == 1.0
    assert chunk_shares(4, 0.5) == [8 / 15, 4 / 15, 2 / 15, 1 / 15]
    assert chunk_bounds(4096, 4) == [(0, 1024), (1024, 2048), (2048, 3072), (3072, 4096)]
    assert chunk_bounds(4096, 4, 0.5) == [(0, 2185), (2185, 3277), (3277, 3823), (3823, 4096)]
    # chunk bounds where every per-token tensor's slice starts 16-byte aligned (Triton specialises on it)
    assert token_alignment(7168, 224, 64, 32, 64) == 1 and token_alignment(256, 24, 12, 4) == 4
    assert token_alignment(132, 1) == 16 and token_alignment() == 1
    assert chunk_bounds(9, 2, align=4) == [(0, 8), (8, 9)] and chunk_bounds(20, 4, align=16)[1] == (16, 20)
    w = torch.rand(5, 2)  # rows sliced where the data decides (a combine's chunks): copied where misaligned
    assert one_variant(w) is w and one_variant(w[1:]).data_ptr() % 16 == 0 and torch.equal(one_variant(w[1:]), w[1:])
    wide = torch.rand(3, 8)  # one row or none of a wider buffer's columns: copied to rows of their own width
    for t in (wide[:1, :4], wide[:0, :4]):
        assert one_variant(t).stride() == (4, 1) and torch.equal(one_variant(t), t)
    rows = wide[:2]  # whole rows of a contiguous tensor: as they are
    assert one_variant(rows) is rows
    for n in (0, 1, 2, 5, 17, 4096):
        for chunks in (1, 2, 3, 4):
            for ratio in (1.0, 0.8, 0.5, 0.25):
                for align in (1, 4, 16):
                    bounds = chunk_bounds(n, chunks, ratio, align)
                    assert len(bounds) == chunks and bounds[0][0] == 0 and bounds[-1][1] == n, (n, chunks, ratio)
                    assert all(a <= b for a, b in bounds) and all(bounds[c][1] == bounds[c + 1][0]
                                                                  for c in range(chunks - 1)), bounds
                    assert all(a % align == 0 or a == n for a, _ in bounds), bounds


def test_chunk_count_pick_needs_a_clear_gain():
    """A larger count replaces a smaller one only when faster by more than CHUNK_GAIN (5%) of it: gains within the
    noise keep fewer chunks (fewer fixed costs)."""
    from epcomm.transports.hierarchical import CHUNK_GAIN, pick_chunks

    assert CHUNK_GAIN == 0.05
    assert pick_chunks((1, 2, 4), [100.0, 97.0, 96.0]) == 1  # 3-4% faster: within the noise
    assert pick_chunks((1, 2, 4), [100.0, 90.0, 88.0]) == 2  # 4 is only 2% faster than 2
    assert pick_chunks((1, 2, 4), [100.0, 99.0, 80.0]) == 4
    assert pick_chunks((1, 2, 4), [100.0, 120.0, 94.0]) == 4
    assert pick_chunks((1, 2, 4), [float("inf"), 50.0, 49.0]) == 2
    assert pick_chunks((2,), [10.0]) == 2


def test_chunk_count_from_the_environment(monkeypatch):
    monkeypatch.setenv("EPCOMM_INTERNODE_CHUNKS", "3")
    for failures, chosen, seen, text, _ in spawn(_chunk_count, 4, 0.0, device="cpu", timeout_s=600):
        assert failures == [] and chosen is None and seen == 0 and text == "3 (EPCOMM_INTERNODE_CHUNKS); chunks even"
    monkeypatch.setenv("EPCOMM_INTERNODE_CHUNKS", "0")
    with pytest.raises(Exception, match="EPCOMM_INTERNODE_CHUNKS='0' must be a whole number from 1 to 16"):
        spawn(_chunk_count, 4, 0.0, device="cpu", timeout_s=600)


def test_find_domains():
    hosts = ["a", "a", "b", "b"]
    d = find_domains(hosts)
    assert (d.num_domains, d.local_size) == (2, 2)
    assert d.rail_ranks(1) == [1, 3] and d.domain_ranks(1) == [2, 3]
    assert (find_domains(["a"] * 6, 2, "test").num_domains, find_domains(["a"] * 6).num_domains) == (3, 1)
    with pytest.raises(ValueError, match="same number of ranks.*ranks 0-2 on a, ranks 3-3 on b"):
        find_domains(["a", "a", "a", "b"])
    with pytest.raises(ValueError, match="must be consecutive.*host a has ranks 0, 2"):
        find_domains(["a", "b", "a", "b"])
    with pytest.raises(ValueError, match="puts ranks 0-3 into one domain, but they run on 2 hosts"):
        find_domains(hosts, 4, "test")
    with pytest.raises(ValueError, match="must be a positive divisor"):
        find_domains(hosts, 3, "test")


def _counts_without_topk(ctx, buf) -> list:
    """A dispatch with ``num_tokens_per_expert`` but without top-k ids (the forwarding ranks route by rank; the
    per-expert counts travel on their own, over the two subgroups): its per-expert receive counts against the sum of
    every rank's counts for this rank's experts."""
    import torch
    import torch.distributed as dist

    from epcomm.testing.routing import make_inputs

    num_experts = 8
    mine = make_inputs(11, ctx.world_size, 5 + 3 * ctx.rank, 64, num_experts, 3)[ctx.rank]
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(mine.topk_idx, num_experts)
    _, _, _, counts, handle, _ = buf.dispatch(mine.x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                              num_tokens_per_expert=per_expert, expert_alignment=4)
    every = [torch.empty_like(per_expert) for _ in range(ctx.world_size)]
    dist.all_gather(every, per_expert, group=ctx.group)
    e_local = num_experts // ctx.world_size
    want = torch.stack(every).sum(0)[ctx.rank * e_local:(ctx.rank + 1) * e_local].to(torch.int32)
    problems = []
    if not torch.equal(handle.num_recv_tokens_per_expert, want):
        problems.append(f"per-expert receive counts {handle.num_recv_tokens_per_expert.tolist()} != {want.tolist()}")
    if counts != [(c + 3) // 4 * 4 for c in want.tolist()]:
        problems.append(f"per-expert list {counts} (aligned to 4) for counts {want.tolist()}")
    return problems


def _disagree(ctx):
    import torch

    from epcomm.buffer import Buffer

    try:
        Buffer(ctx.group, transport="alltoall", ranks_per_node=3)
        bad_split = "no exception"
    except ValueError as exc:
        bad_split = str(exc)
    buf = Buffer(ctx.group, transport="alltoall", ranks_per_node=2)
    counts_problems = _counts_without_topk(ctx, buf)
    hidden = 256 if ctx.rank != 3 else 128  # rank 3 was configured differently
    x = torch.randn(4, hidden).to(torch.bfloat16)
    idx = torch.zeros(4, 2, dtype=torch.int64)
    idx[:, 1] = 5
    try:
        buf.low_latency_dispatch(x, idx, 4, 8)
    except ValueError as exc:
        return bad_split, str(exc), counts_problems
    return bad_split, "no exception", counts_problems


def test_ranks_that_disagree_raise_before_data_moves():
    """Ranks that disagree on a call's shape raise before data moves (and, in the same processes, a dispatch without
    top-k ids returns the per-expert counts: ``_counts_without_topk``)."""
    for bad_split, message, counts_problems in spawn(_disagree, 4, device="cpu"):
        assert counts_problems == [], counts_problems
        assert bad_split.startswith("Buffer: find_domains: ranks_per_node=3 (Buffer(ranks_per_node=3)) must be a "
                                    "positive divisor of the group's 4 ranks"), bad_split
        assert message.startswith("Buffer.low_latency_dispatch: the ranks disagree on this call's shape"), message
        assert "ranks [0, 1, 2]" in message and "ranks [3]" in message, message


def _peer_missing(ctx, mode, local=2, stall_s=8.0, fault_timeout=None, warm_buffer=False):
    """Every rank makes a call of ``mode`` (``dispatch``, ``low_latency`` or ``combine``: a dispatch then its
    combine); then the last rank (on another domain than rank 0) stalls for ``stall_s`` instead of making the next
    one (for ``combine``: it dispatches, then skips the combine). The others report ``(message of the error, seconds
    from the call to the error, message of the next call, seconds it took)``; every rank ends at a meeting point in
    the store, so that the stalled rank's peers (and the store, on rank 0) outlive it. ``fault_timeout``: the
    ``EPCOMM_TIMEOUT_S`` of the faulty call (after the first calls, made with the environment's); ``warm_buffer``:
    compile every kernel with a first Buffer, so that the second one's first call is quick. With NCCL the faulty
    dispatch is the second Buffer's first with a head chunk: it must load no kernel variant that the first dispatch
    did not (loading one waits for the device, where its count exchange hangs, and NCCL's watchdog would end the
    process)."""
    import os
    import time

    import torch.distributed as dist

    from epcomm.buffer import Buffer
    from epcomm.errors import EpcommError
    from epcomm.testing.routing import make_inputs

    dev = ctx.device
    mine = make_inputs(3, ctx.world_size, 4, 128, 4 * ctx.world_size, 2)[ctx.rank]
    x, idx, w = mine.x.to(dev), mine.topk_idx.to(dev), mine.topk_weights.to(dev)
    num_experts = 4 * ctx.world_size

    def make_calls(buf):
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)

        def dispatch():
            return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)

        def low_latency():
            return buf.low_latency_dispatch(x, idx, 8, num_experts)

        def combine(out):
            return buf.combine(out[0], out[4], topk_weights=out[2])

        return dispatch, low_latency, combine

    def first_calls(buf):
        dispatch, low_latency, combine = make_calls(buf)
        if mode == "low_latency":
            low_latency()
        else:
            combine(dispatch())

    if warm_buffer:  # with the environment's timeout; the second Buffer's groups get fault_timeout's
        warm = Buffer(ctx.group, transport="alltoall", ranks_per_node=local)
        first_calls(warm)
        warm.destroy()
        if fault_timeout is not None:
            os.environ["EPCOMM_TIMEOUT_S"] = str(fault_timeout)
    buf = Buffer(ctx.group, transport="alltoall", ranks_per_node=local)
    first_calls(buf)  # every rank makes the first calls of this kind
    if fault_timeout is not None:
        os.environ["EPCOMM_TIMEOUT_S"] = str(fault_timeout)
    dispatch, low_latency, combine = make_calls(buf)
    stalled = ctx.rank == ctx.world_size - 1
    out = "stalled"
    if mode == "combine":
        got = dispatch()
    if stalled:
        time.sleep(stall_s)
    else:
        begin = time.monotonic()
        try:
            if mode == "combine":
                combine(got)
            else:
                dispatch() if mode == "normal" else low_latency()
            buf.check_errors()  # stream-ordered calls (NCCL) are found here at the latest
            out = ("no exception", time.monotonic() - begin, "", 0.0)
        except EpcommError as exc:
            took = time.monotonic() - begin
            begin = time.monotonic()
            try:
                dispatch()
                again = "no exception"
            except EpcommError as exc2:
                again = str(exc2)
            out = (str(exc), took, again, time.monotonic() - begin)
    store = dist.distributed_c10d._get_default_store()
    store.add("test/finished", 1)
    deadline = time.monotonic() + stall_s + 60
    try:
        while int(store.add("test/finished", 0)) < ctx.world_size and time.monotonic() < deadline:
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - rank 0 (the store's host) may end first
        pass
    time.sleep(0.5 if ctx.rank == 0 else 0.0)
    return out


def check_peer_missing(out: list, mode: str, timeout: float, slack: float, local: int, on_stream: bool = False) -> None:
    """``_peer_missing``'s results: every rank but the stalled last one raised within ``timeout + slack`` s, naming
    its rank, the phase and what it learnt of the others; its next call raised at once. ``on_stream``: the combine
    never synchronises (NCCL): it is found by check_errors as a call still running on the stream, whose collectives
    every rank but the stalled one joined."""
    world = len(out)
    last = world - 1
    assert out[last] == "stalled", out[last]
    phases = {"normal": "counts of both legs", "low_latency": "tokens to their domains",
              "combine": "partial sums back to their sources"}
    problems = []
    for rank in range(last):
        message, took, again, took_again = out[rank]
        expect = [f"rank {rank}: ", f"did not complete within EPCOMM_TIMEOUT_S={timeout:g} s",
                  "groups were aborted, this Buffer cannot be used again"]
        if on_stream and mode == "combine":
            expect += ["the collectives of Buffer.combine, still running on the stream", f"rank {last} never joined it"]
        elif rank == last - local:  # the stalled rank's rail peer waits for it in the inter-domain leg
            expect += [f"the inter-domain leg ({phases[mode]})", f"rank {last} never joined it"]
        if not (took < timeout + slack and all(e in message for e in expect)):
            problems.append(f"rank {rank}: after {took:.1f} s (at most {timeout + slack:g} expected), missing "
                            f"{[e for e in expect if e not in message]} in: {message}")
        if not (took_again < 1.0 and "cannot be used again" in again):
            problems.append(f"rank {rank}: the next call took {took_again:.1f} s and raised: {again}")
    assert not problems, "\n".join(problems)


def test_call_watch_reports_a_host_blocked_in_a_native_call(monkeypatch):
    """``faults.CallWatch``: a call whose thread stays in one native call (a frame that does not move) for more than
    EPCOMM_TIMEOUT_S is reported once, naming the frame; a call whose thread moves on before that, and one waiting
    in a bounded wait of ``faults`` (which ends by itself), are not."""
    import threading
    import time

    from epcomm.transports import faults

    monkeypatch.setenv("EPCOMM_TIMEOUT_S", "0.4")
    watch, seen = faults.CallWatch(period_s=0.02), []

    class Never:
        def query(self):
            return False

    def blocked():
        key = watch.begin(lambda s, w: seen.append(("blocked", s, w)))
        time.sleep(1.0)  # one native call
        watch.end(key)

    def moving():
        key = watch.begin(lambda s, w: seen.append(("moving", s, w)))
        time.sleep(0.2)
        time.sleep(0.2)
        time.sleep(0.2)
        time.sleep(0.2)
        watch.end(key)

    def bounded():
        key = watch.begin(lambda s, w: seen.append(("bounded", s, w)))
        with pytest.raises(faults.WaitExpired):
            faults.host_wait(Never(), "f", "nothing", limit_s=0.9)
        watch.end(key)

    threads = [threading.Thread(target=f) for f in (blocked, moving, bounded)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [s[0] for s in seen] == ["blocked"], seen
    assert 0.4 < seen[0][1] < 0.8 and seen[0][2].startswith("test_internode.py:") and "in blocked" in seen[0][2], seen


@pytest.mark.parametrize("mode", ["normal", "low_latency", "combine"])
def test_stalled_rank_of_another_domain_is_an_error(mode, monkeypatch):
    """A rank of the other domain that never makes the call (for ``combine``: dispatches, then skips the combine)
    makes every other rank raise within EPCOMM_TIMEOUT_S and a few seconds, naming the phase and the missing rank
    (its rail peer) or the rank it waits for; the next call raises at once; nothing hangs at the end."""
    monkeypatch.setenv("EPCOMM_TIMEOUT_S", "3")  # gloo's collectives end at their group's timeout
    out = spawn(_peer_missing, 4, mode, device="cpu", timeout_s=120)
    check_peer_missing(out, mode, 3.0, 4.0, 2)
    if mode == "normal":  # rank 0 waits within its domain for rank 1, which waits for rank 3 across
        assert "the domain leg (counts of both legs)" in out[0][0] and "rank 1 is stuck in the inter-domain leg " \
            "(counts of both legs)" in out[0][0], out[0][0]
        assert "rank 3 never joined it" in out[2][0], out[2][0]


def test_bounded_host_wait():
    """``faults.host_wait`` returns once the work completes, and raises ``WaitExpired`` (an EpcommTimeoutError,
    naming the function and what was awaited) after its limit when it never does."""
    import time

    from epcomm.errors import EpcommTimeoutError
    from epcomm.transports import faults

    class Never:
        def query(self):
            return False

    class Later:
        polls = 0

        def is_completed(self):
            self.polls += 1
            return self.polls > 50

    begin = time.monotonic()
    with pytest.raises(faults.WaitExpired, match=r"^Buffer.dispatch: rank 0: the count exchange did not complete "
                                                 r"within 0.3 s \(EPCOMM_TIMEOUT_S=") as info:
        faults.host_wait(Never(), "Buffer.dispatch", lambda: "rank 0: the count exchange", limit_s=0.3)
    assert 0.3 <= time.monotonic() - begin < 2.0 and isinstance(info.value, EpcommTimeoutError)
    with pytest.raises(faults.WaitExpired):  # the limit counts from when the work was issued
        faults.host_wait(Never(), "Buffer.dispatch", "x", started=time.monotonic() - 1.0, limit_s=0.5)
    later = Later()
    faults.host_wait(later, "Buffer.dispatch", "x", limit_s=5.0)
    assert later.polls == 51
    assert faults.describe_peers({3: None, 1: "the domain leg (x)"}) == (
        "rank 3 never joined it (stalled, dead, or making another call); rank 1 is stuck in the domain leg (x)")
    assert "could not be found" in faults.describe_peers(None)


def test_bench_internode_and_its_model(tmp_path, monkeypatch):
    """The benchmark runs every row on CPU processes (tiny shape, two interleaved rounds) and writes its tables:
    the hierarchical path in the chunk count it measured and in each fixed count; the model's dedup and the
    published figures are in the notes."""
    import csv

    from epcomm.bench import internode
    from epcomm.bench.traffic import expected_domains, internode_estimate
    from epcomm.transports.hierarchical import HierarchicalTransport

    assert internode.main(["--world-size", "4", "--ranks-per-node", "2", "--tokens", "24", "--ll-tokens", "4",
                           "--hidden", "256", "--experts", "16", "--topk", "4", "--iters", "2", "--rounds", "2",
                           "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "bench_internode_4ranks.csv")))
    impls = {(r["routing"], r["impl"]) for r in rows}
    for routing in ("uniform", "group_limited"):
        assert {(routing, i) for i in ("hierarchical", "flat alltoall", "nccl-baseline", "raw link",
                                       "hierarchical, 1 chunk", "hierarchical, 2 chunks", "hierarchical, 4 chunks")
                } <= impls
    phases = [r for r in rows if r["impl"] in ("hierarchical, 1 chunk, by phase", "hierarchical, 4 chunks, by phase")]
    assert {r["op"] for r in phases} >= {"dispatch BF16: tokens to their domains",
                                         "dispatch BF16: forwarding the tokens"}, phases
    assert all(float(r["time_us"]) > 0 for r in phases)
    assert all(r["rounds"] == "2" and "-" in r["time_us range"] for r in rows if r not in phases)
    assert {r["chunks"] for r in rows if r["impl"] == "hierarchical" and r["op"] == "dispatch FP8"} <= {"1", "2", "4"}
    hier = [r for r in rows if r["impl"] == "hierarchical" and r["op"] == "dispatch BF16"]
    flat = [r for r in rows if r["impl"] == "flat alltoall" and r["op"] == "dispatch BF16"]
    # dedup: a token crosses once per remote domain, never more often than once per remote rank
    assert all(float(h["crossing rows/token"]) <= float(f["crossing rows/token"]) for h, f in zip(hier, flat))
    assert "DeepEP published" in open(tmp_path / "bench_internode_4ranks.md").read()
    # the model: 2 domains, top-8 of 256: nearly every token needs both domains; 4 of 8 domains when limited
    assert 1.99 < expected_domains(256, 2, 8) <= 2.0 and expected_domains(256, 8, 8, 4) < 4.0
    e = internode_estimate(64, 8, 4096, 7168, 8, 256, "fp8", 50.0, 322.0, chunks=4, ratio=1.0)  # even chunks
    assert e.sequential_us == e.network_us + e.forward_us and e.nic_share(50.0) > e.nic_share(50.0, False)
    assert e.pipelined_us == e.network_us + e.forward_us / 4 + e.reorder_us
    # the count exchange is paid once per call; the host's issue is hidden while it is shorter than the network's time
    hidden = internode_estimate(64, 8, 4096, 7168, 8, 256, "fp8", 50.0, 322.0, chunks=4, fixed_us=100.0,
                                host_us=e.network_us / 8, ratio=1.0)
    assert hidden.pipelined_us == e.pipelined_us + 100.0
    bound = internode_estimate(64, 8, 4096, 7168, 8, 256, "fp8", 50.0, 322.0, chunks=4, host_us=e.network_us,
                               ratio=1.0)
    assert bound.pipelined_us == 4 * e.network_us + e.forward_us / 4 + e.reorder_us
    # the host's time before the first rows is exposed; each further chunk adds its own host time, not a whole call's
    lead = internode_estimate(64, 8, 4096, 7168, 8, 256, "fp8", 50.0, 322.0, chunks=4, host_us=300.0, lead_us=200.0,
                              host_chunk_us=100.0, ratio=1.0)
    assert lead.host_us == 600.0 and lead.pipelined_us == e.pipelined_us + 200.0
    # what the transport does: the forwarding (~0.26 of the network's time at EP64) sets each chunk to ~0.26 of the
    # previous one, so only the last chunk's forwarding is exposed (less than with halving chunks, 1/15 of it); at
    # EP16 the two legs take about as long: even chunks
    g = internode_estimate(64, 8, 4096, 7168, 8, 256, "fp8", 50.0, 322.0, chunks=4)
    half = internode_estimate(64, 8, 4096, 7168, 8, 256, "fp8", 50.0, 322.0, chunks=4, ratio=0.5)
    assert abs(g.ratio - g.forward_us / g.network_us) < 1e-9 and 0.25 < g.ratio < 0.3
    assert abs(half.pipelined_us - (g.network_us + g.forward_us / 15 + g.reorder_us)) < 1e-6
    assert g.pipelined_us < half.pipelined_us and g.nic_share(50.0) > 0.95
    assert half.nic_share(50.0) > 0.94 and 0.9 < e.nic_share(50.0) < 0.91  # even chunks: the ceiling is ~90%
    assert internode_estimate(16, 8, 4096, 7168, 8, 256, "fp8", 50.0, 322.0, chunks=4).ratio == 1.0
    costs = internode.HostCosts.measured(rows)  # this run's, from the rows by phase (1 and 4 chunks)
    assert costs.fixed > 0 and costs.dispatch_host > 0 and costs.combine_host > 0, costs
    assert 0 < costs.dispatch_lead <= costs.dispatch_host, costs
    assert costs.dispatch_chunk is not None and costs.combine_chunk is not None, costs
    # the dispatch with a cached handle (what DeepEP's figures time): timed beside the others, its host time measured
    # and modelled without a count exchange
    assert {r["impl"] for r in rows if r["op"] == internode.CACHED_FP8} >= {"hierarchical", "flat alltoall"}
    assert costs.cached_host > 0 and costs.cached_chunk is not None, costs
    assert internode.HostCosts(fixed=500.0).model_args(internode.CACHED_FP8).get("fixed_us", 0.0) == 0.0
    # ... and its rows written in place over the one-sided node leg (no gather after it): no reorder charged
    cached_args = internode.HostCosts(fixed=500.0).model_args(internode.CACHED_FP8)
    placed = internode_estimate(64, 8, 4096, 7168, 8, 256, "fp8", 50.0, 322.0, chunks=4, ratio=1.0, **cached_args)
    assert cached_args["in_place"] and placed.reorder_us == 0.0 < e.reorder_us
    # (its device copies before the first rows cross: one pack of every chunk's rows, and its tokens' scales put at
    # the end of their rows, each a read and a write at the model's HBM rate)
    assert cached_args["copies"] == (0.0, 0.0, 1.0, 1.0)
    first = 2 * (e.crossing_bytes + 4096 * (7168 + 4 * 7168 // 128)) / 4000e9 * 1e6
    assert abs(placed.pipelined_us - (e.pipelined_us - e.reorder_us + first)) < 1e-6, (placed, e, first)
    # copies of each chunk's rows before it crosses and after it lands overlap the other chunks' transfers: in one
    # chunk both are exposed, in four chunks less than that (an exact-mode dispatch: its records copied out after its
    # rows land, its pack writing rows and records into the rows that are sent; a combine: the partials' sum where
    # they landed, its node leg writing them beside their weights into the rows that are sent)
    assert internode.HostCosts().model_args("dispatch FP8", records=0.04)["copies"] == (0.0, 0.04, 0.0, 0.0)
    assert abs(internode.records_share(7168, 8, "fp8") - 74 * 4 / 7392) < 1e-12  # (source, 56 scales, 8 ids, 8 weights)
    assert internode.HostCosts().model_args("combine BF16")["copies"] == (0.0, 1.0, 0.0, 0.0)
    copy = 2 * e.crossing_bytes / 4000e9 * 1e6
    for c in (1, 4):
        bare = internode_estimate(64, 8, 4096, 7168, 8, 256, "fp8", 50.0, 322.0, chunks=c, ratio=1.0)
        copied = internode_estimate(64, 8, 4096, 7168, 8, 256, "fp8", 50.0, 322.0, chunks=c, ratio=1.0,
                                    copies=(1.0, 1.0, 0.0, 0.0))
        exposed = copied.pipelined_us - bare.pipelined_us
        assert abs(exposed - 2 * copy) < 1e-6 if c == 1 else copy / 4 <= exposed < copy, (c, exposed, copy)
        assert abs(copied.sequential_us - bare.sequential_us - 2 * copy) < 1e-6
    # an exact-mode dispatch is written in place in any chunk count, with a head chunk or without
    # (HierarchicalTransport's _rows_in_place): no reorder charged
    shape = internode.InternodeBenchOptions(4096, 8, 7168, 8, 256, 2, ("uniform",), 4, "auto", 2)
    for head in (True, False):
        exact_args = internode.HostCosts(fixed=500.0, nohead_host=900.0).model_args("dispatch FP8", head=head)
        assert exact_args["in_place"], exact_args
        for c in (1, 4):
            monkeypatch.setattr(HierarchicalTransport, "CHUNK_CANDIDATES", (c,))
            got = internode.best_estimate(shape, 64, 8, "fp8", 50.0, 322.0, 0, exact_args)
            assert got.reorder_us == 0.0 and got.chunks == c, (c, got)
    model = open(tmp_path / "bench_internode_4ranks.md").read()
    assert internode.CACHED_FP8 in model and "with a cached handle" in model
    assert {"dispatch BF16: counts of both legs", "dispatch BF16: the call (host)", "combine BF16: the call (host)",
            "dispatch BF16: host after the count read", "dispatch BF16: host up to the count read",
            "dispatch BF16: host from the count read to the first rows",
            "dispatch BF16: host after the call's device work is issued"} <= {r["op"] for r in phases}
    assert not any("device work issued" in r["op"] and "(host)" in r["op"] for r in phases)  # (a point, not a part)
    assert {r["op"] for r in rows if r["impl"] == "hierarchical, 4 chunks, by phase"} >= {
        "dispatch BF16: host after the count read", "combine BF16: the call (host)"}
    # the split-node targets' table, from the isolated rows (no host-ahead rows on CPUs: no device to be ahead of)
    assert not any(r["impl"].endswith(internode.AHEAD) for r in rows)
    assert "split-node targets" in model and "share of the raw link" in model
    targets = internode.target_rows(rows)
    assert {(t["routing"], t["timing"]) for t in targets} == {("uniform", "isolated"), ("group_limited", "isolated")}
    assert {t["op"] for t in targets} == {op for op, _ in internode.TARGET_OPS}
    # the model's host-ahead columns: never slower than the isolated call's; the same for the exact-mode dispatch
    table = [line.split("|") for line in model.splitlines() if line.startswith("| 64 |")]
    assert table and "NIC share (host ahead)" in model
    # the model again from this run's CSV (its host terms), at another NIC rate, running nothing
    shape = ["--tokens", "24", "--hidden", "256", "--experts", "16", "--topk", "4"]
    run_csv = str(tmp_path / "bench_internode_4ranks.csv")
    assert internode.main(["--model-only", "--costs-from", run_csv, "--nic-gbps", "25", "--out", str(tmp_path),
                           "--name", "again"] + shape) == 0
    again = list(csv.DictReader(open(tmp_path / "again.csv")))
    opts = internode.InternodeBenchOptions(24, 4, 256, 4, 16, 2, ("uniform",), 4, "auto", 2)
    expected = internode.model_rows(opts, 25.0, 322.0, costs)
    assert [(r["EP"], r["op"], r["NIC share"]) for r in again] == [
        (str(r["EP"]), r["op"], str(r["NIC share"])) for r in expected]
    assert f"host terms of {run_csv}" in open(tmp_path / "again.md").read()
    for bad in (["--costs-from", run_csv], ["--model-only", "--costs-from", str(tmp_path / "again.csv")]):
        with pytest.raises(SystemExit):  # (a run measures its own; a CSV without rows by phase)
            internode.main(bad + ["--out", str(tmp_path)] + shape)


def test_targets_and_the_host_ahead_model():
    """The targets' table pairs each hierarchical row with the flat path's and the raw link's of the same timing
    (isolated, host ahead) and bytes (FP8 rows against the FP8 link row); the model with the host ahead charges a
    combine and a cached dispatch no host time and keeps the exact-mode dispatch's (its count read synchronises)."""
    from types import SimpleNamespace

    import pytest
    import torch

    from epcomm.bench import internode
    from epcomm.bench.timing import time_ahead

    def row(impl, op, us, routing="uniform"):
        return {"routing": routing, "impl": impl, "op": op, "time_us": us}

    rows = []
    for suffix, scale in (("", 1.0), (internode.AHEAD, 0.8)):
        # (host ahead: the raw link timed in turn with each operation, a row of its own beside each)
        beside = (lambda op: op) if suffix else (lambda op: "")  # noqa: E731
        rows += [row("hierarchical" + suffix, "dispatch FP8", 1000.0 * scale),
                 row("flat alltoall" + suffix, "dispatch FP8", 2000.0 * scale),
                 row("raw link" + suffix, internode.raw_op("fp8", beside("dispatch FP8")), 900.0 * scale),
                 row("raw link" + suffix, internode.raw_op("bf16", beside("combine BF16")), 1800.0 * scale),
                 row("hierarchical" + suffix, "combine BF16", 2000.0 * scale),
                 row("flat alltoall" + suffix, "combine BF16", 3000.0)]
    assert internode.raw_op("fp8") == "all_to_all FP8 bytes"
    assert internode.raw_op("bf16", "combine BF16") == "all_to_all BF16 bytes, beside combine BF16"
    targets = internode.target_rows(rows)
    assert [(t["timing"], t["op"]) for t in targets] == [("isolated", "dispatch FP8"), ("isolated", "combine BF16"),
                                                         ("host ahead", "dispatch FP8"), ("host ahead", "combine BF16")]
    assert (targets[0]["speed-up"], targets[0]["share of the raw link"]) == ("2.00x", "90%")
    assert targets[1]["raw link us"] == 1800 and targets[1]["share of the raw link"] == "90%"  # BF16 against BF16
    assert targets[3]["speed-up"] == "1.88x"  # (3000 / 1600)
    costs = internode.HostCosts(fixed=700.0, dispatch_host=2000.0, combine_host=3000.0, dispatch_lead=150.0,
                                dispatch_chunk=1400.0, combine_chunk=700.0, cached_host=2300.0, cached_chunk=150.0)
    ahead = costs.host_ahead()
    assert (ahead.combine_host, ahead.combine_chunk, ahead.cached_host, ahead.cached_chunk) == (0.0,) * 4
    assert (ahead.fixed, ahead.dispatch_host, ahead.dispatch_lead, ahead.dispatch_chunk) == (700.0, 2000.0, 150.0,
                                                                                             1400.0)
    opts = SimpleNamespace(tokens=4096, hidden=7168, topk=8, experts=256, max_groups=4)
    for r in internode.model_rows(opts, 50.0, 322.0, costs):
        assert r["NIC share (host ahead)"] >= r["NIC share"], r
        if r["op"] == "dispatch FP8":
            assert r["epcomm us (host ahead)"] == r["epcomm us (pipelined)"], r
    limited = [r for r in internode.model_rows(opts, 50.0, 322.0, costs) if r["EP"] == 64 and r["op"] != "dispatch FP8"
               and r["routing"] == "group_limited"]
    # (host-bound when charged: the host ahead gains, and both pass 90% with their own device passes over the rows
    # charged too)
    assert all(r["NIC share (host ahead)"] > r["NIC share"] + 0.05 for r in limited), limited
    assert limited[0]["NIC share (host ahead)"] > 0.95 and limited[1]["NIC share (host ahead)"] > 0.91, limited
    with pytest.raises(ValueError, match="^time_ahead: needs a CUDA device"):
        time_ahead(lambda: None, None, torch.device("cpu"))


def test_model_head_chunk_crosses_while_the_counts_travel():
    """The model's head chunk (``head_share``): its padded slots (a row per head token for every remote domain) cross
    from the call's start, so a count exchange and a host lead shorter than them are hidden, and the padding is
    paid; without a head the count exchange and the lead are paid in full. The exact dispatch's model arguments carry
    the transport's share."""
    from epcomm.bench import internode
    from epcomm.bench.traffic import internode_estimate, row_bytes
    from epcomm.transports.hierarchical import HierarchicalTransport

    args = (16, 8, 4096, 7168, 8, 256, "fp8", 50.0, 1e6)  # 2 domains; forwarding at 1e6 GB/s: ~free
    base = internode_estimate(*args, chunks=1, ratio=1.0)
    paid = internode_estimate(*args, chunks=1, ratio=1.0, fixed_us=100.0, lead_us=30.0)
    assert abs(paid.pipelined_us - (base.pipelined_us + 130.0)) < 1e-6
    head = internode_estimate(*args, chunks=1, ratio=1.0, fixed_us=100.0, lead_us=30.0, head_share=0.25)
    slots = 4096 * 0.25 * 1 * row_bytes(7168, "fp8") / 50e9 * 1e6  # every head slot crosses to the other domain
    assert slots > 130.0  # (the head outlasts the count exchange and the lead: both hidden)
    assert abs(head.pipelined_us - (slots + base.network_us * 0.75 + head.forward_us * 0.75 + head.reorder_us)) < 1e-3
    assert head.pipelined_us < paid.pipelined_us and head.crossing_bytes == base.crossing_bytes
    # bounded as the transport bounds it (the tokens the link moves during the count exchange, at the call's pace):
    # where the exchange outlasts twice the head's rows there is none, and without an exchange none either
    short = internode_estimate(*args, chunks=1, ratio=1.0, fixed_us=3000.0, head_share=0.25)
    assert abs(short.pipelined_us - (3000.0 + base.pipelined_us)) < 1e-3
    assert abs(internode_estimate(*args, chunks=1, ratio=1.0, head_share=0.25).pipelined_us
               - base.pipelined_us) < 0.2  # (one token's head)
    assert internode.HostCosts().model_args("dispatch FP8")["head_share"] == HierarchicalTransport.head_share > 0


def test_model_takes_the_head_chunk_only_where_it_pays():
    """The model weighs a dispatch with a head chunk against one without, each with its own measured host times (the
    head's receive and forwarding cost the host a chunk's work after the count read), and keeps the faster, as the
    transport's tuner does: a long count exchange favours the head, a slow host after the read does not."""
    from types import SimpleNamespace

    from epcomm.bench import internode

    opts = SimpleNamespace(tokens=4096, hidden=7168, topk=8, experts=256)
    row = lambda impl, op, us: {"routing": "uniform", "impl": impl, "op": op, "time_us": str(us)}  # noqa: E731
    one, nohead = internode.phased_impl(1), internode.phased_impl(1, head=False)
    after, lead = f"dispatch BF16: {internode.HOST_AFTER_READ}", f"dispatch BF16: {internode.HOST_LEAD}"
    counts = f"dispatch BF16: {internode.COUNTS_PHASE}"

    def costs(fixed, with_head, without, fixed_without=None):
        rows = [row(one, counts, fixed), row(one, after, with_head), row(one, lead, 600.0),
                row(nohead, after, without), row(nohead, lead, 150.0)]
        if fixed_without is not None:  # (the calls without a head measure their own count exchange)
            rows.append(row(nohead, counts, fixed_without))
        return internode.HostCosts.measured(rows)

    assert internode.phased_impl(1, head=False) == "hierarchical, 1 chunk, no head, by phase"
    slow_counts = costs(2000.0, 3000.0, 2900.0)  # the head costs the host little: it hides the long exchange
    assert (slow_counts.nohead_host, slow_counts.nohead_lead) == (2900.0, 150.0)
    assert slow_counts.heads("dispatch FP8") == (True, False) and slow_counts.heads(internode.CACHED_FP8) == (True,)
    assert "without a head chunk 2900 us" in slow_counts.describe()
    e, head = internode.best_of_heads(opts, 64, 8, "fp8", 50.0, 322.0, 0, slow_counts, "dispatch FP8")
    assert head
    dear = costs(300.0, 6000.0, 2900.0)  # a short exchange and a dear head: none
    e2, head2 = internode.best_of_heads(opts, 64, 8, "fp8", 50.0, 322.0, 0, dear, "dispatch FP8")
    assert not head2
    with_head = internode.best_estimate(opts, 64, 8, "fp8", 50.0, 322.0, 0, dear.model_args("dispatch FP8"))
    assert e2.pipelined_us < with_head.pipelined_us
    assert "head_share" not in dear.model_args("dispatch FP8", head=False)
    # each option with its own count exchange where measured (a head's host work may delay the count read)
    own = costs(1200.0, 3000.0, 2900.0, fixed_without=800.0)
    assert own.model_args("dispatch FP8", head=False)["fixed_us"] == 800.0
    assert own.model_args("dispatch FP8")["fixed_us"] == 1200.0 and "800 us of count exchange" in own.describe()
    assert own.model_args("dispatch FP8", 50.0, head=False)["fixed_us"] == 50.0  # (a given exchange replaces both)
    assert dear.model_args("dispatch FP8", head=False)["fixed_us"] == 300.0  # (not measured: the head's)
    rows = internode.model_rows(opts if hasattr(opts, "max_groups") else SimpleNamespace(**vars(opts), max_groups=4),
                                50.0, 322.0, dear)
    assert {r["head chunk"] for r in rows if r["op"] == "dispatch FP8"} == {"no"}
    assert {r["head chunk"] for r in rows if r["op"] != "dispatch FP8"} == {""}


def test_model_host_ahead_columns_take_the_count_exchange_timed_with_the_host_ahead():
    """Where the run timed the count exchange with the host ahead (``COUNTS_AHEAD``, with a head chunk and without),
    the model's host-ahead columns charge that one and the isolated columns the isolated one; a given
    ``--fixed-us`` replaces all four; without those rows nothing changes."""
    from types import SimpleNamespace

    from epcomm.bench import internode

    opts = SimpleNamespace(tokens=4096, hidden=7168, topk=8, experts=256, max_groups=4)
    row = lambda impl, op, us: {"routing": "uniform", "impl": impl, "op": op, "time_us": str(us)}  # noqa: E731
    one, nohead = internode.phased_impl(1), internode.phased_impl(1, head=False)
    after, counts = f"dispatch BF16: {internode.HOST_AFTER_READ}", f"dispatch BF16: {internode.COUNTS_PHASE}"
    ahead = f"dispatch BF16: {internode.COUNTS_AHEAD}"
    assert ahead == f"dispatch BF16: {internode.COUNTS_PHASE}, host ahead"
    rows = [row(one, counts, 900.0), row(one, after, 1500.0), row(nohead, counts, 800.0), row(nohead, after, 1400.0)]
    plain = internode.HostCosts.measured(rows)
    timed = internode.HostCosts.measured(rows + [row(one, ahead, 300.0), row(nohead, ahead, 250.0)])
    assert (plain.fixed_ahead, plain.nohead_fixed_ahead) == (None, None)
    assert (timed.fixed_ahead, timed.nohead_fixed_ahead) == (300.0, 250.0)
    assert plain.host_ahead().fixed == 900.0 and plain.host_ahead().nohead_fixed == 800.0
    assert timed.host_ahead().fixed == 300.0 and timed.host_ahead().nohead_fixed == 250.0
    assert timed.model_args("dispatch FP8")["fixed_us"] == 900.0  # (isolated: the isolated exchange)
    assert timed.host_ahead().model_args("dispatch FP8", head=False)["fixed_us"] == 250.0
    assert "(300 us with the host ahead, 250 us without a head chunk)" in timed.describe()
    shares = {(r["EP"], r["routing"], r["op"]): r for r in internode.model_rows(opts, 50.0, 322.0, timed)}
    before = {(r["EP"], r["routing"], r["op"]): r for r in internode.model_rows(opts, 50.0, 322.0, plain)}
    key = (64, "uniform", "dispatch FP8")
    assert shares[key]["NIC share"] == before[key]["NIC share"]  # (the isolated columns: unchanged)
    assert shares[key]["NIC share (host ahead)"] > before[key]["NIC share (host ahead)"]
    given = internode._override(timed, 100.0, None)
    assert (given.fixed, given.nohead_fixed, given.fixed_ahead, given.nohead_fixed_ahead) == (100.0, None, None, None)
    assert given.host_ahead().model_args("dispatch FP8", head=False)["fixed_us"] == 100.0


def test_model_lets_the_host_tail_run_beside_the_last_forwarding():
    """The host's time after a dispatch's last device work is issued (``HOST_TAIL``: its handle) runs beside the
    device's last forwarding: a host-bound call ends that much earlier, up to the forwarding's time, never before the
    host's own end; the measured rows give it (with a head chunk and without) and ``--host-us`` clears it."""
    from types import SimpleNamespace

    from epcomm.bench import internode
    from epcomm.bench.traffic import internode_estimate

    args = dict(ranks=64, gpus_per_node=8, num_tokens=4096, hidden=7168, topk=8, num_experts=256, kind="fp8",
                nic_gbps=50.0, nvlink_gbps=322.0, chunks=1, fixed_us=150.0, host_us=5000.0, lead_us=200.0,
                in_place=True)
    plain = internode_estimate(**args)
    fwd = plain.forward_us
    assert abs(plain.pipelined_us - (150.0 + 5000.0 + fwd)) < 1e-6  # host-bound: the host's end, then the forwarding
    for tail in (100.0, fwd / 2):
        assert abs(internode_estimate(**args, tail_us=tail).pipelined_us - (plain.pipelined_us - tail)) < 1e-6
    # a tail longer than the forwarding: the call ends with the host
    assert abs(internode_estimate(**args, tail_us=fwd + 500.0).pipelined_us - (150.0 + 5000.0)) < 1e-6
    # network-bound: the tail changes nothing
    quick = dict(args, host_us=600.0)
    assert internode_estimate(**quick, tail_us=300.0).pipelined_us == internode_estimate(**quick).pipelined_us
    row = lambda impl, op, us: {"routing": "uniform", "impl": impl, "op": op, "time_us": str(us)}  # noqa: E731
    one, nohead = internode.phased_impl(1), internode.phased_impl(1, head=False)
    counts = f"dispatch BF16: {internode.COUNTS_PHASE}"
    after, tail = f"dispatch BF16: {internode.HOST_AFTER_READ}", f"dispatch BF16: {internode.HOST_TAIL}"
    costs = internode.HostCosts.measured([row(one, counts, 900.0), row(one, after, 3000.0), row(one, tail, 250.0),
                                          row(nohead, counts, 800.0), row(nohead, after, 2800.0),
                                          row(nohead, tail, 200.0)])
    assert (costs.dispatch_tail, costs.nohead_tail) == (250.0, 200.0)
    assert costs.model_args("dispatch FP8")["tail_us"] == 250.0
    assert costs.model_args("dispatch FP8", head=False)["tail_us"] == 200.0
    assert "200 us after its last device work" in costs.describe()
    given = internode._override(costs, None, 500.0)
    assert given.model_args("dispatch FP8")["tail_us"] == 0.0 and given.model_args("dispatch FP8", head=False)[
        "tail_us"] == 0.0
    opts = SimpleNamespace(tokens=4096, hidden=7168, topk=8, experts=256, max_groups=4)
    shares = {(r["EP"], r["routing"], r["op"]): r for r in internode.model_rows(opts, 50.0, 322.0, costs)}
    untailed = {(r["EP"], r["routing"], r["op"]): r for r in internode.model_rows(
        opts, 50.0, 322.0, internode.replace(costs, dispatch_tail=0.0, nohead_tail=None))}
    key = (64, "uniform", "dispatch FP8")
    assert shares[key]["NIC share"] > untailed[key]["NIC share"]


def test_model_charges_a_gated_dispatch_its_own_host_time_per_chunk():
    """Where the dispatches without a head chunk were measured in several chunks too (over a one-sided domain leg:
    ``HierarchicalTransport._gated``), the model charges each further chunk of such a dispatch what those calls added
    (``nohead_chunk``), not what a dispatch with a head chunk adds per chunk; where not measured, the latter; the
    one-sided node leg's extra host time (a one-GPU simulated node) is charged to it once per call, not per chunk;
    ``--host-us`` replaces it too."""
    from types import SimpleNamespace

    from epcomm.bench import internode

    row = lambda impl, op, us: {"routing": "uniform", "impl": impl, "op": op, "time_us": str(us)}  # noqa: E731
    c1, cn = internode.PHASED_CHUNKS[0], internode.PHASED_CHUNKS[-1]
    counts = f"dispatch BF16: {internode.COUNTS_PHASE}"
    after = f"dispatch BF16: {internode.HOST_AFTER_READ}"
    rows = [row(internode.phased_impl(c1), counts, 900.0), row(internode.phased_impl(c1), after, 3000.0),
            row(internode.phased_impl(cn), after, 3000.0 + 900.0 * (cn - c1)),
            row(internode.phased_impl(c1, head=False), counts, 800.0),
            row(internode.phased_impl(c1, head=False), after, 2000.0)]
    ungated = internode.HostCosts.measured(rows)
    assert ungated.nohead_chunk is None and ungated.dispatch_chunk == 900.0
    assert ungated.model_args("dispatch FP8", head=False)["host_chunk_us"] == 900.0
    costs = internode.HostCosts.measured(rows + [row(internode.phased_impl(cn, head=False), after,
                                                     2000.0 + 300.0 * (cn - c1))])
    assert costs.nohead_chunk == 300.0 and costs.dispatch_chunk == 900.0
    assert costs.model_args("dispatch FP8", head=False)["host_chunk_us"] == 300.0
    assert costs.model_args("dispatch FP8")["host_chunk_us"] == 900.0
    assert "300 us more per further chunk" in costs.describe()
    node = [{"routing": "uniform", "impl": internode.NODE_LEG, "op": "known-count dispatch (host)", "time_us": "700"},
            row(internode.phased_impl(c1), "dispatch BF16: forwarding the tokens (host)", 500.0)]
    legged = internode.HostCosts.measured(rows + node + [row(internode.phased_impl(cn, head=False), after,
                                                            2000.0 + 300.0 * (cn - c1))])
    assert (legged.nohead_host, legged.nohead_chunk, legged.dispatch_chunk) == (2200.0, 300.0, 1100.0)
    assert internode._override(costs, None, 500.0).nohead_chunk == 500.0
    opts = SimpleNamespace(tokens=4096, hidden=7168, topk=8, experts=256, max_groups=4)
    key = (64, "uniform", "dispatch FP8")
    shares = {(r["EP"], r["routing"], r["op"]): r for r in internode.model_rows(opts, 50.0, 322.0, costs)}
    before = {(r["EP"], r["routing"], r["op"]): r for r in internode.model_rows(opts, 50.0, 322.0, ungated)}
    assert shares[key]["NIC share (host ahead)"] >= before[key]["NIC share (host ahead)"]
    # the gated call's own lead and tail (measured in several chunks) for several chunks, the one-chunk call's for one
    lead, tail = f"dispatch BF16: {internode.HOST_LEAD}", f"dispatch BF16: {internode.HOST_TAIL}"
    several = internode.phased_impl(cn, head=False)
    timed = internode.HostCosts.measured(rows + [row(several, after, 2000.0 + 300.0 * (cn - c1)),
                                                 row(internode.phased_impl(c1, head=False), lead, 90.0),
                                                 row(internode.phased_impl(c1, head=False), tail, 200.0),
                                                 row(several, lead, 400.0), row(several, tail, 350.0)])
    args = timed.model_args("dispatch FP8", head=False)
    assert (args["lead_us"], args["tail_us"], args["one_chunk"]) == (400.0, 350.0, {"lead_us": 90.0, "tail_us": 200.0})
    assert "in several chunks 400 us before its first rows' collective and 350 us after" in timed.describe()
    one = internode.internode_estimate(64, 8, 4096, 7168, 8, 256, "fp8", 50.0, 322.0, 0, 1, **dict(
        {k: v for k, v in args.items() if k != "one_chunk"}, **args["one_chunk"]))
    old_candidates = internode.HierarchicalTransport.CHUNK_CANDIDATES
    internode.HierarchicalTransport.CHUNK_CANDIDATES = (1,)
    try:
        assert internode.best_estimate(opts, 64, 8, "fp8", 50.0, 322.0, 0, args).pipelined_us == one.pipelined_us
    finally:
        internode.HierarchicalTransport.CHUNK_CANDIDATES = old_candidates
    assert internode._override(timed, None, 500.0).model_args("dispatch FP8", head=False)["lead_us"] == 0.0


def test_model_charges_the_one_sided_node_leg():
    """Where each simulated node is one GPU, the model charges every chunk's node leg at the one-sided transport's
    host time (measured on the GPUs as one domain) where that is the larger: each call's one-chunk and per-chunk
    host terms grow by the difference, never shrink (a cached dispatch's once per call: one gated push for all
    chunks); without those rows nothing changes."""
    from epcomm.bench import internode

    base = internode.HostCosts(fixed=700.0, dispatch_host=2000.0, combine_host=900.0, dispatch_lead=150.0,
                               dispatch_chunk=1400.0, combine_chunk=400.0, cached_host=1300.0, cached_chunk=500.0)
    one = internode.phased_impl(internode.PHASED_CHUNKS[0])

    def row(impl, op, us, routing="uniform"):
        return {"routing": routing, "impl": impl, "op": op, "time_us": str(us)}

    rows = [row(one, own, us) for (_, _, own), us in zip(internode.NODE_LEG_CALLS, (100.0, 80.0, 90.0))]
    assert base.with_node_leg(rows) == base  # not measured: the path's own legs' times stand
    rows += [row(internode.NODE_LEG, node, us) for (_, node, _), us in zip(internode.NODE_LEG_CALLS,
                                                                            (400.0, 300.0, 60.0))]
    rows += [row(internode.NODE_LEG, internode.NODE_LEG_CALLS[0][1], 9999.0, "group_limited")]  # uniform's taken
    got = base.with_node_leg(rows)
    assert (got.dispatch_host, got.dispatch_chunk) == (2300.0, 1700.0), got
    assert (got.cached_host, got.cached_chunk) == (1520.0, 500.0), got
    assert (got.combine_host, got.combine_chunk) == (900.0, 400.0), got  # the one-GPU leg was slower: kept
    assert (got.fixed, got.dispatch_lead) == (700.0, 150.0) and len(got.node_leg) == 3, got
    assert "one-sided transport" in got.describe()


def _layer_and_demo(ctx):
    import torch

    from epcomm.bench.demo import DemoOptions, demo_worker
    from epcomm.layers.checks import run_layer_cases
    from test_layers import CASES_4

    torch.set_num_threads(1)
    failed = run_layer_cases(ctx, CASES_4)
    rows = demo_worker(ctx, DemoOptions(tokens=24, hidden=256, experts=16, topk=4, ll_tokens=8, iters=2, seed=3,
                                        transport="auto"))
    failed += [("demo " + r["op"], ["does not match the reference"]) for r in rows if r["correct"] != "yes"]
    failed += [("demo transport", [r["transport"]]) for r in rows if r["transport"] != "hierarchical"]
    return failed


def test_layer_and_demo_across_simulated_nodes(monkeypatch):
    """The MoE layer (against its dense reference) and the demo, unchanged, on 2 simulated nodes of 2 ranks."""
    monkeypatch.setenv("EPCOMM_RANKS_PER_NODE", "2")
    results = spawn(_layer_and_demo, 4, device="cpu", timeout_s=400)
    problems = [f"rank {r}: {label}: {fails}" for r, res in enumerate(results) for label, fails in res]
    assert not problems, "\n".join(problems)


def test_groups_are_aborted_at_once(monkeypatch):
    """``faults.abort_groups`` starts every group's abort before waiting for any: here (as with NCCL, where an abort
    frees memory and so waits for the device) aborting the first group cannot finish until the second group's abort
    has started. One by one, the first abort would wait for its whole limit."""
    import threading
    import time

    import torch.distributed as dist

    from epcomm.transports import faults

    started = {g: threading.Event() for g in ("rail", "domain")}
    finished = []

    def abort(g):
        started[g].set()
        if g == "rail" and not started["domain"].wait(5.0):
            return  # the domain group's abort never started while this one waited
        finished.append(g)

    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", abort)
    begin = time.monotonic()
    faults.abort_groups(("rail", "domain"))
    assert sorted(finished) == ["domain", "rail"] and time.monotonic() - begin < 4.0
