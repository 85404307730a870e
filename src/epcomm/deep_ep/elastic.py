"""DeepEP V2's ``ElasticBuffer`` and ``EPHandle``, mapped onto epcomm's ``Buffer`` where they map.

V2 unifies high-throughput and low-latency expert parallelism in one ``dispatch``/``combine`` pair:
``do_cpu_sync=True`` (the default) is the exact-size normal dispatch; ``do_cpu_sync=False`` (V2's
decode / CUDA-graph mode) gives every output ``num_ranks * num_max_tokens_per_rank`` rows with no host
synchronisation, which is epcomm's ``num_worst_tokens``; a cached ``handle`` resends new data with an
earlier layout (decode steps, combine's backward). Received rows are ordered by source rank, then token:
V2's ``deterministic=True`` order (without it V2's order is unspecified, so this order is one it may give).
The combine adds in FP32 in rank order and casts once (V2's single-reduction precision).

Mapped: ``ElasticBuffer(...)`` (``num_bytes`` or the MoE settings size the one-sided transports' receive
area), ``dispatch`` (``x`` BF16 or an FP8 pair, ``topk_idx``, ``topk_weights``,
``cumulative_local_expert_recv_stats``, ``num_experts``, ``num_max_tokens_per_rank``, ``expert_alignment``,
``num_sms``, ``previous_event``, ``async_with_compute_stream``, ``allocate_on_comm_stream``, ``handle``,
``do_handle_copy``, ``do_cpu_sync``), ``combine``, ``capture``, ``get_comm_stream``, ``barrier``,
``get_buffer_size_hint``, ``get_theoretical_num_sms`` / ``get_theoretical_num_qps``, the domain sizes,
``destroy``. Not implemented (NotImplementedError naming it): the expanded expert-major layout
(``do_expand``, with ``do_zero_padding`` and TMA-aligned scales), Engram, pipeline-parallel send/recv,
all-gather/reduce-scatter sessions and CPU buffer memory. Across nodes the epcomm Buffer takes its hierarchical
path; the scale-out/scale-up sizes then describe its domains."""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ..buffer.buffer import Buffer as _EpcommBuffer
from ..core.config import model_num_sms
from ..core.handles import DispatchHandle
from ..core.layout import align_up, get_normal_buffer_size_hint
from ..fp8 import GROUP
from .buffer import Buffer, communication_device
from .utils import EventHandle, EventOverlap, from_epcomm_event, to_epcomm_event

_BUFFER_ALIGNMENT = 2 << 20  # V2 sizes its buffers in 2 MiB steps


@dataclass(frozen=True, eq=False)
class EPHandle:
    """V2's dispatch handle: reuse it in a cached ``dispatch`` and pass it to ``combine``.

    Attributes:
        do_expand: False (the expanded layout is not implemented).
        num_experts, expert_alignment, num_max_tokens_per_rank, num_sms: as the dispatch used them.
        topk_idx: ``[num_tokens, num_topk]`` int64, the dispatch's (a copy with ``do_handle_copy``).
        num_recv_tokens: rows of the outputs (with ``do_cpu_sync=False`` the worst case
            ``num_ranks * num_max_tokens_per_rank``; the real count is ``psum_num_recv_tokens_per_scaleup_rank[-1]``).
        num_recv_tokens_per_expert_list: received (token, local expert) pairs per local expert, aligned (empty
            without a host synchronisation).
        psum_num_recv_tokens_per_scaleup_rank: ``[num_ranks]`` int32 on the device, inclusive prefix sum of the
            rows received from each source rank (a token counts once per rank).
        psum_num_recv_tokens_per_expert: ``[num_local_experts]`` int32 on the device, inclusive prefix sum of the
            aligned per-expert counts.
        handle: the epcomm ``DispatchHandle`` (``recv_src_rank``, ``recv_src_idx`` [M] int32 per row, ...).
    V2's kernel-layout fields (``recv_src_metadata``, ``dst_buffer_slot_idx``, ``token_metadata_at_forward``,
    ``channel_linked_list``, ``num_unaligned_recv_tokens_per_expert``, ``num_expanded_tokens``) have no
    counterpart: reading one raises NotImplementedError."""

    handle: DispatchHandle
    num_experts: int
    expert_alignment: int
    num_max_tokens_per_rank: int
    num_sms: int
    topk_idx: torch.Tensor
    num_recv_tokens: int
    num_recv_tokens_per_expert_list: list
    psum_num_recv_tokens_per_scaleup_rank: torch.Tensor
    psum_num_recv_tokens_per_expert: torch.Tensor
    do_expand: bool = False

    def __getattr__(self, name: str):
        if name in _V2_ONLY:
            raise NotImplementedError(f"EPHandle.{name}: V2's {name} describes its own kernels' layout, which "
                                      f"epcomm does not have; the rows' sources are in handle.handle.recv_src_rank "
                                      f"and handle.handle.recv_src_idx ([num_recv_tokens] int32)")
        raise AttributeError(f"EPHandle has no attribute {name!r}")


_V2_ONLY = ("recv_src_metadata", "dst_buffer_slot_idx", "token_metadata_at_forward", "channel_linked_list",
            "num_unaligned_recv_tokens_per_expert", "num_expanded_tokens")


def _psums(h: DispatchHandle, alignment: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The handle's two prefix sums, on the device without a host synchronisation (graph-capturable)."""
    src = h.recv_src_rank.long()
    r = h.num_ranks
    per_rank = torch.zeros(r + 1, dtype=torch.int32, device=src.device)
    per_rank.index_add_(0, torch.where(src >= 0, src, r), torch.ones_like(src, dtype=torch.int32))
    per_expert = h.num_recv_tokens_per_expert
    aligned = (per_expert + (alignment - 1)) // alignment * alignment
    return torch.cumsum(per_rank[:r], 0, dtype=torch.int32), torch.cumsum(aligned, 0, dtype=torch.int32)


class ElasticBuffer:
    """V2's unified EP buffer on epcomm (intranode normal and low-latency calls; see the module docstring).

    Attributes: group, rank_idx, num_ranks, num_bytes, num_max_tokens_per_rank, deterministic,
    allow_hybrid_mode, allow_multiple_reduction, prefer_overlap_with_compute, explicitly_destroy, the logical and
    physical domain sizes (one scale-up domain of ``num_ranks`` ranks), and ``runtime``, the ``epcomm.Buffer``."""

    def __init__(self,
                 group: dist.ProcessGroup,
                 num_bytes: Optional[int] = None,
                 num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0,
                 hidden: int = 0,
                 num_topk: int = 0,
                 use_fp8_dispatch: bool = False,
                 deterministic: bool = False,
                 allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True,
                 prefer_overlap_with_compute: bool = True,
                 sl_idx: int = 3,
                 num_allocated_qps: int = 0,
                 num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100,
                 explicitly_destroy: bool = False):
        """Create the buffer (collective).

        Arguments:
            group: the expert-parallel ranks (at most 8).
            num_bytes: receive-area bytes of the one-sided transports; None: sized from ``num_max_tokens_per_rank``,
                ``hidden``, ``num_topk`` and ``use_fp8_dispatch`` (``get_buffer_size_hint``).
            num_cpu_bytes: CPU memory (Engram storage) is not implemented: > 0 raises.
            num_max_tokens_per_rank: the default of ``dispatch``'s argument.
            deterministic, allow_multiple_reduction: epcomm always orders rows deterministically and reduces once.
            allow_hybrid_mode, sl_idx, num_allocated_qps: RDMA settings, without meaning within one node.
            prefer_overlap_with_compute: not used (epcomm's traffic model picks the SMs per call).
            num_cpu_timeout_secs, num_gpu_timeout_secs: not used; epcomm's waits time out after
                ``EPCOMM_TIMEOUT_S``.
            explicitly_destroy: forwarded to epcomm's Buffer.
        """
        fn = "ElasticBuffer"
        if num_cpu_bytes:
            raise NotImplementedError(f"{fn}: num_cpu_bytes={num_cpu_bytes} (CPU buffer memory for Engram) is not "
                                      f"implemented; pass 0")
        self.group = group
        self.rank_idx = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.deterministic = deterministic
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.explicitly_destroy = explicitly_destroy
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self._hidden, self._num_topk = hidden, num_topk
        if num_bytes is None:
            num_bytes = self.get_buffer_size_hint(group, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch)
        self.num_bytes = num_bytes
        self.runtime = _EpcommBuffer(group, num_bytes, 0, explicitly_destroy=explicitly_destroy,
                                     transport=Buffer.transport, device=communication_device(group))
        domains, local = self.runtime.num_domains, self.runtime.local_size
        self.num_scaleout_ranks, self.num_scaleup_ranks = domains, local
        self.scaleout_rank_idx, self.scaleup_rank_idx = self.rank_idx // local, self.rank_idx % local
        self.num_rdma_ranks, self.num_nvlink_ranks = domains, local

    def destroy(self) -> None:
        """Release the buffer (collective; epcomm's ``Buffer.destroy``)."""
        self.runtime.destroy()

    @staticmethod
    def get_buffer_size_hint(group: dist.ProcessGroup,
                             num_max_tokens_per_rank: int, hidden: int,
                             num_topk: int = 0, use_fp8_dispatch: bool = False,
                             allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """Receive-area bytes for one dispatch of up to ``num_max_tokens_per_rank`` tokens per rank in one piece
        (``epcomm.core.layout.get_normal_buffer_size_hint``: every rank may send all its tokens to this one; a
        row carries BF16 or FP8 + scales, and 12 bytes per top-k slot), rounded up to 2 MiB."""
        row = hidden * (1 if use_fp8_dispatch else 2) + (4 * -(-hidden // GROUP) if use_fp8_dispatch else 0)
        num_bytes = get_normal_buffer_size_hint(num_max_tokens_per_rank, row + 12 * num_topk,
                                                dist.get_world_size(group))
        return align_up(max(num_bytes, 1), _BUFFER_ALIGNMENT)

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """Wait for every rank: finish this rank's queued work, then a host barrier over the group (stronger than
        V2's device barrier, whatever the arguments)."""
        if self.runtime.device.type == "cuda":
            torch.cuda.synchronize(self.runtime.device)
        dist.barrier(group=self.group)

    @staticmethod
    def capture() -> EventHandle:
        """An ``EventHandle`` on the current stream (V2 passes handles, not ``EventOverlap``)."""
        return EventHandle()

    def get_comm_stream(self) -> torch.Stream:
        """The communication stream (None on the CPU)."""
        return self.runtime.get_comm_stream()

    def get_physical_domain_size(self) -> Tuple[int, int]:
        """``(RDMA ranks, NVLink ranks)``: one node."""
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> Tuple[int, int]:
        """``(scale-out ranks, scale-up ranks)``: one scale-up domain."""
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int,
                                num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0,
                                sm_read_gbs: float = 200, sm_write_gbs: float = 50) -> int:
        """The SMs epcomm's traffic model (``epcomm.core.config.model_num_sms``) gives a BF16 dispatch of
        ``num_max_tokens_per_rank`` tokens of ``hidden`` (the constructor's), each sent to the ranks of its
        ``num_topk`` experts, over the transport's link (``nvlink_gbs`` when given). Pass it, or 0 (chosen per
        call), as ``num_sms``. The portable transport runs on NCCL's SMs and takes no SM count."""
        link = nvlink_gbs or getattr(self.runtime.runtime, "link_gbps", 0) or 400.0
        ranks_per_token = self.num_ranks * (1 - math.comb(num_experts - num_experts // self.num_ranks, num_topk)
                                            / math.comb(num_experts, num_topk))
        sent = self.num_max_tokens_per_rank * self._hidden * 2 * ranks_per_token * (self.num_ranks - 1) / self.num_ranks
        device_sms = (torch.cuda.get_device_properties(self.runtime.device).multi_processor_count
                      if self.runtime.device.type == "cuda" else 2)
        return model_num_sms(int(sent) if sent > 0 else 1 << 40, link, device_sms, self.num_ranks)

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """RDMA queue pairs: none within one node."""
        return 0

    def dispatch(self,
                 x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                 num_experts: Optional[int] = None,
                 num_max_tokens_per_rank: Optional[int] = None,
                 expert_alignment: Optional[int] = None,
                 num_sms: int = 0, num_qps: int = 0,
                 previous_event: Optional[EventHandle] = None,
                 previous_event_before_epilogue: Optional[EventHandle] = None,
                 async_with_compute_stream: bool = False,
                 allocate_on_comm_stream: bool = False,
                 handle: Optional[EPHandle] = None,
                 do_handle_copy: bool = True,
                 do_cpu_sync: Optional[bool] = None,
                 do_expand: bool = False,
                 do_zero_padding: bool = False,
                 use_tma_aligned_col_major_sf: bool = False) \
            -> Tuple[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                     Optional[torch.Tensor], Optional[torch.Tensor], EPHandle, EventOverlap]:
        """Send every token to each rank holding one of its experts; with ``handle``, resend new data with that
        dispatch's layout (then ``topk_idx``/``topk_weights`` must be None and the host is not synchronised).

        Arguments:
            x: ``[num_tokens, hidden]`` bf16 or ``(x_e4m3, scales [num_tokens, hidden / 128] float32)``,
                ``num_tokens <= num_max_tokens_per_rank``.
            topk_idx ``[num_tokens, num_topk]`` int64 (-1: none); topk_weights ``[num_tokens, num_topk]`` float32.
            cumulative_local_expert_recv_stats: optional ``[num_local_experts]`` int32; the received pairs per
                local expert are added to it on the device.
            num_experts: required without ``handle``. num_max_tokens_per_rank: default the constructor's.
            expert_alignment: round each local expert's count up to a multiple of this (default 1).
            num_sms: SMs of the one-sided kernels (0: epcomm's traffic model per call). num_qps: not used (RDMA).
            previous_event: an ``EventHandle``/``EventOverlap`` the call waits for; previous_event_before_epilogue:
                waited for before the whole call (only one of the two may be given).
            async_with_compute_stream: return an event instead of making the current stream wait.
            allocate_on_comm_stream: outputs stay owned by the communication stream.
            do_handle_copy: keep a copy of ``topk_idx`` in the handle.
            do_cpu_sync: True (default without ``handle``): exact sizes, one host synchronisation; False: outputs
                of ``num_ranks * num_max_tokens_per_rank`` rows (padding rows have ``recv_topk_idx`` -1),
                no host synchronisation, CUDA-graph capturable.
            do_expand, do_zero_padding, use_tma_aligned_col_major_sf: the expanded layout is not implemented.

        Returns:
            recv_x (like ``x``), recv_topk_idx ``[M, num_topk]`` int64 local expert ids (-1: none),
            recv_topk_weights ``[M, num_topk]`` float32 or None, handle (``EPHandle``; the given one in cached
            mode, where recv_topk_idx and recv_topk_weights are None), event (``EventOverlap``).
        """
        fn = "ElasticBuffer.dispatch"
        _no_expand(fn, do_expand, do_zero_padding, use_tma_aligned_col_major_sf)
        cached = handle is not None
        if cached:
            if not isinstance(handle, EPHandle):
                raise TypeError(f"{fn}: handle must be the EPHandle an earlier dispatch returned; got "
                                f"{type(handle).__name__}")
            if topk_idx is not None:
                raise ValueError(f"{fn}: with a handle topk_idx must be None (the handle holds the layout)")
            if topk_weights is not None:
                raise NotImplementedError(f"{fn}: topk_weights in a cached dispatch (V2 resends them with the "
                                          f"expanded layout) is not implemented; pass None")
            if do_cpu_sync:
                raise ValueError(f"{fn}: a cached dispatch makes no host synchronisation; pass do_cpu_sync=None")
            for name, given, kept in (("num_experts", num_experts, handle.num_experts),
                                      ("expert_alignment", expert_alignment, handle.expert_alignment),
                                      ("num_max_tokens_per_rank", num_max_tokens_per_rank,
                                       handle.num_max_tokens_per_rank)):
                if given is not None and given != kept:
                    raise ValueError(f"{fn}: {name}={given} differs from the handle's {kept}; leave it None")
            num_experts, expert_alignment = handle.num_experts, handle.expert_alignment
            num_max_tokens_per_rank, do_cpu_sync = handle.num_max_tokens_per_rank, False
        else:
            if num_experts is None or topk_idx is None:
                raise ValueError(f"{fn}: without a handle, topk_idx and num_experts are required")
            num_max_tokens_per_rank = num_max_tokens_per_rank or self.num_max_tokens_per_rank
            expert_alignment = 1 if expert_alignment is None else expert_alignment
            do_cpu_sync = True if do_cpu_sync is None else do_cpu_sync
        n = (x[0] if isinstance(x, tuple) else x).size(0)
        if not do_cpu_sync and not cached and (not num_max_tokens_per_rank or n > num_max_tokens_per_rank):
            raise ValueError(f"{fn}: do_cpu_sync=False sizes the outputs by num_max_tokens_per_rank, which must be >= "
                             f"the {n} tokens of x; got {num_max_tokens_per_rank}")
        config = replace(self.runtime.get_dispatch_config(self.num_ranks), num_sms=num_sms or None)
        event = self._previous_event(fn, previous_event, previous_event_before_epilogue)
        common = dict(config=config, previous_event=event, async_finish=async_with_compute_stream,
                      allocate_on_comm_stream=allocate_on_comm_stream,
                      cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats)
        if cached:
            recv_x, _, _, _, _, ev = self.runtime.dispatch(x, handle.handle, **common)
            return recv_x, None, None, handle, from_epcomm_event(ev, async_with_compute_stream)
        per_rank, _, per_expert, in_rank, _ = self.runtime.get_dispatch_layout(topk_idx, num_experts, event)
        worst = 0 if do_cpu_sync else self.num_ranks * num_max_tokens_per_rank
        recv_x, recv_idx, recv_w, counts, h, ev = self.runtime.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=topk_weights, expert_alignment=expert_alignment, num_worst_tokens=worst,
            **common)
        comm = self.runtime.get_comm_stream() if ev.event is not None else None
        if comm is None:
            psum_rank, psum_expert = _psums(h, expert_alignment)
        else:  # the dispatch ran on the communication stream: read its outputs there, after it
            compute = torch.cuda.current_stream()
            with torch.cuda.stream(comm):
                psum_rank, psum_expert = _psums(h, expert_alignment)
            for t in (psum_rank, psum_expert):
                t.record_stream(compute)
            ev.event.record(comm)  # the call's event now also covers the sums
            if not async_with_compute_stream:
                compute.wait_event(ev.event)
        out = EPHandle(h, num_experts, expert_alignment, num_max_tokens_per_rank, num_sms,
                       topk_idx.clone() if do_handle_copy else topk_idx, h.num_recv_tokens, counts, psum_rank,
                       psum_expert)
        return recv_x, recv_idx, recv_w, out, from_epcomm_event(ev, async_with_compute_stream)

    def combine(self,
                x: torch.Tensor,
                handle: EPHandle,
                topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None,
                num_sms: int = 0, num_qps: int = 0,
                previous_event: EventHandle = None,
                previous_event_before_epilogue: Optional[EventHandle] = None,
                async_with_compute_stream: bool = False,
                allocate_on_comm_stream: bool = False) \
            -> Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """Send every received row back to its source rank and add them per token (the reverse of ``dispatch``).

        Arguments:
            x: ``[handle.num_recv_tokens, hidden]`` bf16 (padding rows are not read).
            handle: the dispatch's ``EPHandle``.
            topk_weights: optional ``[handle.num_recv_tokens, num_topk]`` float32, added up the same way.
            bias: None, a ``[num_tokens, hidden]`` tensor or a pair, added after the sum.
            num_sms: 0 reuses the dispatch's. Events and streams as in ``dispatch``.

        Returns:
            combined_x ``[num_tokens, hidden]``, combined_topk_weights ``[num_tokens, num_topk]`` float32 or None,
            event (``EventOverlap``).
        """
        fn = "ElasticBuffer.combine"
        if not isinstance(handle, EPHandle):
            raise TypeError(f"{fn}: handle must be the EPHandle dispatch returned; got {type(handle).__name__}")
        config = replace(self.runtime.get_combine_config(self.num_ranks), num_sms=(num_sms or handle.num_sms) or None)
        event = self._previous_event(fn, previous_event, previous_event_before_epilogue)
        combined, combined_w, ev = self.runtime.combine(x, handle.handle, topk_weights, bias, config, event,
                                                        async_with_compute_stream, allocate_on_comm_stream)
        return combined, combined_w, from_epcomm_event(ev, async_with_compute_stream)

    @staticmethod
    def _previous_event(fn: str, previous_event, before_epilogue):
        if previous_event is not None and before_epilogue is not None:
            raise NotImplementedError(f"{fn}: previous_event and previous_event_before_epilogue together are not "
                                      f"implemented; pass one (the call then waits for it before it starts)")
        return to_epcomm_event(fn, previous_event if previous_event is not None else before_epilogue)

    # ------------------------------------------------------------------ V2 features epcomm does not have
    @staticmethod
    def get_engram_storage_size_hint(num_entries: int, hidden: int, num_max_tokens_per_rank: int,
                                     dtype: torch.dtype = torch.bfloat16) -> Tuple[int, int]:
        _not_implemented("ElasticBuffer.get_engram_storage_size_hint", "Engram")

    @staticmethod
    def get_pp_buffer_size_hint(num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> int:
        _not_implemented("ElasticBuffer.get_pp_buffer_size_hint", "pipeline-parallel send/recv")

    @staticmethod
    def get_agrs_num_max_session_bytes(group, shapes, dtype: torch.dtype) -> int:
        _not_implemented("ElasticBuffer.get_agrs_num_max_session_bytes", "all-gather reduce-scatter sessions")

    @staticmethod
    def get_agrs_buffer_size_hint(group, num_max_session_bytes: int) -> int:
        _not_implemented("ElasticBuffer.get_agrs_buffer_size_hint", "all-gather reduce-scatter sessions")

    def engram_write(self, storage: torch.Tensor, sf: Optional[torch.Tensor] = None) -> None:
        _not_implemented("ElasticBuffer.engram_write", "Engram")

    def engram_fetch(self, indices: torch.Tensor, num_qps: int = 0, use_tma_aligned_col_major_sf: bool = False):
        _not_implemented("ElasticBuffer.engram_fetch", "Engram")

    def pp_set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int):
        _not_implemented("ElasticBuffer.pp_set_config", "pipeline-parallel send/recv")

    def pp_send(self, t: torch.Tensor, dst_rank_idx: int, num_sms: int = 0) -> None:
        _not_implemented("ElasticBuffer.pp_send", "pipeline-parallel send/recv")

    def pp_recv(self, t: torch.Tensor, src_rank_idx: int, num_sms: int = 0) -> None:
        _not_implemented("ElasticBuffer.pp_recv", "pipeline-parallel send/recv")

    def create_agrs_session(self) -> None:
        _not_implemented("ElasticBuffer.create_agrs_session", "all-gather reduce-scatter sessions")

    def destroy_agrs_session(self) -> None:
        _not_implemented("ElasticBuffer.destroy_agrs_session", "all-gather reduce-scatter sessions")

    @contextmanager
    def agrs_new_session(self, enabled: bool = True):
        _not_implemented("ElasticBuffer.agrs_new_session", "all-gather reduce-scatter sessions")
        yield

    def agrs_set_config(self, num_max_session_bytes: int, num_max_all_gathers_per_session: int) -> None:
        _not_implemented("ElasticBuffer.agrs_set_config", "all-gather reduce-scatter sessions")

    def agrs_get_inplace_tensor(self, shapes, dtype: torch.dtype):
        _not_implemented("ElasticBuffer.agrs_get_inplace_tensor", "all-gather reduce-scatter sessions")

    def all_gather(self, t: Union[torch.Tensor, Sequence[torch.Tensor]]):
        _not_implemented("ElasticBuffer.all_gather", "all-gather reduce-scatter sessions")


def _no_expand(fn: str, do_expand: bool, do_zero_padding: bool, tma_sf: bool) -> None:
    for name, value in (("do_expand", do_expand), ("do_zero_padding", do_zero_padding),
                        ("use_tma_aligned_col_major_sf", tma_sf)):
        if value:
            raise NotImplementedError(f"{fn}: {name}=True (V2's expanded expert-major layout) is not implemented; "
                                      f"pass {name}=False (rows are then ordered by source rank, with "
                                      f"recv_topk_idx naming their local experts)")


def _not_implemented(fn: str, feature: str):
    raise NotImplementedError(f"{fn}: DeepEP V2's {feature} is not implemented in epcomm")


__all__ = ["ElasticBuffer", "EPHandle"]
