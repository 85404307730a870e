"""``deep_ep.Buffer`` with DeepEP V1's exact signatures, over epcomm's ``Buffer``.

Every call is a thin adapter: it converts DeepEP's events and tuple handles and forwards to
``epcomm.Buffer``, which holds the semantics (and their checks) in one place. What epcomm does not implement
raises NotImplementedError naming the feature: an mpi4py communicator,
fabric memory, masking failed ranks (``enable_shrink``), the raw buffer tensor, the wait-time statistics
and LogFMT. The signatures are DeepEP's at its last V1 release (``deep_ep/buffer.py`` before V2, which keeps
this class as its legacy ``Buffer`` minus ``use_fabric``)."""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..buffer.buffer import Buffer as _EpcommBuffer
from ..core.config import Config as _EpcommConfig
from ..core.device import default_device
from ..core.handles import DispatchHandle, LowLatencyHandle
from ..core.layout import get_low_latency_rdma_size_hint as _ll_size_hint
from .config import Config
from .handles import DispatchHandleTuple, LowLatencyHandleTuple, unwrap
from .utils import EventHandle, EventOverlap, from_epcomm_event, to_epcomm_event

# DeepEP's tuned (num_max_nvl_chunked_send_tokens, recv, rdma send, rdma recv) per group size
_DISPATCH_CONFIGS = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
                     24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
                     96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128),
                     160: (28, 720, 12, 128)}
_COMBINE_CONFIGS = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
                    24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
                    96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}

Tensors = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


def communication_device(group) -> torch.device:
    """DeepEP communicates CUDA tensors on the current device whatever the group's backend (frameworks pass
    a gloo group for its bootstrap, e.g. vLLM's CPU group). So: the group's own device when that is a GPU
    (NCCL), else the current CUDA device when this process uses CUDA, else the CPU."""
    device = default_device(group)
    if device.type == "cpu" and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_config(fn: str, config) -> None:
    if not isinstance(config, _EpcommConfig):
        raise TypeError(f"{fn}: config must be a deep_ep.Config (from Buffer.get_dispatch_config / "
                        f"get_combine_config or Config(...)); got {type(config).__name__}")


class Buffer:
    """DeepEP's communication buffer for MoE dispatch and combine (``deep_ep.Buffer``), running on epcomm.

    Normal (high-throughput) dispatch/combine and low-latency dispatch/combine share one Buffer, as in DeepEP.
    The transport is epcomm's choice for the hardware (``nvlink``, ``p2p`` or the portable ``alltoall``, which
    also runs on CPU processes over gloo); ``epcomm.deep_ep.Buffer.transport = "p2p"`` (a class attribute) or
    ``EPCOMM_TRANSPORT`` forces one. The group may be a gloo group:
    like DeepEP, the Buffer communicates on the current CUDA device when the process uses CUDA.

    Attributes (DeepEP's):
        num_sms: class attribute, SMs of the normal kernels (default 20, ``set_num_sms``); the default configs
            carry it to the one-sided transports.
        rank, group_size, group: this rank, the group size and the group.
        num_nvl_bytes: receive area of the one-sided transports' normal mode (0: epcomm's default).
        num_rdma_bytes: storage of the one-sided low-latency mode (0: sized at the first call).
        low_latency_mode, explicitly_destroy, enable_shrink: as given.
        runtime: the ``epcomm.Buffer`` doing the work (its ``transport`` names the transport).
    """

    num_sms: int = 20
    # epcomm's: the transport of every drop-in buffer made from now on (ElasticBuffer's too): "auto" (epcomm's
    # choice for the hardware), "nvlink", "p2p", "alltoall" or a Transport class; EPCOMM_TRANSPORT overrides it
    transport: Union[str, type] = "auto"

    def __init__(self,
                 group: Optional[dist.ProcessGroup],
                 num_nvl_bytes: int = 0,
                 num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False,
                 use_fabric: bool = False,
                 explicitly_destroy: bool = False,
                 enable_shrink: bool = False,
                 comm: Optional["mpi4py.MPI.Comm"] = None) -> None:  # noqa: F821
        """Create the buffer (collective: every rank of ``group`` calls it with the same arguments).

        Arguments:
            group: the process group of the expert-parallel ranks; across nodes epcomm's Buffer takes its
                hierarchical path (nodes as the topology probe or ``EPCOMM_RANKS_PER_NODE`` finds them).
            num_nvl_bytes, num_rdma_bytes: bytes for normal and low-latency mode (``Config.get_nvl_buffer_size_hint``,
                ``Buffer.get_low_latency_rdma_size_hint``); forwarded to epcomm's Buffer.
            low_latency_mode, num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl,
            explicitly_destroy: forwarded to epcomm's Buffer, which decides what they do (the RDMA queue pairs and
                multi-node NVLink have no meaning within one node).
            use_fabric, enable_shrink, comm: fabric memory, rank masking and mpi4py communicators are not
                implemented: True / a communicator raises NotImplementedError.
        """
        fn = "Buffer"
        if group is None:
            if comm is not None:
                raise NotImplementedError(f"{fn}: an mpi4py communicator (comm=) is not supported; pass the "
                                          f"torch.distributed process group of the expert-parallel ranks as group")
            raise ValueError(f"{fn}: either 'group' or 'comm' must be provided; pass the torch.distributed process "
                             f"group of the expert-parallel ranks")
        if use_fabric:
            raise NotImplementedError(f"{fn}: use_fabric=True (fabric-API memory for multi-node NVLink) is not "
                                      f"implemented; pass use_fabric=False")
        if enable_shrink:
            raise NotImplementedError(f"{fn}: enable_shrink=True (masking failed ranks in low-latency mode) is not "
                                      f"implemented; pass enable_shrink=False")
        self.rank = dist.get_rank(group)
        self.group = group
        self.group_size = dist.get_world_size(group)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self.runtime = _EpcommBuffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank,
                                     allow_nvlink_for_low_latency_mode, allow_mnnvl, explicitly_destroy,
                                     transport=Buffer.transport, device=communication_device(group))

    def destroy(self):
        """Release the buffer's resources (collective; epcomm's ``Buffer.destroy``)."""
        self.runtime.destroy()

    # ------------------------------------------------------------------ static helpers
    @staticmethod
    def is_sm90_compiled():
        """True: what DeepEP builds only for SM90 (FP8 casts with UE8M0 scales, the low-latency kernels) epcomm
        runs on every device it supports."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set ``Buffer.num_sms``, the SMs of the normal kernels in the default configs (even, >= 2)."""
        if not isinstance(new_num_sms, int) or new_num_sms < 2 or new_num_sms % 2:
            raise ValueError(f"Buffer.set_num_sms: {new_num_sms!r} must be an even integer >= 2 (the kernels pair "
                             f"SMs)")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream (``torch.cuda.current_stream()``), to pass as ``previous_event``."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of storage low-latency mode needs, to pass as ``num_rdma_bytes``: epcomm's own requirement
        (``epcomm.core.layout.get_low_latency_rdma_size_hint``: per rank and buffer parity, ``T`` rows from each
        rank and the combine rows of its own tokens), smaller than DeepEP's ``E * T`` rows per direction."""
        return _ll_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    def get_comm_stream(self) -> torch.Stream:
        """The communication stream (a ``torch.cuda.Stream``; None for a Buffer on the CPU, which has no streams:
        ``torch.cuda.stream(None)`` is then a no-op)."""
        return self.runtime.get_comm_stream()

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """Not implemented: epcomm's transports lay their storage out their own way (and the portable one has
        none), so a raw view of it is no buffer to write into; ``clean_low_latency_buffer`` resets low-latency
        state."""
        raise NotImplementedError("Buffer.get_local_buffer_tensor: a raw view of the communication buffer is not "
                                  "implemented (epcomm's storage layout is its transports' own; writing into it "
                                  "would corrupt their protocol state); use clean_low_latency_buffer to reset "
                                  "low-latency state")

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's recommended dispatch config for ``num_ranks`` (with ``Buffer.num_sms``); group sizes DeepEP
        has no entry for take the entry of the next larger size it has (3 -> 4, 5-7 -> 8)."""
        return Config(Buffer.num_sms, *_config_entry("Buffer.get_dispatch_config", _DISPATCH_CONFIGS, num_ranks))

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP's recommended combine config for ``num_ranks`` (with ``Buffer.num_sms``); sizes without an
        entry as in ``get_dispatch_config``."""
        return Config(Buffer.num_sms, *_config_entry("Buffer.get_combine_config", _COMBINE_CONFIGS, num_ranks))

    # ------------------------------------------------------------------ normal mode
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False) -> \
            Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, EventOverlap]:
        """Where each token goes.

        Arguments:
            topk_idx: ``[num_tokens, num_topk]`` ``topk_idx_t`` (int64), expert ids, -1 for none.
            num_experts: the number of experts (a multiple of the group size).
            previous_event, async_finish, allocate_on_comm_stream: stream control (see ``dispatch``).

        Returns:
            num_tokens_per_rank: ``[num_ranks]`` int32; num_tokens_per_rdma_rank: None (intranode);
            num_tokens_per_expert: ``[num_experts]`` int32; is_token_in_rank: ``[num_tokens, num_ranks]`` bool;
            event: EventOverlap (holding an event only with ``async_finish``).
        """
        fn = "Buffer.get_dispatch_layout"
        per_rank, per_rdma, per_expert, in_rank, event = self.runtime.get_dispatch_layout(
            topk_idx, num_experts, to_epcomm_event(fn, previous_event), async_finish, allocate_on_comm_stream)
        return per_rank, per_rdma, per_expert, in_rank, from_epcomm_event(event, async_finish)

    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 handle: Optional[Tuple] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None, num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False) -> \
            Tuple[Union[Tuple[torch.Tensor, torch.Tensor], torch.Tensor], Optional[torch.Tensor],
                  Optional[torch.Tensor], List[int], Tuple, EventOverlap]:
        """Send every token to each rank holding one of its experts (once per rank); with ``handle``, resend new
        data with an earlier dispatch's layout (cached mode, also combine's backward).

        Arguments:
            x: ``[num_tokens, hidden]`` bf16, or ``(x_e4m3 [num_tokens, hidden] float8_e4m3fn, scales
                [num_tokens, hidden / 128] float32)``.
            handle: a handle from an earlier ``dispatch`` of this Buffer (cached mode: the layout arguments and
                ``topk_idx``/``topk_weights`` are then not used / must be None).
            num_tokens_per_rank ``[num_ranks]`` int32, num_tokens_per_rdma_rank (None), is_token_in_rank
                ``[num_tokens, num_ranks]`` bool, num_tokens_per_expert ``[num_experts]`` int32: from
                ``get_dispatch_layout``.
            topk_idx: ``[num_tokens, num_topk]`` int64; topk_weights: ``[num_tokens, num_topk]`` float32.
            expert_alignment: round each local expert's received count up to a multiple of this.
            num_worst_tokens: if > 0, every output has this many rows and the call makes no host synchronisation
                (CUDA-graph capturable); rows past the received ones have ``recv_topk_idx`` -1.
            config: tuning (default ``get_dispatch_config(group size)``).
            previous_event: the dispatch waits for it; async_finish: return an event instead of making the
                current stream wait; allocate_on_comm_stream: outputs stay owned by the communication stream.

        Returns:
            recv_x: like ``x`` (a pair for FP8), ``[num_recv_tokens, hidden]``, ordered by source rank, then token.
            recv_topk_idx: ``[num_recv_tokens, num_topk]`` int64 local expert ids (-1: another rank's expert).
            recv_topk_weights: ``[num_recv_tokens, num_topk]`` float32 (0 where ``recv_topk_idx`` is -1).
            num_recv_tokens_per_expert_list: list of ``E_local`` ints, aligned (empty with ``num_worst_tokens``).
            handle: a ``DispatchHandleTuple`` (None in cached mode).
            event: EventOverlap (holding an event only with ``async_finish``).
            In cached mode the three middle results are None, as in DeepEP.
        """
        fn = "Buffer.dispatch"
        config = self.get_dispatch_config(self.group_size) if config is None else config
        check_config(fn, config)
        recv_x, recv_idx, recv_w, counts, out_handle, event = self.runtime.dispatch(
            x, unwrap(fn, handle, DispatchHandle, required=False), num_tokens_per_rank, num_tokens_per_rdma_rank,
            is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
            config, to_epcomm_event(fn, previous_event), async_finish, allocate_on_comm_stream)
        out_handle = None if out_handle is None else DispatchHandleTuple(out_handle, self.rank)
        return recv_x, recv_idx, recv_w, counts, out_handle, from_epcomm_event(event, async_finish)

    def combine(self, x: torch.Tensor, handle: Tuple,
                topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None,
                config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> \
            Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """Send every received row back to its source rank and add them per token (no weights applied).

        Arguments:
            x: ``[num_recv_tokens, hidden]`` bf16, one row per row the dispatch returned.
            handle: that dispatch's handle.
            topk_weights: optional ``[num_recv_tokens, num_topk]`` float32, added up the same way.
            bias: None, a ``[num_tokens, hidden]`` bf16 tensor or a pair of them, added after the sum.
            config, previous_event, async_finish, allocate_on_comm_stream: as in ``dispatch``.

        Returns:
            combined_x: ``[num_tokens, hidden]`` like ``x``: the FP32 sum in rank order plus the biases, cast once.
            combined_topk_weights: ``[num_tokens, num_topk]`` float32 or None.
            event: EventOverlap.
        """
        fn = "Buffer.combine"
        config = self.get_combine_config(self.group_size) if config is None else config
        check_config(fn, config)
        combined, combined_w, event = self.runtime.combine(
            x, unwrap(fn, handle, DispatchHandle), topk_weights, bias, config, to_epcomm_event(fn, previous_event),
            async_finish, allocate_on_comm_stream)
        return combined, combined_w, from_epcomm_event(event, async_finish)

    def internode_dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                           handle: Optional[Tuple] = None,
                           num_tokens_per_rank: Optional[torch.Tensor] = None,
                           num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                           is_token_in_rank: Optional[torch.Tensor] = None,
                           num_tokens_per_expert: Optional[torch.Tensor] = None,
                           topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                           expert_alignment: int = 1,
                           num_worst_tokens: int = 0, config: Optional[Config] = None,
                           previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                           allocate_on_comm_stream: bool = False):
        """DeepEP's internode dispatch (its ``dispatch`` calls it for groups of more than 8 ranks): epcomm's
        ``dispatch`` serves both (the epcomm Buffer takes its hierarchical path across nodes)."""
        return self.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                             num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens, config,
                             previous_event, async_finish, allocate_on_comm_stream)

    def internode_combine(self, x: torch.Tensor, handle: Union[tuple, list],
                          topk_weights: Optional[torch.Tensor] = None,
                          bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None,
                          config: Optional[Config] = None,
                          previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                          allocate_on_comm_stream: bool = False):
        """DeepEP's internode combine: ``combine`` (see ``internode_dispatch``)."""
        return self.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                            allocate_on_comm_stream)

    # ------------------------------------------------------------------ low-latency mode
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Reset the low-latency state (DeepEP requires it after normal-mode calls, before low-latency ones);
        epcomm's ``Buffer.clean_low_latency_buffer``."""
        self.runtime.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False) -> \
            Tuple[Tuple[torch.Tensor, torch.Tensor], torch.Tensor, Tuple, EventOverlap, Callable]:
        """Send one copy of each token to each selected expert (decode batches; fixed shapes, no host sync).

        Arguments:
            x: ``[num_tokens, hidden]`` bf16, ``num_tokens <= num_max_dispatch_tokens_per_rank``, hidden a multiple
                of 128.
            topk_idx: ``[num_tokens, num_topk]`` int64, -1 for none.
            num_max_dispatch_tokens_per_rank: T, the same on every rank; num_experts: E.
            cumulative_local_expert_recv_stats: optional ``[E_local]`` int32; this call's received count per local
                expert is added to it (on the device, when the receive completes).
            dispatch_wait_recv_cost_stats: not implemented (must be None).
            use_fp8, round_scale, use_ue8m0: FP8 cast on the way (per-128-channel scales; power-of-two; packed
                UE8M0, which needs ``round_scale``).
            async_finish: return an event; return_recv_hook: return a hook that completes the receive (not both).

        Returns:
            recv_x: ``[E_local, R * T, hidden]`` e4m3 with scales ``[E_local, R * T, hidden / 128]`` float32
                (column-major; ``hidden / 512`` int32 for UE8M0), or bf16 without FP8.
            recv_count: ``[E_local]`` int32, valid rows per local expert.
            handle: a ``LowLatencyHandleTuple``; event: EventOverlap; hook: callable or None.
        """
        fn = "Buffer.low_latency_dispatch"
        if dispatch_wait_recv_cost_stats is not None:
            raise NotImplementedError(f"{fn}: dispatch_wait_recv_cost_stats (per-rank receive wait times) is not "
                                      f"implemented; pass None")
        check_hook_and_async(fn, async_finish, return_recv_hook)
        recv_x, recv_count, handle, event, hook = self.runtime.low_latency_dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=use_fp8, round_scale=round_scale,
            use_ue8m0=use_ue8m0, async_finish=async_finish, return_recv_hook=return_recv_hook,
            cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats)
        return recv_x, recv_count, LowLatencyHandleTuple(handle), from_epcomm_event(event, async_finish), hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: tuple, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None) -> \
            Tuple[torch.Tensor, EventOverlap, Callable]:
        """Return the expert outputs to their tokens and reduce them with the top-k weights.

        Arguments:
            x: ``[E_local, R * T, hidden]`` bf16 expert outputs in the dispatch's layout (not read with
                ``zero_copy``, which reads ``get_next_low_latency_combine_buffer(handle)`` in place).
            topk_idx ``[num_tokens, num_topk]`` int64, topk_weights ``[num_tokens, num_topk]`` float32: the
                dispatch's.
            handle: the dispatch's handle.
            use_logfmt: LogFMT is not implemented (True raises). zero_copy, async_finish, return_recv_hook
                (not with async_finish): as in DeepEP. out: optional ``[num_tokens, hidden]`` bf16 output.
            combine_wait_recv_cost_stats: not implemented (must be None).

        Returns:
            combined_x: ``[num_tokens, hidden]`` bf16 (``out`` when given); event: EventOverlap; hook or None.
        """
        fn = "Buffer.low_latency_combine"
        if combine_wait_recv_cost_stats is not None:
            raise NotImplementedError(f"{fn}: combine_wait_recv_cost_stats (per-rank receive wait times) is not "
                                      f"implemented; pass None")
        check_hook_and_async(fn, async_finish, return_recv_hook)
        combined, event, hook = self.runtime.low_latency_combine(
            x, topk_idx, topk_weights, unwrap(fn, handle, LowLatencyHandle), use_logfmt=use_logfmt,
            zero_copy=zero_copy, async_finish=async_finish, return_recv_hook=return_recv_hook, out=out)
        return combined, from_epcomm_event(event, async_finish), hook

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False):
        """Masking failed ranks is not implemented (``enable_shrink``)."""
        _no_masks("Buffer.low_latency_update_mask_buffer")

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor):
        """Masking failed ranks is not implemented (``enable_shrink``)."""
        _no_masks("Buffer.low_latency_query_mask_buffer")

    def low_latency_clean_mask_buffer(self):
        """Masking failed ranks is not implemented (``enable_shrink``)."""
        _no_masks("Buffer.low_latency_clean_mask_buffer")

    def get_next_low_latency_combine_buffer(self, handle: object):
        """The ``[E_local, R * T, hidden]`` bf16 tensor a ``zero_copy`` combine with ``handle`` reads: write the
        expert outputs into it."""
        fn = "Buffer.get_next_low_latency_combine_buffer"
        return self.runtime.get_next_low_latency_combine_buffer(unwrap(fn, handle, LowLatencyHandle))


def _config_entry(fn: str, table: dict, num_ranks: int) -> tuple:
    sizes = [n for n in sorted(table) if n >= num_ranks]
    if not isinstance(num_ranks, int) or num_ranks < 1 or not sizes:
        raise ValueError(f"{fn}: unsupported number of EP ranks {num_ranks!r}; DeepEP has configs for "
                         f"{sorted(table)}")
    return table[sizes[0]]


def check_hook_and_async(fn: str, async_finish: bool, return_recv_hook: bool) -> None:
    if async_finish and return_recv_hook:
        raise ValueError(f"{fn}: async_finish=True and return_recv_hook=True cannot be combined (the hook completes "
                         f"the receive on the current stream); pass one of them")


def _no_masks(fn: str) -> None:
    raise NotImplementedError(f"{fn}: masking failed ranks (DeepEP's enable_shrink) is not implemented")


__all__ = ["Buffer"]
