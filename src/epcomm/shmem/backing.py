"""Where a symmetric heap's bytes live: one allocation per rank, mapped into every rank's process.

* CUDA: PyTorch symmetric memory, CUDA backend (``symm_mem.empty`` + ``symm_mem.rendezvous``): peers'
  allocations are mapped into this process through CUDA IPC, so a kernel on this GPU can load and store
  them over NVLink at the addresses ``bases[peer] + offset``.
* CUDA, several ranks on one GPU (testing, ``epcomm.testing.launcher``): one ordinary allocation per rank,
  mapped into the other ranks' processes through CUDA IPC (torch symmetric memory refuses ranks that share a
  device).
* CPU (tests and development): one shared-memory file per rank (``/dev/shm``), mapped by every rank's
  process. Kernels then run under the Triton interpreter, whose loads and stores go to the same
  addresses; without the interpreter the heap falls back to torch copies and host polling.

A backing only provides ``local`` (this rank's bytes, uint8), ``bases`` (every rank's base address as mapped
in this process), ``view(peer, offset, nbytes)`` (a uint8 tensor aliasing bytes of ``peer``'s heap) and
``close(group=None)`` (collective when a group is given)."""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
import uuid

import torch
import torch.distributed as dist

from ..errors import EpcommError, TransportUnavailableError

log = logging.getLogger(__name__)


def _all_gather_object(value, group, world: int) -> list:
    out = [None] * world
    dist.all_gather_object(out, value, group=group)
    return out


class CpuBacking:
    """Shared-memory files, one per rank, each mapped by every rank."""

    def __init__(self, group, rank: int, world: int, total_bytes: int) -> None:
        directory = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) \
            else tempfile.gettempdir()
        path = os.path.join(directory, f"epcomm-heap-{os.getpid()}-{uuid.uuid4().hex[:12]}-r{rank}")
        self._maps: list = []
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, total_bytes)  # a new file reads as zeros
                own = mmap.mmap(fd, total_bytes)
            finally:
                os.close(fd)
            paths = _all_gather_object(path, group, world)
            for r, p in enumerate(paths):
                if r == rank:
                    self._maps.append(own)
                    continue
                fd = os.open(p, os.O_RDWR)
                try:
                    self._maps.append(mmap.mmap(fd, total_bytes))
                finally:
                    os.close(fd)
            dist.barrier(group=group)  # every rank has mapped every file: the names can go
        finally:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._tensors = [torch.frombuffer(m, dtype=torch.uint8) for m in self._maps]
        self.local = self._tensors[rank]
        self.bases = [t.data_ptr() for t in self._tensors]

    def view(self, peer: int, offset: int, nbytes: int) -> torch.Tensor:
        return self._tensors[peer][offset:offset + nbytes]

    def close(self, group=None) -> None:
        self._tensors = []
        self.local = None
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view of the heap is still alive: the mapping goes with it
                pass
        self._maps = []


class CudaBacking:
    """PyTorch symmetric memory (CUDA backend)."""

    def __init__(self, group, rank: int, world: int, total_bytes: int, device: torch.device) -> None:
        try:
            import torch.distributed._symmetric_memory as symm_mem
        except ImportError as e:
            raise TransportUnavailableError(f"SymmetricHeap: torch {torch.__version__} has no symmetric memory "
                                            f"(torch.distributed._symmetric_memory): {e}") from e
        try:
            tensor = symm_mem.empty(total_bytes, dtype=torch.uint8, device=device)
            handle = symm_mem.rendezvous(tensor, group.group_name)
        except Exception as e:  # noqa: BLE001 - any failure here means "no P2P mapping on this machine"
            raise TransportUnavailableError(
                f"SymmetricHeap: torch symmetric memory could not map {total_bytes} bytes across the {world} "
                f"ranks of the group (rank {rank}, {device}): {type(e).__name__}: {e}") from e
        ptrs = [int(p) for p in handle.buffer_ptrs]
        # With torch's symmetric memory pool the tensor may start inside its allocation; the offset is
        # exchanged rather than assumed equal on every rank.
        offsets = _all_gather_object(tensor.data_ptr() - ptrs[rank], group, world)
        size = int(handle.buffer_size)
        for r, off in enumerate(offsets):
            if off < 0 or off + total_bytes > size:
                raise EpcommError(f"SymmetricHeap: rank {r}'s heap lies at offset {off} of a {size}-byte "
                                  f"symmetric allocation, which cannot hold {total_bytes} bytes")
        self._tensor = tensor
        self._handle = handle
        self._ptrs = ptrs
        self._rank = rank
        self.local = tensor
        self.bases = [p + o for p, o in zip(ptrs, offsets)]

    def view(self, peer: int, offset: int, nbytes: int) -> torch.Tensor:
        if peer == self._rank:
            return self.local[offset:offset + nbytes]
        want = self.bases[peer] + offset
        v = self._handle.get_buffer(peer, [nbytes], torch.uint8, want - self._ptrs[peer])
        if v.data_ptr() != want:  # a torch version that counts the offset from elsewhere
            v = self._handle.get_buffer(peer, [nbytes], torch.uint8, 2 * (want - self._ptrs[peer]) - (
                v.data_ptr() - self._ptrs[peer]))
            if v.data_ptr() != want:
                raise EpcommError(f"SymmetricHeap.peer_tensor: torch's get_buffer returned address "
                                  f"{v.data_ptr():#x} for rank {peer}, expected {want:#x}")
        return v

    def close(self, group=None) -> None:
        self._handle = None
        self._tensor = None
        self.local = None


class CudaIpcBacking:
    """Several ranks on one GPU: one allocation per rank, opened in every other rank's process through CUDA IPC
    (torch.multiprocessing's sharing of CUDA tensors). Not across GPUs: a kernel cannot reach another GPU's memory
    through such a mapping (the heap refuses a group that shares GPUs and spans several); a group of one rank per
    GPU uses torch symmetric memory instead."""

    def __init__(self, group, rank: int, world: int, total_bytes: int, device: torch.device) -> None:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

        try:
            tensor = torch.empty(total_bytes, dtype=torch.uint8, device=device)
            # one send per receiving rank: torch counts the receivers' references per send, and a send shared by
            # several receivers leaves this rank's count unbalanced (torch then warns at exit)
            sends = [reduce_tensor(tensor)[1] if r != rank else None for r in range(world)]
            shared = _all_gather_object(sends, group, world)
            self._tensors = [tensor if r == rank else rebuild_cuda_tensor(*a[rank]) for r, a in enumerate(shared)]
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure here means "no IPC mapping on this machine"
            raise TransportUnavailableError(
                f"SymmetricHeap: CUDA IPC could not map {total_bytes} bytes across the {world} ranks of the group "
                f"(rank {rank}, {device}): {type(e).__name__}: {e}") from e
        self.local = tensor
        self.bases = [t.data_ptr() for t in self._tensors]

    def view(self, peer: int, offset: int, nbytes: int) -> torch.Tensor:
        return self._tensors[peer][offset:offset + nbytes]

    def close(self, group=None) -> None:
        """Unmap the peers' allocations; with ``group`` (collective), wait until every rank has unmapped this
        rank's before it can be freed (an owner that exits first makes torch warn about tensors still shared)."""
        self._tensors = []
        self.local = None
        if group is not None and dist.is_initialized():
            torch.cuda.synchronize()
            dist.barrier(group=group)
