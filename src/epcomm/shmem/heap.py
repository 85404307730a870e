"""``SymmetricHeap``: one symmetric allocation per rank, carved identically on every rank, with one-sided
``put`` / ``get`` / ``signal`` / ``wait`` / ``barrier`` / ``quiet`` on it (NVSHMEM's model, from Python).

Layout of every rank's heap (identical offsets on all ranks, see ``HeapLayout``)::

    [ signals int64[num_signals] | barrier flags int64[R] | identity int64[2] | user region (heap.empty) ... ]

* ``signals[s]`` on rank r is written by whoever ``signal(r, s, ...)``s it; ``wait(s, ...)`` polls it.
* ``barrier flags[q]`` on rank r is written only by rank q (the epoch of q's latest ``barrier()``).
* ``identity`` holds (rank, nonce) of the heap's owner: at creation every rank reads every peer's through
  the mapping, which catches a peer address that does not point at that peer's heap.
* The user region is handed out by ``empty(shape, dtype)`` in call order, 256-byte aligned, the same on
  every rank (it is collective: all ranks must make the same calls in the same order).

Ordering: every operation is enqueued on the current CUDA stream (``nonblocking=True``: on the heap's
communication stream, joined back by ``quiet()``) and is ordered with the work around it like any
kernel. ``put`` / ``get`` return once enqueued; the data is in the peer's memory when the copy kernel has
finished. A ``signal`` (or ``put(..., signal_slot=...)``) releases everything this rank wrote before it, so
the rank that sees the signal through ``wait`` (acquire) sees the data too.

Timeouts: ``wait`` and ``barrier`` poll on the device with ``%globaltimer`` and give up after
``timeout_s`` (default ``epcomm.env.timeout_s()``): the kernel records which rank, slot, expected and seen
value in a device error word and returns, and the host raises ``EpcommTimeoutError``. With
``nonblocking=True`` the error is raised by the next blocking call or ``check_errors()``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from .. import env
from ..core.device import device_uuid, split_shared_group
from ..core.layout import align_up
from ..errors import BufferTooSmallError, EpcommError, EpcommTimeoutError, TransportUnavailableError
from ..kernels import triton_available
from ..kernels import shmem_codes as codes
from .backing import CpuBacking, CudaBacking, CudaIpcBacking
from .p2p import p2p_atomics_supported

log = logging.getLogger(__name__)

HEAP_ALIGNMENT = 256
DEFAULT_NUM_SIGNALS = 1024
_ENGINES = ("sm", "ce")
_PEER_VIEW_CACHE = 256
_ON_CURRENT_STREAM = contextlib.nullcontext(0)  # reusable: nullcontext keeps no state

Shape = Union[int, Sequence[int], torch.Size]


@dataclass(frozen=True)
class HeapLayout:
    """Byte offsets of a heap (the same on every rank).

    signals_off: ``int64[num_signals]`` signal slots; barrier_off: ``int64[world_size]`` barrier arrival flags
    (slot q written only by rank q); ident_off: ``int64[2]`` (owner rank, nonce); user_off: start of the
    region ``empty()`` carves; total_bytes: the allocation (control region + ``user_bytes``)."""

    world_size: int
    num_signals: int
    user_bytes: int
    signals_off: int
    barrier_off: int
    ident_off: int
    user_off: int
    total_bytes: int

    @staticmethod
    def build(world_size: int, user_bytes: int, num_signals: int = DEFAULT_NUM_SIGNALS) -> "HeapLayout":
        if world_size < 1:
            raise ValueError(f"HeapLayout.build: world_size={world_size} must be >= 1")
        if user_bytes < 0:
            raise ValueError(f"HeapLayout.build: user_bytes={user_bytes} must be >= 0")
        if num_signals < 1:
            raise ValueError(f"HeapLayout.build: num_signals={num_signals} must be >= 1")
        signals_off = 0
        barrier_off = align_up(signals_off + 8 * num_signals, HEAP_ALIGNMENT)
        ident_off = align_up(barrier_off + 8 * world_size, HEAP_ALIGNMENT)
        user_off = align_up(ident_off + 16, HEAP_ALIGNMENT)
        user_bytes = align_up(user_bytes, HEAP_ALIGNMENT)
        return HeapLayout(world_size, num_signals, user_bytes, signals_off, barrier_off, ident_off, user_off,
                          user_off + user_bytes)


def heap_bytes_for(specs: Iterable[tuple]) -> int:
    """``nbytes`` a heap needs for ``empty()`` calls of ``specs`` (``(shape, dtype)`` pairs) in that order,
    alignment padding included."""
    total = 0
    for shape, dtype in specs:
        total = align_up(total, HEAP_ALIGNMENT) + _numel(shape) * _element_size(dtype)
    return align_up(total, HEAP_ALIGNMENT)


def _numel(shape: Shape) -> int:
    if isinstance(shape, int):
        return shape
    return math.prod(int(s) for s in shape)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of contiguous ``t`` as a 1-D uint8 view."""
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


class SymmetricHeap:
    """A symmetric heap of ``nbytes`` usable bytes on every rank of ``group``.

    Arguments:
        group: process group (default: the world group). Creation is collective: one allocation and one
            rendezvous, every rank the same ``nbytes``.
        nbytes: bytes ``empty()`` may hand out per rank.
        device: CUDA device (default: the current one when CUDA is available, else CPU: the shared-memory
            test backing).
        num_signals: number of int64 signal slots.

    Attributes:
        rank, world_size, device, layout (``HeapLayout``), nbytes.
        peer_bases: int64 ``[world_size]`` tensor on ``device``: every rank's heap base address as mapped in
            this process (the table device kernels take; ``epcomm.kernels.shmem.peer_ptr``).
        copy_config: ``epcomm.kernels.shmem.CopyConfig`` of the SM-driven copies (settable).
        p2p_atomics: tuple of bools, whether this rank's device has native atomics on each rank's memory.
    """

    def __init__(self, group=None, nbytes: int = 0, device: Optional[Union[str, torch.device]] = None,
                 num_signals: int = DEFAULT_NUM_SIGNALS) -> None:
        fn = "SymmetricHeap"
        if not dist.is_initialized():
            raise EpcommError(f"{fn}: torch.distributed is not initialised; call init_process_group first "
                              f"(or use epcomm.testing.run)")
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"{fn}: nbytes={nbytes!r} must be a non-negative int")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
                else torch.device("cpu")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"{fn}: device {device} must be a CUDA device or the CPU")
        self.device = device
        self.layout = HeapLayout.build(self.world_size, nbytes, num_signals)
        self.nbytes = self.layout.user_bytes
        nonce = int.from_bytes(os.urandom(7), "little")
        facts = [None] * self.world_size
        dist.all_gather_object(facts, (device.index if device.type == "cuda" else -1, device_uuid(device), nonce),
                               group=self.group)
        self._peer_devices = tuple(f[0] for f in facts)
        gpus = [f[1] for f in facts]
        shares_gpu = device.type == "cuda" and len(set(gpus)) < self.world_size
        if device.type == "cuda" and split_shared_group(gpus):
            raise TransportUnavailableError(
                f"{fn}: the group's {self.world_size} ranks share GPUs and span {len(set(gpus))} of them "
                f"(rank {self.rank} on {device}): ranks that share a GPU map each other's memory through CUDA IPC, "
                "and a kernel cannot reach another GPU's memory through such a mapping (an illegal address). Keep a "
                "group of ranks that share GPUs on one GPU (EPCOMM_RANKS_PER_NODE places each simulated node's ranks "
                "on one GPU), or give each rank its own GPU")
        if shares_gpu:  # several ranks on one GPU (testing): torch symmetric memory refuses that
            self._backing = CudaIpcBacking(self.group, self.rank, self.world_size, self.layout.total_bytes, device)
        elif device.type == "cuda":
            self._backing = CudaBacking(self.group, self.rank, self.world_size, self.layout.total_bytes, device)
        else:
            self._backing = CpuBacking(self.group, self.rank, self.world_size, self.layout.total_bytes)
        self._bases = list(self._backing.bases)
        self._base = self._bases[self.rank]
        for r, b in enumerate(self._bases):
            if b % HEAP_ALIGNMENT:
                raise EpcommError(f"{fn}: rank {r}'s heap base {b:#x} is not {HEAP_ALIGNMENT}-byte aligned")
        self.peer_bases = torch.tensor(self._bases, dtype=torch.int64, device=device)
        self._cursor = self.layout.user_off
        self._error = torch.zeros(8, dtype=torch.int64, device=device)
        self._barrier_epoch = torch.zeros(1, dtype=torch.int64, device=device)
        # arrival counters of signalling copies, one per stream kind (current stream, communication stream)
        counters = torch.zeros(2, dtype=torch.int32, device=device)
        self._counters = (counters[0:1], counters[1:2])
        self._last_timeout_s = env.timeout_s()
        self._comm_stream = None
        self._peer_views: dict = {}
        self._destroyed = False
        self._K = _kernels_module(device)
        self.copy_config = self._K.CopyConfig() if self._K is not None else None
        self.p2p_atomics = tuple(self._atomics_towards(r) for r in range(self.world_size))
        # the control region starts at zero on every rank before anyone may signal into it
        self._backing.local[:self.layout.user_off].zero_()
        ident = self._backing.local[self.layout.ident_off:self.layout.ident_off + 16].view(torch.int64)
        ident.copy_(torch.tensor([self.rank, nonce], dtype=torch.int64))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier(group=self.group)
        self._check_mapping([f[2] for f in facts])
        log.debug("SymmetricHeap: rank %d of %d, %d user bytes on %s, bases %s", self.rank, self.world_size,
                  self.nbytes, device, [hex(b) for b in self._bases])

    # ------------------------------------------------------------------------------------------------
    # allocation and addressing
    # ------------------------------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        """Bytes of the user region handed out so far (padding included)."""
        return self._cursor - self.layout.user_off

    @property
    def free_bytes(self) -> int:
        return self.layout.total_bytes - self._cursor

    def empty(self, shape: Shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` in this heap, at the same offset on every rank (collective: all
        ranks make the same ``empty`` calls in the same order). Uninitialised. 256-byte aligned."""
        fn = "SymmetricHeap.empty"
        self._check_alive(fn)
        shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"{fn}: shape {shape} has a negative size")
        nbytes = _numel(shape) * _element_size(dtype)
        offset = align_up(self._cursor, HEAP_ALIGNMENT)
        if offset + nbytes > self.layout.total_bytes:
            need = heap_bytes_for([((self.used_bytes,), torch.uint8), (shape, dtype)])
            raise BufferTooSmallError(
                f"{fn}: cannot place {nbytes} bytes ({tuple(shape)} {dtype}): the heap has {self.nbytes} usable "
                f"bytes and {self.used_bytes} are taken ({self.free_bytes} free); create the SymmetricHeap with "
                f"nbytes >= {need} (epcomm.shmem.heap_bytes_for computes it for a list of tensors)")
        if env.validate_level() == "full":
            self._check_same_everywhere(fn, (offset, nbytes, str(dtype)))
        self._cursor = offset + nbytes
        return self._backing.local[offset:offset + nbytes].view(dtype).view(shape)

    def offset_of(self, t: torch.Tensor) -> int:
        """Byte offset of ``t``'s first element from this rank's heap base (the same on every rank)."""
        return self._offset_of(t, "SymmetricHeap.offset_of", "t")

    def peer_ptrs(self, t: torch.Tensor) -> torch.Tensor:
        """int64 ``[world_size]`` tensor on ``device``: the address of ``t`` in every rank's heap, as mapped in
        this process (what a kernel needs to load or store a peer's copy)."""
        return self.peer_bases + self._offset_of(t, "SymmetricHeap.peer_ptrs", "t")

    def peer_tensor(self, t: torch.Tensor, peer: int) -> torch.Tensor:
        """A tensor of ``t``'s shape and dtype aliasing ``peer``'s copy of heap tensor ``t`` (contiguous).
        On CUDA it lives on this process's device but its memory is the peer's (NVLink loads/stores; ``copy_``
        into or out of it uses the copy engine)."""
        fn = "SymmetricHeap.peer_tensor"
        self._check_alive(fn)
        peer = self._check_peer(fn, peer)
        self._check_contiguous(fn, "t", t)
        offset = self._offset_of(t, fn, "t")
        return self._peer_bytes(peer, offset, t.numel() * t.element_size()).view(t.dtype).view(t.shape)

    # ------------------------------------------------------------------------------------------------
    # one-sided data movement
    # ------------------------------------------------------------------------------------------------
    def put(self, dst: torch.Tensor, src: torch.Tensor, peer: int, nonblocking: bool = False, engine: str = "sm",
            signal_slot: Optional[int] = None, signal_value: int = 1, signal_op: str = "set",
            config=None) -> None:
        """Copy local ``src`` into ``peer``'s copy of heap tensor ``dst``.

        dst: contiguous heap tensor (any shape/dtype); src: contiguous tensor on ``device`` with as many
        bytes (shape and dtype may differ). ``engine``: ``"sm"`` (a Triton kernel storing over NVLink, 16-byte
        vectors) or ``"ce"`` (the copy engine, ``peer_tensor(dst, peer).copy_(src)``). With ``signal_slot``
        the same kernel then releases ``signal_value`` into (``"set"``) or onto (``"add"``) ``peer``'s signal
        ``signal_slot``, after all of the data: a ``wait`` on that slot on ``peer`` then sees the data.
        ``config``: a ``CopyConfig`` for this call instead of ``self.copy_config``.

        Signalling copies share one arrival counter per stream kind (the current stream; the heap's
        communication stream for ``nonblocking``): do not run two of them at the same time on two other
        streams. Signals in a captured CUDA graph replay the value baked in at capture: a ``wait(slot, "ge", v)`` would
        pass at once on the second replay. In graphs use ``barrier``/``AllGather`` (device-side epochs), or
        consume the signal: the receiver waits ``eq v`` and then resets its own slot with
        ``signal(self.rank, slot, 0)`` before the sender may signal again."""
        fn = "SymmetricHeap.put"
        peer, nbytes, dst_off, engine = self._copy_args(fn, dst, src, peer, engine)
        signal = None
        if signal_slot is not None:
            signal = (self._signal_addr(fn, peer, signal_slot),
                      self._check_signal_op(fn, signal_op, peer), int(signal_value))
        with self._issue(nonblocking, (src,)) as counter:
            if engine == "ce" or not self._kernels_usable("sm copies"):
                if nbytes:
                    self._peer_bytes(peer, dst_off, nbytes).copy_(_byte_view(src))
                if signal is not None:
                    self._raw_signal(peer, signal[0], signal[2], signal[1])
            else:
                self._K.launch_copy(src.data_ptr(), self._bases[peer] + dst_off, nbytes, self.device,
                                    config or self.copy_config, self._counters[counter],
                                    *((signal[0], signal[2], codes.SIGNAL_OPS[signal[1]]) if signal is not None
                                      else ()))

    def get(self, dst: torch.Tensor, src: torch.Tensor, peer: int, nonblocking: bool = False,
            engine: str = "sm", config=None) -> None:
        """Copy ``peer``'s copy of heap tensor ``src`` into local ``dst``.

        src: contiguous heap tensor; dst: contiguous tensor on ``device`` with as many bytes. ``engine`` as in
        ``put``. Only data ``peer`` has finished writing (ordered by a signal/wait or barrier) is well
        defined. ``config`` as in ``put``."""
        fn = "SymmetricHeap.get"
        peer, nbytes, src_off, engine = self._copy_args(fn, src, dst, peer, engine)
        with self._issue(nonblocking, (dst,)) as counter:
            if engine == "ce" or not self._kernels_usable("sm copies"):
                if nbytes:
                    _byte_view(dst).copy_(self._peer_bytes(peer, src_off, nbytes))
            else:
                self._K.launch_copy(self._bases[peer] + src_off, dst.data_ptr(), nbytes, self.device,
                                    config or self.copy_config, self._counters[counter])

    # ------------------------------------------------------------------------------------------------
    # signals, waits, barrier
    # ------------------------------------------------------------------------------------------------
    def signal(self, peer: int, slot: int, value: int = 1, op: str = "set", nonblocking: bool = False) -> None:
        """Release ``value`` into (``op="set"``) or add it onto (``op="add"``) signal ``slot`` of ``peer``, after
        everything this rank's stream wrote before (a system-scope fence, then a release store/atomic).

        ``op="add"`` towards another GPU needs native P2P atomics (NVLink; ``self.p2p_atomics[peer]``) and
        is refused without them. The single-writer alternative works everywhere: give every writer its own
        slot (e.g. slot = writer's rank), let each writer ``set`` a growing count into its slot, and let the
        reader ``wait`` on each writer's slot (or sum them after waiting)."""
        fn = "SymmetricHeap.signal"
        self._check_alive(fn)
        peer = self._check_peer(fn, peer)
        addr = self._signal_addr(fn, peer, slot)
        op = self._check_signal_op(fn, op, peer)
        with self._issue(nonblocking, ()):
            self._raw_signal(peer, addr, int(value), op)

    def wait(self, slot: int, cmp: str = "ge", value: int = 1, timeout_s: Optional[float] = None,
             nonblocking: bool = False) -> None:
        """Wait until this rank's signal ``slot`` satisfies ``signal <cmp> value`` (``cmp`` one of eq, ne, gt,
        ge, lt, le), then acquire: the data released before the signal is visible to later work.

        Blocking (default): the host waits for the device wait to finish and raises ``EpcommTimeoutError``
        (rank, slot, expected and seen value) after ``timeout_s`` (default ``epcomm.env.timeout_s()``).
        ``nonblocking=True``: only enqueued (CUDA-graph capturable); a timeout is raised by the next blocking
        call or ``check_errors()``."""
        fn = "SymmetricHeap.wait"
        self._check_alive(fn)
        addr = self._signal_addr(fn, self.rank, slot)
        cmp = self._check_choice(fn, "cmp", cmp, tuple(codes.CMP_CODES))
        timeout_s = self._timeout(fn, timeout_s)
        value = int(value)
        if self._kernels_usable("device waits"):
            self._K.launch_wait(addr, codes.CMP_CODES[cmp], value, timeout_s, self._error, self.rank, int(slot), self.device)
            if not nonblocking:
                self._host_sync(fn, timeout_s)
                self.check_errors(fn)
            return
        # host polling (CPU heap without the Triton interpreter)
        local = self._signals(self.rank)
        deadline = time.monotonic() + timeout_s
        ops = {"eq": int.__eq__, "ne": int.__ne__, "gt": int.__gt__, "ge": int.__ge__, "lt": int.__lt__,
               "le": int.__le__}
        while True:
            seen = int(local[slot])
            if ops[cmp](seen, value):
                return
            if time.monotonic() > deadline:
                if nonblocking:  # as on the device: recorded, raised by check_errors()
                    self._record_host_error(codes.ERR_WAIT_TIMEOUT, -1, int(slot), value, seen, codes.CMP_CODES[cmp])
                    return
                raise EpcommTimeoutError(self._wait_message(fn, timeout_s, int(slot), cmp, value, seen))
            time.sleep(1e-4)

    def barrier(self, timeout_s: Optional[float] = None, nonblocking: bool = False) -> None:
        """Device barrier of all ranks on the current stream: every rank's work enqueued before it (puts
        included) is complete and visible everywhere before any rank's work after it starts. CUDA-graph safe
        (the epoch is kept on the device). Timeouts as in ``wait``; after a barrier timeout the ranks'
        barrier epochs disagree and the heap should be destroyed."""
        fn = "SymmetricHeap.barrier"
        self._check_alive(fn)
        timeout_s = self._timeout(fn, timeout_s)
        if self._kernels_usable("device barriers"):
            self._K.launch_barrier(self.peer_bases, self.layout.barrier_off, self._barrier_epoch, self._error, self.rank,
                             self.world_size, timeout_s)
            if not nonblocking:
                self._host_sync(fn, timeout_s)
                self.check_errors(fn)
            return
        epoch = _int64(int(self._barrier_epoch[0]) + 1)
        for peer in range(self.world_size):
            self._flags(peer)[self.rank] = epoch
        local = self._flags(self.rank)
        deadline = time.monotonic() + timeout_s
        while True:
            lag = [q for q in range(self.world_size) if _int64(int(local[q]) - epoch) < 0]  # wrap-safe, as on GPUs
            if not lag:
                break
            if time.monotonic() > deadline:
                self._barrier_epoch[0] = epoch
                if nonblocking:
                    self._record_host_error(codes.ERR_BARRIER_TIMEOUT, lag[0], -1, epoch, int(local[lag[0]]),
                                            codes.CMP_GE)
                    return
                raise EpcommTimeoutError(self._barrier_message(fn, timeout_s, lag[0], epoch, int(local[lag[0]])))
            time.sleep(1e-4)
        self._barrier_epoch[0] = epoch

    def _start_epochs(self, epoch: int) -> None:
        """For tests only (collective, nothing in flight): the barrier epoch and every barrier flag at ``epoch`` (an
        int64, e.g. just below 2**63), as if that many barriers had passed: the next ones cross the wrap."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        self._barrier_epoch.fill_(epoch)
        self._flags(self.rank).fill_(epoch)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)

    def quiet(self) -> None:
        """Make the current stream wait for every ``nonblocking`` operation issued so far (their data is then
        delivered for everything ordered after this call). Enqueues only; no host synchronisation."""
        self._check_alive("SymmetricHeap.quiet")
        if self._comm_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._comm_stream)

    def check_errors(self, fn: str = "SymmetricHeap.check_errors") -> None:
        """Raise ``EpcommTimeoutError`` if a device wait of this heap timed out (host synchronisation), and
        clear the record."""
        rec = self._error.tolist()
        if rec[0] == 0:
            return
        self._error.zero_()
        code, rank, peer, slot, expected, seen, cmp = rec[:7]
        t = self._last_timeout_s
        if code == codes.ERR_WAIT_TIMEOUT:
            cmp_name = next((k for k, v in codes.CMP_CODES.items() if v == cmp), "?")
            raise EpcommTimeoutError(self._wait_message(fn, t, slot, cmp_name, expected, seen))
        if code == codes.ERR_BARRIER_TIMEOUT:
            raise EpcommTimeoutError(self._barrier_message(fn, t, peer, expected, seen))
        what = codes.ERROR_NAMES.get(code, f"device error {code}")
        raise EpcommTimeoutError(f"{fn}: rank {rank}: {what} after {t:g} s waiting on rank {peer}: expected a "
                                 f"flag at {expected} or later, saw {seen}")

    def signal_value(self, slot: int) -> int:
        """This rank's signal ``slot`` as the host reads it now (synchronises; for tests and debugging)."""
        self._signal_addr("SymmetricHeap.signal_value", self.rank, slot)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return int(self._signals(self.rank)[slot])

    def destroy(self, barrier: bool = True) -> None:
        """Release this rank's heap (collective with ``barrier=True``, the default: a device barrier first, so no
        peer still writes into it). Tensors from ``empty()`` keep the memory alive until they are freed."""
        if self._destroyed:
            return
        passed = False  # the barrier passed: every rank is here, so the backing may wait for them again
        try:
            if barrier:
                self.barrier()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            passed = barrier
        finally:
            self._destroyed = True
            self._peer_views.clear()
            self._backing.close(self.group if passed else None)
            self._comm_stream = None

    # ------------------------------------------------------------------------------------------------
    # internals
    # ------------------------------------------------------------------------------------------------
    def _check_alive(self, fn: str) -> None:
        if self._destroyed:
            raise EpcommError(f"{fn}: this SymmetricHeap was destroyed")

    def _check_peer(self, fn: str, peer: int) -> int:
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < self.world_size:
            raise ValueError(f"{fn}: peer={peer!r} must be a rank in [0, {self.world_size})")
        return peer

    @staticmethod
    def _check_choice(fn: str, name: str, value: str, choices: tuple) -> str:
        if value not in choices:
            raise ValueError(f"{fn}: {name}={value!r} must be one of {choices}")
        return value

    def _check_contiguous(self, fn: str, name: str, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != self.device:
            raise ValueError(f"{fn}: {name} is on {t.device}, the heap on {self.device}")
        if not t.is_contiguous():
            raise ValueError(f"{fn}: {name} {tuple(t.shape)} must be contiguous (call .contiguous() first)")

    def _copy_args(self, fn: str, heap_t: torch.Tensor, other: torch.Tensor, peer: int, engine: str) -> tuple:
        """Checks of put/get: ``(peer, nbytes, heap offset of heap_t, engine)``."""
        self._check_alive(fn)
        peer = self._check_peer(fn, peer)
        nbytes = self._check_pair(fn, heap_t, other)
        offset = self._offset_of(heap_t, fn, "dst" if fn.endswith("put") else "src")
        return peer, nbytes, offset, self._check_choice(fn, "engine", engine, _ENGINES)

    def _check_pair(self, fn: str, heap_t: torch.Tensor, other: torch.Tensor) -> int:
        names = ("dst", "src") if fn.endswith("put") else ("src", "dst")
        self._check_contiguous(fn, names[0], heap_t)
        self._check_contiguous(fn, names[1], other)
        a, b = heap_t.numel() * heap_t.element_size(), other.numel() * other.element_size()
        if a != b:
            raise ValueError(f"{fn}: {names[0]} has {a} bytes ({tuple(heap_t.shape)} {heap_t.dtype}), {names[1]} "
                             f"{b} bytes ({tuple(other.shape)} {other.dtype}); they must be the same size")
        return a

    def _offset_of(self, t: torch.Tensor, fn: str, name: str) -> int:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        offset = t.data_ptr() - self._base
        span = t.numel() * t.element_size()
        if t.device != self.device or offset < self.layout.user_off or offset + span > self.layout.total_bytes:
            if t.device == self.device and 0 <= offset < self.layout.user_off:
                raise ValueError(f"{fn}: {name} lies in the heap's control region; use tensors from "
                                 f"SymmetricHeap.empty()")
            raise ValueError(f"{fn}: {name} ({tuple(t.shape)} {t.dtype} on {t.device}) is not in this symmetric "
                             f"heap; allocate it with SymmetricHeap.empty()")
        return offset

    def _signal_addr(self, fn: str, rank: int, slot: int) -> int:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.layout.num_signals:
            raise ValueError(f"{fn}: slot={slot!r} must be in [0, {self.layout.num_signals}) (num_signals)")
        return self._bases[rank] + self.layout.signals_off + 8 * slot

    def _atomics_towards(self, peer: int) -> bool:
        if peer == self.rank:
            return True
        mine, theirs = self._peer_devices[self.rank], self._peer_devices[peer]
        if self.device.type != "cuda":
            return False  # the CPU test backing has no cross-process atomics contract
        if theirs is None or theirs < 0 or theirs >= torch.cuda.device_count():
            log.warning("SymmetricHeap: rank %d's device cuda:%s is not visible from rank %d; assuming no native "
                        "P2P atomics towards it", peer, theirs, self.rank)
            return False
        return p2p_atomics_supported(mine, theirs)

    def _check_signal_op(self, fn: str, op: str, peer: int) -> str:
        op = self._check_choice(fn, "op", op, tuple(codes.SIGNAL_OPS))
        if op == "add" and not self.p2p_atomics[peer]:
            raise TransportUnavailableError(
                f"{fn}: op='add' towards rank {peer} needs native P2P atomics from {self.device} to rank {peer}'s "
                f"device, which this machine does not have (e.g. PCIe); use single-writer slots instead: each "
                f"writer 'set's a growing count into its own slot and the reader waits on each slot")
        return op

    def _timeout(self, fn: str, timeout_s: Optional[float]) -> float:
        t = env.timeout_s() if timeout_s is None else float(timeout_s)
        if not t > 0:
            raise ValueError(f"{fn}: timeout_s={timeout_s!r} must be positive")
        self._last_timeout_s = t
        return t

    def _kernels_usable(self, what: str) -> bool:
        """Whether the Triton kernels run here (GPUs; CPUs under the interpreter). Without Triton on a GPU the
        operations that need them raise."""
        if self._K is not None:
            return True
        if self.device.type == "cuda":
            raise TransportUnavailableError(f"SymmetricHeap: {what} need Triton, which does not import here")
        return False

    def _record_host_error(self, code: int, peer: int, slot: int, expected: int, seen: int, cmp: int) -> None:
        if int(self._error[0]) == 0:
            self._error.copy_(torch.tensor([code, self.rank, peer, slot, expected, seen, cmp, 0], dtype=torch.int64))

    def _raw_signal(self, peer: int, addr: int, value: int, op: str) -> None:
        if self._kernels_usable("device signals"):
            self._K.launch_signal(addr, value, codes.SIGNAL_OPS[op], self.device)
            return
        slots = self._signals(peer)
        slot = (addr - self._bases[peer] - self.layout.signals_off) // 8
        if op == "set":
            slots[slot] = value
        else:
            slots[slot] += value

    def _signals(self, rank: int) -> torch.Tensor:
        return self._peer_bytes(rank, self.layout.signals_off, 8 * self.layout.num_signals).view(torch.int64)

    def _flags(self, rank: int) -> torch.Tensor:
        return self._peer_bytes(rank, self.layout.barrier_off, 8 * self.world_size).view(torch.int64)

    def _peer_bytes(self, peer: int, offset: int, nbytes: int) -> torch.Tensor:
        key = (peer, offset, nbytes)
        v = self._peer_views.get(key)
        if v is None:
            v = self._backing.view(peer, offset, nbytes)
            if len(self._peer_views) >= _PEER_VIEW_CACHE:
                self._peer_views.pop(next(iter(self._peer_views)))
            self._peer_views[key] = v
        return v

    def _issue(self, nonblocking: bool, foreign: Sequence[torch.Tensor]):
        """A context for the body: the current stream (yields 0) or, nonblocking on CUDA, the communication
        stream after the current one (yields 1: the index of the copy-signal counter of that stream)."""
        if nonblocking and self.device.type == "cuda":
            return self._on_comm_stream(foreign)
        return _ON_CURRENT_STREAM

    @contextlib.contextmanager
    def _on_comm_stream(self, foreign: Sequence[torch.Tensor]):
        if self._comm_stream is None:
            self._comm_stream = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        self._comm_stream.wait_stream(current)
        with torch.cuda.stream(self._comm_stream):
            yield 1
        for t in foreign:
            t.record_stream(self._comm_stream)

    def _host_sync(self, fn: str, timeout_s: float) -> None:
        """Wait for the current stream with a deadline (the device waits end by themselves after
        ``timeout_s``; this guards against work queued before them that never ends)."""
        if self.device.type != "cuda":
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        deadline = time.monotonic() + 2 * timeout_s + 10.0
        pause = 2e-5
        while not event.query():
            if time.monotonic() > deadline:
                raise EpcommTimeoutError(f"{fn}: rank {self.rank}: the device did not finish within "
                                         f"{2 * timeout_s + 10.0:g} s; work queued before this call is stuck")
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)

    def _check_mapping(self, nonces: list) -> None:
        """Every peer's identity words, read through this process's mapping, name that peer."""
        for peer in range(self.world_size):
            seen = self._peer_bytes(peer, self.layout.ident_off, 16).view(torch.int64).tolist()
            if seen != [peer, nonces[peer]]:
                raise EpcommError(f"SymmetricHeap: rank {self.rank} reads (rank, nonce) {seen} at rank {peer}'s heap "
                                  f"base {self._bases[peer]:#x}, expected {[peer, nonces[peer]]}: the symmetric "
                                  f"mapping does not point at rank {peer}'s heap (ranks allocated asymmetrically?)")

    def _check_same_everywhere(self, fn: str, item) -> None:
        items = [None] * self.world_size
        dist.all_gather_object(items, item, group=self.group)
        if any(x != items[0] for x in items):
            raise EpcommError(f"{fn}: ranks asked for different allocations (offset, bytes, dtype by rank: {items}); "
                              f"every rank must make the same empty() calls in the same order")

    def _wait_message(self, fn: str, timeout_s: float, slot: int, cmp: str, value: int, seen: int) -> str:
        return (f"{fn}: rank {self.rank} timed out after {timeout_s:g} s waiting for signal slot {slot} "
                f"{codes.CMP_SYMBOLS.get(cmp, cmp)} {value}; the slot holds {seen}")

    def _barrier_message(self, fn: str, timeout_s: float, peer: int, epoch: int, seen: int) -> str:
        return (f"{fn}: rank {self.rank} timed out after {timeout_s:g} s in barrier number {epoch}: rank {peer} has "
                f"not arrived (its flag holds {seen}); the heap's barrier is now out of step, destroy it")

    def __repr__(self) -> str:
        return (f"SymmetricHeap(rank={self.rank}, world_size={self.world_size}, device={self.device}, "
                f"nbytes={self.nbytes}, used={self.used_bytes}{', destroyed' if self._destroyed else ''})")


def _int64(v: int) -> int:
    """``v`` wrapped to a signed 64-bit integer (what the device's int64 arithmetic gives)."""
    return (v + (1 << 63)) % (1 << 64) - (1 << 63)


def _kernels_module(device: torch.device):
    """``epcomm.kernels.shmem`` when its kernels can run on ``device`` (CUDA with Triton; the CPU only under the
    Triton interpreter), else None."""
    if not triton_available():
        return None
    from ..kernels import shmem as K

    return K if device.type == "cuda" or K.interpreted() else None
