"""Ordered row reduction: the combine epilogue of the copy-based transports.

``out[t] = cast(sum over r = 0..R-1 with slot[t, r] >= 0 of float32(buf[slot[t, r]]) + bias0[t] + bias1[t])``,
added in that order starting from +0.0, so results are bit-identical to ``epcomm.reference.combine``.
One program handles one token and one block of columns; each row of ``buf`` is read once."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .numerics import f32_to_bf16_rne


@triton.jit
def _reduce_rows_kernel(buf_ptr, slot_ptr, b0_ptr, b1_ptr, out_ptr, hidden, buf_stride, b0_stride, b1_stride,
                        out_stride, NUM_SLOTS: tl.constexpr, HAS_B0: tl.constexpr, HAS_B1: tl.constexpr,
                        OUT_BF16: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(NUM_SLOTS):
        slot = tl.load(slot_ptr + token * NUM_SLOTS + r).to(tl.int64)
        # a masked-out slot adds +0.0, which leaves acc unchanged (acc is never -0.0: it starts at +0.0)
        v = tl.load(buf_ptr + slot * buf_stride + cols, mask=col_mask & (slot >= 0), other=0.0)
        acc += v.to(tl.float32)
    if HAS_B0:
        acc += tl.load(b0_ptr + token * b0_stride + cols, mask=col_mask, other=0.0).to(tl.float32)
    if HAS_B1:
        acc += tl.load(b1_ptr + token * b1_stride + cols, mask=col_mask, other=0.0).to(tl.float32)
    if OUT_BF16:
        result = f32_to_bf16_rne(acc)
    else:
        result = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + token * out_stride + cols, result, mask=col_mask)


def reduce_rows(buf: torch.Tensor, slot: torch.Tensor, bias: tuple = (), out_dtype: Optional[torch.dtype] = None,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``buf [S, H]`` rows, ``slot [N, R]`` int32/int64 row numbers (-1 = absent), up to two ``[N, H]``
    biases -> ``out [N, H]`` of ``out_dtype`` (default ``buf.dtype``)."""
    n, num_slots = slot.shape
    hidden = buf.size(1)
    if out is None:
        out = torch.empty(n, hidden, dtype=out_dtype or buf.dtype, device=buf.device)
    if n == 0 or hidden == 0:
        return out
    if buf.size(0) == 0:  # nothing came back: the sum is the bias alone
        buf = torch.zeros(1, hidden, dtype=buf.dtype, device=buf.device)
    slot = slot.contiguous()
    b0 = bias[0] if len(bias) > 0 else None
    b1 = bias[1] if len(bias) > 1 else None
    block = min(1024, triton.next_power_of_2(hidden))
    grid = (n, triton.cdiv(hidden, block))
    _reduce_rows_kernel[grid](
        buf, slot, b0 if b0 is not None else buf, b1 if b1 is not None else buf, out, hidden, buf.stride(0),
        b0.stride(0) if b0 is not None else 0, b1.stride(0) if b1 is not None else 0, out.stride(0),
        NUM_SLOTS=num_slots, HAS_B0=b0 is not None, HAS_B1=b1 is not None,
        OUT_BF16=out.dtype == torch.bfloat16, BLOCK=block,
        num_warps=4 if block >= 512 else 1)
    return out
