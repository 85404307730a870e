"""The local experts: SwiGLU MLPs over the rows a rank received, as one grouped GEMM or a loop.

Three layouts arrive from the communication:

* normal mode, expert-major (the default, ``Buffer.dispatch(..., layout="expert_major")``): ``recv_x [rows,
  H]`` already grouped by local expert, every group starting at a multiple of ``ALIGN`` and padded with zero
  rows, with its int32 group ends: the grouped GEMMs read it as it is (``expert_major_act``, ``expert_major_down``);
  the weighting and the reduction per token happen in the combine.
* normal mode, rank-major (``MoEConfig.normal_layout="rank_major"``, the earlier path): ``recv_x [M, H]``
  with ``recv_topk_idx [M, K]`` local expert ids (-1: not here). The
  (row, slot) pairs are sorted by expert, the rows gathered (``[T, H]``, T = pairs), the experts run on
  contiguous groups and each output row is scaled by its routing weight and summed back into its row.
* low-latency mode: ``recv_x [E_local, C, H]`` with ``recv_count [E_local]`` valid rows per expert (C = R * T
  slots, the rest padding). The grouped path compacts the valid rows into at most
  ``R * T * min(K, E_local)`` rows plus alignment (sync-free, fixed size) and runs one grouped GEMM; the
  fallback is a batched matmul over the padded slabs (padding rows are zero, so their outputs are zero).

For the grouped GEMM every expert's group is padded with zero rows to a multiple of ``ALIGN`` = 8.

``torch._grouped_mm(a [T, K], b [G, K, N], offs=int32 cumulative ends [G])`` is used where available:
CUDA, bfloat16, SM90+ in auto mode (it also runs on CPUs in recent torch, which the tests use). Nothing
here synchronises with the host except the normal-mode loop, which reads the host counts the dispatch
already returned.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
import torch.nn.functional as F

from .ops import glu, swiglu

log = logging.getLogger("epcomm.layers")

# Rows of each expert group given to torch._grouped_mm are padded to a multiple of ALIGN (16 bytes of bf16):
# its weight gradient contracts over the rows, and the CUDA kernels want 16-byte-aligned group starts there.
ALIGN = 8


def grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


# What torch says when its build or the GPU has no grouped GEMM for a dtype (checked in message text: torch raises
# plain RuntimeError / NotImplementedError for these, as for real failures).
_UNSUPPORTED = ("only supported", "not supported", "is not implemented", "not implemented for", "could not run",
                "unsupported")


def grouped_mm_unsupported(exc: BaseException) -> bool:
    """Whether ``exc`` from ``torch._grouped_mm`` says it is unsupported here (build, GPU or dtype), as opposed to
    a real failure (out of memory, a CUDA error, a bug), which must propagate."""
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    if isinstance(exc, NotImplementedError):
        return True
    text = str(exc).lower()
    if "no kernel image" in text:  # a build without code for this GPU
        return True
    if "out of memory" in text or "illegal" in text or "device-side assert" in text or "cuda error" in text:
        return False
    return isinstance(exc, RuntimeError) and any(s in text for s in _UNSUPPORTED)


def probe_grouped_mm(device: torch.device, dtype: torch.dtype, run=None) -> tuple[bool, str]:
    """Run a tiny grouped GEMM (2 groups of 8 rows, 16 x 16, forward and backward) once: ``(True, reason)`` when
    it works, ``(False, reason)`` when torch says it is unsupported here (``grouped_mm_unsupported``); any other
    error propagates. ``run`` replaces the probe (tests)."""
    def default_run():
        a = torch.zeros(16, 16, dtype=dtype, device=device, requires_grad=True)
        b = torch.zeros(2, 16, 16, dtype=dtype, device=device, requires_grad=True)
        out = torch._grouped_mm(a, b, offs=torch.tensor([8, 16], dtype=torch.int32, device=device))
        out.backward(torch.ones_like(out))

    try:
        (run or default_run)()
    except (RuntimeError, NotImplementedError) as exc:
        if not grouped_mm_unsupported(exc):
            raise
        first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        log.warning("MoE: torch._grouped_mm is unsupported on %s with %s (%s: %s); the experts run as a loop",
                    device, dtype, type(exc).__name__, first)
        return False, f"auto: torch._grouped_mm unsupported here ({type(exc).__name__})"
    return True, "auto: torch._grouped_mm"


def choose_grouped_gemm(requested, device: torch.device, dtype: torch.dtype, hidden: int, ffn: int) -> tuple[bool, str]:
    """Whether to use ``torch._grouped_mm`` and why (``requested``: None = auto, True, False)."""
    if requested is False:
        return False, "grouped_gemm=False"
    aligned = hidden % 8 == 0 and ffn % 8 == 0
    if requested is True:
        if not grouped_mm_available():
            raise RuntimeError(f"MoE: grouped_gemm=True but torch {torch.__version__} has no torch._grouped_mm; "
                               f"set grouped_gemm=None (auto) or False")
        if not aligned:
            raise ValueError(f"MoE: grouped_gemm=True needs hidden and ffn_hidden divisible by 8 (16-byte rows); "
                             f"got {hidden}, {ffn}")
        return True, "grouped_gemm=True"
    if not grouped_mm_available():
        return False, "auto: torch._grouped_mm missing"
    if device.type != "cuda" or dtype != torch.bfloat16:
        return False, f"auto: grouped GEMM only on CUDA with bf16 (here {device.type}, {dtype})"
    if torch.cuda.get_device_capability(device) < (9, 0):
        return False, "auto: torch._grouped_mm needs SM90+"
    if not aligned:
        return False, "auto: hidden/ffn_hidden not divisible by 8"
    return probe_grouped_mm(device, dtype)


def grouped_swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """SwiGLU of the row groups of ``x [T, H]`` (group g = rows ``offs[g-1] .. offs[g]-1``) with expert g's
    ``w13 [G, 2F, H]``, ``w2 [G, H, F]``. Rows past ``offs[-1]`` are undefined."""
    return torch._grouped_mm(_grouped_act(x, w13, offs), w2.transpose(1, 2), offs=offs)


def _grouped_act(x: torch.Tensor, w13: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``glu`` of the row groups' gate/up projections, ``[T, F]`` (the first half of ``grouped_swiglu``)."""
    return glu(torch._grouped_mm(x, w13.transpose(1, 2), offs=offs))


def loop_swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """SwiGLU of consecutive row groups of sizes ``counts`` (host ints) of ``x [T, H]``. Every expert runs,
    also on zero rows, so the control flow (and what autograd saves) is the same on every rank."""
    chunks = torch.split(x, list(counts), dim=0)
    return torch.cat([swiglu(c, w13[e], w2[e]) for e, c in enumerate(chunks)], dim=0)


def expert_major_act(recv_x: torch.Tensor, offsets: torch.Tensor, counts: Sequence[int], w13: torch.Tensor, *,
                     grouped: bool) -> torch.Tensor:
    """The first half of the experts on expert-major rows ``recv_x [rows, H]`` (group e = rows ``offsets[e-1] ..
    offsets[e] - 1``, ``offsets [E_local]`` int32 on the device; padding rows zero): ``silu(x W_gate^T) * x
    W_up^T`` per group, ``[rows, F]`` (padding rows zero; rows past the last group undefined). ``counts``: the
    groups' (aligned) sizes on the host, for the loop."""
    if grouped:
        return _grouped_act(recv_x, w13, offsets)
    chunks = torch.split(recv_x[:sum(counts)], list(counts), dim=0)
    return _pad_rows(torch.cat([glu(F.linear(c, w13[e])) for e, c in enumerate(chunks)], dim=0), recv_x.size(0))


def expert_major_down(act: torch.Tensor, offsets: torch.Tensor, counts: Sequence[int], w2: torch.Tensor, *,
                      grouped: bool) -> torch.Tensor:
    """The second half: ``act [rows, F]`` times each group's ``W2^T``, ``[rows, H]`` (padding rows zero, rows past
    the last group undefined). ``MoE``'s weighted combine differentiates through it itself (``layers.autograd``)."""
    if grouped:
        return torch._grouped_mm(act, w2.transpose(1, 2), offs=offsets)
    chunks = torch.split(act[:sum(counts)], list(counts), dim=0)
    return _pad_rows(torch.cat([F.linear(c, w2[e]) for e, c in enumerate(chunks)], dim=0), act.size(0))


def expert_major_down_backward(g: torch.Tensor, act: torch.Tensor, offsets: torch.Tensor, counts: Sequence[int],
                               w2: torch.Tensor, *, grouped: bool, need_w2: bool = True) -> tuple:
    """The backward of ``expert_major_down(act, ..., w2)`` for the output gradient ``g [rows, H]``:
    ``(grad_act [rows, F], grad_w2 [G, H, F] or None)``, the two GEMMs autograd would run (the same calls, so the
    same values) without recomputing the forward. Rows past the last group: undefined."""
    if grouped:
        grad_act = torch._grouped_mm(g, w2, offs=offsets)
        return grad_act, (torch._grouped_mm(g.t(), act, offs=offsets) if need_w2 else None)
    total = sum(counts)
    gs, acts = torch.split(g[:total], list(counts), dim=0), torch.split(act[:total], list(counts), dim=0)
    grad_act = _pad_rows(torch.cat([ge @ w2[e] for e, ge in enumerate(gs)], dim=0), act.size(0))
    grad_w2 = torch.stack([ge.t() @ ae for ge, ae in zip(gs, acts)]) if need_w2 else None
    return grad_act, grad_w2


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.size(0) < rows:
        t = torch.cat([t, t.new_zeros(rows - t.size(0), t.size(1))])
    return t


def _align(t, alignment: int = ALIGN):
    return (t + alignment - 1) // alignment * alignment


def normal_experts(recv_x: torch.Tensor, recv_topk_idx: torch.Tensor, recv_topk_weights: torch.Tensor,
                   counts: Sequence[int], counts_device: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
                   grouped: bool) -> torch.Tensor:
    """``out[m] = sum over k with recv_topk_idx[m, k] >= 0 of recv_topk_weights[m, k] * expert(recv_x[m])``,
    summed in float32 and cast once to ``recv_x.dtype``. ``counts``: host per-expert pair counts (the
    dispatch's list), ``counts_device``: the same on the device (for the grouped GEMM offsets)."""
    m, k = recv_topk_idx.shape
    e_local = w13.size(0)
    total = int(sum(counts))
    flat = recv_topk_idx.reshape(-1)
    key = torch.where(flat >= 0, flat, e_local)
    experts, order = torch.sort(key, stable=True)  # (row, slot) pairs grouped by expert, row order inside
    experts, order = experts[:total], order[:total]
    rows = torch.div(order, k, rounding_mode="floor")
    x_sorted = recv_x.index_select(0, rows)
    if grouped:
        y = _padded_grouped_swiglu(x_sorted, experts, counts, counts_device, w13, w2)
    else:
        y = loop_swiglu(x_sorted, w13, w2, counts)
    weights = recv_topk_weights.reshape(-1).index_select(0, order)
    contrib = y.float() * weights.unsqueeze(1)
    out = torch.zeros(m, recv_x.size(1), dtype=torch.float32, device=recv_x.device).index_add(0, rows, contrib)
    return out.to(recv_x.dtype)


def _padded_grouped_swiglu(x_sorted, experts, counts, counts_device, w13, w2) -> torch.Tensor:
    """``grouped_swiglu`` with every expert's rows padded (zeros) to a multiple of ``ALIGN``."""
    padded_total = sum(int(_align(c)) for c in counts)
    hidden = w2.size(1)
    if padded_total == 0:
        return x_sorted.new_zeros(0, hidden)
    cnt = counts_device.long()
    acnt = _align(cnt)
    start, astart = torch.cumsum(cnt, 0) - cnt, torch.cumsum(acnt, 0) - acnt
    dest = astart[experts] + torch.arange(x_sorted.size(0), device=x_sorted.device) - start[experts]
    x_pad = torch.zeros(padded_total, x_sorted.size(1), dtype=x_sorted.dtype, device=x_sorted.device)
    x_pad = x_pad.index_copy(0, dest, x_sorted)
    y_pad = grouped_swiglu(x_pad, w13, w2, torch.cumsum(acnt, 0).to(torch.int32))
    return y_pad.index_select(0, dest)


def low_latency_experts(xe: torch.Tensor, recv_count: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
                        grouped: bool, max_rows: int) -> torch.Tensor:
    """Expert outputs ``[E_local, C, H]`` for ``xe [E_local, C, H]`` whose rows past ``recv_count[e]`` are
    zero; output padding rows are zero. ``max_rows``: most valid rows in total (``R * T * min(K, E_local)``).
    No host synchronisation (CUDA-graph capturable)."""
    g, c, h = xe.shape
    if not grouped:
        return torch.bmm(glu(torch.bmm(xe, w13.transpose(1, 2))), w2.transpose(1, 2))
    cap = min(g * int(_align(c)), max_rows + (ALIGN - 1) * g)
    count = recv_count.long()
    acount = _align(count)
    aoffs = torch.cumsum(acount, dim=0)
    i = torch.arange(cap, device=xe.device)
    e = torch.searchsorted(aoffs, i, right=True)
    e_c = e.clamp(max=g - 1)
    j = i - (aoffs - acount)[e_c]
    valid = ((e < g) & (j < count[e_c])).unsqueeze(1)
    src = (e_c * c + j).clamp(0, g * c - 1)
    flat = xe.reshape(g * c, h)
    zero = torch.zeros((), dtype=xe.dtype, device=xe.device)
    x_c = torch.where(valid, flat.index_select(0, src), zero)
    y_c = torch.where(valid, grouped_swiglu(x_c, w13, w2, aoffs.to(torch.int32)), zero)
    out = torch.zeros(g * c, h, dtype=y_c.dtype, device=xe.device).index_add(0, src, y_c)
    return out.view(g, c, h)
