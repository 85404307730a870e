"""Sizing and sharing the communication ``Buffer`` of MoE layers.

Rule of thumb (what ``moe_buffer_size_bytes`` computes):

* normal mode (``num_nvl_bytes``): one dispatch held in one piece, every rank possibly sending all of its
  tokens to one rank: ``R * max_tokens_per_rank * (row_bytes + 12 K + 64)``, where ``row_bytes`` is the
  larger of a dispatched row (``2 H`` in BF16, ``H + 4 H / 128`` in FP8, ``4 H`` in FP32) and a combined
  row (``2 H`` / ``4 H``). DeepSeek-V3 on 8 GPUs (H = 7168, K = 8, 4096 tokens per rank, BF16):
  ``8 * 4096 * (14336 + 160) = 475 MB``. Chunked transports need less; the portable ``alltoall``
  transport needs none (it allocates per call).
* low-latency mode (``num_rdma_bytes``): ``get_low_latency_rdma_size_hint``: two parities of a dispatch
  area of ``R * T`` rows (payload and scales: a token arrives once per rank) plus ``R * T * min(K, E_local)``
  4-byte routing records, and a combine area of ``T * K`` BF16 rows, with rows wide enough for the widest
  low-latency message the layer sends, which is the backward dispatch: the gradient plus the routing
  metadata, ``(H + 128) * elem`` bytes. DeepSeek-V3 on 8 GPUs with T = 128: about 60 MB.

``get_buffer`` keeps one Buffer per (group, transport, device) and grows it (destroy + recreate, which is
collective: every rank builds the same layers in the same order) when a layer needs more; layers look
it up at every forward, so all layers share the largest. ``destroy_buffers()`` releases them.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Optional

import torch

from ..buffer import Buffer
from ..core.layout import get_low_latency_rdma_size_hint, get_normal_buffer_size_hint
from ..errors import EpcommError
from ..fp8 import GROUP
from .config import MoEConfig

log = logging.getLogger("epcomm.layers")

_GIB = 1 << 30
_BUFFERS: dict = {}


class BufferSizes(NamedTuple):
    num_nvl_bytes: int
    num_rdma_bytes: int

    def describe(self) -> str:
        return (f"num_nvl_bytes={self.num_nvl_bytes} ({self.num_nvl_bytes / _GIB:.3f} GiB), "
                f"num_rdma_bytes={self.num_rdma_bytes} ({self.num_rdma_bytes / _GIB:.3f} GiB)")


def low_latency_meta_columns(topk: int, dtype: torch.dtype) -> int:
    """Columns (of ``dtype``) appended to the low-latency backward dispatch for the routing metadata
    (K float32 weights and K int32 expert ids, bit-cast), padded to a multiple of 128."""
    cols = 2 * topk * 4 // torch.tensor([], dtype=dtype).element_size()
    return -(-cols // GROUP) * GROUP


def moe_buffer_size_bytes(config: MoEConfig, max_tokens_per_rank: int, num_ranks: int) -> BufferSizes:
    """``(num_nvl_bytes, num_rdma_bytes)`` for a layer of ``config`` on ``num_ranks`` ranks with at most
    ``max_tokens_per_rank`` tokens per rank in normal mode (see the module docstring).
    ``config.buffer_size_gb`` replaces the normal-mode size."""
    h, k = config.hidden, config.topk
    elem = torch.tensor([], dtype=config.dtype).element_size()
    dispatch_row = h + 4 * (h // GROUP) if config.fp8_dispatch else elem * h
    row = max(dispatch_row, elem * h)
    if config.buffer_size_gb is not None:
        nvl = int(config.buffer_size_gb * _GIB)
    else:
        nvl = get_normal_buffer_size_hint(max_tokens_per_rank, row + 12 * k, num_ranks)
    rdma = 0
    if config.low_latency_max_tokens:
        widest = max(dispatch_row, elem * (h + low_latency_meta_columns(k, config.dtype)), 2 * h)
        rdma = get_low_latency_rdma_size_hint(config.low_latency_max_tokens, -(-widest // 2), num_ranks,
                                              config.num_experts, k)
    return BufferSizes(nvl, rdma)


def _key(group, transport: str, device: Optional[torch.device]):
    return (id(group), transport, str(device))


def get_buffer(group, sizes: BufferSizes, transport: str, device: Optional[torch.device] = None) -> Buffer:
    """The shared Buffer of ``group`` for ``transport``, at least ``sizes`` large (collective when it has to
    be created or grown)."""
    key = _key(group, transport, device)
    buf = _BUFFERS.get(key)
    if buf is not None and not buf._destroyed and buf.num_nvl_bytes >= sizes.num_nvl_bytes \
            and buf.num_rdma_bytes >= sizes.num_rdma_bytes:
        return buf
    if buf is not None:
        sizes = BufferSizes(max(sizes.num_nvl_bytes, buf.num_nvl_bytes), max(sizes.num_rdma_bytes, buf.num_rdma_bytes))
        log.info("MoE: growing the shared %s buffer to %s", transport, sizes.describe())
        if not buf._destroyed:
            buf.destroy()
    try:
        buf = Buffer(group, sizes.num_nvl_bytes, sizes.num_rdma_bytes, low_latency_mode=sizes.num_rdma_bytes > 0,
                     transport=transport, device=device)
    except torch.OutOfMemoryError as exc:
        raise EpcommError(
            f"MoE: out of GPU memory creating the communication buffer ({sizes.describe()}, transport "
            f"{transport!r}). Lower MoEConfig.buffer_size_gb (normal mode; chunked transports work with less), "
            f"MoE(max_tokens_per_rank=...) or MoEConfig.low_latency_max_tokens (low-latency area), or create "
            f"the layers before other large allocations") from exc
    _BUFFERS[key] = buf
    return buf


def destroy_buffers() -> None:
    """Destroy every shared Buffer (collective: call on every rank, e.g. before destroy_process_group)."""
    for buf in list(_BUFFERS.values()):
        if not buf._destroyed:
            buf.destroy()
    _BUFFERS.clear()


def too_small_message(exc: Exception, sizes: BufferSizes, what: str) -> str:
    return (f"MoE {what}: the communication buffer is too small ({sizes.describe()}): {exc}. Set "
            f"MoEConfig(buffer_size_gb=...) larger (normal mode), raise MoE(max_tokens_per_rank=...) to the "
            f"largest batch per rank, or lower low_latency_max_tokens; moe_buffer_size_bytes(config, "
            f"max_tokens_per_rank, num_ranks) gives the sizes")
