"""Collectives written with the one-sided primitives."""

from __future__ import annotations

import logging
from typing import Optional

import torch

from ..errors import BufferTooSmallError, TransportUnavailableError
from .heap import SymmetricHeap

log = logging.getLogger(__name__)


class AllGather:
    """One-sided all-gather: every rank puts its shard straight into every peer's output, then signals.

    One kernel per call, grid ``(P, R)``: program ``(p, j)`` writes its share of the shard into row ``rank`` of
    rank ``(rank + j) % R``'s output (rotated destinations spread the NVLink load), after that rank has said
    its previous result was consumed (a ``ready`` flag it sets when its stream reaches the call); the last
    program to finish releases ``done`` flags to every peer and waits for everyone's. Flags are single-writer
    epochs kept on the device, so calls can be captured in a CUDA graph and replayed.

    Arguments:
        heap: the ``SymmetricHeap`` to allocate from (collective: every rank constructs the AllGather in the
            same order with the same ``max_shard_bytes``).
        max_shard_bytes: the largest shard a call may gather. Uses ``R * max_shard_bytes + 16 * R`` heap bytes
            (plus alignment): ``AllGather.heap_bytes(R, max_shard_bytes)``.

    ``ag(shard) -> out``: ``shard`` is a contiguous tensor on the heap's device (any shape ``S``, dtype ``D``;
    the same on every rank); ``out`` is ``[R, *S]`` of dtype ``D``, a view of this rank's heap holding every
    rank's shard in rank order. It stays valid until this rank's next call (the next call waits, on every
    peer, until this rank's stream has reached it before overwriting it). Stream-ordered, no host
    synchronisation; a timeout is raised by ``heap.check_errors()`` or the next blocking heap call."""

    def __init__(self, heap: SymmetricHeap, max_shard_bytes: int) -> None:
        fn = "AllGather"
        if max_shard_bytes <= 0:
            raise ValueError(f"{fn}: max_shard_bytes={max_shard_bytes} must be positive")
        if not heap._kernels_usable("one-sided all-gather"):
            raise TransportUnavailableError(f"{fn}: needs the Triton kernels (on CPUs: TRITON_INTERPRET=1)")
        self.heap = heap
        self.max_shard_bytes = int(max_shard_bytes)
        r = heap.world_size
        self._out = heap.empty((r * self.max_shard_bytes,), torch.uint8)
        self._flags = heap.empty((2, r), torch.int64)  # [ready, done][writer rank]
        self._flags.zero_()
        self._state = torch.zeros(2, dtype=torch.int64, device=heap.device)  # [epoch, arrival counter]
        self._out_off = heap.offset_of(self._out)
        self._ready_off = heap.offset_of(self._flags[0])
        self._done_off = heap.offset_of(self._flags[1])
        self.config = None  # a CopyConfig for this all-gather; None: the heap's copy_config
        heap.barrier()  # every rank's flags are zero before anyone signals into them

    @staticmethod
    def heap_bytes(world_size: int, max_shard_bytes: int) -> int:
        """Heap bytes one AllGather takes."""
        from .heap import heap_bytes_for

        return heap_bytes_for([((world_size * max_shard_bytes,), torch.uint8), ((2, world_size), torch.int64)])

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
        heap._K.launch_allgather(heap.peer_bases, shard.data_ptr(), self._out_off, nbytes, self._ready_off,
                           self._done_off, self._state, heap._error, heap.rank, heap.world_size, timeout_s,
                           self.config or heap.copy_config)
        return self._out[:heap.world_size * nbytes].view(shard.dtype).view(heap.world_size, *shard.shape)
