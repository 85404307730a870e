"""The hierarchical (internode) path on GPUs: ranks split into simulated nodes (``ranks_per_node``), the real
intranode transports within each domain (one-sided kernels over NVLink or CUDA IPC) and NCCL (or gloo, for ranks
sharing a GPU) between the domains; the CPU suite's cases, DeepSeek-sized ones and CUDA-graph replays (where the
inter-domain leg is NCCL) against the reference. With ``EPCOMM_RANKS_PER_NODE`` set, the launcher gives each
simulated node its own ``NCCL_HOSTID`` (NCCL then connects the nodes through its network path)."""

import pytest

from conftest import gpu_count, gpu_ranks, skip_split_shared_group
from epcomm.testing import spawn
from epcomm.testing.checks import GraphCase, LowLatencyCase, NormalCase, run_cases
from test_internode import (_assert_clean, _gated_refused, _ll_true_sources, _peer_missing, check_peer_missing,
                            internode_cases)


def large_cases():
    return [
        NormalCase(num_tokens=4096, hidden=7168, num_experts=256, topk=8, dtype="fp8", seed=31),
        NormalCase(num_tokens=(2048, 1, 0, 1500), hidden=7168, num_experts=256, topk=8, dtype="bf16",
                   routing="skewed", bias=1, seed=32),
        NormalCase(num_tokens=512, hidden=2048, num_experts=64, topk=6, dtype="bf16", worst=True, bias=2, seed=33),
        LowLatencyCase(num_tokens=(1, 128, 0, 77), max_tokens=128, hidden=7168, num_experts=288, topk=8,
                       round_scale=True, use_ue8m0=True, hook=True, seed=34),
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("suite", ["small", "large", "graph"])
@pytest.mark.parametrize("transport", ["nvlink", "p2p", "alltoall"])
@pytest.mark.parametrize("world_size,local", [(2, 1), (4, 2), (8, 4), (8, 2)])
def test_gpu_hierarchical_matches_reference(world_size, local, transport, suite):
    if gpu_ranks() < world_size:
        pytest.skip(f"needs {world_size} GPU rank slots")
    skip_split_shared_group(transport, world_size, local)
    if suite == "graph":
        if world_size > gpu_count():
            pytest.skip("ranks sharing a GPU talk over gloo, whose all_to_all cannot be captured in a CUDA graph")
        cases = [GraphCase(low_latency=False), GraphCase(low_latency=True, num_tokens=32, hidden=1024,
                                                         num_experts=32, topk=8),
                 GraphCase(low_latency=True, num_tokens=32, hidden=1024, num_experts=32, topk=8, use_fp8=True, seed=44),
                 GraphCase(low_latency=True, num_tokens=16, hidden=640, num_experts=32, topk=4, use_fp8=True,
                           use_ue8m0=True, seed=48)]
    else:
        cases = internode_cases(world_size) if suite == "small" else large_cases()
        if world_size == 2:  # the uneven token counts of the large cases are written for 4 ranks
            cases = [c for c in cases if not isinstance(c.num_tokens, tuple)]
    # the small suite in 3 pipelined chunks, each half the previous one's tokens (the network stream's path, one
    # count exchange for all chunks), without a head chunk (so that a one-sided domain leg takes the chunks in one
    # gated call); the others in the counts the transport tries while it measures, with and without a head chunk
    _assert_clean(spawn(_in_chunks, world_size, cases, transport, local, 3 if suite == "small" else None,
                        device="cuda", timeout_s=600))


def _in_chunks(ctx, cases, transport, local, chunks):
    from epcomm.transports.hierarchical import HierarchicalTransport

    HierarchicalTransport.pipeline_chunks = chunks
    HierarchicalTransport.chunk_ratio = 0.5 if chunks else None
    HierarchicalTransport.head_chunk = False if chunks else None
    return run_cases(ctx, cases, transport, {"ranks_per_node": local})


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["normal", "combine"])
@pytest.mark.parametrize("world_size,local", [(2, 1), (4, 2)])
def test_gpu_stalled_rank_of_another_node_is_an_error(world_size, local, mode, monkeypatch):
    """Two simulated nodes over NCCL's sockets (one GPU per rank): the last rank stalls instead of making a dispatch
    (``normal``) or, after dispatching, its combine. Every other rank raises within EPCOMM_TIMEOUT_S=10 s and a
    few seconds (the dispatch at its count exchange; the combine, which never synchronises, at check_errors),
    naming the phase and the missing rank; its next call raises at once. The stalled rank sleeps past its groups'
    NCCL timeout (2 * 10 + 40 s) while the others wait for it: NCCL's watchdog (default
    TORCH_NCCL_ASYNC_ERROR_HANDLING) must not end any process, since the groups were aborted."""
    if gpu_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs (one per rank: NCCL between every rank)")
    monkeypatch.setenv("EPCOMM_RANKS_PER_NODE", str(local))  # a simulated node per NCCL_HOSTID
    monkeypatch.setenv("NCCL_NET", "Socket")
    monkeypatch.delenv("EPCOMM_TIMEOUT_S", raising=False)  # a first Buffer compiles under the default (60 s) ...
    try:  # ... then the faulty one has EPCOMM_TIMEOUT_S=10, its groups' NCCL timeout 60 s; the stall lasts 75 s
        out = spawn(_peer_missing, world_size, mode, local, 75.0, 10, True, device="cuda", timeout_s=400)
    except Exception as exc:  # a rank that died (NCCL's watchdog) or hung: say so with the launcher's report
        raise AssertionError(f"a rank did not finish (killed by NCCL's watchdog, or hung): {exc}") from exc
    check_peer_missing(out, mode, 10.0, 12.0, local, on_stream=True)


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["nvlink", "alltoall"])
@pytest.mark.parametrize("world_size,local", [(4, 2), (6, 2), (6, 3)])
def test_gpu_low_latency_handle_names_the_true_sources(world_size, local, transport):
    """The hierarchical low-latency handle's src_info / layout_range against every rank's routing (the CPU test's
    check, with the domain's one-sided kernels forwarding pre-cast FP8 rows)."""
    if gpu_ranks() < world_size:
        pytest.skip(f"needs {world_size} GPU rank slots")
    for rank, problems in enumerate(spawn(_ll_true_sources, world_size, local, transport, device="cuda",
                                          timeout_s=600)):
        assert problems == [], (rank, problems)


def _early_calls(ctx, local):
    """Exact-mode dispatches in 3 chunks without a head chunk over a one-sided domain leg, each checked against the
    reference (its combine and cached dispatch too): the first of each size learns the needs; a later one of the same
    size issues its domain leg before its count read and uses it; a larger one outgrows those bounds and lets it go
    (the call then goes the present way; its first chunk's rows do not fit the early call's landing buffer); the
    same larger size again fits; then, inside those bounds, uneven tokens with an empty rank and ``-1`` slots, and
    skewed routing; last a call whose first chunk's rows fit that buffer (they are issued into it once the rail's
    counts are read) but whose other chunks do not (let go: its first rows move into a call of its own). Returns
    ``(failures, early_stats, paths)``: ``paths`` is what each call did (``issued``, ``let go``, ``first rows moved``
    or ``-``)."""
    from epcomm.buffer import Buffer
    from epcomm.testing.checks import NormalCase, check_normal
    from epcomm.transports.hierarchical import HierarchicalTransport

    HierarchicalTransport.pipeline_chunks, HierarchicalTransport.head_chunk = 3, False
    buf = Buffer(ctx.group, transport="nvlink", ranks_per_node=local)
    buf.runtime.early_issue = True  # (also over gloo, between ranks sharing GPUs: these calls are small)
    failures, paths = [], []
    calls = ((96, "uniform", 51), (96, "uniform", 52), (400, "uniform", 53), (400, "uniform", 54),
             (40, "uniform", 55), ((120, 0, 77, 96), "dropped", 56), ((120, 0, 77, 96), "skewed", 57),
             (800, "uniform", 58))
    for tokens, routing, seed in calls:
        case = NormalCase(num_tokens=tokens, hidden=256, num_experts=8 * ctx.world_size, topk=4, dtype="fp8",
                          routing=routing, bias=1, seed=seed)
        before = dict(buf.runtime.early_stats)
        failures += [f"{tokens} tokens {routing}: {f}" for f in check_normal(ctx, buf, case).failures]
        after = buf.runtime.early_stats
        paths.append(" ".join(k for k in ("issued", "let go", "first rows moved")
                              if after.get(k, 0) > before.get(k, 0)) or "-")
    stats = dict(buf.runtime.early_stats)
    buf.destroy()
    return failures, stats, paths


@pytest.mark.gpu
@pytest.mark.parametrize("world_size,local", [(4, 2), (8, 4)])
def test_gpu_domain_leg_issued_before_the_count_read(world_size, local):
    """``HierarchicalTransport.early_issue``: the gated domain leg issued before the count read, sized by the earlier
    calls' needs, used where the counts fit and let go where they outgrow it, bit-exact against the reference."""
    if gpu_ranks() < world_size:
        pytest.skip(f"needs {world_size} GPU rank slots")
    skip_split_shared_group("nvlink", world_size, local)
    for rank, (failures, stats, paths) in enumerate(spawn(_early_calls, world_size, local, device="cuda",
                                                          timeout_s=600)):
        assert failures == [], (rank, failures)
        assert stats.get("issued", 0) >= 3 and stats.get("let go", 0) >= 1, (rank, stats, paths)
        # the first call of the kind learns; the second of 96 tokens goes early; 400 outgrows 96's bounds; the
        # uneven calls (at most 120 tokens a rank) fit the bounds 400 left and go early
        assert paths[0] == "-" and paths[1] == "issued" and "let go" in paths[2], (rank, paths)
        assert "first rows moved" not in paths[2], (rank, paths)  # (its first rows did not fit: let go before them)
        assert paths[5] == "issued" and paths[6] == "issued", (rank, paths)
        assert paths[7] == "issued let go first rows moved", (rank, paths)


@pytest.mark.gpu
def test_gpu_gated_call_refused_by_fixed_storage_goes_chunk_by_chunk():
    """The CPU test's calls (``_gated_refused``) on GPUs: where the domain's fixed storage cannot hold the merged call,
    the gated path is refused after its first chunk's rows were issued into its landing buffer (once the rail's
    counts were read); the chunks then go one by one, the first made from its landed rows on the caller's stream
    (after the network stream's event), bit-exact against the reference."""
    if gpu_ranks() < 4:
        pytest.skip("needs 4 GPU rank slots")
    skip_split_shared_group("nvlink", 4, 2)
    for failed, refused in spawn(_gated_refused, 4, device="cuda", timeout_s=600):
        assert failed == [], failed
        assert refused >= 2, refused


def _leg_errors(ctx, local, transport):
    """A word of each leg's device errors set as a kernel records a failure (before a call): the call's refresh
    mirrors both legs' words in one launch, and the next call raises, naming the failure."""
    import torch

    from epcomm.buffer import Buffer
    from epcomm.errors import EpcommDeviceError
    from epcomm.testing.routing import make_inputs

    problems = []
    for leg in ("rail", "domain"):
        buf = Buffer(ctx.group, transport=transport, ranks_per_node=local)
        mine = make_inputs(5, ctx.world_size, 64, 256, 4 * ctx.world_size, 2)[ctx.rank].to(ctx.device)
        lay = buf.get_dispatch_layout(mine.topk_idx, 4 * ctx.world_size)
        kw = dict(num_tokens_per_rank=lay[0], is_token_in_rank=lay[3], num_tokens_per_expert=lay[2],
                  topk_idx=mine.topk_idx, topk_weights=mine.topk_weights)
        handle = buf.dispatch(mine.x, **kw)[4]
        getattr(buf.runtime, leg).errors.words[0] = 1  # the normal-mode span's first word
        seen = None
        for _ in range(2):  # (the first call may see it at its exit already)
            try:
                buf.combine(torch.zeros(handle.num_recv_tokens, 256, dtype=torch.bfloat16, device=ctx.device),
                            handle)
                torch.cuda.synchronize()
            except EpcommDeviceError as exc:
                seen = str(exc)
                break
        if seen is None or not seen.startswith("Buffer.combine"):
            problems.append(f"{leg}: the failure was not raised by the calls after it ({seen})")
        buf.destroy()
    return problems


@pytest.mark.gpu
@pytest.mark.parametrize("transport,world_size,local", [("alltoall", 2, 1), ("nvlink", 4, 2)])
def test_gpu_device_errors_of_either_leg_are_seen(transport, world_size, local):
    """A failure either leg's kernels record on the device (a word of its error block) is seen by the host after the
    next call's refresh (both legs' words mirrored by one kernel) and raised by the call after it."""
    if gpu_ranks() < world_size:
        pytest.skip(f"needs {world_size} GPU rank slots")
    for rank, problems in enumerate(spawn(_leg_errors, world_size, local, transport, device="cuda", timeout_s=300)):
        assert problems == [], (rank, problems)
