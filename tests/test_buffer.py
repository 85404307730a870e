"""The Buffer over the portable transport on CPU processes (gloo), against the reference."""

import pytest

from epcomm.testing import spawn
from epcomm.testing.checks import LowLatencyCase, NormalCase, run_cases


def normal_cases(world_size: int) -> list:
    uneven = (0, 1, 37, 64) if world_size > 1 else (1,)  # repeated over the ranks
    return [
        NormalCase(num_tokens=64, hidden=200, num_experts=24, topk=3, dtype="bf16", seed=1),
        NormalCase(num_tokens=uneven, hidden=384, num_experts=24, topk=4, dtype="fp8", column_major_scales=True,
                   seed=2),
        NormalCase(num_tokens=50, hidden=136, num_experts=24, topk=2, routing="skewed", dtype="fp32", bias=2,
                   expert_alignment=4, seed=3),
        NormalCase(num_tokens=33, hidden=96, num_experts=24, topk=2, routing="one_expert", dtype="fp16", bias=1,
                   seed=4),
        NormalCase(num_tokens=40, hidden=128, num_experts=24, topk=5, routing="dropped", expert_alignment=8,
                   worst=True, seed=5),
        NormalCase(num_tokens=uneven, hidden=256, num_experts=24, topk=3, dtype="fp8", worst=True, seed=6),
        NormalCase(num_tokens=30, hidden=72, num_experts=24, topk=2, routing="one_rank", seed=7),
        NormalCase(num_tokens=30, hidden=64, num_experts=24, topk=2, with_topk=False, bias=1, seed=8),
        NormalCase(num_tokens=uneven, hidden=256, num_experts=24, topk=4, dtype="fp8", bias=1, overlap=True, seed=9),
    ]


def low_latency_cases(world_size: int) -> list:
    uneven = (5, 0, 16, 3) if world_size > 1 else (5,)
    return [
        LowLatencyCase(num_tokens=uneven, max_tokens=16, hidden=256, num_experts=24, topk=4, seed=11),
        LowLatencyCase(num_tokens=7, max_tokens=9, hidden=384, num_experts=24, topk=3, use_fp8=False, hook=True,
                       zero_copy=True, use_out=True, seed=12),
        LowLatencyCase(num_tokens=8, max_tokens=8, hidden=256, num_experts=24, topk=6, round_scale=True,
                       routing="skewed", seed=13),
        LowLatencyCase(num_tokens=6, max_tokens=10, hidden=512, num_experts=24, topk=2, round_scale=True,
                       use_ue8m0=True, hook=True, routing="dropped", seed=14),
        LowLatencyCase(num_tokens=4, max_tokens=4, hidden=128, num_experts=24, topk=3, routing="one_expert",
                       use_out=True, seed=15),
    ]


def _assert_clean(results):
    problems = [f"rank {r}: {label}: {fails}" for r, res in enumerate(results) for label, fails in res]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_buffer_matches_reference(world_size):
    _assert_clean(spawn(run_cases, world_size, normal_cases(world_size) + low_latency_cases(world_size),
                        device="cpu"))


def test_evolve_copies_a_record_with_its_changes():
    """``evolve`` (the per-call copy of frozen records): the changes set, every other field the same object, the
    original untouched, an unknown name refused, a cached value of the original left behind."""
    import torch

    from epcomm.core.handles import evolve
    from epcomm.transports.base import KnownCounts

    k = KnownCounts((1, 2), (3, 4), (5,), num_tokens_max=7)
    t = torch.zeros(1, dtype=torch.int32)
    e = evolve(k, recv_per_expert_tensor=t, max_pair=2)
    assert type(e) is KnownCounts and e.recv_per_expert_tensor is t and e.max_pair == 2
    assert e.num_tokens_per_rank is k.num_tokens_per_rank and e.num_tokens_max == 7
    assert k.recv_per_expert_tensor is None and k.max_pair is None
    with pytest.raises(TypeError, match="evolve: KnownCounts has no field 'maxpair'"):
        evolve(k, maxpair=1)
    k.__dict__["cached"] = 1  # (what a cached_property keeps: not a field, not copied)
    assert "cached" not in evolve(k).__dict__ and evolve(k) == k
