"""Framework call sequences replayed through the ``deep_ep`` drop-in (``epcomm.deep_ep``), every output checked
bit for bit against ``epcomm.reference``. Used by the CPU tests and the GPU script alike.

Each replay makes its ``deep_ep`` calls in the order, with the arguments and keyword spellings, of one
integration's public source (read, not copied; names of its own helpers are kept where they explain a
step): vLLM's DeepEP high-throughput and low-latency prepare/finalize (plain, async and with two micro-batches),
SGLang's DeepEP dispatcher (normal mode with and without ``async_finish``, the switch to low latency that
cleans the buffer, and two-batch overlap with hooks), Megatron-Core's ``fused_a2a`` autograd functions
(forward and backward), xorl's ``ep_dispatch: deepep`` (dispatch + expert permutation, async combine,
backward), DeepEP's own README example and test checks, and DeepEP V2's ``ElasticBuffer`` (training,
prefill and vLLM's CUDA-graph decode mode). A replay returns a ``CaseResult``; the worker returns the failing
ones as ``(label, failures)``."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from .. import env, reference
from ..fp8 import per_token_cast_back, per_token_cast_to_fp8
from .checks import CaseResult, low_latency_ranges
from .routing import make_inputs

HIDDEN = 256
TOPK = 3
TOKENS = (9, 0, 13, 5)  # per rank, repeated over the ranks: uneven, one empty rank from 2 ranks on
MAX_TOKENS = 16  # low-latency T (>= every rank's tokens)


class Scenario:
    """One group's inputs and reference, shared by the replays: ``inputs(seed, routing, fp8)`` and helpers."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.rank, self.num_ranks, self.device = ctx.rank, ctx.world_size, ctx.device
        self.num_experts = 4 * ctx.world_size
        self.e_local = 4
        # ranks per node (EPCOMM_RANKS_PER_NODE splits the group into simulated nodes: the drop-in's Buffers are then
        # hierarchical, and the reference models that path)
        self.local_size = env.ranks_per_node() or ctx.world_size
        # vLLM hands DeepEP its CPU (gloo) group while the tensors are on the GPU
        self.cpu_group = dist.new_group(backend="gloo") if ctx.device.type == "cuda" else ctx.group

    def inputs(self, seed: int, routing: str = "dropped"):
        return make_inputs(seed, self.num_ranks, TOKENS, HIDDEN, self.num_experts, TOPK, routing, torch.bfloat16)

    def mine(self, inputs):
        return inputs[self.rank].to(self.device)

    def normal_reference(self, inputs, fp8: bool = False, with_weights: bool = True, alignment: int = 1):
        """``(reference.dispatch outputs, FP8 casts or None)`` of every rank."""
        casts = [per_token_cast_to_fp8(i.x) for i in inputs] if fp8 else None
        ref = reference.dispatch([c[0] for c in casts] if fp8 else [i.x for i in inputs],
                                 [i.topk_idx for i in inputs], self.num_experts,
                                 [i.topk_weights for i in inputs] if with_weights else None,
                                 [c[1] for c in casts] if fp8 else None, alignment, self.local_size)
        return ref, casts

    def combine_reference(self, ys, ref, inputs, weights=None, biases=None):
        """This rank's ``(combined_x, combined_topk_weights)`` when every rank ``r`` sends back ``ys[r]``."""
        return reference.combine(ys, ref, [i.x.size(0) for i in inputs], weights, biases, torch.bfloat16)[self.rank]


def expert_stand_in(rows: torch.Tensor, local_idx: Optional[torch.Tensor], weights: Optional[torch.Tensor],
                    rank: int) -> torch.Tensor:
    """A deterministic expert block for received rows ``[M, H]`` (the same bits wherever its inputs are the same):
    each row times ``sum_k w_k (1 + e_k / 8)`` over its local experts (or times ``1 + rank / 2`` without
    routing), in FP32, cast to bf16."""
    if local_idx is None:
        return (rows.float() * (1.0 + 0.5 * rank)).to(torch.bfloat16)
    terms = (weights.float() * (1.0 + local_idx.clamp(min=0).float() / 8)).masked_fill(local_idx < 0, 0)
    gain = torch.zeros(rows.size(0), dtype=torch.float32, device=rows.device)
    for k in range(terms.size(1)):  # slot by slot: the same sums on every device (no reduction kernel's order)
        gain = gain + terms[:, k]
    return (rows.float() * gain.unsqueeze(1)).to(torch.bfloat16)


def _dequant(recv_x):
    return per_token_cast_back(*recv_x, torch.bfloat16) if isinstance(recv_x, tuple) else recv_x


def _wait(event) -> None:
    """vLLM's receivers: wait only when the call returned an event."""
    if event.event is not None:
        event.current_stream_wait()


def check_recv(res: CaseResult, sc: Scenario, ref, casts, recv_x, recv_idx, recv_w, counts, label: str = "") -> None:
    mine = ref[sc.rank]
    m = mine.recv_x.size(0)
    data, scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
    res.expect(f"{label}recv_x", data[:m], mine.recv_x)
    if scales is not None:
        res.expect(f"{label}recv_x scales", scales[:m], mine.recv_scales)
    if recv_idx is not None:
        res.expect(f"{label}recv_topk_idx", recv_idx[:m], mine.recv_topk_idx)
    if recv_w is not None:
        res.expect(f"{label}recv_topk_weights", recv_w[:m], mine.recv_topk_weights)
    if counts is not None:
        res.expect_eq(f"{label}num_recv_tokens_per_expert_list", counts, mine.num_recv_tokens_per_expert)


def stand_in_outputs(sc: Scenario, ref) -> list:
    """Every rank's expert-block output for its reference dispatch (what each rank sends back)."""
    return [expert_stand_in(_dequant((r.recv_x, r.recv_scales)) if r.recv_scales is not None else r.recv_x,
                            r.recv_topk_idx, r.recv_topk_weights, rank) for rank, r in enumerate(ref)]


# ---------------------------------------------------------------------------------------------------- vLLM
def vllm_high_throughput(sc: Scenario, deep_ep) -> list:
    """vLLM's DeepEPHTAll2AllManager buffer and DeepEPHTPrepareAndFinalize (BF16 and block-FP8 dispatch; async
    prepare/finalize, and the dual-batch-overlap form with a captured previous event and no async_finish)."""
    buffer = deep_ep.Buffer(group=sc.cpu_group, num_nvl_bytes=1024 * 1024 * 1024, num_rdma_bytes=0,
                            low_latency_mode=False, num_qps_per_rank=1, explicitly_destroy=True)
    deep_ep.Buffer.set_num_sms(min(20, 20))
    available_rank_configs = [2, 4, 8, 16, 24, 32, 64, 128, 144, 160]
    dispatch_config = (deep_ep.Buffer.get_dispatch_config(sc.num_ranks)
                       if sc.num_ranks in available_rank_configs else None)
    combine_config = (deep_ep.Buffer.get_combine_config(sc.num_ranks)
                      if sc.num_ranks in available_rank_configs else None)
    out = []
    for seed, fp8, dbo in ((1, False, False), (2, True, False), (3, False, True)):
        res = CaseResult(f"vLLM HT fp8={fp8} dbo={dbo}")
        inputs = sc.inputs(seed)
        mine = sc.mine(inputs)
        ref, casts = sc.normal_reference(inputs, fp8)
        rank_expert_offset = sc.rank * sc.e_local
        previous_event = buffer.capture() if dbo else None
        tokens = (casts[sc.rank][0].to(sc.device), casts[sc.rank][1].to(sc.device)) if fp8 else mine.x
        (num_tokens_per_rank, num_tokens_per_rdma_rank, dispatch_expert_num_tokens, is_token_in_rank,
         event) = buffer.get_dispatch_layout(topk_idx=mine.topk_idx, num_experts=sc.num_experts,
                                             previous_event=previous_event, async_finish=False,
                                             allocate_on_comm_stream=False)
        (token_data, expert_topk_ids, expert_topk_weights, expert_num_tokens_per_expert_list, handle,
         event) = buffer.dispatch(x=tokens, handle=None, num_tokens_per_rank=num_tokens_per_rank,
                                  num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
                                  is_token_in_rank=is_token_in_rank, num_tokens_per_expert=dispatch_expert_num_tokens,
                                  topk_idx=mine.topk_idx, topk_weights=mine.topk_weights, expert_alignment=1,
                                  config=dispatch_config, previous_event=previous_event, async_finish=not dbo,
                                  allocate_on_comm_stream=False)
        _wait(event)
        res.expect_eq("event only when async", event.event is not None, not dbo)
        check_recv(res, sc, ref, casts, token_data, None, expert_topk_weights, expert_num_tokens_per_expert_list)
        # the receiver's re-mapping of local ids to global ones (-1 to an expert outside this rank)
        glob = torch.where(expert_topk_ids == -1, sc.num_experts - 1 if rank_expert_offset == 0 else 0,
                           expert_topk_ids + rank_expert_offset)
        want_local = ref[sc.rank].recv_topk_idx
        res.expect("global expert ids", glob.cpu(), torch.where(
            want_local == -1, sc.num_experts - 1 if rank_expert_offset == 0 else 0, want_local + rank_expert_offset))
        # finalize: weight-and-reduce (the stand-in) then combine without top-k weights
        fused_expert_output = expert_stand_in(_dequant(token_data), expert_topk_ids, expert_topk_weights, sc.rank)
        output = torch.full_like(mine.x, float("nan"))
        previous_event = buffer.capture() if dbo else None
        combined_x, _, event = buffer.combine(x=fused_expert_output, handle=handle, topk_weights=None,
                                              config=combine_config, previous_event=previous_event,
                                              async_finish=not dbo, allocate_on_comm_stream=False)
        _wait(event)
        output.copy_(combined_x, non_blocking=True)
        res.expect("combined output", output, sc.combine_reference(stand_in_outputs(sc, ref), ref, inputs)[0])
        out.append(res)
    buffer.destroy()
    return out


def vllm_low_latency(sc: Scenario, deep_ep) -> list:
    """vLLM's DeepEPLLAll2AllManager buffer and DeepEPLLPrepareAndFinalize: dispatch with a receive hook, combine
    into ``out``; one batch (hook run at once, plain combine) and two micro-batches in flight (both hooked)."""
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN, num_ranks=sc.num_ranks,
        num_experts=sc.num_experts)
    buffer = deep_ep.Buffer(group=sc.cpu_group, num_nvl_bytes=1024 * 1024 * 1024, num_rdma_bytes=num_rdma_bytes,
                            low_latency_mode=True, num_qps_per_rank=sc.e_local,
                            allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, explicitly_destroy=True,
                            enable_shrink=False)
    out = []
    for use_fp8, micro_batches in ((True, 1), (False, 2)):
        res = CaseResult(f"vLLM LL fp8={use_fp8} micro-batches={micro_batches}")
        batches = [sc.inputs(20 + b + 2 * use_fp8, "uniform") for b in range(micro_batches)]
        handles, recvs, hooks = [None, None], [], []
        for b, inputs in enumerate(batches):  # prepare_async for each micro-batch
            mine = sc.mine(inputs)
            expert_x, expert_num_tokens, handle, _, hook = buffer.low_latency_dispatch(
                mine.x, mine.topk_idx, MAX_TOKENS, sc.num_experts, use_fp8=use_fp8, round_scale=False,
                use_ue8m0=False, async_finish=False, return_recv_hook=True)
            handles[b] = handle
            recvs.append((expert_x, expert_num_tokens))
            hooks.append(hook)
            if micro_batches == 1:  # prepare(): the hook at once
                hook()
        if micro_batches > 1:  # two micro-batches: both dispatches in flight, then both receives
            for hook in hooks:
                hook()
        outputs, recv_hooks = [], []
        for b, inputs in enumerate(batches):  # finalize
            mine = sc.mine(inputs)
            ys = check_low_latency_recv(res, sc, inputs, recvs[b][0], recvs[b][1], handles[b], use_fp8, f"mb{b} ")
            output = torch.full_like(mine.x, float("nan"))
            _, _, recv_hook = buffer.low_latency_combine(ys[sc.rank], mine.topk_idx, mine.topk_weights, handles[b],
                                                         async_finish=False, zero_copy=False,
                                                         return_recv_hook=micro_batches > 1, out=output)
            outputs.append((output, inputs, ys))
            recv_hooks.append(recv_hook)
        for recv_hook in recv_hooks:
            if recv_hook is not None:
                recv_hook()
        for b, (output, inputs, ys) in enumerate(outputs):
            res.expect(f"mb{b} combined", output, low_latency_combine_reference(sc, inputs, ys, use_fp8))
        out.append(res)
    buffer.destroy()
    return out


def _ll_reference(sc: Scenario, inputs, use_fp8: bool, round_scale: bool = False, use_ue8m0: bool = False):
    return reference.low_latency_dispatch([i.x for i in inputs], [i.topk_idx for i in inputs], sc.num_experts,
                                          use_fp8, round_scale, use_ue8m0, sc.local_size)


def low_latency_expert_outputs(sc: Scenario, ref, use_fp8: bool) -> list:
    """Every rank's ``[E_local, R * T, H]`` bf16 expert outputs (NaN past each expert's rows) and per-expert rows."""
    padded, per_rank = [], []
    for d in ref:
        rows = []
        y = torch.full((sc.e_local, sc.num_ranks * MAX_TOKENS, HIDDEN), float("nan"), dtype=torch.bfloat16)
        for e in range(sc.e_local):
            x = d.x[e]
            if use_fp8:
                x = per_token_cast_back(x, d.scales[e], torch.bfloat16) if x.numel() else x.to(torch.bfloat16)
            rows.append((x.float() * (1.0 + 0.125 * e)).to(torch.bfloat16))
            y[e, :d.count[e]] = rows[-1]
        padded.append(y)
        per_rank.append(rows)
    return padded, per_rank


def check_low_latency_recv(res: CaseResult, sc: Scenario, inputs, recv_x, recv_count, handle, use_fp8: bool,
                           label: str = "", round_scale: bool = False, use_ue8m0: bool = False) -> list:
    """Check a low-latency receive against the reference; return every rank's padded expert outputs (on this
    rank's device for this rank)."""
    ref = _ll_reference(sc, inputs, use_fp8, round_scale, use_ue8m0)
    mine = ref[sc.rank]
    data, scales = recv_x if use_fp8 else (recv_x, None)
    res.expect(f"{label}recv_count", recv_count, torch.tensor(mine.count, dtype=torch.int32))
    for e in range(sc.e_local):
        c = mine.count[e]
        res.expect(f"{label}recv_x[{e}]", data[e, :c], mine.x[e])
        if scales is not None:
            res.expect(f"{label}recv_scales[{e}]", scales[e, :c], mine.scales[e])
        res.expect(f"{label}handle[0] src_info[{e}]", handle[0][e, :c].long(), mine.src_idx[e])
    padded, _ = low_latency_expert_outputs(sc, ref, use_fp8)
    return [y.to(sc.device) if r == sc.rank else y for r, y in enumerate(padded)]


def low_latency_combine_reference(sc: Scenario, inputs, ys, use_fp8: bool, round_scale: bool = False,
                                  use_ue8m0: bool = False) -> torch.Tensor:
    ref = _ll_reference(sc, inputs, use_fp8, round_scale, use_ue8m0)
    _, per_rank = low_latency_expert_outputs(sc, ref, use_fp8)
    return reference.low_latency_combine(per_rank, ref, [i.topk_idx for i in inputs], [i.topk_weights for i in inputs],
                                         sc.num_experts)[sc.rank]


# ---------------------------------------------------------------------------------------------------- SGLang
def sglang(sc: Scenario, deep_ep) -> list:
    """SGLang's DeepEPBuffer (auto mode: normal and low-latency in one buffer, sized by the config and
    low-latency hints; a JSON DeepEP config), ``_DeepEPDispatcherImplNormal`` with and without async_finish,
    the switch to low latency (``clean_low_latency_buffer``) and ``_DeepEPDispatcherImplLowLatency``, alone
    (async_finish) and in two-batch overlap (hooks, both batches in flight)."""
    Buffer, Config = deep_ep.Buffer, deep_ep.Config
    config_parsed = {"normal_dispatch": {"num_sms": 24, "num_max_nvl_chunked_send_tokens": 16,
                                         "num_max_nvl_chunked_recv_tokens": 256,
                                         "num_max_rdma_chunked_send_tokens": 6,
                                         "num_max_rdma_chunked_recv_tokens": 128},
                     "normal_combine": {"num_sms": 24, "num_max_nvl_chunked_send_tokens": 8,
                                        "num_max_nvl_chunked_recv_tokens": 256,
                                        "num_max_rdma_chunked_send_tokens": 6,
                                        "num_max_rdma_chunked_recv_tokens": 128}}
    normal_dispatch_config = Config(**config_parsed["normal_dispatch"])
    normal_combine_config = Config(**config_parsed["normal_combine"])
    group, hidden_bytes = sc.ctx.group, HIDDEN * 2
    num_nvl_bytes, num_rdma_bytes = 0, 0
    for config in (normal_dispatch_config, normal_combine_config):
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()), num_nvl_bytes)
        num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, group.size()), num_rdma_bytes)
    num_rdma_bytes = max(Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, HIDDEN, group.size(), sc.num_experts),
                         num_rdma_bytes)
    num_qps_per_rank = max(config_parsed["normal_dispatch"]["num_sms"], sc.num_experts // group.size())
    buffer = Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode=True, num_qps_per_rank=num_qps_per_rank,
                    allow_mnnvl=True)
    out = []
    for seed, async_finish, alignment in ((30, False, 128), (31, True, 1)):
        res = CaseResult(f"SGLang normal async_finish={async_finish} expert_alignment={alignment}")
        inputs = sc.inputs(seed)
        mine = sc.mine(inputs)
        ref, casts = sc.normal_reference(inputs, fp8=True, alignment=alignment)
        hidden_states = (casts[sc.rank][0].to(sc.device), casts[sc.rank][1].to(sc.device))
        topk_ids = mine.topk_idx.to(torch.int64)
        previous_event = Buffer.capture() if async_finish else None  # dispatch_a
        (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank,
         previous_event) = buffer.get_dispatch_layout(topk_ids, sc.num_experts, previous_event=previous_event,
                                                      async_finish=async_finish,
                                                      allocate_on_comm_stream=previous_event is not None)
        recv_x, recv_topk_ids, recv_topk_weights, num_recv_tokens_per_expert, handle, event = buffer.dispatch(
            hidden_states, topk_idx=topk_ids, topk_weights=mine.topk_weights, num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert, previous_event=previous_event, async_finish=async_finish,
            allocate_on_comm_stream=(previous_event is not None) and async_finish, expert_alignment=alignment,
            config=normal_dispatch_config)
        event.current_stream_wait() if async_finish else ()
        check_recv(res, sc, ref, casts, recv_x, recv_topk_ids, recv_topk_weights, num_recv_tokens_per_expert)
        output = expert_stand_in(_dequant(recv_x), recv_topk_ids, recv_topk_weights, sc.rank)
        previous_event = Buffer.capture() if async_finish else None  # combine_a
        combined_x, _, event = buffer.combine(output, handle, async_finish=async_finish, previous_event=previous_event,
                                              allocate_on_comm_stream=previous_event is not None,
                                              config=normal_combine_config)
        event.current_stream_wait() if async_finish else ()
        res.expect("combined", combined_x, sc.combine_reference(stand_in_outputs(sc, ref), ref, inputs)[0])
        out.append(res)
    # set_dispatch_mode_as_low_latency after normal mode: the buffer is cleaned first
    buffer.clean_low_latency_buffer(MAX_TOKENS, HIDDEN, sc.num_experts)
    for return_recv_hook in (False, True):
        res = CaseResult(f"SGLang low latency return_recv_hook={return_recv_hook} (two-batch overlap with hooks)")
        batches = [sc.inputs(40 + b + 2 * return_recv_hook) for b in range(1 + return_recv_hook)]
        states = []
        for inputs in batches:  # dispatch_a of each batch (two-batch overlap: both before either dispatch_b)
            mine = sc.mine(inputs)
            topk_ids = mine.topk_idx.to(torch.int64)
            expected_m = (mine.x.shape[0] * buffer.group_size * topk_ids.shape[1] + sc.num_experts) // sc.num_experts
            packed_recv_hidden, packed_recv_count, handle, event, hook = buffer.low_latency_dispatch(
                mine.x, topk_ids, MAX_TOKENS, sc.num_experts, use_fp8=True, async_finish=not return_recv_hook,
                return_recv_hook=return_recv_hook, round_scale=False, use_ue8m0=False)
            states.append((inputs, packed_recv_hidden, packed_recv_count, handle, event, hook, expected_m))
        combines = []
        for b, (inputs, hidden_states, masked_m, handle, event, hook, expected_m) in enumerate(states):  # dispatch_b
            hook() if return_recv_hook else event.current_stream_wait()
            ys = check_low_latency_recv(res, sc, inputs, hidden_states, masked_m, handle, True, f"b{b} ")
            mine = sc.mine(inputs)
            combined_hidden_states, event, hook = buffer.low_latency_combine(  # combine_a
                x=ys[sc.rank], topk_idx=mine.topk_idx, topk_weights=mine.topk_weights, handle=handle,
                async_finish=not return_recv_hook, return_recv_hook=return_recv_hook)
            combines.append((inputs, ys, combined_hidden_states, event, hook))
        for b, (inputs, ys, hidden_states, event, hook) in enumerate(combines):  # combine_b
            hook() if return_recv_hook else event.current_stream_wait()
            res.expect(f"b{b} combined", hidden_states, low_latency_combine_reference(sc, inputs, ys, True))
        out.append(res)
    return out


# ---------------------------------------------------------------------------------------------------- Megatron
def megatron(sc: Scenario, deep_ep) -> list:
    """Megatron-Core's ``fused_a2a``: ``get_buffer`` sized by the config hints, ``FusedDispatch`` and
    ``FusedCombine`` as autograd functions (forward: layout + dispatch; backward: combine of the gradients with
    their top-k weights / cached dispatch), with async_finish off and on; gradients checked too."""
    Buffer, EventOverlap, EventHandle = deep_ep.Buffer, deep_ep.EventOverlap, deep_ep.utils.EventHandle
    state = {"buffer": None}

    def get_hidden_bytes(x):
        return x.size(1) * max(x.element_size(), 2)

    def get_buffer(group, hidden_bytes):
        num_nvl_bytes, num_rdma_bytes = 0, 0
        for config in (Buffer.get_dispatch_config(group.size()), Buffer.get_combine_config(group.size())):
            num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()), num_nvl_bytes)
            if Buffer.is_sm90_compiled():
                num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, group.size()), num_rdma_bytes)
        buf = state["buffer"]
        if (buf is None or buf.group != group or buf.num_nvl_bytes < num_nvl_bytes
                or buf.num_rdma_bytes < num_rdma_bytes):
            state["buffer"] = Buffer(group, num_nvl_bytes, num_rdma_bytes, explicitly_destroy=True)
        return state["buffer"]

    class FusedDispatch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, token_indices, token_probs, num_experts, group, async_finish=False,
                    allocate_on_comm_stream=False):
            previous_event = EventOverlap(EventHandle()) if async_finish else None
            buffer = get_buffer(group, get_hidden_bytes(x))
            (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank,
             event) = buffer.get_dispatch_layout(token_indices, num_experts, previous_event=previous_event,
                                                 async_finish=async_finish,
                                                 allocate_on_comm_stream=allocate_on_comm_stream)
            (recv_x, recv_token_indices, recv_token_probs, num_recv_tokens_per_expert_list, handle,
             after_event_overlap) = buffer.dispatch(
                x, topk_idx=token_indices, topk_weights=token_probs, num_tokens_per_rank=num_tokens_per_rank,
                num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
                num_tokens_per_expert=num_tokens_per_expert, previous_event=event, async_finish=async_finish,
                allocate_on_comm_stream=allocate_on_comm_stream)
            if async_finish:
                after_event_overlap.current_stream_wait()
            ctx.group, ctx.handle = group, handle
            ctx.async_finish, ctx.allocate_on_comm_stream = async_finish, allocate_on_comm_stream
            tokens_per_expert = torch.tensor(num_recv_tokens_per_expert_list)
            return recv_x, recv_token_indices, recv_token_probs, tokens_per_expert, handle

        @staticmethod
        def backward(ctx, grad_output, grad_token_indices, grad_token_probs, grad_tokens_per_expert, grad_handle):
            buffer = get_buffer(ctx.group, get_hidden_bytes(grad_output))
            previous_event = EventOverlap(EventHandle()) if ctx.async_finish else None
            grad_x, grad_token_probs, after_event = buffer.combine(
                grad_output.contiguous(), ctx.handle, topk_weights=grad_token_probs.float(),
                previous_event=previous_event, async_finish=ctx.async_finish,
                allocate_on_comm_stream=ctx.allocate_on_comm_stream)
            if ctx.async_finish:
                after_event.current_stream_wait()
            return grad_x, None, grad_token_probs, None, None, None, None

    class FusedCombine(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group, handle, async_finish=False, allocate_on_comm_stream=False):
            previous_event = EventOverlap(EventHandle()) if async_finish else None
            buffer = get_buffer(group, get_hidden_bytes(x))
            combined_x, _, after_event = buffer.combine(x, handle=handle, async_finish=async_finish,
                                                        previous_event=previous_event,
                                                        allocate_on_comm_stream=allocate_on_comm_stream)
            if async_finish:
                after_event.current_stream_wait()
            ctx.handle, ctx.group = handle, group
            ctx.async_finish, ctx.allocate_on_comm_stream = async_finish, allocate_on_comm_stream
            return combined_x, None

        @staticmethod
        def backward(ctx, grad_output, previous_event=None):
            previous_event = EventOverlap(EventHandle()) if ctx.async_finish else None
            buffer = get_buffer(ctx.group, get_hidden_bytes(grad_output))
            grad_x, _, _, _, _, after_event = buffer.dispatch(grad_output.contiguous(), handle=ctx.handle,
                                                              previous_event=previous_event,
                                                              async_finish=ctx.async_finish,
                                                              allocate_on_comm_stream=ctx.allocate_on_comm_stream)
            if ctx.async_finish:
                after_event.current_stream_wait()
            return grad_x, None, None, None, None

    out = []
    for seed, async_finish in ((50, False), (51, True)):
        res = CaseResult(f"Megatron fused_a2a async_finish={async_finish}")
        inputs = sc.inputs(seed)
        mine = sc.mine(inputs)
        ref, _ = sc.normal_reference(inputs)
        x = mine.x.clone().requires_grad_(True)
        probs = mine.topk_weights.clone().requires_grad_(True)
        recv_x, recv_idx, recv_probs, tokens_per_expert, handle = FusedDispatch.apply(
            x, mine.topk_idx, probs, sc.num_experts, sc.ctx.group, async_finish, async_finish)
        check_recv(res, sc, ref, None, recv_x, recv_idx, recv_probs, tokens_per_expert.tolist())
        scale = 0.5 * (1 + sc.rank)  # the expert stand-in: a power of two times the rank's rows (exact in bf16)
        combined, _ = FusedCombine.apply(recv_x * scale, sc.ctx.group, handle, async_finish, async_finish)
        ys = [(r.recv_x.float() * (0.5 * (1 + s))).to(torch.bfloat16) for s, r in enumerate(ref)]
        res.expect("combined", combined, sc.combine_reference(ys, ref, inputs)[0])
        # backward: d(loss)/d(combined) = g, d(loss)/d(recv_probs) = c
        gen = torch.Generator().manual_seed(seed + 100)
        gs = [torch.randn(i.x.shape, generator=gen).to(torch.bfloat16) for i in inputs]
        cs = [torch.randn(r.recv_x.size(0), TOPK, generator=gen) for r in ref]
        loss = ((combined.float() * gs[sc.rank].to(sc.device).float()).sum()
                + (recv_probs * cs[sc.rank].to(sc.device)).sum())
        loss.backward()
        back = reference.dispatch([g for g in gs], [i.topk_idx for i in inputs], sc.num_experts,
                                  local_size=sc.local_size)
        grad_recv = [(b.recv_x.float() * (0.5 * (1 + s))).to(torch.bfloat16) for s, b in enumerate(back)]
        want_x, want_w = sc.combine_reference(grad_recv, ref, inputs, weights=cs)
        res.expect("grad x", x.grad, want_x)
        res.expect("grad probs", probs.grad, want_w)
        out.append(res)
    state["buffer"].destroy()
    return out


# ---------------------------------------------------------------------------------------------------- xorl
def xorl(sc: Scenario, deep_ep) -> list:
    """xorl's ``ep_dispatch: deepep``: ``DeepEPBuffer.init_buffer`` (set_num_sms before the configs; config
    hints over a fixed size), then ``_FusedDispatchAndPermute`` / ``_FusedUnpermuteAndCombine``: every call with
    ``EventOverlap(EventHandle())`` as previous event, async_finish and allocate_on_comm_stream, the combine's
    event kept pending (deferred sync), and the backward's combine and cached dispatch."""
    deep_ep.Buffer.set_num_sms(20)
    num_ranks = sc.ctx.group.size()
    dispatch_config = deep_ep.Buffer.get_dispatch_config(num_ranks)
    combine_config = deep_ep.Buffer.get_combine_config(num_ranks)
    num_nvl_bytes, num_rdma_bytes = int(0.25 * 1e9), 0
    for config in (dispatch_config, combine_config):
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(HIDDEN * 2, num_ranks), num_nvl_bytes)
        num_rdma_bytes = max(config.get_rdma_buffer_size_hint(HIDDEN * 2, num_ranks), num_rdma_bytes)
    buffer = deep_ep.Buffer(group=sc.ctx.group, num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes,
                            low_latency_mode=False, explicitly_destroy=True)
    EventOverlap, EventHandle = deep_ep.utils.EventOverlap, deep_ep.utils.EventHandle
    res = CaseResult("xorl deepep dispatch+permute / unpermute+combine")
    inputs = sc.inputs(60)
    mine = sc.mine(inputs)
    ref, _ = sc.normal_reference(inputs)
    topk_idx_deepep = mine.topk_idx.to(deep_ep.topk_idx_t)
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = \
        buffer.get_dispatch_layout(topk_idx_deepep, sc.num_experts)
    recv_x, recv_topk_idx, recv_topk_weights, recv_counts, handle, event = buffer.dispatch(
        x=mine.x.contiguous(), num_tokens_per_rank=num_tokens_per_rank,
        num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
        is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx_deepep,
        topk_weights=mine.topk_weights.to(torch.float32), config=dispatch_config,
        previous_event=EventOverlap(EventHandle()), async_finish=True, allocate_on_comm_stream=True)
    event.current_stream_wait()
    check_recv(res, sc, ref, None, recv_x, recv_topk_idx, recv_topk_weights, recv_counts)
    expert_out = [_xorl_expert_block(r.recv_x, r.recv_topk_idx, r.recv_topk_weights, sum(r.num_recv_tokens_per_expert),
                                     s) for s, r in enumerate(ref)]
    gather_output = _xorl_expert_block(recv_x.cpu(), recv_topk_idx.cpu(), recv_topk_weights.cpu(), sum(recv_counts),
                                       sc.rank).to(sc.device)  # on the CPU: GPU scatter-adds add in any order
    combined_x, _, event = buffer.combine(x=gather_output.contiguous(), handle=handle, config=combine_config,
                                          previous_event=EventOverlap(EventHandle()), async_finish=True,
                                          allocate_on_comm_stream=True)
    pending = event  # _store_pending_event: synchronised later, before the next layer reads the output
    pending.current_stream_wait()
    res.expect("combined", combined_x, sc.combine_reference(expert_out, ref, inputs)[0])
    # backward of the combine: a cached dispatch of the output gradient
    grads = [(i.x.float() * 0.25).to(torch.bfloat16) for i in inputs]
    grad_gather, _, _, _, _, event = buffer.dispatch(x=grads[sc.rank].to(sc.device).contiguous(), handle=handle,
                                                     config=dispatch_config, previous_event=EventOverlap(EventHandle()),
                                                     async_finish=True, allocate_on_comm_stream=True)
    event.current_stream_wait()
    back = reference.dispatch(grads, [i.topk_idx for i in inputs], sc.num_experts, local_size=sc.local_size)
    res.expect("backward cached dispatch", grad_gather, back[sc.rank].recv_x)
    buffer.destroy()
    return [res]


def _xorl_expert_block(recv_x, recv_topk_idx, recv_topk_weights, num_valid: int, rank: int) -> torch.Tensor:
    """xorl's permute (stable sort of the (row, slot) pairs by local expert), a per-expert stand-in, and the
    unpermute (scatter-add back to received rows), in bf16 as xorl does."""
    topk = recv_topk_idx.shape[1]
    flat = recv_topk_idx.reshape(-1)
    keys = torch.where(flat >= 0, flat.long(), torch.iinfo(torch.int64).max)
    order = torch.argsort(keys, stable=True)[:num_valid]
    rows = order // topk
    permuted_x = recv_x.index_select(0, rows)
    scores = recv_topk_weights.reshape(-1)[order]
    expert_output = (permuted_x.float() * scores.unsqueeze(1) * (1.0 + 0.5 * rank)).to(recv_x.dtype)
    gather = torch.zeros(recv_x.shape, dtype=recv_x.dtype, device=recv_x.device)
    gather.scatter_add_(0, rows.unsqueeze(1).expand(-1, recv_x.size(1)), expert_output)
    return gather


# ---------------------------------------------------------------------------------------------------- DeepEP
def deepep_readme(sc: Scenario, deep_ep) -> list:
    """DeepEP's README training/prefill example: ``Buffer.set_num_sms(24)``, ``get_buffer`` from the config hints,
    dispatch_forward (layout and dispatch with async_finish and a previous event), combine_forward,
    dispatch_backward (combine with top-k weights) and combine_backward (cached dispatch), FP8 and BF16."""
    Buffer = deep_ep.Buffer
    Buffer.set_num_sms(24)
    group = sc.ctx.group
    num_nvl_bytes, num_rdma_bytes = 0, 0
    for config in (Buffer.get_dispatch_config(group.size()), Buffer.get_combine_config(group.size())):
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(HIDDEN * 2, group.size()), num_nvl_bytes)
        num_rdma_bytes = max(config.get_rdma_buffer_size_hint(HIDDEN * 2, group.size()), num_rdma_bytes)
    buffer = Buffer(group, num_nvl_bytes, num_rdma_bytes)
    out = []
    for seed, fp8, with_previous in ((70, True, True), (71, False, False)):
        res = CaseResult(f"DeepEP README normal example fp8={fp8} previous_event={with_previous}")
        inputs = sc.inputs(seed)
        mine = sc.mine(inputs)
        ref, casts = sc.normal_reference(inputs, fp8)
        x = (casts[sc.rank][0].to(sc.device), casts[sc.rank][1].to(sc.device)) if fp8 else mine.x
        previous_event = buffer.capture() if with_previous else None
        num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, previous_event = \
            buffer.get_dispatch_layout(mine.topk_idx, sc.num_experts, previous_event=previous_event, async_finish=True,
                                       allocate_on_comm_stream=previous_event is not None)
        recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event = buffer.dispatch(
            x, topk_idx=mine.topk_idx, topk_weights=mine.topk_weights, num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert, previous_event=previous_event, async_finish=True,
            allocate_on_comm_stream=True)
        with event:  # EventOverlap as a context manager: the current stream waits on exit
            pass
        check_recv(res, sc, ref, casts, recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list)
        y = expert_stand_in(_dequant(recv_x), recv_topk_idx, recv_topk_weights, sc.rank)
        previous_event = buffer.capture() if with_previous else None
        combined_x, _, event = buffer.combine(y, handle, async_finish=True, previous_event=previous_event,
                                              allocate_on_comm_stream=previous_event is not None)
        event.current_stream_wait()
        res.expect("combine_forward", combined_x, sc.combine_reference(stand_in_outputs(sc, ref), ref, inputs)[0])
        # dispatch_backward: a combine of the received gradient and its top-k weights
        grad_recv = [(_dequant((r.recv_x, r.recv_scales)) if fp8 else r.recv_x) for r in ref]
        combined_grad_x, combined_grad_recv_topk_weights, event = buffer.combine(
            grad_recv[sc.rank].to(sc.device), handle, topk_weights=recv_topk_weights, async_finish=True)
        event.current_stream_wait()
        want_x, want_w = sc.combine_reference(grad_recv, ref, inputs, weights=[r.recv_topk_weights for r in ref])
        res.expect("dispatch_backward grad x", combined_grad_x, want_x)
        res.expect("dispatch_backward grad weights", combined_grad_recv_topk_weights, want_w)
        # combine_backward: a cached dispatch of the combined gradient
        grads = [(i.x.float() * -2.0).to(torch.bfloat16) for i in inputs]
        previous_event = buffer.capture() if with_previous else None
        grad_x, _, _, _, _, event = buffer.dispatch(grads[sc.rank].to(sc.device), handle=handle, async_finish=True,
                                                    previous_event=previous_event,
                                                    allocate_on_comm_stream=previous_event is not None)
        event.current_stream_wait()
        res.expect("combine_backward", grad_x, reference.dispatch(grads, [i.topk_idx for i in inputs],
                                                                  sc.num_experts, local_size=sc.local_size
                                                                  )[sc.rank].recv_x)
        out.append(res)
    return out + deepep_tests(sc, deep_ep, buffer)


def deepep_tests(sc: Scenario, deep_ep, buffer) -> list:
    """Checks of DeepEP's own intranode and low-latency tests: ``handle[0]`` (rank prefix matrix) against the
    received rows, ``num_worst_tokens`` (an empty list, padding ids -1, the same rows first), a dispatch without
    top-k (the per-expert list from the layout) and its cached dispatch; low-latency dispatch with
    ``cumulative_local_expert_recv_stats`` and every FP8 mode, ``handle[1]`` (packed layout ranges), zero-copy
    combine through ``get_next_low_latency_combine_buffer`` into ``out``."""
    res = CaseResult("DeepEP tests: intranode")
    inputs = sc.inputs(80)
    mine = sc.mine(inputs)
    ref, _ = sc.normal_reference(inputs)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(mine.topk_idx, sc.num_experts)
    config = deep_ep.Config(deep_ep.Buffer.num_sms, 8, 256)
    args = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                config=config)
    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(mine.x, topk_idx=mine.topk_idx,
                                                                  topk_weights=mine.topk_weights, **args)
    rank_prefix_matrix = handle[0]
    m = ref[sc.rank].recv_x.size(0)
    ends = [int(rank_prefix_matrix[i][sc.rank]) for i in range(sc.num_ranks)]
    src = ref[sc.rank].recv_src_rank
    res.expect_eq("handle[0][i][rank]", ends, [int((src <= i).sum()) for i in range(sc.num_ranks)])
    res.expect("handle[3] recv_src_idx", handle[3][:m].long(), ref[sc.rank].recv_src_idx)
    num_worst_tokens = max(i.x.size(0) for i in inputs) * sc.num_ranks
    worst_x, worst_idx, worst_w, empty_list, _, _ = buffer.dispatch(mine.x, topk_idx=mine.topk_idx,
                                                                    topk_weights=mine.topk_weights,
                                                                    num_worst_tokens=num_worst_tokens, **args)
    res.expect_eq("num_worst_tokens: empty list, rows", (len(empty_list), worst_x.size(0)), (0, num_worst_tokens))
    res.expect("num_worst_tokens: the same rows first", worst_x[:m], recv_x)
    res.expect_eq("num_worst_tokens: padding ids -1", bool((worst_idx[m:] == -1).all()), True)
    plain_x, _, _, plain_counts, plain_handle, _ = buffer.dispatch(mine.x, **args)
    res.expect("without top-k: recv_x", plain_x, ref[sc.rank].recv_x)
    res.expect_eq("without top-k: per-expert list from the layout", plain_counts, counts)
    cached_x, *_ = buffer.dispatch(mine.x, handle=plain_handle, config=config)
    res.expect("cached dispatch", cached_x, ref[sc.rank].recv_x)
    out = [res]
    # DeepEP's low-latency test and README decode example: a buffer in low-latency mode sized by the hint
    ll_buffer = deep_ep.Buffer(sc.ctx.group, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(
        MAX_TOKENS, HIDDEN, sc.num_ranks, sc.num_experts), low_latency_mode=True,
        num_qps_per_rank=sc.num_experts // sc.num_ranks)
    for hook_mode, use_fp8, round_scale, use_ue8m0 in ((False, False, False, False), (True, True, False, False),
                                                       (False, True, True, False), (True, True, True, True)):
        res = CaseResult(f"DeepEP tests: low latency hook={hook_mode} fp8={use_fp8} round_scale={round_scale} "
                         f"ue8m0={use_ue8m0}")
        ll_inputs = sc.inputs(90 + len(out), "dropped")
        mine = sc.mine(ll_inputs)
        stats = torch.zeros((sc.e_local,), dtype=torch.int, device=sc.device)
        packed_recv_x, packed_recv_count, handle, event, hook = ll_buffer.low_latency_dispatch(
            mine.x, mine.topk_idx, MAX_TOKENS, sc.num_experts, use_fp8=use_fp8, round_scale=round_scale,
            use_ue8m0=use_ue8m0, cumulative_local_expert_recv_stats=stats, async_finish=not hook_mode,
            return_recv_hook=hook_mode)
        hook() if hook_mode else event.current_stream_wait()
        ys = check_low_latency_recv(res, sc, ll_inputs, packed_recv_x, packed_recv_count, handle, use_fp8, "",
                                    round_scale, use_ue8m0)
        res.expect("cumulative_local_expert_recv_stats", stats, packed_recv_count)
        int_mask = (2 ** 32) - 1
        layout = handle[1]
        ll_ref = _ll_reference(sc, ll_inputs, use_fp8, round_scale, use_ue8m0)[sc.rank]
        sources = layout.size(1)  # the source ranks (across nodes too: the handle names the true sources)
        for i in range(sc.e_local):
            begins = [int(layout[i][j] >> 32) for j in range(sources)]
            lens = [int(layout[i][j] & int_mask) for j in range(sources)]
            want = low_latency_ranges(ll_ref, i)
            res.expect_eq(f"handle[1][{i}] counts", lens, [c for _, c in want])
            res.expect_eq(f"handle[1][{i}] begins", begins, [b for b, _ in want])
        res.expect_eq("handle[2:]", tuple(handle[2:]), (MAX_TOKENS, HIDDEN, sc.num_experts))
        ll_buffer.get_next_low_latency_combine_buffer(handle)[:, :, :] = ys[sc.rank]
        out_t = torch.empty((mine.x.size(0), HIDDEN), dtype=torch.bfloat16, device=sc.device)
        combined_x, event, hook = ll_buffer.low_latency_combine(torch.zeros_like(ys[sc.rank]), mine.topk_idx,
                                                             mine.topk_weights, handle, use_logfmt=False,
                                                             async_finish=not hook_mode, zero_copy=True,
                                                             return_recv_hook=hook_mode, out=out_t)
        hook() if hook_mode else event.current_stream_wait()
        res.expect("zero-copy combine into out",
                   out_t, low_latency_combine_reference(sc, ll_inputs, ys, use_fp8, round_scale, use_ue8m0))
        res.expect_eq("combined is out", combined_x.data_ptr() == out_t.data_ptr(), True)
        out.append(res)
    ll_buffer.destroy()
    buffer.destroy()
    return out


# ---------------------------------------------------------------------------------------------------- DeepEP V2
def elastic(sc: Scenario, deep_ep) -> list:
    """DeepEP V2's README (``get_buffer`` from ``get_buffer_size_hint``, ``get_theoretical_num_sms``; training:
    dispatch/combine forward and backward with async_with_compute_stream; decoding with a cached handle) and
    vLLM's V2 decode mode (``do_cpu_sync=False``, a power-of-two ``num_max_tokens_per_rank``, the prefix sums)."""
    ElasticBuffer = deep_ep.ElasticBuffer
    group = sc.ctx.group
    num_max_tokens_per_rank = max(TOKENS)
    required_bytes = ElasticBuffer.get_buffer_size_hint(group, num_max_tokens_per_rank, HIDDEN, num_topk=TOPK,
                                                        use_fp8_dispatch=True)
    buffer = ElasticBuffer(group, num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=HIDDEN, num_topk=TOPK,
                           use_fp8_dispatch=True, explicitly_destroy=True)
    num_comm_sms = buffer.get_theoretical_num_sms(sc.num_experts, TOPK)
    out = []
    res = CaseResult("DeepEP V2 ElasticBuffer training")
    res.expect_eq("buffer sized by the hint, even SMs", (buffer.num_bytes >= required_bytes, num_comm_sms % 2),
                  (True, 0))
    inputs = sc.inputs(100)
    mine = sc.mine(inputs)
    ref, casts = sc.normal_reference(inputs, fp8=True)
    x = (casts[sc.rank][0].to(sc.device), casts[sc.rank][1].to(sc.device))
    recv_x, recv_topk_idx, recv_topk_weights, handle, event = buffer.dispatch(
        x, topk_idx=mine.topk_idx, topk_weights=mine.topk_weights, num_experts=sc.num_experts,
        num_max_tokens_per_rank=num_max_tokens_per_rank, expert_alignment=1, num_sms=num_comm_sms,
        async_with_compute_stream=True)
    event.current_stream_wait()
    check_recv(res, sc, ref, casts, recv_x, recv_topk_idx, recv_topk_weights, handle.num_recv_tokens_per_expert_list)
    _check_psums(res, sc, ref[sc.rank], handle)
    y = expert_stand_in(_dequant(recv_x), recv_topk_idx, recv_topk_weights, sc.rank)
    combined_x, _, event = buffer.combine(y, handle=handle, num_sms=num_comm_sms, async_with_compute_stream=True)
    event.current_stream_wait()
    res.expect("combine_forward", combined_x, sc.combine_reference(stand_in_outputs(sc, ref), ref, inputs)[0])
    grads = [(_dequant((r.recv_x, r.recv_scales))) for r in ref]
    combined_grad_x, combined_grad_topk_weights, event = buffer.combine(
        grads[sc.rank].to(sc.device), handle=handle, topk_weights=recv_topk_weights, num_sms=num_comm_sms,
        async_with_compute_stream=True)
    event.current_stream_wait()
    want_x, want_w = sc.combine_reference(grads, ref, inputs, weights=[r.recv_topk_weights for r in ref])
    res.expect("dispatch_backward", combined_grad_x, want_x)
    res.expect("dispatch_backward weights", combined_grad_topk_weights, want_w)
    grad_combined = [(i.x.float() * 0.75).to(torch.bfloat16) for i in inputs]
    grad_x, _, _, _, event = buffer.dispatch(grad_combined[sc.rank].to(sc.device), handle=handle,
                                             num_sms=num_comm_sms, async_with_compute_stream=True)
    event.current_stream_wait()
    res.expect("combine_backward (cached)", grad_x,
               reference.dispatch(grad_combined, [i.topk_idx for i in inputs], sc.num_experts,
                                  local_size=sc.local_size)[sc.rank].recv_x)
    out.append(res)
    res = CaseResult("DeepEP V2 ElasticBuffer decode (vLLM's CUDA-graph mode, then a cached handle)")
    inputs = sc.inputs(101, "skewed")
    mine = sc.mine(inputs)
    ref, _ = sc.normal_reference(inputs)
    n = max(i.x.size(0) for i in inputs)
    num_max = 1 << max(n - 1, 0).bit_length()
    recv_x, recv_topk_idx, recv_topk_weights, handle, event = buffer.dispatch(
        x=mine.x, topk_idx=mine.topk_idx, topk_weights=mine.topk_weights, num_experts=sc.num_experts,
        num_max_tokens_per_rank=num_max, do_expand=False, do_cpu_sync=False, async_with_compute_stream=False)
    _wait(event)
    m = ref[sc.rank].recv_x.size(0)
    res.expect_eq("worst-case rows", recv_x.size(0), sc.num_ranks * num_max)
    check_recv(res, sc, ref, None, recv_x, recv_topk_idx, recv_topk_weights, None)
    res.expect_eq("padding ids -1", bool((recv_topk_idx[m:] == -1).all()), True)
    _check_psums(res, sc, ref[sc.rank], handle)
    y = expert_stand_in(recv_x, recv_topk_idx, recv_topk_weights, sc.rank)
    y[m:] = float("nan")  # padding rows are never read
    combined_x, _, event = buffer.combine(x=y, handle=handle, topk_weights=None, async_with_compute_stream=False)
    res.expect("decode combine", combined_x, sc.combine_reference(stand_in_outputs(sc, ref), ref, inputs)[0])
    step = [(i.x.float() * 1.5).to(torch.bfloat16) for i in inputs]
    recv_x2, _, _, handle2, event = buffer.dispatch(step[sc.rank].to(sc.device), handle=handle, num_sms=num_comm_sms,
                                                    async_with_compute_stream=True)
    event.current_stream_wait()
    res.expect("cached decode dispatch", recv_x2[:m],
               reference.dispatch(step, [i.topk_idx for i in inputs], sc.num_experts,
                                  local_size=sc.local_size)[sc.rank].recv_x)
    res.expect_eq("cached handle returned", handle2 is handle, True)
    out.append(res)
    buffer.destroy()
    return out


def _check_psums(res: CaseResult, sc: Scenario, mine, handle) -> None:
    per_rank = [int((mine.recv_src_rank == s).sum()) for s in range(sc.num_ranks)]
    want = torch.tensor(per_rank, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    res.expect("psum_num_recv_tokens_per_scaleup_rank", handle.psum_num_recv_tokens_per_scaleup_rank, want)
    counts = [int((mine.recv_topk_idx == e).sum()) for e in range(sc.e_local)]
    res.expect("psum_num_recv_tokens_per_expert", handle.psum_num_recv_tokens_per_expert,
               torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32))


def graph_decode(sc: Scenario, deep_ep, replays: int = 3) -> list:
    """A decode step captured once in a CUDA graph and replayed with new data, as vLLM and SGLang capture their
    decode steps: the low-latency pair (dispatch with ``cumulative_local_expert_recv_stats`` and a hook, an
    elementwise expert stand-in, combine with a hook) and V2's decode pair (``do_cpu_sync=False`` dispatch,
    combine). Every replay is checked against the reference, and the counters hold the replays' sum. On the CPU
    (no graphs) the step runs eagerly for every replay, which checks this replay itself."""
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS, HIDDEN, sc.num_ranks, sc.num_experts)
    buffer = deep_ep.Buffer(sc.ctx.group, 0, num_rdma_bytes, low_latency_mode=True, num_qps_per_rank=sc.e_local)
    elastic_buffer = deep_ep.ElasticBuffer(sc.ctx.group, num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN,
                                           num_topk=TOPK)
    batches = [sc.inputs(110 + i, "uniform") for i in range(replays + 1)]
    static = sc.mine(batches[0])
    x_s, idx_s, w_s = static.x.clone(), static.topk_idx.clone(), static.topk_weights.clone()
    stats = torch.zeros(sc.e_local, dtype=torch.int32, device=sc.device)

    def step():
        recv, count, handle, _, hook = buffer.low_latency_dispatch(
            x_s, idx_s, MAX_TOKENS, sc.num_experts, cumulative_local_expert_recv_stats=stats, use_fp8=True,
            async_finish=False, return_recv_hook=True)
        hook()
        y = (per_token_cast_back(recv[0].view(-1, HIDDEN), recv[1].reshape(-1, HIDDEN // 128), torch.bfloat16)
             .view(recv[0].shape).float() * 0.5).to(torch.bfloat16)
        combined, _, hook = buffer.low_latency_combine(y, idx_s, w_s, handle, async_finish=False,
                                                       return_recv_hook=True)
        hook()
        recv_x, recv_idx, recv_w, eh, _ = elastic_buffer.dispatch(x_s, topk_idx=idx_s, topk_weights=w_s,
                                                                  num_experts=sc.num_experts, do_cpu_sync=False)
        back, _, _ = elastic_buffer.combine(expert_stand_in(recv_x, recv_idx, recv_w, sc.rank), handle=eh)
        return recv, count, combined, recv_x, back

    on_gpu = sc.device.type == "cuda"
    if on_gpu:
        from ..bench.timing import capture_graph

        graph, outs = capture_graph(step)
    stats.zero_()
    res = CaseResult(f"decode step in a CUDA graph ({'replayed' if on_gpu else 'eager'} {replays} times)")
    counts = torch.zeros(sc.e_local, dtype=torch.int32)
    for i in range(1, replays + 1):
        inputs = batches[i]
        mine = inputs[sc.rank]
        x_s.copy_(mine.x)
        idx_s.copy_(mine.topk_idx)
        w_s.copy_(mine.topk_weights)
        if on_gpu:
            graph.replay()
            torch.cuda.synchronize()
        else:
            outs = step()
        recv, count, combined, recv_x, back = outs
        ll = _ll_reference(sc, inputs, True)
        res.expect(f"replay {i} recv_count", count, torch.tensor(ll[sc.rank].count, dtype=torch.int32))
        for e in range(sc.e_local):
            res.expect(f"replay {i} recv_x[{e}]", recv[0][e, :ll[sc.rank].count[e]], ll[sc.rank].x[e])
        ys = [[(per_token_cast_back(d.x[e], d.scales[e], torch.bfloat16).float() * 0.5).to(torch.bfloat16)
               if d.x[e].numel() else d.x[e].to(torch.bfloat16) for e in range(sc.e_local)] for d in ll]
        res.expect(f"replay {i} combined", combined, reference.low_latency_combine(
            ys, ll, [b.topk_idx for b in inputs], [b.topk_weights for b in inputs], sc.num_experts)[sc.rank])
        counts += torch.tensor(ll[sc.rank].count, dtype=torch.int32)
        ref, _ = sc.normal_reference(inputs)
        res.expect(f"replay {i} V2 recv_x", recv_x[:ref[sc.rank].recv_x.size(0)], ref[sc.rank].recv_x)
        res.expect(f"replay {i} V2 combined", back,
                   sc.combine_reference(stand_in_outputs(sc, ref), ref, inputs)[0])
    res.expect("cumulative_local_expert_recv_stats over the replays", stats, counts)
    elastic_buffer.destroy()
    buffer.destroy()
    return [res]


REPLAYS: dict[str, Callable] = {"vllm_ht": vllm_high_throughput, "vllm_ll": vllm_low_latency, "sglang": sglang,
                                "megatron": megatron, "xorl": xorl, "deepep": deepep_readme, "elastic": elastic,
                                "graph": graph_decode}


def run_replays(ctx, transport="auto", names: Optional[list] = None) -> list:
    """Worker entry: install the drop-in, ``import deep_ep`` and run the named replays (default all) on
    ``transport`` (a name or a Transport class; default epcomm's choice). Returns ``[(label, failures)]`` of the
    failing checks; a replay that raises ends the worker (its collectives are out of step), naming the replay."""
    from ..deep_ep import Buffer, install

    Buffer.transport = transport
    if not install():
        raise RuntimeError("run_replays: a DeepEP installation is importable; the replays need the drop-in")
    import deep_ep
    import deep_ep.utils  # noqa: F401 - Megatron and xorl import it

    sc = Scenario(ctx)
    failed = []
    for name in names or list(REPLAYS):
        try:
            results = REPLAYS[name](sc, deep_ep)
        except Exception as exc:
            raise RuntimeError(f"replay {name!r} raised on rank {ctx.rank}") from exc
        failed += [(r.label, r.failures) for r in results if not r.ok]
    return failed
