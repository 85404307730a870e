"""``MoE``: an expert-parallel Mixture-of-Experts layer (router, dispatch, local experts, combine, shared
experts) on an ``epcomm.Buffer``. See ``epcomm.layers`` for the configuration guide."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import env
from ..buffer import Buffer
from ..core.device import default_device
from ..errors import EpcommError
from . import autograd as ag
from .buffers import BufferSizes, get_buffer, moe_buffer_size_bytes
from .config import MoEConfig
from .experts import (ALIGN, choose_grouped_gemm, expert_major_act, expert_major_down, expert_major_down_backward,
                      low_latency_experts, normal_experts)
from .ops import route, swiglu
from .timing import PhaseTimer
from .weights import init_expert_weights, init_router_weight, init_shared_weights

log = logging.getLogger("epcomm.layers")

MODES = ("normal", "low_latency")
_layer_ids = itertools.count()


class MoEFuture:
    """The pending result of ``MoE.forward_async``. ``wait()`` makes the current stream wait for the combine
    (CUDA event, or the low-latency receive hook), adds the shared experts' output and returns ``[N, H]``;
    calling it again returns the same tensor. Until then the combine runs on the communication stream while
    the caller's stream does other work (on CPUs the combine has already finished)."""

    def __init__(self, out: torch.Tensor, dtype: torch.dtype, waiter: Optional[Callable[[], None]] = None,
                 on_done: Optional[Callable[[], None]] = None) -> None:
        self._out = out
        self._dtype = dtype
        self._waiter = waiter
        self._on_done = on_done
        self.shared: Optional[torch.Tensor] = None
        self._result: Optional[torch.Tensor] = None

    @property
    def done(self) -> bool:
        return self._result is not None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            if self._waiter is not None:
                self._waiter()
            out = self._out.to(self._dtype)
            if self.shared is not None:
                out = out + self.shared
            self._result, self._out, self._waiter, self.shared = out, None, None, None
            if self._on_done is not None:
                self._on_done()
        return self._result


class MoE(nn.Module):
    """Expert-parallel MoE layer: expert ``e`` lives on rank ``e // E_local`` of ``group``.

    Arguments:
        config: MoEConfig.
        group: the expert-parallel process group (default: the world group); every rank builds the layer.
        seed: weights are ``epcomm.layers.weights.init_*`` of this seed, drawn on ``device``; the same as a
            ``DenseMoE(config, seed, device)`` of the same device type.
        max_tokens_per_rank: largest normal-mode batch per rank, for the buffer size when
            ``config.buffer_size_gb`` is None.
        buffer: an ``epcomm.Buffer`` to use instead of the shared one (``epcomm.layers.get_buffer``).
        device: parameter device (default: the buffer's device: the current GPU for NCCL groups, else CPU).

    Parameters: ``router_weight [E, H]`` float32 and ``shared_w13``/``shared_w2`` are replicated (their
    gradients cover this rank's tokens only: ``sync_replicated_grads()`` sums them over the group, as a
    data-parallel all-reduce would); ``w13 [E_local, 2F, H]`` and ``w2 [E_local, H, F]`` are this rank's
    experts (marked ``param.expert_parallel = True``), whose gradients already include every rank's tokens.
    """

    def __init__(self, config: MoEConfig, group=None, *, seed: int = 0, max_tokens_per_rank: int = 4096,
                 buffer: Optional[Buffer] = None, device=None, _init: bool = True) -> None:
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"MoE: config must be a MoEConfig; got {type(config).__name__}")
        if not dist.is_initialized():
            raise EpcommError("MoE: torch.distributed is not initialised; call init_process_group first (or start "
                              "the workers with epcomm.testing.run / torchrun)")
        self.config = config
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.num_ranks = dist.get_world_size(self.group)
        if config.num_experts % self.num_ranks:
            raise ValueError(f"MoE: num_experts={config.num_experts} must be a multiple of the expert-parallel "
                             f"group size {self.num_ranks}")
        self.num_local_experts = config.num_experts // self.num_ranks
        self.first_expert = self.rank * self.num_local_experts
        self.max_tokens_per_rank = int(max_tokens_per_rank)
        self.sizes: BufferSizes = moe_buffer_size_bytes(config, self.max_tokens_per_rank, self.num_ranks)
        self._own_buffer = buffer
        self.device = torch.device(device) if device is not None else (
            buffer.device if buffer is not None else default_device(self.group))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())

        h, f, dtype = config.hidden, config.ffn_hidden, config.dtype
        e_local, dev = self.num_local_experts, self.device
        if _init:
            router = init_router_weight(config, seed, dev)
            w13, w2 = init_expert_weights(config, seed, range(self.first_expert, self.first_expert + e_local), dev)
            shared = init_shared_weights(config, seed, dev)
        else:
            router = torch.empty(config.num_experts, h, dtype=torch.float32, device=dev)
            w13 = torch.empty(e_local, 2 * f, h, dtype=dtype, device=dev)
            w2 = torch.empty(e_local, h, f, dtype=dtype, device=dev)
            fs = config.shared_ffn_hidden
            shared = (torch.empty(2 * fs, h, dtype=dtype, device=dev), torch.empty(h, fs, dtype=dtype, device=dev)) \
                if fs else None
        self.router_weight = nn.Parameter(router)
        self.w13, self.w2 = nn.Parameter(w13), nn.Parameter(w2)
        self.w13.expert_parallel = self.w2.expert_parallel = True
        if shared is not None:
            self.shared_w13, self.shared_w2 = nn.Parameter(shared[0]), nn.Parameter(shared[1])
        else:
            self.shared_w13 = self.shared_w2 = None

        self.grouped_gemm, self.grouped_gemm_reason = choose_grouped_gemm(config.grouped_gemm, dev, dtype, h, f)
        self.timer = PhaseTimer(dev, enabled=env.debug(), log_each_step=env.debug(), label=f"MoE#{next(_layer_ids)}")
        self._dispatch_config = dataclasses.replace(Buffer.get_dispatch_config(self.num_ranks), num_sms=config.num_sms)
        self._combine_config = dataclasses.replace(Buffer.get_combine_config(self.num_ranks), num_sms=config.num_sms)
        self.last_mode: Optional[str] = None
        self.last_handle = None
        buf = self.buffer  # create (or grow) the shared buffer now, so that size / memory errors surface here
        if self.rank == 0:
            log.info("MoE: %d experts over %d ranks on %s, transport %s, experts via %s, buffer %s",
                     config.num_experts, self.num_ranks, dev, buf.transport,
                     "torch._grouped_mm" if self.grouped_gemm else "a loop", self.sizes.describe())

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def from_dense(cls, dense, group=None, **kwargs) -> "MoE":
        """A layer holding ``dense``'s router and shared experts and this rank's slice of its experts
        (``dense`` is a ``DenseMoE`` or anything with the same parameter names and layouts)."""
        moe = cls(dense.config, group, _init=False, **kwargs)
        first, n = moe.first_expert, moe.num_local_experts
        with torch.no_grad():
            moe.router_weight.copy_(dense.router_weight)
            moe.w13.copy_(dense.w13[first:first + n])
            moe.w2.copy_(dense.w2[first:first + n])
            if moe.shared_w13 is not None:
                moe.shared_w13.copy_(dense.shared_w13)
                moe.shared_w2.copy_(dense.shared_w2)
        return moe

    @property
    def buffer(self) -> Buffer:
        """The Buffer this layer communicates through (the shared one unless one was passed)."""
        if self._own_buffer is not None:
            return self._own_buffer
        return get_buffer(self.group, self.sizes, self.config.transport, self.device)

    def expert_parameters(self) -> list:
        return [self.w13, self.w2]

    def replicated_parameters(self) -> list:
        return [p for p in (self.router_weight, self.shared_w13, self.shared_w2) if p is not None]

    def sync_replicated_grads(self, average: bool = False) -> None:
        """Sum (or average) the gradients of the replicated parameters over the group."""
        for p in self.replicated_parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)
                if average:
                    p.grad /= self.num_ranks

    def extra_repr(self) -> str:
        c = self.config
        return (f"hidden={c.hidden}, ffn_hidden={c.ffn_hidden}, experts={c.num_experts} ({self.num_local_experts} "
                f"local), topk={c.topk}, router={c.router}, shared={c.num_shared_experts}, dtype={c.dtype}, "
                f"ep_dispatch={c.ep_dispatch}, fp8_dispatch={c.fp8_dispatch}, "
                f"low_latency_max_tokens={c.low_latency_max_tokens}, grouped_gemm={self.grouped_gemm}, "
                f"normal_layout={c.normal_layout}")

    # ------------------------------------------------------------------ forward
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_idx [N, K] int64, topk_weights [N, K] float32)`` of this layer's router."""
        return route(x, self.router_weight, self.config)

    def forward(self, x: torch.Tensor, topk_idx: Optional[torch.Tensor] = None,
                topk_weights: Optional[torch.Tensor] = None, mode: Optional[str] = None) -> torch.Tensor:
        """``[N, H]`` output for ``x [N, H]``; see ``forward_async``."""
        return self.forward_async(x, topk_idx, topk_weights, mode=mode).wait()

    def forward_async(self, x: torch.Tensor, topk_idx: Optional[torch.Tensor] = None,
                      topk_weights: Optional[torch.Tensor] = None, mode: Optional[str] = None) -> MoEFuture:
        """Route ``x [N, H]``, dispatch, run the local experts, combine, add the shared experts.

        Collective: every rank of the group calls it (with its own N, possibly 0).
        topk_idx ``[N, K]`` int64 / topk_weights ``[N, K]`` float32: routing to use instead of the router
            (``-1`` selects nothing); gradients flow into ``topk_weights``.
        mode: ``"normal"``, ``"low_latency"`` or None (auto: low latency when every rank has at most
            ``low_latency_max_tokens`` tokens; deciding that costs one tiny all-reduce and a host sync, so
            decode loops and CUDA graphs pass the mode explicitly).
        With ``async_combine`` the combine is left running: the shared experts are computed meanwhile and
        ``wait()`` on the returned future joins it."""
        c = self.config
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.size(1) != c.hidden:
            raise ValueError(f"MoE: x must be [num_tokens, {c.hidden}]; got {tuple(getattr(x, 'shape', ()))}")
        if x.device != self.device:
            raise ValueError(f"MoE: x is on {x.device}, the layer on {self.device}")
        x = x.to(c.dtype)
        timer = self.timer
        with timer.phase("router"):
            if topk_idx is None:
                if topk_weights is not None:
                    raise ValueError("MoE: topk_weights given without topk_idx")
                topk_idx, topk_weights = self.route(x)
            else:
                topk_idx, topk_weights = self._check_routing(x, topk_idx, topk_weights)
        mode = self._choose_mode(x.size(0), mode)
        self.last_mode = mode
        buf = self.buffer
        state = ag.CallState(buffer=buf, timer=timer, sizes=self.sizes, dispatch_config=self._dispatch_config,
                             combine_config=self._combine_config)
        if mode == "normal":
            fut = self._normal(x, topk_idx, topk_weights, state)
        else:
            fut = self._low_latency(x, topk_idx, topk_weights, state)
        if self.shared_w13 is not None:
            with timer.phase("shared"):
                fut.shared = swiglu(x, self.shared_w13, self.shared_w2)
        return fut

    def _check_routing(self, x, topk_idx, topk_weights):
        n, k = x.size(0), self.config.topk
        if topk_weights is None:
            raise ValueError("MoE: topk_idx given without topk_weights")
        if topk_idx.shape != (n, k) or topk_weights.shape != (n, k):
            raise ValueError(f"MoE: topk_idx and topk_weights must be [{n}, {k}]; got {tuple(topk_idx.shape)} and "
                             f"{tuple(topk_weights.shape)}")
        if topk_idx.dtype not in (torch.int64, torch.int32) or not topk_weights.is_floating_point():
            raise TypeError(f"MoE: topk_idx must be int64 and topk_weights float; got {topk_idx.dtype}, "
                            f"{topk_weights.dtype}")
        return topk_idx.to(device=self.device, dtype=torch.int64), topk_weights.to(self.device, torch.float32)

    def _choose_mode(self, num_tokens: int, mode: Optional[str]) -> str:
        t = self.config.low_latency_max_tokens
        if mode in (None, "auto"):
            if t == 0:
                return "normal"
            if self.num_ranks == 1:
                largest = num_tokens
            else:
                if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    raise EpcommError("MoE: mode=None decides the path with a host sync, which CUDA graph capture "
                                      "forbids; pass mode='low_latency' (or 'normal') explicitly")
                n = torch.tensor([num_tokens], dtype=torch.int64, device=self.buffer.device)
                dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.group)
                largest = int(n.item())
            return "low_latency" if largest <= t else "normal"
        if mode not in MODES:
            raise ValueError(f"MoE: mode={mode!r} must be None, 'normal' or 'low_latency'")
        if mode == "low_latency":
            if t == 0:
                raise ValueError("MoE: mode='low_latency' needs MoEConfig.low_latency_max_tokens > 0")
            if num_tokens > t:
                raise ValueError(f"MoE: {num_tokens} tokens exceed low_latency_max_tokens={t}; split the batch or "
                                 f"use mode='normal'")
        return mode

    def _normal(self, x, topk_idx, topk_weights, state) -> MoEFuture:
        c, timer, buf = self.config, self.timer, state.buffer
        with timer.phase("layout"):
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, c.num_experts)
        layout = (per_rank, per_expert, in_rank)
        if c.normal_layout == "expert_major":
            # one rank with the grouped GEMM: every pair is local, so N * K bounds the rows exactly and the dispatch
            # runs without a host synchronisation (num_worst_tokens): the host issues the step ahead of the GPU
            worst = x.size(0) * c.topk if self.num_ranks == 1 and self.grouped_gemm else 0
            recv_x, row_w = ag.expert_major_dispatch(x, topk_weights, state, topk_idx, layout, c.fp8_dispatch, ALIGN,
                                                     worst)
            offsets, counts, grouped = state.handle.expert_offsets, state.counts, self.grouped_gemm

            def down_backward(g, act_w, w2, need_w2):
                return expert_major_down_backward(g, act_w, offsets, counts, w2, grouped=grouped, need_w2=need_w2)

            with timer.phase("experts"):
                act = expert_major_act(recv_x, offsets, counts, self.w13, grouped=grouped)
                with torch.no_grad():  # differentiated by the weighted combine (the weights on the narrow side)
                    out = expert_major_down(act, offsets, counts, self.w2, grouped=grouped)
            combined = ag.weighted_combine(out, row_w, state, c.async_combine, act=act, w2=self.w2,
                                           down_backward=down_backward)
        else:
            recv_x, recv_w = ag.dispatch(x, topk_weights, state, topk_idx, layout, c.fp8_dispatch)
            with timer.phase("experts"):
                out = self._experts(normal_experts, recv_x, state.recv_topk_idx, recv_w, state.counts,
                                    state.handle.num_recv_tokens_per_expert, self.w13, self.w2)
            combined = ag.combine(out, state, c.async_combine)
        self.last_handle = state.handle  # the last normal-mode dispatch's layout (benchmarks read its sizes)
        waiter = state.event.current_stream_wait if state.event is not None else None
        return MoEFuture(combined, c.dtype, self._waiter(waiter), self._done)

    def _low_latency(self, x, topk_idx, topk_weights, state) -> MoEFuture:
        c, timer = self.config, self.timer
        state.topk_idx, state.max_tokens, state.num_experts = topk_idx, c.low_latency_max_tokens, c.num_experts
        xe = ag.low_latency_dispatch(x, state, c.fp8_dispatch, c.dtype)
        with timer.phase("experts"):
            max_rows = self.num_ranks * c.low_latency_max_tokens * min(c.topk, self.num_local_experts)
            ye = self._experts(low_latency_experts, xe, state.recv_count, self.w13, self.w2, max_rows=max_rows)
        use_hook = c.async_combine and c.dtype == torch.bfloat16
        out = ag.low_latency_combine(ye, topk_weights, state, use_hook)
        return MoEFuture(out, c.dtype, self._waiter(state.hook), self._done)

    def _experts(self, fn, *args, **kwargs):
        """``fn(*args, grouped=..., **kwargs)``. Whether the grouped GEMM runs was decided once at construction
        (``choose_grouped_gemm``); errors here are real and propagate."""
        return fn(*args, grouped=self.grouped_gemm, **kwargs)

    def _waiter(self, fn):
        if fn is None:
            return None

        def wait():
            # no_grad: a receive hook fills the combine's output in place; autograd must not record that
            with self.timer.phase("combine_wait"), torch.no_grad():
                fn()
        return wait

    def _done(self) -> None:
        self.timer.end_step(self.rank)
