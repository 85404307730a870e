"""One-sided (NVSHMEM-style) primitives from Python, on PyTorch symmetric memory.

``SymmetricHeap(group, nbytes)`` allocates one symmetric region per rank (mapped into every rank over
CUDA IPC) and offers ``empty`` / ``peer_ptrs`` / ``peer_tensor`` plus the one-sided operations ``put``,
``get``, ``signal``, ``wait``, ``barrier`` and ``quiet``. ``AllGather`` is a one-sided all-gather built on
it. Device-side helpers for other kernels (``peer_ptr``, ``ld_acquire``, ``st_release``, ``atomic_add_release``,
``wait_until``, ``block_barrier``, ``copy_bytes``, ...) and ``CopyConfig`` (how the SM-driven copies are
launched; ``heap.copy_config``) are in ``epcomm.kernels.shmem``. All calls must be made with the heap's
device as the current CUDA device.

On CPUs the heap uses shared memory between the ranks' processes (for tests): with ``TRITON_INTERPRET=1``
the same kernels run under the Triton interpreter, otherwise torch copies and host polling stand in."""

from .collectives import AllGather
from .heap import DEFAULT_NUM_SIGNALS, HEAP_ALIGNMENT, HeapLayout, SymmetricHeap, heap_bytes_for
from .p2p import p2p_access_supported, p2p_atomics_supported

__all__ = ["SymmetricHeap", "HeapLayout", "AllGather", "heap_bytes_for", "p2p_atomics_supported",
           "p2p_access_supported", "HEAP_ALIGNMENT", "DEFAULT_NUM_SIGNALS"]
