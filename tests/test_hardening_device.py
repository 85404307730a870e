"""Production hardening of the one-sided kernels, on CPU processes (the kernels under the Triton interpreter, and
compiled for sm_90 where the PTX matters):

* epochs wrap: normal and low-latency calls, the heap's barrier and both all-gather protocols, started just below
  2**31 (tagged words change sign), 2**32 (their 32 bits wrap) and 2**63 (the int64 wraps), stay bit-exact;
* memory ordering: acquire loads are ``ld.acquire.sys`` by one thread, inline-flag lines strong relaxed stores;
* co-residency: kernels whose programs wait for each other are launched cooperatively with a grid that fits (the
  launcher's arithmetic, its grid functions, its fallback where a device refuses cooperative launches);
* an overflowing ``num_worst_tokens`` on the one-sided transport writes and reads nothing outside its regions and
  is an error on every rank.

The GPU side: tests/gpu/test_hardening_gpu.py."""

import pytest
import torch

pytest.importorskip("triton")

from conftest import sm90_compiler  # noqa: E402
from epcomm.testing import spawn  # noqa: E402
from epcomm.testing.checks import LowLatencyCase, NormalCase  # noqa: E402

# just below 2**31 (the words' epoch tags change sign) and 2**63 (the int64 wraps, and the tags' 32 bits with it)
WRAPS = (2**31 - 2, 2**63 - 2)


def _wrapped(v: int) -> int:
    return (v + 2**63) % 2**64 - 2**63


def _late(obj, names, delay: float = 0.15) -> None:
    """Make ``obj``'s methods ``names`` start ``delay`` seconds late: the peer's waits must then really wait (a
    stale flag or word that satisfied a comparison would let it read before the data came)."""
    import time

    for name in names:
        def late(*args, _call=getattr(obj, name), **kwargs):
            time.sleep(delay)
            return _call(*args, **kwargs)
        setattr(obj, name, late)


# ---------------------------------------------------------------------------------------------------------
# epochs across the wrap
# ---------------------------------------------------------------------------------------------------------
CASES = [
    NormalCase(num_tokens=(6, 3), hidden=32, num_experts=4, topk=2, dtype="bf16", bias=1, seed=61),
    NormalCase(num_tokens=(4, 5), hidden=32, num_experts=4, topk=2, dtype="fp32", worst=True, strict_sms=True,
               seed=62),
    LowLatencyCase(num_tokens=(3, 2), max_tokens=4, hidden=128, num_experts=4, topk=2, seed=63),
    LowLatencyCase(num_tokens=(2, 3), max_tokens=4, hidden=128, num_experts=4, topk=2, use_fp8=False, hook=True,
                   seed=64),
]


def _across_wraps(ctx):
    """For each start in WRAPS: every epoch of the one-sided transport there (``_start_epochs``), then normal calls
    (exchange, streaming and bounded dispatch, cached dispatch, combine) and low-latency calls (plain and hook),
    each checked bit for bit. Returns [(start, failures, normal epoch after, low-latency call counts after)]."""
    from dataclasses import replace

    from epcomm.buffer import Buffer
    from epcomm.testing.checks import check_low_latency, check_normal
    from epcomm.transports.nvlink import NVLinkTransport

    buf = Buffer(ctx.group, transport=NVLinkTransport, num_nvl_bytes=1 << 16)
    rt = buf.runtime
    if ctx.rank == 1:  # pushes late: after the count exchange, or the low-latency send
        _late(rt, ("_push_rounds", "combine", "low_latency_dispatch", "low_latency_combine"))
    out = []
    for i, start in enumerate(WRAPS):
        rt._start_epochs(start)
        failures = []
        for case in CASES:
            case = replace(case, seed=case.seed + 100 * i)  # stale rows of the previous start would not match
            check = check_low_latency if isinstance(case, LowLatencyCase) else check_normal
            failures += [f"{case.label()}: {f}" for f in check(ctx, buf, case).failures]
        failures += rt.pending_errors()
        out.append((start, failures, int(rt.epoch[0]), rt._ll._ctl[:2].tolist()))
    buf.destroy()
    return out


def test_one_sided_calls_across_epoch_wraps(monkeypatch):
    """Bit-exact across the wraps, and the epochs did cross them (the normal epoch past 2**31, then past 2**63
    into negative int64s; the low-latency call counters past 2**63)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("EPCOMM_TIMEOUT_S", "20")
    for rank, res in enumerate(spawn(_across_wraps, 2, device="cpu", timeout_s=600)):
        for start, failures, epoch, ll_calls in res:
            assert not failures, f"rank {rank}, epochs from {start}: {failures}"
            assert 4 <= _wrapped(epoch - start) <= 20, (start, epoch)
            assert ll_calls == [_wrapped(start + 2)] * 2, (start, ll_calls)
        assert res[0][2] >= 2**31 and res[1][2] < 0, "the normal epochs did not cross 2**31 / 2**63"
        assert res[1][3][0] < 0, "the low-latency call counters did not cross 2**63"


def _heap_across_wraps(ctx):
    """The heap's device barrier and an AllGather (lines for small shards, the direct protocol for larger ones)
    from just below each wrap (``_start_epochs``): every gathered shard checked. Returns (failures, epochs)."""
    import time

    from epcomm.shmem import AllGather, SymmetricHeap
    from epcomm.shmem.checks import pattern

    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    heap = SymmetricHeap(ctx.group, AllGather.heap_bytes(world, 1024, 256) + 4096, dev)
    ag = AllGather(heap, 1024, small_shard_bytes=256)
    if rank == 1:
        _late(heap, ("barrier",))
    failures, epochs = [], []
    for start in WRAPS:
        heap._start_epochs(start)
        ag._start_epochs(start)
        for call in range(2):
            heap.barrier()
            for n in (64, 1024):  # lines, direct
                if rank == 1:
                    time.sleep(0.15)  # late: rank 0's all-gather must wait for this rank's shard
                got = ag(pattern(n, start % 1000 + call, rank, dev))
                for r in range(world):
                    if not torch.equal(got[r], pattern(n, start % 1000 + call, r, dev)):
                        failures.append(f"from {start}, call {call}: rank {r}'s {n}-byte shard")
        heap.barrier()
        heap.check_errors()
        epochs.append((start, int(heap._barrier_epoch[0]), int(ag._state[0])))
    heap.destroy()
    return failures, epochs


def test_heap_barrier_and_allgather_across_epoch_wraps(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("EPCOMM_TIMEOUT_S", "20")
    for rank, (failures, epochs) in enumerate(spawn(_heap_across_wraps, 2, device="cpu", timeout_s=600)):
        assert not failures, f"rank {rank}: {failures}"
        for start, barrier_epoch, ag_epoch in epochs:
            assert barrier_epoch == _wrapped(start + 3) and ag_epoch == _wrapped(start + 4), (start, epochs)


# ---------------------------------------------------------------------------------------------------------
# num_worst_tokens overflow on the one-sided transport
# ---------------------------------------------------------------------------------------------------------
def _overflow(ctx, strict: bool, interleave: bool):
    """Every rank sends 12 tokens to its peer and 6 to itself with ``num_worst_tokens=4``: more than a source's
    region of 4 rows holds, and than the 4 output rows. The area past what a 4-row call may write, and the heap
    past the area, are filled with 0xFF (a NaN in bf16); the combine input is 4 rows followed by NaN rows. Nothing
    may be written into the poison, and the combine must read neither the poison nor the NaN rows. The Buffer's
    error check is held off so that the combine runs after the failed dispatch (as it can on a GPU, enqueued
    before the error is seen). Returns (poison intact after dispatch, after combine, combine finite, errors,
    the first rows received from the peer are right)."""
    import epcomm.transports.nvlink as nvlink
    from epcomm.buffer import Buffer, Config
    from epcomm.core.layout import align_up
    from epcomm.errors import EpcommDeviceError
    from epcomm.kernels.ep import record_words

    if interleave:  # the combine push that spreads every program over every peer (above NARROW_RANKS ranks)
        nvlink.NARROW_RANKS = 1
    rank, world = ctx.rank, ctx.world_size
    worst, hidden, n = 4, 64, 18
    buf = Buffer(ctx.group, transport=nvlink.NVLinkTransport, num_nvl_bytes=1 << 16)
    rt = buf.runtime
    gen = torch.Generator().manual_seed(70 + rank)
    x = torch.randn(n, hidden, generator=gen).to(torch.bfloat16)
    idx = torch.where(torch.arange(n) < 12, 1 - rank, rank).unsqueeze(1)  # expert e lives on rank e
    w = torch.ones(n, 1)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, world)
    data_end = world * worst * hidden * 2
    meta_rel = align_up(data_end, 256)
    meta_end = meta_rel + world * worst * record_words(0, 1, True) * 4
    local = rt.heap._backing.local
    area_off = rt.heap.offset_of(rt.area)
    guards = [(area_off + data_end, area_off + meta_rel), (area_off + meta_end, local.numel())]
    for a, b in guards:
        local[a:b].fill_(0xFF)

    def intact():
        return all(bool((local[a:b] == 0xFF).all()) for a, b in guards)

    buf._errors.failure = lambda: None  # hold the Buffer's check off: the combine runs after the failed dispatch
    cfg = Config(strict_sms=strict)
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                   num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w,
                                                   num_worst_tokens=worst, config=cfg)
    after_dispatch = intact()
    peer_x = torch.randn(n, hidden, generator=torch.Generator().manual_seed(70 + 1 - rank)).to(torch.bfloat16)
    first_rows = bool(torch.equal(recv_x[:worst].view(torch.int16), peer_x[:worst].view(torch.int16))) \
        if rank == 1 else True  # rank 1's first rows come from rank 0 (source order), its first tokens
    y_all = torch.full((worst + 32, hidden), float("nan"), dtype=torch.bfloat16)
    y_all[:worst] = 1.0
    combined, _, _ = buf.combine(y_all[:worst], handle, topk_weights=recv_w, config=cfg)
    after_combine = intact()
    finite = not bool(combined.isnan().any())
    del buf._errors.failure
    errors = rt.pending_errors()
    try:
        buf.destroy()
    except EpcommDeviceError:
        pass  # the errors are reported at destroy: expected
    return after_dispatch, after_combine, finite, errors, first_rows


@pytest.mark.parametrize("strict,interleave", [(False, False), (True, True)])
def test_worst_tokens_overflow_stays_in_bounds(monkeypatch, strict, interleave):
    """Streaming dispatch with the contiguous combine push, and the bounded dispatch (push, then copy-out) with the
    interleaved one."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("EPCOMM_TIMEOUT_S", "20")
    for rank, (after_dispatch, after_combine, finite, errors, first_rows) in enumerate(
            spawn(_overflow, 2, strict, interleave, device="cpu", timeout_s=600)):
        assert after_dispatch, f"rank {rank}: the dispatch wrote outside its regions"
        assert after_combine, f"rank {rank}: the combine wrote outside its regions"
        assert finite, f"rank {rank}: the combine read outside the rows it was given or received"
        assert first_rows, f"rank {rank}: the rows that fit were not received"
        assert any("more rows than num_worst_tokens" in e for e in errors), (rank, errors)


# ---------------------------------------------------------------------------------------------------------
# co-residency: cooperative launches with a grid that fits
# ---------------------------------------------------------------------------------------------------------
def test_programs_per_sm_follows_cudas_occupancy_rules():
    from epcomm.kernels.launch import programs_per_sm

    assert programs_per_sm(128, 256, 0) == 2  # registers: 128 x 256 = 32K of 64K
    assert programs_per_sm(168, 256, 0) == 1  # 168 x 32 rounds to 5376 per warp: 12 warps fit, 8 per program
    assert programs_per_sm(32, 256, 0) == 8  # threads: 2048 per SM
    assert programs_per_sm(16, 32, 0) == 32  # at most 32 programs per SM
    assert programs_per_sm(32, 128, 100 * 1024) == 2  # shared memory: 228 KiB, 1 KiB reserved per program
    assert programs_per_sm(255, 1024, 0) == 0  # does not fit at all


class _Compiled:
    """A compiled kernel stand-in whose fast launches are logged (and may fail, as a refused launch does)."""

    def __init__(self, log, variant, refuse=False):
        self.log, self.variant, self.refuse = log, variant, refuse
        self.function, self.packed_metadata = f"function{variant}", "packed"

    def _init_handles(self):
        pass

    def run(self, g0, g1, g2, stream, function, packed, metadata, enter_hook, exit_hook, *args):
        if self.refuse:
            raise RuntimeError("Triton Error [CUDA]: operation not supported")
        self.log.append(("fast", self.variant, (g0, g1, g2)))


class _Kernel:
    """A JITFunction stand-in: ``kernel[grid](...)`` and ``kernel.warmup(...)`` log and return a _Compiled, which
    refuses to launch cooperatively when ``refuse`` is set."""

    def __init__(self, refuse=False):
        from epcomm.kernels.launch import Launcher  # noqa: F401 - the launcher under test
        import triton
        import triton.language as tl

        @triton.jit
        def probe(p, a, C: tl.constexpr):
            pass

        self.params, self.fn, self.log, self.refuse = probe.params, probe.fn, [], refuse

    def _compiled(self, kwargs):
        return _Compiled(self.log, len(self.log), self.refuse and kwargs.get("launch_cooperative_grid", False))

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("slow", grid, kwargs.get("launch_cooperative_grid", False)))
            return self._compiled(kwargs)
        return run

    def warmup(self, *args, grid, **kwargs):
        self.log.append(("warmup", kwargs.get("launch_cooperative_grid", False)))
        return self._compiled(kwargs)


def _no_gpu(monkeypatch, resident=10):
    import epcomm.kernels.launch as L

    monkeypatch.setattr(L, "_current_device", lambda: 0)
    monkeypatch.setattr(L, "_current_stream", lambda device: "stream0")
    monkeypatch.setattr(L, "resident_programs", lambda compiled, device: resident)
    monkeypatch.setattr(L, "_COOPERATIVE", {0: True})
    return L


def test_grid_functions_get_the_programs_that_fit(monkeypatch):
    """A grid function sees what fits (the kernel is compiled first at its first launch); a cooperative launch
    whose grid does not fit is refused with a message instead of being sent to the GPU."""
    L = _no_gpu(monkeypatch, resident=10)
    kernel = _Kernel()
    launcher = L.Launcher(kernel)
    t = torch.zeros(16)
    launcher(lambda resident: (min(50, resident),), (t, 32), {"C": 1, "launch_cooperative_grid": True})
    launcher(lambda resident: (min(50, resident),), (t, 32), {"C": 1, "launch_cooperative_grid": True})
    assert [e[0] for e in kernel.log] == ["warmup", "slow", "fast"]
    assert kernel.log[1] == ("slow", (10,), True) and kernel.log[2][2] == (10, 1, 1)
    launcher((10,), (t, 32), {"C": 1, "launch_cooperative_grid": True})
    assert kernel.log[-1][::2] == ("fast", (10, 1, 1))
    with pytest.raises(ValueError, match="Launcher: a cooperative launch of probe with 11 programs; this GPU holds "
                                         "at most 10"):
        launcher((11,), (t, 32), {"C": 1, "launch_cooperative_grid": True})
    launcher((11,), (t, 32), {"C": 1})  # without the option any grid goes
    assert kernel.log[-1] == ("slow", (11,), False)


def test_a_refused_cooperative_launch_goes_on_without(monkeypatch, caplog):
    """Where a device refuses cooperative launches (e.g. an MPS client that may not make them), the launch is made
    again without the option, with a warning, and later launches skip it."""
    L = _no_gpu(monkeypatch)
    kernel = _Kernel(refuse=True)
    launcher = L.Launcher(kernel)
    t = torch.zeros(16)
    launcher((4,), (t, 32), {"C": 1})  # a plain variant first
    plain = kernel.log[-1]
    launcher((4,), (t, 32), {"C": 1, "launch_cooperative_grid": True})  # compiled (the stand-in's slow path runs)
    assert kernel.log[-2:] == [("warmup", True), ("slow", (4,), True)]
    with caplog.at_level("WARNING", logger="epcomm.kernels.launch"):
        launcher((4,), (t, 32), {"C": 1, "launch_cooperative_grid": True})  # refused: again, without the option
    assert "refused a cooperative launch" in caplog.text
    assert L._COOPERATIVE[0] is False
    assert kernel.log[-1] == ("fast", 1, (4, 1, 1)) and plain == ("slow", (4,), False)  # the plain variant ran
    launcher((4,), (t, 32), {"C": 1, "launch_cooperative_grid": True})
    assert kernel.log[-1] == ("fast", 1, (4, 1, 1))


def test_kernels_that_wait_within_their_launch_are_cooperative(monkeypatch):
    """The fused low-latency kernel (on GPUs) and the streaming dispatch are launched cooperatively, with grids
    capped at what fits; the halves of a low-latency call, whose programs wait only for other launches, are not."""
    import epcomm.kernels.ep as ep
    from epcomm.kernels import low_latency as K

    for stage in (K.dispatch_launcher(dict(USE_PTX=True, num_warps=8)), K.combine_launcher(dict(USE_PTX=True))):
        assert stage.kwargs(True, True).get("launch_cooperative_grid") is True
        assert stage.kwargs(True, True)["maxnreg"] == K.FUSED_MAXNREG == 128
        assert not stage.kwargs(True, False).get("launch_cooperative_grid")
        assert not stage.kwargs(False, True).get("launch_cooperative_grid")
        launched = []
        stage.launcher = lambda grid, args, kwargs: launched.append(grid)
        stage(132, (), True, True)
        stage(132, (), True, False)
        assert launched[0](None) == (132,) and launched[0](100) == (100,) and launched[0](264) == (132,)
        assert launched[1] == (132,)
    assert not K.dispatch_launcher(dict(USE_PTX=False)).kwargs(True, True).get("launch_cooperative_grid")

    calls = []
    monkeypatch.setattr(ep, "launch", lambda kernel, grid, *args, **kwargs: calls.append((kernel, grid, kwargs)))
    x = torch.zeros(8, 16, dtype=torch.bfloat16)
    receive = ep.ReceiveSide(*([None] * 3), 0, *([None] * 7), 8, 1, 24)
    for use_ptx in (True, False):
        ep.launch_push(x=x, scales=None, topk_idx=None, topk_weights=None, itr=torch.zeros(8, 4, dtype=torch.bool),
                       pos=None, first=None, rows=None, bases=None, area_off=0, meta_off=0, hdr_off=0, arrive_off=0,
                       epoch=None, counter=None, t_begin=0, t_end=8, cap=8, rank=0, world=4, num_experts=4, grid=24,
                       tokens_per_step=4, use_ptx=use_ptx, single_round=True, publish=True, dummy=x, receive=receive)
    (kernel, grid, kwargs), (_, _, plain) = calls
    assert kernel is ep.dispatch_kernel and kwargs["launch_cooperative_grid"] is True and kwargs["maxnreg"] == 128
    assert "launch_cooperative_grid" not in plain
    assert grid(None) == (24 + 4 * 24,) and grid(1000) == (24 + 4 * 24,)
    assert grid(264) == (24 + 4 * 24,) and grid(100) == (24 + 4 * 19,)  # receivers: as many as fit
    with pytest.raises(ValueError, match="Buffer.dispatch: 24 pushing programs and one receiving program per rank"):
        grid(27)


# ---------------------------------------------------------------------------------------------------------
# memory ordering in the compiled code
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", ["dispatch", "gated dispatch", "ll_fused"])
def test_waits_acquire_with_one_thread_and_end_with_a_barrier(kernel):
    """Compiled for sm_90: the acquire of a poll is an ``ld.acquire.sys`` made by one thread (a predicated inline
    load, no atomic), and every wait ends with ``bar.sync`` (checked on the streaming dispatch, whose receivers
    poll progress words, its gated variant, whose pushers also poll their chunks' flags, and the fused low-latency
    kernel)."""
    compile_for = sm90_compiler()
    if "dispatch" in kernel and kernel != "ll_fused":
        import epcomm.kernels.ep as ep

        t32, t64, i8 = (torch.empty(8, dtype=d) for d in (torch.int32, torch.int64, torch.int8))
        f32 = torch.empty(8)
        args = (t32, t32, 0, 0, t64, f32, i8, t32, t32, t64, 1 << 40, 1 << 41, 1 << 42, t64, 0, 64, 64, 1, 4, 24,
                t32, t32, t64, t64, t32, t32, t32, t64, f32, t32, 64, 10 ** 10, t32, t64, 7, 3, t64)
        meta = dict(XW=64, W=8, NS=0, K=2, E_LOCAL=2, R=4, R_POW2=4, TOK=4, BLOCK=256, BLOCK_S=16, BLOCK_K=16,
                    HAS_SCALES=False, HAS_TOPK=True, HAS_W=True, HAS_IDX=True, SINGLE_ROUND=True, VEC=True,
                    USE_PTX=True, USE_TIMER=True, PMAX=256, SIG=8, ROWS=4, num_warps=8, launch_cooperative_grid=True,
                    GATED=kernel == "gated dispatch", MAPPED=kernel == "gated dispatch")
        ptx = compile_for(ep.dispatch_kernel, args, meta).asm["ptx"]
    else:
        from test_low_latency_interpreter import _sample_args

        from epcomm.kernels import low_latency as K

        disp, _, d_args, _ = _sample_args()
        ptx = compile_for(K.ll_dispatch_kernel, d_args, dict(disp, DO_SEND=True, DO_RECV=True,
                                                             launch_cooperative_grid=True)).asm["ptx"]
    assert "@p ld.acquire.sys.global.b64" in ptx, "the poll's acquire is not the one-thread inline load"
    assert "atom.global.sys.acquire" not in ptx and "atom.acquire" not in ptx, "a poll still uses an atomic"
    assert "bar.sync" in ptx


def test_kernels_that_wait_within_their_launch_fit_twice_per_sm():
    """The fused low-latency dispatch (FP8, pre-cast FP8 and BF16, DeepSeek's hidden size) and the streaming dispatch
    compile for sm_90 to at most 128 registers per thread without spills (ptxas -v), so two programs of 256 threads
    share an SM: one call takes half the GPU, and two calls on two streams are resident together."""
    import os
    import subprocess
    import tempfile

    compile_for = sm90_compiler()
    try:
        from triton import knobs

        ptxas = knobs.nvidia.ptxas.path
    except Exception as e:  # noqa: BLE001 - another Triton version's internals
        pytest.skip(f"cannot find Triton's ptxas here: {e}")
    import epcomm.kernels.ep as ep
    from epcomm.kernels import low_latency as K
    from test_low_latency_interpreter import _sample_args

    disp, _, d_args, _ = _sample_args()
    stage = K.dispatch_launcher(dict(disp, num_warps=8))
    precast_args = (torch.empty(8, dtype=torch.uint8), torch.empty(8)) + d_args[2:]  # e4m3 bytes, float32 scales
    kernels = [(f"low-latency dispatch fp8={fp8}", K.ll_dispatch_kernel, d_args,
                dict(stage.kwargs(True, True), FP8=fp8)) for fp8 in (True, False)]
    kernels.append(("low-latency dispatch of pre-cast fp8", K.ll_dispatch_kernel, precast_args,
                    dict(stage.kwargs(True, True), PRECAST=True)))
    t32, t64, i8 = (torch.empty(8, dtype=d) for d in (torch.int32, torch.int64, torch.int8))
    args = (t32, t32, 0, 0, t64, torch.empty(8), i8, t32, t32, t64, 1 << 40, 1 << 41, 1 << 42, t64, 0, 64, 64, 1, 4,
            24, t32, t32, t64, t64, t32, t32, t32, t64, torch.empty(8), t32, 64, 10 ** 10, t32, t64, 7, 3, t64)
    meta = dict(XW=3584, W=20, NS=0, K=8, E_LOCAL=64, R=4, R_POW2=4, TOK=4, BLOCK=4096, BLOCK_S=16, BLOCK_K=16,
                HAS_SCALES=False, HAS_TOPK=True, HAS_W=True, HAS_IDX=True, SINGLE_ROUND=True, VEC=True, USE_PTX=True,
                USE_TIMER=True, PMAX=256, SIG=8, ROWS=4, num_warps=ep.PUSH_WARPS, **ep._COOPERATIVE)
    kernels.append(("streaming dispatch", ep.dispatch_kernel, args, meta))
    # the gated one (the hierarchical cached dispatch's node leg: FP8 rows of bytes read from wider rows that end in
    # their scales, records of the source and the scales, every row written where the output's order puts it)
    kernels.append(("gated streaming dispatch", ep.dispatch_kernel, args,
                    dict(meta, XW=1792, XS=1848, W=58, NS=56, BLOCK_S=64, HAS_SCALES=True, K=1, HAS_TOPK=False,
                         HAS_W=False, HAS_IDX=False, BLOCK=2048, GATED=True, MAPPED=True)))
    for name, kernel, a, kw in kernels:
        compiled = compile_for(kernel, a, kw)
        assert compiled.metadata.num_warps == 8
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(compiled.asm["ptx"])
            f.flush()
            info = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                                  text=True).stderr
        regs = [int(w) for line in info.splitlines() if "Used" in line and "registers" in line
                for w, nxt in zip(line.split(), line.split()[1:]) if nxt.startswith("registers")]
        assert regs and regs[0] <= 128, f"{name}: {info}"
        assert "0 bytes spill stores" in info, f"{name} spills: {info}"


def _mirror(ctx, dtype):
    import os

    os.environ["TRITON_INTERPRET"] = "1"
    from epcomm.kernels import shmem

    src = torch.arange(1, 6, dtype=dtype) * 7
    dst = torch.full((8,), -1, dtype=dtype)
    shmem.mirror_kernel[(1,)](src, dst.data_ptr(), 5, DTYPE=shmem.tl.int64 if dtype == torch.int64 else
                              shmem.tl.int32, BLOCK=16)
    return dst.tolist()


def _mirror_pair(ctx):
    import os

    os.environ["TRITON_INTERPRET"] = "1"
    from epcomm.kernels import shmem

    src, src2 = torch.arange(1, 4, dtype=torch.int32), torch.arange(1, 6, dtype=torch.int64) * -3
    dst, dst2 = torch.full((5,), -1, dtype=torch.int32), torch.full((8,), -1, dtype=torch.int64)
    shmem.mirror2_kernel[(1,)](src, dst.data_ptr(), 3, src2, dst2.data_ptr(), 5, DTYPE=shmem.tl.int32, BLOCK=16,
                               DTYPE2=shmem.tl.int64, BLOCK2=16)
    return dst.tolist(), dst2.tolist()


def test_error_words_of_two_legs_mirrored_in_one_kernel():
    """``mirror2_kernel`` (a hierarchical Buffer's two legs' words, one launch per call): each array to its own host
    address, with its own dtype, nothing past either."""
    assert spawn(_mirror_pair, 1, device="cpu")[0] == ([1, 2, 3, -1, -1], [-3, -6, -9, -12, -15, -1, -1, -1])


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_error_words_mirror_kernel(dtype):
    """The kernel that refreshes the host copy of the error words (``DeviceErrors.refresh`` on GPUs) stores every
    word to the host address and nothing past it (interpreter, in a process of its own: a host buffer standing for
    the pinned copy, with a guard after it)."""
    assert spawn(_mirror, 1, dtype, device="cpu")[0] == [7, 14, 21, 28, 35, -1, -1, -1]

def test_error_words_mirror_kernel_compiles_for_sm90():
    """The mirror kernel compiles for sm_90: a store through a 64-bit address."""
    from epcomm.kernels import shmem

    compile_for = sm90_compiler()
    ptx = compile_for(shmem.mirror_kernel, (torch.empty(4, dtype=torch.int32), 1 << 40, 4),
                      dict(DTYPE=shmem.tl.int32, BLOCK=16, num_warps=1)).asm["ptx"]
    assert "st.global" in ptx and "ld.volatile.global" in ptx


# ---------------------------------------------------------------------------------------------------------
# compilation out of the device timeouts: no variant compiled inside a call
# ---------------------------------------------------------------------------------------------------------
def _variant(launcher, args: tuple, kwargs: dict) -> tuple:
    """What Triton compiles a launch's variant from (``kernels.launch``'s module docstring), for an interpreted
    kernel (its ``do_not_specialize`` by name or position)."""
    import inspect

    from epcomm.kernels.launch import arg_key

    kernel = launcher.kernel
    names = list(inspect.signature(kernel.fn).parameters)
    free = set(kernel.kwargs.get("do_not_specialize") or ())
    return (kernel.fn.__name__, tuple(sorted(kwargs.items())),
            tuple(arg_key(a, names[i] not in free and i not in free) for i, a in enumerate(args)))


def _compiled_variants(ctx, warm: bool):
    """Calls of uneven token counts on the one-sided transport, after ``Buffer.warmup`` (``warm``) or after a first
    round of the same kinds of calls with other token counts. Returns the variants launched in the measured calls
    that were neither compiled at a meeting point (``compile_only``) nor launched before: each would compile
    inside a call, on this rank only, while its peers' kernels wait for it."""
    import epcomm.kernels.launch as launch_mod
    from epcomm.buffer import Buffer
    from epcomm.testing.checks import check_low_latency, check_normal
    from epcomm.transports.nvlink import NVLinkTransport

    known, new, measuring = set(), [], [False]
    plain_call, compile_call = launch_mod.Launcher.__call__, launch_mod.Launcher._compile

    def call(self, grid, args, kwargs):
        key = _variant(self, args, kwargs)
        if measuring[0] and key not in known:
            new.append(key[:2])
        known.add(key)
        return plain_call(self, grid, args, kwargs)

    def compile_(self, grid, args, kwargs):
        known.add(_variant(self, args, kwargs))
        return compile_call(self, grid, args, kwargs)

    launch_mod.Launcher.__call__, launch_mod.Launcher._compile = call, compile_
    h, e, k = 256, 16, 4
    buf = Buffer(ctx.group, transport=NVLinkTransport)
    mine, other = (48, 21), (21, 48)  # counts that are and are not multiples of 16 on each rank, in turn
    failures = []
    if warm:
        buf.warmup(h, e, k, 48, dtypes=("fp8",), num_max_dispatch_tokens_per_rank=8, use_fp8=(True,))
    else:
        failures += check_normal(ctx, buf, NormalCase(num_tokens=other, hidden=h, num_experts=e, topk=k,
                                                      dtype="fp8", seed=83)).failures
        failures += check_low_latency(ctx, buf, LowLatencyCase(num_tokens=(8, 3), max_tokens=8, hidden=h,
                                                               num_experts=e, topk=k, hook=True, seed=84)).failures
    measuring[0] = True
    for tokens, ll_tokens, columns in ((mine, (1, 6), True), ((0, 33), (5, 0), False)):  # then an empty rank
        # (column-major scales too, DeepEP's layout: their column stride is the token count)
        failures += check_normal(ctx, buf, NormalCase(num_tokens=tokens, hidden=h, num_experts=e, topk=k,
                                                      dtype="fp8", seed=81, column_major_scales=columns)).failures
        failures += check_low_latency(ctx, buf, LowLatencyCase(num_tokens=ll_tokens, max_tokens=8, hidden=h,
                                                               num_experts=e, topk=k, hook=True, seed=82)).failures
    buf.destroy()
    return failures, new


@pytest.mark.parametrize("warm", [True, False])
def test_no_kernel_variant_compiles_inside_a_later_call(warm, monkeypatch):
    """A rank whose calls carry other token counts than before (or than Buffer.warmup's) launches no kernel variant
    it has not compiled: Triton specialises integers on == 1 and % 16 and pointers on their 16-byte alignment, so
    a per-call integer that is not ``do_not_specialize`` (or a pointer into a tensor at a rank-dependent offset)
    compiled a new variant inside the call, where a slower compiler made the peers' waits time out (seen on GPUs:
    the combine's reduce specialised on the number of rows received)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for rank, (failures, new) in enumerate(spawn(_compiled_variants, 2, warm, device="cpu", timeout_s=600)):
        assert failures == [], (rank, failures)
        assert new == [], f"rank {rank} launched variants it had not compiled: {new}"


# integers that change from call to call (token, row and pair counts, token ranges, slots, flag values, the
# timeout): Triton would compile a variant per class of their values (== 1, % 16), on one rank, inside a call
PER_CALL_INTS = {"n", "n_tokens", "num_tokens", "num_pairs", "rows", "rows_out", "out_rows", "num_rows", "self_rows",
                 "num_src", "num_row_progs", "num_push", "t_begin", "t_end", "cap", "slot", "info_slot", "value",
                 "timeout", "self_rank", "nbytes", "sig_value"}
# integers of these names that stay the same for a Buffer's life (the error words' count of the mirror kernel)
FIXED_PER_BUFFER = {"mirror_kernel": {"n"}, "mirror2_kernel": {"n", "n2"}}


def test_launched_kernels_do_not_specialise_per_call_integers():
    """Every kernel epcomm launches (``*_kernel`` in ``epcomm.kernels``) marks its per-call integers
    ``do_not_specialize``. Seen on GPUs: after ``Buffer.warmup`` with 256 tokens, a rank with 100 tokens
    compiled a new ``layout_kernel`` (n % 16) while its peer already waited in the count exchange."""
    import importlib
    import pkgutil

    import triton

    import epcomm.kernels as kernels

    found, missing = 0, []
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"epcomm.kernels.{info.name}")
        for name, fn in vars(module).items():
            if not (isinstance(fn, triton.runtime.jit.JITFunction) and fn.__module__ == module.__name__
                    and name.endswith("_kernel")):
                continue
            found += 1
            for p in fn.params:
                if (not p.is_constexpr and p.name in PER_CALL_INTS - FIXED_PER_BUFFER.get(name, set())
                        and not p.do_not_specialize):
                    missing.append(f"{info.name}.{name}({p.name})")
    assert found > 20, found
    assert missing == [], f"per-call integers Triton would specialise on: {missing}"
