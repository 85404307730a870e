"""Expert-parallel MoE layer on epcomm.

    from epcomm.layers import MoE, MoEConfig
    cfg = MoEConfig(hidden=4096, ffn_hidden=1408, num_experts=64, topk=6, num_shared_experts=2,
                    ep_dispatch="auto", low_latency_max_tokens=128)
    moe = MoE(cfg, group)            # every rank of the expert-parallel group
    y = moe(x)                       # x [tokens, hidden] on this rank; differentiable
    fut = moe.forward_async(x)       # with async_combine=True: overlap the combine with other work
    y = fut.wait()

One forward: router (float32 logits, softmax or sigmoid, top-k, optional normalisation) -> dispatch
(``Buffer.dispatch(..., layout="expert_major")``: rows arrive grouped by local expert, ready for the grouped
GEMM; or ``low_latency_dispatch`` for small batches) -> local SwiGLU experts (``torch._grouped_mm`` or a loop)
-> combine (weighted by the routing weights, each token's rows reduced in a fixed order: deterministic) -> plus
shared experts. Dispatch and combine are
``torch.autograd.Function``s whose backwards are the opposite communication with the same handle, so the
layer trains, with ``torch.utils.checkpoint`` too; gradients reach the router through the routing weights.

Configuration as frameworks name it
-----------------------------------
Megatron-LM (Megatron-Core ``TransformerConfig`` / command line):

* ``--moe-token-dispatcher-type alltoall`` -> ``ep_dispatch="alltoall"``.
* ``--moe-token-dispatcher-type flex --moe-enable-deepep`` (``moe_flex_dispatcher_backend="deepep"``)
  -> ``ep_dispatch="deepep"`` (an alias of ``"nvlink"``, the fast one-sided path).
* ``--moe-deepep-num-sms`` (Megatron's default 20) -> ``num_sms`` (must be even) when given explicitly;
  ``MoEConfig.num_sms`` defaults to None, epcomm's traffic model per call (24-40 SMs at DeepSeek sizes).
* ``--moe-router-topk``, ``--moe-router-score-function softmax|sigmoid`` -> ``topk``, ``router``;
  ``normalize_topk`` as the model does (Mixtral, DeepSeek-V3: True; Qwen-MoE: its ``norm_topk_prob``).
  ``--moe-router-topk-scaling-factor``, aux losses and expert bias are not part of this layer.
* ``--moe-ffn-hidden-size`` -> ``ffn_hidden``; ``--moe-shared-expert-intermediate-size`` ->
  ``num_shared_experts * ffn_hidden``.
* ``--moe-grouped-gemm`` -> ``grouped_gemm=True`` (None picks it automatically on SM90+ with BF16).
* ``--moe-shared-expert-overlap`` -> ``async_combine=True`` (the shared experts run during the combine).

SGLang:

* ``--moe-a2a-backend deepep`` (older ``--enable-deepep-moe``) -> ``ep_dispatch="deepep"``;
  ``--moe-a2a-backend none`` -> ``ep_dispatch="alltoall"`` (the closest portable path).
* ``--deepep-mode normal | low_latency | auto`` -> ``low_latency_max_tokens = 0 | T | T`` together with
  ``forward(mode="normal" | "low_latency" | None)``.
* ``SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK`` (128) -> ``low_latency_max_tokens``.

vLLM (``--all2all-backend``):

* ``deepep_high_throughput`` -> ``ep_dispatch="deepep"``, ``low_latency_max_tokens=0``.
* ``deepep_low_latency`` -> ``ep_dispatch="deepep"``, ``low_latency_max_tokens=T``,
  ``forward(mode="low_latency")``.
* ``naive`` / ``allgather_reducescatter`` -> ``ep_dispatch="alltoall"`` (closest portable path).
* ``pplx`` -> no direct equivalent; the low-latency mode plays its role.

DeepEP itself: ``Buffer(group, num_nvl_bytes, num_rdma_bytes)`` -> ``buffer_size_gb`` /
``moe_buffer_size_bytes``; ``Buffer.set_num_sms`` -> ``num_sms``; low-latency ``use_fp8=True`` and FP8
normal dispatch -> ``fp8_dispatch=True``.

``EPCOMM_TRANSPORT`` overrides ``ep_dispatch`` for the whole process. ``ep_dispatch`` other than ``auto`` and
``alltoall`` needs that transport to be registered in this build (``epcomm.transports.TRANSPORTS``);
otherwise creating the layer raises ``TransportUnavailableError``.

Paths and their rules
---------------------
* The path (normal or low-latency) must be the same on every rank: ``mode=None`` agrees on it with one
  all-reduce of the batch sizes (a host sync); pass ``mode`` explicitly in decode loops and CUDA graphs.
* The low-latency path never synchronises with the host (CUDA-graph capturable with a capturable
  transport); the normal path makes one host sync in the dispatch (exact receive sizes), except on one rank
  with the grouped GEMM and the expert-major layout: every pair is local there, so ``N * K`` bounds the rows
  exactly and the dispatch runs with ``num_worst_tokens`` (no host sync: the host issues the step ahead of the
  GPU; a bad expert id in given routing is then a deferred error of the Buffer, raised by its next call).
* Precision: normal mode sums in float32 and rounds once per rank and once after the combine (in slot
  order on each rank, then in rank order: ``epcomm.reference.expert_major_combine``); the
  low-latency combine is bfloat16 by design (DeepEP's too): the expert outputs are rounded to bfloat16 and
  the combined result is bfloat16, also for ``dtype=float32``. The gradients of the expert and router
  weights in low-latency mode are exact float32 (see ``epcomm.layers.autograd``).
* ``fp8_dispatch``: tokens travel as e4m3 with per-token, per-128-channel scales; gradients pass straight
  through the quantisation; the combine and all backward traffic use ``dtype``.

Buffer sizing: see ``epcomm.layers.buffers`` (``moe_buffer_size_bytes`` and its rule of thumb).
Timings: ``EPCOMM_DEBUG=1`` makes every rank log each forward's phases (router, layout, dispatch,
experts, combine, shared, the backward communication, ``bwd_weighting_in`` and ``bwd_weighting``, the backward of
the combine's weighting, moved onto the experts' narrow side: see ``epcomm.layers.autograd._WeightedCombine``);
``moe.timer.enabled = True`` and ``moe.timer.format_summary()`` give a summary without per-step logs.
"""

from .buffers import BufferSizes, destroy_buffers, get_buffer, moe_buffer_size_bytes
from .config import MoEConfig
from .dense import DenseMoE
from .moe import MoE, MoEFuture
from .ops import fp8_qdq, route, swiglu
from .timing import PhaseTimer

__all__ = ["MoE", "MoEConfig", "MoEFuture", "DenseMoE", "BufferSizes", "moe_buffer_size_bytes", "get_buffer",
           "destroy_buffers", "PhaseTimer", "route", "swiglu", "fp8_qdq"]
