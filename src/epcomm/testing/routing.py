"""Routing and input generators shared by tests, the demo and the benchmarks.

Every rank can rebuild every rank's inputs from the same seed, so a worker can compute the reference for
the whole group locally and compare only its own outputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

ROUTINGS = ("uniform", "skewed", "one_expert", "dropped", "one_rank")


def make_topk(num_tokens: int, num_experts: int, topk: int, routing: str = "uniform", *,
              generator: torch.Generator, num_ranks: int = 1) -> torch.Tensor:
    """Expert choices ``[num_tokens, topk]`` int64, distinct per token, ``-1`` for unused slots.

    routing: ``uniform`` (every expert equally likely), ``skewed`` (Zipf-like popularity: a few hot
    experts), ``one_expert`` (every token picks expert 0 in slot 0, the other slots -1), ``dropped``
    (uniform, then about a quarter of the slots set to -1, some tokens with none left), ``one_rank``
    (uniform among the experts of the last rank only)."""
    if routing not in ROUTINGS:
        raise ValueError(f"make_topk: routing={routing!r} is not one of {ROUTINGS}")
    if topk > num_experts:
        raise ValueError(f"make_topk: topk={topk} > num_experts={num_experts}")
    if num_tokens == 0:
        return torch.empty(0, topk, dtype=torch.int64)
    if routing == "one_expert":
        idx = torch.full((num_tokens, topk), -1, dtype=torch.int64)
        idx[:, 0] = 0
        return idx
    if routing == "one_rank":
        per_rank = num_experts // num_ranks
        k = min(topk, per_rank)
        scores = torch.rand(num_tokens, per_rank, generator=generator)
        chosen = scores.topk(k, dim=1).indices + (num_ranks - 1) * per_rank
        idx = torch.full((num_tokens, topk), -1, dtype=torch.int64)
        idx[:, :k] = chosen
        return idx
    if routing == "skewed":
        popularity = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** 1.2
        popularity = popularity[torch.randperm(num_experts, generator=generator)]
        idx = torch.multinomial(popularity.expand(num_tokens, num_experts), topk, replacement=False,
                                generator=generator)
    else:
        idx = torch.rand(num_tokens, num_experts, generator=generator).topk(topk, dim=1).indices
    idx = idx.to(torch.int64)
    if routing == "dropped":
        drop = torch.rand(num_tokens, topk, generator=generator) < 0.25
        drop[::5] = True  # every fifth token selects nothing at all
        idx = idx.masked_fill(drop, -1)
    return idx


def group_limited_topk(num_tokens: int, num_experts: int, topk: int, num_groups: int, max_groups: int, *,
                       generator: torch.Generator) -> torch.Tensor:
    """DeepSeek-V3's node-limited routing: each token picks ``max_groups`` of the ``num_groups`` equal blocks of
    experts (nodes) at random, then ``topk`` distinct experts uniformly among those blocks' experts.
    ``[num_tokens, topk]`` int64."""
    if num_experts % num_groups or not 1 <= max_groups <= num_groups:
        raise ValueError(f"group_limited_topk: num_experts={num_experts} must split into num_groups={num_groups} "
                         f"blocks and 1 <= max_groups={max_groups} <= num_groups")
    per = num_experts // num_groups
    if topk > max_groups * per:
        raise ValueError(f"group_limited_topk: topk={topk} > the {max_groups * per} experts of max_groups blocks")
    groups = torch.rand(num_tokens, num_groups, generator=generator).topk(max_groups, dim=1).indices
    pick = torch.rand(num_tokens, max_groups * per, generator=generator).topk(topk, dim=1).indices
    return (groups.gather(1, pick // per) * per + pick % per).to(torch.int64)


@dataclass(frozen=True)
class RankInputs:
    """One rank's inputs: ``x [N, H]`` (float dtype), ``topk_idx [N, K]`` int64, ``topk_weights [N, K]``
    float32 (0 where ``topk_idx`` is -1)."""

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor

    def to(self, device: torch.device | str) -> "RankInputs":
        return RankInputs(self.x.to(device), self.topk_idx.to(device), self.topk_weights.to(device))


def tokens_per_rank(num_tokens: int | Sequence[int], num_ranks: int) -> list[int]:
    """Token counts of ``num_ranks`` ranks: an int for every rank, or a sequence repeated over the ranks
    (rank ``r`` gets entry ``r % len``), so one uneven pattern serves any group size."""
    if isinstance(num_tokens, int):
        return [num_tokens] * num_ranks
    counts = [int(n) for n in num_tokens]
    if not counts:
        raise ValueError("tokens_per_rank: num_tokens is an empty sequence; give an int or at least one count")
    return [counts[r % len(counts)] for r in range(num_ranks)]


def make_inputs(seed: int, num_ranks: int, num_tokens: int | Sequence[int], hidden: int, num_experts: int,
                topk: int, routing: str = "uniform", dtype: torch.dtype = torch.bfloat16) -> list[RankInputs]:
    """Inputs for every rank, built on the CPU from ``seed`` (identical in every process); ``num_tokens`` as
    in :func:`tokens_per_rank`."""
    counts = tokens_per_rank(num_tokens, num_ranks)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in counts:
        x = torch.randn(n, hidden, generator=gen, dtype=torch.float32)
        # a spread of magnitudes per token so FP8 scales differ between tokens and channel groups
        x = x * torch.exp2(torch.randint(-4, 5, (n, 1), generator=gen).float())
        idx = make_topk(n, num_experts, topk, routing, generator=gen, num_ranks=num_ranks)
        w = torch.rand(n, topk, generator=gen, dtype=torch.float32) + 0.05
        w = w.masked_fill(idx < 0, 0.0)
        out.append(RankInputs(x.to(dtype), idx, w))
    return out
