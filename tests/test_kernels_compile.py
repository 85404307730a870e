"""Every Triton kernel the one-sided and portable transports launch (normal and low-latency mode, and a one-rank
group's expert-major placement) also compiles for sm_90 with its GPU-only branches on: the interpreter suites cannot
see compiler-only errors (`epcomm.testing.compile_check`). CPU only: Triton ships the compiler and ptxas."""

import pytest

pytest.importorskip("triton")

from epcomm.testing import spawn  # noqa: E402
from epcomm.testing.checks import ExpertMajorCase, LowLatencyCase, NormalCase, run_cases  # noqa: E402

CASES = [
    NormalCase(num_tokens=(5, 3), hidden=64, num_experts=4, topk=2, dtype="bf16", bias=2, seed=41),
    NormalCase(num_tokens=6, hidden=128, num_experts=4, topk=3, dtype="fp8", strict_sms=True, seed=42),
    NormalCase(num_tokens=(4, 6), hidden=32, num_experts=4, topk=2, dtype="fp32", worst=True, seed=43),
    LowLatencyCase(num_tokens=(3, 2), max_tokens=4, hidden=128, num_experts=4, topk=2, seed=44),
    LowLatencyCase(num_tokens=2, max_tokens=3, hidden=256, num_experts=4, topk=2, use_fp8=False, hook=True,
                   zero_copy=True, seed=45),
    ExpertMajorCase(num_tokens=(5, 3), hidden=64, num_experts=4, topk=3, dtype="bf16", bias=1, seed=46),
    ExpertMajorCase(num_tokens=4, hidden=128, num_experts=4, topk=2, dtype="fp8", worst=True, seed=47),
    ExpertMajorCase(num_tokens=(2, 5), hidden=64, num_experts=4, topk=2, dtype="fp32", strict_sms=True, seed=48),
]


def _precast_dispatches(ctx, transport) -> None:
    """Low-latency dispatches of pre-cast FP8 input (the variant the hierarchical path's domain leg launches), with
    float32 and with UE8M0 scales."""
    import torch

    from epcomm.buffer import Buffer
    from epcomm.fp8 import per_token_cast_to_fp8
    from epcomm.testing.routing import make_inputs
    from epcomm.transports.base import LowLatencyDispatchRequest

    mine = make_inputs(49, ctx.world_size, (3, 2), 256, 4, 2)[ctx.rank]
    buf = Buffer(ctx.group, transport=transport, num_nvl_bytes=1 << 20)
    for ue8m0 in (False, True):
        xq, scales = per_token_cast_to_fp8(mine.x, ue8m0)
        buf.runtime.low_latency_dispatch(LowLatencyDispatchRequest(xq, mine.topk_idx, 4, 4, True, ue8m0, ue8m0,
                                                                   False, None, x_scales=scales))
    torch.distributed.barrier(group=ctx.group)
    buf.destroy()


def _rows_in_place() -> None:
    """The hierarchical path's row map of a one-chunk exact-mode dispatch (``rows_in_place_kernel``), 2 domains of 2,
    with and without the domain leg's summary; the row maps of a gated one's chunks merged (``rows_merged_kernel``)
    and one chunk made ready for it once its rows land (``launch_forward_layout``: FP8 scales, top-k ids and
    weights)."""
    import torch

    from epcomm.kernels.ep import (SUMMARY_HEAD, launch_forward_layout, launch_rows_in_place, launch_rows_merged,
                                   record_words, summary_words)

    counts = torch.ones(2, 9, dtype=torch.int32)
    launch_rows_in_place(counts, torch.empty(4, dtype=torch.int64), 9, 5, 2, 2)
    launch_rows_in_place(counts, torch.empty(4, dtype=torch.int64), 9, 5, 2, 2, 0, 1, 9,
                         torch.empty(SUMMARY_HEAD + 6 + 1, dtype=torch.int32), 1, 1)
    counts = torch.ones(4, 9, dtype=torch.int32)
    launch_rows_merged(counts, torch.empty(8, dtype=torch.int64), torch.empty(8, dtype=torch.int64),
                       torch.empty(3, summary_words(2, 1), dtype=torch.int32), 18, 5, 2, 2, 2, 9, 1, 1)
    w = record_words(2, 2, True)
    records = torch.zeros(16, w + 4, dtype=torch.int32)[:, 4:]
    launch_forward_layout(records, 0, 3, 16, torch.zeros(2, 2, dtype=torch.int32), 0,
                          torch.empty(16, 4, dtype=torch.int32), torch.empty(16, 2, dtype=torch.int64),
                          torch.empty(16, 2, dtype=torch.int32), torch.empty(16, 2, dtype=torch.int8),
                          torch.empty(16, 2, dtype=torch.int32), torch.empty(3, 2, dtype=torch.int32),
                          torch.empty(2, 4, dtype=torch.int32), torch.zeros(2, 8, dtype=torch.int32),
                          torch.zeros(1, dtype=torch.int32), torch.zeros(2, dtype=torch.int64),
                          torch.empty(3, dtype=torch.int32), 1, 1, 2, torch.zeros(1, dtype=torch.int32))


def _record(ctx):
    from epcomm.testing.compile_check import record_launches
    from epcomm.transports.alltoall import AllToAllTransport
    from epcomm.transports.nvlink import NVLinkTransport

    launches = []
    if ctx.world_size == 1:  # a one-rank group's expert-major dispatch: the local placement and permute
        with record_launches(launches):
            problems = run_cases(ctx, CASES[5:], NVLinkTransport, {"num_nvl_bytes": 1 << 20})
        assert not problems, problems
        assert any(n == "local_pairs_kernel" for _, n, _, _ in launches), "no one-rank placement launch"
        return launches
    with record_launches(launches):
        problems = run_cases(ctx, CASES, NVLinkTransport, {"num_nvl_bytes": 1 << 20})
        problems += run_cases(ctx, CASES[:3] + CASES[5:], AllToAllTransport, {})
        _precast_dispatches(ctx, NVLinkTransport)
        _rows_in_place()
    assert not problems, problems
    assert any(n == "ll_dispatch_kernel" and kw.get("PRECAST") for _, n, _, kw in launches), "no pre-cast launch"
    assert any(n == "rows_in_place_kernel" for _, n, _, _ in launches), "no row map launch"
    assert {"rows_merged_kernel", "forward_layout_kernel"} <= {
        n for _, n, _, _ in launches}, "no gated exact-mode launches"
    return launches


def _compile(ctx, launches):
    from epcomm.testing.compile_check import compile_launches

    return compile_launches(launches, share=(ctx.rank, ctx.world_size))


def test_kernels_compile_for_sm90(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launches = [launch for world in (2, 1) for rank in spawn(_record, world, device="cpu", timeout_s=600)
                for launch in rank]
    assert len({(m, n) for m, n, _, _ in launches}) >= 8, "too few distinct kernels were launched"
    # above 4 ranks the combine push interleaves its peers: compile that variant too, in and out of rounds
    launches += [(m, n, a, dict(kw, INTERLEAVE=True, SINGLE_ROUND=single)) for m, n, a, kw in launches
                 if n == "combine_push_kernel" for single in (True, False)]
    # and the streaming dispatch gated (a hierarchical dispatch's chunks in one call of the domain leg), top-k too
    launches += [(m, n, a, dict(kw, GATED=True)) for m, n, a, kw in launches
                 if n == "dispatch_kernel" and not kw.get("GATED")]
    monkeypatch.delenv("TRITON_INTERPRET")
    failures = [f for rank in spawn(_compile, 2, launches, device="cpu", timeout_s=900) for f in rank]
    assert not failures, "\n".join(failures)
