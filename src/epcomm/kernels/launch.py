"""Kernel launches at the least host cost (shared by every launcher in ``epcomm.kernels``).

Each launch through Triton binds the arguments, works out what to specialise on and looks the compiled
kernel up: about 10-40 us of host time per launch on the GPU machines, more than a small put or a decode
step's kernel takes on the device. A ``Launcher`` does that once per *variant* and then calls the compiled
kernel's launch function directly, with the arguments in signature order, exactly what ``JITFunction.run``
would pass (Triton's launch hooks, when a profiler sets them, still run). Tensors go to it as their device
addresses (the integers its pointer parameters take): Triton's launcher would otherwise call each tensor's
``data_ptr()`` again and ask the driver about every pointer (``cuPointerGetAttribute``), a few microseconds per
pointer and 20-40 us for a kernel with a dozen tensors. That driver query is what refused a CPU tensor; the
variant's first launch still takes Triton's path (and its check), and every caller here passes tensors of the
current device (the Buffer checks the caller's tensors).

A variant is everything Triton's compiled-kernel cache depends on (Triton 3.x):

* the current device (a compiled kernel is loaded per device);
* the constexpr values and the launch options (``num_warps``, ``enable_fp_fusion``, ...);
* per runtime argument: a tensor's dtype and whether its address is a multiple of 16; an integer's width
  (i32, i64 or u64 by value), and unless the parameter is ``do_not_specialize``, whether it equals 1 (Triton
  turns a 1 into a constant) and whether it is a multiple of 16; a bool or a float by its type.

``tests/test_launch.py`` checks this key against Triton's own specialisation. Under the interpreter, with
``FAST_LAUNCH = False`` and with Triton older than 3.4 every launch takes Triton's normal path.

``compile_only()``: within the block, launches compile (or load from Triton's cache) the variant they would run
and load it onto the device, without running anything; the next real launch of it costs no compilation. The
transports use it to compile a call's kernels before any rank's kernel starts waiting (compilation time differs
between ranks and must not count against the device timeouts), ``Buffer.warmup`` to compile whole
configurations, several variants at once on a pool of threads (Triton's compiler releases the GIL).

Co-residency. A GPU runs a launch's programs as SMs free up; nothing guarantees that every program of a launch
runs at the same time, least of all while other kernels (a GEMM, a tensor-parallel collective, another
micro-batch's communication) hold SMs. So a program may wait for another program of its own launch only if
the kernel is launched *cooperatively* (``launch_cooperative_grid=True``, a Triton launch option: CUDA starts
all programs together or refuses the launch) with a grid that fits the GPU at once. The grid of such a launch
is a function of what fits: ``launch(kernel, lambda resident: grid, ...)``, where ``resident`` is how many
programs of the compiled kernel the GPU holds at once (``resident_programs``: occupancy per SM times SMs;
None under the interpreter, which runs programs one after another in id order). Kernels launched so: the
fused low-latency kernel (every program waits for the flag the last one releases) and the streaming dispatch
(receivers wait for the pushers of their launch). Every other waiting kernel waits only for flags written by
other launches. Either way every wait also times out from a start its own program takes (``kernels.shmem``),
so a kernel whose peer never runs still ends, with an error. On a device without cooperative launches (or one
that refuses them) the launch goes on without the option, with a warning: waits then still end, by timeout.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any, Callable, Optional, Union

import torch

try:  # Triton >= 3.4: the launch path this module calls directly (checked on the GPU machines with 3.6)
    from triton import knobs as _knobs
except ImportError:  # older Triton: every launch goes through Triton
    _knobs = None

FAST_LAUNCH = True  # False: always go through Triton's argument binding (for debugging)

log = logging.getLogger(__name__)
Grid = Union[tuple, Callable[[Optional[int]], tuple]]  # a grid, or a function of the programs that fit at once

_I32 = (-(1 << 31), (1 << 31) - 1)
_I64_MAX = (1 << 63) - 1


_ahead: Optional[list] = None  # inside compile_only(): (launcher, key, kwargs, compiled or future) to load


def one_variant(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-D rows, made by slicing at offsets a call's data decides), or a copy of it where a kernel would take
    it for another variant than a fresh tensor of its shape (``arg_key``, and the row stride where a launcher passes
    it): a row stride other than its width (torch's ``contiguous`` keeps a view of one row or none as it is, with the
    wider buffer's stride) or a start that is not 16-byte aligned. Such a variant would be compiled and loaded in the
    middle of a call, where loading waits for the device (``transports.faults``)."""
    dense = t.stride(0) == t.size(1) and (t.size(1) <= 1 or t.stride(1) == 1)
    if dense and (t.numel() == 0 or t.data_ptr() % 16 == 0):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def arg_key(value: Any, specialize: bool = True):
    """What Triton specialises a runtime argument ``value`` on, as a hashable key (a ``torch.dtype`` stands for a
    16-byte aligned tensor of that dtype)."""
    if isinstance(value, torch.dtype):
        return value, True
    if hasattr(value, "data_ptr"):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return bool
    if isinstance(value, int):
        width = 32 if _I32[0] <= value <= _I32[1] else 64 if value <= _I64_MAX else 65
        if not specialize:
            return width
        return width, value == 1, value % 16 == 0
    if isinstance(value, float):
        return float
    return type(value), value  # None and other constants: by value


class Launcher:
    """Launches one ``@triton.jit`` kernel, caching its compiled variants (see the module docstring).

    ``launcher(grid, args, kwargs)``: ``grid`` a tuple of 1-3 ints (or a function of the programs that fit at once,
    returning one: "Co-residency"), ``args`` the runtime arguments in
    signature order (every constexpr parameter must come after them), ``kwargs`` the constexpr values by
    name plus launch options; the same as ``kernel[grid](*args, **kwargs)``."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self._compiled: dict = {}
        self._fits: dict = {}  # variant key -> programs the GPU holds at once (grid functions, cooperative launches)
        self._layout = None  # (specialize flag per runtime parameter, (name, default) per constexpr)

    def _fast(self) -> bool:  # a JITFunction (the interpreter's kernels and test stand-ins have no params)
        return FAST_LAUNCH and _knobs is not None and hasattr(self.kernel, "params")

    def _check_keywords(self, kwargs: dict) -> None:
        if not hasattr(self.kernel, "fn"):
            return
        params = inspect.signature(self.kernel.fn).parameters.values()
        runtime = [p.name for p in params if "constexpr" not in str(p.annotation) and p.name in kwargs]
        if runtime:
            raise TypeError(f"Launcher: pass {self.kernel.fn.__name__}'s runtime arguments {runtime} by position "
                            "(only constexprs and launch options by keyword)")

    def _params(self):
        if self._layout is None:
            params = self.kernel.params
            runtime = [p for p in params if not p.is_constexpr]
            consts = [(p.name, p.default) for p in params if p.is_constexpr]
            if any(p.is_constexpr for p in params[:len(runtime)]):
                raise TypeError(f"Launcher: {self.kernel.fn.__name__} has a constexpr before a runtime parameter; "
                                "the fast path needs every constexpr last")
            if any(p.do_not_specialize_on_alignment for p in runtime):
                raise TypeError(f"Launcher: {self.kernel.fn.__name__} uses do_not_specialize_on_alignment, "
                                "which this launcher does not model")
            self._layout = (tuple(not p.do_not_specialize for p in runtime), tuple(consts))
        return self._layout

    def arguments(self, args: tuple, kwargs: dict) -> tuple:
        """What the fast path hands the compiled kernel: ``args``, then every constexpr's value (its default
        when not in ``kwargs``) in signature order."""
        return tuple(args) + tuple(kwargs.get(name, default) for name, default in self._params()[1])

    def _key(self, device: int, args: tuple, kwargs: dict) -> tuple:
        return self._bind(device, args, kwargs)[0]

    def _bind(self, device: int, args: tuple, kwargs: dict) -> tuple:
        """``(variant key, args with every tensor replaced by its address)`` in one pass over ``args``."""
        keys, values = [], []
        for a, s in zip(args, self._params()[0]):
            if isinstance(a, torch.Tensor):
                ptr = a.data_ptr()
                keys.append((a.dtype, ptr % 16 == 0))  # arg_key's key of a tensor
                values.append(ptr)
            else:
                keys.append(arg_key(a, s))
                values.append(a)
        return (device, tuple(kwargs.items()), tuple(keys)), values

    def _check_arity(self, args: tuple) -> None:
        if len(args) != len(self._params()[0]):
            raise TypeError(f"Launcher: {self.kernel.fn.__name__} takes {len(self._params()[0])} runtime arguments, "
                            f"got {len(args)}")

    def _store(self, key: tuple, kwargs: dict, compiled) -> None:
        if hasattr(compiled, "result"):  # compiled on a thread pool (compile_only)
            compiled = compiled.result()
        compiled._init_handles()  # load it onto the device now, not at its first launch
        self._compiled[key] = _entry(compiled, self.arguments((), kwargs))

    def _compile(self, grid: Grid, args: tuple, kwargs: dict) -> None:
        """``compile_only()``'s part of a launch: compile the variant, launch nothing."""
        self._check_keywords(kwargs)
        grid = grid if isinstance(grid, tuple) else (1,)  # compiling does not depend on the grid
        if not self._fast():
            self.kernel.warmup(*args, grid=grid, **kwargs)  # Triton keeps it (the interpreter: nothing to do)
            return
        kwargs = _usable_options(kwargs, _current_device())
        self._check_arity(args)
        key = self._key(_current_device(), args, kwargs)
        if key not in self._compiled and not any(other is self and k == key for other, k, _, _ in _ahead):
            _ahead.append((self, key, kwargs, self.kernel.warmup(*args, grid=grid, **kwargs)))

    def __call__(self, grid: Grid, args: tuple, kwargs: dict) -> None:
        if _ahead is not None:
            self._compile(grid, args, kwargs)
            return
        if not self._fast():
            self._check_keywords(kwargs)
            if not isinstance(grid, tuple):
                grid = grid(self._slow_resident(args, kwargs))
            self.kernel[grid](*args, **kwargs)
            return
        device = _current_device()
        cooperative = kwargs.get("launch_cooperative_grid", False)
        if cooperative:
            kwargs = _usable_options(kwargs, device)
        key, values = self._bind(device, args, kwargs)
        entry = self._compiled.get(key)
        try:
            if entry is None:  # first launch of this variant: Triton binds, compiles (or loads) and launches
                self._check_keywords(kwargs)
                self._check_arity(args)
                if not isinstance(grid, tuple) or kwargs.get("launch_cooperative_grid"):
                    compiled = self.kernel.warmup(*args, grid=(1,), **kwargs)  # the grid depends on what fits
                    compiled._init_handles()
                    grid = self._fit(grid, resident_programs(compiled, device), kwargs)
                compiled = self.kernel[grid](*args, **kwargs)
                self._compiled[key] = _entry(compiled, self.arguments((), kwargs))
                return
            compiled, run, direct, function, packed, tail = entry
            if not isinstance(grid, tuple) or cooperative:
                grid = self._fit(grid, self._resident(key, compiled, device), kwargs)
            g = grid + (1, 1)
            if _hooks_set(_knobs.runtime.launch_enter_hook) or _hooks_set(_knobs.runtime.launch_exit_hook):
                compiled[g[:3]](*args, *tail)  # a profiler's launch hooks are set: let Triton call them
                return
            if direct is not None:
                c_launch, coop, pdl = direct
                c_launch(g[0], g[1], g[2], _current_stream(device), function, coop, pdl, None, None, packed, None, None,
                         None, *values, *tail)
                return
            run(g[0], g[1], g[2], _current_stream(device), function, packed, None, None, None, *values, *tail)
        except RuntimeError as exc:
            if not kwargs.get("launch_cooperative_grid") or not _refuse_cooperative(device, exc):
                raise
            self(grid, args, kwargs)  # again, without the option

    def _fit(self, grid: Grid, resident: int, kwargs: dict) -> tuple:
        """The grid of a launch whose kernel holds ``resident`` programs at once on this GPU: ``grid(resident)`` for
        a grid function; a cooperative grid must fit."""
        if not isinstance(grid, tuple):
            grid = grid(resident)
        if kwargs.get("launch_cooperative_grid") and _programs(grid) > resident:
            raise ValueError(f"Launcher: a cooperative launch of {self.kernel.fn.__name__} with {_programs(grid)} "
                             f"programs; this GPU holds at most {resident} of them at once (pass a grid function)")
        return grid

    def _resident(self, key: tuple, compiled, device: int) -> int:
        resident = self._fits.get(key)
        if resident is None:
            resident = self._fits[key] = resident_programs(compiled, device)
        return resident

    def _slow_resident(self, args: tuple, kwargs: dict) -> Optional[int]:
        """``resident`` for a grid function outside the fast path: None under the interpreter (it runs programs one
        after another), else from the compiled kernel."""
        if not hasattr(self.kernel, "params") or type(self.kernel).__name__ == "InterpretedFunction":
            return None
        compiled = self.kernel.warmup(*args, grid=(1,), **kwargs)
        compiled._init_handles()
        return resident_programs(compiled, _current_device())


def _entry(compiled, tail: tuple) -> tuple:
    """A cached variant: ``(compiled, its runner, direct, function, packed metadata, constexpr tail)``. ``direct``:
    ``(the launcher's C launch function, cooperative, pdl)`` when the runner is Triton 3.x's ``CudaLauncher`` and the
    kernel needs no scratch memory (its runner's Python wrapper then only forwards the call), else None."""
    run = compiled.run
    c_launch = getattr(run, "launch", None)
    direct = None
    if (type(run).__name__ == "CudaLauncher" and callable(c_launch) and getattr(run, "global_scratch_size", 1) == 0
            and getattr(run, "profile_scratch_size", 1) == 0):
        direct = (c_launch, run.launch_cooperative_grid, run.launch_pdl)
    return compiled, run, direct, compiled.function, compiled.packed_metadata, tail


@contextlib.contextmanager
def compile_only(threads: int = 1):
    """Within the block, every ``Launcher`` launch compiles (or loads from Triton's cache) its variant instead
    of running it; at the end of the block the variants are loaded onto the current device, so that their
    launches afterwards cost no compilation. ``threads`` > 1 compiles that many variants at once (Triton's
    ``AsyncCompileMode``; sequentially where this Triton lacks it). Host code in the block runs as usual, so it
    must not read results of the kernels it does not launch. Not reentrant."""
    global _ahead
    if _ahead is not None:
        raise RuntimeError("compile_only: already inside compile_only()")
    pool = mode = None
    if threads > 1:
        try:
            from concurrent.futures import ThreadPoolExecutor

            from triton.runtime._async_compile import AsyncCompileMode
        except ImportError:
            pass
        else:
            pool = ThreadPoolExecutor(threads, thread_name_prefix="epcomm-compile")
            mode = AsyncCompileMode(pool)
    _ahead = []
    try:
        with mode if mode is not None else contextlib.nullcontext():
            yield
        for launcher, key, kwargs, compiled in _ahead:
            launcher._store(key, kwargs, compiled)
    finally:
        _ahead = None
        if pool is not None:
            pool.shutdown()


def _hooks_set(hook) -> bool:
    """A Triton launch hook is set (``None`` or an empty ``HookChain``: not set)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _current_device() -> int:
    return torch._C._cuda_getDevice()


def _current_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


_LAUNCHERS: dict = {}  # id(kernel) -> its Launcher


def launch(kernel, grid: Grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)`` through the kernel's ``Launcher`` (runtime arguments positional,
    constexprs and options by keyword). ``grid``: a tuple, or a function of the programs the GPU holds at once
    (module docstring, "Co-residency")."""
    launcher = _LAUNCHERS.get(id(kernel))  # (by id: hashing a JITFunction costs microseconds per launch)
    if launcher is None or launcher.kernel is not kernel:
        launcher = _LAUNCHERS[id(kernel)] = Launcher(kernel)
    launcher(grid, args, kwargs)


# ---------------------------------------------------------------------------------------------------------
# Co-residency (module docstring)
# ---------------------------------------------------------------------------------------------------------
def programs_per_sm(regs_per_thread: int, threads: int, shared_bytes: int, regs_per_sm: int = 65536,
                    threads_per_sm: int = 2048, shared_per_sm: int = 233472, max_programs: int = 32,
                    reg_unit: int = 256, shared_reserved: int = 1024) -> int:
    """How many programs of ``threads`` threads, ``regs_per_thread`` registers each and ``shared_bytes`` of shared
    memory one SM holds at once (CUDA's occupancy rules: registers are allocated per warp in units of
    ``reg_unit``, each program reserves ``shared_reserved`` bytes of shared memory; defaults: sm_90). The fallback
    of ``resident_programs`` where the driver cannot be asked."""
    warps = -(-max(threads, 1) // 32)
    regs_per_warp = -(-max(regs_per_thread, 1) * 32 // reg_unit) * reg_unit
    by_regs = (regs_per_sm // regs_per_warp) // warps
    by_threads = threads_per_sm // (warps * 32)
    by_shared = shared_per_sm // (shared_bytes + shared_reserved)
    return max(0, min(max_programs, by_regs, by_threads, by_shared))


def resident_programs(compiled, device: int) -> int:
    """How many programs of ``compiled`` (a Triton kernel loaded on GPU ``device``) the GPU holds at once: the
    driver's occupancy per SM (``cuOccupancyMaxActiveBlocksPerMultiprocessor``, what bounds a cooperative launch)
    times the SMs this process sees (under MPS, its share), or ``programs_per_sm`` from the kernel's registers,
    shared memory and warps where the driver cannot be asked."""
    threads = 32 * compiled.metadata.num_warps
    shared = compiled.metadata.shared
    props = torch.cuda.get_device_properties(device)
    per_sm = _driver_occupancy(compiled.function, threads, shared)
    if per_sm is None:
        per_sm = programs_per_sm(compiled.n_regs, threads, shared,
                                 getattr(props, "regs_per_multiprocessor", 65536),
                                 getattr(props, "max_threads_per_multi_processor", 2048),
                                 getattr(props, "shared_memory_per_multiprocessor", 233472))
    return max(1, per_sm) * props.multi_processor_count


def _programs(grid: tuple) -> int:
    n = 1
    for g in grid:
        n *= g
    return n


_CUDA_LIB: list = []  # [libcuda handle or None], loaded once
_COOPERATIVE: dict = {}  # device -> whether cooperative launches are used there


def _libcuda():
    if not _CUDA_LIB:
        import ctypes

        try:
            _CUDA_LIB.append(ctypes.CDLL("libcuda.so.1"))
        except OSError:
            _CUDA_LIB.append(None)
    return _CUDA_LIB[0]


def _driver_occupancy(function: int, threads: int, shared: int) -> Optional[int]:
    """Programs of the loaded kernel ``function`` (a CUfunction) one SM holds at once, or None."""
    import ctypes

    lib = _libcuda()
    if lib is None:
        return None
    n = ctypes.c_int(0)
    rc = lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), ctypes.c_void_p(function),
                                                         ctypes.c_int(threads), ctypes.c_size_t(shared))
    return n.value if rc == 0 else None


def cooperative_launches(device: int) -> bool:
    """Whether launches on GPU ``device`` use ``launch_cooperative_grid`` (the device supports it and has not
    refused one)."""
    ok = _COOPERATIVE.get(device)
    if ok is None:
        import ctypes

        ok, lib = True, _libcuda()
        if lib is not None:
            handle, value = ctypes.c_int(0), ctypes.c_int(1)
            if lib.cuDeviceGet(ctypes.byref(handle), ctypes.c_int(device)) == 0 and lib.cuDeviceGetAttribute(
                    ctypes.byref(value), ctypes.c_int(95), handle) == 0:  # CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH
                ok = bool(value.value)
        if not ok:
            log.warning("GPU %d does not support cooperative launches: kernels whose programs wait for each other are "
                        "launched without the guarantee that they all run at once (their waits still time out)",
                        device)
        _COOPERATIVE[device] = ok
    return ok


def _usable_options(kwargs: dict, device: int) -> dict:
    """``kwargs`` without ``launch_cooperative_grid`` where this device does not take cooperative launches (left out,
    not False: the launch is then the same variant as one that never asked)."""
    if kwargs.get("launch_cooperative_grid") and not cooperative_launches(device):
        kwargs = {k: v for k, v in kwargs.items() if k != "launch_cooperative_grid"}
    return kwargs


def _refuse_cooperative(device: int, exc: Exception) -> bool:
    """A cooperative launch on ``device`` failed with ``exc`` (a device or an MPS client that does not take them, or
    a grid larger than the driver allows there): stop using them on that device and return True (launch again
    without); False if they were already off (the failure is something else)."""
    if not _COOPERATIVE.get(device, True):
        return False
    _COOPERATIVE[device] = False
    log.warning("GPU %d refused a cooperative launch (%s): kernels whose programs wait for each other are launched "
                "without the guarantee that they all run at once from now on (their waits still time out)", device,
                exc)
    return True


def next_pow2(v: int) -> int:
    """The smallest power of two >= ``v`` (1 for ``v <= 1``); ``triton.next_power_of_2`` costs microseconds
    of host time per call."""
    return 1 << max(0, (max(1, v) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host integers (``triton.cdiv`` costs microseconds of host time per call)."""
    return -(-a // b)


def _interpreter_patches_once() -> None:
    """Under the Triton interpreter (``TRITON_INTERPRET=1``: the CPU tests), a device function's call no longer patches
    ``triton.language`` again when the launch that runs it already has. The interpreter patches the language's
    builtins at each launch (and undoes it at its end), and again at every call of a ``@triton.jit`` helper inside it
    (``_patch_lang``: a walk over every member of the language's modules, ~1 ms a call). That second walk changes
    nothing: the members are already the launch's (not builtins any more, so it leaves them), as long as the helper
    sees no language module the launch's function did not (then it patches as before). Device functions are called
    thousands of times per test; their results are the same. Does nothing outside the interpreter, or where Triton's
    interpreter has no such function."""
    if _knobs is None or not getattr(getattr(_knobs, "runtime", None), "interpret", False):
        return
    from triton.runtime import interpreter

    patch, empty = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "_LangPatchScope", None)
    if patch is None or empty is None or getattr(patch, "epcomm_once", False):
        return
    patched: list = []  # per launch in progress: the language modules its patch covered

    def languages(fn) -> set:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v.__name__.startswith("triton.lang")}

    class _Scope:
        def __init__(self, scope) -> None:
            self.scope = scope

        def restore(self) -> None:
            patched.pop()
            self.scope.restore()

    def once(fn):
        if patched and languages(fn) <= patched[-1]:
            return empty()  # (what a walk that patched nothing returns; Triton never restores a helper's scope)
        scope = patch(fn)
        if patched:  # (a helper that sees another module: patched as Triton would, covered from here on)
            patched[-1] |= languages(fn)
            return scope
        patched.append(languages(fn))
        return _Scope(scope)

    once.epcomm_once, once.__wrapped__ = True, patch
    interpreter._patch_lang = once


_interpreter_patches_once()
