"""Kernel launches at the least host cost (shared by every launcher in ``epcomm.kernels``).

Each launch through Triton binds the arguments, works out what to specialise on and looks the compiled
kernel up: about 10-40 us of host time per launch on the GPU machines, more than a small put or a decode
step's kernel takes on the device. A ``Launcher`` does that once per *variant* and then calls the compiled
kernel's launch function directly, with the arguments in signature order, exactly what ``JITFunction.run``
would pass (Triton's launch hooks, when a profiler sets them, still run).

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
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Optional

import torch

try:  # Triton >= 3.4: the launch path this module calls directly (checked on the GPU machines with 3.6)
    from triton import knobs as _knobs
except ImportError:  # older Triton: every launch goes through Triton
    _knobs = None

FAST_LAUNCH = True  # False: always go through Triton's argument binding (for debugging)

_I32 = (-(1 << 31), (1 << 31) - 1)
_I64_MAX = (1 << 63) - 1


_ahead: Optional[list] = None  # inside compile_only(): (launcher, key, kwargs, compiled or future) to load


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

    ``launcher(grid, args, kwargs)``: ``grid`` a tuple of 1-3 ints, ``args`` the runtime arguments in
    signature order (every constexpr parameter must come after them), ``kwargs`` the constexpr values by
    name plus launch options; the same as ``kernel[grid](*args, **kwargs)``."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self._compiled: dict = {}
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
        return device, tuple(kwargs.items()), tuple(arg_key(a, s) for a, s in zip(args, self._params()[0]))

    def _check_arity(self, args: tuple) -> None:
        if len(args) != len(self._params()[0]):
            raise TypeError(f"Launcher: {self.kernel.fn.__name__} takes {len(self._params()[0])} runtime arguments, "
                            f"got {len(args)}")

    def _store(self, key: tuple, kwargs: dict, compiled) -> None:
        if hasattr(compiled, "result"):  # compiled on a thread pool (compile_only)
            compiled = compiled.result()
        compiled._init_handles()  # load it onto the device now, not at its first launch
        self._compiled[key] = (compiled, compiled.run, compiled.function, compiled.packed_metadata,
                               self.arguments((), kwargs))

    def _compile(self, grid: tuple, args: tuple, kwargs: dict) -> None:
        """``compile_only()``'s part of a launch: compile the variant, launch nothing."""
        self._check_keywords(kwargs)
        if not self._fast():
            self.kernel.warmup(*args, grid=grid, **kwargs)  # Triton keeps it (the interpreter: nothing to do)
            return
        self._check_arity(args)
        key = self._key(_current_device(), args, kwargs)
        if key not in self._compiled and not any(other is self and k == key for other, k, _, _ in _ahead):
            _ahead.append((self, key, kwargs, self.kernel.warmup(*args, grid=grid, **kwargs)))

    def __call__(self, grid: tuple, args: tuple, kwargs: dict) -> None:
        if _ahead is not None:
            self._compile(grid, args, kwargs)
            return
        if not self._fast():
            self._check_keywords(kwargs)
            self.kernel[grid](*args, **kwargs)
            return
        device = _current_device()
        key = self._key(device, args, kwargs)
        entry = self._compiled.get(key)
        if entry is None:  # first launch of this variant: Triton binds, compiles (or loads) and launches
            self._check_keywords(kwargs)
            self._check_arity(args)
            compiled = self.kernel[grid](*args, **kwargs)
            self._compiled[key] = (compiled, compiled.run, compiled.function, compiled.packed_metadata,
                                   self.arguments((), kwargs))
            return
        compiled, run, function, packed, tail = entry
        g = grid + (1, 1)
        if _hooks_set(_knobs.runtime.launch_enter_hook) or _hooks_set(_knobs.runtime.launch_exit_hook):
            compiled[g[:3]](*args, *tail)  # a profiler's launch hooks are set: let Triton call them
            return
        run(g[0], g[1], g[2], _current_stream(device), function, packed, None, None, None, *args, *tail)


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


_LAUNCHERS: dict = {}


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)`` through the kernel's ``Launcher`` (runtime arguments positional,
    constexprs and options by keyword)."""
    launcher = _LAUNCHERS.get(kernel)
    if launcher is None:
        launcher = _LAUNCHERS[kernel] = Launcher(kernel)
    launcher(grid, args, kwargs)


def next_pow2(v: int) -> int:
    """The smallest power of two >= ``v`` (1 for ``v <= 1``); ``triton.next_power_of_2`` costs microseconds
    of host time per call."""
    return 1 << max(0, (max(1, v) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host integers (``triton.cdiv`` costs microseconds of host time per call)."""
    return -(-a // b)
