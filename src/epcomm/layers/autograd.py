"""Differentiable dispatch and combine: ``torch.autograd.Function`` wrappers of the ``Buffer`` calls.

Normal mode, expert-major (the default)
    ``_ExpertMajorDispatch(x, topk_weights) -> (recv_x [rows, H], row_weights [rows])``: rows grouped by local
    expert (``Buffer.dispatch(..., layout="expert_major")``). Backward: an unweighted expert-major combine of the
    row gradients, which also returns every row weight's gradient to its ``(token, slot)``.
    ``_WeightedCombine(expert_out [rows, H], row_weights [rows]) -> combined``: the weighted expert-major
    combine. Backward: a cached expert-major dispatch of the gradient ``g`` (one row per pair), then per row
    ``grad_y = w * g`` and ``grad_w = <g, y>`` (float32), one kernel (``weighted_rows_grad``).
Normal mode, rank-major (``normal_layout="rank_major"``)
    ``_Dispatch(x, topk_weights) -> (recv_x, recv_topk_weights)``. Backward: a combine of the gradients,
    which sums every received row's gradient back to its token and, through ``topk_weights=``, the
    gradient of every ``recv_topk_weights`` entry back to its ``(token, slot)`` (entries of experts on other
    ranks are constants 0 there and get no gradient). With ``fp8`` the cast is straight-through.
    ``_Combine(expert_out) -> combined``. Backward: a cached dispatch of the gradient with the same handle.
Low-latency mode
    ``_LowLatencyDispatch(x) -> xe [E_local, C, H]`` (padding rows zero). Backward: a low-latency combine of
    the row gradients with weight 1 per selected slot.
    ``_LowLatencyCombine(ye, topk_weights) -> out [N, H]`` (``sum_k w_k * bf16(y_k)``). Backward: one
    low-latency dispatch of ``[grad_out | routing metadata]`` (the same ``topk_idx``, so rows land where the
    forward's did) gives each expert row its gradient and its weight ``w``: ``grad_y = w * grad_out``; the
    weight gradients ``<grad_out, bf16(y_k)>`` go back through one more low-latency combine, each split in
    three bfloat16 parts (hi, mid, lo) in its own columns so that the bfloat16 combine carries them exactly.

The Functions keep the handles in a per-call ``CallState`` (non-tensor state on ``ctx``), so
``torch.utils.checkpoint`` works: a recomputed forward makes new handles with the same layout, and the
original backward nodes keep using theirs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .. import env
from ..errors import BufferTooSmallError, EpcommError
from ..fp8 import GROUP, per_token_cast_back, per_token_cast_to_fp8
from .buffers import low_latency_meta_columns, too_small_message
from .timing import PhaseTimer


@dataclass(eq=False)
class CallState:
    """What one MoE call's Functions share: the buffer, its configs, the handle and the wait."""

    buffer: Any
    timer: PhaseTimer
    sizes: Any
    dispatch_config: Any = None
    combine_config: Any = None
    handle: Any = None
    recv_topk_idx: Optional[torch.Tensor] = None
    counts: Optional[list] = None
    # low-latency
    topk_idx: Optional[torch.Tensor] = None
    max_tokens: int = 0
    num_experts: int = 0
    valid: Optional[torch.Tensor] = None  # [E_local, C] bool
    recv_count: Optional[torch.Tensor] = None
    # asynchronous combine
    event: Any = None
    hook: Any = None
    extra: dict = field(default_factory=dict)


@contextlib.contextmanager
def actionable(state: CallState, what: str):
    """Re-raise a BufferTooSmallError with the layer's sizes and what to set."""
    try:
        yield
    except BufferTooSmallError as exc:
        raise BufferTooSmallError(too_small_message(exc, state.sizes, what)) from exc


# ---------------------------------------------------------------------------------------------- normal mode
class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, state: CallState, topk_idx, layout, fp8: bool):
        per_rank, per_expert, in_rank = layout
        payload = per_token_cast_to_fp8(x) if fp8 else x.contiguous()
        with state.timer.phase("dispatch"), actionable(state, "dispatch"):
            recv, recv_idx, recv_w, counts, handle, _ = state.buffer.dispatch(
                payload, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=topk_idx, topk_weights=topk_weights.detach().float().contiguous(),
                config=state.dispatch_config)
        recv_x = per_token_cast_back(recv[0], recv[1], x.dtype) if fp8 else recv
        state.handle, state.recv_topk_idx, state.counts = handle, recv_idx, counts
        ctx.state, ctx.x_dtype = state, x.dtype
        return recv_x, recv_w

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_w):
        state: CallState = ctx.state
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = torch.where(state.recv_topk_idx >= 0, grad_recv_w.float(), 0.0).contiguous()
        with state.timer.phase("bwd_combine"), actionable(state, "backward of dispatch (a combine)"):
            grad_x, grad_topk_w, _ = state.buffer.combine(grad_recv_x.contiguous(), state.handle, topk_weights=grad_w,
                                                          config=state.combine_config)
        return grad_x.to(ctx.x_dtype), grad_topk_w, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, state: CallState, async_finish: bool):
        with state.timer.phase("combine"), actionable(state, "combine"):
            combined, _, event = state.buffer.combine(expert_out.contiguous(), state.handle,
                                                      config=state.combine_config, async_finish=async_finish)
        state.event = event if async_finish else None
        ctx.state = state
        return combined

    @staticmethod
    def backward(ctx, grad):
        state: CallState = ctx.state
        with state.timer.phase("bwd_dispatch"), actionable(state, "backward of combine (a cached dispatch)"):
            recv = state.buffer.dispatch(grad.contiguous(), handle=state.handle, config=state.dispatch_config)[0]
        return recv, None, None


class _ExpertMajorDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, state: CallState, topk_idx, layout, fp8: bool, alignment: int, worst: int):
        per_rank, per_expert, in_rank = layout
        payload = per_token_cast_to_fp8(x) if fp8 else x.contiguous()
        with state.timer.phase("dispatch"), actionable(state, "dispatch"):
            recv, _, row_w, counts, handle, _ = state.buffer.dispatch(
                payload, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=topk_idx, topk_weights=topk_weights.detach().float().contiguous(),
                expert_alignment=alignment, num_worst_tokens=worst, config=state.dispatch_config,
                layout="expert_major")
        recv_x = per_token_cast_back(recv[0], recv[1], x.dtype) if fp8 else recv
        state.handle, state.counts = handle, counts
        ctx.state, ctx.x_dtype = state, x.dtype
        return recv_x, row_w

    @staticmethod
    def backward(ctx, grad_recv_x, grad_row_w):
        state: CallState = ctx.state
        h = state.handle
        values = None
        if ctx.needs_input_grad[1] and grad_row_w is not None:
            values = grad_row_w.float().contiguous()
        if grad_recv_x is None:
            grad_recv_x = torch.zeros(h.num_recv_rows, h.hidden, dtype=ctx.x_dtype, device=h.expert_offsets.device)
        with state.timer.phase("bwd_combine"), actionable(state, "backward of dispatch (a combine)"):
            grad_x, grad_topk_w, _ = state.buffer.combine(grad_recv_x.contiguous(), h, topk_weights=values,
                                                          weighted=False, config=state.combine_config)
        return grad_x.to(ctx.x_dtype), grad_topk_w, None, None, None, None, None, None


class _WeightedCombine(torch.autograd.Function):
    """``combined = sum over a token's rows of row_weights[row] * expert_out[row]`` (the expert-major combine).

    With ``down_backward`` (the layer's case) ``expert_out`` is the experts' down projection ``act W2^T``, computed
    without autograd, and this function differentiates through it with the routing weight moved onto the narrow
    side: ``w (g W2) = (w g) W2``, ``(w g)^T act = g^T (w act)``, ``<g, act W2^T> = <g W2, act>``. The backward's
    elementwise work then runs on ``[rows, F]`` tensors instead of ``[rows, H]`` ones, and ``expert_out`` is not
    kept. Without it: ``grad_y = w * g`` and ``grad_w = <g, y>`` (``weighted_rows_grad``)."""

    @staticmethod
    def forward(ctx, expert_out, row_weights, act, w2, state: CallState, async_finish: bool, down_backward):
        expert_out = expert_out.contiguous()
        row_w = row_weights.detach().float().contiguous()
        with state.timer.phase("combine"), actionable(state, "combine"):
            combined, _, event = state.buffer.combine(expert_out, state.handle, row_weights=row_w,
                                                      config=state.combine_config, async_finish=async_finish)
        state.event = event if async_finish else None
        ctx.state, ctx.down_backward, ctx.y_dtype = state, down_backward, expert_out.dtype
        ctx.save_for_backward(*((expert_out, row_w) if down_backward is None else (act, w2, row_w)))
        return combined

    @staticmethod
    def backward(ctx, grad):
        from ..transports.expert_major import weighted_rows_grad

        state: CallState = ctx.state
        with state.timer.phase("bwd_dispatch"), actionable(state, "backward of combine (a cached dispatch)"):
            g = state.buffer.dispatch(grad.to(ctx.y_dtype).contiguous(), handle=state.handle,
                                      config=state.dispatch_config)[0]
        row_src = state.handle.recv_row_src
        if ctx.down_backward is None:
            y, row_w = ctx.saved_tensors
            with state.timer.phase("bwd_weighting"):
                grad_y, grad_w = weighted_rows_grad(g, y if ctx.needs_input_grad[1] else None, row_w, row_src)
            return grad_y, grad_w, None, None, None, None, None
        act, w2, row_w = ctx.saved_tensors
        with state.timer.phase("bwd_weighting_in"):
            act_w, _ = weighted_rows_grad(act, None, row_w, row_src)  # w * act (zero on padding rows)
        h, grad_w2 = ctx.down_backward(g, act_w, w2, need_w2=ctx.needs_input_grad[3])  # h = g W2
        with state.timer.phase("bwd_weighting"):
            grad_act, grad_w = weighted_rows_grad(h, act if ctx.needs_input_grad[1] else None, row_w, row_src)
        return None, grad_w, grad_act, grad_w2, None, None, None


def expert_major_dispatch(x, topk_weights, state, topk_idx, layout, fp8, alignment, num_worst_tokens=0):
    return _ExpertMajorDispatch.apply(x, topk_weights, state, topk_idx, layout, fp8, alignment, num_worst_tokens)


def weighted_combine(expert_out, row_weights, state, async_finish, act=None, w2=None, down_backward=None):
    """See ``_WeightedCombine``: with ``down_backward``, ``expert_out`` must be the experts' down projection of
    ``act`` by ``w2`` computed without autograd, and ``down_backward(g, act, w2, need_w2=...) -> (grad_act, grad_w2)``
    its backward; gradients reach ``act`` and ``w2`` through this function."""
    return _WeightedCombine.apply(expert_out, row_weights, act, w2, state, async_finish, down_backward)


def dispatch(x, topk_weights, state, topk_idx, layout, fp8):
    return _Dispatch.apply(x, topk_weights, state, topk_idx, layout, fp8)


def combine(expert_out, state, async_finish):
    return _Combine.apply(expert_out, state, async_finish)


# ---------------------------------------------------------------------------------------- low-latency mode
def _ones_for(topk_idx: torch.Tensor) -> torch.Tensor:
    return (topk_idx >= 0).float()


def _zero_padding(t: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid.unsqueeze(-1), t, torch.zeros((), dtype=t.dtype, device=t.device))


class _LowLatencyDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, state: CallState, fp8: bool, dtype: torch.dtype):
        buf = state.buffer
        with state.timer.phase("dispatch"), actionable(state, "low-latency dispatch"):
            recv, count, handle, _, _ = buf.low_latency_dispatch(x.contiguous(), state.topk_idx, state.max_tokens,
                                                                 state.num_experts, use_fp8=fp8)
        if fp8:
            data, scales = recv
            g, c, h = data.shape
            xe = per_token_cast_back(data.reshape(g * c, h), scales.reshape(g * c, h // GROUP), dtype).view(g, c, h)
        else:
            xe = recv.to(dtype)
        valid = torch.arange(xe.size(1), device=xe.device) < count.unsqueeze(1)
        state.handle, state.valid, state.recv_count = handle, valid, count
        ctx.state, ctx.x_dtype = state, x.dtype
        return _zero_padding(xe, valid)

    @staticmethod
    def backward(ctx, grad_xe):
        state: CallState = ctx.state
        g = _zero_padding(grad_xe, state.valid).to(torch.bfloat16).contiguous()
        with state.timer.phase("bwd_combine"), actionable(state, "backward of low-latency dispatch (a combine)"):
            grad_x, _, _ = state.buffer.low_latency_combine(g, state.topk_idx, _ones_for(state.topk_idx), state.handle)
        return grad_x.to(ctx.x_dtype), None, None, None


def pack_routing(topk_weights: torch.Tensor, topk_idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[N, P]`` of ``dtype`` holding the bits of ``topk_weights`` (float32) and ``topk_idx`` (int32),
    zero-padded to ``P = low_latency_meta_columns(K, dtype)`` columns."""
    n, k = topk_idx.shape
    words = torch.cat([topk_weights.float().contiguous().view(torch.int32), topk_idx.to(torch.int32)], dim=1)
    packed = words.contiguous().view(dtype)
    pad = low_latency_meta_columns(k, dtype) - packed.size(1)
    return torch.nn.functional.pad(packed, (0, pad))


def unpack_routing(meta: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``pack_routing`` on ``[..., P]``: ``(weights [..., K] float32, ids [..., K] int32)``."""
    cols = 2 * k * 4 // meta.element_size()
    words = meta[..., :cols].contiguous().view(torch.int32)
    return words[..., :k].contiguous().view(torch.float32), words[..., k:]


def split_bf16x3(t: torch.Tensor) -> torch.Tensor:
    """``[..., 3]`` bfloat16 (hi, mid, lo) whose float32 sum is ``t`` (float32) to about 2^-24 relative."""
    hi = t.to(torch.bfloat16)
    rest = t - hi.float()
    mid = rest.to(torch.bfloat16)
    return torch.stack([hi, mid, (rest - mid.float()).to(torch.bfloat16)], dim=-1)


def join_bf16x3(parts: torch.Tensor) -> torch.Tensor:
    """Inverse of ``split_bf16x3``: ``hi + mid + lo`` in float32."""
    p = parts.float()
    return p[..., 0] + p[..., 1] + p[..., 2]


class _LowLatencyCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ye, topk_weights, state: CallState, use_hook: bool):
        y16 = _zero_padding(ye, state.valid).to(torch.bfloat16).contiguous()
        with state.timer.phase("combine"), actionable(state, "low-latency combine"):
            out, _, hook = state.buffer.low_latency_combine(y16, state.topk_idx,
                                                            topk_weights.detach().float().contiguous(), state.handle,
                                                            return_recv_hook=use_hook)
        state.hook = hook
        ctx.state, ctx.y_dtype = state, ye.dtype
        ctx.save_for_backward(y16, topk_weights)
        if hook is None and ye.dtype != torch.bfloat16:
            out = out.to(ye.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        state: CallState = ctx.state
        y16, topk_weights = ctx.saved_tensors
        idx, buf = state.topk_idx, state.buffer
        e_local, c, h = y16.shape
        k = idx.size(1)
        dtype = torch.bfloat16 if grad_out.dtype == torch.bfloat16 else torch.float32
        payload = torch.cat([grad_out.to(dtype), pack_routing(topk_weights.detach(), idx, dtype)], dim=1)
        with state.timer.phase("bwd_dispatch"), actionable(state, "backward of low-latency combine (a dispatch)"):
            recv, _, handle2, _, _ = buf.low_latency_dispatch(payload, idx, state.max_tokens, state.num_experts,
                                                              use_fp8=False)
        if env.validate_level() == "full" and not torch.equal(
                torch.where(state.valid, handle2.src_info, -1), torch.where(state.valid, state.handle.src_info, -1)):
            raise EpcommError("MoE backward: the low-latency dispatch of the gradient did not place rows where the "
                              "forward dispatch did; the transport's row order is not deterministic")
        first_expert = buf.rank * e_local
        recv_g = recv[..., :h].float()
        w_recv, ids = unpack_routing(recv[..., h:], k)
        experts = torch.arange(first_expert, first_expert + e_local, device=ids.device, dtype=ids.dtype)
        match = (ids == experts.view(-1, 1, 1)) & state.valid.unsqueeze(-1)  # [E_local, C, K]
        has = match.any(-1)
        slot = match.to(torch.int32).argmax(-1)
        w_row = torch.where(match, w_recv, 0.0).sum(-1)
        zero = torch.zeros((), device=recv_g.device)
        grad_ye = torch.where(has.unsqueeze(-1), recv_g * w_row.unsqueeze(-1), zero).to(ctx.y_dtype)
        grad_w = None
        if ctx.needs_input_grad[1]:
            dot = torch.where(has, (recv_g * y16.float()).sum(-1), zero)
            parts = split_bf16x3(dot).view(e_local * c, 3)
            cols = 3 * slot.view(-1, 1).long() + torch.arange(3, device=slot.device)
            onehot = torch.zeros(e_local * c, h, dtype=torch.bfloat16, device=recv_g.device).scatter_(1, cols, parts)
            with state.timer.phase("bwd_combine"), actionable(state, "backward of low-latency combine (weights)"):
                out_w, _, _ = buf.low_latency_combine(onehot.view(e_local, c, h), idx, _ones_for(idx), state.handle)
            grad_w = join_bf16x3(out_w[:, :3 * k].view(-1, k, 3))
        return grad_ye, grad_w, None, None


def low_latency_dispatch(x, state, fp8, dtype):
    return _LowLatencyDispatch.apply(x, state, fp8, dtype)


def low_latency_combine(ye, topk_weights, state, use_hook):
    return _LowLatencyCombine.apply(ye, topk_weights, state, use_hook)
