"""The expert-major layout and its weighted combine on GPUs (NCCL groups, or ranks sharing a GPU): the CPU
suite's cases, DeepSeek-sized cases (top-8 of 256 experts, hidden 7168; top-32), and a CUDA-graph replay of an
expert-major step with ``num_worst_tokens``, every transport, bit-exact against ``epcomm.reference``."""

import pytest

from conftest import skip_unless_runnable
from epcomm.testing import spawn
from epcomm.testing.checks import ExpertMajorCase, GraphCase, run_cases
from test_buffer import _assert_clean
from test_expert_major import cases as small_cases

TRANSPORTS = ["alltoall", "nvlink", "p2p"]


def large_cases(world_size: int):
    return [
        ExpertMajorCase(num_tokens=4096, hidden=7168, num_experts=256, topk=8, dtype="bf16", seed=61),
        ExpertMajorCase(num_tokens=(4096, 1, 0, 3000), hidden=7168, num_experts=256, topk=8, dtype="fp8",
                        routing="skewed", bias=1, seed=62),
        ExpertMajorCase(num_tokens=1024, hidden=2048, num_experts=64, topk=32, dtype="bf16", worst=True, bias=2,
                        seed=63),
        ExpertMajorCase(num_tokens=512, hidden=1024, num_experts=64, topk=6, dtype="bf16", routing="one_expert",
                        expert_alignment=128, seed=64),
    ]


SUITES = {"small": small_cases, "large": large_cases,
          "graph": lambda ws: [GraphCase(expert_major=True, num_tokens=96, hidden=512, num_experts=32, topk=8)]}


@pytest.mark.gpu
@pytest.mark.parametrize("suite", list(SUITES))
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_gpu_expert_major_matches_reference(world_size, transport, suite):
    skip_unless_runnable(transport, world_size, graph=suite == "graph")
    cases = SUITES[suite](world_size)
    if suite == "large" and world_size < 4:
        cases = [c for c in cases if not isinstance(c.num_tokens, tuple)]
    # the num_worst_tokens case gives every source a region of W rows in one piece: size the one-sided storage for
    # it (Buffer.get_normal_size_hint with W tokens; the default is sized by the first dispatch)
    kwargs = {"num_nvl_bytes": 1 << 30} if suite == "large" and transport != "alltoall" else {}
    _assert_clean(spawn(run_cases, world_size, cases, transport, kwargs, device="cuda", timeout_s=600))
