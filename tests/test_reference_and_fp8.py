"""The oracle and the FP8 helpers, checked against brute force."""

import pytest
import torch

from epcomm import reference
from epcomm.fp8 import pack_ue8m0, per_token_cast_back, per_token_cast_to_fp8, unpack_ue8m0
from epcomm.testing.routing import ROUTINGS, make_inputs, make_topk


@pytest.mark.parametrize("routing", ROUTINGS)
def test_layout_matches_brute_force(routing):
    gen = torch.Generator().manual_seed(3)
    idx = make_topk(50, 12, 3, routing, generator=gen, num_ranks=3)
    lay = reference.dispatch_layout(idx, 12, 3)
    for t in range(50):
        ranks = {int(e) // 4 for e in idx[t] if e >= 0}
        assert [bool(lay.is_token_in_rank[t, r]) for r in range(3)] == [r in ranks for r in range(3)]
    for e in range(12):
        assert int(lay.num_tokens_per_expert[e]) == int((idx == e).sum())
    assert lay.num_tokens_per_rank.tolist() == lay.is_token_in_rank.sum(0).tolist()
    # every token's experts are distinct
    for t in range(50):
        chosen = [int(e) for e in idx[t] if e >= 0]
        assert len(chosen) == len(set(chosen))


def test_device_layout_equals_reference():
    from epcomm.core.layout import compute_dispatch_layout

    gen = torch.Generator().manual_seed(4)
    idx = make_topk(77, 16, 4, "dropped", generator=gen)
    per_rank, per_expert, in_rank = compute_dispatch_layout(idx, 16, 4)
    lay = reference.dispatch_layout(idx, 16, 4)
    assert torch.equal(per_rank, lay.num_tokens_per_rank)
    assert torch.equal(per_expert, lay.num_tokens_per_expert)
    assert torch.equal(in_rank, lay.is_token_in_rank)


def test_dispatch_combine_round_trip_in_reference():
    inputs = make_inputs(5, 3, [7, 0, 11], 64, 9, 2, "uniform", torch.float32)
    out = reference.dispatch([i.x for i in inputs], [i.topk_idx for i in inputs], 9,
                             [i.topk_weights for i in inputs])
    back = reference.combine([o.recv_x for o in out], out, [7, 0, 11], [o.recv_topk_weights for o in out])
    for i, (x, w) in zip(inputs, back):
        k = reference.dispatch_layout(i.topk_idx, 9, 3).is_token_in_rank.sum(1, keepdim=True)
        assert torch.equal(x, i.x * k)
        assert torch.equal(w, i.topk_weights)  # each weight comes back from exactly one rank


def test_low_latency_reference_combine_is_weighted_sum():
    inputs = make_inputs(6, 2, 5, 128, 4, 2, "uniform", torch.bfloat16)
    out = reference.low_latency_dispatch([i.x for i in inputs], [i.topk_idx for i in inputs], 4, use_fp8=False)
    ys = [[xe for xe in o.x] for o in out]  # identity experts
    comb = reference.low_latency_combine(ys, out, [i.topk_idx for i in inputs], [i.topk_weights for i in inputs], 4)
    for i, c in zip(inputs, comb):
        want = (i.x.float() * i.topk_weights.sum(1, keepdim=True)).to(torch.bfloat16)
        assert (c.float() - want.float()).abs().max() <= 0.02 * i.x.float().abs().max()


@pytest.mark.parametrize("round_scale", [False, True])
def test_fp8_cast_round_trip(round_scale):
    x = (torch.randn(9, 384) * torch.logspace(-3, 3, 9).unsqueeze(1)).to(torch.bfloat16)
    q, s = per_token_cast_to_fp8(x, round_scale=round_scale)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (9, 3) and s.dtype == torch.float32
    amax = x.float().view(9, 3, 128).abs().amax(-1).clamp(min=1e-4)
    if round_scale:
        assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # powers of two
        assert (s >= amax * (1 / 448) * (1 - 1e-6)).all() and (s < 2 * amax / 448).all()
    else:
        assert torch.allclose(s, amax / 448, rtol=1e-6, atol=0)
    back = per_token_cast_back(q, s, torch.float32)
    err = (back - x.float()).abs().view(9, 3, 128).amax(-1)
    assert (err <= amax / 8 + 1e-6).all()  # e4m3 has 3 mantissa bits


def test_fp8_ue8m0_packing():
    x = torch.randn(4, 1024).to(torch.bfloat16)
    q, packed = per_token_cast_to_fp8(x, round_scale=True, use_ue8m0=True)
    q2, s = per_token_cast_to_fp8(x, round_scale=True)
    assert packed.shape == (4, 2) and packed.dtype == torch.int32
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8))
    assert torch.equal(unpack_ue8m0(packed, 8), s)
    assert torch.equal(unpack_ue8m0(pack_ue8m0(s), 8), s)
    assert torch.equal(per_token_cast_back(q, packed), per_token_cast_back(q2, s))


def test_fp8_amax_floor_and_errors():
    q, s = per_token_cast_to_fp8(torch.zeros(2, 128))
    assert torch.allclose(s, torch.full((2, 1), 1e-4) / 448, rtol=1e-6) and not q.float().any()
    q, s = per_token_cast_to_fp8(torch.zeros(0, 1024), round_scale=True, use_ue8m0=True)  # no tokens
    assert q.shape == (0, 1024) and s.shape == (0, 2)
    with pytest.raises(ValueError, match="^per_token_cast_to_fp8: .*divisible by 128"):
        per_token_cast_to_fp8(torch.zeros(2, 100))
    with pytest.raises(TypeError, match="^per_token_cast_to_fp8"):
        per_token_cast_to_fp8(torch.zeros(2, 128, dtype=torch.int32))


def test_token_counts_repeat_over_the_ranks():
    from epcomm.testing.routing import tokens_per_rank

    assert tokens_per_rank(5, 3) == [5, 5, 5]
    assert tokens_per_rank((0, 1, 37, 64), 2) == [0, 1]
    assert tokens_per_rank((0, 1, 37, 64), 8) == [0, 1, 37, 64, 0, 1, 37, 64]
    assert tokens_per_rank([4, 0, 3], 7) == [4, 0, 3, 4, 0, 3, 4]
    with pytest.raises(ValueError, match="^tokens_per_rank: num_tokens is an empty sequence"):
        tokens_per_rank((), 4)
    inputs = make_inputs(1, 5, (3, 0), 16, 10, 2)
    assert [i.x.shape[0] for i in inputs] == [3, 0, 3, 0, 3]
    assert all(i.topk_idx.shape == (n, 2) for i, n in zip(inputs, [3, 0, 3, 0, 3]))
