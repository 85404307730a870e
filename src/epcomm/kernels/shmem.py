"""One-sided (NVSHMEM-style) device helpers and the kernels behind ``epcomm.shmem``.

Everything here addresses memory through raw 64-bit addresses: a rank's symmetric heap is mapped into every
process of the group, so a peer's copy of a heap object is ``peer_base[peer] + offset`` (see
``epcomm.shmem.SymmetricHeap``). ``addr_to_ptr`` turns such an int64 into a typed Triton pointer. Nothing in
this module talks to ``torch.distributed``.

Memory-ordering rules (PTX memory model, system scope because the observer is another GPU):

* **Data, then flag.** A producer writes payload with ordinary (weak) stores, possibly from every thread
  of several programs, then raises a flag that a consumer on another GPU polls. Ordinary stores are not
  ordered with respect to other threads' stores, so the producer must, in this order:
  1. ``fence_sys()`` in every thread that wrote payload (``fence.acq_rel.sys``: this thread's earlier
     writes are ordered before its later ones for every observer in the system);
  2. ``tl.debug_barrier()`` (``bar.sync``), so the thread that raises the flag has observed every other
     thread's fenced writes;
  3. raise the flag with a **release** at system scope (``st_release`` or ``atomic_add_release``). Release
     is cumulative: it publishes everything the releasing thread has observed, i.e. the whole program's
     payload.
  Payload written by *several programs* is published by the last one to arrive (``arrive_last``): each
  program fences and arrives on a device-local counter with acq_rel (GPU scope); the program that sees the
  count complete has therefore observed all payload and releases the flag at system scope.
* **Flag, then data.** The consumer polls with an **acquire** load at system scope, ``ld_acquire``: thread 0
  of the program executes ``ld.acquire.sys.global`` (inline PTX) and a reduction over the program's threads
  hands the value to all of them (the poll is uniform, see below). Once thread 0 sees the expected value,
  every write the producer released before the flag is visible to it; the program's other threads are
  ordered after that acquire by a block barrier (``bar.sync``, which synchronises the threads of a program in
  the PTX memory model: acquire by thread 0, barrier, then their reads). The barrier is explicit: every wait
  helper (``wait_until``, ``wait_after``, ``wait_all_ge``) ends with ``tl.debug_barrier()``, once per wait and
  not per poll; code that reads published data after a bare ``ld_acquire`` issues it itself. Later kernels
  on the consumer's stream see the data too (kernel boundary).
* **Flag inside the data.** For small transfers the flag can travel with the data instead: each 4-byte word
  travels in the 8-byte line ``epoch << 32 | word``, stored with ``st_relaxed`` (one ``st.relaxed.sys.global.b64``
  per line: a strong store, single-copy atomic towards any observer) and polled with ``volatile`` loads
  (``ld.volatile``, which the PTX memory model treats as relaxed loads at system scope, and which bypass L1).
  Both sides being strong, the race on a line is not a data race: the consumer sees either the old line or
  the whole new one, and polls until every line of its block carries the epoch. No fence, release or acquire
  is needed (each line is its own flag), at the price of twice the bytes (NCCL's LL protocol). Lines of
  consecutive calls alternate between two buffers so that a writer never overwrites lines still being read.
* **Uniform polls.** A poll loop's condition must have the same value in every thread of the program:
  Triton places ``bar.sync`` inside reductions and scalar atomics, and threads that left a loop at
  different iterations would deadlock there. ``ld_acquire`` (one thread loads, a reduction broadcasts),
  ``now`` and ``wait_all_ge`` (per-thread reads, then a reduction over every thread) are uniform; never branch
  on a per-thread inline-PTX load without such a reduction.
* **Who writes which flag.** Every flag has exactly one writer unless it is incremented with
  ``atomic_add_release`` (remote atomics need native P2P atomics: ``epcomm.shmem.p2p_atomics_supported``).
  Single-writer flags hold epochs that grow by one per call, so they never need to be reset and are safe to
  replay in a CUDA graph: the epoch lives in device memory, it is not a constant baked in at capture.
* **Epochs wrap.** An int64 epoch cannot wrap in practice (2**63 calls), but a tagged word carries only the
  low 32 bits of its epoch (``epoch << 32 | value``), which change sign after 2**31 calls and wrap after
  2**32: at two calls per MoE layer and step, days to weeks of serving. Epochs and tagged words are therefore
  never compared with ``>=``: every such comparison is a signed difference (``CMP_AFTER``, ``wait_after``,
  ``wait_all_ge``: ``(v - value) >= 0`` in the word's width), which is right across any wrap as long as the two
  values are less than half the range apart (the protocols keep a flag within a few calls of what its reader
  expects), and the parity of an epoch is ``e & 1`` (``%`` of a wrapped, negative epoch is negative). A test
  hook starts a transport's epochs near a wrap (``_start_epochs`` of the transports and of ``SymmetricHeap``).
* **Kernel boundaries.** A kernel's writes are complete when it ends; a later kernel on the same stream
  sees them. Kernels that start by releasing a flag (``signal``, ``barrier``) issue ``fence_sys()`` first
  so that the release also covers what earlier kernels on the stream wrote to peers.
* **No wait without an end.** Every poll loop times out from a start time its own program takes (``now()``,
  ``%globaltimer``), records an error naming the rank, the peer and what it waited for (``record_error``) and
  lets the program finish, so that every kernel terminates. A program waits only for flags written by other
  launches (other ranks, earlier kernels of its stream), unless its kernel is launched cooperatively with a
  grid that fits the GPU at once (``epcomm.kernels.launch``, "Co-residency"): with another kernel holding SMs,
  a program of the same launch that it waits for might otherwise never be scheduled.

CPU testing: under the Triton interpreter (``TRITON_INTERPRET=1``) inline PTX and ``globaltimer`` do not
exist, so the helpers that need them take ``USE_PTX`` / ``USE_TIMER`` constexprs. Launchers set both from
the device of the data (CUDA: True; CPU, i.e. the interpreter: False). Without PTX the release store is an
atomic exchange with release semantics and the fence is skipped (the interpreter is sequential); without
the timer a timeout counts polls instead of nanoseconds. The interpreter runs a launch's programs one after another, so no
kernel here ever makes one program wait for another program of the same launch: cross-program
completion is detected with ``arrive_last`` (the last program to arrive acts) and waits only ever target
flags written by other ranks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as _cuda_ext

from .launch import cdiv, launch, next_pow2
from .shmem_codes import (CMP_AFTER, CMP_CODES, CMP_EQ, CMP_GE, CMP_GT, CMP_LE, CMP_LT, CMP_NE,  # noqa: F401
                           ERR_BARRIER_TIMEOUT, ERR_DONE_TIMEOUT, ERR_READY_TIMEOUT, ERR_WAIT_TIMEOUT, ERROR_NAMES,
                           ERROR_WORDS, SIGNAL_ADD, SIGNAL_SET)

# jitted code may only read globals that are tl.constexpr
_K_ERR_WAIT = tl.constexpr(ERR_WAIT_TIMEOUT)
_K_ERR_BARRIER = tl.constexpr(ERR_BARRIER_TIMEOUT)
_K_ERR_READY = tl.constexpr(ERR_READY_TIMEOUT)
_K_ERR_DONE = tl.constexpr(ERR_DONE_TIMEOUT)
_K_CMP_GE = tl.constexpr(CMP_GE)
_K_CMP_AFTER = tl.constexpr(CMP_AFTER)

# Under the interpreter a timeout counts polls. One poll there costs about 1-4 ms of Python, so a timeout is
# only approximate in that mode (about as long as asked, up to a few times longer).
INTERPRETER_SECONDS_PER_POLL = 1e-3


# ---------------------------------------------------------------------------------------------------------
# Device helpers (import these from other kernels)
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def addr_to_ptr(addr, DTYPE: tl.constexpr):
    """int64 address (scalar or tensor) -> pointer to ``DTYPE``."""
    return addr.to(tl.pointer_type(DTYPE))


@triton.jit
def peer_ptr(bases_ptr, peer, byte_offset, DTYPE: tl.constexpr):
    """Pointer to ``DTYPE`` at ``byte_offset`` in ``peer``'s heap; ``bases_ptr`` is the int64 ``[R]`` table
    of heap base addresses (``SymmetricHeap.peer_bases``). ``peer`` may be a scalar or a tensor."""
    base = tl.load(bases_ptr + peer)
    return (base + byte_offset).to(tl.pointer_type(DTYPE))


@triton.jit
def fence_sys(USE_PTX: tl.constexpr):
    """``fence.acq_rel.sys`` in every thread: its earlier writes are ordered before its later memory
    operations for every observer, peer GPUs included. No-op in the interpreter (sequential there)."""
    if USE_PTX:
        tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def ld_acquire(ptr, USE_PTX: tl.constexpr):
    """Acquire load at system scope of a scalar int32/int64 flag, the same value in every thread of the program.

    With ``USE_PTX``: thread 0 alone executes ``ld.acquire.sys.global`` (the others take 0) and a sum over the
    program's threads hands its value to every thread (a reduction: shuffles inside each warp, shared memory and
    ``bar.sync`` across warps); without (the interpreter), an atomic add of 0 with acquire semantics. The value
    is uniform, so poll loops built on it leave together (module docstring, "Uniform polls"). Reads that thread
    0 makes afterwards see everything the flag's writer released before storing the value; the other threads'
    reads are ordered after the acquire only by a block barrier: call ``tl.debug_barrier()`` before reading
    published data (the wait helpers end with one)."""
    if USE_PTX:
        lanes = tl.zeros([_cuda_ext.num_threads()], tl.int32)  # one element per thread: no replicas
        if ptr.dtype.element_ty.primitive_bitwidth == 64:
            v = tl.inline_asm_elementwise(
                "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; mov.b64 $0, 0; "
                "@p ld.acquire.sys.global.b64 $0, [$1]; }", "=l,l", [ptr + lanes], dtype=tl.int64, is_pure=False,
                pack=1)
        else:
            v = tl.inline_asm_elementwise(
                "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; mov.b32 $0, 0; "
                "@p ld.acquire.sys.global.b32 $0, [$1]; }", "=r,l", [ptr + lanes], dtype=tl.int32, is_pure=False,
                pack=1)
        value = tl.sum(v, axis=0)
    else:
        value = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
    return value


@triton.jit
def st_release(ptr, value, USE_PTX: tl.constexpr):
    """Release store at system scope of an int32/int64 flag (scalar or tensor of pointers). A plain store,
    not an atomic, so it works towards peers without native P2P atomics. Every thread that holds the
    element stores the same value (harmless); publish multi-thread payload with fence_sys +
    tl.debug_barrier first (see the module docstring)."""
    if USE_PTX:
        if ptr.dtype.element_ty.primitive_bitwidth == 64:
            tl.inline_asm_elementwise("st.release.sys.global.b64 [$1], $2; mov.u32 $0, 0;", "=r,l,l",
                                      [ptr, tl.cast(value, tl.int64)], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise("st.release.sys.global.b32 [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                                      [ptr, tl.cast(value, tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.atomic_xchg(ptr, value, sem="release", scope="sys")


@triton.jit
def st_relaxed(ptrs, values, mask, USE_PTX: tl.constexpr):
    """Store the int64 ``values`` at ``ptrs`` (tensors) where ``mask``: with ``USE_PTX`` one strong
    ``st.relaxed.sys.global.b64`` per element, single-copy atomic towards a concurrent reader on any GPU (the lines
    of "Flag inside the data" in the module docstring); a plain store in the interpreter (sequential)."""
    if USE_PTX:
        tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.s32 p, $3, 0; @p st.relaxed.sys.global.b64 [$1], $2; } "
                                  "mov.u32 $0, 0;", "=r,l,l,r", [ptrs, tl.cast(values, tl.int64),
                                                                 mask.to(tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptrs, values, mask=mask)


@triton.jit
def atomic_add_release(ptr, value):
    """``*ptr += value`` as one atomic with release semantics at system scope; returns the old value. On a
    peer's memory this needs native P2P atomics (NVLink); a scalar atomic is executed by one thread."""
    return tl.atomic_add(ptr, value, sem="release", scope="sys")


@triton.jit
def signal_flag(flag_addr, value, SIGNAL_OP: tl.constexpr, USE_PTX: tl.constexpr):
    """Fence (system scope), then release ``value`` into (SIGNAL_SET) or onto (SIGNAL_ADD) the int64 flag at
    address ``flag_addr``: everything this thread wrote or observed before is visible to whoever acquires
    the new value. Callers publishing other threads' writes sync with them first (tl.debug_barrier)."""
    fence_sys(USE_PTX)
    flag = addr_to_ptr(flag_addr, tl.int64)
    if SIGNAL_OP == 0:
        st_release(flag, value, USE_PTX)
    else:
        atomic_add_release(flag, value)


@triton.jit
def compare(v, cmp, value):
    """``v <cmp> value`` for the runtime comparison code ``cmp`` (CMP_EQ .. CMP_LE, or CMP_AFTER: ``v`` at or
    after ``value`` in wrap-around order, a signed difference in the values' width)."""
    return tl.where(cmp == 0, v == value,
                    tl.where(cmp == 1, v != value,
                             tl.where(cmp == 2, v > value,
                                      tl.where(cmp == 3, v >= value,
                                               tl.where(cmp == 4, v < value,
                                                        tl.where(cmp == 5, v <= value, (v - value) >= 0))))))


@triton.jit
def now(USE_TIMER: tl.constexpr):
    """GPU nanosecond clock (``%globaltimer``), the same value in every thread (the latest of their reads,
    through a reduction), or 0 without a timer (interpreter). Threads of different warps read the clock at
    different moments; a timeout decided on unequal values would split the program's control flow."""
    if USE_TIMER:
        lanes = tl.zeros([_cuda_ext.num_threads()], tl.int64)  # one element per thread: no replicas
        t = tl.max(tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,l", [lanes], dtype=tl.int64,
                                             is_pure=False, pack=1), axis=0)
    else:
        t = tl.full([], 0, tl.int64)
    return t


@triton.jit
def expired(t0, polls, timeout, USE_TIMER: tl.constexpr):
    """1 once a wait that started at ``t0`` (``now()``) has run past ``timeout`` (ns with the timer, read every
    64 polls; else ``polls`` against a poll budget), else 0. Uniform across the program's threads."""
    e = tl.full([], 0, tl.int32)
    if USE_TIMER:
        if polls % 64 == 0:
            e = ((now(USE_TIMER) - t0) > timeout).to(tl.int32)
    else:
        e = (polls >= timeout).to(tl.int32)
    return e


@triton.jit
def record_error(err_ptr, code, rank, peer, slot, expected, seen, cmp):
    """Claim the int64 error record at ``err_ptr`` (first error wins, via compare-and-swap on word 0) and
    fill it: ``[code, rank, peer, slot, expected, seen, cmp, 0]``."""
    old = tl.atomic_cas(err_ptr, tl.cast(0, tl.int64), tl.cast(code, tl.int64), sem="acq_rel", scope="gpu")
    if old == 0:
        tl.store(err_ptr + 1, tl.cast(rank, tl.int64))
        tl.store(err_ptr + 2, tl.cast(peer, tl.int64))
        tl.store(err_ptr + 3, tl.cast(slot, tl.int64))
        tl.store(err_ptr + 4, tl.cast(expected, tl.int64))
        tl.store(err_ptr + 5, tl.cast(seen, tl.int64))
        tl.store(err_ptr + 6, tl.cast(cmp, tl.int64))


@triton.jit
def wait_until(ptr, cmp, value, timeout, err_ptr, err_code, rank, peer, slot, USE_PTX: tl.constexpr,
               USE_TIMER: tl.constexpr):
    """Poll the scalar int32/int64 flag at ``ptr`` (``ld_acquire``: acquire, system scope) until ``*ptr <cmp>
    value`` (``CMP_AFTER`` for epochs: wrap-safe).

    ``timeout``: nanoseconds of ``%globaltimer`` with ``USE_TIMER``, else a number of polls; the clock starts when
    this program starts waiting. On expiry the error record at ``err_ptr`` gets ``[err_code, rank, peer, slot,
    value, last value seen, cmp]`` and the helper returns 0 instead of hanging; it returns 1 when the condition
    held. Every thread of the program runs it and sees the same values (``ld_acquire`` and ``now`` are uniform),
    so all leave the loop together; it ends with a block barrier, which orders every thread's later reads after
    the acquire."""
    seen = ld_acquire(ptr, USE_PTX)
    ok = compare(seen, cmp, value).to(tl.int32)
    t0 = now(USE_TIMER)
    polls = tl.full([], 0, tl.int64)
    late = tl.full([], 0, tl.int32)
    while (ok == 0) & (late == 0):
        seen = ld_acquire(ptr, USE_PTX)
        ok = compare(seen, cmp, value).to(tl.int32)
        polls += 1
        late = expired(t0, polls, timeout, USE_TIMER)
    if ok == 0:
        record_error(err_ptr, err_code, rank, peer, slot, value, seen, cmp)
    tl.debug_barrier()  # the acquire's block barrier (module docstring, "Flag, then data")
    return ok


@triton.jit
def wait_after(ptr, value, timeout, err_ptr, err_code, rank, peer, slot, USE_PTX: tl.constexpr,
               USE_TIMER: tl.constexpr):
    """Wait until the scalar int64 word at ``ptr`` is at or after ``value`` in wrap-around order (``CMP_AFTER``);
    one acquire load when it already is. Returns the word's last value seen (uniform), which is before ``value``
    only after a timeout (recorded as ``wait_until`` does). Ends with a block barrier."""
    seen = ld_acquire(ptr, USE_PTX).to(tl.int64)
    if (seen - value) < 0:
        t0 = now(USE_TIMER)
        polls = tl.full([], 0, tl.int64)
        late = tl.full([], 0, tl.int32)
        while ((seen - value) < 0) & (late == 0):
            seen = ld_acquire(ptr, USE_PTX).to(tl.int64)
            polls += 1
            late = expired(t0, polls, timeout, USE_TIMER)
        if (seen - value) < 0:
            record_error(err_ptr, err_code, rank, peer, slot, value, seen, _K_CMP_AFTER)
    tl.debug_barrier()  # the acquire's block barrier (module docstring, "Flag, then data")
    return seen


@triton.jit
def wait_all_ge(base, flags_off, world, value, timeout, err_ptr, err_code, rank, R_POW2: tl.constexpr,
                USE_PTX: tl.constexpr, USE_TIMER: tl.constexpr):
    """Wait until the int64 epoch flags ``[world]`` at ``base + flags_off`` (this rank's heap) are all at or after
    ``value`` in wrap-around order (``(flag - value) >= 0``, ``CMP_AFTER``), every flag read in each poll: each
    thread acquire-loads flag ``thread % R_POW2`` and the smallest difference over all threads (a reduction across
    the program's warps, so the same in every thread) decides; one memory round trip per poll. Timeout and error
    record as ``wait_until`` (``peer``: the first flag still before ``value``, ``slot`` -1). Returns 1, or 0 after
    the timeout. Ends with a block barrier (each thread acquired one flag; the barrier orders its later reads
    after every thread's acquire)."""
    if USE_PTX:
        lanes = tl.arange(0, _cuda_ext.num_threads()) % R_POW2  # one element per thread
    else:
        lanes = tl.arange(0, R_POW2)
    live = lanes < world
    ptrs = (base + flags_off + tl.where(live, lanes, 0) * 8).to(tl.pointer_type(tl.int64))
    big = tl.full([], 1 << 62, tl.int64)
    lag = tl.min(tl.where(live, _ld_acquire_lanes(ptrs, USE_PTX) - value, big), axis=0)
    ok = (lag >= 0).to(tl.int32)
    t0 = now(USE_TIMER)
    polls = tl.full([], 0, tl.int64)
    late = tl.full([], 0, tl.int32)
    while (ok == 0) & (late == 0):
        lag = tl.min(tl.where(live, _ld_acquire_lanes(ptrs, USE_PTX) - value, big), axis=0)
        ok = (lag >= 0).to(tl.int32)
        polls += 1
        late = expired(t0, polls, timeout, USE_TIMER)
    if ok == 0:
        d = tl.where(live, _ld_acquire_lanes(ptrs, USE_PTX) - value, big)
        peer = tl.min(tl.where(d < 0, lanes, R_POW2), axis=0)
        record_error(err_ptr, err_code, rank, peer, -1, value, value + tl.min(tl.where(lanes == peer, d, big), axis=0),
                     _K_CMP_AFTER)
    tl.debug_barrier()  # the acquires' block barrier (module docstring, "Flag, then data")
    return ok


@triton.jit
def _ld_acquire_lanes(ptrs, USE_PTX: tl.constexpr):
    """Per-element acquire load (system scope) of int64 flags; each thread gets its own elements' values, so
    callers reduce over all threads before branching on them (``wait_all_ge``)."""
    if USE_PTX:
        v = tl.inline_asm_elementwise("ld.acquire.sys.global.b64 $0, [$1];", "=l,l", [ptrs], dtype=tl.int64,
                                      is_pure=False, pack=1)
    else:
        v = tl.atomic_add(ptrs, 0, sem="acquire", scope="sys")
    return v


@triton.jit
def arrive_last(counter_ptr, total):
    """Count this program as done on the int32 counter at ``counter_ptr`` (device-local, starts at 0) and
    return 1 in the program that completes the count of ``total`` (0 in the others). That program also
    resets the counter to 0, so the same counter serves the next launch and CUDA-graph replays. Callers
    fence their writes first (fence_sys + tl.debug_barrier) when the last program publishes them."""
    old = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = (old == total - 1).to(tl.int32)
    if last != 0:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def barrier_enter(bases_ptr, flags_off, epoch, err_ptr, rank, world, timeout, err_code,
                  R_POW2: tl.constexpr, USE_PTX: tl.constexpr, USE_TIMER: tl.constexpr):
    """The two steps of ``block_barrier`` for a caller that keeps the epoch itself: release ``epoch`` into slot
    ``rank`` of every peer's flags, then acquire-poll the local flags until all are at ``epoch`` or later
    (``wait_all_ge``, wrap-safe). Any number of programs of one launch may call it with the same ``epoch`` (they
    store the same value, so every slot still has one writing rank); the caller stores the new epoch once all of
    them have passed (e.g. in the last program of ``arrive_last``). Returns 1, or 0 after a timeout."""
    fence_sys(USE_PTX)
    tl.debug_barrier()
    peers = tl.arange(0, R_POW2)
    live = peers < world
    safe_peers = tl.where(live, peers, rank)  # spare lanes repeat this rank's own slot (same value)
    remote = peer_ptr(bases_ptr, safe_peers, flags_off + rank * 8, tl.int64)
    st_release(remote, tl.zeros([R_POW2], tl.int64) + epoch, USE_PTX)
    return wait_all_ge(tl.load(bases_ptr + rank), flags_off, world, epoch, timeout, err_ptr, err_code, rank, R_POW2,
                       USE_PTX, USE_TIMER)


@triton.jit
def block_barrier(bases_ptr, flags_off, epoch_ptr, err_ptr, rank, world, timeout, err_code,
                  R_POW2: tl.constexpr, USE_PTX: tl.constexpr, USE_TIMER: tl.constexpr):
    """Barrier of one program per rank across all ``world`` ranks; returns 1, or 0 after a timeout.

    ``flags_off``: byte offset in every heap of ``int64[world]`` arrival flags; slot ``r`` is written only by
    rank ``r`` (single writer, no atomics). ``epoch_ptr``: this rank's int64 barrier counter (local device
    memory, starts at 0). Each call: epoch += 1, release-store the epoch into slot ``rank`` of every peer's
    flags, then acquire-poll the local flags until all are at epoch or later (``barrier_enter``). Epochs only grow, so
    no flag is ever reset and replays of a captured CUDA graph keep working. Orders this program's earlier
    writes (and those of earlier kernels on the stream) before every peer's later reads. Only one program of
    a launch may call it with a given (flags_off, epoch_ptr)."""
    epoch = tl.load(epoch_ptr) + 1
    ok = barrier_enter(bases_ptr, flags_off, epoch, err_ptr, rank, world, timeout, err_code, R_POW2, USE_PTX,
                       USE_TIMER)
    tl.store(epoch_ptr, epoch)
    return ok


@triton.jit
def copy_bytes(src_addr, dst_addr, nbytes, pid, nprog, BLOCK: tl.constexpr, ALIGNED16: tl.constexpr):
    """Copy ``nbytes`` from address ``src_addr`` to ``dst_addr`` (int64; either may be a peer's), shared by
    programs ``pid`` of ``nprog``: program p copies blocks p, p + nprog, ... of ``BLOCK`` bytes.

    ``ALIGNED16``: both addresses are multiples of 16 (caller's promise). The body then moves 16-byte
    vectors (int32 x 4 per thread, no masks) and the last < 16 bytes go byte by byte; otherwise every byte
    is moved on its own (correct, slow). Plain stores: publish with fence_sys/arrive_last/st_release.
    ``src_addr``/``dst_addr`` must be int64 values (not pointers): the alignment hint is attached to the
    int-to-pointer casts made here."""
    n = tl.cast(nbytes, tl.int64)  # tl.cast, not .to(): Triton turns an int argument equal to 1 into a constant
    if ALIGNED16:
        WORDS: tl.constexpr = BLOCK // 4
        # the alignment hint goes on the int->pointer casts: Triton does not carry an int argument's
        # divisibility through the cast, and without it every access would be a 4-byte one
        src_w = tl.multiple_of(src_addr.to(tl.pointer_type(tl.int32)), 16)
        dst_w = tl.multiple_of(dst_addr.to(tl.pointer_type(tl.int32)), 16)
        n_words = (n // 16) * 4
        offs = tl.arange(0, WORDS)
        num_full = n_words // WORDS
        blk = pid.to(tl.int64)
        while blk < num_full:  # a while loop: the interpreter cannot run range() over tensors
            o = blk * WORDS + offs
            tl.store(dst_w + o, tl.load(src_w + o))
            blk += nprog
        if pid == (num_full % nprog):
            o = num_full * WORDS + offs
            m = o < n_words
            tl.store(dst_w + o, tl.load(src_w + o, mask=m), mask=m)
            tail = tl.arange(0, 16)
            ob = n_words * 4 + tail
            mb = ob < n
            src_b = src_addr.to(tl.pointer_type(tl.uint8))
            dst_b = dst_addr.to(tl.pointer_type(tl.uint8))
            tl.store(dst_b + ob, tl.load(src_b + ob, mask=mb), mask=mb)
    else:
        src_b = src_addr.to(tl.pointer_type(tl.uint8))
        dst_b = dst_addr.to(tl.pointer_type(tl.uint8))
        offs = tl.arange(0, BLOCK)
        num_blocks = tl.cdiv(n, BLOCK)
        blk = pid.to(tl.int64)
        while blk < num_blocks:
            o = blk * BLOCK + offs
            m = o < n
            tl.store(dst_b + o, tl.load(src_b + o, mask=m), mask=m)
            blk += nprog


# ---------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["nbytes", "sig_value"])
def _copy_kernel(src_addr, dst_addr, nbytes, sig_addr, sig_value, counter_ptr, BLOCK: tl.constexpr,
                 ALIGNED16: tl.constexpr, HAS_SIGNAL: tl.constexpr, SIGNAL_OP: tl.constexpr,
                 USE_PTX: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    copy_bytes(src_addr, dst_addr, nbytes, pid, nprog, BLOCK, ALIGNED16)
    if HAS_SIGNAL:
        # data, then flag: every thread fences its stores, the block syncs, the last program releases.
        fence_sys(USE_PTX)
        tl.debug_barrier()
        if arrive_last(counter_ptr, nprog) != 0:
            signal_flag(sig_addr, sig_value, SIGNAL_OP, USE_PTX)


@triton.jit(do_not_specialize=["value"])
def _signal_kernel(sig_addr, value, SIGNAL_OP: tl.constexpr, USE_PTX: tl.constexpr):
    signal_flag(sig_addr, value, SIGNAL_OP, USE_PTX)


@triton.jit
def _mirror_words(src_ptr, dst_addr, n, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    live = offs < n
    tl.store(addr_to_ptr(dst_addr, DTYPE) + offs, tl.load(src_ptr + offs, mask=live, volatile=True), mask=live)


@triton.jit
def mirror_kernel(src_ptr, dst_addr, n, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    """Store the ``n`` words at ``src_ptr`` (device memory) to the pinned host memory at ``dst_addr`` (its address,
    which the device reaches through unified addressing): a host copy refreshed in stream order by a kernel, which
    costs the stream far less than a device-to-host copy (measured on 2xH200: 10-15 us per copy)."""
    _mirror_words(src_ptr, dst_addr, n, DTYPE, BLOCK)


@triton.jit
def mirror2_kernel(src_ptr, dst_addr, n, src2_ptr, dst2_addr, n2, DTYPE: tl.constexpr, BLOCK: tl.constexpr,
                   DTYPE2: tl.constexpr, BLOCK2: tl.constexpr):
    """``mirror_kernel`` of two word arrays in one launch (the two legs of a hierarchical Buffer: one launch of host
    time per call fewer)."""
    _mirror_words(src_ptr, dst_addr, n, DTYPE, BLOCK)
    _mirror_words(src2_ptr, dst2_addr, n2, DTYPE2, BLOCK2)


def launch_mirror(src, dst, src2=None, dst2=None) -> None:
    """``mirror_kernel`` from the 1-D device tensor ``src`` into the pinned host tensor ``dst`` (same dtype); with
    ``src2``/``dst2``, ``mirror2_kernel`` of both pairs."""
    from triton.language import int32, int64

    def words(t):
        n = t.numel()
        return n, int64 if t.element_size() == 8 else int32, max(16, next_pow2(n))

    n, dtype, block = words(src)
    if src2 is None:
        launch(mirror_kernel, (1,), src, dst.data_ptr(), n, DTYPE=dtype, BLOCK=block, num_warps=1)
        return
    n2, dtype2, block2 = words(src2)
    launch(mirror2_kernel, (1,), src, dst.data_ptr(), n, src2, dst2.data_ptr(), n2, DTYPE=dtype, BLOCK=block,
           DTYPE2=dtype2, BLOCK2=block2, num_warps=1)


@triton.jit(do_not_specialize=["value", "timeout", "slot"])
def _wait_kernel(sig_addr, cmp, value, timeout, err_ptr, rank, slot, USE_PTX: tl.constexpr, USE_TIMER: tl.constexpr):
    wait_until(addr_to_ptr(sig_addr, tl.int64), cmp, value, timeout, err_ptr, _K_ERR_WAIT, rank, -1, slot, USE_PTX,
               USE_TIMER)


@triton.jit(do_not_specialize=["timeout"])
def _barrier_kernel(bases_ptr, flags_off, epoch_ptr, err_ptr, rank, world, timeout, R_POW2: tl.constexpr,
                    USE_PTX: tl.constexpr, USE_TIMER: tl.constexpr):
    block_barrier(bases_ptr, flags_off, epoch_ptr, err_ptr, rank, world, timeout, _K_ERR_BARRIER, R_POW2,
                  USE_PTX, USE_TIMER)


@triton.jit(do_not_specialize=["timeout"])
def _allgather_kernel(bases_ptr, src_addr, out_off, shard_bytes, ready_off, done_off, state_ptr, err_ptr,
                      rank, world, timeout, BLOCK: tl.constexpr, ALIGNED16: tl.constexpr, R_POW2: tl.constexpr,
                      USE_PTX: tl.constexpr, USE_TIMER: tl.constexpr):
    """Grid (P, R). Program (p, j) copies its share of the local shard into row ``rank`` of the gathered
    output of rank ``(rank + j) % R`` (j = 0: the local copy). ``state_ptr``: int64[2] local
    [epoch, arrival counter]. Protocol of call number e (e = epoch + 1, read at program start):
      1. every program release-stores e into ``ready[rank]`` of every peer: "my previous result has been
         consumed, you may write call e" (a rank reaches this kernel only after its stream finished the
         kernels that read the previous result);
      2. program (p, j != 0) waits until ``ready[dst] >= e`` in its own heap, then copies;
      3. all programs fence and arrive; the last one stores epoch = e, release-stores e into ``done[rank]``
         of every peer and waits until its own ``done[q] >= e`` for every q.
    Every flag has one writer (its index), epochs only grow: graph-replay safe, no remote atomics."""
    pid = tl.program_id(0)
    j = tl.program_id(1)
    nprog = tl.num_programs(0)
    e = tl.load(state_ptr) + 1
    peers = tl.arange(0, R_POW2)
    live = peers < world
    safe_peers = tl.where(live, peers, rank)
    ready_remote = peer_ptr(bases_ptr, safe_peers, ready_off + rank * 8, tl.int64)
    st_release(ready_remote, tl.zeros([R_POW2], tl.int64) + e, USE_PTX)
    dst = (rank + j) % world
    base_local = tl.load(bases_ptr + rank)
    ok = tl.full([], 1, tl.int32)
    if j != 0:
        ready_local = (base_local + ready_off + dst * 8).to(tl.pointer_type(tl.int64))
        ok = wait_until(ready_local, _K_CMP_AFTER, e, timeout, err_ptr, _K_ERR_READY, rank, dst, -1, USE_PTX,
                        USE_TIMER)
    if ok != 0:
        dst_addr = tl.load(bases_ptr + dst) + out_off + tl.cast(rank, tl.int64) * shard_bytes
        copy_bytes(src_addr, dst_addr, shard_bytes, pid, nprog, BLOCK, ALIGNED16)
    fence_sys(USE_PTX)
    tl.debug_barrier()
    if arrive_last(state_ptr + 1, nprog * world) != 0:
        fence_sys(USE_PTX)
        tl.store(state_ptr, e)
        done_remote = peer_ptr(bases_ptr, safe_peers, done_off + rank * 8, tl.int64)
        st_release(done_remote, tl.zeros([R_POW2], tl.int64) + e, USE_PTX)
        wait_all_ge(base_local, done_off, world, e, timeout, err_ptr, _K_ERR_DONE, rank, R_POW2, USE_PTX, USE_TIMER)


@triton.jit(do_not_specialize=["timeout"])
def _allgather_lines_kernel(bases_ptr, src_addr, out_addr, shard_bytes, stage_off, slot_words, state_ptr, err_ptr,
                            rank, world, timeout, BLOCK: tl.constexpr, VEC: tl.constexpr, USE_PTX: tl.constexpr,
                            USE_TIMER: tl.constexpr):
    """All-gather of small shards (``shard_bytes`` a multiple of 4, both addresses 4-byte aligned) with the
    flag inside the data: every 4-byte word travels as one 8-byte line ``e << 32 | word`` (``e``: the call's
    epoch), see "Flag inside the data" in the module docstring. No fence, no flag, no handshake.

    Grid (P, R). ``stage_off``: byte offset in every heap of the staging lines, int64 ``[2, R, slot_words]``
    (slot ``e & 1``, row = the writing rank). Program (p, j != 0) stores its share of the shard as lines
    (``st_relaxed``) into row ``rank`` of slot ``e & 1`` of rank ``(rank + j) % R``, then polls its share of row
    ``(rank - j) % R`` of its own staging until every line carries ``e`` and writes the words into that row
    of ``out_addr`` (this rank's output, ``[R, shard_bytes]``); program (p, 0) copies the own shard into
    ``out_addr`` directly. ``VEC``: ``src_addr``, ``out_addr`` and ``shard_bytes`` are multiples of 16 (16-byte
    accesses); the staging rows always are (``stage_off`` a multiple of 16, ``slot_words`` even).
    ``state_ptr``: int64[2] local [epoch, arrival counter]; the last program to finish
    stores the epoch. Two slots suffice: a rank writes call e + 2 into slot e & 1 only after its call e + 1
    has finished, i.e. after every rank's lines of call e + 1 arrived, which a rank writes only once its own
    stream has left call e (its reads of slot e & 1). Lines match the epoch's low 32 bits exactly, so epochs may
    wrap. Epochs only grow: graph-replay safe."""
    pid = tl.program_id(0)
    j = tl.program_id(1)
    nprog = tl.num_programs(0)
    e = tl.load(state_ptr) + 1
    n_words = tl.cast(shard_bytes, tl.int64) // 4
    offs = tl.arange(0, BLOCK)
    src_w = src_addr.to(tl.pointer_type(tl.int32))
    if VEC:
        src_w = tl.multiple_of(src_w, 16)
    if j == 0:
        own = (out_addr + tl.cast(rank, tl.int64) * shard_bytes).to(tl.pointer_type(tl.int32))
        if VEC:
            own = tl.multiple_of(own, 16)
        blk = pid.to(tl.int64)
        while blk * BLOCK < n_words:
            o = blk * BLOCK + offs
            m = o < n_words
            tl.store(own + o, tl.load(src_w + o, mask=m), mask=m)
            blk += nprog
    else:
        slot = (e & 1) * world
        dst = (rank + j) % world
        row = tl.multiple_of((tl.load(bases_ptr + dst) + stage_off + (slot + rank) * slot_words * 8).to(
            tl.pointer_type(tl.int64)), 16)
        tag = e << 32
        low = tl.full([], 0xFFFFFFFF, tl.int64)
        blk = pid.to(tl.int64)
        while blk * BLOCK < n_words:
            o = blk * BLOCK + offs
            m = o < n_words
            word = tl.load(src_w + o, mask=m).to(tl.int64) & low
            st_relaxed(row + o, tag | word, m, USE_PTX)
            blk += nprog
        src = (rank - j + world) % world
        mine = tl.multiple_of((tl.load(bases_ptr + rank) + stage_off + (slot + src) * slot_words * 8).to(
            tl.pointer_type(tl.int64)), 16)
        out = (out_addr + tl.cast(src, tl.int64) * shard_bytes).to(tl.pointer_type(tl.int32))
        if VEC:
            out = tl.multiple_of(out, 16)
        want = tag >> 32  # the epoch as a line carries it: its low 32 bits, sign-extended (2**31 calls wrap)
        late = tl.full([], 0, tl.int32)
        blk = pid.to(tl.int64)
        while (blk * BLOCK < n_words) & (late == 0):
            o = blk * BLOCK + offs
            m = o < n_words
            # every line must carry the epoch (a smallest-epoch test would pass a stale line once epochs wrap)
            line = tl.load(mine + o, mask=m, other=tag, volatile=True)
            missing = tl.sum(((line >> 32) != want).to(tl.int32), axis=0)  # a reduction: the same in every thread
            t0 = now(USE_TIMER)
            polls = tl.full([], 0, tl.int64)
            while (missing != 0) & (late == 0):
                line = tl.load(mine + o, mask=m, other=tag, volatile=True)
                missing = tl.sum(((line >> 32) != want).to(tl.int32), axis=0)
                polls += 1
                late = expired(t0, polls, timeout, USE_TIMER)
            if missing == 0:
                tl.store(out + o, (line & low).to(tl.int32), mask=m)
            else:
                stale = tl.min(tl.where((line >> 32) != want, line >> 32, 1 << 62), axis=0)  # a line's old epoch
                record_error(err_ptr, _K_ERR_DONE, rank, src, -1, e, stale, _K_CMP_GE)
            blk += nprog
    tl.debug_barrier()
    if arrive_last(state_ptr + 1, nprog * world) != 0:
        tl.store(state_ptr, e)


# ---------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CopyConfig:
    """How the SM-driven copy kernels are launched.

    block_bytes: bytes one program moves per loop iteration (power of two, >= 512); num_warps: warps per
    program; programs_per_sm: grid = at most this many programs per SM (persistent loop beyond that);
    min_block_bytes: small copies shrink the block down to this so that they still spread over many SMs."""

    block_bytes: int = 16384
    num_warps: int = 8
    programs_per_sm: int = 2
    min_block_bytes: int = 2048

    def __post_init__(self) -> None:
        for name in ("block_bytes", "min_block_bytes"):
            v = getattr(self, name)
            if v < 512 or v & (v - 1):
                raise ValueError(f"CopyConfig: {name}={v} must be a power of two >= 512")
        if self.min_block_bytes > self.block_bytes:
            raise ValueError(f"CopyConfig: min_block_bytes={self.min_block_bytes} > block_bytes={self.block_bytes}")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"CopyConfig: num_warps={self.num_warps} must be a power of two <= 32")
        if self.programs_per_sm < 1:
            raise ValueError(f"CopyConfig: programs_per_sm={self.programs_per_sm} must be >= 1")


_SMS: dict = {}


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 for the CPU: the interpreter only needs a few programs)."""
    key = (device.type, device.index)
    sms = _SMS.get(key)
    if sms is None:
        sms = _SMS[key] = (torch.cuda.get_device_properties(device).multi_processor_count
                           if device.type == "cuda" else 4)
    return sms


def interpreted() -> bool:
    """True when this module's kernels run under the Triton interpreter (TRITON_INTERPRET=1 was set when
    it was imported); CPU tensors can only be used then."""
    return type(_copy_kernel).__name__ == "InterpretedFunction"


def _flags(device: torch.device) -> dict:
    on_gpu = device.type == "cuda"
    return {"USE_PTX": on_gpu}


def timeout_units(timeout_s: float, device: torch.device) -> int:
    """What the kernels' ``timeout`` argument means on ``device``: ns of globaltimer on GPUs, polls in
    the interpreter."""
    if device.type == "cuda":
        return max(1, int(timeout_s * 1e9))
    return max(1, int(timeout_s / INTERPRETER_SECONDS_PER_POLL))


@functools.lru_cache(maxsize=4096)
def copy_grid(nbytes: int, sms: int, config: CopyConfig) -> tuple[int, int, int]:
    """``(programs, block_bytes, num_warps)`` for an ``nbytes`` copy on a device with ``sms`` SMs: the block
    shrinks (down to ``config.min_block_bytes``) until the copy covers every SM, and the grid is capped at
    ``programs_per_sm`` per SM."""
    block = config.block_bytes
    while block > config.min_block_bytes and -(-nbytes // block) < sms:
        block //= 2
    warps = max(1, min(config.num_warps, block // 512))  # 16 bytes per thread per vector, >= 1 vector
    programs = max(1, min(-(-max(nbytes, 1) // block), config.programs_per_sm * sms))
    return programs, block, warps


def launch_copy(src_addr: int, dst_addr: int, nbytes: int, device: torch.device, config: CopyConfig,
                counter: torch.Tensor, signal_addr: int = 0, signal_value: int = 0,
                signal_op: Optional[int] = None) -> None:
    """Copy ``nbytes`` from ``src_addr`` to ``dst_addr`` on the current stream of ``device`` (either address
    may be in a peer's heap). With ``signal_op`` (SIGNAL_SET / SIGNAL_ADD) the kernel then releases
    ``signal_value`` into the int64 flag at ``signal_addr`` after all of its data. ``counter``: a device int32
    ``[1]`` that is 0 between launches (the arrival count of the signalling copy; one per stream that may
    run such copies concurrently)."""
    if nbytes <= 0 and signal_op is None:
        return
    programs, block, warps = copy_grid(nbytes, num_sms(device), config)
    aligned = src_addr % 16 == 0 and dst_addr % 16 == 0
    has_signal = signal_op is not None
    launch(_copy_kernel, (programs,),
        src_addr, dst_addr, nbytes, signal_addr, signal_value, counter, BLOCK=block if aligned else min(block, 4096),
        ALIGNED16=aligned, HAS_SIGNAL=has_signal, SIGNAL_OP=signal_op if has_signal else 0,
        num_warps=warps if aligned else 4, **_flags(device))


def launch_signal(signal_addr: int, value: int, op: int, device: torch.device) -> None:
    """Release ``value`` into (SIGNAL_SET) or onto (SIGNAL_ADD) the int64 flag at ``signal_addr``."""
    launch(_signal_kernel, (1,), signal_addr, value, SIGNAL_OP=op, num_warps=1, **_flags(device))


def launch_wait(signal_addr: int, cmp: int, value: int, timeout_s: float, err: torch.Tensor, rank: int, slot: int,
                device: torch.device) -> None:
    """Wait on the current stream until the int64 flag at ``signal_addr`` satisfies ``cmp`` against ``value``
    or ``timeout_s`` passes (then ``err``, int64[ERROR_WORDS], records it)."""
    launch(_wait_kernel, (1,), signal_addr, cmp, value, timeout_units(timeout_s, device), err, rank, slot, num_warps=1,
           USE_TIMER=device.type == "cuda", **_flags(device))


def launch_barrier(bases: torch.Tensor, flags_off: int, epoch: torch.Tensor, err: torch.Tensor, rank: int,
                   world: int, timeout_s: float) -> None:
    """``block_barrier`` as its own one-program kernel (``bases`` int64 [R], ``epoch`` int64 [1])."""
    device = bases.device
    launch(_barrier_kernel, (1,), bases, flags_off, epoch, err, rank, world, timeout_units(timeout_s, device),
           R_POW2=max(2, next_pow2(world)), num_warps=1,
           USE_TIMER=device.type == "cuda", **_flags(device))


def launch_allgather(bases: torch.Tensor, src_addr: int, out_off: int, shard_bytes: int, ready_off: int,
                     done_off: int, state: torch.Tensor, err: torch.Tensor, rank: int, world: int,
                     timeout_s: float, config: CopyConfig) -> None:
    """One-sided all-gather (see ``_allgather_kernel``): ``state`` int64 [2] local [epoch, counter]."""
    device = bases.device
    sms = num_sms(device)
    programs, block, warps = copy_grid(shard_bytes, sms, config)
    programs = max(1, min(programs, max(1, config.programs_per_sm * sms // world)))
    aligned = src_addr % 16 == 0 and shard_bytes % 16 == 0 and out_off % 16 == 0
    launch(_allgather_kernel, (programs, world),
        bases, src_addr, out_off, shard_bytes, ready_off, done_off, state, err, rank, world,
        timeout_units(timeout_s, device), BLOCK=block if aligned else min(block, 4096), ALIGNED16=aligned,
        R_POW2=max(2, next_pow2(world)), num_warps=warps if aligned else 4,
        USE_TIMER=device.type == "cuda", **_flags(device))


_LINE_BLOCK = 512  # words a line all-gather program moves per step


def launch_allgather_lines(bases: torch.Tensor, src_addr: int, out_addr: int, shard_bytes: int, stage_off: int,
                           slot_words: int, state: torch.Tensor, err: torch.Tensor, rank: int, world: int,
                           timeout_s: float, programs: int) -> None:
    """All-gather of a small shard with inline flags (see ``_allgather_lines_kernel``): at most ``programs``
    programs per rank (each moves 512 words per step), ``state`` int64 [2] local [epoch, counter]."""
    device = bases.device
    per_rank = max(1, min(cdiv(shard_bytes // 4, _LINE_BLOCK), programs // world))
    if stage_off % 16 or slot_words % 2:
        raise ValueError(f"launch_allgather_lines: stage_off={stage_off} must be a multiple of 16 and "
                         f"slot_words={slot_words} even")
    vec = src_addr % 16 == 0 and out_addr % 16 == 0 and shard_bytes % 16 == 0
    launch(_allgather_lines_kernel, (per_rank, world), bases, src_addr, out_addr, shard_bytes, stage_off, slot_words,
           state, err, rank, world, timeout_units(timeout_s, device), BLOCK=_LINE_BLOCK, VEC=vec, num_warps=4,
           USE_TIMER=device.type == "cuda", **_flags(device))

