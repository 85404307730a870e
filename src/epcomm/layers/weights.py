"""Deterministic initialisation shared by the expert-parallel layer and its dense reference.

Every tensor comes from its own ``torch.Generator`` seeded from ``(seed, what)``: the router, the shared
experts and each routed expert ``e`` separately. A rank therefore generates exactly its own experts' weights
(no rank materialises all E experts) and still holds the same values as a single-process model built from
the same seed. Values are drawn in float32 on ``device`` and then cast; generators on different device types
draw different numbers, so compare models initialised on the same device type.

Layout (the ``nn.Linear`` ``[out, in]`` convention):
    router_weight: ``[E, H]`` float32.
    w13: ``[E, 2F, H]``: rows ``0..F-1`` are the gate projection, rows ``F..2F-1`` the up projection.
    w2: ``[E, H, F]``: the down projection.
    shared_w13 ``[2 S F, H]`` and shared_w2 ``[H, S F]``: the shared-expert MLP (S = num_shared_experts).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

_ROUTER, _SHARED, _EXPERT0 = 0, 1, 16


def _generator(seed: int, stream: int, device) -> torch.Generator:
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed((int(seed) * 1_000_003 + stream) % (1 << 62))
    return gen


def _randn(shape, std: float, gen: torch.Generator, device, dtype) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype)


def init_router_weight(config, seed: int, device="cpu") -> torch.Tensor:
    """``[E, H]`` float32, std ``H ** -0.5``."""
    gen = _generator(seed, _ROUTER, device)
    return _randn((config.num_experts, config.hidden), config.hidden ** -0.5, gen, device, torch.float32)


def init_expert_weights(config, seed: int, experts: Iterable[int], device="cpu",
                        dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w13 [n, 2F, H], w2 [n, H, F])`` of the given global expert ids, in ``config.dtype``."""
    dtype = dtype or config.dtype
    h, f = config.hidden, config.ffn_hidden
    experts = list(experts)
    w13 = torch.empty(len(experts), 2 * f, h, dtype=dtype, device=device)
    w2 = torch.empty(len(experts), h, f, dtype=dtype, device=device)
    for i, e in enumerate(experts):
        gen = _generator(seed, _EXPERT0 + e, device)
        w13[i] = _randn((2 * f, h), h ** -0.5, gen, device, dtype)
        w2[i] = _randn((h, f), f ** -0.5, gen, device, dtype)
    return w13, w2


def init_shared_weights(config, seed: int, device="cpu", dtype: Optional[torch.dtype] = None
                        ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``(shared_w13 [2 S F, H], shared_w2 [H, S F])`` or None without shared experts."""
    fs = config.shared_ffn_hidden
    if fs == 0:
        return None
    dtype = dtype or config.dtype
    gen = _generator(seed, _SHARED, device)
    h = config.hidden
    return _randn((2 * fs, h), h ** -0.5, gen, device, dtype), _randn((h, fs), fs ** -0.5, gen, device, dtype)
