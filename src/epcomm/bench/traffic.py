"""Byte accounting from the actual routing, in the conventions the benchmarks report.

DeepEP's convention ("GB/s (DeepEP)"): the bytes of all token rows a rank *receives*, its own included,
over the call's time; combine counts the same rows as the BF16 dispatch. The NVLink column counts only
rows that cross between GPUs (self-traffic excluded). Low-latency: per selected (token, expert) pair,
dispatch ``H + 4 * H / 128 + 16`` bytes (FP8) or ``2 * H + 16`` (BF16) and combine ``2 * H``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..core.layout import chunk_shares
from ..reference import dispatch_layout


def row_bytes(hidden: int, kind: str) -> int:
    """Bytes of one token row: ``bf16`` 2H, ``fp8`` H + 4H/128 (e4m3 data + float32 scales), ``fp32`` 4H."""
    return {"bf16": 2 * hidden, "fp16": 2 * hidden, "fp32": 4 * hidden, "fp8": hidden + 4 * (hidden // 128)}[kind]


@dataclass(frozen=True)
class NormalTraffic:
    """Rows each rank receives in a normal dispatch: ``recv_rows[r]`` (self included) and ``remote_rows[r]``."""

    recv_rows: tuple
    remote_rows: tuple

    def mean_recv_bytes(self, hidden: int, kind: str) -> float:
        return sum(self.recv_rows) / len(self.recv_rows) * row_bytes(hidden, kind)

    def mean_remote_bytes(self, hidden: int, kind: str) -> float:
        return sum(self.remote_rows) / len(self.remote_rows) * row_bytes(hidden, kind)


def normal_traffic(topk_idxs: Sequence[torch.Tensor], num_experts: int) -> NormalTraffic:
    num_ranks = len(topk_idxs)
    in_rank = [dispatch_layout(t, num_experts, num_ranks).is_token_in_rank for t in topk_idxs]
    recv = [sum(int(in_rank[s][:, r].sum()) for s in range(num_ranks)) for r in range(num_ranks)]
    remote = [recv[r] - int(in_rank[r][:, r].sum()) for r in range(num_ranks)]
    return NormalTraffic(tuple(recv), tuple(remote))


def low_latency_pairs(topk_idxs: Sequence[torch.Tensor]) -> float:
    """Mean number of selected (token, expert) pairs per rank."""
    return sum(int((t >= 0).sum()) for t in topk_idxs) / len(topk_idxs)


def low_latency_bytes(hidden: int, use_fp8: bool) -> tuple[int, int]:
    """(dispatch, combine) bytes per selected (token, expert) pair."""
    return (hidden + 4 * (hidden // 128) + 16) if use_fp8 else (2 * hidden + 16), 2 * hidden


# ------------------------------------------------------------------------------------------------ internode
def distinct_domains(topk_idx: torch.Tensor, num_experts: int, num_domains: int) -> torch.Tensor:
    """``[N]`` int64: how many distinct domains each token's experts live in (ids < 0 ignored)."""
    per = num_experts // num_domains
    hit = torch.zeros(topk_idx.size(0), num_domains + 1, dtype=torch.bool)
    idx = topk_idx.cpu().long()
    hit.scatter_(1, torch.where(idx >= 0, idx // per, num_domains), True)
    return hit[:, :num_domains].sum(1)


def expected_domains(num_experts: int, num_domains: int, topk: int, max_groups: int = 0) -> float:
    """Expected number of distinct domains among a token's ``topk`` distinct experts, uniform routing over all
    experts or (``max_groups`` > 0) over ``max_groups`` random domains' experts."""
    groups = max_groups if 0 < max_groups < num_domains else num_domains
    pool, per = groups * (num_experts // num_domains), num_experts // num_domains
    if topk > pool - per:  # every chosen domain is hit
        return float(groups)
    return groups * (1.0 - math.comb(pool - per, topk) / math.comb(pool, topk))


HBM_GBPS = 4000.0  # the model's rate of the device's own passes over rows (an H100/H200's copy rate, round)


@dataclass(frozen=True)
class InternodeEstimate:
    """What the traffic model predicts for one normal-mode call of the hierarchical path at ``ranks`` GPUs."""

    ranks: int
    domains: int
    chunks: int
    crossing_rows_per_token: float
    crossing_bytes: float  # per GPU, through its NIC
    network_us: float
    forward_us: float
    reorder_us: float  # the gather that puts the received rows in source order
    fixed_us: float  # before the first row crosses: the call's one count exchange and host read
    lead_us: float  # the host's time from the count read to the first rows' collective (nothing crosses meanwhile)
    host_us: float  # the host's time after the count read, all chunks (hidden while the rows cross, if shorter)
    sequential_us: float  # the network leg, then the forwarding (one chunk)
    pipelined_us: float  # chunk c + 1 on the network while chunk c is forwarded (what epcomm does)
    ratio: float = 1.0  # each chunk's share of the tokens over the previous one's (1: even)

    def nic_share(self, nic_gbps: float, pipelined: bool = True) -> float:
        """Crossing bytes over the call's time, as a fraction of the NIC's rate."""
        t = self.pipelined_us if pipelined else self.sequential_us
        return self.crossing_bytes / (t * 1e-6) / (nic_gbps * 1e9)


def internode_estimate(ranks: int, gpus_per_node: int, num_tokens: int, hidden: int, topk: int, num_experts: int,
                       kind: str, nic_gbps: float, nvlink_gbps: float, max_groups: int = 0, chunks: int = 4,
                       hbm_gbps: float = HBM_GBPS, fixed_us: float = 0.0, host_us: float = 0.0, lead_us: float = 0.0,
                       host_chunk_us: Optional[float] = None, ratio: Optional[float] = None,
                       in_place: bool = False, head_share: float = 0.0, copies: tuple = (0.0, 0.0, 0.0, 0.0),
                       tail_us: float = 0.0) -> InternodeEstimate:
    """Model of one dispatch (``kind`` fp8 or bf16; a combine moves the BF16 bytes the other way) of the
    hierarchical path: every token crosses once to each remote domain holding one of its experts (at
    ``nic_gbps`` per GPU), then each forwarding rank copies the rows it received to the ranks of its domain
    that hold their experts (at ``nvlink_gbps``, the intranode dispatch's measured rate in DeepEP's convention:
    received bytes per rank over time). With ``chunks`` pipelined chunks only the last chunk's forwarding is not
    hidden behind the network; the received rows are then gathered into source order once (read and write at
    ``hbm_gbps``; ``in_place``: not gathered, each row written at its place as it is forwarded, as a cached dispatch
    over a one-sided domain leg does). ``fixed_us``: what the call costs before its first row crosses (its one count
    exchange over the network and within the domain, and the host read; the benchmark measures it), paid once per
    call. Host time
    (measured likewise): ``host_us`` the host's time from the count read to the end of a one-chunk call, of which
    ``lead_us`` passes before the first rows' collective is issued (exposed: nothing crosses meanwhile);
    ``host_chunk_us`` what each further chunk adds (None: ``host_us``, every chunk as costly as a whole call). The
    rest is issued while the rows cross: it costs nothing while it stays below the network's time, and bounds the
    call above it; of it, ``tail_us`` (the host's time after the call's last device work is issued: the handle)
    runs beside the last chunk's forwarding, so the device's end waits for the host's issue less the tail, and the
    call ends at the later of the device's end and the host's. The host's work before the count read is not
    counted: in a model's step the host runs ahead of its GPU (no synchronisation since the previous layer's
    dispatch), so that work overlaps the GPU's earlier work.
    Chunk sizes: ``ratio`` times the previous chunk's tokens (``chunk_shares``; None: what the transport measures and
    uses, ``chunk_ratio`` of the forwarding's time over the network's); the two legs then run as a two-stage
    pipeline, each a chunk at a time: the call's legs end at the largest, over chunks ``k``, of the network's time for
    chunks ``0..k`` and the forwarding's for chunks ``k..``. ``head_share``: an exact-mode dispatch's head chunk (that
    share of the tokens, ahead of the ``chunks``) crosses in fixed slots, every slot to every remote domain whether a
    token fills it or not, from the call's start, while the counts travel and the host reads them; its forwarding
    and the other chunks' rows wait for the count read and the host's lead. The head is bounded as the transport
    bounds it (``head_bounds`` of the tokens the link moves during ``fixed_us``, at the call's pace): none where the
    count exchange is short against the head's share, at most a few round trips' worth where it is long.
    ``copies``: the device's own passes over the rows besides the legs, each a read and a write at ``hbm_gbps``:
    ``(before, after, first, tokens)`` copies of each chunk's crossing bytes before they cross (after the previous
    chunk's: they overlap its transfer) and after they land (before they are forwarded), copies of all of them before
    the first crossing (one pack for every chunk), and copies of the rank's own tokens' bytes then."""
    domains = ranks // gpus_per_node
    rows = expected_domains(num_experts, domains, topk, max_groups)
    crossing = num_tokens * rows * (domains - 1) / domains * row_bytes(hidden, kind)
    # a forwarding rank receives as many rows as a rank sends (symmetry) and forwards each to the ranks of its
    # domain that hold one of the token's experts there
    per_domain_k = topk / rows  # a token's experts in one of its domains, on average
    ranks_hit = gpus_per_node * (1.0 - (1.0 - 1.0 / gpus_per_node) ** per_domain_k) if gpus_per_node > 1 else 1.0
    forwarded = num_tokens * rows * ranks_hit * row_bytes(hidden, kind)
    network_us = crossing / (nic_gbps * 1e9) * 1e6
    forward_us = forwarded / (nvlink_gbps * 1e9) * 1e6

    def pass_us(nbytes: float) -> float:  # one pass of the device over nbytes: read and write at hbm_gbps
        return 2 * nbytes / (hbm_gbps * 1e9) * 1e6

    reorder_us = 0.0 if in_place else pass_us(forwarded)
    before, after, first = (c * pass_us(crossing) for c in copies[:3])
    first += copies[3] * pass_us(num_tokens * row_bytes(hidden, kind))
    issue_us = host_us + (chunks - 1) * (host_us if host_chunk_us is None else host_chunk_us)
    behind = max(0.0, issue_us - lead_us)  # issued once the first rows cross
    if ratio is None:
        from ..transports.hierarchical import chunk_ratio

        ratio = chunk_ratio(forward_us / network_us if network_us > 0 else float("inf"))
    start = fixed_us + lead_us  # the counts are read and the first rows' collective issued
    if head_share:  # bounded as the transport bounds it: by the rows the link moves during the count round trip
        from ..transports.hierarchical import head_bounds

        fewest, most = head_bounds(num_tokens * fixed_us / (start + network_us))
        head = math.ceil(num_tokens * head_share)
        head_share = 0.0 if head < fewest else min(head, most) / num_tokens
    rest = 1.0 - head_share
    stages, ready = [], start + first
    for share in chunk_shares(chunks, ratio):  # (a chunk's copies before it crosses follow the previous chunk's)
        ready += before * rest * share
        stages.append((ready, network_us * rest * share, (forward_us + after) * rest * share))
    if head_share:  # (its padded slots: every remote domain gets one row per token of it)
        stages.insert(0, (0.0, num_tokens * head_share * (domains - 1) * row_bytes(hidden, kind) / (nic_gbps * 1e9)
                          * 1e6, forward_us * head_share))
    net_end = legs = 0.0
    for ready, net, fwd in stages:  # a chunk crosses once the link and its collective are there, then is forwarded
        net_end = max(net_end, ready) + net
        legs = max(legs, net_end, start) + fwd
    return InternodeEstimate(ranks, domains, chunks, rows * (domains - 1) / domains, crossing, network_us, forward_us,
                             reorder_us, fixed_us, lead_us, issue_us,
                             fixed_us + lead_us + first + before + max(network_us, host_us - lead_us) + after
                             + forward_us, max(legs, start + behind - min(tail_us, behind) + stages[-1][2],
                                               start + behind) + reorder_us, ratio)


# DeepEP's published internode figures (its README; H800, ConnectX-7 400 Gb/s InfiniBand, ~50 GB/s per GPU), for
# the benchmark's model table: normal-mode RDMA GB/s per GPU (dispatch, combine) and low-latency us (dispatch,
# combine) at 128 tokens.
DEEPEP_PUBLISHED_NORMAL = {16: (43, 43), 32: (58, 57), 64: (51, 50)}
DEEPEP_PUBLISHED_LOW_LATENCY = {8: (163, 318), 16: (173, 329), 32: (182, 350), 64: (186, 353), 128: (192, 369),
                                256: (194, 360)}
