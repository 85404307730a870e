"""The one-sided kernels (epcomm.kernels.shmem) without a GPU.

* Under the Triton interpreter (``TRITON_INTERPRET=1`` must be set before Triton is imported, so these run
  in a subprocess that executes this file as a script): the device helpers' logic in one process (copies of
  every size and alignment, fused copy+signal and its counter reset, signal set/add, every wait comparison,
  timeouts recorded in the error word, the barrier against simulated peers, a one-rank all-gather), then
  the whole SymmetricHeap suite across 3 spawned ranks, all-gather included.
* Compiled for sm_90 here, without a GPU: every kernel variant goes through Triton's real CUDA pipeline
  (TTIR -> PTX -> cubin with ptxas), and the PTX is checked for 16-byte vector accesses and the
  acquire/release/fence/globaltimer instructions the memory-ordering rules rely on."""

import json
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed")


def _run_interpreted(mode: str, timeout: int = 600) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), mode], env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{mode} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_device_helpers_under_interpreter():
    out = _run_interpreted("unit")
    assert out["interpreted"], "the subprocess did not run the kernels under the interpreter"
    assert not out["failures"], "\n".join(out["failures"])
    assert out["checked"] > 20


def test_heap_across_three_ranks_under_interpreter():
    out = _run_interpreted("ranks")
    assert not out["failures"], "\n".join(out["failures"])
    assert "allgather" in out["ran"]
    assert out["bench_allgather"] == 0, "python -m epcomm bench allgather failed its data check"


# ------------------------------------------------------------------------------------------------------------
# sm_90 compilation (in this process, without the interpreter)
# ------------------------------------------------------------------------------------------------------------
def _variants():
    from epcomm.kernels import shmem as K

    a = 1 << 40  # a 16-byte aligned address (never dereferenced: compile only)
    cnt = torch.zeros(2, dtype=torch.int32)
    err = torch.zeros(8, dtype=torch.int64)
    bases = torch.zeros(4, dtype=torch.int64)
    state = torch.zeros(2, dtype=torch.int64)
    flags = dict(USE_PTX=True)
    timer = dict(USE_PTX=True, USE_TIMER=True)
    return [
        ("copy aligned+set", K._copy_kernel, (a, a + 4096, 1 << 20, a + 64, 1, cnt),
         dict(BLOCK=16384, ALIGNED16=True, HAS_SIGNAL=True, SIGNAL_OP=0, num_warps=8, **flags),
         ("ld.global.v4", "st.global.v4", "fence.acq_rel.sys", "st.release.sys.global.b64")),
        ("copy aligned+add", K._copy_kernel, (a, a + 4096, 1, a + 64, 5, cnt),
         dict(BLOCK=2048, ALIGNED16=True, HAS_SIGNAL=True, SIGNAL_OP=1, num_warps=4, **flags),
         ("atom.global.sys.release.add",)),
        ("copy bytes", K._copy_kernel, (a + 1, a + 4097, 1001, 0, 0, cnt),
         dict(BLOCK=4096, ALIGNED16=False, HAS_SIGNAL=False, SIGNAL_OP=0, num_warps=4, **flags), ()),
        ("signal set", K._signal_kernel, (a, 1), dict(SIGNAL_OP=0, num_warps=1, **flags),
         ("fence.acq_rel.sys", "st.release.sys.global.b64")),
        ("signal add", K._signal_kernel, (a, 3), dict(SIGNAL_OP=1, num_warps=1, **flags), ("release.add",)),
        ("wait", K._wait_kernel, (a, 3, 1, 10 ** 10, err, 1, 1), dict(num_warps=1, **timer),
         ("@p ld.acquire.sys.global.b64", "%globaltimer", "bar.sync")),
        ("barrier R=4", K._barrier_kernel, (bases, 8192, state, err, 1, 4, 10 ** 10), dict(R_POW2=4, num_warps=1, **timer),
         ("fence.acq_rel.sys", "st.release.sys.global.b64", "ld.acquire.sys.global.b64", "%globaltimer")),
        ("barrier R=3", K._barrier_kernel, (bases, 8192, state, err, 0, 3, 1), dict(R_POW2=4, num_warps=1, **timer), ()),
        ("allgather aligned", K._allgather_kernel, (bases, a, 16384, 1 << 20, 256, 512, state, err, 1, 4, 10 ** 10),
         dict(BLOCK=16384, ALIGNED16=True, R_POW2=4, num_warps=8, **timer),
         ("ld.global.v4", "st.global.v4", "st.release.sys", "ld.acquire.sys.global", "%globaltimer")),
        ("allgather bytes", K._allgather_kernel, (bases, a + 3, 16384, 1001, 256, 512, state, err, 2, 3, 1),
         dict(BLOCK=4096, ALIGNED16=False, R_POW2=4, num_warps=4, **timer), ()),
        ("allgather lines", K._allgather_lines_kernel,
         (bases, a, a + 65536, 4000, 1024, 1000, state, err, 1, 4, 10 ** 10),
         dict(BLOCK=512, VEC=True, num_warps=4, **timer),
         ("ld.volatile.global.v2.b64", "%globaltimer", "st.relaxed.sys.global.b64", "ld.global.v4.b32")),
    ]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="kernels are interpreted in this process")
@pytest.mark.parametrize("case", range(11))
def test_kernels_compile_for_sm90(case):
    from conftest import sm90_compiler

    compile_for = sm90_compiler()
    name, fn, args, kwargs, needles = _variants()[case]
    kernel = compile_for(fn, args, kwargs)
    ptx = kernel.asm["ptx"]
    missing = [n for n in needles if n not in ptx]
    assert not missing, f"{name}: PTX lacks {missing}"


def test_copy_config_and_grid():
    from epcomm.kernels.shmem import CopyConfig, copy_grid, num_sms

    with pytest.raises(ValueError, match="CopyConfig: block_bytes"):
        CopyConfig(block_bytes=3000)
    with pytest.raises(ValueError, match="CopyConfig: num_warps"):
        CopyConfig(num_warps=3)
    with pytest.raises(ValueError, match="CopyConfig: min_block_bytes"):
        CopyConfig(block_bytes=1024, min_block_bytes=2048)
    cfg = CopyConfig(block_bytes=16384, num_warps=8, programs_per_sm=2, min_block_bytes=2048)
    assert num_sms(torch.device("cpu")) == 4  # a few programs for the interpreter
    assert copy_grid(1 << 30, 4, cfg) == (8, 16384, 8)  # capped at programs_per_sm * SMs
    assert copy_grid(16384, 4, cfg) == (4, 4096, 8)  # the block shrinks until every SM has work
    assert copy_grid(100, 4, cfg) == (1, 2048, 4)  # not below min_block_bytes; warps follow the block
    assert copy_grid(0, 4, cfg)[0] == 1
    assert copy_grid(1 << 30, 132, cfg) == (264, 16384, 8)  # H200: 132 SMs


# ------------------------------------------------------------------------------------------------------------
# what the subprocess runs
# ------------------------------------------------------------------------------------------------------------
def _unit() -> dict:
    from epcomm.kernels import shmem as K

    cpu = torch.device("cpu")
    failures, checked = [], 0

    def check(cond, what):
        nonlocal checked
        checked += 1
        if not cond:
            failures.append(what)

    cfg = K.CopyConfig(block_bytes=1024, num_warps=4, programs_per_sm=2, min_block_bytes=512)
    counter = torch.zeros(1, dtype=torch.int32)
    for n, s_off, d_off in ((0, 0, 0), (1, 0, 0), (15, 0, 0), (16, 0, 0), (17, 0, 0), (3 * 1024 + 5, 0, 0),
                            (70000, 0, 0), (100, 1, 0), (100, 0, 3), (5000, 7, 7)):
        src = torch.randint(0, 256, (n + 64,), dtype=torch.uint8)
        dst = torch.full((n + 64,), 0xAB, dtype=torch.uint8)
        K.launch_copy(src.data_ptr() + s_off, dst.data_ptr() + 16 + d_off, n, cpu, cfg, counter)
        check(torch.equal(dst[16 + d_off:16 + d_off + n], src[s_off:s_off + n]), f"copy n={n} offsets {s_off}/{d_off}")
        check(bool((dst[:16 + d_off] == 0xAB).all()) and bool((dst[16 + d_off + n:] == 0xAB).all()),
              f"copy n={n} wrote outside its range")
    # fused copy + signal: the flag after the data, the arrival counter back at 0 (graph replays)
    flag = torch.zeros(4, dtype=torch.int64)
    src = torch.randint(0, 256, (5000,), dtype=torch.uint8)
    dst = torch.zeros(5000, dtype=torch.uint8)
    for op, value, want in ((K.SIGNAL_SET, 7, 7), (K.SIGNAL_ADD, 5, 12), (K.SIGNAL_ADD, 1, 13)):
        K.launch_copy(src.data_ptr(), dst.data_ptr(), 5000, cpu, cfg, counter, flag.data_ptr() + 8, value, op)
        check(int(flag[1]) == want and torch.equal(dst, src), f"copy+signal op={op}: flag {flag.tolist()}")
        check(int(counter[0]) == 0, f"arrival counter left at {int(counter[0])}")
    K.launch_copy(src.data_ptr(), dst.data_ptr(), 0, cpu, cfg, counter, flag.data_ptr(), 9, K.SIGNAL_SET)
    check(int(flag[0]) == 9, "a zero-byte copy still signals")
    K.launch_signal(flag.data_ptr() + 16, 4, K.SIGNAL_SET, cpu)
    K.launch_signal(flag.data_ptr() + 16, 3, K.SIGNAL_ADD, cpu)
    check(int(flag[2]) == 7, f"signal set 4 then add 3: {int(flag[2])}")
    # waits: every comparison that holds returns without an error; one that cannot hold times out
    err = torch.zeros(8, dtype=torch.int64)
    for cmp, value in (("eq", 7), ("ne", 6), ("gt", 6), ("ge", 7), ("lt", 8), ("le", 7)):
        K.launch_wait(flag.data_ptr() + 16, K.CMP_CODES[cmp], value, 5.0, err, 3, 2, cpu)
        check(int(err[0]) == 0, f"wait {cmp} {value} on 7 reported {err.tolist()}")
    K.launch_wait(flag.data_ptr() + 16, K.CMP_CODES["gt"], 7, 0.02, err, 3, 2, cpu)
    check(err.tolist() == [K.ERR_WAIT_TIMEOUT, 3, -1, 2, 7, 7, K.CMP_GT, 0], f"wait timeout record {err.tolist()}")
    K.launch_wait(flag.data_ptr() + 24, K.CMP_CODES["eq"], 1, 0.02, err, 3, 3, cpu)
    check(int(err[3]) == 2, "the first error stays in the record")
    err.zero_()
    # barrier of rank 1 of 3 against simulated peers: three heaps, one table
    heaps = [torch.zeros(64, dtype=torch.int64) for _ in range(3)]
    bases = torch.tensor([h.data_ptr() for h in heaps], dtype=torch.int64)
    flags_off, epoch = 128, torch.zeros(1, dtype=torch.int64)
    heaps[1][16 + 0] = 1  # ranks 0 and 2 already arrived at barrier 1
    heaps[1][16 + 2] = 1
    K.launch_barrier(bases, flags_off, epoch, err, 1, 3, 5.0)
    check(int(err[0]) == 0 and int(epoch[0]) == 1, f"barrier with everyone there: {err.tolist()} epoch {epoch}")
    check(all(int(h[16 + 1]) == 1 for h in heaps), "barrier did not publish rank 1's arrival to every heap")
    check(int(heaps[0][16 + 3]) == 0, "barrier wrote past the R flags (padding lanes)")
    heaps[1][16 + 2] = 2  # rank 2 arrives at barrier 2, rank 0 does not
    K.launch_barrier(bases, flags_off, epoch, err, 1, 3, 0.02)
    check(err.tolist()[:6] == [K.ERR_BARRIER_TIMEOUT, 1, 0, -1, 2, 1], f"barrier timeout record {err.tolist()}")
    err.zero_()
    # one-rank all-gather: the local copy, the epoch and the done flag
    heap = torch.zeros(4096, dtype=torch.uint8)
    bases1 = torch.tensor([heap.data_ptr()], dtype=torch.int64)
    state = torch.zeros(2, dtype=torch.int64)
    shard = torch.randint(0, 256, (1000,), dtype=torch.uint8)
    for it in (1, 2):
        K.launch_allgather(bases1, shard.data_ptr(), 1024, 1000, 256, 512, state, err, 0, 1, 5.0, cfg)
        check(torch.equal(heap[1024:2024], shard) and state.tolist() == [it, 0] and int(err[0]) == 0,
              f"one-rank all-gather call {it}: state {state.tolist()} err {err.tolist()}")
        check(int(heap[256:264].view(torch.int64)[0]) == it and int(heap[512:520].view(torch.int64)[0]) == it,
              f"all-gather ready/done flags after call {it}")
    # line all-gather, rank 0 of 2 simulated in one process: rank 1's lines of call 1 are already in rank 0's
    # staging (slot 1, row 1); rank 0's own lines must land in rank 1's staging and every word in the output
    words, slot_words = 300, 320
    heaps = [torch.zeros(8192, dtype=torch.int64) for _ in range(2)]
    bases2 = torch.tensor([h.data_ptr() for h in heaps], dtype=torch.int64)
    stage_off, out = 512 * 8, torch.full((2, words), -7, dtype=torch.int32)
    state.zero_()
    shards = [torch.randint(-2**31, 2**31, (words,), dtype=torch.int32) for _ in range(2)]

    def stage(h, slot, row):
        first = 512 + (slot * 2 + row) * slot_words
        return heaps[h][first:first + words]

    stage(0, 1, 1).copy_((1 << 32) | (shards[1].to(torch.int64) & 0xFFFFFFFF))
    K.launch_allgather_lines(bases2, shards[0].data_ptr(), out.data_ptr(), 4 * words, stage_off, slot_words, state,
                             err, 0, 2, 5.0, 4)
    check(int(err[0]) == 0 and state.tolist() == [1, 0], f"line all-gather: err {err.tolist()} state {state.tolist()}")
    check(torch.equal(out[0], shards[0]) and torch.equal(out[1], shards[1]), "line all-gather output")
    check(torch.equal(stage(1, 1, 0), (1 << 32) | (shards[0].to(torch.int64) & 0xFFFFFFFF)),
          "line all-gather: rank 0's lines in rank 1's staging")
    # call 2 (slot 0): rank 1's lines never come, one of them is stale: a timeout naming rank 1, no hang
    stage(0, 0, 1).copy_((2 << 32) | 5)
    stage(0, 0, 1)[words - 1] = (0 << 32) | 5
    K.launch_allgather_lines(bases2, shards[0].data_ptr(), out.data_ptr(), 4 * words, stage_off, slot_words, state,
                             err, 0, 2, 0.02, 4)
    check(err.tolist()[:6] == [K.ERR_DONE_TIMEOUT, 0, 1, -1, 2, 0], f"line all-gather timeout record {err.tolist()}")
    err.zero_()
    # epochs past 2**31 (lines carry the low 32 bits): call 2**31 with one stale line of call 2**31 - 2, whose
    # sign-extended epoch is larger than the current one's, times out; call 2**31 + 1 then completes
    def line_tag(e):
        tag = (e & 0xFFFFFFFF) << 32
        return tag - (1 << 64) if tag >= 1 << 63 else tag

    state[0] = 2**31 - 1
    stage(0, 0, 1).copy_(line_tag(2**31) | (shards[1].to(torch.int64) & 0xFFFFFFFF))
    stage(0, 0, 1)[7] = line_tag(2**31 - 2) | 5
    K.launch_allgather_lines(bases2, shards[0].data_ptr(), out.data_ptr(), 4 * words, stage_off, slot_words, state,
                             err, 0, 2, 0.02, 4)
    check(err.tolist()[:6] == [K.ERR_DONE_TIMEOUT, 0, 1, -1, 2**31, 2**31 - 2],
          f"line all-gather past 2**31: a stale line must time out, record {err.tolist()}")
    err.zero_()
    out.fill_(-7)
    stage(0, 1, 1).copy_(line_tag(2**31 + 1) | (shards[1].to(torch.int64) & 0xFFFFFFFF))
    K.launch_allgather_lines(bases2, shards[0].data_ptr(), out.data_ptr(), 4 * words, stage_off, slot_words, state,
                             err, 0, 2, 5.0, 4)
    check(int(err[0]) == 0 and torch.equal(out[1], shards[1]) and int(state[0]) == 2**31 + 1,
          f"line all-gather past 2**31: err {err.tolist()} state {state.tolist()}")
    return {"failures": failures, "checked": checked, "interpreted": K.interpreted()}


def _ranks() -> dict:
    from epcomm.shmem.checks import run_all
    from epcomm.testing import spawn

    results = spawn(run_all, 3, device="cpu", timeout_s=500)
    failures = [f"rank {r} {name}: {f}" for r, res in enumerate(results) for name, v in res.items()
                for f in v["failures"]]
    ran = sorted(name for name, v in results[0].items() if "skipped" not in v)
    import tempfile

    from epcomm.bench import allgather

    with tempfile.TemporaryDirectory() as out:  # the all-gather benchmark end to end (needs the kernels)
        rc = allgather.main(["--world-size", "2", "--sizes", "4K", "--iters", "1", "--warmup", "1", "--out", out])
    return {"failures": failures, "ran": ran, "bench_allgather": rc}


if __name__ == "__main__":
    result = {"unit": _unit, "ranks": _ranks}[sys.argv[1]]()
    print(json.dumps(result))
