"""Correctness cases of the one-sided primitives, run inside a worker (``epcomm.testing.spawn``).

Each ``check_*(ctx, ...)`` builds its own heap, exercises one area on every rank and returns a dict with
``failures`` (a list of strings, empty when everything matched) and counts. Every rank can rebuild every
other rank's data from the seed, so each checks what it received itself. The CPU suite (gloo, shared
memory, optionally the Triton interpreter) and the GPU suite (NCCL, NVLink) run the same cases."""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import EpcommTimeoutError, TransportUnavailableError
from .collectives import AllGather
from .heap import SymmetricHeap, heap_bytes_for


def pattern(nbytes: int, seed: int, rank: int, device: torch.device) -> torch.Tensor:
    """Random uint8 ``[nbytes]`` that every process can regenerate from (seed, rank)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 7919 + rank * 104729 + nbytes)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _first_diff(got: torch.Tensor, want: torch.Tensor) -> str:
    bad = (got != want).nonzero()
    if bad.numel() == 0:
        return "no difference"
    i = int(bad[0, 0])
    return f"{int(bad.size(0))} bytes differ, first at {i}: got {int(got[i])}, want {int(want[i])}"


def check_put_get(ctx, cases: Sequence[tuple], seed: int = 0, engines: Sequence[str] = ("sm", "ce")) -> dict:
    """Ring put and get of random bytes. ``cases``: ``(nbytes, byte_offset)`` pairs; a nonzero offset makes
    both addresses unaligned (the byte-wise kernel path). Each rank puts into rank+1's ``inbox`` and gets
    rank+1's ``outbox``."""
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    span = max(n + off for n, off in cases)
    heap = SymmetricHeap(ctx.group, heap_bytes_for([((span,), torch.uint8)] * 2), device=dev)
    inbox = heap.empty(span, torch.uint8)
    outbox = heap.empty(span, torch.uint8)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    failures: list = []
    count = 0
    for engine in engines:
        for n, off in cases:
            key = seed + 31 * off + (0 if engine == "sm" else 17)
            mine = pattern(n, key, rank, dev)
            heap.barrier()  # everyone is done reading the previous case
            heap.put(inbox[off:off + n], mine, nxt, engine=engine)
            outbox[off:off + n].copy_(mine)
            heap.barrier()  # puts delivered, outboxes written
            want = pattern(n, key, prv, dev)
            if not torch.equal(inbox[off:off + n], want):
                failures.append(f"put engine={engine} nbytes={n} offset={off} on rank {rank}: "
                                f"{_first_diff(inbox[off:off + n], want)}")
            got = torch.empty(n, dtype=torch.uint8, device=dev)
            heap.get(got, outbox[off:off + n], nxt, engine=engine)
            want = pattern(n, key, nxt, dev)
            _sync(dev)
            if not torch.equal(got, want):
                failures.append(f"get engine={engine} nbytes={n} offset={off} on rank {rank}: {_first_diff(got, want)}")
            count += 2
    heap.destroy()
    return {"failures": failures, "checked": count}


def check_typed(ctx, seed: int = 0) -> dict:
    """Typed tensors (float32 ``[4, 33]`` <- flat source, bfloat16, int64) through put/get/peer_tensor, and the
    table layout: ``peer_ptrs(t)[r] == peer_bases[r] + offset_of(t)``."""
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    heap = SymmetricHeap(ctx.group, 1 << 16, device=dev)
    a = heap.empty((4, 33), torch.float32)
    b = heap.empty((5,), torch.bfloat16)
    c = heap.empty((3, 3), torch.int64)
    failures = []
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    if heap.offset_of(a) % 256 or heap.offset_of(b) % 256 or heap.offset_of(c) % 256:
        failures.append(f"offsets not 256-aligned: {heap.offset_of(a)}, {heap.offset_of(b)}, {heap.offset_of(c)}")
    ptrs = heap.peer_ptrs(b).cpu()
    if not torch.equal(ptrs, heap.peer_bases.cpu() + heap.offset_of(b)) or int(ptrs[rank]) != b.data_ptr():
        failures.append(f"peer_ptrs(b) {ptrs.tolist()} does not match peer_bases + offset")
    offsets = [None] * world
    dist.all_gather_object(offsets, (heap.offset_of(a), heap.offset_of(b), heap.offset_of(c)), group=ctx.group)
    if len(set(offsets)) != 1:
        failures.append(f"offsets differ between ranks: {offsets}")
    src = torch.arange(4 * 33, dtype=torch.float32, device=dev) + 1000 * rank
    heap.barrier()
    heap.put(a, src, nxt)
    heap.put(b, torch.tensor([rank + 0.5] * 5, dtype=torch.bfloat16, device=dev), nxt, engine="ce")
    c.fill_(rank)
    heap.barrier()
    if not torch.equal(a.flatten(), torch.arange(4 * 33, dtype=torch.float32, device=dev) + 1000 * prv):
        failures.append(f"typed put float32 [4, 33] on rank {rank}: got {a.flatten()[:4].tolist()}...")
    if not torch.equal(b.float().cpu(), torch.full((5,), prv + 0.5)):
        failures.append(f"typed put bfloat16 (copy engine) on rank {rank}: got {b.tolist()}")
    view = heap.peer_tensor(c, nxt)
    if view.shape != c.shape or view.dtype != c.dtype or not bool((view == nxt).all()):
        failures.append(f"peer_tensor(c, {nxt}) on rank {rank}: {view.shape} {view.dtype} {view.tolist()}")
    got = torch.empty(9, dtype=torch.int64, device=dev)
    heap.get(got, c, prv)
    _sync(dev)
    if not bool((got == prv).all()):
        failures.append(f"typed get int64 [3, 3] -> [9] on rank {rank}: {got.tolist()}")
    heap.destroy()
    return {"failures": failures}


def check_signals(ctx, rounds: int = 3, nbytes: int = 4096, seed: int = 1) -> dict:
    """Signals and waits: every comparison against a local slot, a ring ping over slot 0, an all-to-all of
    fused put+signal (each rank writes block ``rank`` of every peer's inbox and signals slot ``10 + rank``),
    and ``op="add"`` from every rank onto rank 0 where native P2P atomics exist (refused elsewhere)."""
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    heap = SymmetricHeap(ctx.group, heap_bytes_for([((world, nbytes), torch.uint8)]), device=dev)
    inbox = heap.empty((world, nbytes), torch.uint8)
    failures: list = []
    heap.signal(rank, 1, 5)
    for cmp, v in (("eq", 5), ("ne", 4), ("gt", 4), ("ge", 5), ("lt", 6), ("le", 5)):
        heap.wait(1, cmp, v, timeout_s=10)
    if heap.signal_value(1) != 5:
        failures.append(f"signal_value(1) = {heap.signal_value(1)} after signal(set 5) on rank {rank}")
    heap.signal(rank, 2, 3, op="add")
    heap.signal(rank, 2, 4, op="add")
    if heap.signal_value(2) != 7:
        failures.append(f"local add: slot 2 holds {heap.signal_value(2)}, want 7, on rank {rank}")
    nxt = (rank + 1) % world
    for it in range(1, rounds + 1):
        heap.signal(nxt, 0, it)
        heap.wait(0, "ge", it, timeout_s=30)
        for p in range(world):
            if p != rank:
                heap.put(inbox[rank], pattern(nbytes, seed + it, rank, dev), p, signal_slot=10 + rank,
                         signal_value=it)
        for p in range(world):
            if p != rank:
                heap.wait(10 + p, "ge", it, timeout_s=30)
                want = pattern(nbytes, seed + it, p, dev)
                if not torch.equal(inbox[p], want):
                    failures.append(f"put+signal round {it} block from {p} on rank {rank}: "
                                    f"{_first_diff(inbox[p], want)}")
        heap.barrier()  # nobody overwrites an inbox before its owner checked it
    atomics = all(heap.p2p_atomics)
    if atomics:
        for it in range(1, rounds + 1):
            heap.signal(0, 3, 1, op="add")
            if rank == 0:
                heap.wait(3, "ge", it * world, timeout_s=30)
            heap.barrier()
        if rank == 0 and heap.signal_value(3) != rounds * world:
            failures.append(f"remote add: slot 3 holds {heap.signal_value(3)}, want {rounds * world}")
    elif world > 1:
        try:
            heap.signal(nxt, 3, 1, op="add")
            failures.append(f"signal(op='add') towards rank {nxt} was not refused without P2P atomics")
        except TransportUnavailableError as e:
            if "single-writer" not in str(e):
                failures.append(f"refusal message lacks the single-writer advice: {e}")
    heap.destroy()
    return {"failures": failures, "atomics": atomics}


def check_barrier(ctx, rounds: int = 4) -> dict:
    """``barrier`` orders data: each round every rank puts a round-stamped value into every peer (no signal),
    barriers, and checks what arrived; the epoch advances each round."""
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    heap = SymmetricHeap(ctx.group, 1 << 12, device=dev)
    slots = heap.empty((world, 4), torch.int64)
    slots.zero_()
    heap.barrier()
    failures = []
    for it in range(1, rounds + 1):
        mine = torch.tensor([it, rank, it * 100 + rank, -it], dtype=torch.int64, device=dev)
        for p in range(world):
            heap.put(slots[rank], mine, p)
        heap.barrier()
        for p in range(world):
            want = [it, p, it * 100 + p, -it]
            if slots[p].tolist() != want:
                failures.append(f"barrier round {it}: rank {rank} holds {slots[p].tolist()} from {p}, want {want}")
        heap.barrier()
    epoch = int(heap._barrier_epoch[0])
    heap.destroy()
    return {"failures": failures, "epoch": epoch}


def check_timeouts(ctx, timeout_s: float = 0.5, barrier_timeout: bool = True) -> dict:
    """A missing signal becomes ``EpcommTimeoutError`` (blocking and nonblocking), naming the rank, slot and
    values, after about ``timeout_s``; the heap still works afterwards. Then a barrier that rank 0 skips times
    out on the other ranks (the heap is destroyed afterwards without a barrier)."""
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    heap = SymmetricHeap(ctx.group, 1 << 12, device=dev)
    failures = []
    heap.signal(rank, 7, 2)
    t0 = time.monotonic()
    try:
        heap.wait(7, "ge", 3, timeout_s=timeout_s)
        failures.append(f"rank {rank}: wait on a slot nobody signals returned")
    except EpcommTimeoutError as e:
        elapsed = time.monotonic() - t0
        msg = str(e)
        for part in (f"rank {rank}", "slot 7", ">= 3", "holds 2", "SymmetricHeap.wait"):
            if part not in msg:
                failures.append(f"timeout message lacks {part!r}: {msg}")
        if elapsed > 20 * timeout_s + 10:
            failures.append(f"rank {rank}: the timeout of {timeout_s} s took {elapsed:.1f} s")
    heap.wait(8, "eq", 1, timeout_s=timeout_s, nonblocking=True)
    try:
        _sync(dev)
        heap.check_errors()
        failures.append(f"rank {rank}: nonblocking wait timeout not reported by check_errors()")
    except EpcommTimeoutError as e:
        if "slot 8" not in str(e):
            failures.append(f"nonblocking timeout message lacks the slot: {e}")
    heap.barrier(timeout_s=60)  # still usable
    if barrier_timeout and world > 1:
        if rank != 0:
            try:
                heap.barrier(timeout_s=timeout_s)
                failures.append(f"rank {rank}: barrier without rank 0 returned")
            except EpcommTimeoutError as e:
                if "rank 0 has not arrived" not in str(e):
                    failures.append(f"barrier timeout message does not name rank 0: {e}")
        dist.barrier(group=ctx.group)
    heap.destroy(barrier=False)
    dist.barrier(group=ctx.group)
    return {"failures": failures}


def check_allgather(ctx, shard_bytes: Sequence[int] = (64, 1000, 1001, 4096), rounds: int = 3, seed: int = 5,
                    graph: bool = False, small_shard_bytes: int = 1024) -> dict:
    """``AllGather`` over several calls with fresh data each time (the epochs advance), odd sizes included,
    the protocol alternating (shards up to ``small_shard_bytes`` as lines unless forced direct, larger ones
    direct); with ``graph`` (CUDA) a call with the smallest and one with the largest shard are captured in
    one graph and replayed with new shard contents."""
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    top = max(shard_bytes)
    heap = SymmetricHeap(ctx.group, AllGather.heap_bytes(world, top, small_shard_bytes), device=dev)
    ag = AllGather(heap, top, small_shard_bytes)
    failures: list = []

    def compare(what: str, out: torch.Tensor, n: int, data_seed: int) -> None:
        for p in range(world):
            want = pattern(n, data_seed, p, dev)
            if not torch.equal(out[p], want):
                failures.append(f"all-gather {what} nbytes={n}: row {p} on rank {rank}: {_first_diff(out[p], want)}")

    for it in range(rounds):
        for i, n in enumerate(shard_bytes):
            ag.protocol = "direct" if (it + i) % 3 == 2 else "auto"
            out = ag(pattern(n, seed + it, rank, dev))
            _sync(dev)
            heap.check_errors()
            compare(f"round {it} ({ag.protocol})", out, n, seed + it)
    ag.protocol = "auto"
    if graph and dev.type == "cuda":
        sizes = (min(shard_bytes), max(shard_bytes))
        shards = [torch.empty(n, dtype=torch.uint8, device=dev) for n in sizes]
        for n, shard in zip(sizes, shards):
            shard.copy_(pattern(n, seed, rank, dev))

        def both():
            first = ag(shards[0]).clone()  # the second call reuses the output
            return first, ag(shards[1])

        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            both()  # warm-up outside the graph (compiles, advances the epoch on every rank alike)
        torch.cuda.current_stream(dev).wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs = both()
        for it in range(rounds):
            for n, shard in zip(sizes, shards):
                shard.copy_(pattern(n, seed + 100 + it, rank, dev))
            g.replay()
            _sync(dev)
            heap.check_errors()
            for n, out in zip(sizes, outs):
                compare(f"graph replay {it}", out, n, seed + 100 + it)
    heap.destroy()
    return {"failures": failures}


def check_graph_put_barrier(ctx, nbytes: int = 1 << 16, replays: int = 4, seed: int = 9) -> dict:
    """CUDA graph of ``put`` (to rank+1) + ``barrier(nonblocking=True)``, replayed with new source data: the
    barrier's epoch lives on the device, so every replay synchronises anew."""
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    if dev.type != "cuda":
        return {"failures": [], "skipped": True}
    heap = SymmetricHeap(ctx.group, nbytes, device=dev)
    inbox = heap.empty(nbytes, torch.uint8)
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    nxt, prv = (rank + 1) % world, (rank - 1) % world

    def step():
        heap.barrier(nonblocking=True)
        heap.put(inbox, src, nxt)
        heap.barrier(nonblocking=True)

    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream(dev).wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    failures = []
    for it in range(replays):
        src.copy_(pattern(nbytes, seed + it, rank, dev))
        g.replay()
        _sync(dev)
        heap.check_errors()
        want = pattern(nbytes, seed + it, prv, dev)
        if not torch.equal(inbox, want):
            failures.append(f"graph replay {it} on rank {rank}: {_first_diff(inbox, want)}")
        heap.barrier()  # nobody replays (and overwrites) before everyone has checked
    heap.destroy()
    return {"failures": failures}


def run_all(ctx, cases: Optional[Sequence[tuple]] = None, timeout_s: float = 0.5) -> dict:
    """Every check above with small sizes (one spawn for the whole CPU suite)."""
    cases = cases or ((4, 0), (5, 0), (17, 1), (4096, 0), (4099, 0), (65536 + 3, 1))
    results = {
        "validation": check_validation(ctx),
        "put_get": check_put_get(ctx, cases),
        "typed": check_typed(ctx),
        "signals": check_signals(ctx),
        "barrier": check_barrier(ctx),
        "timeouts": check_timeouts(ctx, timeout_s=timeout_s),
    }
    try:
        results["allgather"] = check_allgather(ctx)
    except TransportUnavailableError as e:  # CPU without the interpreter
        results["allgather"] = {"failures": [], "skipped": str(e)}
    return results


def check_validation(ctx) -> dict:
    """Argument checks and their messages: each must raise the documented exception, naming the function."""
    from ..errors import BufferTooSmallError, EpcommError

    world, dev = ctx.world_size, ctx.device
    heap = SymmetricHeap(ctx.group, 1024, device=dev)
    a = heap.empty(100, torch.uint8)
    failures: list = []

    def expect(exc, parts, fn, *args, **kwargs):
        try:
            fn(*args, **kwargs)
        except exc as e:
            missing = [p for p in parts if p not in str(e)]
            if missing:
                failures.append(f"{exc.__name__} message lacks {missing}: {e}")
            return
        except Exception as e:  # noqa: BLE001
            failures.append(f"expected {exc.__name__} with {parts}, got {type(e).__name__}: {e}")
            return
        failures.append(f"expected {exc.__name__} with {parts}, nothing was raised")

    expect(BufferTooSmallError, ["SymmetricHeap.empty", "nbytes >=", "free"], heap.empty, (1000,), torch.float32)
    expect(ValueError, ["SymmetricHeap.empty", "negative"], heap.empty, (-1, 2))
    outside = torch.zeros(100, dtype=torch.uint8, device=dev)
    expect(ValueError, ["SymmetricHeap.put", "not in this symmetric heap"], heap.put, outside, outside, 0)
    expect(ValueError, ["SymmetricHeap.put", "same size"], heap.put, a, outside[:99], 0)
    expect(ValueError, ["SymmetricHeap.put", "peer="], heap.put, a, outside, world)
    expect(ValueError, ["SymmetricHeap.put", "engine="], heap.put, a, outside, 0, engine="dma")
    expect(ValueError, ["SymmetricHeap.get", "contiguous"], heap.get, outside.view(10, 10).t(), a.view(10, 10), 0)
    expect(ValueError, ["SymmetricHeap.signal", "slot="], heap.signal, 0, heap.layout.num_signals)
    expect(ValueError, ["SymmetricHeap.signal", "op="], heap.signal, 0, 0, 1, op="max")
    expect(ValueError, ["SymmetricHeap.wait", "cmp="], heap.wait, 0, "approx", 1)
    expect(ValueError, ["SymmetricHeap.wait", "timeout_s="], heap.wait, 0, "ge", 0, timeout_s=0)
    expect(ValueError, ["SymmetricHeap.peer_tensor", "not in this symmetric heap"], heap.peer_tensor, outside, 0)
    if heap.offset_of(a) != heap.layout.user_off or a.data_ptr() % 256:
        failures.append(f"first tensor at offset {heap.offset_of(a)}, want {heap.layout.user_off} (256-aligned)")
    b = heap.empty((3,), torch.float64)
    if heap.offset_of(b) != heap.layout.user_off + 256:
        failures.append(f"second tensor at offset {heap.offset_of(b)}, want {heap.layout.user_off + 256}")
    if heap.used_bytes != 256 + 24 or heap.free_bytes != heap.nbytes - heap.used_bytes:
        failures.append(f"used {heap.used_bytes} free {heap.free_bytes} of {heap.nbytes}")
    if heap._kernels_usable("all-gather"):
        top = 64
        heap2 = SymmetricHeap(ctx.group, AllGather.heap_bytes(world, top), device=dev)
        ag = AllGather(heap2, top)
        expect(BufferTooSmallError, ["AllGather", "max_shard_bytes >= 65"], ag,
               torch.zeros(65, dtype=torch.uint8, device=dev))
        heap2.destroy()
    heap.destroy()
    expect(EpcommError, ["SymmetricHeap.put", "destroyed"], heap.put, a, outside, 0)
    return {"failures": failures}
