"""The Buffer on GPUs (NCCL process groups): the CPU suite's cases, DeepSeek-sized cases and CUDA graphs,
for every transport that can run on the machine."""

import pytest

from conftest import gpu_count
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
@pytest.mark.parametrize("world_size", [2, 4])
def test_gpu_buffer_matches_reference(world_size, transport, suite):
    if gpu_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    cases = SUITES[suite](world_size)
    if suite == "large" and world_size == 2:
        cases = [c for c in cases if not isinstance(c.num_tokens, tuple)]
    _assert_clean(spawn(run_cases, world_size, cases, transport, device="cuda", timeout_s=400))


@pytest.mark.gpu
def test_gpu_rounds_when_buffer_is_small():
    """nvlink with a buffer far smaller than one call's traffic: several rounds, same results."""
    if gpu_count() < 2:
        pytest.skip("needs 2 GPUs")
    cases = [NormalCase(num_tokens=512, hidden=1024, num_experts=16, topk=4, dtype="bf16", bias=1, seed=41),
             NormalCase(num_tokens=300, hidden=512, num_experts=16, topk=4, dtype="fp8", seed=42)]
    _assert_clean(spawn(run_cases, 2, cases, "nvlink", {"num_nvl_bytes": 1 << 20}, device="cuda", timeout_s=300))
