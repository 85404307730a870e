"""The one-sided transport's kernels under the Triton interpreter: CPU processes share a symmetric heap in
shared memory, so the same push/copy-out/combine code paths run without a GPU, checked bit-exact against
the reference (normal mode; several rounds; num_worst_tokens; FP8; cached handles; bias and weights)."""

import os
import time

import pytest

pytest.importorskip("triton")

from epcomm.testing import spawn  # noqa: E402
from epcomm.testing.checks import LowLatencyCase, NormalCase, run_cases  # noqa: E402
from epcomm.transports.nvlink import NVLinkTransport, P2PTransport  # noqa: E402

CASES = [
    NormalCase(num_tokens=(5, 0, 7), hidden=64, num_experts=6, topk=2, dtype="bf16", bias=2, seed=31),
    NormalCase(num_tokens=6, hidden=128, num_experts=6, topk=3, dtype="fp8", routing="dropped", strict_sms=True,
               seed=32),
    NormalCase(num_tokens=(4, 6, 1), hidden=32, num_experts=6, topk=2, dtype="fp32", worst=True,
               expert_alignment=4, seed=33),
    NormalCase(num_tokens=5, hidden=40, num_experts=6, topk=2, routing="one_rank", with_topk=False, seed=34),
]
# enough tokens per pushing program that the streaming dispatch reports progress mid-way (every SIGNAL_TOKENS)
LONG = NormalCase(num_tokens=(100, 37, 0), hidden=16, num_experts=6, topk=2, dtype="bf16", seed=37)


def _run(world_size, transport, buffer_kwargs, cases):
    results = spawn(run_cases, world_size, cases, transport, buffer_kwargs, device="cpu", timeout_s=600)
    problems = [f"rank {r}: {label}: {fails}" for r, res in enumerate(results) for label, fails in res]
    assert not problems, "\n".join(problems)


def test_one_sided_transport_single_round(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _run(3, NVLinkTransport, {"num_nvl_bytes": 1 << 20}, CASES + [LONG])


def test_one_sided_transport_in_rounds(monkeypatch):
    """A buffer too small for one call: the traffic moves in several rounds, results unchanged."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cases = [NormalCase(num_tokens=(9, 3), hidden=64, num_experts=4, topk=2, dtype="bf16", bias=1, seed=35),
             NormalCase(num_tokens=8, hidden=128, num_experts=4, topk=2, dtype="fp8", seed=36)]
    _run(2, P2PTransport, {"num_nvl_bytes": 2 * 3 * (128 + 64)}, cases)


def _across_domains(ctx, cases, chunks):
    from epcomm.transports.hierarchical import HierarchicalTransport

    HierarchicalTransport.pipeline_chunks = chunks
    return run_cases(ctx, cases, NVLinkTransport, {"num_nvl_bytes": 1 << 20, "ranks_per_node": 2})


def test_one_sided_domain_leg_across_simulated_nodes(monkeypatch):
    """2 simulated nodes of 2 ranks with these kernels forwarding within each node: the domain leg is given its
    counts (learnt with the inter-domain leg's) and keeps its exchange on the device, checked against them. (In one
    chunk; ``test_gated_cached_dispatch_forwards_once_per_call`` runs every mode in three.) The second case's
    dispatch sends a head chunk (slots sized by the first); the third's handle has fixed slots (``num_worst_tokens``),
    whose cached dispatch takes the mapped path too."""
    chunks = 1
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cases = [NormalCase(num_tokens=(5, 0, 7, 3), hidden=64, num_experts=8, topk=3, dtype="bf16", bias=1, seed=51),
             NormalCase(num_tokens=6, hidden=128, num_experts=8, topk=2, dtype="fp8", routing="dropped", seed=52),
             NormalCase(num_tokens=(4, 6, 0, 5), hidden=128, num_experts=8, topk=3, dtype="fp8", worst=True, seed=53)]
    results = spawn(_across_domains, 4, cases, chunks, device="cpu", timeout_s=600)
    problems = [f"rank {r}: {label}: {fails}" for r, res in enumerate(results) for label, fails in res]
    assert not problems, "\n".join(problems)


def _gated(ctx, withheld, nvl_bytes=1 << 20, gated_exact=True):
    """Cached dispatches across 2 simulated nodes of 2 ranks in 3 chunks, checked against the reference, while the
    domain leg's calls are counted: ``(failures, [(cached call, domain-leg calls, whether gated and mapped)], the
    domain's storage bytes before and after each cached call, whether merge_cached refused rows too wide for fixed
    storage)``; with
    ``withheld`` rank 1 never releases chunk 1's flag: ``(the error that rank's next check raises, or None)``.
    ``nvl_bytes``: the Buffer's ``num_nvl_bytes`` (0: storage sized by the first dispatch, grown where needed);
    ``gated_exact``: the exact-mode dispatches' chunks through the domain leg in one gated call too (else one by
    one)."""
    from epcomm.buffer import Buffer
    from epcomm.errors import EpcommError
    from epcomm.testing.checks import check_normal
    from epcomm.transports.hierarchical import HierarchicalTransport

    HierarchicalTransport.pipeline_chunks, HierarchicalTransport.gated_exact = 3, gated_exact
    NVLinkTransport.min_storage_bytes = 4096  # (grown storage: small, so that the merged call must grow it)
    buf = Buffer(ctx.group, transport=NVLinkTransport, num_nvl_bytes=nvl_bytes, ranks_per_node=2)
    rt = buf.runtime
    domain_dispatch, seen, states, sizes = rt.domain.dispatch, [], [], []
    mapped = rt._mapped

    def watched(fn, st, rows, req):  # the handles, and the domain's storage before and after each cached call
        states.append(st)
        sizes.append(rt.domain.area_bytes)
        out = mapped(fn, st, rows, req)
        sizes.append(rt.domain.area_bytes)
        return out

    rt._mapped = watched

    def counted(req):
        if req.handle is not None:
            seen.append(req.gate is not None and req.row_map is not None)
            if withheld and ctx.rank == 1:
                rt._gate_flags[1] -= 1  # (on CPUs every chunk's flag is released before the push: take one back)
        return domain_dispatch(req)

    rt.domain.dispatch = counted
    failures, calls = [], []
    cases = (NormalCase(num_tokens=(9, 0, 14, 6), hidden=64, num_experts=8, topk=3, dtype="bf16", seed=81),
             NormalCase(num_tokens=(7, 11, 3, 0), hidden=128, num_experts=8, topk=2, dtype="fp8", seed=82,
                        routing="skewed"))
    if withheld:
        try:
            check_normal(ctx, buf, cases[0])
            buf.check_errors()
            return None
        except EpcommError as exc:
            return str(exc)
    for case in cases:
        seen.clear()
        failures += check_normal(ctx, buf, case).failures
        calls.append((case.label(), len(seen), all(seen)))
    refused = None
    if nvl_bytes:  # fixed storage: rows that cannot fit one round are refused (the chunks then go one by one)
        refused = rt.domain.merge_cached(list(states[-1].domain), rt.domain.area_bytes) is None
    buf.destroy()
    return failures, calls, sizes, refused


def test_gated_cached_dispatch_forwards_once_per_call(monkeypatch):
    """A cached dispatch across simulated nodes issues its domain leg once for all chunks (a gated push that waits
    for each chunk's flag and writes every row at its place in the output's order: no gather after it), bit-exact
    against the reference (BF16, FP8 with scales split from the rows as they are written, skewed routing, an empty
    rank)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for rank, (failures, calls, _, refused) in enumerate(spawn(_gated, 4, False, device="cpu", timeout_s=600)):
        assert not failures, f"rank {rank}: {failures}"
        assert [c[1:] for c in calls] == [(1, True)] * 2, f"rank {rank}: {calls}"
        assert refused, f"rank {rank}: merge_cached took rows wider than its fixed storage"


@pytest.mark.parametrize("gated_exact", [False, True])
def test_gated_dispatch_grows_storage_sized_by_the_first_call(monkeypatch, gated_exact):
    """Storage sized by the first (exact-mode, chunked) dispatch, its chunks one by one: the merged call of all chunks
    needs more, so ``merge_cached`` grows it (every rank at the same call) and the gated push still runs, bit-exact.
    Where the exact-mode dispatch merges its chunks too (``gated_exact``), it grows the storage for its merged call
    (``holds_merged``) and the cached dispatches, whose rows are narrower, need no more."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for rank, (failures, calls, sizes, _) in enumerate(spawn(_gated, 4, False, 0, gated_exact, device="cpu",
                                                             timeout_s=600)):
        assert not failures, f"rank {rank}: {failures}"
        assert [c[1:] for c in calls] == [(1, True)] * 2, f"rank {rank}: {calls}"
        if gated_exact:
            assert sizes[0] == sizes[1] > 4096, f"rank {rank}: storage before and after each cached call {sizes}"
        else:
            assert sizes[0] < sizes[1], f"rank {rank}: storage before and after each cached call {sizes}"


def test_gated_dispatch_without_its_rows_is_an_error(monkeypatch):
    """A chunk's flag that never comes: the push gives up after the timeout and that rank raises an error naming the
    chunk and the inter-domain leg; its domain peer, whose rows from it never came, raises an error naming it
    (nothing waits forever, and no rank takes rows that were not pushed)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("EPCOMM_TIMEOUT_S", "1")
    errors = spawn(_gated, 4, True, device="cpu", timeout_s=600)
    assert errors[1] is not None and "chunk 1" in errors[1] and "inter-domain leg" in errors[1], errors
    assert errors[0] is not None and "rank 1" in errors[0], errors


def _grows(ctx):
    """Storage sized by a small first dispatch, then calls with more tokens (after the epochs were put just below
    their 32-bit wrap): each checked against the reference; returns the failures and the storage sizes."""
    from epcomm.buffer import Buffer
    from epcomm.testing.checks import ExpertMajorCase, check_expert_major, check_low_latency, check_normal

    NVLinkTransport.min_storage_bytes = 4096  # (at least 1 MiB otherwise: these shapes would fit it)
    buf = Buffer(ctx.group, transport=NVLinkTransport)
    rt = buf.runtime
    small = NormalCase(num_tokens=(3, 2, 1), hidden=64, num_experts=6, topk=2, dtype="bf16", seed=71)
    big = NormalCase(num_tokens=(24, 0, 17), hidden=128, num_experts=6, topk=2, dtype="fp8", bias=1, seed=72)
    failures = check_normal(ctx, buf, small).failures
    sizes = [rt.area_bytes]
    rt._start_epochs(2**31 - 2)  # the control words carried into new storage must keep the epochs going
    failures += check_normal(ctx, buf, big).failures
    sizes.append(rt.area_bytes)
    failures += check_normal(ctx, buf, small).failures + check_normal(ctx, buf, big).failures
    failures += check_expert_major(ctx, buf, ExpertMajorCase(num_tokens=(48, 7, 37), hidden=64, num_experts=6,
                                                             topk=3, dtype="bf16", expert_alignment=4,
                                                             seed=73)).failures
    sizes.append(rt.area_bytes)
    failures += check_low_latency(ctx, buf, LowLatencyCase(num_tokens=(3, 0, 2), max_tokens=4, hidden=128,
                                                           num_experts=6, topk=2, seed=74)).failures
    failures += rt.pending_errors()
    buf.destroy()
    return failures, sizes


def test_storage_sized_by_a_small_first_call_grows(monkeypatch, caplog):
    """A Buffer whose first dispatch had few tokens grows its storage at the first dispatch that needs more (one
    collective step, then a single round again), with results unchanged and the epochs carried over; an
    expert-major dispatch with more tokens still grows it."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for rank, (failures, sizes) in enumerate(spawn(_grows, 3, device="cpu", timeout_s=600)):
        assert failures == [], (rank, failures)
        assert sizes[0] < sizes[1] <= sizes[2], sizes


def _worst_after_a_small_call(ctx):
    """Storage sized by a small exact-mode dispatch, then a ``num_worst_tokens`` dispatch whose FP8 rows fit it but
    whose combine's BF16 rows would not, then an expert-major one of more pairs: returns the failures against the
    reference, the storage sizes, and the error of such a dispatch on storage that ``num_nvl_bytes`` fixed."""
    import torch

    from epcomm.buffer import Buffer
    from epcomm.errors import BufferTooSmallError
    from epcomm.testing.checks import ExpertMajorCase, check_expert_major, check_normal

    NVLinkTransport.min_storage_bytes = 4096
    buf = Buffer(ctx.group, transport=NVLinkTransport)
    failures = check_normal(ctx, buf, NormalCase(num_tokens=(3, 2, 1), hidden=64, num_experts=6, topk=2,
                                                 dtype="bf16", seed=75)).failures
    sizes = [buf.runtime.area_bytes]
    failures += check_normal(ctx, buf, NormalCase(num_tokens=(2, 2, 1), hidden=128, num_experts=6, topk=2,
                                                  dtype="fp8", worst=True, seed=76)).failures
    sizes.append(buf.runtime.area_bytes)
    failures += check_expert_major(ctx, buf, ExpertMajorCase(num_tokens=(9, 7, 5), hidden=128, num_experts=6, topk=2,
                                                             dtype="fp8", expert_alignment=2, worst=True,
                                                             seed=77)).failures
    sizes.append(buf.runtime.area_bytes)
    failures += buf.runtime.pending_errors()
    buf.destroy()
    # storage fixed by num_nvl_bytes cannot grow: the dispatch raises before any row moves, naming the combine
    fixed = Buffer(ctx.group, transport=NVLinkTransport, num_nvl_bytes=4096)
    x = torch.randn(2, 128).to(torch.bfloat16)
    idx = torch.tensor([[0, 3], [5, -1]])
    per_rank, _, per_expert, in_rank, _ = fixed.get_dispatch_layout(idx, 6)
    try:
        fixed.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                       topk_idx=idx, topk_weights=torch.rand(2, 2), num_worst_tokens=64)
        raised = None
    except BufferTooSmallError as exc:
        raised = str(exc)
    fixed.destroy()
    return failures, sizes, raised


def test_worst_tokens_dispatch_makes_room_for_its_combine(monkeypatch):
    """A ``num_worst_tokens`` dispatch after a smaller first call grows the storage (every rank at the same call)
    for its own rows and for its combine's, which are wider where the dispatch sends FP8: the combine then fits (it
    raised BufferTooSmallError before; found at 8 ranks in domains of 4); storage fixed by ``num_nvl_bytes`` cannot
    grow, so there the dispatch raises before any row moves."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for rank, (failures, sizes, raised) in enumerate(spawn(_worst_after_a_small_call, 3, device="cpu",
                                                           timeout_s=600)):
        assert failures == [], (rank, failures)
        assert sizes[0] < sizes[1] <= sizes[2], sizes
        assert raised is not None and raised.startswith("Buffer.dispatch: num_worst_tokens=64 needs"), raised
        assert "for this dispatch and its combine" in raised and "pass num_nvl_bytes >=" in raised, raised


def _known_counts_checked(ctx):
    """Exact-mode dispatches given their counts beforehand (``KnownCounts``, as the hierarchical path's domain leg
    gets them): right counts, then one expert's count off by one, then the largest token count off by one (neither
    changes where rows go). Returns (each call's rows equal the first dispatch's, the errors pending after each)."""
    import torch

    from epcomm.buffer import Buffer
    from epcomm.core.config import Config
    from epcomm.transports.base import DispatchRequest, KnownCounts

    buf = Buffer(ctx.group, transport=NVLinkTransport)
    rt = buf.runtime
    gen = torch.Generator().manual_seed(90 + ctx.rank)
    n, e = 5 + 2 * ctx.rank, 6
    x = torch.randn(n, 64, generator=gen).to(torch.bfloat16)
    idx = torch.randint(0, e, (n, 2), generator=gen)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, e)
    req = DispatchRequest(x, None, idx, None, per_rank, in_rank, per_expert, e, 1, 0, None, Config(), None)
    first = rt.dispatch(req)
    h = first.handle
    right = KnownCounts(h.num_tokens_per_rank, h.num_recv_tokens_per_rank,
                        tuple(first.num_recv_tokens_per_expert_list), num_tokens_max=h.state.num_tokens_max,
                        max_pair=h.state.max_pair)
    per_expert_off = tuple(c + (i == 0) for i, c in enumerate(right.num_recv_tokens_per_expert))
    out = []
    for known in (right, KnownCounts(right.num_tokens_per_rank, right.num_recv_tokens_per_rank, per_expert_off,
                                     right.num_tokens_max, right.max_pair),
                  KnownCounts(right.num_tokens_per_rank, right.num_recv_tokens_per_rank,
                              right.num_recv_tokens_per_expert, right.num_tokens_max + 1, right.max_pair)):
        got = rt.dispatch(DispatchRequest(x, None, idx, None, per_rank, in_rank, per_expert, e, 1, 0, None, Config(),
                                          None, known=known))
        out.append((torch.equal(got.recv_x.view(torch.int16), first.recv_x.view(torch.int16)),
                    rt.pending_errors()))
    try:
        buf.destroy()
    except Exception:  # (the errors are reported at destroy: expected)
        pass
    return out


def test_known_counts_are_checked_on_the_device(monkeypatch):
    """Counts known beforehand spare the host its read; the exchange kernel still counts what it finds, and a
    difference (one expert's count, the largest token count) is a deferred error, reported without a host
    synchronisation; right counts report nothing. The rows move as the exchange found them either way."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for rank, calls in enumerate(spawn(_known_counts_checked, 2, device="cpu", timeout_s=300)):
        (same0, errors0), (same1, errors1), (same2, errors2) = calls
        assert same0 and same1 and same2, (rank, calls)
        assert errors0 == [], (rank, errors0)
        for errors, found in ((errors1, 1), (errors2, 2)):  # (the error word adds up: one more per wrong call)
            assert any(f"({found} found of:" in m and "counts other than the ones known beforehand" in m
                       for m in errors), (rank, errors)


def test_interleaved_combine_push_in_rounds(monkeypatch):
    """Above 4 ranks the combine push interleaves its peers (every program writes to every peer); with a
    buffer of a few rows per source both that push and the dispatch move the traffic in rounds."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    case = NormalCase(num_tokens=(30, 3, 0, 17, 1), hidden=64, num_experts=10, topk=2, dtype="bf16", bias=1, seed=38)
    _run(5, NVLinkTransport, {"num_nvl_bytes": 4096}, [case])  # 6 combine rows per source and round


def test_eight_ranks(monkeypatch):
    """The largest group the transports take (8 ranks, one NVLink domain): uneven counts with empty ranks,
    FP8 with dropped slots, num_worst_tokens, and a low-latency call, one-sided and portable."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cases = [NormalCase(num_tokens=(5, 0, 7, 3, 1, 2, 6, 4), hidden=64, num_experts=16, topk=3, dtype="bf16", bias=2,
                        seed=51),
             NormalCase(num_tokens=6, hidden=128, num_experts=16, topk=4, dtype="fp8", routing="dropped", seed=52),
             NormalCase(num_tokens=(4, 6, 1, 0), hidden=32, num_experts=8, topk=2, dtype="fp32", worst=True, seed=53),
             LowLatencyCase(num_tokens=(3, 2, 0, 1), max_tokens=4, hidden=128, num_experts=16, topk=3, seed=54)]
    results = spawn(_both_transports, 8, cases, device="cpu", timeout_s=600)  # (one start of 8 processes)
    problems = [f"rank {r}: {label}: {fails}" for r, res in enumerate(results) for label, fails in res]
    assert not problems, "\n".join(problems)


def _both_transports(ctx, cases):
    """``cases`` on the one-sided transport, then the normal-mode ones on the portable transport, in one group."""
    from epcomm.transports.alltoall import AllToAllTransport

    return (run_cases(ctx, cases, NVLinkTransport, {"num_nvl_bytes": 1 << 20})
            + run_cases(ctx, [c for c in cases if isinstance(c, NormalCase)], AllToAllTransport, {}))


def test_portable_transport_kernels(monkeypatch):
    """The portable transport's GPU path (plan + pack kernels, layout-driven reduce) under the interpreter."""
    from epcomm.transports.alltoall import AllToAllTransport

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _run(3, AllToAllTransport, {}, CASES)


def _many_against_one(ctx):
    """``AllToAllTransport.dispatch_many`` (one count exchange for several requests) against a ``dispatch`` of each
    request: the same rows, records, counts and handles (a combine with each handle gives the same result).
    Returns the fields that differ."""
    import torch

    from epcomm.core.config import Config
    from epcomm.fp8 import per_token_cast_to_fp8
    from epcomm.testing.routing import make_inputs
    from epcomm.transports.alltoall import AllToAllTransport
    from epcomm.transports.base import CombineRequest, DispatchRequest

    rt = AllToAllTransport(ctx.group, ctx.device, 0)
    num_experts, reqs = 6, []
    for c, tokens in enumerate(((3, 0, 5), (0, 0, 0), (4, 7, 1))):
        mine = make_inputs(60 + c, ctx.world_size, tokens, 128, num_experts, 3, "dropped" if c else "uniform")[ctx.rank]
        per_rank, per_expert, itr = rt.get_dispatch_layout(mine.topk_idx, num_experts)
        x, scales = (per_token_cast_to_fp8(mine.x) if c == 2 else (mine.x, None))
        reqs.append(DispatchRequest(x, scales, mine.topk_idx, mine.topk_weights, per_rank, itr, per_expert,
                                    num_experts, 2, 0, None, Config(), None))
    wrong = []
    for c, (one, many) in enumerate(zip([rt.dispatch(r) for r in reqs], list(rt.dispatch_many(reqs)))):
        for field in ("recv_x", "recv_scales", "recv_topk_idx", "recv_topk_weights", "num_recv_tokens_per_expert_list"):
            a, b = getattr(one, field), getattr(many, field)
            raw = [v.view(torch.uint8) if isinstance(v, torch.Tensor) and v.dtype.itemsize == 1 else v for v in (a, b)]
            same = a == b if not isinstance(a, torch.Tensor) else (a.shape == b.shape and torch.equal(*raw))
            if not same:
                wrong.append((c, field))
        for field in ("recv_src_rank", "recv_src_idx", "num_recv_tokens_per_expert"):
            if not torch.equal(getattr(one.handle, field), getattr(many.handle, field)):
                wrong.append((c, "handle." + field))
        if one.handle.num_recv_tokens_per_rank != many.handle.num_recv_tokens_per_rank:
            wrong.append((c, "handle.num_recv_tokens_per_rank"))
        if reqs[c].x_scales is None:
            y = torch.randn(one.recv_x.shape, dtype=torch.float32).to(one.recv_x.dtype)
            back = [rt.combine(CombineRequest(y, h.handle, h.recv_topk_weights, (), Config()))[0] for h in (one, many)]
            if not torch.equal(back[0], back[1]):
                wrong.append((c, "combine"))
    rt.destroy()
    return wrong


def test_portable_transport_dispatch_many(monkeypatch):
    """Several exact-mode requests with one count exchange, as the pipelined internode leg makes them: the same
    results as one dispatch each (uneven and empty ranks, an all-empty request, FP8 with scales)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert spawn(_many_against_one, 3, device="cpu", timeout_s=600) == [[], [], []]


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _peer_skips_push(ctx, op):
    """Rank 1 takes part in the count exchange of ``op`` ("dispatch" or "combine") but never launches its
    push (for the combine, that launch also holds the barrier that opens it): rank 0's programs must time
    out, record the error and report it (naming both ranks), not hang; and the error is sticky: every later
    call of the Buffer raises it, ``check_errors`` as often as asked. Returns rank 0's messages. The calls of
    each kind are made once by both ranks first; ``op="first"``: rank 1 skips the push of the very first
    dispatch, whose ranks meet on the host before pushing (compilation), and rank 0's wait there ends too."""
    import torch

    import epcomm.kernels.ep as ep
    import epcomm.transports.base as base
    from epcomm.buffer import Buffer
    from epcomm.errors import EpcommError
    from epcomm.testing.routing import make_inputs

    base.COMPILE_ALLOWANCE_S = 0.0  # the first call's meeting point waits EPCOMM_TIMEOUT_S only
    buf = Buffer(ctx.group, transport=NVLinkTransport, num_nvl_bytes=1 << 20)
    mine = make_inputs(5, 2, 4, 64, 4, 2, "uniform", torch.bfloat16)[ctx.rank]
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(mine.topk_idx, 4)
    if op not in ("first", "first-dead"):  # both ranks make each call once (the first calls of a kind meet on the host)
        short, os.environ["EPCOMM_TIMEOUT_S"] = os.environ["EPCOMM_TIMEOUT_S"], "30"  # these must not time out
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(mine.x, num_tokens_per_rank=per_rank,
                                                      is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                                      topk_idx=mine.topk_idx, topk_weights=mine.topk_weights)
        buf.combine(recv_x, handle, topk_weights=recv_w)
        os.environ["EPCOMM_TIMEOUT_S"] = short
    if ctx.rank == 1 and op in ("dispatch", "first", "first-dead"):
        buf.runtime._run_dispatch = lambda *args, **kwargs: None
    if ctx.rank == 1 and op == "first-dead":  # leaves the group at once: rank 0's barrier fails
        return []
    if op == "first-dead":
        os.environ["EPCOMM_TIMEOUT_S"] = "60"  # rank 0 sees the failure, not its own timeout
    messages = []
    later = [lambda: buf.get_dispatch_layout(mine.topk_idx, 4), buf.check_errors, buf.check_errors,
             lambda: buf.low_latency_dispatch(mine.x, mine.topk_idx, 4, 4)]
    try:
        recv_x, _, recv_w, _, handle, _ = buf.dispatch(mine.x, num_tokens_per_rank=per_rank,
                                                      is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                                                      topk_idx=mine.topk_idx, topk_weights=mine.topk_weights)
        if op == "combine":
            buf.check_errors()
            if ctx.rank == 1:
                ep.combine_push_kernel = _NoLaunch()
            buf.combine(recv_x, handle, topk_weights=recv_w)
        later.insert(0, buf.check_errors)
    except EpcommError as exc:  # on CPUs the failing call itself raises (its kernels ran to the end)
        messages.append(str(exc))
    if ctx.rank == 1 and op == "first":  # stays in the group until rank 0's wait has timed out
        time.sleep(3)
    if ctx.rank == 0:
        for call in later:
            try:
                call()
                messages.append("no exception")
            except EpcommError as exc:
                messages.append(str(exc))
    return messages


@pytest.mark.parametrize("op,what", [("dispatch", "data arrival timeout waiting for rank 1"),
                                     ("combine", "barrier timeout waiting for rank 1"),
                                     ("first", "rank 0 waited 0.2 s at a host barrier for the other ranks"),
                                     ("first-dead", "rank 0 waited at a host barrier for the other ranks to reach "
                                                    "the first call of this kind, and the barrier failed")])
def test_missing_push_times_out(monkeypatch, op, what):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("EPCOMM_TIMEOUT_S", "0.2")
    first, *later = spawn(_peer_skips_push, 2, op, device="cpu", timeout_s=300)[0]
    fn = "combine" if op == "combine" else "dispatch"
    assert first.startswith(f"Buffer.{fn}: a call failed on the device ("), first
    assert what in first and "destroy the Buffer on every rank" in first, first
    want = ["Buffer.get_dispatch_layout:", "Buffer.check_errors:", "Buffer.check_errors:",
            "Buffer.low_latency_dispatch:"]
    assert [m.split(" ")[0] for m in later] == want, later
    assert all(what in m for m in later), later


def _combine_with_uneven_programs(ctx):
    """Each rank pushes its combine rows with a different number of programs (num_sms depends on the rank, as
    the traffic model's choice does on the rank's row count): the results must not change."""
    import torch

    from epcomm.buffer import Buffer, Config
    from epcomm.testing.routing import make_inputs

    buf = Buffer(ctx.group, transport=NVLinkTransport, num_nvl_bytes=1 << 20)
    mine = make_inputs(9, 2, 12, 64, 4, 2, "uniform", torch.bfloat16)[ctx.rank]
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(mine.topk_idx, 4)
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(mine.x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                  num_tokens_per_expert=per_expert, topk_idx=mine.topk_idx,
                                                  topk_weights=mine.topk_weights)
    same, _, _ = buf.combine(recv_x, handle, topk_weights=recv_w, config=Config(num_sms=2))
    uneven, _, _ = buf.combine(recv_x, handle, topk_weights=recv_w, config=Config(num_sms=2 + 4 * ctx.rank))
    buf.check_errors()
    return torch.equal(same.view(torch.int16), uneven.view(torch.int16)) and same.abs().sum().item() > 0


def test_combine_with_uneven_program_counts(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("EPCOMM_TIMEOUT_S", "5")
    assert spawn(_combine_with_uneven_programs, 2, device="cpu", timeout_s=300) == [True, True]
