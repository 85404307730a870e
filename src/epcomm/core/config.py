"""Tuning configuration, in DeepEP's positional order so ``Config(num_sms, 6, 256, 6, 128)`` ports as is."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Config:
    """Performance knobs of the normal (high-throughput) kernels.

    num_sms: SMs the one-sided kernels may occupy (even, >= 2), or None (the default): chosen per call by
        ``model_num_sms`` from the call's traffic. The portable transport ignores it.
    num_max_nvl_chunked_send_tokens: tokens a push program moves per step (rounded down to a power of two,
        at most 16).
    num_max_nvl_chunked_recv_tokens: DeepEP's ring capacity (tokens) per (channel, peer); checked (at least
        ``send``) and otherwise unused: epcomm has no ring, its receive area holds a whole call (or a round of
        one) per source, sized by ``num_nvl_bytes``. No value changes a result.
    num_max_rdma_chunked_send_tokens / num_max_rdma_chunked_recv_tokens: accepted for DeepEP compatibility;
        epcomm is intranode only and does not use them.
    strict_sms: whether the one-sided transports' local passes (the dispatch's copy-out of received rows,
        the combine's reduction) also stay within ``num_sms`` programs. None (the default): yes when the
        call runs on the communication stream (``async_finish``, ``allocate_on_comm_stream`` or a
        ``previous_event``: the caller means to overlap its own kernels); otherwise the dispatch copies
        rows out on receiving programs while it pushes (one program per push program and source rank)
        and the combine's reduction spreads over the whole GPU for its ~0.1 ms, which is 100-200 us
        faster per call at DeepSeek sizes on 4xH200 (``benchmarks/NOTES.md``). The pushes always keep to
        ``num_sms``.
    """

    num_sms: Optional[int] = None
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256
    strict_sms: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.num_sms is not None and (not isinstance(self.num_sms, int) or self.num_sms < 2 or self.num_sms % 2):
            raise ValueError(f"Config: num_sms={self.num_sms!r} must be an even integer >= 2 (the kernels pair "
                             f"sender and receiver SMs)")
        for name in ("num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
                     "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Config: {name}={value!r} must be a positive integer")
        if self.strict_sms not in (None, True, False):
            raise ValueError(f"Config: strict_sms={self.strict_sms!r} must be None, True or False")
        if self.num_max_nvl_chunked_recv_tokens < self.num_max_nvl_chunked_send_tokens:
            raise ValueError(f"Config: num_max_nvl_chunked_recv_tokens={self.num_max_nvl_chunked_recv_tokens} "
                             f"must be >= num_max_nvl_chunked_send_tokens={self.num_max_nvl_chunked_send_tokens}")

    @property
    def num_channels(self) -> int:
        """DeepEP's channel count, ``num_sms // 2`` (one sender and one receiver SM each; None while ``num_sms``
        is chosen per call), for code that sizes DeepEP buffers with it. epcomm's kernels do not pair SMs: the
        pushes run ``num_sms`` programs (``Buffer``'s docstring says how many the local passes use)."""
        return None if self.num_sms is None else self.num_sms // 2


# The traffic model behind the default ``num_sms`` of the one-sided normal kernels. A push program stores
# what it loads into peers' memory (and its own rank's share locally); one SM sustains about PER_SM_GBPS of
# stores into peers when they go to at most NARROW_RANKS ranks, and about PER_SM_GBPS_WIDE when they fan out
# to more. At R <= NARROW_RANKS ranks a push spends (R - 1) / R of its programs' work on peers (the combine's
# slices: one in R programs holds the rank's own rows), so it takes R / (R - 1) times the SMs that the link
# needs. Measured over NVLink: 24 programs at 4 ranks (18 of them writing to peers, ~400 GB/s; 32 were
# slower); at 2 ranks 32 / 40 programs beat 24 by 10-26% (NOTES row 45); at 6 and 8 ranks of 8xH200 ~10 GB/s
# per program at 24 programs, for the dispatch and the combine alike, speeding up to ~40 programs. A program
# needs about MIN_BYTES_PER_SM of work before its fixed cost (fence, arrival, publishing) stops mattering.
PER_SM_GBPS = 22.5
PER_SM_GBPS_WIDE = 10.0
NARROW_RANKS = 4
MIN_BYTES_PER_SM = 1 << 20


def model_num_sms(send_bytes: int, link_gbps: float, max_sms: int, num_ranks: int) -> int:
    """The even number of SMs a push of ``send_bytes`` (this rank's bytes leaving for all destinations) among
    ``num_ranks`` ranks should occupy: enough that their stores into peers reach the interconnect's
    ``link_gbps`` (GB/s leaving one GPU), no more than ``send_bytes / MIN_BYTES_PER_SM`` (small calls are
    latency-bound: more programs only add fixed costs), within ``[2, max_sms]``. NVLink4 (H100/H200, 18 links)
    -> large calls take 24 SMs at 4 ranks (DeepEP's tuned choice), 28 at 3, 36 at 2, 40 at 5-8; PCIe -> 2-4. One
    rank has no link: its calls are local copies, which take as many SMs as their bytes allow (a 4096-token top-8
    MoE layer on one H200: 132 SMs against 18 took 0.09-0.1 ms off each of its four copies)."""
    if link_gbps <= 0 or max_sms < 2 or num_ranks < 1:
        raise ValueError(f"model_num_sms: link_gbps={link_gbps} must be > 0, max_sms={max_sms} >= 2 and "
                         f"num_ranks={num_ranks} >= 1")
    if num_ranks == 1:  # every row is the rank's own: local copies, bound by memory bandwidth, not by a link
        link_sms = max_sms
    elif num_ranks <= NARROW_RANKS:  # a share 1 / R of the work is the rank's own rows
        link_sms = link_gbps / PER_SM_GBPS * num_ranks / max(num_ranks - 1, 1)
    else:
        link_sms = link_gbps / PER_SM_GBPS_WIDE
    want = min(math.ceil(link_sms), math.ceil(max(send_bytes, 0) / MIN_BYTES_PER_SM))
    want = max(2, want + want % 2)
    return min(want, max_sms - max_sms % 2)
