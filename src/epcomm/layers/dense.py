"""``DenseMoE``: the single-process reference of ``epcomm.layers.MoE`` in plain torch.

All E experts are local; routing, FP8 quantisation and the weighted sum are written out directly (a loop
over experts, vectorised over tokens) so that the expert-parallel layer can be checked against it, values
and gradients. It is also what ``MoE.from_dense`` copies its weights from.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import MoEConfig
from .ops import bf16_round_ste, fp8_qdq_ste, route, swiglu
from .weights import init_expert_weights, init_router_weight, init_shared_weights


class DenseMoE(nn.Module):
    """Every expert in one process; same parameters (names, layouts, initial values) as the
    expert-parallel ``MoE`` built from the same config and seed.

    ``forward(x, topk_idx=None, topk_weights=None, low_latency_rounding=False)``: with routing given it is
    used instead of the router (``-1`` entries select nothing). ``low_latency_rounding`` applies the
    roundings the low-latency path makes (expert outputs and the result in bfloat16, straight-through
    gradients), so the low-latency path can be compared tightly. Computation happens in the parameters'
    dtype (call ``.float()`` for an FP32 reference of a BF16 model)."""

    def __init__(self, config: MoEConfig, seed: int = 0, device="cpu") -> None:
        super().__init__()
        self.config = config
        self.router_weight = nn.Parameter(init_router_weight(config, seed, device))
        w13, w2 = init_expert_weights(config, seed, range(config.num_experts), device)
        self.w13, self.w2 = nn.Parameter(w13), nn.Parameter(w2)
        shared = init_shared_weights(config, seed, device)
        if shared is not None:
            self.shared_w13, self.shared_w2 = nn.Parameter(shared[0]), nn.Parameter(shared[1])
        else:
            self.shared_w13 = self.shared_w2 = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(x, self.router_weight, self.config)

    def forward(self, x: torch.Tensor, topk_idx=None, topk_weights=None, low_latency_rounding: bool = False
                ) -> torch.Tensor:
        if topk_idx is None:
            topk_idx, topk_weights = self.route(x)
        dtype = self.w13.dtype
        x = x.to(dtype)
        xin = fp8_qdq_ste(x) if self.config.fp8_dispatch else x
        acc = torch.zeros(x.size(0), x.size(1), dtype=torch.float32, device=x.device)
        for e in range(self.config.num_experts):
            rows, slots = torch.nonzero(topk_idx == e, as_tuple=True)
            y = swiglu(xin[rows], self.w13[e], self.w2[e])
            if low_latency_rounding:
                y = bf16_round_ste(y)
            acc = acc.index_add(0, rows, y.float() * topk_weights[rows, slots].float().unsqueeze(1))
        if low_latency_rounding:
            acc = bf16_round_ste(acc)
        out = acc.to(dtype)
        if self.shared_w13 is not None:
            out = out + swiglu(x, self.shared_w13, self.shared_w2)
        return out
