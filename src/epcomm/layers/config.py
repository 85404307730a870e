"""``MoEConfig``: every knob of ``epcomm.layers.MoE``, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..fp8 import GROUP

EP_DISPATCH = ("auto", "nvlink", "p2p", "alltoall")
EP_DISPATCH_ALIASES = {"deepep": "nvlink"}
ROUTERS = ("softmax", "sigmoid")
NORMAL_LAYOUTS = ("expert_major", "rank_major")
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}


@dataclass(frozen=True)
class MoEConfig:
    """Shape and behaviour of one expert-parallel MoE layer.

    Model:
        hidden: model width H.
        ffn_hidden: width F of one routed expert (SwiGLU: gate and up ``[F, H]``, down ``[H, F]``).
        num_experts: E, routed experts in total; a multiple of the expert-parallel group size.
        topk: K experts per token.
        router: ``"softmax"`` (scores = softmax of the logits) or ``"sigmoid"`` (DeepSeek-V3 style).
        normalize_topk: divide the K selected scores by their sum.
        num_shared_experts: S; S > 0 adds one dense SwiGLU of width ``S * ffn_hidden`` on every rank
            (DeepSeek's shared experts), applied to every token.
        dtype: ``torch.bfloat16`` (GPUs) or ``torch.float32`` (CPU testing); strings ``"bf16"``/``"fp32"``
            are accepted. The router weight and the routing probabilities are always float32.
    Communication:
        ep_dispatch: transport of the Buffer: ``"auto"``, ``"nvlink"`` (the fast one-sided path),
            ``"p2p"``, ``"alltoall"`` (portable ``all_to_all_single``); ``"deepep"`` is an alias of
            ``"nvlink"``. ``EPCOMM_TRANSPORT`` still overrides it for the whole process.
        buffer_size_gb: bytes (in GiB) of the normal-mode communication buffer; None sizes it with
            ``moe_buffer_size_bytes`` for ``max_tokens_per_rank`` given to ``MoE``.
        num_sms: SMs the normal-mode kernels may occupy (even, >= 2), or None (the default): each call's
            from epcomm's traffic model (``epcomm.core.config.model_num_sms``; 24 at DeepSeek sizes over
            NVLink at up to 4 ranks, 40 at 5-8). Megatron's ``--moe-deepep-num-sms`` maps here when given.
        async_combine: issue the combine asynchronously; ``MoE.forward`` overlaps it with the shared
            experts and ``MoE.forward_async`` returns a future so the caller can overlap its own work.
        fp8_dispatch: send tokens as FP8 e4m3 with per-token, per-128-channel scales
            (``epcomm.per_token_cast_to_fp8``); the experts see ``per_token_cast_back`` of them. Gradients
            pass straight through the cast. Combine and all backward traffic stay in ``dtype``.
        low_latency_max_tokens: T; batches of at most T tokens per rank (on every rank) use
            ``low_latency_dispatch``/``low_latency_combine``; 0 disables the low-latency path.
        normal_layout: how the normal path receives rows: ``"expert_major"`` (the default: the dispatch
            groups rows by local expert for the grouped GEMM and the combine applies the routing weights and
            reduces each token's rows in a fixed order, ``Buffer.dispatch(..., layout="expert_major")``) or
            ``"rank_major"`` (DeepEP's layout: one row per token and rank; the layer sorts, gathers, pads and
            scatters the (row, expert) pairs itself around the GEMMs: the earlier path, kept for comparison).
    Experts:
        grouped_gemm: None (auto: ``torch._grouped_mm`` on CUDA with bf16 on SM90+, checked once at
            construction with a tiny grouped GEMM: a build without it falls back to the loop, with a log
            line), True (always, an error where it cannot run), False (a loop over local experts / batched
            matmul).
    """

    hidden: int
    ffn_hidden: int
    num_experts: int
    topk: int
    router: str = "softmax"
    normalize_topk: bool = True
    num_shared_experts: int = 0
    dtype: Union[torch.dtype, str] = torch.bfloat16
    ep_dispatch: str = "auto"
    buffer_size_gb: Optional[float] = None
    num_sms: Optional[int] = None
    async_combine: bool = False
    fp8_dispatch: bool = False
    low_latency_max_tokens: int = 0
    grouped_gemm: Optional[bool] = None
    normal_layout: str = "expert_major"

    def __post_init__(self) -> None:
        fn = "MoEConfig"
        for name in ("hidden", "ffn_hidden", "num_experts", "topk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{fn}: {name}={value!r} must be a positive integer")
        if self.topk > self.num_experts:
            raise ValueError(f"{fn}: topk={self.topk} cannot exceed num_experts={self.num_experts}")
        if self.router not in ROUTERS:
            raise ValueError(f"{fn}: router={self.router!r} must be one of {ROUTERS}")
        if not isinstance(self.num_shared_experts, int) or self.num_shared_experts < 0:
            raise ValueError(f"{fn}: num_shared_experts={self.num_shared_experts!r} must be an integer >= 0")
        dtype = _DTYPES.get(self.dtype, self.dtype) if isinstance(self.dtype, str) else self.dtype
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"{fn}: dtype={self.dtype!r} must be torch.bfloat16 or torch.float32")
        object.__setattr__(self, "dtype", dtype)
        ep = EP_DISPATCH_ALIASES.get(str(self.ep_dispatch).lower(), str(self.ep_dispatch).lower())
        if ep not in EP_DISPATCH:
            raise ValueError(f"{fn}: ep_dispatch={self.ep_dispatch!r} is not one of {EP_DISPATCH} "
                             f"(or 'deepep', an alias of 'nvlink')")
        object.__setattr__(self, "ep_dispatch", ep)
        if self.buffer_size_gb is not None and not (isinstance(self.buffer_size_gb, (int, float))
                                                    and self.buffer_size_gb > 0):
            raise ValueError(f"{fn}: buffer_size_gb={self.buffer_size_gb!r} must be None (auto) or a positive "
                             f"number of GiB")
        if self.num_sms is not None and (not isinstance(self.num_sms, int) or isinstance(self.num_sms, bool)
                                         or self.num_sms < 2 or self.num_sms % 2):
            raise ValueError(f"{fn}: num_sms={self.num_sms!r} must be None (the traffic model's choice per call) "
                             f"or an even integer >= 2, e.g. Megatron's --moe-deepep-num-sms 20")
        if self.normal_layout not in NORMAL_LAYOUTS:
            raise ValueError(f"{fn}: normal_layout={self.normal_layout!r} must be one of {NORMAL_LAYOUTS}")
        if not isinstance(self.low_latency_max_tokens, int) or self.low_latency_max_tokens < 0:
            raise ValueError(f"{fn}: low_latency_max_tokens={self.low_latency_max_tokens!r} must be an integer "
                             f">= 0 (0 disables the low-latency path)")
        if self.grouped_gemm not in (None, True, False):
            raise ValueError(f"{fn}: grouped_gemm={self.grouped_gemm!r} must be None (auto), True or False")
        if self.fp8_dispatch and self.hidden % GROUP:
            raise ValueError(f"{fn}: fp8_dispatch needs hidden divisible by {GROUP} (one scale per {GROUP} "
                             f"channels); hidden={self.hidden}")
        if self.low_latency_max_tokens:
            if self.hidden % GROUP:
                raise ValueError(f"{fn}: the low-latency path needs hidden divisible by {GROUP}; hidden="
                                 f"{self.hidden} (set low_latency_max_tokens=0 to disable it)")
            if 3 * self.topk > self.hidden:
                raise ValueError(f"{fn}: the low-latency backward needs 3 * topk <= hidden; got topk={self.topk}")

    @property
    def shared_ffn_hidden(self) -> int:
        """Width of the shared-expert MLP (0 without shared experts)."""
        return self.num_shared_experts * self.ffn_hidden

    @property
    def transport(self) -> str:
        """The ``Buffer`` transport name for ``ep_dispatch``."""
        return self.ep_dispatch
