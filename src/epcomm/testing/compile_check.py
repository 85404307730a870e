"""Compile the Triton kernels that a run under the interpreter launched, for a GPU, without one.

The Triton interpreter runs a kernel's Python: it cannot see errors that only the compiler reports (a value
defined in one run-time branch and used in another, a type mismatch in a branch the interpreter never
takes, the inline-PTX branches it skips). ``record_launches()`` notes every kernel launch of a block of code
run under ``TRITON_INTERPRET=1`` as (module, kernel, argument types, constexpr values, options);
``compile_launches()``, in a process *without* the interpreter, compiles each distinct launch for
``sm_90`` (H100/H200) with its GPU-only branches on (``USE_PTX``/``USE_TIMER`` set), down to a cubin:
Triton ships the compiler and ``ptxas``, so no GPU or CUDA toolkit is needed.
"""

from __future__ import annotations

import contextlib
import importlib

_DTYPES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.int64": "i64",
           "torch.int32": "i32", "torch.int16": "i16", "torch.int8": "i8", "torch.uint8": "u8", "torch.bool": "i1",
           "torch.float8_e4m3fn": "fp8e4nv"}
GPU_FLAGS = ("USE_PTX", "USE_TIMER")  # constexprs that select inline PTX / the GPU timer


def _describe(value):
    """A launch argument as something picklable: ('T', dtype) for a tensor, else the value."""
    import torch

    if isinstance(value, torch.Tensor):
        return ("T", str(value.dtype))
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


def compile_launches(launches: list, arch: int = 90) -> list[str]:
    """Compile every distinct launch in ``launches`` (from ``record_launches``) for ``sm_<arch>``; returns one
    message per kernel that failed to compile (empty: all compiled). Run without ``TRITON_INTERPRET``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failures, seen = [], set()
    for module, name, args, kwargs in launches:
        fn = getattr(importlib.import_module(module), name)
        bound = dict(zip(fn.arg_names, args))
        bound.update({k: v for k, v in kwargs.items() if k in fn.arg_names})
        options = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages", "enable_fp_fusion")}
        signature, constexprs = {}, {}
        for i, p in enumerate(fn.params):
            value = bound.get(p.name, p.default)
            if p.is_constexpr:
                value = True if p.name in GPU_FLAGS else value
                signature[p.name] = "constexpr"
                constexprs[(i,)] = value
            elif isinstance(value, tuple) and value[:1] == ("T",):
                signature[p.name] = "*" + _DTYPES[value[1]]
            elif isinstance(value, bool):
                signature[p.name] = "i1"
            elif isinstance(value, int):
                signature[p.name] = "i32" if -2**31 <= value < 2**31 else "i64"
            elif isinstance(value, float):
                signature[p.name] = "fp32"
            else:
                raise TypeError(f"compile_launches: {name}: argument {p.name} = {value!r} has no Triton type")
        consts = tuple(sorted((k[0], repr(v)) for k, v in constexprs.items()))
        key = (module, name, tuple(sorted(signature.items())), consts, tuple(sorted(options.items())))
        if key in seen:
            continue
        seen.add(key)
        try:
            triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", arch, 32), options=options)
        except Exception as exc:  # noqa: BLE001 - reported, with the kernel's name
            failures.append(f"{module}.{name}: {type(exc).__name__}: {str(exc)[-2000:]}")
    return failures


__all__ = ["record_launches", "compile_launches"]
