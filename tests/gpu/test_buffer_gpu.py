"""The Buffer on GPUs (NCCL process groups): the CPU suite's cases, DeepSeek-sized cases and CUDA graphs."""

import pytest

from epcomm.testing import spawn
from epcomm.testing.checks import GraphCase, LowLatencyCase, NormalCase, run_cases

from conftest import gpu_count
from test_buffer import _assert_clean, low_latency_cases, normal_cases

TRANSPORTS = ["alltoall"]


def large_cases():
    return [
        NormalCase(num_tokens=4096, hidden=7168, num_experts=256, topk=8, dtype="bf16", seed=21),
        NormalCase(num_tokens=(4096, 1, 0, 3000), hidden=7168, num_experts=256, topk=8, dtype="fp8",
                   routing="skewed", seed=22),
        NormalCase(num_tokens=1024, hidden=2048, num_experts=64, topk=6, dtype="bf16", worst=True, bias=2, seed=23),
        LowLatencyCase(num_tokens=128, max_tokens=128, hidden=7168, num_experts=288, topk=8, seed=24),
        LowLatencyCase(num_tokens=(1, 128, 0, 77), max_tokens=128, hidden=7168, num_experts=288, topk=8,
                       round_scale=True, use_ue8m0=True, hook=True, seed=25),
        GraphCase(low_latency=False),
        GraphCase(low_latency=True, num_tokens=32, hidden=1024, num_experts=32, topk=8),
    ]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.gpu
def test_gpu_buffer_matches_reference(world_size, transport):
    if gpu_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    cases = normal_cases(world_size) + low_latency_cases(world_size) + large_cases()
    _assert_clean(spawn(run_cases, world_size, cases, transport, device="cuda", timeout_s=600))
