"""The cached kernel launcher (`epcomm.kernels.launch`): its variant key separates exactly what Triton
specialises on, and it reuses a compiled kernel only for a launch of the same variant. CPU only: Triton's
argument binder runs without a GPU; the compiled kernel is a stand-in that records its launches."""

import itertools

import pytest

triton = pytest.importorskip("triton")
import torch  # noqa: E402
import triton.language as tl  # noqa: E402

from epcomm.kernels import launch as L  # noqa: E402


@triton.jit(do_not_specialize=["b"])
def _probe(p, a, b, C: tl.constexpr, D: tl.constexpr = 3):
    pass


def _triton_specialization(args):
    """Triton's own specialisation of ``_probe``'s runtime arguments (the binder a launch uses)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    binder = create_function_from_signature(_probe.signature, _probe.params, make_backend(GPUTarget("cuda", 90, 32)))
    _, spec, _ = binder(*args, C=1)
    return tuple(spec[:3])


INTS = [0, 1, 2, 15, 16, 17, 48, -1, -16, -17, 2**31 - 1, 2**31, 2**31 + 16, -2**31, -2**31 - 1, 2**40 + 3,
        2**63 - 16, 2**63, 2**64 - 16]


def _tensors():
    base = torch.zeros(64, dtype=torch.float32)
    return [base, base[1:], base[4:], base.view(torch.int8)[16:], base.view(torch.int8)[3:],
            torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.int64)]


@pytest.mark.parametrize("position", ["pointer", "int", "int_do_not_specialize"])
def test_key_separates_what_triton_specialises(position):
    """Two values share a key exactly when Triton specialises them the same way (no stale compiled kernel
    is reused, and no needless recompilation)."""
    values = _tensors() if position == "pointer" else INTS
    index, specialize = {"pointer": (0, True), "int": (1, True), "int_do_not_specialize": (2, False)}[position]
    default = [torch.zeros(4), 5, 7]
    seen = []
    for v in values:
        args = list(default)
        args[index] = v
        seen.append((L.arg_key(v, specialize), _triton_specialization(args)[index]))
    for (k1, s1), (k2, s2) in itertools.combinations(seen, 2):
        assert (k1 == k2) == (s1 == s2), (k1, s1, k2, s2)


class _Compiled:
    def __init__(self, log, variant):
        self.log, self.variant = log, variant
        self.function, self.packed_metadata = f"function{variant}", "packed"

    def run(self, g0, g1, g2, stream, function, packed, metadata, enter_hook, exit_hook, *args):
        assert (stream, function, packed, metadata, enter_hook, exit_hook) == (
            "stream0", f"function{self.variant}", "packed", None, None, None)
        self.log.append(("fast", self.variant, (g0, g1, g2), args))


class _Kernel:
    """Stands in for a JITFunction: ``kernel[grid](...)`` records a slow launch and returns a compiled kernel."""

    def __init__(self):
        self.params, self.fn, self.log = _probe.params, _probe.fn, []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("slow", grid, args, kwargs))
            return _Compiled(self.log, len(self.log))
        return run


def _no_gpu(monkeypatch):
    monkeypatch.setattr(L, "_current_device", lambda: 0)
    monkeypatch.setattr(L, "_current_stream", lambda device: f"stream{device}")


def test_launcher_reuses_a_variant_and_recompiles_on_a_new_one(monkeypatch):
    _no_gpu(monkeypatch)
    kernel = _Kernel()
    launcher = L.Launcher(kernel)
    t = torch.zeros(16)
    launcher((4,), (t, 32, 5), {"C": 2, "num_warps": 4})
    launcher((8, 2), (t, 64, 9), {"C": 2, "num_warps": 4})  # same variant: 64 is a multiple of 16 too
    assert [e[0] for e in kernel.log] == ["slow", "fast"]
    # the compiled kernel gets every argument in signature order (a tensor as its address), constexprs (and D's
    # default) last
    assert kernel.log[1] == ("fast", 1, (8, 2, 1), (t.data_ptr(), 64, 9, 2, 3))
    launcher((4,), (t, 33, 5), {"C": 2, "num_warps": 4})  # 33: not a multiple of 16
    launcher((4,), (t, 1, 5), {"C": 2, "num_warps": 4})  # 1: a constant for Triton
    launcher((4,), (t[1:], 32, 5), {"C": 2, "num_warps": 4})  # not 16-byte aligned
    launcher((4,), (t, 32, 5), {"C": 2, "num_warps": 8})  # another option
    launcher((4,), (t, 32, 2**40), {"C": 2, "num_warps": 4})  # a 64-bit integer
    assert [e[0] for e in kernel.log] == ["slow", "fast"] + ["slow"] * 5
    launcher((4,), (t, 48, 6), {"C": 2, "num_warps": 4})
    assert kernel.log[-1][:2] == ("fast", 1)


class CudaLauncher:
    """Stands in for Triton 3.x's runner of a compiled kernel: a Python wrapper around the C ``launch``."""

    def __init__(self, log, scratch):
        self.log, self.global_scratch_size, self.profile_scratch_size = log, scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = True, False

    def launch(self, *args):
        self.log.append(("direct", args))

    def __call__(self, *args):
        self.log.append(("wrapper", args))


@pytest.mark.parametrize("scratch", [0, 64])
def test_launcher_calls_tritons_c_launch_directly(monkeypatch, scratch):
    """With Triton's CUDA runner and no scratch memory, a cached variant's launch skips the runner's Python wrapper
    and hands the C launch function what the wrapper would: grid, stream, function, the cooperative and PDL flags,
    no scratch, the packed metadata, no launch metadata or hooks, then the arguments (tensors as addresses)."""
    _no_gpu(monkeypatch)
    kernel = _Kernel()
    launcher = L.Launcher(kernel)
    t = torch.zeros(16)
    launcher((4,), (t, 32, 5), {"C": 2})
    runner = CudaLauncher(kernel.log, scratch)
    compiled, _, _, function, packed, tail = launcher._compiled[next(iter(launcher._compiled))]
    launcher._compiled = {k: L._entry(type("C", (), {"run": runner, "function": function, "packed_metadata": packed})(),
                                      tail) for k in launcher._compiled}
    launcher((8, 2), (t, 48, 6), {"C": 2})
    if scratch:  # the wrapper allocates the scratch: it must run
        assert kernel.log[-1] == ("wrapper", (8, 2, 1, "stream0", function, packed, None, None, None,
                                              t.data_ptr(), 48, 6, 2, 3))
    else:
        assert kernel.log[-1] == ("direct", (8, 2, 1, "stream0", function, True, False, None, None, packed, None,
                                             None, None, t.data_ptr(), 48, 6, 2, 3))


def test_launcher_refuses_runtime_arguments_by_keyword(monkeypatch):
    _no_gpu(monkeypatch)
    launcher = L.Launcher(_Kernel())
    with pytest.raises(TypeError, match=r"Launcher: pass _probe's runtime arguments \['b'\] by position"):
        launcher((1,), (torch.zeros(4), 16), {"b": 3, "C": 1})
    monkeypatch.setattr(L, "FAST_LAUNCH", False)  # the checked path is the same without the cache
    with pytest.raises(TypeError, match="by position"):
        launcher((1,), (torch.zeros(4), 16), {"b": 3, "C": 1})


def test_launch_hooks_take_tritons_path(monkeypatch):
    """When a profiler sets Triton's launch hooks, launches go through the compiled kernel's own runner."""
    from triton import knobs

    _no_gpu(monkeypatch)
    kernel = _Kernel()
    launcher = L.Launcher(kernel)
    t = torch.zeros(16)
    launcher((4,), (t, 32, 5), {"C": 2})
    calls = []
    monkeypatch.setattr(_Compiled, "__getitem__", lambda self, grid: lambda *args: calls.append((grid, args)),
                        raising=False)
    hook = knobs.HookChain()
    hook.add(lambda metadata: None)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
    launcher((4,), (t, 32, 5), {"C": 2})
    assert calls == [((4, 1, 1), (t, 32, 5, 2, 3))] and len(kernel.log) == 1


def test_compile_only_compiles_without_launching(monkeypatch):
    """Inside ``compile_only()`` a launch compiles its variant and runs nothing; the launch after it takes the
    cached path at once (what lets the transports compile a call's kernels before any rank waits). A dtype
    stands for an aligned tensor of that dtype."""
    _no_gpu(monkeypatch)
    kernel = _Kernel()
    loaded = []
    monkeypatch.setattr(_Compiled, "_init_handles", lambda self: loaded.append(self.variant), raising=False)
    kernel.warmup = lambda *args, grid, **kwargs: kernel.log.append(("warmup", grid, args)) or _Compiled(kernel.log, 0)
    launcher = L.Launcher(kernel)
    t = torch.zeros(16)
    with L.compile_only():
        launcher((4,), (torch.float32, 32, 5), {"C": 2})
        launcher((4,), (t, 48, 6), {"C": 2})  # the same variant: compiled once
        assert loaded == []  # loaded onto the device when the block ends
    assert [e[0] for e in kernel.log] == ["warmup"] and loaded == [0]
    launcher((4,), (t, 32, 5), {"C": 2})
    assert kernel.log[-1] == ("fast", 0, (4, 1, 1), (t.data_ptr(), 32, 5, 2, 3))
    with pytest.raises(RuntimeError, match="already inside"):
        with L.compile_only():
            with L.compile_only():
                pass


def test_waiting_kernels_do_not_specialise_on_per_call_counts():
    """A kernel that waits for peers must run the variant every rank compiled ahead (``compile_then_meet``,
    ``Buffer.warmup``): an integer that differs between ranks or calls (token and row counts, chunk bounds, the
    timeout) must not select a new variant, or a rank would compile inside the device timeout."""
    pytest.importorskip("triton")
    from epcomm.kernels import ep, expert_major, reduce, shmem

    per_call = {"n", "t_begin", "t_end", "cap", "num_push", "out_rows", "rows_out", "num_rows", "timeout",
                "value", "slot"}  # (an all-gather's shard size is the same on every rank)
    kernels = [ep.exchange_kernel, ep.dispatch_push_kernel, ep.dispatch_copyout_kernel, ep.dispatch_kernel,
               expert_major.em_dispatch_kernel, expert_major.em_push_kernel, expert_major.em_copyout_kernel,
               ep.combine_push_kernel, reduce._reduce_kernel, shmem._wait_kernel, shmem._barrier_kernel,
               shmem._allgather_kernel, shmem._allgather_lines_kernel]
    for kernel in kernels:
        specialised = [p.name for p in kernel.params if p.name in per_call and not p.do_not_specialize]
        assert not specialised, f"{kernel.fn.__name__} specialises on {specialised}"


@pytest.mark.parametrize("num_rows", [0, 3])
def test_pack_passes_addresses_that_select_one_variant(monkeypatch, num_rows):
    """The portable transport's pack takes its buffers' addresses as integers: an empty buffer's address (0) would
    be a 32-bit argument, another variant of the kernel, compiled and loaded in the middle of a call (where loading
    waits for the device, so for any collective that hangs there). Every pack passes 64-bit addresses."""
    import types

    from epcomm.kernels import ep
    from epcomm.transports.alltoall import AllToAllTransport

    seen = {}
    monkeypatch.setattr(ep, "launch_push", lambda **kw: seen.update(kw))
    fake = types.SimpleNamespace(_zero_bases={}, _errors=torch.zeros(4, dtype=torch.int32), rank=0)
    n = 1 if num_rows else 0
    x, itr = torch.zeros(n, 8, dtype=torch.bfloat16), torch.ones(n, 3, dtype=torch.bool)
    rows, recs = AllToAllTransport._pack(fake, x, None, None, None, itr, None, None, 4, num_rows)
    assert rows.shape == (num_rows, 4) and recs.size(0) == num_rows
    assert L.arg_key(seen["area_off"]) == L.arg_key(seen["meta_off"]) == L.arg_key(1 << 40), seen


_INTERPRETED_HELPERS = """
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

from epcomm.kernels import launch  # (installs the patch)

walks = [0]
walk = interpreter._patch_builtin


def counted(*args, **kwargs):
    walks[0] += 1
    return walk(*args, **kwargs)


interpreter._patch_builtin = counted


@triton.jit
def _twice(v):
    return v * 2


@triton.jit
def _kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + i, mask=i < n)
    for _ in tl.static_range(3):
        v = _twice(v)
    tl.store(y_ptr + i, v, mask=i < n)


load = tl.load
out = []
for patch in (interpreter._patch_lang, interpreter._patch_lang.__wrapped__):
    interpreter._patch_lang = patch
    x, y = torch.arange(37, dtype=torch.float32), torch.full((37,), -1.0)
    walks[0] = 0
    _kernel[(5,)](x, y, 37, BLOCK=8)
    out.append((torch.equal(y, x * 8), walks[0], tl.load is load))
print(out)
"""


def test_interpreter_patches_the_language_once_per_launch():
    """Under the Triton interpreter a device function's call does not walk the language's members again (the launch
    that runs it patched them): the same results, the language restored after the launch, one walk per launch instead
    of one more per helper call (5 programs x 3 calls here)."""
    import ast
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", _INTERPRETED_HELPERS], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    (once_ok, once, once_restored), (every_ok, every, every_restored) = ast.literal_eval(run.stdout.strip())
    assert once_ok and every_ok and once_restored and every_restored
    assert once > 0 and every == once * (1 + 5 * 3), (once, every)
