"""Per-token, per-128-channel FP8 (e4m3) casts, as DeepEP and DeepGEMM use them.

For each token and each group of 128 channels: ``amax = max(|x|)`` floored at 1e-4,
``scale = amax * fl32(1 / 448)`` (or, with ``round_scale``, the power of two ``2**ceil(log2(that))``),
``x_fp8 = e4m3(x * scale_inv)`` with ``scale_inv = 448 / amax`` (a correctly rounded float32 division;
exactly ``2**-e`` when rounded). Every step is a correctly rounded float32 multiply or tensor-by-tensor
division, so CPUs, GPUs and Triton kernels agree bit for bit (a division by a Python scalar is not used:
CUDA turns it into a multiply by the reciprocal).
With ``use_ue8m0`` the (power-of-two) scales are returned as their biased exponent bytes, four packed per
int32 little-endian (group ``4i`` in the low byte of word ``i``), as DeepGEMM's UE8M0 layout expects.

These functions are the definition: the reference, every transport and every kernel that casts must give
bit-identical results.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4
GROUP = 128
FP8_DTYPE = torch.float8_e4m3fn


def _ceil_log2(v: torch.Tensor) -> torch.Tensor:
    """Exact ``ceil(log2(v))`` for positive finite float32 ``v`` (int32)."""
    mantissa, exponent = torch.frexp(v)  # v = mantissa * 2**exponent, mantissa in [0.5, 1)
    return torch.where(mantissa == 0.5, exponent - 1, exponent).to(torch.int32)


FP8_MAX_INV = float(torch.tensor(1.0 / FP8_MAX, dtype=torch.float32))  # fl32(1/448)


def fp8_scales(amax: torch.Tensor, round_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, scale_inv)`` float32 from float32 ``amax`` (already floored)."""
    scale = amax * FP8_MAX_INV
    if round_scale:
        e = _ceil_log2(scale).to(torch.float32)
        return torch.exp2(e), torch.exp2(-e)
    return scale, torch.div(torch.full_like(amax, FP8_MAX), amax)


def per_token_cast_to_fp8(x: torch.Tensor, round_scale: bool = False, use_ue8m0: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast ``x [N, H]`` (bf16/fp16/fp32, H divisible by 128) to ``(x_fp8 [N, H] float8_e4m3fn,
    scales)``; scales are ``[N, H/128]`` float32, or with ``use_ue8m0`` ``[N, ceil(H/512)]`` int32 packed
    exponent bytes (``use_ue8m0`` implies ``round_scale``)."""
    if x.dim() != 2 or x.size(1) % GROUP != 0:
        raise ValueError(f"per_token_cast_to_fp8: x must be [num_tokens, hidden] with hidden divisible by "
                         f"{GROUP}; got shape {tuple(x.shape)}")
    if not x.is_floating_point() or x.dtype == FP8_DTYPE:
        raise TypeError(f"per_token_cast_to_fp8: x must be bf16, fp16 or fp32; got {x.dtype}")
    n, h = x.shape
    xf = x.float().view(n, h // GROUP, GROUP)
    amax = xf.abs().amax(dim=2).clamp(min=FP8_AMAX_FLOOR)
    scale, scale_inv = fp8_scales(amax, round_scale or use_ue8m0)
    x_fp8 = (xf * scale_inv.unsqueeze(2)).to(FP8_DTYPE).view(n, h)
    if use_ue8m0:
        return x_fp8, pack_ue8m0(scale)
    return x_fp8, scale


def pack_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Pack power-of-two float32 scales ``[N, G]`` into ``[N, ceil(G/4)]`` int32 exponent bytes."""
    n, g = scale.shape
    exp_byte = ((scale.view(torch.int32) >> 23) & 0xFF).to(torch.int32)
    pad = (-g) % 4
    if pad:
        exp_byte = torch.nn.functional.pad(exp_byte, (0, pad))
    b = exp_byte.view(n, exp_byte.size(1) // 4, 4)
    packed = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    return packed.to(torch.int32)


def unpack_ue8m0(packed: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Inverse of ``pack_ue8m0``: ``[N, ceil(G/4)]`` int32 -> ``[N, G]`` float32 powers of two."""
    n = packed.size(0)
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int32, device=packed.device)
    exp_byte = (packed.unsqueeze(-1) >> shifts) & 0xFF
    exp_byte = exp_byte.reshape(n, -1)[:, :num_groups]
    return (exp_byte << 23).to(torch.int32).view(torch.float32)


def per_token_cast_back(x_fp8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
                        ) -> torch.Tensor:
    """Dequantise ``(x_fp8 [N, H], scales)`` (float32 ``[N, H/128]`` or packed UE8M0 int32) to ``dtype``."""
    if x_fp8.dim() != 2 or x_fp8.size(1) % GROUP != 0:
        raise ValueError(f"per_token_cast_back: x_fp8 must be [num_tokens, hidden] with hidden divisible by "
                         f"{GROUP}; got shape {tuple(x_fp8.shape)}")
    n, h = x_fp8.shape
    g = h // GROUP
    if scales.dtype == torch.int32:
        scales = unpack_ue8m0(scales, g)
    if scales.shape != (n, g):
        raise ValueError(f"per_token_cast_back: scales must be [{n}, {g}]; got {tuple(scales.shape)}")
    return (x_fp8.float().view(n, g, GROUP) * scales.float().unsqueeze(2)).view(n, h).to(dtype)
