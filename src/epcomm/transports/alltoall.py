"""The portable transport: ``torch.distributed.all_to_all_single`` (NCCL on GPUs, gloo on CPUs).

Runs on any hardware and any process group. Written for speed within that limit: no Python loops over
tokens, payloads moved as raw bytes in as few collectives as possible.

Normal dispatch, exact sizes (one host synchronisation):
  1. one all_to_all of a ``[R, 1 + E_local]`` int32 table (tokens per rank, tokens per expert);
  2. one copy of the counts to the host (it also carries the deferred input checks);
  3. one all_to_all of the token rows (gathered in destination-rank, token order) straight into ``recv_x``;
  4. one all_to_all of a per-row int32 metadata record (source token, FP8 scales, local top-k ids and
     weights).
Normal dispatch with ``num_worst_tokens`` (no host synchronisation, CUDA-graph capturable): every rank
  sends a fixed ``num_worst_tokens`` rows to every peer (the only bound all ranks know without talking),
  and the receiver compacts them on the device. It moves ``R * num_worst_tokens`` rows per rank: correct,
  but the one-sided transports are the fast way to avoid host synchronisation.
Combine: the reverse all_to_all of the rows (and top-k weights), then an ordered FP32 reduction (a Triton
  kernel on GPUs, torch on CPUs) that is bit-identical to the reference.
A group of one rank (the node leg of a node with one GPU) makes no collective: its packed rows are its received
  rows, and a count or slot exchange is a copy.
Low-latency dispatch/combine: fixed-size slots of ``T * min(K, E_local)`` rows per peer, so there is no
  host synchronisation, shapes are static (CUDA-graph capturable with NCCL) and ``return_recv_hook``
  really defers the receive: the all_to_alls are issued asynchronously and the hook waits and unpacks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..core.handles import DispatchHandle, LowLatencyHandle
from ..core.layout import align_all, low_latency_pair_capacity
from ..core.validate import check_precast, raise_if_bad_routing
from ..errors import EpcommError
from ..fp8 import FP8_DTYPE, pack_ue8m0, per_token_cast_to_fp8
from ..kernels import triton_available, use_kernels
from ..kernels.launch import one_variant
from .device_errors import LOW_LATENCY, NORMAL, DeviceErrors
from .faults import read_later
from .plan import exclusive_cumsum, send_plan
from .base import (Capabilities, CombineRequest, DispatchRequest, DispatchResult, KnownCounts,
                   LowLatencyCombineRequest, LowLatencyCombineResult, LowLatencyDispatchRequest,
                   LowLatencyDispatchResult, Transport, counts_to_device)


class _Done:
    """The finished work of a collective that needed none (a group of one rank)."""

    @staticmethod
    def wait() -> bool:
        return True


_DONE = _Done()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 2-D view of ``t``'s rows as uint8 (what travels; dtype-agnostic for NCCL and gloo)."""
    t = t if t.dim() == 2 else t.reshape(t.size(0), -1)
    if t.dtype != torch.uint8 and t.numel() == 0:  # an empty tensor may have any strides (e.g. 0): nothing to view
        return torch.empty(t.size(0), t.size(1) * t.element_size(), dtype=torch.uint8, device=t.device)
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _split_fused(recv: torch.Tensor, parts: list, views: list, first_in_place: bool) -> list:
    """The parts of received fused rows (``recv [rows, width]`` uint8: each row's parts side by side, as
    ``_fused_send`` sent ``parts``, whose byte views are ``views``), as fresh contiguous tensors of the parts' dtypes
    and widths; ``first_in_place``: the first part as a view of ``recv`` (rows of a wider stride)."""
    outs, col, rows = [], 0, recv.size(0)
    for i, (t, v) in enumerate(zip(parts, views)):
        width = v.size(1)
        if i == 0 and first_in_place and t.dim() == 2 and recv.size(1) % t.element_size() == 0:
            outs.append(columns_of_rows(recv, t.dtype, t.size(1)))
        else:
            outs.append(one_variant(recv[:, col:col + width]).view(t.dtype).view(rows, *t.shape[1:]))
        col += width
    return outs


def _side_by_side(parts: list) -> Optional[torch.Tensor]:
    """The ``[rows, bytes]`` uint8 rows of one buffer that ``parts`` (2-D, unit column stride) fill side by side, in
    order and without a gap between them (each row of the buffer is a row of every part, one after another, then at
    most 15 bytes of padding: rows of 16 bytes), or None where they do not (then they are copied side by side to be
    sent). The padding crosses with the rows."""
    first = parts[0]
    if any(t.dim() != 2 or t.size(0) != first.size(0) or (t.size(1) > 1 and t.stride(1) != 1) for t in parts):
        return None
    stride = first.stride(0) * first.element_size()
    at = first.data_ptr()
    for t in parts:
        if t.data_ptr() != at or (t.size(0) > 1 and t.stride(0) * t.element_size() != stride):
            return None
        at += t.size(1) * t.element_size()
    storage = first.untyped_storage()
    end = first.data_ptr() + first.size(0) * stride  # (the last row's padding must be in the buffer too)
    if (not 0 <= stride - (at - first.data_ptr()) < 16 or end > storage.data_ptr() + storage.nbytes()
            or any(t.untyped_storage().data_ptr() != storage.data_ptr() for t in parts)):
        return None
    return torch.as_strided(first.view(torch.uint8), (first.size(0), stride), (stride, 1))


def columns_of_rows(buf: torch.Tensor, dtype: torch.dtype, width: int, offset: int = 0) -> torch.Tensor:
    """``[rows, width]`` elements of ``dtype`` starting ``offset`` bytes into each row of ``buf`` (contiguous uint8
    rows whose width and ``offset`` are multiples of ``dtype``'s size): a view, its row stride stated rather than left
    to torch (a view of one row or none would report the row's width: another kernel variant than the calls with
    more rows)."""
    typed = buf.view(dtype)
    size = typed.element_size()
    return torch.as_strided(typed, (buf.size(0), width), (buf.size(1) // size, 1), offset // size)


def fused_width(widths) -> int:
    """Bytes of one fused row (``fuse_rows``) of parts ``widths`` bytes wide: side by side, padded to 16 (the pack
    kernel's vector stores want 16-byte rows). A function of the parts' widths alone, the same on every rank: a
    receiver sizes its rows by it whatever way its own rows were made; the pack and the hierarchical combine's send
    rows are made this wide, so that they are sent as they are."""
    return -(-sum(widths) // 16) * 16


def _fused_as_is(parts: list, views: list) -> Optional[torch.Tensor]:
    """The ``[rows, fused_width]`` uint8 rows of the buffer ``parts`` (their byte ``views``) already fill side by side
    (``_side_by_side``) where its rows are that wide, or None."""
    send = _side_by_side(parts)
    return send if send is not None and send.size(1) == fused_width(v.size(1) for v in views) else None


def _fused_send(parts: list, views: list) -> torch.Tensor:
    """The ``[rows, fused_width]`` uint8 rows that carry ``parts`` (their byte ``views``) side by side: the buffer they
    already fill (``_fused_as_is``, sent as it is), else a copy (zero padding)."""
    send = _fused_as_is(parts, views)
    if send is not None:
        return send
    pad = fused_width(v.size(1) for v in views) - sum(v.size(1) for v in views)
    return torch.cat(views + ([views[0].new_zeros(views[0].size(0), pad)] if pad else []), 1)


def reduce_rows(buf: torch.Tensor, slot: torch.Tensor, bias: tuple, out_dtype: torch.dtype) -> torch.Tensor:
    """Ordered reduction ``out[t] = sum_r float(buf[slot[t, r]]) + bias``, bit-identical on every device."""
    if buf.is_cuda and buf.size(1) >= 64 and triton_available():
        from ..kernels.reduce import reduce_rows as reduce_rows_triton

        return reduce_rows_triton(buf, slot, bias, out_dtype)
    n, num_slots = slot.shape
    acc = torch.zeros(n, buf.size(1), dtype=torch.float32, device=buf.device)
    if buf.size(0) > 0:
        for r in range(num_slots):
            s = slot[:, r].long()
            rows = buf.index_select(0, s.clamp(min=0)).float()
            acc += torch.where((s >= 0).unsqueeze(1), rows, torch.zeros((), device=buf.device))
    for b in bias:
        acc += b.float()
    return acc.to(out_dtype)


@dataclass(frozen=True)
class _NormalState:
    send_idx: torch.Tensor  # token of every row of the send area ([S] exact, [R * C] padded)
    send_counts: Optional[tuple]  # rows to each rank (exact mode)
    slot: torch.Tensor  # [N, R] int64: row of (token, rank) in the combine receive buffer, -1 if absent
    capacity: int  # padded mode: rows per peer (0 in exact mode)
    recv_dst: Optional[torch.Tensor]  # padded mode: [R * C] output row of every received slot (W = unused)
    num_rows: int = 0  # padded mode: W, the rows of the outputs
    pos: Optional[torch.Tensor] = None  # GPU path: [N, R] int32 index among this rank's tokens to r
    first: Optional[torch.Tensor] = None  # GPU path: [R] int32, minus the first send row of each rank


@dataclass(frozen=True)
class Ahead:
    """An exact-mode dispatch sent ahead of its counts (``AllToAllTransport.send_ahead``), until ``receive_ahead``."""
    req: DispatchRequest
    plan: "_Plan"
    capacity: int  # slots per destination
    recv: torch.Tensor  # [R * capacity, row bytes + record bytes (+ padding)] uint8: the slots as received, by source
    row_bytes: int  # of x's rows (the records follow them)
    record_bytes: int  # of the records (any padding after them)


@dataclass(frozen=True)
class _LowLatencyState:
    capacity: int  # rows per peer
    send_slot: torch.Tensor  # [N, K] int64 slot of each (token, k) in the send area, -1 if none
    recv_dst: torch.Tensor  # [R * C] int64 flat output row of each received slot (E_local*R*T = unused)


@dataclass(frozen=True)
class _Plan:
    """An exact-mode GPU dispatch between its plan kernel and its rows' all_to_all (``AllToAllTransport``)."""
    ctl: torch.Tensor  # int32: checks [4] | send table [R, 1 + E_local] | received table, read by the host once
    table: torch.Tensor  # [R, 1 + E_local] view of ctl
    recv_table: torch.Tensor  # [R, 1 + E_local] view of ctl
    pos: torch.Tensor  # [N, R] int32
    first: torch.Tensor  # [R] int32


class AllToAllTransport(Transport):
    """Dispatch/combine over ``all_to_all_single``; see the module docstring."""

    name = "alltoall"
    accepts_known_counts = True  # exact mode given the counts: no count all_to_all, no host read
    # one all_to_all per call for a dispatch's rows and records (and a combine's rows and weights), their bytes side
    # by side, instead of one each: a network round trip and a collective fewer, a local copy on each side more.
    # What an inter-domain leg wants (the hierarchical path sets it on its own); within a node the copies cost more
    fuse_rows = False
    # With fuse_rows: an exact-mode dispatch's received rows as a view of the landed rows (their records beside them,
    # a wider row stride), not copied out, for a caller whose consumer reads rows of any stride (the hierarchical
    # path's one-sided node leg); its records are still copied out
    rows_as_views = False
    # called (no arguments) right before each all_to_all of rows is issued, or None: a caller's benchmark marks when
    # its rows' collective is issued (the hierarchical path's phase log), not when the leg that issues it begins
    on_collective: Optional[Callable[[], None]] = None

    def __init__(self, group, device: torch.device, buffer_id: int) -> None:
        super().__init__(group, device, buffer_id)
        self._errors = torch.zeros(2, dtype=torch.int32, device=device)  # [worst-token overflow, LL overflow]
        self.errors = DeviceErrors(self._errors, ((0, 1, NORMAL), (1, 2, LOW_LATENCY)), self._describe_errors)
        self._zero_copy: dict = {}
        self._zero_bases: dict = {}
        self._slot_first: dict = {}  # send_ahead's minus first slot of each destination, by (ranks, capacity)
        self._pinned: dict = {}  # pinned host blocks for the dispatch's count read, by size
        self._no_rows = torch.empty(0, dtype=torch.int64, device=device)  # send_idx of the GPU path's handles
        # gloo moves CUDA tensors through the host: such a group (e.g. ranks that share a GPU) cannot be captured
        self._capturable = device.type != "cuda" or "nccl" in str(dist.get_backend(group)).lower()

    @classmethod
    def capabilities(cls) -> Capabilities:
        return Capabilities(
            name=cls.name, devices=("cpu", "cuda"), one_sided=False, sync_free_normal=True,
            graph_capturable_low_latency=True, needs_p2p=False, needs_p2p_atomics=False,
            description="torch.distributed all_to_all_single (NCCL or gloo); runs on any hardware")

    # ------------------------------------------------------------------ helpers
    def _a2a(self, out: torch.Tensor, inp: torch.Tensor, out_splits=None, in_splits=None, async_op=False):
        if self.on_collective is not None:
            self.on_collective()
        if self.num_ranks == 1:  # a group of one rank (a domain of one GPU): the all_to_all is a copy
            _as_bytes(out).copy_(_as_bytes(inp))
            return _DONE if async_op else None
        if not self._capturable and torch.cuda.is_current_stream_capturing():
            raise EpcommError(
                f"AllToAllTransport: rank {self.rank}'s group moves CUDA tensors with "
                f"{dist.get_backend(self.group)!r}, whose all_to_all cannot be captured in a CUDA graph; capture "
                f"with an NCCL group, or use a one-sided transport (transport='nvlink' or 'p2p')")
        return dist.all_to_all_single(_as_bytes(out), _as_bytes(inp), out_splits, in_splits, group=self.group,
                                      async_op=async_op)

    def _a2a_rows(self, parts: list, out_rows: int, out_splits: list, in_splits: list,
                  first_in_place: bool = False) -> list:
        """All-to-all of several tensors whose rows go to the same ranks (rows, their records or weights; split
        sizes in rows): one collective per tensor, or with ``fuse_rows`` one of their bytes side by side, then
        split (fresh contiguous tensors of the parts' dtypes and widths; ``first_in_place``: the first part as a
        view of the received rows, rows of a wider stride, for a reader that takes any row stride). On a group of
        one rank the parts are the received rows themselves (no collective and no copy: callers only read them)."""
        dev = parts[0].device
        if self.num_ranks == 1:  # one rank sends its rows to itself: they are the received rows (no copy)
            return [t.contiguous() for t in parts]  # (a copy only of a part that is a column slice)
        if not self.fuse_rows or len(parts) == 1:
            outs = []
            for t in parts:
                out = torch.empty(out_rows, *t.shape[1:], dtype=t.dtype, device=dev)
                self._a2a(out, t.contiguous(), out_splits, in_splits)
                outs.append(out)
            return outs
        views = [_as_bytes(t if t.stride(-1) == 1 else t.contiguous()) for t in parts]  # (cat reads strided rows)
        send = _fused_send(parts, views)
        recv = torch.empty(out_rows, send.size(1), dtype=torch.uint8, device=dev)
        self._a2a(recv, send, out_splits, in_splits)
        return _split_fused(recv, parts, views, first_in_place)

    @property
    def deferred_errors(self) -> torch.Tensor:
        return self._errors[:1]

    def _describe_errors(self, words: list) -> list:
        """``DeviceErrors.describe`` of ``_errors``."""
        overflow_worst, overflow_ll = words
        errors = []
        if overflow_worst:
            errors.append((NORMAL, f"rank {self.rank}: {overflow_worst} received rows did not fit num_worst_tokens "
                                   f"or had invalid expert ids; pass a num_worst_tokens at least the largest number "
                                   f"of tokens a rank can receive (of (token, local expert) pairs with "
                                   f"layout='expert_major'), ids in [-1, num_experts) and num_tokens_per_expert "
                                   f"of the same get_dispatch_layout"))
        if overflow_ll:
            errors.append((LOW_LATENCY, f"rank {self.rank}: {overflow_ll} low-latency rows did not fit their slots or "
                                        f"had invalid expert ids; expert ids within a token must be distinct, in "
                                        f"[-1, num_experts), and x.size(0) <= num_max_dispatch_tokens_per_rank"))
        return errors

    def memory_usage(self) -> dict:
        held = {"low_latency_zero_copy": sum(t.numel() * t.element_size() for t in self._zero_copy.values())}
        held["pinned_host"] = (super().memory_usage()["pinned_host"]
                               + sum(t.numel() * t.element_size() for t in self._pinned.values()))
        return held

    @staticmethod
    def _unpack_metadata(meta: torch.Tensor, x_scales, topk_idx, topk_weights):
        """Split received records into (src token, src rank, scales, local top-k ids, weights)."""
        col = 2
        recv_scales = recv_idx = recv_w = None
        if x_scales is not None:
            ns = x_scales.size(1)
            recv_scales = meta[:, col:col + ns].contiguous().view(x_scales.dtype)
            col += ns
        if topk_idx is not None:
            k = topk_idx.size(1)
            recv_idx = meta[:, col:col + k].to(torch.int64)
            col += k
            if topk_weights is not None:
                recv_w = meta[:, col:col + k].contiguous().view(torch.float32)
        return meta[:, 0], meta[:, 1], recv_scales, recv_idx, recv_w

    @staticmethod
    def _unpack_records(meta: torch.Tensor, req: DispatchRequest):
        """``_unpack_metadata`` with one kernel (GPU path): fresh contiguous outputs."""
        from ..kernels.ep import launch_unpack_records

        m, dev = meta.size(0), meta.device
        ns = req.x_scales.size(1) if req.x_scales is not None else 0
        k = req.topk_idx.size(1) if req.topk_idx is not None else 0
        src = torch.empty(m, 2, dtype=torch.int32, device=dev)
        scales = torch.empty(m, ns, dtype=req.x_scales.dtype, device=dev) if ns else None
        idx = torch.empty(m, k, dtype=torch.int64, device=dev) if k else None
        w = torch.empty(m, k, dtype=torch.float32, device=dev) if k and req.topk_weights is not None else None
        launch_unpack_records(meta, scales, idx, w, src, ns, k)
        return src[:, 0], src[:, 1], scales, idx, w

    # ------------------------------------------------------------------ normal mode
    def _raise_host_checks(self, error_words, bad_topk: int, bad_layout: int, num_experts: int) -> None:
        """Turn the checks a dispatch read at its host synchronisation into exceptions."""
        if any(error_words):
            for kind, message in self._describe_errors(list(error_words)):
                self.errors.record(kind, message)
            raise self.errors.error("Buffer.dispatch")
        raise_if_bad_routing("Buffer.dispatch", bad_topk, bad_layout, num_experts)

    def checks_topk(self, x: torch.Tensor, num_worst_tokens: int) -> bool:
        # the GPU path's plan kernel counts invalid ids and the host raises at the one synchronisation
        return not num_worst_tokens and self._gpu_path(x)

    def _gpu_path(self, t: torch.Tensor) -> bool:
        """Kernels instead of torch ops: on GPUs (and on CPUs under the Triton interpreter, for tests)."""
        return t.size(1) * t.element_size() % 4 == 0 and use_kernels(t)

    def dispatch(self, req: DispatchRequest) -> DispatchResult:
        if req.handle is not None:
            return self._cached_dispatch(req)
        if not req.num_worst_tokens and self._gpu_path(req.x):
            return self._dispatch_gpu(req)
        num_ranks, e_local = self.num_ranks, req.num_experts // self.num_ranks
        x, dev, itr = req.x, req.x.device, req.is_token_in_rank
        counts = torch.zeros(num_ranks, 1 + e_local, dtype=torch.int32, device=dev)
        counts[:, 0] = req.num_tokens_per_rank
        if req.num_tokens_per_expert is not None:
            counts[:, 1:] = req.num_tokens_per_expert.view(num_ranks, e_local)
        capacity = req.peer_capacity or req.num_worst_tokens  # padded mode: slots per peer
        if req.known is not None and not capacity:
            return self._dispatch_known(req, counts)
        recv_counts = torch.empty_like(counts)
        self._a2a(recv_counts, counts)
        recv_per_expert = recv_counts[:, 1:].sum(0, dtype=torch.int32)
        # everything that needs no host value is enqueued before the one synchronisation below
        slot, send_idx, meta, _ = send_plan(req, counts, capacity, self.rank, self.num_ranks, self._errors)
        if capacity:
            return self._padded_dispatch(req, recv_counts, recv_per_expert, slot, send_idx, meta)

        zero = torch.zeros((), dtype=torch.int32, device=dev)
        checks = torch.stack([req.bad_topk if req.bad_topk is not None else zero,
                              (itr.sum(0, dtype=torch.int32) != counts[:, 0]).sum(dtype=torch.int32)])
        host = self._read_later(torch.cat([counts[:, 0], recv_counts[:, 0], recv_per_expert, checks,
                                           self._errors]))()  # one bounded host read
        send_counts = host[:num_ranks]
        recv_counts_h = host[num_ranks:2 * num_ranks]
        per_expert = host[2 * num_ranks:2 * num_ranks + e_local]
        bad_topk, bad_layout = host[2 * num_ranks + e_local:2 * num_ranks + e_local + 2]
        self._raise_host_checks(host[-2:], bad_topk, bad_layout, req.num_experts)
        num_send = sum(send_counts)
        send_idx = send_idx[:num_send]

        state = _NormalState(send_idx=send_idx, send_counts=tuple(send_counts), slot=slot, capacity=0, recv_dst=None)
        return self._exchange_rows(req, _as_bytes(x).index_select(0, send_idx), meta[:num_send], send_counts,
                                   recv_counts_h, lambda: (per_expert, recv_per_expert), state)

    def _dispatch_known(self, req: DispatchRequest, counts: torch.Tensor) -> DispatchResult:
        """Exact mode with the counts known beforehand (``req.known``), on the torch path: no count exchange and no
        host synchronisation."""
        slot, send_idx, meta, _ = send_plan(req, counts, 0, self.rank, self.num_ranks, self._errors)
        send_idx = send_idx[:sum(req.known.num_tokens_per_rank)]
        state = _NormalState(send_idx=send_idx, send_counts=tuple(req.known.num_tokens_per_rank), slot=slot,
                             capacity=0, recv_dst=None)
        return self._exchange_known(req, _as_bytes(req.x).index_select(0, send_idx), meta, state)

    def _exchange_known(self, req: DispatchRequest, rows: torch.Tensor, records: torch.Tensor,
                        state: "_NormalState") -> DispatchResult:
        """``_exchange_rows`` of the first ``sum(req.known.num_tokens_per_rank)`` packed rows and records, with the
        counts known beforehand (``req.known``)."""
        known = req.known
        num_send = sum(known.num_tokens_per_rank)
        return self._exchange_rows(req, rows[:num_send], records[:num_send], list(known.num_tokens_per_rank),
                                   list(known.num_recv_tokens_per_rank), self._known_expert_counts(known), state)

    def _known_expert_counts(self, known: KnownCounts):
        """``expert_counts`` of ``_received`` for counts known beforehand: the per-expert list, and its tensor (the
        caller's, where it has one on the device; else copied)."""
        per_expert = list(known.num_recv_tokens_per_expert)
        return lambda: (per_expert, counts_to_device(per_expert, self.device)
                        if known.recv_per_expert_tensor is None else known.recv_per_expert_tensor)

    def _exchange_rows(self, req: DispatchRequest, rows: torch.Tensor, records: torch.Tensor, send_counts: list,
                       recv_counts: list, expert_counts, state: "_NormalState") -> DispatchResult:
        """Exact mode, after the host synchronisation: move the packed rows and records, unpack, build the
        handle. ``rows``/``records`` are in send order (destination rank, then token). ``expert_counts()``
        returns ``(per_expert list, recv_per_expert [E_local] int32 tensor)``; it runs once the rows are on
        their way (the call is host-bound until the rows' all_to_all is issued)."""
        num_recv = sum(recv_counts)
        recv_x, recv_meta = self._a2a_rows([rows, records], num_recv, recv_counts, send_counts,
                                           first_in_place=self.rows_as_views)
        return self._received(req, recv_x, recv_meta, send_counts, recv_counts, expert_counts, state)

    def _received(self, req: DispatchRequest, recv_x: torch.Tensor, recv_meta: torch.Tensor, send_counts: list,
                  recv_counts: list, expert_counts, state: "_NormalState") -> DispatchResult:
        """An exact-mode dispatch's result from its received rows (``recv_x``: contiguous rows of any dtype of the right
        row bytes, or with ``rows_as_views`` a view of wider rows) and records (``recv_meta`` int32), in source order
        (``_exchange_rows``)."""
        x = req.x
        num_recv = sum(recv_counts)
        recv_x = recv_x.view(x.dtype)
        if tuple(recv_x.shape) != (num_recv, x.size(1)):  # (a view of one row would lose its stated row stride)
            recv_x = recv_x.view(num_recv, x.size(1))
        per_expert, recv_per_expert = expert_counts()
        if self._gpu_path(x):  # one kernel instead of a torch op per field
            recv_src_idx, recv_src_rank, recv_scales, recv_idx, recv_w = self._unpack_records(recv_meta, req)
        else:
            recv_src_idx, recv_src_rank, recv_scales, recv_idx, recv_w = self._unpack_metadata(
                recv_meta, req.x_scales, req.topk_idx, req.topk_weights)
        handle = self._exact_handle((req.num_experts, x.size(0), x.size(1), req.is_token_in_rank), send_counts,
                                    recv_counts, recv_per_expert, recv_src_rank, recv_src_idx, state)
        per_expert_list = (align_all(per_expert, req.expert_alignment)
                           if req.num_tokens_per_expert is not None else [])
        return DispatchResult(recv_x, recv_scales, recv_idx, recv_w, per_expert_list, handle)

    def _pack(self, x, scales, topk_idx, topk_weights, itr, pos, first, num_experts, num_rows=None, fused=False):
        """GPU path: rows and records of every (token, destination) pair, in send order, with one kernel
        (the one-sided push kernel in local mode). Returns ``(rows [S, XW] int32, records [S, W])``: ``S`` is
        ``num_rows`` (the pairs, when the host knows their number) or ``N * R`` (room for any routing). ``fused``:
        both are views of one buffer's rows, a row's words then its record's, padded to 16 bytes (what ``fuse_rows``
        sends as it is: ``_side_by_side``)."""
        from ..kernels.ep import launch_push, record_words
        from ..kernels.shmem import num_sms

        n, num_ranks = itr.shape
        xw = x.size(1) * x.element_size() // 4
        ns = scales.size(1) if scales is not None else 0
        k = topk_idx.size(1) if topk_idx is not None else 0
        num_rows = n * num_ranks if num_rows is None else num_rows
        mw = record_words(ns, k, topk_weights is not None)
        # (at least one row allocated, whose address the kernel takes as an integer: an empty tensor's address is 0,
        # a 32-bit argument, so another variant of the kernel, compiled and loaded in the middle of a call)
        if fused:
            width = fused_width((xw * 4, mw * 4)) // 4  # (in words)
            both = torch.empty(max(num_rows, 1), width, dtype=torch.int32, device=x.device)
            rows, recs = both[:, :xw], both[:, xw:xw + mw]
        else:
            width = 0
            rows = torch.empty(max(num_rows, 1), xw, dtype=torch.int32, device=x.device)
            recs = torch.empty(max(num_rows, 1), mw, dtype=torch.int32, device=x.device)
        # every "destination" base is 0 and the offsets are the local buffers' addresses: no per-call table
        zero_bases = self._zero_bases.get(num_ranks)
        if zero_bases is None:
            zero_bases = self._zero_bases[num_ranks] = torch.zeros(num_ranks, dtype=torch.int64, device=x.device)
        launch_push(x=x, scales=scales, topk_idx=topk_idx, topk_weights=topk_weights, itr=itr, pos=pos, first=first,
                    rows=first, bases=zero_bases, area_off=rows.data_ptr(), meta_off=recs.data_ptr(), hdr_off=0,
                    arrive_off=0, epoch=self._errors, counter=self._errors, t_begin=0, t_end=n, cap=0, rank=self.rank,
                    world=num_ranks, num_experts=num_experts, grid=max(1, min(num_sms(x.device) * 4, -(-n // 4))),
                    tokens_per_step=4, use_ptx=x.is_cuda, single_round=False, publish=False, dummy=self._errors,
                    row_words=width)
        return rows[:num_rows], recs[:num_rows]

    def _dispatch_gpu(self, req: DispatchRequest) -> DispatchResult:
        """Exact-mode dispatch on GPUs: a plan kernel (positions, checks, count table), the count all_to_all,
        a pack kernel, one host synchronisation, then the rows and records all_to_alls."""
        if req.known is not None:  # no count exchange, no host read (the plan kernel's checks are not read)
            plan, packed = (req.prepared or self.prepare(req))[:2]
            return self._exchange_known(req, *packed, self._gpu_state(plan, req.known.num_tokens_per_rank))
        plan = self._plan_gpu(req, None)
        self._a2a(plan.recv_table, plan.table)
        read = self._read_later(plan.ctl)  # the host waits for the counts only, not for the pack kernel below
        packed = self._pack_plan(req, plan)
        host = read()
        self._check_plan(req, host)
        return self._finish_gpu(req, plan, packed, host)

    def prepare(self, req: DispatchRequest):
        """``Transport.prepare``: on the GPU path, ``(plan, (rows, records), fused)`` of the plan and pack kernels,
        which read this rank's routing only; ``fused``: with ``fuse_rows``, the packed rows beside their records as
        one collective sends them (``_fused_as_is``: views, made here while the counts travel rather than per call
        after them), or None where they are not side by side (``dispatch_into`` then fuses the rows it sends)."""
        if req.handle is not None or req.num_worst_tokens or req.peer_capacity or not self._gpu_path(req.x):
            return None
        plan = self._plan_gpu(req, None)
        rows, recs = self._pack_plan(req, plan)
        return plan, (rows, recs), (_fused_as_is([rows, recs], [_as_bytes(rows), _as_bytes(recs)])
                                    if self.fuse_rows else None)

    def dispatch_into(self, req: DispatchRequest, sends: list, recvs: list,
                      out: torch.Tensor) -> Callable[[tuple, torch.Tensor], DispatchHandle]:
        """An exact-mode GPU-path dispatch whose counts the caller knows, ``sends`` and ``recvs`` (rows to and from each
        rank, host lists), and whose local work is prepared (``req.prepared``, ``prepare``): its one collective lands
        its rows beside their records, as ``fuse_rows`` sends them (``[rows, fused_width]`` uint8: the row's bytes,
        then its record, ``record_words`` layout, then padding), into ``out`` (contiguous rows, e.g. one chunk's of a
        caller's buffer), where the caller reads them: nothing is unpacked. Nothing but the collective and a slice is
        done before it is issued (a caller's host lead to its first rows' collective). Returns a function of
        ``(recv_src, recv_per_expert)`` that makes the dispatch's handle (when first asked: a combine's or cached
        dispatch's host work, which a step hides, not this call's): its ``recv_src_rank`` / ``recv_src_idx`` are the
        caller's ``recv_src`` (what it will unpack of the records), its per-expert counts ``recv_per_expert``
        (``[E_local]`` int32 on the device)."""
        if req.prepared is None:
            raise ValueError("AllToAllTransport.dispatch_into: an exact-mode GPU-path dispatch whose local work is "
                             "prepared (req.prepared from AllToAllTransport.prepare)")
        plan, (rows, recs), fused = req.prepared
        n = sum(sends)
        self._a2a(out, fused[:n] if fused is not None else _fused_send(
            [rows[:n], recs[:n]], [_as_bytes(rows[:n]), _as_bytes(recs[:n])]), recvs, sends)
        # (the function keeps what the handle needs of ``req``, not ``req``: its packed rows, ``prepared``, would live
        # as long as the handle is not made, until the combine)
        shape = (req.num_experts, req.x.size(0), req.x.size(1), req.is_token_in_rank)
        return lambda recv_src, recv_per_expert: self._exact_handle(shape, sends, recvs, recv_per_expert, *recv_src,
                                                                    self._gpu_state(plan, sends))

    def landed_result(self, req: DispatchRequest, out: torch.Tensor) -> DispatchResult:
        """The result of the dispatch whose rows ``dispatch_into`` landed in ``out`` (``req`` with its counts known,
        ``req.known``, and prepared), unpacked on the current stream (which waits for them to land) as ``dispatch``
        of ``req`` would have made it: the same rows, records and handle."""
        known = req.known
        plan, (rows, recs), _ = req.prepared
        sends, recvs = list(known.num_tokens_per_rank), list(known.num_recv_tokens_per_rank)
        recv_x, recv_meta = _split_fused(out, [rows, recs], [_as_bytes(rows), _as_bytes(recs)], self.rows_as_views)
        return self._received(req, recv_x, recv_meta, sends, recvs, self._known_expert_counts(known),
                              self._gpu_state(plan, sends))

    def _exact_handle(self, shape: tuple, sends: list, recvs: list, recv_per_expert: torch.Tensor,
                      recv_src_rank: torch.Tensor, recv_src_idx: torch.Tensor, state: "_NormalState") -> DispatchHandle:
        """The handle of an exact-mode dispatch that sent ``sends`` and received ``recvs`` rows per rank; ``shape``:
        its request's ``(num_experts, tokens, hidden, is_token_in_rank)``."""
        num_experts, num_tokens, hidden, itr = shape
        return DispatchHandle(
            buffer_id=self.buffer_id, transport=self.name, num_ranks=self.num_ranks, num_experts=num_experts,
            num_tokens=num_tokens, hidden=hidden, is_token_in_rank=itr,
            num_tokens_per_rank=tuple(sends), num_recv_tokens=sum(recvs), num_recv_tokens_per_rank=tuple(recvs),
            num_recv_tokens_per_expert=recv_per_expert, recv_src_rank=recv_src_rank, recv_src_idx=recv_src_idx,
            state=state)

    def can_send_ahead(self, x: torch.Tensor) -> bool:
        """Whether ``send_ahead`` takes dispatches of ``x`` (the GPU path's kernels run on its device)."""
        return self._gpu_path(x)

    def send_ahead(self, req: DispatchRequest, capacity: int) -> "Ahead":
        """An exact-mode dispatch whose rows leave before its counts are known (GPU path): the plan and pack kernels
        put each destination's rows and records in ``capacity`` fixed slots (``capacity >= x.size(0)``: every rank
        passes the same), and one all_to_all of equal splits is issued now, with no count exchange and no host read.
        ``receive_ahead`` makes its result once the counts are known; the slots that hold no row cross as padding.
        Raises ValueError for a request this does not take."""
        n, num_ranks = req.x.size(0), self.num_ranks
        if (req.handle is not None or req.num_worst_tokens or req.peer_capacity or req.topk_idx is None
                or not self._gpu_path(req.x) or not n <= capacity):
            raise ValueError(f"AllToAllTransport.send_ahead: an exact-mode GPU-path dispatch with top-k ids and at "
                             f"most capacity={capacity} tokens; got {n} tokens (handle, num_worst_tokens or "
                             f"peer_capacity given: {req.handle is not None}, {req.num_worst_tokens}, "
                             f"{req.peer_capacity})")
        plan = self._plan_gpu(req, None)
        slots = self._slot_first.get((num_ranks, capacity))
        if slots is None:  # destination r's rows start at slot r * capacity (the pack writes pos - first[r])
            slots = self._slot_first[(num_ranks, capacity)] = -capacity * torch.arange(
                num_ranks, dtype=torch.int32, device=req.x.device)
        rows, recs = self._pack_plan(req, plan, slots, num_ranks * capacity)
        # (slots no row fills hold what was there; rows packed beside their records are sent as they are)
        send = _fused_send([rows, recs], [_as_bytes(rows), _as_bytes(recs)])
        recv = torch.empty_like(send)
        self._a2a(recv, send)
        return Ahead(req, plan, capacity, recv, rows.size(1) * 4, recs.size(1) * 4)

    def receive_ahead(self, ahead: "Ahead", known: KnownCounts) -> DispatchResult:
        """The result of ``send_ahead``'s dispatch, given its counts (``known``, as ``DispatchRequest.known``): the
        rows each source filled of its slots, side by side, exactly what ``dispatch`` with those counts returns
        (the same rows, records and handle)."""
        cap, rb, recv = ahead.capacity, ahead.row_bytes, ahead.recv
        end = rb + ahead.record_bytes
        recv_counts = list(known.num_recv_tokens_per_rank)
        filled = [(s * cap, c) for s, c in enumerate(recv_counts) if c]

        def columns(lo: int, hi: int) -> torch.Tensor:  # one copy: the filled rows' columns [lo, hi)
            # (none filled: a fresh tensor too, not a view of no rows, whose row stride would be the slots' width: the
            # kernels the rows go to take the row stride for a variant of its own)
            return (torch.cat([recv[a:a + c, lo:hi] for a, c in filled]) if filled
                    else recv.new_empty(0, hi - lo))

        if self.rows_as_views:  # the filled rows whole, once; the rows a view of them (the row stride stated), as
            # ``_exchange_rows`` gives them: the same kernel variant downstream whether a chunk was sent ahead or not
            whole = columns(0, recv.size(1))
            rows = columns_of_rows(whole, torch.uint8, rb)
            records = one_variant(whole[:, rb:end])
        else:
            rows, records = columns(0, rb), columns(rb, end)
        return self._received(ahead.req, rows, records.view(torch.int32),
                              list(known.num_tokens_per_rank), recv_counts, self._known_expert_counts(known),
                              self._gpu_state(ahead.plan, known.num_tokens_per_rank))

    def dispatch_many(self, reqs: list):
        """``dispatch`` of each request in turn (a generator that yields each result once its collectives are
        issued: an event recorded then marks that request's end). Exact-mode requests on the GPU path share one count
        all_to_all and one host synchronisation (a pipelined caller's network stream never idles between them,
        waiting for the host); other requests are dispatched one after another."""
        if len(reqs) < 2 or not all(r.handle is None and not r.num_worst_tokens and not r.peer_capacity
                                    and r.known is None and self._gpu_path(r.x) for r in reqs):
            for r in reqs:
                yield self.dispatch(r)
            return
        e_local = reqs[0].num_experts // self.num_ranks
        if any(r.num_experts != reqs[0].num_experts for r in reqs):
            raise ValueError("AllToAllTransport.dispatch_many: the requests must have the same num_experts")
        width = 4 + 2 * self.num_ranks * (1 + e_local)
        ctl = torch.zeros(len(reqs), width, dtype=torch.int32, device=reqs[0].x.device)
        plans = [self._plan_gpu(r, ctl[c]) for c, r in enumerate(reqs)]
        tw = self.num_ranks * (1 + e_local)
        send = ctl[:, 4:4 + tw].view(len(reqs), self.num_ranks, 1 + e_local).transpose(0, 1).contiguous()
        recv = torch.empty_like(send)  # [source rank, request, 1 + E_local]
        self._a2a(recv, send)
        ctl[:, 4 + tw:].view(len(reqs), self.num_ranks, 1 + e_local).copy_(recv.transpose(0, 1))
        read = self._read_later(ctl.view(-1))
        packed = [self._pack_plan(r, plan) for r, plan in zip(reqs, plans)]
        host = read()
        hosts = [host[c * width:(c + 1) * width] for c in range(len(reqs))]
        for r, h in zip(reqs, hosts):  # every request's checks before any row moves
            self._check_plan(r, h)
        for r, plan, rows, h in zip(reqs, plans, packed, hosts):  # each result once its collectives are issued
            yield self._finish_gpu(r, plan, rows, h)

    def _plan_gpu(self, req: DispatchRequest, ctl: Optional[torch.Tensor]) -> "_Plan":
        """The plan kernel of an exact-mode GPU dispatch: positions, checks and the count table, in ``ctl`` (one
        int32 block the host reads: checks [4] | send table [R, 1 + E_local] | received table; a fresh one when
        None)."""
        from ..kernels.ep import plan_kernel, pow2_block
        from ..kernels.launch import launch, next_pow2

        num_ranks, e_local = self.num_ranks, req.num_experts // self.num_ranks
        x, dev, itr = req.x, req.x.device, req.is_token_in_rank
        n = x.size(0)
        k = req.topk_idx.size(1) if req.topk_idx is not None else 0
        has_experts = req.num_tokens_per_expert is not None
        tw = num_ranks * (1 + e_local)
        pos = torch.empty(n, num_ranks, dtype=torch.int32, device=dev)
        if ctl is None:
            ctl = (torch.empty if has_experts else torch.zeros)(4 + 2 * tw, dtype=torch.int32, device=dev)
        checks, table, recv_table = ctl[:4], ctl[4:4 + tw].view(num_ranks, -1), ctl[4 + tw:].view(num_ranks, -1)
        first = torch.empty(num_ranks, dtype=torch.int32, device=dev)
        launch(plan_kernel, (1,), req.num_tokens_per_rank, req.num_tokens_per_expert if has_experts else checks,
               itr.view(torch.int8), req.topk_idx if k else checks, pos, table, first, checks, self._errors,
               n, req.num_experts, E_LOCAL=e_local, K=max(k, 1), R=num_ranks,
               R_POW2=max(2, next_pow2(num_ranks)), HAS_EXPERTS=has_experts, HAS_TOPK=k > 0,
               BLOCK_T=256, BLOCK_E=pow2_block(e_local), BLOCK_K=pow2_block(k))
        return _Plan(ctl, table, recv_table, pos, first)

    def _pack_plan(self, req: DispatchRequest, plan: "_Plan", first: Optional[torch.Tensor] = None,
                   num_rows: Optional[int] = None) -> tuple:
        """``(rows, records)`` of every (token, destination) pair of ``req`` (``_pack``), in the plan's positions
        (``first``: minus each destination's first row, the plan's when None; ``num_rows``: as ``_pack``)."""
        return self._pack(req.x, req.x_scales, req.topk_idx, req.topk_weights, req.is_token_in_rank, plan.pos,
                          plan.first if first is None else first, req.num_experts, num_rows, fused=self.fuse_rows)

    def _check_plan(self, req: DispatchRequest, host: list) -> None:
        bad_layout, bad_topk = host[:2]
        self._raise_host_checks(host[2:4], bad_topk, bad_layout, req.num_experts)

    def _finish_gpu(self, req: DispatchRequest, plan: "_Plan", packed: tuple, host: list) -> DispatchResult:
        """After the host read ``host`` (``plan.ctl`` as a list): the all_to_alls of the packed rows and records."""
        num_ranks, e_local = self.num_ranks, req.num_experts // self.num_ranks
        tw = num_ranks * (1 + e_local)
        send_counts = host[4:4 + tw:1 + e_local]
        recv_table_h = host[4 + tw:]
        num_send = sum(send_counts)
        state = self._gpu_state(plan, send_counts)
        recv_table = plan.recv_table

        def expert_counts():
            per_expert = [sum(recv_table_h[s * (1 + e_local) + 1 + e] for s in range(num_ranks))
                          for e in range(e_local)]
            return per_expert, recv_table[:, 1:].sum(0, dtype=torch.int32)

        rows, recs = packed
        return self._exchange_rows(req, rows[:num_send], recs[:num_send], send_counts,
                                   recv_table_h[::1 + e_local], expert_counts, state)

    def _gpu_state(self, plan: "_Plan", send_counts) -> "_NormalState":
        return _NormalState(send_idx=self._no_rows, send_counts=tuple(send_counts), slot=None, capacity=0,
                            recv_dst=None, pos=plan.pos, first=plan.first)

    def _read_later(self, t: torch.Tensor):
        """Start copying the int32 tensor ``t`` (a dispatch's counts) to the host; returns a function that waits for
        that copy (not for work enqueued after it) and returns ``t`` as a list. On CPUs the copy happens at the call.
        The wait is bounded (``faults.host_wait``): ``EPCOMM_TIMEOUT_S`` after this call it raises ``WaitExpired``
        naming the count exchange and this group's ranks (the collective stays pending: a transport that owns the
        group aborts it)."""
        return read_later(t, "Buffer.dispatch", lambda: f"rank {self.rank}: the count exchange with ranks "
                                                         f"{dist.get_process_group_ranks(self.group)}", self._pinned)

    def _cached_dispatch(self, req: DispatchRequest) -> DispatchResult:
        h = req.handle
        st: _NormalState = h.state
        if st.pos is not None:  # GPU path: pack again (exactly the rows that go), then one all_to_all per tensor
            num_send = sum(st.send_counts)
            rows, recs = self._pack(req.x, req.x_scales, None, None, h.is_token_in_rank, st.pos, st.first,
                                    h.num_experts, num_send)
            # the scales alone of each record (its other words are the handle's already)
            parts = [rows[:num_send]] + ([recs[:num_send, 2:2 + req.x_scales.size(1)]]
                                         if req.x_scales is not None else [])
            got = self._a2a_rows(parts, h.num_recv_tokens, list(h.num_recv_tokens_per_rank), list(st.send_counts))
            recv_x = got[0].view(req.x.dtype).view(h.num_recv_tokens, req.x.size(1))
            recv_scales = got[1].view(req.x_scales.dtype) if req.x_scales is not None else None
            return DispatchResult(recv_x, recv_scales, None, None, None, h)
        present = [t for t in (req.x, req.x_scales) if t is not None]
        if st.capacity:
            recv = [self._padded_rows(t, st) for t in present]
        else:
            got = self._a2a_rows([_as_bytes(t.contiguous()).index_select(0, st.send_idx) for t in present],
                                 h.num_recv_tokens, list(h.num_recv_tokens_per_rank), list(st.send_counts))
            recv = [g.view(t.dtype).view(h.num_recv_tokens, t.size(1)) for g, t in zip(got, present)]
        return DispatchResult(recv[0], recv[1] if len(recv) > 1 else None, None, None, None, h)

    def merge_cached(self, handles: list, bounds: list) -> tuple:
        """What ``cached_rows_many`` needs to pack the rows of several exact-mode dispatches' ``handles`` (chunks of one
        x, tokens ``bounds[c] = (first, end)``, one after another from 0) at once: ``(send rows per chunk, how to pack,
        the handles)``. Each chunk's send rows follow the previous chunk's, in the order its own dispatch sends
        them."""
        sends = [sum(h.state.send_counts) for h in handles]
        offsets = [sum(sends[:c]) for c in range(len(sends))]
        states = [h.state for h in handles]
        if all(st.pos is not None for st in states):  # GPU path: one pack kernel, each chunk's rows at its offset
            pos = torch.cat([st.pos - st.first + off for st, off in zip(states, offsets)])
            how = (torch.cat([h.is_token_in_rank for h in handles]), pos, torch.zeros_like(states[0].first))
        else:
            how = torch.cat([st.send_idx + a for st, (a, _) in zip(states, bounds)])
        return tuple(sends), how, handles

    def cached_rows_many(self, x: torch.Tensor, merged: tuple, outs: list):
        """Cached exact-mode dispatches of the rows of ``x`` (no scales; the chunks of ``merge_cached``), each chunk's
        received rows into ``outs[c]`` (``[rows, row bytes]``, contiguous): one pack (or gather) for all chunks, then
        one all_to_all per chunk; a generator that yields once each chunk's collective is issued."""
        sends, how, handles = merged
        if isinstance(how, tuple):
            itr, pos, first = how
            send = self._pack(x, None, None, None, itr, pos, first, handles[0].num_experts, sum(sends))[0]
        else:
            send = _as_bytes(x.contiguous()).index_select(0, how)
        at = 0
        for h, n, out in zip(handles, sends, outs):
            self._a2a(out, send[at:at + n], list(h.num_recv_tokens_per_rank), list(h.state.send_counts))
            at += n
            yield

    def _padded_dispatch(self, req: DispatchRequest, recv_counts: torch.Tensor, recv_per_expert: torch.Tensor,
                         slot: torch.Tensor, send_idx: torch.Tensor, meta: torch.Tensor) -> DispatchResult:
        """``num_worst_tokens`` mode: fixed ``C`` rows per peer (``peer_capacity``, else ``W``), compacted on the
        receiver into ``W`` rows; no host sync."""
        num_ranks, cap, x = self.num_ranks, req.peer_capacity or req.num_worst_tokens, req.x
        num_out = req.num_worst_tokens
        dev = x.device
        if req.bad_topk is not None:
            self._errors[0] += req.bad_topk  # reported at the next check
        # receiver side: row j from source s lands at prefix[s] + j when j < count[s]
        count = recv_counts[:, 0].long()
        prefix = exclusive_cumsum(count, 0)
        j = torch.arange(cap, device=dev)
        out_row = prefix.unsqueeze(1) + j
        arrived = j < count.unsqueeze(1)
        valid = arrived & (out_row < num_out)
        self._errors[0] += (arrived & ~valid).sum(dtype=torch.int32)
        recv_dst = torch.where(valid, out_row, num_out).flatten()  # [R * C]; W = discard row
        state = _NormalState(send_idx=send_idx, send_counts=None, slot=slot, capacity=cap, recv_dst=recv_dst,
                             num_rows=num_out)
        recv_x = self._padded_rows(x, state)
        recv_scales = self._padded_rows(req.x_scales, state) if req.x_scales is not None else None
        recv_meta = torch.empty(num_ranks * cap, meta.size(1), dtype=torch.int32, device=dev)
        self._a2a(recv_meta, meta)
        fill = torch.zeros(1, meta.size(1), dtype=torch.int32, device=dev)
        fill[0, :2] = -1  # rows nothing lands on: source -1, top-k ids -1, weights 0
        k = req.topk_idx.size(1) if req.topk_idx is not None else 0
        first_idx = 2 + (req.x_scales.size(1) if req.x_scales is not None else 0)
        fill[0, first_idx:first_idx + k] = -1
        recv_meta = _scatter_rows(recv_meta, recv_dst, num_out, fill)
        recv_src_idx, recv_src_rank, _, recv_idx, recv_w = self._unpack_metadata(
            recv_meta, req.x_scales, req.topk_idx, req.topk_weights)
        handle = DispatchHandle(
            buffer_id=self.buffer_id, transport=self.name, num_ranks=num_ranks, num_experts=req.num_experts,
            num_tokens=x.size(0), hidden=x.size(1), is_token_in_rank=req.is_token_in_rank, num_tokens_per_rank=None,
            num_recv_tokens=num_out, num_recv_tokens_per_rank=None, num_recv_tokens_per_expert=recv_per_expert,
            recv_src_rank=recv_src_rank, recv_src_idx=recv_src_idx, num_worst_tokens=num_out, state=state)
        return DispatchResult(recv_x, recv_scales, recv_idx, recv_w, [], handle)

    def _padded_rows(self, t: torch.Tensor, st: "_NormalState") -> torch.Tensor:
        """Move rows of ``t`` through fixed ``C`` slots per peer and compact them into ``[W, ...]``."""
        rows = _as_bytes(t.contiguous())  # shuffles run on bytes: index ops lack some dtypes (FP8)
        recv = torch.empty(self.num_ranks * st.capacity, rows.size(1), dtype=torch.uint8, device=t.device)
        send = rows.index_select(0, st.send_idx) if rows.size(0) else torch.empty_like(recv)  # no tokens: all padding
        self._a2a(recv, send)
        return _scatter_rows(recv, st.recv_dst, st.num_rows, None).view(t.dtype)

    def combine(self, req: CombineRequest) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        h: DispatchHandle = req.handle
        st: _NormalState = h.state
        x, dev, num_ranks = req.x, req.x.device, self.num_ranks
        parts = [x] + ([req.topk_weights] if req.topk_weights is not None else [])
        if st.capacity:
            back = []
            gather = torch.where(st.recv_dst < st.num_rows, st.recv_dst, 0)  # padded: row j of peer s goes back to
            for t in parts:  # slot j of s
                send = t.index_select(0, gather) if t.size(0) else torch.zeros(
                    num_ranks * st.capacity, t.size(1), dtype=t.dtype, device=dev)
                recv = torch.empty(num_ranks * st.capacity, t.size(1), dtype=t.dtype, device=dev)
                self._a2a(recv, send)
                back.append(recv)
        else:  # (the sum reads the returned rows where they landed, with their row stride)
            back = self._a2a_rows(parts, sum(st.send_counts), list(st.send_counts), list(h.num_recv_tokens_per_rank),
                                  first_in_place=True)
        if st.pos is not None:  # GPU path: one kernel reduces rows and weights, slots from the layout
            from ..kernels.reduce import reduce_from_layout

            n = h.num_tokens
            combined = torch.empty(n, x.size(1), dtype=x.dtype, device=dev)
            combined_w = torch.empty(n, back[1].size(1), dtype=torch.float32, device=dev) if len(back) > 1 else None
            reduce_from_layout(back[0], h.is_token_in_rank, st.pos, 0, 0, n, req.bias, combined, st.first,
                               back[1] if len(back) > 1 else None, combined_w)
            return combined, combined_w
        combined = reduce_rows(back[0], st.slot, req.bias, x.dtype)
        combined_w = reduce_rows(back[1], st.slot, (), torch.float32) if len(back) > 1 else None
        return combined, combined_w

    # ------------------------------------------------------------------ low-latency mode
    def low_latency_dispatch(self, req: LowLatencyDispatchRequest) -> LowLatencyDispatchResult:
        num_ranks, num_experts = self.num_ranks, req.num_experts
        e_local, t_max = num_experts // num_ranks, req.num_max_dispatch_tokens_per_rank
        x, dev = req.x, req.x.device
        n, hidden = x.shape
        k = req.topk_idx.size(1)
        cap = low_latency_pair_capacity(t_max, k, e_local)
        num_rows = e_local * num_ranks * t_max

        # the row each token sends: payload bytes | scales bytes | source token (int32)
        tokens = torch.arange(n, dtype=torch.int32, device=dev)
        if req.x_scales is not None:  # pre-cast: moved as they are
            check_precast("Buffer.low_latency_dispatch", x, req.x_scales, req.use_fp8)
        if req.use_fp8:
            x_fp8, scales = ((x, pack_ue8m0(req.x_scales) if req.use_ue8m0 else req.x_scales)
                             if req.x_scales is not None else per_token_cast_to_fp8(x, req.round_scale, req.use_ue8m0))
            parts = [_as_bytes(x_fp8), _as_bytes(scales), _as_bytes(tokens.unsqueeze(1))]
        else:
            scales = None
            parts = [_as_bytes(x), _as_bytes(tokens.unsqueeze(1))]
        token_rows = torch.cat(parts, dim=1)
        row_bytes = token_rows.size(1)

        # order (token, slot) pairs by (global expert, token): destination-major, then expert, then token
        idx = req.topk_idx.long()
        valid = (idx >= 0) & (idx < num_experts)
        if req.bad_topk is not None:
            self._errors[1] += req.bad_topk
        flat = torch.arange(n * k, device=dev)
        key = torch.where(valid, idx * max(n, 1) + flat.view(n, k) // k, num_experts * max(n, 1) + flat.view(n, k))
        order = torch.sort(key.flatten(), stable=True).indices
        g_sorted = torch.where(valid, idx, num_experts).flatten()[order]
        per_expert = torch.zeros(num_experts + 1, dtype=torch.int32, device=dev)
        per_expert.index_add_(0, g_sorted, torch.ones_like(g_sorted, dtype=torch.int32))
        per_expert = per_expert[:num_experts]
        rank_start = exclusive_cumsum(per_expert.view(num_ranks, e_local).sum(1).long(), 0)
        dest_sorted = torch.clamp(g_sorted // e_local, max=num_ranks - 1)
        j = torch.arange(n * k, device=dev) - rank_start[dest_sorted]
        ok = (g_sorted < num_experts) & (j < cap)
        self._errors[1] += ((g_sorted < num_experts) & (j >= cap)).sum(dtype=torch.int32)
        slot_sorted = torch.where(ok, dest_sorted * cap + j, num_ranks * cap)
        send_slot = torch.empty(n * k, dtype=torch.int64, device=dev)
        send_slot[order] = torch.where(ok, slot_sorted, -1)
        send_buf = torch.empty(num_ranks * cap + 1, row_bytes, dtype=torch.uint8, device=dev)
        send_buf.index_copy_(0, slot_sorted, token_rows.index_select(0, order // k))

        recv_cnt = torch.empty(num_ranks, e_local, dtype=torch.int32, device=dev)
        works = [self._a2a(recv_cnt, per_expert.view(num_ranks, e_local).contiguous(), async_op=True)]
        recv_buf = torch.empty(num_ranks * cap, row_bytes, dtype=torch.uint8, device=dev)
        works.append(self._a2a(recv_buf, send_buf[:num_ranks * cap], async_op=True))

        # outputs exist now; the hook (or the code below) fills them
        dtype = FP8_DTYPE if req.use_fp8 else x.dtype
        recv_x_full = torch.empty(num_rows + 1, hidden, dtype=dtype, device=dev)
        recv_x = recv_x_full[:num_rows].view(e_local, num_ranks * t_max, hidden)
        recv_scales = None
        if scales is not None:
            ns = scales.size(1)
            recv_scales = torch.empty(e_local, ns, num_ranks * t_max, dtype=scales.dtype, device=dev).transpose(1, 2)
        src_info = torch.full((num_rows + 1,), -1, dtype=torch.int32, device=dev)
        recv_count = torch.empty(e_local, dtype=torch.int32, device=dev)
        layout_range = torch.empty(e_local, num_ranks, 2, dtype=torch.int32, device=dev)
        recv_dst = torch.empty(num_ranks * cap, dtype=torch.int64, device=dev)

        def receive() -> None:
            for w in works:
                w.wait()
            cnt = recv_cnt.long()
            cum = torch.cumsum(cnt, dim=1)  # [R, E_local] inclusive, per source
            jj = torch.arange(cap, device=dev).expand(num_ranks, cap).contiguous()
            e = torch.searchsorted(cum, jj, right=True).clamp(max=e_local - 1)
            ok_rows = jj < cum[:, -1:]
            within = jj - (cum.gather(1, e) - cnt.gather(1, e))
            begin = exclusive_cumsum(cnt, 0)  # [R, E_local]: first row of source s in expert e
            dst = torch.where(ok_rows, e * (num_ranks * t_max) + begin.gather(1, e) + within, num_rows).flatten()
            recv_dst.copy_(dst)
            off = 0
            recv_x_full.view(torch.uint8).view(num_rows + 1, -1).index_copy_(
                0, dst, recv_buf[:, off:off + hidden * recv_x.element_size()])
            off += hidden * recv_x.element_size()
            if recv_scales is not None:
                nb = recv_scales.size(2) * 4
                flat_scales = torch.empty(num_rows + 1, nb, dtype=torch.uint8, device=dev)
                flat_scales.index_copy_(0, dst, recv_buf[:, off:off + nb])
                recv_scales.copy_(flat_scales[:num_rows].view(recv_scales.dtype).view(e_local, num_ranks * t_max, -1))
                off += nb
            src_info.view(torch.uint8).view(num_rows + 1, 4).index_copy_(0, dst, recv_buf[:, off:off + 4])
            recv_count.copy_(cnt.sum(0))
            layout_range[:, :, 0] = begin.t()
            layout_range[:, :, 1] = cnt.t()

        handle = LowLatencyHandle(
            buffer_id=self.buffer_id, transport=self.name, num_max_dispatch_tokens_per_rank=t_max, hidden=hidden,
            num_experts=num_experts, num_ranks=num_ranks, num_tokens=n, num_topk=k,
            src_info=src_info[:num_rows].view(e_local, num_ranks * t_max), layout_range=layout_range,
            recv_count=recv_count,
            state=_LowLatencyState(capacity=cap, send_slot=send_slot.view(n, k), recv_dst=recv_dst))
        if req.return_recv_hook:
            return LowLatencyDispatchResult(recv_x, recv_scales, recv_count, handle, receive)
        receive()
        return LowLatencyDispatchResult(recv_x, recv_scales, recv_count, handle, None)

    def low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        e_local = handle.num_experts // handle.num_ranks
        shape = (e_local, handle.num_ranks * handle.num_max_dispatch_tokens_per_rank, handle.hidden)
        buf = self._zero_copy.get(shape)
        if buf is None:
            buf = self._zero_copy[shape] = torch.empty(shape, dtype=torch.bfloat16, device=self.device)
        return buf

    def low_latency_combine(self, req: LowLatencyCombineRequest) -> LowLatencyCombineResult:
        h: LowLatencyHandle = req.handle
        st: _LowLatencyState = h.state
        y = self.low_latency_combine_buffer(h) if req.zero_copy else req.x
        num_rows = y.size(0) * y.size(1)
        y_flat = y.reshape(num_rows, y.size(2))
        dev = y.device
        gather = torch.where(st.recv_dst < num_rows, st.recv_dst, 0)
        back = torch.empty(self.num_ranks * st.capacity, y.size(2), dtype=y.dtype, device=dev)
        work = self._a2a(back, y_flat.index_select(0, gather), async_op=True)
        n = req.topk_idx.size(0)
        out = req.out if req.out is not None else torch.empty(n, y.size(2), dtype=torch.bfloat16, device=dev)

        def receive() -> None:
            work.wait()
            acc = torch.zeros(n, y.size(2), dtype=torch.float32, device=dev)
            zero = torch.zeros((), dtype=torch.float32, device=dev)
            for kk in range(st.send_slot.size(1)):
                s = st.send_slot[:, kk]
                rows = back.index_select(0, s.clamp(min=0)).float()
                prod = req.topk_weights[:, kk:kk + 1] * rows
                acc = acc + torch.where((s >= 0).unsqueeze(1), prod, zero)
            out.copy_(acc)

        if req.return_recv_hook:
            return LowLatencyCombineResult(out, receive)
        receive()
        return LowLatencyCombineResult(out, None)


def _scatter_rows(src: torch.Tensor, dst: torch.Tensor, num_rows: int, fill) -> torch.Tensor:
    """``out[dst[i]] = src[i]`` into ``[num_rows, ...]``; ``dst == num_rows`` discards. ``fill`` (a row, a
    scalar or None for uninitialised) sets rows nothing lands on."""
    out = torch.empty(num_rows + 1, *src.shape[1:], dtype=src.dtype, device=src.device)
    if fill is not None:
        out[:] = fill
    out.index_copy_(0, dst, src)
    return out[:num_rows]
