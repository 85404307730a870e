"""The Buffer on GPUs (NCCL process groups): the CPU suite's cases, DeepSeek-sized cases and CUDA graphs,
for every transport that can run on the machine."""

import pytest

from conftest import gpu_ranks, skip_unless_runnable
from epcomm.testing import spawn
from epcomm.testing.checks import GraphCase, LowLatencyCase, NormalCase, run_cases
from test_buffer import _assert_clean, low_latency_cases, normal_cases

TRANSPORTS = ["alltoall", "nvlink", "p2p"]


def large_cases():
    return [
        NormalCase(num_tokens=4096, hidden=7168, num_experts=256, topk=8, dtype="fp8", seed=21),
        NormalCase(num_tokens=(4096, 1, 0, 3000), hidden=7168, num_experts=256, topk=8, dtype="bf16",
                   routing="skewed", bias=1, seed=22),
        NormalCase(num_tokens=1024, hidden=2048, num_experts=64, topk=6, dtype="bf16", worst=True, bias=2, seed=23),
        LowLatencyCase(num_tokens=(1, 128, 0, 77), max_tokens=128, hidden=7168, num_experts=288, topk=8,
                       round_scale=True, use_ue8m0=True, hook=True, seed=25),
    ]


def graph_cases():
    return [GraphCase(low_latency=False), GraphCase(low_latency=True, num_tokens=32, hidden=1024, num_experts=32,
                                                    topk=8)]


SUITES = {"small": lambda ws: normal_cases(ws) + low_latency_cases(ws), "large": lambda ws: large_cases(),
          "graph": lambda ws: graph_cases()}


@pytest.mark.gpu
@pytest.mark.parametrize("suite", list(SUITES))
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_gpu_buffer_matches_reference(world_size, transport, suite):
    skip_unless_runnable(transport, world_size, graph=suite == "graph")
    cases = SUITES[suite](world_size)
    if suite == "large" and world_size == 2:
        cases = [c for c in cases if not isinstance(c.num_tokens, tuple)]
    _assert_clean(spawn(run_cases, world_size, cases, transport, device="cuda", timeout_s=400))


@pytest.mark.gpu
def test_gpu_rounds_when_buffer_is_small():
    """nvlink with a buffer far smaller than one call's traffic: several rounds, same results."""
    if gpu_ranks() < 2:
        pytest.skip("needs 2 GPUs")
    cases = [NormalCase(num_tokens=512, hidden=1024, num_experts=16, topk=4, dtype="bf16", bias=1, seed=41),
             NormalCase(num_tokens=300, hidden=512, num_experts=16, topk=4, dtype="fp8", seed=42)]
    _assert_clean(spawn(run_cases, 2, cases, "nvlink", {"num_nvl_bytes": 1 << 20}, device="cuda", timeout_s=300))


def _dispatch_with_bad_id(ctx, transport):
    """Every rank dispatches with one expert id out of range; returns the error message (or None)."""
    import torch

    from epcomm import Buffer

    buf = Buffer(ctx.group, transport=transport)
    try:
        gen = torch.Generator().manual_seed(ctx.rank)
        idx = torch.randperm(8, generator=gen)[:2].repeat(16, 1).to(ctx.device)
        idx[3, 1] = 8  # num_experts is 8
        x = torch.randn(16, 128, device=ctx.device).to(torch.bfloat16)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 8)
        try:
            buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                         topk_idx=idx)
        except ValueError as exc:
            return str(exc)
        return None
    finally:
        buf.destroy()


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["alltoall", "nvlink"])
def test_gpu_bad_expert_id_is_an_error(transport):
    """On GPUs the ids are checked by the transports' kernels (no extra host sync): still a clear error."""
    if gpu_ranks() < 2:
        pytest.skip("needs 2 GPUs")
    messages = spawn(_dispatch_with_bad_id, 2, transport, device="cuda", timeout_s=300)
    for rank, msg in enumerate(messages):
        assert msg is not None and msg.startswith("Buffer.dispatch: topk_idx has 1 entries outside [-1, 8)"), \
            f"rank {rank}: {msg!r}"
