"""DeepEP's ``Config``: the tuning knobs of the normal kernels and the buffer size hints frameworks size their
``Buffer`` with. It is epcomm's ``Config`` (so epcomm's Buffer takes it as is) with DeepEP's constructor,
defaults and checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..core.config import Config as _EpcommConfig

NUM_MAX_NVL_PEERS = 8  # DeepEP: ranks of one NVLink domain; larger groups take its internode (RDMA) path
_MAX_TOPK = 128  # DeepEP sizes every row's top-k and scale slots for these maxima
_MAX_SCALES = 128
_TOPK_IDX_BYTES = 8  # topk_idx_t: int64
_SOURCE_META_BYTES = 8  # the per-token source record of DeepEP's internode kernels (two int32)
_ALIGN = 128


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class Config(_EpcommConfig):
    """``deep_ep.Config(num_sms=20, num_max_nvl_chunked_send_tokens=6, num_max_nvl_chunked_recv_tokens=256,
    num_max_rdma_chunked_send_tokens=6, num_max_rdma_chunked_recv_tokens=256)``.

    On epcomm's one-sided transports ``num_sms`` is the number of SMs the normal kernels occupy and the NVLink
    chunk sizes set how many tokens a program moves per step (``epcomm.core.config.Config``); the RDMA fields
    are checked as DeepEP checks them (the receive size is rounded up to a multiple of the send size) and
    used by nothing until epcomm has an internode path. The portable transport uses none of them."""

    num_sms: Optional[int] = 20
    strict_sms: Optional[bool] = field(default=None, init=False)

    def __post_init__(self) -> None:
        for name in ("num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
                     "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"Config: {name}={getattr(self, name)!r} must be a positive integer")
        if self.num_max_nvl_chunked_send_tokens >= self.num_max_nvl_chunked_recv_tokens:
            raise ValueError(f"Config: num_max_nvl_chunked_send_tokens={self.num_max_nvl_chunked_send_tokens} must "
                             f"be smaller than num_max_nvl_chunked_recv_tokens={self.num_max_nvl_chunked_recv_tokens}")
        send, recv = self.num_max_rdma_chunked_send_tokens, self.num_max_rdma_chunked_recv_tokens
        object.__setattr__(self, "num_max_rdma_chunked_recv_tokens", _align(recv, send))
        if send > self.num_max_rdma_chunked_recv_tokens // 2:
            raise ValueError(f"Config: num_max_rdma_chunked_send_tokens={send} must be at most half of "
                             f"num_max_rdma_chunked_recv_tokens={recv} (rounded up to a multiple of the send size)")
        super().__post_init__()

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's bytes of NVLink buffer for rows of ``hidden_bytes`` among ``num_ranks`` ranks with this config:
        per channel (``num_sms / 2``) and NVLink peer, ``num_max_nvl_chunked_recv_tokens`` rows with room for 128
        top-k ids, weights and scales each, plus counters, rounded up to 128 bytes. Passed to ``Buffer`` as
        ``num_nvl_bytes``, it is the receive area of epcomm's one-sided transports (a dispatch larger than
        that goes in several rounds); the portable transport allocates none."""
        if num_ranks > NUM_MAX_NVL_PEERS and num_ranks % NUM_MAX_NVL_PEERS:
            raise ValueError(f"Config.get_nvl_buffer_size_hint: num_ranks={num_ranks} must be at most "
                             f"{NUM_MAX_NVL_PEERS} or a multiple of it")
        num_rdma_ranks = max(num_ranks // NUM_MAX_NVL_PEERS, 1)
        num_nvl_ranks = min(num_ranks, NUM_MAX_NVL_PEERS)
        slots = self.num_sms // 2 * num_nvl_ranks
        row = hidden_bytes + _SOURCE_META_BYTES + _MAX_TOPK * (_TOPK_IDX_BYTES + 4) + _MAX_SCALES * 4
        counters = slots * (2 * num_rdma_ranks + 3) * 4
        return _align(counters + slots * self.num_max_nvl_chunked_recv_tokens * row, _ALIGN)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's bytes of RDMA buffer: 0 within one NVLink domain (at most 8 ranks), else its internode
        formula (double-buffered chunks of ``num_max_rdma_chunked_recv_tokens`` rows per channel and RDMA
        peer), which sizes a path epcomm does not have yet (a ``Buffer`` of more than 8 ranks raises)."""
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        if num_ranks % NUM_MAX_NVL_PEERS:
            raise ValueError(f"Config.get_rdma_buffer_size_hint: num_ranks={num_ranks} must be a multiple of "
                             f"{NUM_MAX_NVL_PEERS}")
        slots = self.num_sms // 2 * (num_ranks // NUM_MAX_NVL_PEERS)
        row = hidden_bytes + _SOURCE_META_BYTES + _MAX_TOPK * (_TOPK_IDX_BYTES + 4) + _MAX_SCALES * 4 + 16
        counters = slots * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4
        return _align(counters + 2 * slots * self.num_max_rdma_chunked_recv_tokens * row, _ALIGN)


__all__ = ["Config", "NUM_MAX_NVL_PEERS"]
