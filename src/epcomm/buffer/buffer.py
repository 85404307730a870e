"""The public ``Buffer``: DeepEP's intranode API over epcomm's transports."""

from __future__ import annotations

import itertools
import logging
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..core.config import Config
from ..core.device import default_device
from ..core.handles import DispatchHandle, LowLatencyHandle
from ..core.layout import get_low_latency_rdma_size_hint as _ll_size_hint
from ..core.layout import LAYOUTS, get_normal_buffer_size_hint
from ..core.validate import check_expert_stats, check_num_experts, check_topk, split_x
from ..errors import EpcommDeviceError, EpcommError, EpcommTimeoutError
from ..fp8 import FP8_DTYPE, GROUP
from .. import env
from ..topology import probe
from ..topology.domains import Domains, find_domains, host_ids_from_report
from ..transports import create_transport
from ..transports.hierarchical import HierarchicalTransport
from ..transports.low_latency import call_shape
from ..transports.base import (CombineRequest, DispatchRequest, LowLatencyCombineRequest,
                               LowLatencyDispatchRequest)
from ..transports.device_errors import LOW_LATENCY, NORMAL
from .events import EventOverlap, StreamOrder, StreamScope, capture_event

log = logging.getLogger("epcomm")

_buffer_ids = itertools.count(1)
Tensors = Union[torch.Tensor, tuple]


class Buffer:
    """Expert-parallel communication buffer with the semantics of DeepEP V1's ``deep_ep.Buffer`` (intranode).

    Works with any ``torch.distributed`` process group: NCCL groups communicate CUDA tensors on the current
    device, gloo groups CPU tensors. The transport (``nvlink``, ``p2p``, ``alltoall`` or ``auto``) is chosen
    at construction; ``EPCOMM_TRANSPORT`` overrides it for the whole process.

    Arguments:
        group: the process group of the expert-parallel ranks (default: the world group).
        num_nvl_bytes: bytes of symmetric storage for normal mode (one-sided transports; the portable one needs
            none; ``get_normal_size_hint``). 0: made by the first dispatch, sized for what it can need (each rank
            sending all its tokens to one rank); later calls that need more move in rounds (see ``warmup``).
        num_rdma_bytes: bytes of symmetric storage for low-latency mode (``get_low_latency_rdma_size_hint``),
            made now. 0: made by the first low-latency call.
        low_latency_mode: True makes the low-latency storage now and needs ``num_rdma_bytes`` > 0 (as in
            DeepEP). Either way both modes work on every Buffer; low-latency storage grows only at the first
            call of a shape that does not fit it (collective, before that call launches anything) or in
            ``warmup`` — never inside a call of a shape already made, nor while a CUDA graph is captured.
        num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl: accepted for DeepEP compatibility
            (RDMA and multi-node NVLink settings; epcomm communicates within one NVLink domain).
        explicitly_destroy: True (DeepEP's explicit mode): ``destroy()`` must be called; a Buffer collected
            without it logs a warning. False (default): the storage is released at process exit, or earlier by
            ``destroy()``. Releasing it when the object is collected is not possible: it is collective.
        transport: ``auto`` (default), ``nvlink``, ``p2p`` or ``alltoall``; or a ``Transport`` subclass to use
            as given, without the topology checks (custom transports, interpreter tests).
        device: the device to communicate on (default: the current CUDA device for NCCL groups, else CPU).
        ranks_per_node: ranks per domain (node), consecutive; default ``EPCOMM_RANKS_PER_NODE``, else one domain
            per host as the topology probe finds them. Several domains make the Buffer hierarchical
            (``epcomm.transports.hierarchical``): tokens cross between domains once per destination domain over
            torch.distributed and ``transport`` names the transport within each domain. ``ranks_per_node`` equal
            to the group size makes one domain (a flat call over the whole group, e.g. ``alltoall``).

    Errors: bad arguments raise at once (messages start with the function's name). What fails on the device (a
    wait that timed out, naming the rank, the peer and what was awaited; rows that did not fit
    ``num_worst_tokens`` or a low-latency slot; invalid expert ids in a call without host synchronisation) is
    recorded there and raised as ``EpcommDeviceError`` by the first interaction with the Buffer that sees it
    (every call checks at entry and exit, receive hooks and ``EventOverlap`` waits too, with a plain read of a
    host copy of the error words; ``check_errors()`` synchronises to look). The error is sticky: every later
    call raises it. Recovery: after a low-latency error, ``clean_low_latency_buffer()`` on every rank; after a
    normal-mode error, ``destroy()`` on every rank and a new Buffer.

    Streams: every call of a Buffer is ordered after its previous one, whatever streams they run on (plain
    calls on the current stream, ``async_finish``/``previous_event`` calls on the communication stream, hooks
    where they are called); see ``events.StreamOrder`` for CUDA graphs.
    """

    num_sms: Optional[int] = None  # None: each call's SMs come from the traffic model (Config.num_sms)

    def __init__(self, group: Optional[dist.ProcessGroup] = None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, *, transport: str = "auto",
                 device: Optional[torch.device] = None, ranks_per_node: Optional[int] = None) -> None:
        if not dist.is_initialized():
            raise EpcommError("Buffer: torch.distributed is not initialised; call "
                              "torch.distributed.init_process_group first (or use epcomm.testing.run)")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.group_size = dist.get_world_size(self.group)
        self.num_nvl_bytes = int(num_nvl_bytes)
        self.num_rdma_bytes = int(num_rdma_bytes)
        if low_latency_mode and self.num_rdma_bytes <= 0:
            raise ValueError("Buffer: low_latency_mode=True needs num_rdma_bytes > 0, as in DeepEP: pass "
                             "num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(...), or leave "
                             "low_latency_mode=False to have the storage made by the first low-latency call")
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.device = torch.device(device) if device is not None else default_device(self.group)
        self.id = next(_buffer_ids)
        self.domains = self._find_domains(transport, ranks_per_node)
        self.num_domains, self.local_size = self.domains.num_domains, self.domains.local_size
        if self.num_domains > 1:
            self.runtime = HierarchicalTransport(self.group, self.device, self.id, self.domains, transport,
                                                 num_nvl_bytes=self.num_nvl_bytes, num_rdma_bytes=self.num_rdma_bytes)
            reason = self.runtime.describe()
        else:
            self.runtime, reason = create_transport(transport, self.group, self.device,
                                                    self.id, num_nvl_bytes=self.num_nvl_bytes,
                                                    num_rdma_bytes=self.num_rdma_bytes)
        self.transport = self.runtime.name
        if self.rank == 0:
            log.info("epcomm.Buffer: transport %s on %s with %d ranks: %s", self.transport, self.device,
                     self.group_size, reason)
        self._comm_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._order = StreamOrder()
        self._errors = self.runtime.errors
        self._destroyed = False

    def _find_domains(self, transport, ranks_per_node: Optional[int]) -> Domains:
        """The group's domains (nodes): from the topology probe's hosts, or consecutive blocks of
        ``ranks_per_node`` (this argument, else ``EPCOMM_RANKS_PER_NODE``). A Transport class given as
        ``transport`` is used as given: over one domain, or within each of ``ranks_per_node``'s domains."""
        if isinstance(transport, type) and ranks_per_node is None:
            return Domains(1, self.group_size, "transport class given")
        if ranks_per_node is not None:
            forced, source = ranks_per_node, f"Buffer(ranks_per_node={ranks_per_node})"
        else:
            forced, source = env.ranks_per_node(), "EPCOMM_RANKS_PER_NODE"
        try:
            return find_domains(host_ids_from_report(probe(self.group, self.device)), forced, source)
        except ValueError as exc:
            raise ValueError(f"Buffer: {exc}") from None

    # ------------------------------------------------------------------ static helpers (DeepEP names)
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the SMs the high-throughput kernels of every Buffer may use (even, >= 2; None: chosen per call by
        ``epcomm.core.config.model_num_sms``)."""
        if new_num_sms is not None and (not isinstance(new_num_sms, int) or new_num_sms < 2 or new_num_sms % 2):
            raise ValueError(f"Buffer.set_num_sms: {new_num_sms!r} must be an even integer >= 2 (or None for the "
                             f"traffic model's choice)")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current CUDA stream, to pass as ``previous_event``."""
        return capture_event()

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """The default dispatch config (``Buffer.num_sms`` SMs)."""
        return Config(Buffer.num_sms, 6 if num_ranks > 2 else 8, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """The default combine config (``Buffer.num_sms`` SMs; 8 rows per step: the combine push stores each
        row it loads once, so it needs more bytes per step than the dispatch to hide load latency)."""
        return Config(Buffer.num_sms, 8, 256, 6, 128)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int, num_topk: Optional[int] = None) -> int:
        """Bytes of symmetric storage low-latency mode needs (see ``epcomm.core.layout``)."""
        return _ll_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts, num_topk)

    @staticmethod
    def get_normal_size_hint(num_tokens: int, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of receive storage that holds one normal dispatch in one piece (larger calls are chunked)."""
        return get_normal_buffer_size_hint(num_tokens, hidden_bytes, num_ranks)

    def get_comm_stream(self) -> Optional[torch.cuda.Stream]:
        """The CUDA stream calls with ``async_finish``, ``allocate_on_comm_stream`` or a ``previous_event`` run
        on (None for a Buffer on the CPU, where there are no streams)."""
        return self._comm_stream

    # ------------------------------------------------------------------ lifecycle
    @property
    def memory_usage(self) -> dict:
        """Bytes this Buffer holds between calls, by part, and their ``total``: ``normal_symmetric`` (normal-mode
        storage of the one-sided transports: ``num_nvl_bytes``, or what the first dispatch sized),
        ``low_latency_symmetric`` (low-latency storage, every size made so far: an older one stays until
        ``destroy`` for results still pending on it), ``low_latency_zero_copy`` (the buffers
        ``get_next_low_latency_combine_buffer`` returns), ``pinned_host`` (host copies of the error words and of
        count reads). Outputs of calls belong to the caller and are not counted."""
        usage = dict.fromkeys(("normal_symmetric", "low_latency_symmetric", "low_latency_zero_copy", "pinned_host"),
                              0)
        if not self._destroyed:
            usage.update(self.runtime.memory_usage())
        usage["total"] = sum(usage.values())
        return usage

    def __del__(self) -> None:
        if getattr(self, "explicitly_destroy", False) and not getattr(self, "_destroyed", True):
            try:
                log.warning("epcomm.Buffer %d: created with explicitly_destroy=True and collected without "
                            "destroy(); its storage stays allocated until the process exits", self.id)
            except Exception:  # noqa: BLE001 - logging may be gone at interpreter exit
                pass

    def destroy(self) -> None:
        """Release the transport's resources. Collective: every rank of the group must call it. Raises if a
        call recorded an error on the device that no call has raised yet."""
        if self._destroyed:
            return
        errors = self.runtime.pending_errors()
        unreported = errors and not self._errors.reported
        self.runtime.destroy()
        self._destroyed = True
        if unreported:
            raise EpcommDeviceError("Buffer.destroy: errors recorded on the device: " + "; ".join(errors))

    def check_errors(self) -> None:
        """Raise if an earlier call recorded an error on the device (synchronises). The error stays: every later
        call raises it too, until the Buffer is reset (the "Errors" section of the class docstring)."""
        self._alive("Buffer.check_errors")
        if self.runtime.pending_errors():
            raise self._errors.error("Buffer.check_errors")

    def _alive(self, fn: str) -> None:
        """At every call's entry (and exit): raise if the Buffer was destroyed or has seen a device error (a plain
        read of the host copy of the error words, no synchronisation)."""
        if self._destroyed:
            raise EpcommError(f"{fn}: this Buffer was destroyed; create a new one")
        if self._errors.failure() is not None:
            raise self._errors.error(fn)

    def _scope(self, previous_event, async_finish, allocate_on_comm_stream) -> StreamScope:
        return StreamScope(self._comm_stream, previous_event, async_finish, allocate_on_comm_stream, self._order,
                           self._alive)

    def _call(self, fn: str, scope: StreamScope, run, outputs, inputs, kind: str = NORMAL) -> tuple:
        """Run ``run()`` (the transport's part of a call) in ``scope``, copy the error words to the host behind it
        on the call's stream, finish the scope; raise if an error is visible by then (an earlier call's, or on
        CPUs this call's own). Returns ``(run's result, event)``; ``outputs``/``inputs`` map the result to the
        tensors the scope protects across streams. A host wait of the call that timed out (a rank missing at a
        first call's meeting point) is an error of the Buffer's ``kind`` state, sticky like the device's."""
        with scope:
            try:
                res = run()
            except EpcommTimeoutError as exc:
                self._errors.record(kind, str(exc))
                raise self._errors.error(fn) from exc
            self._errors.refresh()
        event = scope.finish(outputs(res), inputs)
        if self._errors.failure() is not None:
            raise self._errors.error(fn)
        return res, event

    def _hook(self, fn: str, hook):
        """The receive hook the caller gets: checks, orders and refreshes like a call."""
        if hook is None:
            return None

        def recv_hook() -> None:
            self._alive(fn)
            if self._comm_stream is not None:
                self._order.enter_current(self._comm_stream.device_index)
            hook()
            self._errors.refresh()
            self._alive(fn)

        return recv_hook

    def _own(self, fn: str, handle, kind) -> None:
        if not isinstance(handle, kind):
            raise TypeError(f"{fn}: handle must be the {kind.__name__} returned by this Buffer's "
                            f"{'dispatch' if kind is DispatchHandle else 'low_latency_dispatch'}; got "
                            f"{type(handle).__name__}")
        if handle.buffer_id != self.id:
            raise ValueError(f"{fn}: the handle was made by another Buffer (id {handle.buffer_id}, this is "
                             f"{self.id}); pass the handle returned by this Buffer")

    def warmup(self, hidden: int, num_experts: int, num_topk: int, num_tokens: int = 0, *,
               dtypes: Sequence = (torch.bfloat16,), num_worst_tokens: int = 0,
               num_max_dispatch_tokens_per_rank: int = 0, use_fp8: Sequence[bool] = (True, False),
               round_scale: bool = False, use_ue8m0: bool = False, layouts: Sequence[str] = ("rank_major",),
               expert_alignment: int = 1) -> None:
        """Compile the kernels of a configuration and make its storage before calls of it wait on peers.
        Collective (every rank, the same arguments); not while a CUDA graph is being captured.

        Compilation takes different times on different ranks (seconds per kernel without Triton's cache), and a
        rank's device waits must not count a peer's compilation. Without warm-up the first call of each kind
        compiles its kernels before any rank waits (the ranks meet at a host barrier): in low-latency mode every
        variant that calls of its shape can launch (any token count, an empty rank); in normal mode the kernels'
        per-call integers are not specialised, so other token counts launch the same variants. This method
        moves that compilation and the sizing of storage out of the first calls.

        Arguments:
            hidden, num_experts, num_topk: the calls' shapes.
            num_tokens: if > 0, normal mode: one dispatch (top-k ids and weights), its cached repeat and a combine
                (with weights) per payload in ``dtypes`` (``torch.bfloat16``, ``torch.float16``, ``torch.float32``
                or ``"fp8"``), on ``num_tokens`` tokens per rank of synthetic routing; with ``num_worst_tokens``
                also that dispatch and its combine. They run as calls (their first-call compilation and barrier
                included); with ``num_nvl_bytes=0`` they also size the one-sided transports' storage. Across nodes
                they run once per chunk count the later calls may use (and with a head chunk), not timed.
            layouts, expert_alignment: the normal-mode calls are made with each ``dispatch`` layout in ``layouts``
                (``"expert_major"`` adds its kernels, e.g. before capturing its calls in a CUDA graph).
            num_max_dispatch_tokens_per_rank: if > 0 (T), low-latency mode: for each ``use_fp8`` (with
                ``round_scale``/``use_ue8m0``), the storage for T tokens and every kernel variant (any token
                count, dispatch and combine, plain and hook), compiled without launching.
        Ends with a barrier of the group; raises if a warm-up call recorded an error."""
        fn = "Buffer.warmup"
        self._alive(fn)
        for name, value, least in (("hidden", hidden, 1), ("num_topk", num_topk, 1), ("num_tokens", num_tokens, 0),
                                   ("num_worst_tokens", num_worst_tokens, 0),
                                   ("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 0)):
            if not isinstance(value, int) or value < least:
                raise ValueError(f"{fn}: {name}={value!r} must be an integer >= {least}")
        check_num_experts(fn, num_experts, self.group_size)
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise EpcommError(f"{fn}: called while a CUDA graph is being captured; warm up before capturing")
        if any(layout not in LAYOUTS for layout in layouts):
            raise ValueError(f"{fn}: layouts={tuple(layouts)!r} must hold entries of {LAYOUTS}")
        if num_tokens:
            for dtype, layout in itertools.product(dtypes, layouts):
                self._warm_normal(hidden, num_experts, num_topk, num_tokens, dtype, 0, layout, expert_alignment)
                if num_worst_tokens:  # every row fits: each rank receives at most R * (its tokens) rows
                    per = self.group_size * (num_topk if layout == "expert_major" else 1)  # (or K times that pairs)
                    self._warm_normal(hidden, num_experts, num_topk, max(1, min(num_tokens, num_worst_tokens // per)),
                                      dtype, num_worst_tokens, layout, expert_alignment)
        if num_max_dispatch_tokens_per_rank:
            if hidden % GROUP:
                raise ValueError(f"{fn}: hidden={hidden} must be a multiple of {GROUP} for low-latency mode")
            for fp8 in use_fp8:
                self.runtime.warmup_low_latency(call_shape(num_max_dispatch_tokens_per_rank, hidden, num_topk,
                                                           num_experts, fp8, round_scale, use_ue8m0, torch.bfloat16))
        self.check_errors()
        dist.barrier(group=self.group)

    def _warm_normal(self, hidden: int, num_experts: int, num_topk: int, n: int, dtype, worst: int,
                     layout: str = "rank_major", expert_alignment: int = 1) -> None:
        """One layout, dispatch, cached dispatch and combine of zeros with synthetic routing (``Buffer.warmup``)."""
        dev = self.device
        token = torch.arange(n, device=dev).unsqueeze(1) * num_topk + self.rank
        idx = (token + torch.arange(num_topk, device=dev)) % num_experts  # distinct within a token
        weights = torch.ones(n, num_topk, dtype=torch.float32, device=dev)
        if dtype == "fp8":
            x = (torch.zeros(n, hidden, device=dev).to(FP8_DTYPE),
                 torch.ones(n, hidden // GROUP, dtype=torch.float32, device=dev))
            out_dtype = torch.bfloat16
        else:
            x, out_dtype = torch.zeros(n, hidden, dtype=dtype, device=dev), dtype
        per_rank, _, per_expert, in_rank, _ = self.get_dispatch_layout(idx, num_experts)

        def round_of_calls() -> None:
            recv_x, _, recv_w, _, handle, _ = self.dispatch(
                x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=idx, topk_weights=weights, num_worst_tokens=worst, layout=layout,
                expert_alignment=expert_alignment)
            self.dispatch(x, handle=handle)
            if handle.expert_major:
                rows = torch.zeros(handle.num_recv_rows, hidden, dtype=out_dtype, device=dev)
                self.combine(rows, handle, topk_weights=recv_w)
                self.combine(rows, handle, weighted=False)
                return
            rows = torch.zeros(handle.num_recv_tokens, hidden, dtype=out_dtype, device=dev)
            self.combine(rows, handle, topk_weights=recv_w)

        if worst:  # (fixed slots: one path)
            round_of_calls()
        else:  # once, or once per path the transport's later calls can take
            self.runtime.warm_normal(round_of_calls)

    # ------------------------------------------------------------------ normal mode
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        """Where each token goes.

        Arguments:
            topk_idx: ``[num_tokens, num_topk]`` int64 (int32 accepted), expert ids; -1 means no selection.
            num_experts: E, a multiple of the group size.

        Returns:
            num_tokens_per_rank: ``[num_ranks]`` int32, tokens sent to each rank (a token counts once per rank).
            num_tokens_per_rdma_rank: ``[num_domains]`` int32, tokens sent to each domain (node; a token counts once
                per domain) when the group spans several, else None (DeepEP's ``num_tokens_per_rdma_rank``).
            num_tokens_per_expert: ``[num_experts]`` int32, (token, slot) pairs per expert.
            is_token_in_rank: ``[num_tokens, num_ranks]`` bool.
            event: EventOverlap (valid with ``async_finish``).
        """
        fn = "Buffer.get_dispatch_layout"
        self._alive(fn)
        check_num_experts(fn, num_experts, self.group_size)
        # on GPUs the values are checked by the dispatch that uses this layout (no extra host sync here)
        check_topk(fn, topk_idx, num_experts, None, self.device, values_checked_later=True)
        scope = self._scope(previous_event, async_finish, allocate_on_comm_stream)
        with scope:
            per_rank, per_expert, in_rank = self.runtime.get_dispatch_layout(topk_idx, num_experts)
            per_rdma = None
            if self.num_domains > 1:
                per_rdma = in_rank.view(-1, self.num_domains, self.local_size).any(2).sum(0, dtype=torch.int32)
        event = scope.finish((per_rank, per_expert, in_rank, per_rdma), (topk_idx,))
        return per_rank, per_rdma, per_expert, in_rank, event

    def dispatch(self, x: Tensors, handle: Optional[DispatchHandle] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False, *,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None, layout: Optional[str] = None):
        """Send every token to each rank that holds one of its experts (once per rank).

        Arguments:
            x: ``[num_tokens, hidden]`` bf16 (fp16 and fp32 work too), or the FP8 pair
                ``(x_e4m3 [num_tokens, hidden] float8_e4m3fn, scales [num_tokens, hidden / 128] float32)``;
                column-major scales are accepted.
            handle: a DispatchHandle from an earlier dispatch of this Buffer: reuse its layout (cached mode,
                also combine's backward). Then only ``x`` travels and the layout arguments must be None.
            num_tokens_per_rank ``[R]`` int32, is_token_in_rank ``[N, R]`` bool, num_tokens_per_expert ``[E]``
                int32: from ``get_dispatch_layout`` (required without a handle; the last with ``topk_idx``).
            num_tokens_per_rdma_rank: None, or across domains the ``[num_domains]`` int32 of ``get_dispatch_layout``.
            topk_idx: ``[N, K]`` int64 global expert ids (-1: none); topk_weights: ``[N, K]`` float32.
            expert_alignment: round each local expert's count up to a multiple of this.
            num_worst_tokens: if > 0, outputs have exactly this many rows and the call makes no host
                synchronisation (CUDA-graph capturable); rows past the real count have ``recv_topk_idx == -1``.
                The per-expert list is then empty: read ``handle.num_recv_tokens_per_expert`` (device).
            config: tuning (default ``get_dispatch_config``).
            previous_event, async_finish, allocate_on_comm_stream: stream control as in DeepEP.
            cumulative_local_expert_recv_stats: optional ``[E_local]`` int32 tensor on the Buffer's device; the
                call adds the (token, local expert) pairs it receives per local expert (not aligned) to it, on
                the device, in stream order (no host synchronisation; CUDA-graph capturable).
            layout: ``"rank_major"`` (None, the default: DeepEP's layout, described below) or ``"expert_major"``:
                rows grouped by local expert, ready for a grouped GEMM (needs ``topk_idx``; a cached dispatch
                takes its handle's layout). See "Expert-major layout" below.

        Returns:
            recv_x: ``[M, hidden]`` like ``x`` (a pair for FP8, scales ``[M, hidden / 128]`` row-major),
                ordered by source rank, then source token.
            recv_topk_idx: ``[M, K]`` int64 local expert ids (global - rank * E_local), -1 for other ranks'
                experts (None without ``topk_idx`` and in cached mode).
            recv_topk_weights: ``[M, K]`` float32, 0 where ``recv_topk_idx`` is -1.
            num_recv_tokens_per_expert_list: Python list ``[E_local]`` of received (token, expert) counts,
                aligned, as ``num_tokens_per_expert`` counts them (empty without it; None in cached mode).
            handle: DispatchHandle (None in cached mode, as in DeepEP).
            event: EventOverlap.

        Expert-major layout (``layout="expert_major"``): one row per received (token, slot) whose expert is on
        this rank, grouped by local expert: expert ``e``'s segment starts at a multiple of
        ``expert_alignment`` (A; 8 suits ``torch._grouped_mm`` with bf16), holds its pairs ordered by source
        rank, then source token, then slot, and is followed by zero rows up to the next segment (padding).
        ``num_worst_tokens`` (W) then bounds the received (token, local expert) pairs, and every output has
        ``W + E_local * (A - 1)`` rows (rows past the last segment are unspecified and never read); otherwise
        ``sum over e of align(count_e, A)`` rows. The one-sided transports or a permute kernel after the
        portable transport's all_to_all put the rows there (no host synchronisation beyond the rank-major
        dispatch's). The returned tuple is then:
            recv_x: ``[rows, hidden]`` (FP8: the pair, scales ``[rows, hidden / 128]``), as above.
            recv_expert_offsets: ``[E_local]`` int32 on the device, each segment's end row (aligned,
                cumulative): ``torch._grouped_mm(recv_x, w, offs=recv_expert_offsets)``.
            recv_row_weights: ``[rows]`` float32, each row's routing weight (0 on padding; None without
                ``topk_weights``).
            num_recv_tokens_per_expert_list: as above (aligned pair counts; empty with ``num_worst_tokens``).
            handle: DispatchHandle with ``layout == "expert_major"`` (``expert_offsets``, ``recv_pair_row``,
                ``recv_row_src``, ``recv_row_weights``); its combine takes the rows back (``combine``) and a
                cached dispatch with it returns expert-major rows.
            event: EventOverlap.
        """
        fn = "Buffer.dispatch"
        self._alive(fn)
        data, scales = split_x(fn, x, self.device)
        n = data.size(0)
        if num_tokens_per_rdma_rank is not None:
            if self.num_domains == 1:
                raise ValueError(f"{fn}: num_tokens_per_rdma_rank must be None: this Buffer's ranks form one domain "
                                 f"(node); get_dispatch_layout returned None for it")
            if (not isinstance(num_tokens_per_rdma_rank, torch.Tensor) or num_tokens_per_rdma_rank.dtype != torch.int32
                    or num_tokens_per_rdma_rank.shape != (self.num_domains,)):
                got = (getattr(num_tokens_per_rdma_rank, "dtype", None),
                       tuple(getattr(num_tokens_per_rdma_rank, "shape", ())))
                raise ValueError(f"{fn}: num_tokens_per_rdma_rank must be int32 [{self.num_domains}] (tokens per "
                                 f"node) from get_dispatch_layout; got {got[0]} {got[1]}")
        if not isinstance(expert_alignment, int) or expert_alignment < 1:
            raise ValueError(f"{fn}: expert_alignment={expert_alignment!r} must be an integer >= 1")
        if not isinstance(num_worst_tokens, int) or num_worst_tokens < 0:
            raise ValueError(f"{fn}: num_worst_tokens={num_worst_tokens!r} must be an integer >= 0")
        if layout is not None and layout not in LAYOUTS:
            raise ValueError(f"{fn}: layout={layout!r} must be one of {LAYOUTS} (None: 'rank_major', or the handle's "
                             f"layout in cached mode)")
        config = config or self.get_dispatch_config(self.group_size)
        bad = None
        num_experts = self.group_size
        if handle is not None:
            self._own(fn, handle, DispatchHandle)
            if topk_idx is not None or topk_weights is not None:
                raise ValueError(f"{fn}: with a handle (cached mode) topk_idx and topk_weights must be None; the "
                                 f"handle already holds the layout")
            if n != handle.num_tokens:
                raise ValueError(f"{fn}: x has {n} tokens but the handle was made for {handle.num_tokens}")
            if layout is not None and layout != handle.layout:
                raise ValueError(f"{fn}: layout={layout!r} but the handle was made with layout={handle.layout!r}; a "
                                 f"cached dispatch returns its handle's layout (pass layout=None)")
            num_experts = handle.num_experts
            expert_major = handle.expert_major
        else:
            expert_major = layout == "expert_major"
            if expert_major and topk_idx is None:
                raise ValueError(f"{fn}: layout='expert_major' groups rows by expert: pass topk_idx (and "
                                 f"num_tokens_per_expert, from get_dispatch_layout)")
            if num_tokens_per_rank is None or is_token_in_rank is None:
                raise ValueError(f"{fn}: without a handle, num_tokens_per_rank and is_token_in_rank are required; "
                                 f"get them from Buffer.get_dispatch_layout(topk_idx, num_experts)")
            _check_layout(fn, num_tokens_per_rank, is_token_in_rank, n, self.group_size, self.device)
            if topk_weights is not None and topk_idx is None:
                raise ValueError(f"{fn}: topk_weights needs topk_idx")
            if topk_idx is not None:
                if num_tokens_per_expert is None:
                    raise ValueError(f"{fn}: num_tokens_per_expert is required with topk_idx; get it from "
                                     f"Buffer.get_dispatch_layout")
            if num_tokens_per_expert is not None:
                if num_tokens_per_expert.dim() != 1 or num_tokens_per_expert.dtype != torch.int32:
                    raise ValueError(f"{fn}: num_tokens_per_expert must be [num_experts] int32; got "
                                     f"{num_tokens_per_expert.dtype} {tuple(num_tokens_per_expert.shape)}")
                num_experts = num_tokens_per_expert.numel()
                check_num_experts(fn, num_experts, self.group_size)
            if topk_idx is not None:
                bad = check_topk(fn, topk_idx, num_experts, n, self.device, topk_weights,
                                 values_checked_later=self.runtime.checks_topk(data, num_worst_tokens))
        scope = self._scope(previous_event, async_finish, allocate_on_comm_stream)
        req = DispatchRequest(data, scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                              num_tokens_per_expert, num_experts, expert_alignment, num_worst_tokens, handle,
                              config, bad, overlapped=scope.comm_stream is not None,
                              layout="expert_major" if expert_major else "rank_major")
        stats = cumulative_local_expert_recv_stats
        if stats is not None:
            check_expert_stats(fn, stats, num_experts // self.group_size, self.device)

        def run():
            res = self.runtime.dispatch_expert_major(req) if expert_major else self.runtime.dispatch(req)
            if stats is not None:
                stats.add_(res.handle.num_recv_tokens_per_expert)
            return res

        res, event = self._call(fn, scope, run,
                                lambda r: (r.recv_x, r.recv_scales, r.recv_topk_idx, r.recv_topk_weights),
                                (data, scales, topk_idx, topk_weights, stats))
        recv_x = (res.recv_x, res.recv_scales) if scales is not None else res.recv_x
        if handle is not None:
            return recv_x, None, None, None, None, event
        return (recv_x, res.recv_topk_idx, res.recv_topk_weights, res.num_recv_tokens_per_expert_list, res.handle,
                event)

    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Sequence[torch.Tensor], None] = None, config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False, *, row_weights: Optional[torch.Tensor] = None,
                weighted: bool = True):
        """Send every received row back to its source rank and sum per token (the reverse of ``dispatch``).

        Arguments:
            x: ``[M, hidden]`` bf16 (fp16/fp32 too), one row per row ``dispatch`` returned with ``handle``.
            handle: the DispatchHandle of that dispatch.
            topk_weights: optional ``[M, K]`` float32, summed the same way.
            bias: None, a ``[N, hidden]`` tensor or a pair of them, added (in FP32) after the sum.

        Returns:
            combined_x: ``[N, hidden]`` of ``x.dtype``: for each token, the FP32 sum in rank order of the rows
                sent back for it, plus the biases, cast once.
            combined_topk_weights: ``[N, K]`` float32 or None.
            event: EventOverlap.

        With an expert-major handle (``dispatch(..., layout="expert_major")``) the combine is weighted:
            x: ``[rows, hidden]`` expert-major rows (the expert outputs of the dispatched rows; padding rows and
                rows past the last segment are never read).
            topk_weights: optional ``[rows]`` float32 per-row values, each returned to its (token, slot):
                ``combined_topk_weights[t, k]`` (0.0 for slots without a row; e.g. gradients of the row weights).
            row_weights (keyword): ``[rows]`` float32 weight of every row; None: the routing weights the
                dispatch delivered (``handle.recv_row_weights``; unweighted when it had no ``topk_weights``).
            weighted (keyword): False sums the rows as they are (e.g. the gradients of the dispatched rows).
            The result is, per token, the float32 sum in rank order of one partial per rank it went to, plus the
            biases, cast once; a rank's partial is the float32 sum, in slot order from +0.0, of ``row_weight *
            float(x[row])`` (each product rounded to float32 first) over the token's rows there, cast once to
            ``x.dtype`` (the row that travels back, as in DeepEP). ``epcomm.reference.expert_major_combine``
            models it bit for bit, so the result does not depend on timing or transport.
        """
        fn = "Buffer.combine"
        self._alive(fn)
        self._own(fn, handle, DispatchHandle)
        rows = handle.num_recv_rows if handle.expert_major else handle.num_recv_tokens
        if not isinstance(x, torch.Tensor) or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"{fn}: x must be a bf16, fp16 or fp32 tensor [num_recv_tokens, hidden]; got "
                            f"{getattr(x, 'dtype', type(x).__name__)}")
        if x.dim() != 2 or x.size(0) != rows:
            what = "expert-major row" if handle.expert_major else "dispatched row"
            raise ValueError(f"{fn}: x must be [{rows}, hidden] (one row per {what}); got {tuple(x.shape)}")
        if x.device != self.device:
            raise ValueError(f"{fn}: x is on {x.device}, this Buffer communicates on {self.device}")
        if topk_weights is not None and not isinstance(topk_weights, torch.Tensor):
            raise TypeError(f"{fn}: topk_weights must be a float32 tensor or None; got {type(topk_weights).__name__}")
        if handle.expert_major:
            if topk_weights is not None and (topk_weights.dtype != torch.float32 or topk_weights.shape != (rows,)
                                             or topk_weights.device != self.device):
                raise ValueError(f"{fn}: with an expert-major handle topk_weights must be float32 [{rows}] (one value "
                                 f"per row) on {self.device}; got {topk_weights.dtype} {tuple(topk_weights.shape)}")
            if row_weights is not None and (not isinstance(row_weights, torch.Tensor)
                                            or row_weights.dtype != torch.float32 or row_weights.shape != (rows,)
                                            or row_weights.device != self.device):
                raise ValueError(f"{fn}: row_weights must be float32 [{rows}] (one weight per expert-major row) on "
                                 f"{self.device}; got {getattr(row_weights, 'dtype', type(row_weights).__name__)} "
                                 f"{tuple(getattr(row_weights, 'shape', ()))}")
            if not weighted and row_weights is not None:
                raise ValueError(f"{fn}: weighted=False sums the rows unweighted; do not pass row_weights too")
            if weighted and row_weights is None:
                row_weights = handle.recv_row_weights
            row_weights = row_weights.contiguous() if weighted and row_weights is not None else None
            if topk_weights is not None:
                topk_weights = topk_weights.contiguous()
        elif row_weights is not None or not weighted:
            raise ValueError(f"{fn}: row_weights and weighted apply to expert-major handles only (dispatch with "
                             f"layout='expert_major'); this handle is rank-major")
        elif topk_weights is not None and (topk_weights.dtype != torch.float32 or topk_weights.dim() != 2
                                           or topk_weights.size(0) != x.size(0)):
            raise ValueError(f"{fn}: topk_weights must be float32 [{x.size(0)}, num_topk]; got "
                             f"{topk_weights.dtype} {tuple(topk_weights.shape)}")
        biases = () if bias is None else (bias,) if isinstance(bias, torch.Tensor) else tuple(bias)
        if len(biases) > 2 or any(not isinstance(b, torch.Tensor) or b.shape != (handle.num_tokens, x.size(1))
                                  or b.device != self.device for b in biases):
            raise ValueError(f"{fn}: bias must be None, a tensor or a pair of tensors of shape "
                             f"[{handle.num_tokens}, {x.size(1)}] on {self.device}")
        scope = self._scope(previous_event, async_finish, allocate_on_comm_stream)
        req = CombineRequest(x.contiguous(), handle, topk_weights, biases,
                             config or self.get_combine_config(self.group_size),
                             overlapped=scope.comm_stream is not None, row_weights=row_weights)
        run = self.runtime.combine_expert_major if handle.expert_major else self.runtime.combine
        (combined, combined_w), event = self._call(fn, scope, lambda: run(req), lambda r: r,
                                                   (x, topk_weights, biases, row_weights))
        return combined, combined_w, event

    # ------------------------------------------------------------------ low-latency mode
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, use_fp8: bool = True, round_scale: bool = False,
                             use_ue8m0: bool = False, async_finish: bool = False, return_recv_hook: bool = False, *,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None):
        """Send one copy of each token to each selected expert (decode-sized batches, fixed shapes).

        Arguments:
            x: ``[N, hidden]`` bf16 (fp32 accepted), N <= num_max_dispatch_tokens_per_rank, hidden a multiple
                of 128.
            topk_idx: ``[N, K]`` int64 global expert ids, -1 for none; ids within a token distinct.
            num_max_dispatch_tokens_per_rank: T, the same on every rank.
            num_experts: E, a multiple of the group size.
            use_fp8: cast to e4m3 with per-128-channel scales on the way (else send ``x`` as is).
            round_scale: power-of-two scales. use_ue8m0: scales as packed UE8M0 bytes (needs round_scale).
            async_finish: return an event instead of making the current stream wait.
            return_recv_hook: issue the sends and return; call ``hook()`` later to complete the receive. The
                one-sided transports double-buffer their storage: up to two dispatch and two combine results
                may be pending, provided every rank has run the hook of call j-2 of a kind before any rank
                sends call j of that kind (two micro-batches per layer: D0 D1, hooks, C0 C1, hooks).
            cumulative_local_expert_recv_stats: optional ``[E_local]`` int32 tensor on the Buffer's device; the
                receive adds ``recv_count`` to it on the device (with ``return_recv_hook``: when the hook runs).
                No host synchronisation; CUDA-graph capturable.

        Returns:
            recv_x: ``[E_local, R * T, hidden]`` e4m3 with scales ``[E_local, R * T, hidden / 128]`` float32
                (column-major, as DeepEP; ``[E_local, R * T, hidden / 512]`` int32 for UE8M0), or bf16.
                Expert ``e``'s rows ``0 .. recv_count[e] - 1`` are valid, each source rank's rows one block
                ordered by token: blocks by source rank within a node; across nodes (the hierarchical transport) by
                the source's local index, then its node. ``handle.layout_range`` gives each source's block.
            recv_count: ``[E_local]`` int32.
            handle: LowLatencyHandle (``src_info``, ``layout_range``).
            event: EventOverlap.
            hook: the receive completion (None unless ``return_recv_hook``).
        """
        fn = "Buffer.low_latency_dispatch"
        self._alive(fn)
        _check_hook_flags(fn, async_finish, return_recv_hook)
        check_num_experts(fn, num_experts, self.group_size)
        if not isinstance(x, torch.Tensor) or x.dtype not in (torch.bfloat16, torch.float32) or x.dim() != 2:
            raise TypeError(f"{fn}: x must be a bf16 [num_tokens, hidden] tensor; got "
                            f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
        if x.size(1) % GROUP:
            raise ValueError(f"{fn}: hidden={x.size(1)} must be a multiple of {GROUP}")
        if x.device != self.device:
            raise ValueError(f"{fn}: x is on {x.device}, this Buffer communicates on {self.device}")
        if not isinstance(num_max_dispatch_tokens_per_rank, int) or num_max_dispatch_tokens_per_rank < 1:
            raise ValueError(f"{fn}: num_max_dispatch_tokens_per_rank={num_max_dispatch_tokens_per_rank!r} must "
                             f"be a positive integer")
        if x.size(0) > num_max_dispatch_tokens_per_rank:
            raise ValueError(f"{fn}: x has {x.size(0)} tokens, more than num_max_dispatch_tokens_per_rank="
                             f"{num_max_dispatch_tokens_per_rank}; raise that limit or split the batch")
        if use_ue8m0 and not round_scale:
            raise ValueError(f"{fn}: use_ue8m0=True needs round_scale=True (UE8M0 scales are powers of two)")
        bad = check_topk(fn, topk_idx, num_experts, x.size(0), self.device,
                         values_checked_later=self.runtime.validates_topk)
        stats = cumulative_local_expert_recv_stats
        if stats is not None:
            check_expert_stats(fn, stats, num_experts // self.group_size, self.device)
        req = LowLatencyDispatchRequest(x.contiguous(), topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                        use_fp8, round_scale, use_ue8m0, return_recv_hook, bad)

        def run():
            res = self.runtime.low_latency_dispatch(req)
            if stats is not None and res.hook is None:
                stats.add_(res.recv_count)
            return res

        res, event = self._call(fn, self._scope(None, async_finish, False), run,
                                lambda r: (r.recv_x, r.recv_scales, r.recv_count), (x, topk_idx, stats), LOW_LATENCY)
        hook = res.hook
        if stats is not None and hook is not None:
            hook = _ThenAdd(hook, stats, res.recv_count)
        recv_x = (res.recv_x, res.recv_scales) if use_fp8 else res.recv_x
        return recv_x, res.recv_count, res.handle, event, self._hook(f"{fn} hook", hook)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None):
        """Return the expert outputs to their tokens and reduce them with the top-k weights.

        Arguments:
            x: ``[E_local, R * T, hidden]`` bf16 expert outputs, laid out as ``low_latency_dispatch`` returned
                them (ignored with ``zero_copy``, which reads ``get_next_low_latency_combine_buffer(handle)``).
                Either tensor is read in place: the one-sided kernels store each row from it straight into the
                rank that needs it (there is no staging copy to save, so ``zero_copy`` only lets the experts
                write into a tensor the Buffer keeps); the portable transport gathers the rows for its
                all_to_all in both cases.
            topk_idx ``[N, K]`` int64, topk_weights ``[N, K]`` float32: as given to the dispatch.
            handle: its LowLatencyHandle.
            out: optional ``[N, hidden]`` bf16 tensor to write into.

        Returns:
            combined_x: ``[N, hidden]`` bf16, ``sum_k w[:, k] * y_k`` in FP32 (slot order), cast once.
            event: EventOverlap. hook: receive completion (None unless ``return_recv_hook``).
        """
        fn = "Buffer.low_latency_combine"
        self._alive(fn)
        _check_hook_flags(fn, async_finish, return_recv_hook)
        self._own(fn, handle, LowLatencyHandle)
        if use_logfmt:
            raise NotImplementedError(f"{fn}: use_logfmt=True is not supported; pass use_logfmt=False")
        e_local = handle.num_experts // handle.num_ranks
        shape = (e_local, handle.num_ranks * handle.num_max_dispatch_tokens_per_rank, handle.hidden)
        if not zero_copy and (not isinstance(x, torch.Tensor) or tuple(x.shape) != shape
                              or x.dtype != torch.bfloat16):
            raise ValueError(f"{fn}: x must be bf16 {list(shape)} (expert outputs in dispatch layout); got "
                             f"{getattr(x, 'dtype', None)} {tuple(getattr(x, 'shape', ()))}")
        if topk_idx.shape != (handle.num_tokens, handle.num_topk):
            raise ValueError(f"{fn}: topk_idx must be the dispatch's [{handle.num_tokens}, {handle.num_topk}]; got "
                             f"{tuple(topk_idx.shape)}")
        if topk_weights.dtype != torch.float32 or topk_weights.shape != topk_idx.shape:
            raise ValueError(f"{fn}: topk_weights must be float32 {tuple(topk_idx.shape)}; got {topk_weights.dtype} "
                             f"{tuple(topk_weights.shape)}")
        if out is not None and (out.shape != (handle.num_tokens, handle.hidden) or out.dtype != torch.bfloat16):
            raise ValueError(f"{fn}: out must be bf16 [{handle.num_tokens}, {handle.hidden}]; got {out.dtype} "
                             f"{tuple(out.shape)}")
        req = LowLatencyCombineRequest(x, topk_idx, topk_weights, handle, zero_copy, return_recv_hook, out)
        res, event = self._call(fn, self._scope(None, async_finish, False),
                                lambda: self.runtime.low_latency_combine(req), lambda r: (r.combined_x,),
                                (x, topk_idx, topk_weights), LOW_LATENCY)
        return res.combined_x, event, self._hook(f"{fn} hook", res.hook)

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The ``[E_local, R * T, hidden]`` bf16 tensor to write expert outputs into for a
        ``zero_copy=True`` combine with this handle; that combine reads it in place. One of two per shape
        (by the parity of the dispatch, so two micro-batches in flight get different ones), kept by the
        Buffer (``memory_usage``)."""
        self._alive("Buffer.get_next_low_latency_combine_buffer")
        self._own("Buffer.get_next_low_latency_combine_buffer", handle, LowLatencyHandle)
        return self.runtime.low_latency_combine_buffer(handle)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Reset the low-latency state as after construction (DeepEP's clean): arrival flags, call counters and the
        error words of low-latency calls, on every rank. Collective: every rank calls it, with no low-latency call
        of this Buffer in flight (it synchronises the device and the group); results still pending (hooks not
        run) are abandoned.

        This is how a Buffer recovers from a low-latency error (a receive that timed out, rows that did not fit,
        invalid expert ids): afterwards low-latency calls are correct again. An error of a normal-mode call stays
        (destroy the Buffer and create a new one). The arguments are checked as ``low_latency_dispatch`` checks
        them; epcomm's storage is not laid out per shape, so every shape is reset."""
        fn = "Buffer.clean_low_latency_buffer"
        if self._destroyed:
            raise EpcommError(f"{fn}: this Buffer was destroyed; create a new one")
        for name, value in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
                            ("hidden", hidden)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{fn}: {name}={value!r} must be a positive integer")
        if hidden % GROUP:
            raise ValueError(f"{fn}: hidden={hidden} must be a multiple of {GROUP}")
        check_num_experts(fn, num_experts, self.group_size)
        self.runtime.clean_low_latency()


def _check_hook_flags(fn: str, async_finish: bool, return_recv_hook: bool) -> None:
    if async_finish and return_recv_hook:
        raise ValueError(f"{fn}: async_finish=True and return_recv_hook=True cannot be combined (DeepEP rejects it "
                         f"too): with a hook the receive runs when you call hook(), on your stream; pass one of them")


class _ThenAdd:
    """A receive hook that, once the receive ran, adds ``counts`` to ``stats`` (once, however often it is
    called, like the hook it wraps)."""

    __slots__ = ("_hook", "_stats", "_counts")

    def __init__(self, hook, stats: torch.Tensor, counts: torch.Tensor) -> None:
        self._hook, self._stats, self._counts = hook, stats, counts

    def __call__(self) -> None:
        self._hook()
        if self._stats is not None:
            self._stats.add_(self._counts)
            self._stats = self._counts = None


def _check_layout(fn: str, num_tokens_per_rank, is_token_in_rank, n: int, num_ranks: int, device) -> None:
    if (not isinstance(num_tokens_per_rank, torch.Tensor) or num_tokens_per_rank.dtype != torch.int32
            or num_tokens_per_rank.shape != (num_ranks,)):
        raise ValueError(f"{fn}: num_tokens_per_rank must be int32 [{num_ranks}]; got "
                         f"{getattr(num_tokens_per_rank, 'dtype', None)} "
                         f"{tuple(getattr(num_tokens_per_rank, 'shape', ()))}")
    if (not isinstance(is_token_in_rank, torch.Tensor) or is_token_in_rank.dtype != torch.bool
            or is_token_in_rank.shape != (n, num_ranks)):
        raise ValueError(f"{fn}: is_token_in_rank must be bool [{n}, {num_ranks}]; got "
                         f"{getattr(is_token_in_rank, 'dtype', None)} {tuple(getattr(is_token_in_rank, 'shape', ()))}")
    for name, t in (("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank", is_token_in_rank)):
        if t.device != device:
            raise ValueError(f"{fn}: {name} is on {t.device}, this Buffer communicates on {device}")
