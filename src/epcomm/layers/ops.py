"""Building blocks shared by the expert-parallel layer and its dense reference: the router, the SwiGLU
expert and the straight-through roundings (FP8 quantise-dequantise, bfloat16)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..fp8 import per_token_cast_back, per_token_cast_to_fp8
from .config import MoEConfig


class _RoundSTE(torch.autograd.Function):
    """Forward: a rounding ``fn(x)``; backward: the identity (straight-through)."""

    @staticmethod
    def forward(ctx, x, fn):
        return fn(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def fp8_qdq(x: torch.Tensor) -> torch.Tensor:
    """``per_token_cast_back(per_token_cast_to_fp8(x))`` in ``x.dtype``: what the experts see with
    ``fp8_dispatch``."""
    q, s = per_token_cast_to_fp8(x)
    return per_token_cast_back(q, s, x.dtype)


def fp8_qdq_ste(x: torch.Tensor) -> torch.Tensor:
    """``fp8_qdq`` with a straight-through gradient (as the layer's dispatch backward gives)."""
    return _RoundSTE.apply(x, fp8_qdq)


def bf16_round_ste(x: torch.Tensor) -> torch.Tensor:
    """Round to bfloat16 and back to ``x.dtype`` with a straight-through gradient."""
    return _RoundSTE.apply(x, lambda t: t.to(torch.bfloat16).to(t.dtype))


def glu(gate_up: torch.Tensor) -> torch.Tensor:
    """The SwiGLU activation of ``[..., 2F]`` gate/up projections: ``silu(gate) * up``, ``[..., F]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One SwiGLU MLP: ``(silu(x W_gate^T) * x W_up^T) W2^T`` with ``w13 = [W_gate; W_up]``."""
    return F.linear(glu(F.linear(x, w13)), w2)


def route(x: torch.Tensor, router_weight: torch.Tensor, config: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_idx [N, K] int64, topk_weights [N, K] float32)``: logits in float32, softmax or sigmoid
    scores, the top-k, optionally divided by their sum (plus 1e-20)."""
    logits = F.linear(x.float(), router_weight.float())
    scores = logits.softmax(dim=-1) if config.router == "softmax" else logits.sigmoid()
    weights, idx = torch.topk(scores, config.topk, dim=-1)
    if config.normalize_topk:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return idx, weights
