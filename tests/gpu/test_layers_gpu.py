"""The MoE layer on GPUs in BF16 (2, 4 and 8 GPUs): the same cases as the CPU suite against a float32 dense
reference of the same weights (tolerance 3e-2 relative, see ``epcomm.layers.checks``), over the portable
``alltoall`` transport and whatever ``auto`` picks on this machine, plus a CUDA-graph replay of the
low-latency forward."""

from __future__ import annotations

import pytest

from epcomm.layers.checks import LayerCase, check_graph_replay, run_layer_cases
from epcomm.testing import spawn

from conftest import gpu_ranks, skip_gloo_graph

NGPU = gpu_ranks()  # ranks the launcher can place on GPUs
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NGPU < 1, reason="needs a GPU")]

LL = dict(low_latency_max_tokens=16)
CASES = [
    LayerCase("normal, router, seeded init, timings", from_dense=False, expect_mode="normal", timing=True),
    LayerCase("shared + sigmoid router", config=dict(num_shared_experts=2, router="sigmoid", topk=3)),
    LayerCase("loop experts (grouped_gemm=False)", config=dict(grouped_gemm=False, num_shared_experts=1)),
    LayerCase("fp8 dispatch", config=dict(fp8_dispatch=True), tokens=(12, 17, 5, 30)),
    LayerCase("skewed routing", routing="skewed", tokens=(40, 9, 33, 1)),
    LayerCase("dropped routing, a rank without tokens", routing="dropped", tokens=(16, 0, 8, 3)),
    LayerCase("all tokens to the last rank", routing="one_rank"),
    LayerCase("low latency, auto", config=LL, tokens=(12, 7, 16, 1), expect_mode="low_latency", timing=True),
    LayerCase("low latency, fp8, shared, dropped", config=dict(**LL, fp8_dispatch=True, num_shared_experts=1),
              routing="dropped", mode="low_latency"),
    LayerCase("low latency, loop experts", config=dict(**LL, grouped_gemm=False), mode="low_latency"),
    LayerCase("auto picks normal when one rank exceeds T", config=dict(low_latency_max_tokens=8), tokens=(20, 4, 2, 3),
              expect_mode="normal"),
    LayerCase("checkpoint (non-reentrant)", checkpoint="non_reentrant", config=dict(num_shared_experts=1)),
    LayerCase("checkpoint (reentrant), low latency", checkpoint="reentrant", config=LL, routing="uniform"),
    LayerCase("async combine + shared", config=dict(async_combine=True, num_shared_experts=1), async_wait=True),
    LayerCase("async low latency (receive hook)", config=dict(**LL, async_combine=True), async_wait=True,
              expect_mode="low_latency"),
    LayerCase("rank-major layout (the earlier path), shared", config=dict(normal_layout="rank_major",
                                                                         num_shared_experts=1)),
    LayerCase("rank-major layout, fp8, skewed", routing="skewed", config=dict(normal_layout="rank_major",
                                                                             fp8_dispatch=True)),
    LayerCase("expert-major, all top-4 experts on the last rank", routing="one_rank", config=dict(topk=4)),
]


def _report(results):
    lines = []
    for rank, failed in enumerate(results):
        for label, failures in failed:
            lines.append(f"[rank {rank}] {label}:\n    " + "\n    ".join(failures))
    return "\n".join(lines)


@pytest.mark.parametrize("transport", ["alltoall", "nvlink", "p2p"])
@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_layer_bf16_matches_dense_reference(world_size, transport):
    if NGPU < world_size:
        pytest.skip(f"needs {world_size} GPUs, found {NGPU}")
    report = _report(spawn(run_layer_cases, world_size, CASES, "bf16", transport, device="cuda", timeout_s=600))
    assert not report, report


@pytest.mark.parametrize("transport", ["alltoall", "nvlink", "p2p"])
def test_low_latency_forward_replays_in_cuda_graph(transport):
    world_size = min(NGPU, 4)
    if world_size < 2:
        pytest.skip("needs 2 GPUs (or EPCOMM_RANKS_PER_GPU)")
    skip_gloo_graph(transport, world_size)
    out = spawn(check_graph_replay, world_size, "bf16", transport, device="cuda", timeout_s=600)
    failures = [f"[rank {r}] {f}" for r, fs in enumerate(out) for f in fs]
    assert not failures, "\n".join(failures)
