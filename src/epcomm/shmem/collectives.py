"""Collectives written with the one-sided primitives."""

from __future__ import annotations

import logging
from typing import Optional

import torch

from ..errors import BufferTooSmallError, TransportUnavailableError
from .heap import SymmetricHeap

log = logging.getLogger(__name__)


class AllGather:
    """One-sided all-gather, one kernel per call, no host synchronisation, CUDA-graph capturable. Two
    protocols, chosen per call by size (``protocol="auto"``):

    * ``"lines"`` (small shards, up to ``small_shard_bytes``, a multiple of 4 bytes): every 4-byte word
      travels with the call's epoch in one 8-byte line into a double-buffered staging area of each peer;
      each rank polls its staging until every line carries the epoch and copies the words into its output.
      No fence, flag or handshake: the lowest latency, twice the bytes (NCCL's LL protocol).
    * ``"direct"``: every rank puts its shard straight into row ``rank`` of every peer's output, after that
      peer has said its previous result was consumed (a ``ready`` flag it sets when its stream reaches the
      call); the last program to finish releases ``done`` flags to every peer and waits for everyone's.
      Destinations are rotated to spread the NVLink load.

    Both keep their epochs on the device (flags with a single writer each), so calls can be captured in a
    CUDA graph and replayed, and calls of the two protocols can follow each other in any order.

    Arguments:
        heap: the ``SymmetricHeap`` to allocate from (collective: every rank constructs the AllGather in the
            same order with the same arguments).
        max_shard_bytes: the largest shard a call may gather.
        small_shard_bytes: the largest shard sent as lines (default ``min(max_shard_bytes, 1 MiB // R)``;
            0 turns the protocol off). ``AllGather.heap_bytes(R, max_shard_bytes, small_shard_bytes)`` is the
            heap space it takes: ``R * max_shard_bytes`` of output plus ``4 * R * small_shard_bytes`` of
            staging (plus flags and alignment).

    ``ag(shard) -> out``: ``shard`` is a contiguous tensor on the heap's device (any shape ``S``, dtype ``D``;
    the same on every rank); ``out`` is ``[R, *S]`` of dtype ``D``, a view of this rank's heap holding every
    rank's shard in rank order. It stays valid until this rank's next call. Stream-ordered, no host
    synchronisation; a timeout is raised by ``heap.check_errors()`` or the next blocking heap call.
    ``ag.protocol = "direct"`` forces the direct protocol for every size (benchmarks); ``"auto"`` is the
    default."""

    SMALL_GATHERED_BYTES = 1 << 20  # default: shards up to this many gathered bytes travel as lines

    def __init__(self, heap: SymmetricHeap, max_shard_bytes: int, small_shard_bytes: Optional[int] = None) -> None:
        fn = "AllGather"
        if max_shard_bytes <= 0:
            raise ValueError(f"{fn}: max_shard_bytes={max_shard_bytes} must be positive")
        if not heap._kernels_usable("one-sided all-gather"):
            raise TransportUnavailableError(f"{fn}: needs the Triton kernels (on CPUs: TRITON_INTERPRET=1)")
        self.heap = heap
        self.max_shard_bytes = int(max_shard_bytes)
        r = heap.world_size
        self.small_shard_bytes = self._small(r, self.max_shard_bytes, small_shard_bytes)
        self._out = heap.empty((r * self.max_shard_bytes,), torch.uint8)
        self._flags = heap.empty((2, r), torch.int64)  # [ready, done][writer rank]
        self._flags.zero_()
        self._slot_words = _slot_words(self.small_shard_bytes)
        self._stage = heap.empty((2, r, self._slot_words), torch.int64)  # [slot][writer rank][line]
        self._stage.zero_()
        self._state = torch.zeros(2, dtype=torch.int64, device=heap.device)  # [epoch, arrival counter]
        self._out_off = heap.offset_of(self._out)
        self._ready_off = heap.offset_of(self._flags[0])
        self._done_off = heap.offset_of(self._flags[1])
        self._stage_off = heap.offset_of(self._stage)
        self.config = None  # a CopyConfig for the direct protocol; None: the heap's copy_config
        self.protocol = "auto"
        heap.barrier()  # every rank's flags are zero before anyone signals into them

    def _start_epochs(self, epoch: int) -> None:
        """For tests only (collective, nothing in flight): the epoch, the ready/done flags and every staged line at
        ``epoch`` (lines carry its low 32 bits), as if that many calls had completed: the next calls cross the wrap
        of the lines' 32-bit epochs (from 2**31 - 1, 2**32 - 1) or of the int64 epoch (from 2**63 - 1)."""
        heap = self.heap
        if heap.device.type == "cuda":
            torch.cuda.synchronize(heap.device)
        import torch.distributed as dist

        dist.barrier(group=heap.group)
        tag = (epoch & 0xFFFFFFFF) << 32
        self._state[0] = epoch
        self._flags.fill_(epoch)
        self._stage.fill_(tag - (1 << 64) if tag >= 1 << 63 else tag)
        if heap.device.type == "cuda":
            torch.cuda.synchronize(heap.device)
        dist.barrier(group=heap.group)

    @staticmethod
    def _small(world_size: int, max_shard_bytes: int, small_shard_bytes: Optional[int]) -> int:
        if small_shard_bytes is None:
            small_shard_bytes = min(max_shard_bytes, AllGather.SMALL_GATHERED_BYTES // world_size)
        if small_shard_bytes < 0:
            raise ValueError(f"AllGather: small_shard_bytes={small_shard_bytes} must be >= 0")
        return min(int(small_shard_bytes), max_shard_bytes) // 4 * 4

    def sends_lines(self, nbytes: int, src_addr: int = 0) -> bool:
        """Whether a shard of ``nbytes`` at ``src_addr`` qualifies for the lines protocol (``"auto"``)."""
        return 0 < nbytes <= self.small_shard_bytes and nbytes % 4 == 0 and src_addr % 4 == 0

    @staticmethod
    def heap_bytes(world_size: int, max_shard_bytes: int, small_shard_bytes: Optional[int] = None) -> int:
        """Heap bytes one AllGather takes."""
        from .heap import heap_bytes_for

        small = AllGather._small(world_size, max_shard_bytes, small_shard_bytes)
        return heap_bytes_for([((world_size * max_shard_bytes,), torch.uint8), ((2, world_size), torch.int64),
                               ((2, world_size, _slot_words(small)), torch.int64)])

    def __call__(self, shard: torch.Tensor, timeout_s: Optional[float] = None) -> torch.Tensor:
        fn = "AllGather"
        heap = self.heap
        heap._check_alive(fn)
        heap._check_contiguous(fn, "shard", shard)
        nbytes = shard.numel() * shard.element_size()
        if nbytes > self.max_shard_bytes:
            raise BufferTooSmallError(f"{fn}: the shard has {nbytes} bytes ({tuple(shard.shape)} {shard.dtype}), "
                                      f"this AllGather was built for at most {self.max_shard_bytes}; build it with "
                                      f"max_shard_bytes >= {nbytes}")
        timeout_s = heap._timeout(fn, timeout_s)
        src = shard.data_ptr()
        if self.protocol not in ("auto", "direct"):
            raise ValueError(f"{fn}: protocol={self.protocol!r} must be 'auto' or 'direct'")
        if self.protocol == "auto" and self.sends_lines(nbytes, src):
            heap._K.launch_allgather_lines(heap.peer_bases, src, self._out.data_ptr(), nbytes, self._stage_off,
                                           self._slot_words, self._state, heap._error, heap.rank, heap.world_size,
                                           timeout_s, heap._K.num_sms(heap.device))
        else:
            heap._K.launch_allgather(heap.peer_bases, src, self._out_off, nbytes, self._ready_off, self._done_off,
                                     self._state, heap._error, heap.rank, heap.world_size, timeout_s,
                                     self.config or heap.copy_config)
        return self._out[:heap.world_size * nbytes].view(shard.dtype).view(heap.world_size, *shard.shape)


def _slot_words(small_shard_bytes: int) -> int:
    """Lines per staging row: one per 4-byte word, rounded up to an even count (16-byte aligned rows)."""
    return max(2, (small_shard_bytes // 4 + 1) // 2 * 2)
