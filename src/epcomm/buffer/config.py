"""Tuning configuration, in DeepEP's positional order so ``Config(num_sms, 6, 256, 6, 128)`` ports as is."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Config:
    """Performance knobs of the normal (high-throughput) kernels.

    num_sms: SMs the one-sided kernels may occupy (even, >= 2). The portable transport ignores it.
    num_max_nvl_chunked_send_tokens / num_max_nvl_chunked_recv_tokens: tokens per chunk that a sender
        writes before it publishes progress, and the ring capacity (tokens) per (channel, peer) in the
        receive buffer; ``recv`` must be at least ``send``.
    num_max_rdma_chunked_send_tokens / num_max_rdma_chunked_recv_tokens: accepted for DeepEP compatibility;
        epcomm is intranode only and does not use them.
    """

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def __post_init__(self) -> None:
        if not isinstance(self.num_sms, int) or self.num_sms < 2 or self.num_sms % 2:
            raise ValueError(f"Config: num_sms={self.num_sms!r} must be an even integer >= 2 (the kernels pair "
                             f"sender and receiver SMs)")
        for name in ("num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
                     "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Config: {name}={value!r} must be a positive integer")
        if self.num_max_nvl_chunked_recv_tokens < self.num_max_nvl_chunked_send_tokens:
            raise ValueError(f"Config: num_max_nvl_chunked_recv_tokens={self.num_max_nvl_chunked_recv_tokens} "
                             f"must be >= num_max_nvl_chunked_send_tokens={self.num_max_nvl_chunked_send_tokens}")

    @property
    def num_channels(self) -> int:
        """Independent channels: one sender and one receiver SM each."""
        return self.num_sms // 2
