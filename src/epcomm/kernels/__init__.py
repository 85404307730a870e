"""Triton kernels and their launchers. Nothing here talks to ``torch.distributed``.

Importing this package never fails: ``triton_available()`` says whether Triton can be used at all, and
each launcher is only called by transports after checking it."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when Triton imports (GPU machines; on CPUs only with the interpreter, TRITON_INTERPRET=1)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "no Triton"
        return False
    return True


def use_kernels(t) -> bool:
    """Triton kernels for work on tensor ``t``: on GPUs, and on CPUs under the Triton interpreter (tests); torch
    operations otherwise."""
    if not triton_available():
        return False
    if t.is_cuda:
        return True
    from .shmem import interpreted

    return interpreted()
