"""Helpers shared by kernels, exact on the GPU and under the Triton interpreter alike."""

import triton
import triton.language as tl


@triton.jit
def f32_to_bf16_rne(x):
    """float32 -> bfloat16, round to nearest even (what torch's ``.to(torch.bfloat16)`` does).

    Written with integer operations because the Triton interpreter truncates in ``.to(tl.bfloat16)``;
    on the GPU this matches ``cvt.rn.bf16.f32`` bit for bit (NaN stays a quiet NaN, overflow gives inf)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    quiet_nan = (bits >> 16) | 0x40
    return tl.where(x != x, quiet_nan, rounded).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def pick(vec, lanes, i):
    """Element ``i`` (a run-time or compile-time lane) of the 1-D ``vec`` as a scalar (``lanes = tl.arange(0,
    len)``)."""
    return tl.sum(tl.where(lanes == i, vec, 0))
