"""Compile the Triton kernels that a run under the interpreter launched, for a GPU, without one.

The Triton interpreter runs a kernel's Python: it cannot see errors that only the compiler reports (a value
defined in one run-time branch and used in another, a type mismatch in a branch the interpreter never
takes, the inline-PTX branches it skips). ``record_launches()`` notes every kernel launch of a block of code
run under ``TRITON_INTERPRET=1`` as (module, kernel, argument types, constexpr values, options);
``compile_launches()``, in a process *without* the interpreter, compiles each distinct launch for
``sm_90`` (H100/H200) with its GPU-only branches on (``USE_PTX``/``USE_TIMER`` set), down to a cubin:
Triton ships the compiler and ``ptxas``, so no GPU or CUDA toolkit is needed. ``offline_compiler()`` is the
compiler both use (the shmem kernel tests call it with hand-written launches).
"""

from __future__ import annotations

import contextlib
import importlib

GPU_FLAGS = ("USE_PTX", "USE_TIMER")  # constexprs that select inline PTX / the GPU timer


def _describe(value):
    """A launch argument as something picklable: ('T', dtype) for a tensor, else the value."""
    import torch

    if isinstance(value, torch.Tensor):
        return ("T", str(value.dtype))
    return value


def _rebuild(value):
    """The inverse of ``_describe``: a one-element CPU tensor of the described dtype (compiling needs only
    its dtype and alignment), else the value."""
    import torch

    if isinstance(value, tuple) and value[:1] == ("T",):
        return torch.empty(1, dtype=getattr(torch, value[1].split(".")[1]))
    return value


@contextlib.contextmanager
def record_launches(into: list):
    """Within the block, append ``(module, kernel name, args, kwargs)`` of every interpreted launch to
    ``into`` (tensors described by their dtype). Needs ``TRITON_INTERPRET=1`` when the kernels were imported."""
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        into.append((self.fn.__module__, self.fn.__name__, tuple(_describe(a) for a in args),
                     {k: _describe(v) for k, v in kwargs.items()}))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        yield into
    finally:
        InterpretedFunction.run = original


def offline_compiler(arch: int = 90):
    """A function ``compile_for(kernel, args, kwargs)`` that compiles a ``@triton.jit`` kernel for
    ``sm_<arch>`` with the arguments of a launch (CPU tensors stand in for device ones; constexprs and
    options such as ``num_warps`` as keywords), binding and specialising them as a launch would, down to a
    cubin. Uses Triton internals (3.x); callers skip when it raises."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)

    def pack(fn, args, kwargs):
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        return fn._pack_args(backend, kwargs, bound, specialization, options)

    def compile_for(fn, args, kwargs):
        options, signature, constexprs, attrs = pack(fn, args, kwargs)
        return triton_compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)

    def key(fn, args, kwargs) -> str:
        """What the compiled code depends on: two launches with the same key compile to the same code."""
        options, signature, constexprs, attrs = pack(fn, args, kwargs)
        return repr((sorted(signature.items()), sorted(constexprs.items(), key=repr), sorted(attrs.items(), key=repr),
                     sorted(options.__dict__.items(), key=repr)))

    compile_for.key = key
    return compile_for


def compile_launches(launches: list, arch: int = 90, share: tuple = (0, 1)) -> list[str]:
    """Compile every distinct launch in ``launches`` (from ``record_launches``) for ``sm_<arch>``, with
    ``USE_PTX``/``USE_TIMER`` on; returns one message per launch that failed to compile (empty: all
    compiled). Launches that specialise alike (the same kernel, argument types, specialisations, constexprs and
    options: e.g. other token counts) compile once. ``share = (i, n)``: only the ``i``-th of every ``n`` distinct
    kernels, so that ``n`` processes share the work. Run without ``TRITON_INTERPRET``."""
    compile_for = offline_compiler(arch)
    failures, seen = [], set()
    for module, name, args, kwargs in launches:
        fn = getattr(importlib.import_module(module), name)
        kw = {k: True if k in GPU_FLAGS else _rebuild(v) for k, v in kwargs.items()}
        rebuilt = [_rebuild(v) for v in args]
        try:
            key = (module, name, compile_for.key(fn, rebuilt, kw))
        except Exception:  # noqa: BLE001 - compiled (and reported) below
            key = (module, name, repr(args), repr(sorted(kwargs.items())))
        if key in seen:
            continue
        seen.add(key)
        if (len(seen) - 1) % share[1] != share[0]:
            continue
        try:
            compile_for(fn, rebuilt, kw)
        except Exception as exc:  # noqa: BLE001 - reported, with the kernel's name
            failures.append(f"{module}.{name}: {type(exc).__name__}: {str(exc)[-2000:]}")
    return failures


__all__ = ["record_launches", "compile_launches", "offline_compiler"]
