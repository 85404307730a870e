"""Pure functions: dispatch layout on the device (no host synchronisation) and buffer size hints."""

from __future__ import annotations

import math

import torch


def compute_dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(num_tokens_per_rank [R] int32, num_tokens_per_expert [E] int32, is_token_in_rank [N, R] bool)``
    of ``topk_idx [N, K]`` (int64 or int32; -1 means no selection). Entries outside ``[-1, E)`` are ignored
    here; callers validate them. Graph-capturable: no host synchronisation, fixed shapes."""
    n = topk_idx.size(0)
    idx = topk_idx.long()
    experts_per_rank = num_experts // num_ranks
    valid = (idx >= 0) & (idx < num_experts)
    bins = torch.where(valid, idx, num_experts).flatten()
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int32, device=idx.device)
    per_expert.index_add_(0, bins, torch.ones_like(bins, dtype=torch.int32))
    ranks = torch.where(valid, idx // experts_per_rank, num_ranks)
    in_rank = torch.zeros(n, num_ranks + 1, dtype=torch.bool, device=idx.device)
    in_rank.scatter_(1, ranks, True)
    in_rank = in_rank[:, :num_ranks].contiguous()
    return in_rank.sum(0, dtype=torch.int32), per_expert[:num_experts], in_rank


LAYOUTS = ("rank_major", "expert_major")


def expert_major_rows(num_worst_tokens: int, num_local_experts: int, expert_alignment: int) -> int:
    """Rows of an expert-major receive with ``num_worst_tokens`` (W): at most W (token, local expert) pairs, and
    each of the ``E_local`` segments padded by at most ``A - 1`` rows: ``W + E_local * (A - 1)``."""
    return num_worst_tokens + num_local_experts * (expert_alignment - 1)


def count_bad_topk(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Number of entries of ``topk_idx`` outside ``[-1, num_experts)`` (a device scalar, int32)."""
    return ((topk_idx < -1) | (topk_idx >= num_experts)).sum(dtype=torch.int32)


def chunk_shares(chunks: int, ratio: float = 1.0) -> list:
    """Each chunk's share of a pipelined call's tokens: ``ratio`` times the previous chunk's (1: even; below 1: the
    chunks shrink, so that each one's forwarding can hide behind the next one's transfer)."""
    weights = [ratio ** c for c in range(chunks)]
    total = sum(weights)
    return [w / total for w in weights]


def chunk_bounds(num_tokens: int, chunks: int, ratio: float = 1.0, align: int = 1) -> list:
    """``chunks`` consecutive ``(first, end)`` token ranges (some may be empty): how a pipelined call splits a rank's
    tokens. ``ratio`` 1: ``ceil(num_tokens / chunks)`` tokens each (rounded up to a multiple of ``align``), the last
    ones shorter; otherwise chunk ``c`` ends at ``num_tokens`` times the first ``c + 1`` shares of ``chunk_shares``,
    rounded to a multiple of ``align``. Every bound but ``num_tokens`` is a multiple of ``align``."""
    if ratio == 1.0:
        per = align_up(-(-num_tokens // chunks), align) if chunks else 0
        return [(min(c * per, num_tokens), min((c + 1) * per, num_tokens)) for c in range(chunks)]
    ends, total = [], 0.0
    for share in chunk_shares(chunks, ratio):
        total += share
        ends.append(min(num_tokens, round(num_tokens * total / align) * align))
    ends[-1] = num_tokens
    return [(ends[c - 1] if c else 0, ends[c]) for c in range(chunks)]


def token_alignment(*row_bytes: int) -> int:
    """The fewest tokens whose rows of each of ``row_bytes`` (bytes per token of a per-token tensor) span a multiple
    of 16 bytes: chunk bounds at multiples of it slice every such tensor at 16-byte aligned addresses (where the
    tensor starts aligned). Triton specialises a kernel on whether each pointer is 16-byte aligned, so slices of
    varying alignment would each compile and load another variant of the same kernel, in the middle of a call."""
    a = 1
    for b in row_bytes:
        a = a * (16 // math.gcd(16, a * b))
    return a


def align_up(value: int, alignment: int) -> int:
    """``value`` rounded up to a multiple of ``alignment``."""
    return (value + alignment - 1) // alignment * alignment


def align_all(values, alignment: int) -> list:
    """``[align_up(v, alignment) for v in values]`` (per-expert counts on the host's path between a count read and
    the rows: no loop in Python for the common alignment 1)."""
    return list(values) if alignment == 1 else [align_up(v, alignment) for v in values]


def low_latency_pair_capacity(num_max_dispatch_tokens_per_rank: int, num_topk: int, num_local_experts: int) -> int:
    """Most rows one rank can send to one other rank in a low-latency dispatch: each of its T tokens sends
    one row per distinct selected expert of that rank, at most ``min(K, E_local)``."""
    return num_max_dispatch_tokens_per_rank * min(num_topk, num_local_experts)


LOW_LATENCY_ALIGN = 256


def low_latency_area(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_local_experts: int,
                     num_topk: int, payload_row_bytes: int, scale_words: int) -> dict:
    """Byte layout of the one-sided low-latency storage of one rank for one call geometry (the same on every
    rank; ``epcomm.transports.low_latency``). Two dispatch areas, then two combine areas (one per parity):

    * dispatch area: ``pay [R, T, payload_row_bytes]`` | ``scl [R, T, scale_words]`` int32 (a token's row
      arrives once per rank, whatever the number of its experts there) | ``meta [R, C]`` int32 records,
      one per (token, expert), ``C = T * min(K, E_local)`` per source rank | ``cnt [R, E_local]`` int32;
    * combine area: ``rows [T * K, hidden]`` bf16, one row per (token, slot) of this rank.

    Returns the offsets (relative to the start of the area) and ``total`` bytes; each part is 256-aligned."""
    t, r, k = num_max_dispatch_tokens_per_rank, num_ranks, num_topk
    cap = low_latency_pair_capacity(t, k, num_local_experts)
    out = {"cap": cap}
    off = 0
    for name, nbytes in (("pay", r * t * payload_row_bytes), ("scl", r * t * scale_words * 4),
                         ("meta", r * cap * 4), ("cnt", r * num_local_experts * 4)):
        out[name] = off
        off = align_up(off + nbytes, LOW_LATENCY_ALIGN)
    out["dispatch_bytes"] = off
    out["combine_bytes"] = align_up(t * k * hidden * 2, LOW_LATENCY_ALIGN)
    out["total"] = 2 * (out["dispatch_bytes"] + out["combine_bytes"])
    return out


def low_latency_flag_bytes(num_ranks: int) -> int:
    """Bytes of the low-latency arrival flags (int64 ``[2 kinds, 2 parities, R]``), 256-aligned."""
    return align_up(2 * 2 * num_ranks * 8, LOW_LATENCY_ALIGN)


def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                   num_experts: int, num_topk: int | None = None) -> int:
    """Bytes of symmetric storage one rank needs for low-latency dispatch + combine (BF16 or FP8 payload),
    DeepEP's signature plus an optional ``num_topk``; pass it as ``num_rdma_bytes``.

    epcomm sizes by what can arrive, double-buffered: per parity, from each of the R ranks at most ``T``
    dispatch rows (payload and scales: a token travels once per rank) and ``T * min(K, E_local)`` 4-byte
    records, and ``T * K`` combine rows of this rank's own tokens, instead of DeepEP's ``E * T`` rows per
    direction. Without ``num_topk`` the bound takes ``K = E_local`` (every local expert selected). Float32
    payloads (``use_fp8=False`` with fp32 ``x``) need twice the payload part; the one-sided transports grow
    their storage on the first such call."""
    if num_experts % num_ranks:
        raise ValueError(f"get_low_latency_rdma_size_hint: num_experts={num_experts} is not divisible by "
                         f"num_ranks={num_ranks}")
    e_local = num_experts // num_ranks
    k = e_local if num_topk is None else num_topk
    groups = -(-hidden // 128)
    bf16 = low_latency_area(num_max_dispatch_tokens_per_rank, hidden, num_ranks, e_local, k, 2 * hidden, 0)
    fp8 = low_latency_area(num_max_dispatch_tokens_per_rank, hidden, num_ranks, e_local, k, hidden, groups)
    return low_latency_flag_bytes(num_ranks) + max(bf16["total"], fp8["total"])


def get_normal_buffer_size_hint(num_tokens: int, hidden_bytes: int, num_ranks: int) -> int:
    """Bytes of receive storage a normal dispatch of ``num_tokens`` tokens per rank needs at most, if it
    were done in one piece: every rank may send all its tokens to this one. Chunked transports need less.
    ``hidden_bytes``: one row's payload plus its per-row extras (FP8 scales, 12 bytes per top-k slot for ids
    and weights). Calls with ``num_worst_tokens`` give every source rank a region of that many rows in one
    piece: size them with ``num_tokens=num_worst_tokens``."""
    return num_ranks * num_tokens * (hidden_bytes + 64)


def record_words(num_scales: int, num_topk: int, has_weights: bool, has_pidx: bool = False) -> int:
    """int32 words of one record of a dispatched row: source token, source rank, scales, local top-k ids, weights
    (and, for an expert-major dispatch, the pairs' indices)."""
    return 2 + num_scales + num_topk + (num_topk if has_weights else 0) + (num_topk if has_pidx else 0)
