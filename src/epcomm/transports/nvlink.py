"""One-sided transports: Triton kernels that write tokens straight into peers' symmetric memory.

``nvlink`` (GPUs with P2P access over NVLink) and ``p2p`` (P2P access without native P2P atomics or
without NVLink) share this implementation: its protocol uses only single-writer flags and device-local
atomics, never remote atomics, so it is correct on both; they differ in the capabilities they report.

Normal dispatch (``epcomm.kernels.ep``):
  1. ``exchange_counts``: every rank puts its count table (tokens per rank, token count, tokens per
     expert) into every peer's symmetric matrix, then a barrier. One kernel, no NCCL.
  2. Exact mode reads the matrix to the host once (the receive size, DeepEP's per-expert list).
     ``num_worst_tokens`` and cached handles skip this: no host synchronisation, CUDA-graph capturable.
  3. Rounds (one when the traffic fits the buffer), each one launch of ``dispatch_kernel``: ``num_sms``
     pushing programs read every token once and store it with its record into the receive area of each
     destination rank (token-major), reporting their progress to every destination; receiving programs
     (one per pushing program of each source) copy each reported stretch of rows into ``recv_x`` and
     unpack scales, local top-k ids and weights while the pushes go on. With bounded local passes
     (``Config.strict_sms``) the push publishes at its end and ``dispatch_copyout`` copies afterwards on
     ``num_sms`` programs. Storage sized by the first dispatch (``num_nvl_bytes=0``) grows at a later
     exact-mode dispatch that needs more; traffic larger than a buffer of a given size (``num_nvl_bytes``, or a
     call being captured) is split into rounds over token ranges; each round begins with a barrier.
Expert-major dispatch (``layout="expert_major"``): the same steps with the pair indices in the records
(``epcomm.kernels.expert_major``): the receiving programs store every row straight into its expert-major rows.
On a one-rank group nothing travels: ``local_pairs_kernel`` places the pairs from the layout's counts and a permute
copies the rows (no exchange, no symmetric memory); its combine is the local weighted reduction alone.
Combine: per round one launch of ``combine_push``, which passes a barrier, returns every row to its source
rank's area (rows a rank sends itself stay where they are; up to ``NARROW_RANKS`` ranks each program pushes
one contiguous slice of the rows, so it writes to one or two peers, and above that each program takes a slice
of every peer's rows and writes to all of them in turn, which measured faster at 6 and 8 ranks and slower at
4) and ends once every rank's rows have arrived; then the source reduces with the ordered FP32 kernel
(``epcomm.kernels.reduce``, reading its own rows from the combine input), bit-identical to the reference.
A round covers a range of source tokens, so every contribution to a token arrives in one round.

Low-latency mode: ``epcomm.transports.low_latency`` (one-sided, double-buffered, graph-capturable).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from .. import env
from ..core.config import NARROW_RANKS, model_num_sms
from ..core.handles import DispatchHandle
from ..core.layout import align_all, align_up
from ..core.validate import raise_if_bad_routing
from ..kernels.launch import launch, next_pow2
from ..errors import BufferTooSmallError, EpcommError
from .device_errors import LOW_LATENCY, NORMAL, DeviceErrors
from .faults import backstop_s, host_list
from .base import (Capabilities, CombineRequest, DispatchRequest, DispatchResult, LowLatencyCombineRequest,
                   LowLatencyCombineResult, LowLatencyDispatchRequest, LowLatencyDispatchResult, Transport,
                   counts_to_device)

log = logging.getLogger(__name__)

MAX_LOCAL_EXPERTS = 1024
_LL_CTL = 16  # where the low-latency control words start in the error block (int64 words)


@dataclass(frozen=True)
class _Rounds:
    """How a call's traffic is cut: ``cap`` rows per source region, rounds over token ranges of ``cap``."""

    cap: int
    num_rounds: int

    def token_range(self, j: int, n: int) -> tuple:
        if self.num_rounds == 1:
            return 0, n
        return min(j * self.cap, n), min((j + 1) * self.cap, n)


@dataclass(frozen=True)
class _NVLinkState:
    """What a dispatch leaves for its combine and cached dispatches."""

    summary: torch.Tensor  # int32 summary of the exchange (recv_prefix at SUMMARY_HEAD, see kernels.ep)
    recv_src: torch.Tensor  # [M, 2] int32 source token and source rank of every received row
    pos: torch.Tensor  # [N, R] int32 index of each token among this rank's tokens for that destination
    num_tokens_per_rank: torch.Tensor  # [R] int32 (device)
    num_tokens_max: Optional[int]  # largest token count of any rank (host), None without host sync
    max_pair: Optional[int]  # most tokens any rank sends any rank (host), None without host sync
    # expert-major dispatches: what a cached dispatch needs to place rows again without an exchange
    topk_idx: Optional[torch.Tensor] = None  # [N, K] the sender's top-k ids
    em_pidx: Optional[torch.Tensor] = None  # [N, K] int32 each pair's index among this rank's pairs of its expert
    em_base: Optional[torch.Tensor] = None  # [R, E_local] int32 where each source's pairs of each expert start

    @property
    def recv_prefix(self) -> torch.Tensor:
        from ..kernels.ep import SUMMARY_HEAD

        return self.summary[SUMMARY_HEAD:]

    def rounds(self, row_bytes: int, area_bytes: int, num_ranks: int, worst: int, fn: str) -> _Rounds:
        """The round geometry for rows of ``row_bytes``: one round of ``max_pair`` rows per source when it
        fits the area, else rounds of as many rows as fit (``num_worst_tokens``: one round of that many)."""
        if worst:
            if num_ranks * worst * row_bytes > area_bytes:
                raise BufferTooSmallError(
                    f"{fn}: num_worst_tokens={worst} needs {num_ranks * worst * row_bytes} bytes of symmetric "
                    f"buffer, this Buffer has {area_bytes}; pass num_nvl_bytes >= that or a smaller num_worst_tokens")
            return _Rounds(worst, 1)
        fit = area_bytes // (num_ranks * row_bytes)
        if fit < 1:
            raise BufferTooSmallError(f"{fn}: one row of {row_bytes} bytes per rank does not fit the {area_bytes}-"
                                      f"byte buffer; pass a larger num_nvl_bytes")
        if self.max_pair <= fit:
            return _Rounds(max(self.max_pair, 1), 1)
        return _Rounds(fit, _ceil_div(self.num_tokens_max, fit))


@dataclass(frozen=True)
class _LocalState:
    """What a one-rank expert-major dispatch leaves for its combine and cached dispatches."""

    pair_row_t: torch.Tensor  # [N, K] int32 the expert-major row of every (token, slot), -1: none


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class NVLinkTransport(Transport):
    """Normal-mode dispatch/combine with one-sided Triton kernels; see the module docstring."""

    name = "nvlink"
    link_gbps = 400.0  # what leaves one GPU over NVLink4 (18 links) in practice: the traffic model's ceiling
    min_storage_bytes = 1 << 20  # the least normal-mode storage a first dispatch sizes
    description = "one-sided Triton kernels writing into peers' symmetric memory over NVLink"
    validates_topk = True  # the exchange kernel checks expert ids; the Buffer need not
    accepts_known_counts = True  # the exchange stays on the device, checked against them
    gates_cached_dispatch = True  # merge_cached, and cached dispatches of rows still being written (a Gate)
    gates_exact_dispatch = True  # exact-mode dispatches given their positions (gated too), and known_handle
    combines_into = True  # CombineRequest.out

    def __init__(self, group, device: torch.device, buffer_id: int, num_nvl_bytes: int = 0,
                 num_rdma_bytes: int = 0) -> None:
        super().__init__(group, device, buffer_id)
        from ..kernels import triton_available

        if device.type != "cuda" and not _interpreted():
            raise EpcommError(f"{type(self).__name__}: needs CUDA devices (or the Triton interpreter for tests)")
        if not triton_available():
            raise EpcommError(f"{type(self).__name__}: needs Triton")
        r = self.num_ranks
        self.table_words = 2 + MAX_LOCAL_EXPERTS
        self.heap = None  # normal-mode storage: made now when num_nvl_bytes is given, else sized by the first call
        self.area_bytes = 0
        self._offsets: dict = {}
        self._grows = not num_nvl_bytes  # storage sized by calls grows at a dispatch that needs more
        if num_nvl_bytes:
            self._make_storage(align_up(int(num_nvl_bytes), 1 << 12))
        self.epoch = torch.zeros(1, dtype=torch.int64, device=device)
        self.counters = torch.zeros(4, dtype=torch.int32, device=device)
        from ..kernels import low_latency as LLK
        from .low_latency import OneSidedLowLatency

        # one int64 block holds every error record, so that one copy brings them all to the host:
        # [err (8) | deferred (int32 in word 8) | 7 free | low-latency ctl (CTL_WORDS, errors at CTL_ERR..CTL_BAD)]
        block = torch.zeros(_LL_CTL + LLK.CTL_WORDS, dtype=torch.int64, device=device)
        self.err = block[:8]
        self.deferred = block[8:9].view(torch.int32)[:1]  # sync-free calls' bad inputs (the word's low half)
        ll_err = (_LL_CTL + LLK.CTL_ERR, _LL_CTL + LLK.CTL_BAD + 1)
        self._ll = OneSidedLowLatency(group, device, buffer_id, name=self.name, nbytes=int(num_rdma_bytes),
                                      ctl=block[_LL_CTL:])
        self.errors = DeviceErrors(block[:ll_err[1]], ((0, 9, NORMAL), ll_err + (LOW_LATENCY,)), self._describe_errors)
        self.r_pow2 = max(2, next_pow2(r))
        self.flags_kw = dict(USE_PTX=device.type == "cuda")
        self.timer_kw = dict(USE_TIMER=device.type == "cuda")
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2

    def _make_storage(self, area_bytes: int) -> None:
        """Collective: the symmetric heap of normal mode, ``area_bytes`` of receive area plus control words
        (count matrix, flags, progress words), zeroed on every rank before any rank may write into a peer's. With
        storage already made (``_grow``: every rank's kernels on it have ended), the control words carry over from
        it, so the epochs go on, and the old heap is released once every rank has its copy."""
        from ..kernels.ep import PROGRESS_SLOTS
        from ..shmem import SymmetricHeap

        import torch.distributed as dist

        r, device, old = self.num_ranks, self.device, self.heap
        ctrl = r * r * self.table_words * 4 + 4 * 8 * r + 8 * r * 2 + r * (PROGRESS_SLOTS + 2) * 16 + 4096
        try:
            h = SymmetricHeap(self.group, area_bytes + ctrl, device)
        except torch.cuda.OutOfMemoryError as exc:
            raise BufferTooSmallError(f"{type(self).__name__}: could not allocate {area_bytes} bytes of symmetric "
                                      f"memory ({exc}); pass a smaller num_nvl_bytes") from exc
        words = ((r, r, self.table_words), torch.int32), ((r,), torch.int64), ((r,), torch.int64), \
            ((r, 2), torch.int32), ((r, PROGRESS_SLOTS + 2, 2), torch.int64)
        fresh = [h.empty(shape, dtype) for shape, dtype in words]
        if old is None:
            for t in fresh[1:]:
                t.zero_()
        else:
            for t, before in zip(fresh, (self.mat, self.flags, self.arrive, self.hdr, self.prog)):
                t.copy_(before)
        self.mat, self.flags, self.arrive, self.hdr, self.prog = fresh
        self.area = h.empty((area_bytes,), torch.uint8)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier(group=self.group)
        self.heap, self.area_bytes = h, area_bytes
        self._offsets.clear()  # memoised by address: the new heap's tensors may reuse the old one's
        if old is not None:
            old.destroy(barrier=False)  # every rank passed the barrier above, with its copy made

    def _may_grow(self) -> bool:
        """Whether storage may grow at this call (``_grow``): it was sized by calls (no ``num_nvl_bytes``) and no CUDA
        graph is being captured (nothing can be allocated then)."""
        return self._grows and not (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing())

    def _grow(self, rows: int, row_bytes: int, fn: str) -> None:
        """Collective: storage for ``rows`` rows of ``row_bytes`` from every rank (the largest token count of any
        rank, from the count exchange every rank read), replacing storage that a first dispatch sized smaller.
        Made at the dispatch that needs it (see ``_run_dispatch``), once per size, never while capturing."""
        import torch.distributed as dist

        before = self.area_bytes
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)  # every rank's kernels on the old storage have ended
        self._make_storage(max(next_pow2(self.num_ranks * rows * row_bytes), 2 * before))
        if self.rank == 0:
            log.info("%s: normal-mode storage grown from %d to %d bytes for %d rows of %d bytes per rank (sized by "
                     "the first dispatch, which had fewer tokens; num_nvl_bytes or Buffer.warmup avoid the "
                     "growth)", fn, before, self.area_bytes, rows, row_bytes)

    def _size_storage(self, req: DispatchRequest, fn: str) -> None:
        """With ``num_nvl_bytes=0``, at the first normal-mode dispatch (every rank makes it): storage for what
        this call can need, each rank sending all of its tokens to one rank (the largest token count in the
        group, one collective; ``num_worst_tokens`` rows per source when given), in rows wide enough for the
        dispatch and a BF16 combine, rounded up to a power of two (at least 1 MiB). A later exact-mode dispatch
        that needs more grows it (``_grow``: a synchronisation and two barriers, once per size), and so does a
        ``num_worst_tokens`` dispatch (for its rows and its combine's: ``_fit_worst``); a call being captured moves
        in rounds (a ``num_worst_tokens`` one raises). Pass
        ``num_nvl_bytes`` (``Buffer.get_normal_size_hint``: then calls that need more move in rounds) or warm up
        with the largest token count first (``Buffer.warmup``) to size it once."""
        import torch.distributed as dist

        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise BufferTooSmallError(f"{fn}: this Buffer's normal-mode storage is made by its first dispatch, and "
                                      f"storage cannot be allocated while a CUDA graph is being captured: make one "
                                      f"dispatch (or Buffer.warmup) before capturing, or pass num_nvl_bytes")
        most = torch.tensor([req.x.size(0)], dtype=torch.int64, device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group)
        rows = req.num_worst_tokens or max(int(most.item()), 1)
        row = self._storage_row(req)
        self._make_storage(max(next_pow2(self.num_ranks * rows * row), self.min_storage_bytes))
        if self.rank == 0:
            log.info("%s: %d bytes of normal-mode storage sized by the first dispatch (%d rows of %d bytes per "
                     "rank)", fn, self.area_bytes, rows, row)

    def _fit_worst(self, req: DispatchRequest, worst: int, expert_major: bool) -> None:
        """Storage for a ``num_worst_tokens`` dispatch: ``worst`` rows per source of its rows and of its combine's
        (``_storage_row``: a combine of an FP8 dispatch moves wider BF16 rows), checked before any row moves. Storage
        made smaller by an earlier call grows here (every rank makes the same call: ``_grow``) unless
        ``num_nvl_bytes`` fixed it or a CUDA graph is being captured; then this raises."""
        row = self._storage_row(req, expert_major)
        need = self.num_ranks * worst * row
        if need <= self.area_bytes:
            return
        if not self._may_grow():
            raise BufferTooSmallError(
                f"Buffer.dispatch: num_worst_tokens={worst} needs {need} bytes of symmetric buffer for this dispatch "
                f"and its combine, this Buffer has {self.area_bytes}; pass num_nvl_bytes >= that, or make (or warm "
                f"up) a call of this num_worst_tokens before capturing, or pass a smaller num_worst_tokens")
        self._grow(worst, row, "Buffer.dispatch")

    @staticmethod
    def _storage_row(req: DispatchRequest, expert_major: bool = False, extra_scales: int = 0) -> int:
        """Bytes of storage per row for the calls of ``req``'s shape (with ``extra_scales`` more 4-byte scales a row):
        its dispatch rows with their records, or a BF16 combine of them, whichever is wider."""
        from ..kernels.ep import record_words

        k = req.topk_idx.size(1) if req.topk_idx is not None else 0
        ns = (req.x_scales.size(1) if req.x_scales is not None else 0) + extra_scales
        return max(4 * (_words(req.x) + record_words(ns, k, req.topk_weights is not None, expert_major)),
                   2 * req.x.size(1) + 4 * k)

    @classmethod
    def capabilities(cls) -> Capabilities:
        return Capabilities(
            name=cls.name, devices=("cuda",), one_sided=True, sync_free_normal=True,
            graph_capturable_low_latency=True, needs_p2p=True, needs_p2p_atomics=False, description=cls.description)

    # ------------------------------------------------------------------ helpers
    def _off(self, t: torch.Tensor) -> int:
        """Heap offset of one of this transport's heap tensors (memoised: they live as long as the heap)."""
        key = t.data_ptr()
        off = self._offsets.get(key)
        if off is None:
            off = self._offsets[key] = self.heap.offset_of(t)
        return off

    def _timeout(self) -> int:
        from ..kernels.shmem import timeout_units

        return timeout_units(env.timeout_s(), self.device)

    def _num_sms(self, config, rows: int, row_bytes: int) -> int:
        """``config.num_sms``, or the traffic model's choice for ``rows`` rows of ``row_bytes`` leaving."""
        if config.num_sms is not None:
            return config.num_sms
        return model_num_sms(rows * row_bytes, self.link_gbps, self.sms, self.num_ranks)

    def _barrier(self) -> None:
        from ..kernels.shmem import launch_barrier

        launch_barrier(self.heap.peer_bases, self._off(self.flags), self.epoch, self.err, self.rank, self.num_ranks,
                       env.timeout_s())

    def _timeout_message(self, code: int, peer: int, seen: int, slot: int = 0) -> Optional[str]:
        from ..kernels.shmem_codes import ERR_GATE_TIMEOUT, ERROR_NAMES

        if not code:
            return None
        if code == ERR_GATE_TIMEOUT:
            return (f"rank {self.rank}: {ERROR_NAMES[code]}: the forwarding waited {env.timeout_s():g} s for chunk "
                    f"{slot} of its rows from the inter-domain leg (its flag still said {seen}): a rank of another "
                    f"domain is stuck or died, or the leg's stream was blocked")
        return (f"rank {self.rank}: {ERROR_NAMES.get(code, code)} waiting for rank {peer} (its flag still said "
                f"{seen}) after {env.timeout_s():g} s: a peer is stuck, died, or did not make the same call")

    @property
    def deferred_errors(self) -> torch.Tensor:
        return self.deferred

    def _describe_errors(self, words: list) -> list:
        """``DeviceErrors.describe`` of this transport's block (see ``__init__``)."""
        found = []
        msg = self._timeout_message(words[0], words[2], words[5], words[3])
        if msg:
            found.append((NORMAL, msg))
        deferred = words[8] & 0xFFFFFFFF
        if deferred:
            found.append((NORMAL, f"rank {self.rank}: a call without host synchronisation got invalid input "
                                  f"({deferred} found of: bad expert ids, an inconsistent layout, more rows "
                                  f"than num_worst_tokens, counts other than the ones known beforehand)"))
        from ..kernels.low_latency import CTL_BAD, CTL_ERR

        ll = words[_LL_CTL + CTL_ERR:_LL_CTL + CTL_BAD + 1]
        return found + [(LOW_LATENCY, m) for m in self._ll.describe_errors(ll)]

    def _start_epochs(self, epoch: int) -> None:
        """For tests only (collective, no call in flight, normal-mode storage made): put every epoch of this transport,
        normal and low-latency mode, at ``epoch`` (an int64, e.g. just below 2**31, 2**32 or 2**63) as if that many
        calls of each kind had completed, so that the next calls cross the wrap of their 32-bit tags or of the int64
        itself. Flags hold ``epoch``, progress words its tag ``epoch << 32``."""
        import torch.distributed as dist

        if self.heap is None:
            raise RuntimeError(f"{type(self).__name__}._start_epochs: make the normal-mode storage first")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)  # nobody still reads or releases a flag
        for t in (self.epoch, self.flags, self.arrive):
            t.fill_(epoch)
        self.prog.fill_(_tag(epoch))
        self._ll.start_epochs(epoch)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)  # every rank's flags are set before any rank releases into them

    def clean_low_latency(self) -> None:
        self._ll.reset()
        self.errors.clear(LOW_LATENCY)

    def memory_usage(self) -> dict:
        return {"normal_symmetric": self.heap.layout.total_bytes if self.heap is not None else 0,
                **self._ll.memory_bytes(), **super().memory_usage()}

    # ------------------------------------------------------------------ normal mode
    def dispatch(self, req: DispatchRequest) -> DispatchResult:
        if req.handle is not None:
            return self._cached_dispatch(req)
        itr, pos, summary, num_recv, per_expert_list, n_max, max_pair, host, worst = (
            self._exchange(req) if req.positions is None else self._given(req))
        num_ranks, x, e_local = self.num_ranks, req.x, req.num_experts // self.num_ranks
        outs = req.outs if req.outs is not None and req.row_map is not None else self.alloc_recv(
            num_recv, x, _columns(req.x_scales), None if req.topk_idx is None else req.topk_idx.size(1),
            req.topk_weights is not None, bool(worst))
        recv_x, recv_scales, recv_idx, recv_w, recv_src = outs
        state = _NVLinkState(summary=summary, recv_src=recv_src, pos=pos, num_tokens_per_rank=req.num_tokens_per_rank,
                             num_tokens_max=n_max, max_pair=max_pair)
        self._run_dispatch(req, itr, state, outs, num_recv, worst)
        handle = self._handle(req, itr, state, host, num_recv, worst, _recv_per_expert(summary, num_ranks, e_local))
        return DispatchResult(recv_x, recv_scales, recv_idx, recv_w, per_expert_list, handle)

    def _handle(self, req: DispatchRequest, itr, state: _NVLinkState, host: Optional[list], num_recv: int,
                worst: int, per_expert: torch.Tensor, **layout) -> DispatchHandle:
        """The handle of a dispatch that exchanged counts (``host``: the summary read by the host, None with
        ``num_worst_tokens``); ``layout``: the expert-major fields."""
        from ..kernels.ep import SUMMARY_HEAD

        b, r = SUMMARY_HEAD, self.num_ranks
        return DispatchHandle(
            buffer_id=self.buffer_id, transport=self.name, num_ranks=r, num_experts=req.num_experts,
            num_tokens=req.x.size(0), hidden=req.x.size(1), is_token_in_rank=itr,
            num_tokens_per_rank=None if worst else tuple(host[b + 2 * r:b + 3 * r]), num_recv_tokens=num_recv,
            num_recv_tokens_per_rank=None if worst else tuple(host[b + r:b + 2 * r]),
            num_recv_tokens_per_expert=per_expert, recv_src_rank=state.recv_src[:, 1],
            recv_src_idx=state.recv_src[:, 0], num_worst_tokens=worst, state=state, **layout)

    def dispatch_expert_major(self, req: DispatchRequest) -> DispatchResult:
        """The expert-major dispatch with the rows stored straight into their expert-major rows by the receiving
        programs (``epcomm.kernels.expert_major``: the sender's records carry each pair's index among its pairs
        of that expert, the receiver places them from the exchanged count matrix); no rank-major copy and no
        permute. Cached dispatches of expert-major handles place the rows the same way, with the tables the first
        dispatch left in the handle (``_cached_dispatch_expert_major``)."""
        from ..core.layout import expert_major_rows
        from ..kernels.expert_major import launch_em_table, launch_pair_rows

        if req.handle is not None:
            return self._cached_dispatch_expert_major(req)
        if self.num_ranks == 1 and req.known is None:
            return self._local_dispatch_expert_major(req)
        num_ranks, x, dev = self.num_ranks, req.x, self.device
        n, k, align = x.size(0), req.topk_idx.size(1), req.expert_alignment
        # sender: each pair's index among this rank's pairs of its expert (launched before the exchange's host read:
        # it needs nothing from it); receiver: where each source's pairs of each local expert start, from the count
        # matrix the exchange all-gathered
        pidx = torch.empty(n, k, dtype=torch.int32, device=dev)
        if n:
            launch_pair_rows(req.topk_idx, req.num_tokens_per_expert, None,
                             torch.empty(req.num_experts, dtype=torch.int32, device=dev), pidx, None, None,
                             self.deferred, (1 << 31) - 1, 1, local_index=True)
        itr, pos, summary, num_recv, per_expert_list, n_max, max_pair, host, worst = self._exchange(req)
        e_local = req.num_experts // num_ranks
        rows = expert_major_rows(worst, e_local, align) if worst else sum(per_expert_list)
        base = torch.empty(num_ranks, e_local, dtype=torch.int32, device=dev)
        offs = torch.empty(e_local, dtype=torch.int32, device=dev)
        launch_em_table(self.mat, base, offs, self.deferred, self.rank, rows, align)
        counts = _recv_per_expert(summary, num_ranks, e_local)
        row_w = torch.empty(rows, dtype=torch.float32, device=dev) if req.topk_weights is not None else None
        row_src = torch.empty(rows, dtype=torch.int32, device=dev)
        pair_row = (torch.full if worst else _empty)((num_recv, k), -1, dtype=torch.int32, device=dev)
        recv_src = (torch.full if worst else _empty)((num_recv, 2), -1, dtype=torch.int32, device=dev)
        recv_x, recv_scales, targets = self._em_targets(x, req.x_scales, rows, row_w, row_src, pair_row, recv_src,
                                                        base, pidx, counts, align)
        state = _NVLinkState(summary=summary, recv_src=recv_src, pos=pos, num_tokens_per_rank=req.num_tokens_per_rank,
                             num_tokens_max=n_max, max_pair=max_pair, topk_idx=req.topk_idx, em_pidx=pidx, em_base=base)
        self._run_dispatch(req, itr, state, None, num_recv, worst, em=targets)
        handle = self._handle(req, itr, state, host, num_recv, worst, counts, layout="expert_major",
                              expert_alignment=align, num_recv_rows=rows, num_topk=k, expert_offsets=offs,
                              recv_pair_row=pair_row, recv_row_src=row_src, recv_row_weights=row_w)
        return DispatchResult(recv_x, recv_scales, offs, row_w, per_expert_list, handle)

    def _exchange(self, req: DispatchRequest):
        """The first part of a dispatch: the count exchange (``exchange_kernel``) and, in exact mode, its one read
        by the host. Returns ``(is_token_in_rank, pos, summary, num_recv, per_expert_list, n_max, max_pair, host,
        worst)``."""
        from ..kernels.ep import SUMMARY_HEAD, exchange_kernel, pow2_block

        fn = "Buffer.dispatch"
        host = None
        if self.heap is None:
            self._size_storage(req, fn)
        num_ranks, rank, dev = self.num_ranks, self.rank, self.device
        x = req.x
        n = x.size(0)
        e_local = req.num_experts // num_ranks
        if e_local > MAX_LOCAL_EXPERTS:
            raise ValueError(f"{fn}: {e_local} experts per rank exceed the {MAX_LOCAL_EXPERTS} this transport supports")
        itr = req.is_token_in_rank
        k = req.topk_idx.size(1) if req.topk_idx is not None else 0
        has_experts = req.num_tokens_per_expert is not None
        pos = torch.empty(n, num_ranks, dtype=torch.int32, device=dev)
        summary = torch.empty(SUMMARY_HEAD + 3 * num_ranks + max(e_local, 1), dtype=torch.int32, device=dev)
        worst = req.num_worst_tokens
        known = req.known if req.known is not None and req.known.max_pair is not None and not worst else None
        expected = summary
        if known is not None:
            # counts known beforehand: the host uses them and the exchange kernel checks them against what it finds
            # (a difference is a deferred error, like a sync-free call's bad input)
            host = _known_summary(known, num_ranks, e_local, has_experts)
            expected = counts_to_device(host, dev) if known.summary_tensor is None else known.summary_tensor
        self.first_call(fn, ("exchange", req.num_experts, k, has_experts, known is not None), lambda: launch(
            exchange_kernel, (1,),
            req.num_tokens_per_rank, req.num_tokens_per_expert if has_experts else summary, itr.view(torch.int8),
            req.topk_idx if k else summary, pos, summary, self.mat, self.heap.peer_bases, self._off(self.mat),
            self._off(self.flags), self.epoch, self.err, expected, self.deferred, n, req.num_experts, rank, num_ranks,
            self._timeout(), E_LOCAL=e_local, TW=self.table_words, K=max(k, 1), R=num_ranks, R_POW2=self.r_pow2,
            HAS_EXPERTS=has_experts, HAS_TOPK=k > 0, BLOCK_T=256, BLOCK_E=pow2_block(e_local), BLOCK_K=pow2_block(k),
            CHECK=known is not None, **self.flags_kw, **self.timer_kw))
        if known is not None:
            num_recv, max_pair, n_max = host[:3]
            per_expert_list = (align_all(known.num_recv_tokens_per_expert, req.expert_alignment)
                               if has_experts else [])
        elif worst:
            num_recv, per_expert_list, n_max, max_pair = worst, [], None, None
            head = summary[:5]
            # bad ids, a bad layout, more rows for this rank than num_worst_tokens, or for any rank from one source
            # (every rank sees that one: the pushes drop rows past a source's num_worst_tokens region)
            self.deferred += head[3] + head[4] + (head[:2] > worst).sum(dtype=torch.int32)
        else:
            # bounded by a backstop behind the exchange kernel's own device timeout (a stuck collective of another
            # group ahead on this stream, e.g. the hierarchical path's inter-domain leg, must not block forever)
            host = host_list(summary, fn, f"rank {rank}: the work ahead of the count exchange", backstop_s())
            num_recv, max_pair, n_max, bad_topk, bad_layout, code, peer, seen = host[:SUMMARY_HEAD]
            msg = self._timeout_message(code, peer, seen)
            if msg:
                self.errors.record(NORMAL, msg)
                raise self.errors.error(fn)
            raise_if_bad_routing(fn, bad_topk, bad_layout, req.num_experts)
            first = SUMMARY_HEAD + 3 * num_ranks
            per_expert_list = (align_all(host[first:first + e_local], req.expert_alignment)
                               if req.num_tokens_per_expert is not None else [])
        return itr, pos, summary, num_recv, per_expert_list, n_max, max_pair, host, worst

    def _given(self, req: DispatchRequest):
        """``_exchange``'s results for a dispatch whose caller made its positions (``DispatchRequest.positions``) and
        knows its counts and their summary (``req.known`` with ``summary_tensor``): no count exchange, only the
        barrier that starts the call's epoch (as a cached dispatch's: the progress words of earlier calls never
        satisfy this one's waits, and no rank overwrites an area a peer has not consumed)."""
        known = req.known
        if known is None or known.summary_tensor is None or req.num_worst_tokens or known.max_pair is None:
            raise ValueError("Buffer.dispatch: a dispatch given its positions needs its known counts with their "
                             "summary (KnownCounts.summary_tensor and max_pair), in exact mode")
        if self.heap is None:
            self._size_storage(req, "Buffer.dispatch")
        self.first_call("Buffer.dispatch", ("barrier",), self._barrier)
        has_experts = req.num_tokens_per_expert is not None
        host = _known_summary(known, self.num_ranks, req.num_experts // self.num_ranks, has_experts)
        per_expert_list = align_all(known.num_recv_tokens_per_expert, req.expert_alignment) if has_experts else []
        return (req.is_token_in_rank, req.positions, known.summary_tensor, host[0], per_expert_list, host[2], host[1],
                host, 0)

    def known_handle(self, req: DispatchRequest, pos: torch.Tensor, sends: torch.Tensor,
                     recv_src: torch.Tensor) -> DispatchHandle:
        """The handle an exact-mode dispatch of ``req`` (``x``, ``is_token_in_rank``, ``num_experts`` and ``known``
        with its ``summary_tensor``) would have left, for a call whose rows moved in a merged one (a chunk of a
        hierarchical dispatch's gated domain leg), from what that call made: ``pos [N, R]`` int32 (the chunk's own
        positions), ``sends [R]`` int32 its rows to each rank, ``recv_src [M, 2]`` int32 the (source token, source
        rank) of every row it received, in its own order (by source, then the source's positions). Its combine and
        cached dispatches (``merge_cached``) take it as any other."""
        known = req.known
        e_local = req.num_experts // self.num_ranks
        summary = known.summary_tensor
        state = _NVLinkState(summary=summary, recv_src=recv_src, pos=pos, num_tokens_per_rank=sends,
                             num_tokens_max=known.num_tokens_max, max_pair=known.max_pair)
        host = _known_summary(known, self.num_ranks, e_local, True)
        return self._handle(req, req.is_token_in_rank, state, host, host[0], 0,
                            _recv_per_expert(summary, self.num_ranks, e_local))

    def holds_merged(self, max_pair: int, num_tokens_max: int, row_bytes: int = 0,
                     req: Optional[DispatchRequest] = None, extra_scales: int = 0) -> bool:
        """Whether a merged call (``merge_cached``, or an exact-mode dispatch's chunks in one gated call) of up to
        ``max_pair`` rows of ``row_bytes`` per source (0: the rows of ``req``'s dispatch, with ``extra_scales`` more
        4-byte scales a row, or its BF16 combine, whichever is wider) moves in one round: the storage holds them, or
        grows here to (collective: every rank of the group asks at the same call, with the same numbers) where it may
        grow (``num_nvl_bytes`` not given); False where it may not."""
        row_bytes = row_bytes or self._storage_row(req, extra_scales=extra_scales)
        if max_pair <= self.area_bytes // (self.num_ranks * row_bytes):
            return True
        if not self._may_grow():
            return False
        self._grow(num_tokens_max, row_bytes, "Buffer.dispatch")  # (num_tokens_max >= max_pair: every pair fits)
        return True

    def alloc_recv(self, num_recv: int, x: torch.Tensor, scales: Optional[tuple], k: Optional[int], has_w: bool,
                   padded: bool) -> tuple:
        """The outputs a dispatch of ``num_recv`` rows writes (what ``DispatchRequest.outs`` takes): ``(recv_x [M, H]
        of x's dtype, recv_scales [M, S] or None, recv_topk_idx [M, K] int64 or None, recv_topk_weights [M, K]
        float32 or None, recv_src [M, 2] int32)``. ``scales``: ``(S, dtype)`` or None; ``k``: the top-k columns or
        None; ``padded``: rows a call may leave unwritten are filled (ids and sources -1, weights 0)."""
        dev = x.device
        recv_x = torch.empty(num_recv, x.size(1), dtype=x.dtype, device=dev)
        recv_scales = torch.empty(num_recv, scales[0], dtype=scales[1], device=dev) if scales is not None else None
        recv_idx = recv_w = None
        if k is not None:
            recv_idx = (torch.full if padded else _empty)((num_recv, k), -1, dtype=torch.int64, device=dev)
            if has_w:
                recv_w = (torch.zeros if padded else torch.empty)(num_recv, k, dtype=torch.float32, device=dev)
        recv_src = (torch.full if padded else _empty)((num_recv, 2), -1, dtype=torch.int32, device=dev)
        return recv_x, recv_scales, recv_idx, recv_w, recv_src

    def _run_dispatch(self, req: DispatchRequest, itr, state: _NVLinkState, outs, num_recv: int, worst: int,
                      em=None) -> None:
        """The dispatch's rounds into ``outs`` (rank-major), or with ``em`` (``ExpertMajorTargets``) into the
        expert-major outputs."""
        from ..kernels.ep import PROGRESS_SLOTS, record_words

        x, scales = req.x, req.x_scales
        xw = _words(x)
        ns = scales.size(1) if scales is not None else 0
        k = req.topk_idx.size(1) if req.topk_idx is not None else 0
        has_w = req.topk_weights is not None
        mw = record_words(ns, k, has_w, em is not None)
        if worst:
            self._fit_worst(req, worst, em is not None)
        rounds = state.rounds((xw + mw) * 4, self.area_bytes, self.num_ranks, worst, "Buffer.dispatch")
        grid = self._num_sms(req.config, x.size(0) * (min(self.num_ranks, k) if k else self.num_ranks), (xw + mw) * 4)
        strict = _strict(req)
        if em is not None and not strict and req.config.num_sms is None:
            # expert-major: a receiving program stores each row once per local slot, and each copies the stretches
            # of one sending program: at least enough pushes that the pushes and their receivers fill the GPU
            grid = max(grid, self.sms // (self.num_ranks + 1) // 2 * 2)
        if not strict:  # streaming: receiving programs copy rows out while the pushes run
            grid = min(grid, PROGRESS_SLOTS // (req.gate.chunks if req.gate is not None else 1))
        elif req.gate is not None or req.row_map is not None:
            raise EpcommError("Buffer.dispatch: a gated or mapped dispatch streams (Config.strict_sms must not be set)")
        if rounds.num_rounds > 1 and state.num_tokens_max is not None and self._may_grow():
            # storage sized by a first dispatch with fewer tokens: grown here rather than moved in rounds (each a
            # barrier and launches). Every rank decides the same: from the exchanged counts and the agreed shape
            self._grow(state.num_tokens_max, self._storage_row(req, em is not None), "Buffer.dispatch")
            rounds = state.rounds((xw + mw) * 4, self.area_bytes, self.num_ranks, worst, "Buffer.dispatch")
        # the first dispatch of a kind compiles its kernels before any rank waits (Transport.first_call)
        if req.gate is not None and rounds.num_rounds > 1:
            raise EpcommError(f"Buffer.dispatch: a gated dispatch moves in one round; this one needs "
                              f"{rounds.num_rounds} (merge_cached refuses such handles)")
        key = ("dispatch", x.dtype, x.size(1), ns, k, has_w, req.num_experts, bool(worst), rounds.num_rounds == 1,
               em is not None, req.gate is not None, req.row_map is not None)
        self.first_call("Buffer.dispatch", key,
                        lambda: self._push_rounds(req, itr, state, rounds, outs, num_recv, grid, strict, em))

    def _push_rounds(self, req: DispatchRequest, itr, state: _NVLinkState, rounds: _Rounds, outs, num_recv: int,
                     grid: int, strict: bool, em=None) -> None:
        """The dispatch's launches, round by round, with ``grid`` pushing programs (see the module docstring);
        ``strict``: push, then copy out on the same programs. ``em``: expert-major outputs
        (``epcomm.kernels.expert_major.launch_em_round``)."""
        from ..kernels.ep import (PROGRESS_SLOTS, SIGNAL_TOKENS, ReceiveSide, dispatch_copyout_kernel, launch_push,
                                  pow2_block, record_words)

        num_ranks, rank, dev = self.num_ranks, self.rank, self.device
        x, scales = req.x, req.x_scales
        n = x.size(0)
        xw = _words(x)
        ns = scales.size(1) if scales is not None else 0
        k = req.topk_idx.size(1) if req.topk_idx is not None else 0
        mw = record_words(ns, k, req.topk_weights is not None, em is not None)
        cap = rounds.cap
        area_off = self._off(self.area)
        meta_rel = align_up(num_ranks * cap * xw * 4, 256)
        area_rows = self.area[:num_ranks * cap * xw * 4].view(torch.int32).view(num_ranks * cap, xw)
        meta_rows = self.area[meta_rel:meta_rel + num_ranks * cap * mw * 4].view(torch.int32).view(num_ranks * cap, mw)
        dummy = self.counters
        tok = _tokens_per_step(req.config)
        copy_grid, copy_rows, copy_warps = grid, 8, 16
        single = rounds.num_rounds == 1
        cum = None if single else torch.cat([torch.zeros(1, num_ranks, dtype=torch.int64, device=dev),
                                             torch.cumsum(itr, dim=0, dtype=torch.int64)])
        # the outputs as the kernels take them (None: none). An empty one is passed as it is (its kernel writes no
        # row), not as a dummy: the same variant as a call that receives rows (another one would be compiled and
        # loaded in the middle of a call)
        out_x, out_scales, out_idx, out_w, out_src = outs or (None,) * 5
        out_x = out_x.view(torch.int32) if out_x is not None else None
        out_scales = out_scales.view(torch.int32) if out_scales is not None else None
        out_idx = out_idx if k else None
        for j in range(rounds.num_rounds):
            if j:
                self._barrier()
            lo, hi = rounds.token_range(j, n)
            if single:
                first, rows = dummy, state.num_tokens_per_rank
            else:
                first = cum[lo].to(torch.int32)
                rows = (cum[hi] - cum[lo]).to(torch.int32)
            if em is not None:  # expert-major outputs (epcomm.kernels.expert_major)
                from ..kernels.expert_major import launch_em_round

                launch_em_round(
                    x=x, scales=scales, topk_idx=req.topk_idx, topk_weights=req.topk_weights, itr=itr, pos=state.pos,
                    first=first, rows_ptr=rows, bases=self.heap.peer_bases, area_off=area_off,
                    meta_off=area_off + meta_rel, hdr_off=self._off(self.hdr), arrive_off=self._off(self.arrive),
                    prog=self.prog, prog_off=self._off(self.prog), epoch=self.epoch, counter=self.counters,
                    err=self.err, prefix=state.recv_prefix, hdr=self.hdr, area_rows=area_rows, meta_rows=meta_rows,
                    t_begin=lo, t_end=hi, cap=cap, rank=rank, world=num_ranks, num_experts=req.num_experts, grid=grid,
                    tokens_per_step=tok, use_ptx=self.device.type == "cuda", single_round=single, strict=strict,
                    num_recv=num_recv, timeout=self._timeout(), targets=em, dummy=dummy,
                    progress_slots=PROGRESS_SLOTS, signal_tokens=SIGNAL_TOKENS)
                continue
            receive = None if strict else ReceiveSide(
                area_rows, meta_rows, self.prog, self._off(self.prog), self.err, state.recv_prefix, out_x, out_scales,
                out_idx, out_w, out_src, num_recv, self._timeout(), grid, req.row_map)
            # a gated push holds about one program per SM (half what fits): the rows' writers keep the rest
            limit = 0 if req.gate is None else max(self.sms, grid + num_ranks)
            launch_push(x=x, scales=scales, topk_idx=req.topk_idx, topk_weights=req.topk_weights, itr=itr,
                        pos=state.pos, first=first, rows=rows, bases=self.heap.peer_bases, area_off=area_off,
                        meta_off=area_off + meta_rel, hdr_off=self._off(self.hdr), arrive_off=self._off(self.arrive),
                        epoch=self.epoch, counter=self.counters, t_begin=lo, t_end=hi, cap=cap, rank=rank,
                        world=num_ranks, num_experts=req.num_experts, grid=grid, tokens_per_step=tok,
                        use_ptx=self.device.type == "cuda", single_round=single, publish=True, dummy=dummy,
                        receive=receive, gate=req.gate, limit=limit)
            if strict:
                launch(dispatch_copyout_kernel, (copy_grid,),
                    area_rows, meta_rows, self.hdr, self.heap.peer_bases, self._off(self.arrive), self.epoch, self.err,
                    state.recv_prefix, out_x if out_x is not None else dummy,
                    out_scales if out_scales is not None else dummy,
                    out_idx if out_idx is not None else dummy, out_w if out_w is not None else dummy,
                    out_src if out_src is not None else dummy, num_recv, cap, rank, num_ranks, self._timeout(), XW=xw,
                    W=mw, NS=ns, K=max(k, 1), R=num_ranks, R_POW2=self.r_pow2, ROWS=copy_rows, BLOCK=1024,
                    BLOCK_K=pow2_block(k), BLOCK_S=pow2_block(ns), HAS_SCALES=ns > 0,
                    HAS_TOPK=out_idx is not None, HAS_W=out_w is not None, VEC=xw % 4 == 0, num_warps=copy_warps,
                    **self.flags_kw, **self.timer_kw)

    def _cached_dispatch(self, req: DispatchRequest) -> DispatchResult:
        """A dispatch with a handle; with ``req.gate`` (``kernels.ep.Gate``, a handle of ``merge_cached``) a gated
        one: ``req.x``'s rows are still being written, chunk after chunk, by another stream, which releases each
        chunk's flag once its rows are there; the push waits for each flag on the device. With ``req.row_map``
        (streaming calls only: ``can_gate``) the received rows land in the rows it names. ``req.x`` may be the first
        columns of wider rows (any row stride)."""
        h: DispatchHandle = req.handle
        st: _NVLinkState = h.state
        self.first_call("Buffer.dispatch", ("barrier",), self._barrier)
        plan_req = DispatchRequest(req.x, req.x_scales, None, None, st.num_tokens_per_rank, h.is_token_in_rank, None,
                                   h.num_experts, 1, h.num_worst_tokens, None, req.config, None, req.overlapped,
                                   gate=req.gate, row_map=req.row_map)
        outs = self.alloc_recv(h.num_recv_tokens, req.x, _columns(req.x_scales), None, False, bool(h.num_worst_tokens))
        self._run_dispatch(plan_req, h.is_token_in_rank, st, outs, h.num_recv_tokens, h.num_worst_tokens)
        return DispatchResult(outs[0], outs[1], None, None, None, h)

    def can_gate(self, req: DispatchRequest) -> bool:
        """Whether a cached dispatch with ``req``'s config can be gated or mapped (it streams: see ``_strict``)."""
        return not _strict(req)

    def merge_cached(self, handles: list, x_row_bytes: int, num_scales: int = 0) -> Optional[tuple]:
        """``(handle, to_merged)``: one handle for the tokens of several exact-mode dispatches' ``handles`` side by
        side (chunk after chunk), as one dispatch of them all would have left it, for a gated cached dispatch of
        their rows (``_cached_dispatch`` with a ``Gate``); ``to_merged [M]`` int64: the row of that dispatch's output
        that holds each row of the chunks' outputs one after another (its rows come by source rank, then chunk, then
        token). The merged call moves in one round of up to the chunks' ``max_pair`` summed rows per source (every
        rank sums the same): where the storage holds fewer and may grow (``num_nvl_bytes`` not given) it grows here
        (collective: every rank merges at the same call), else None (the chunks are dispatched one by one). The
        handle is private: its ``recv_src_rank`` / ``recv_src_idx`` are not filled. ``x_row_bytes``: the bytes of
        each row it will move, with ``num_scales`` 4-byte scales besides."""
        from ..kernels.ep import SUMMARY_HEAD, record_words

        states = [h.state for h in handles]
        if not handles or any(not isinstance(st, _NVLinkState) or h.num_worst_tokens or st.max_pair is None
                              or st.topk_idx is not None for h, st in zip(handles, states)):
            return None
        r, dev = self.num_ranks, self.device
        row_bytes = x_row_bytes + 4 * record_words(num_scales, 0, False)
        max_pair, n_max = sum(st.max_pair for st in states), sum(st.num_tokens_max for st in states)
        if not self.holds_merged(max_pair, n_max, row_bytes):
            return None
        sent = torch.stack([st.num_tokens_per_rank for st in states])  # [C, R] rows to each destination
        got = torch.stack([st.summary[SUMMARY_HEAD + r:SUMMARY_HEAD + 2 * r] for st in states])  # [C, R] by source
        sent_before, got_before = sent.cumsum(0) - sent, got.cumsum(0) - got
        got_all = got.sum(0, dtype=torch.int32)
        prefix = got_all.cumsum(0, dtype=torch.int32) - got_all
        tail = torch.stack([st.summary[SUMMARY_HEAD + 3 * r:] for st in states]).sum(0, dtype=torch.int32)
        head = torch.zeros(SUMMARY_HEAD, dtype=torch.int32, device=dev)
        summary = torch.cat([head, prefix, got_all, sent.sum(0, dtype=torch.int32), tail])
        pos = torch.cat([st.pos + sent_before[c] for c, st in enumerate(states)])
        # row i of chunk c's output, from source s: row prefix[s] + (earlier chunks' rows from s) + (i - chunk c's
        # prefix[s]) of the merged output
        to_merged = torch.cat([(prefix + got_before[c] - st.recv_prefix[:r])[st.recv_src[:, 1].long()].long()
                               + torch.arange(st.recv_src.size(0), device=dev) for c, st in enumerate(states)])
        num_recv = sum(h.num_recv_tokens for h in handles)
        state = _NVLinkState(summary=summary, recv_src=torch.empty(0, 2, dtype=torch.int32, device=dev), pos=pos,
                             num_tokens_per_rank=sent.sum(0, dtype=torch.int32), num_tokens_max=n_max,
                             max_pair=max_pair)
        h0 = handles[0]
        handle = DispatchHandle(
            buffer_id=self.buffer_id, transport=self.name, num_ranks=r, num_experts=h0.num_experts,
            num_tokens=sum(h.num_tokens for h in handles), hidden=h0.hidden,
            is_token_in_rank=torch.cat([h.is_token_in_rank for h in handles]), num_tokens_per_rank=None,
            num_recv_tokens=num_recv, num_recv_tokens_per_rank=None, num_recv_tokens_per_expert=None,
            recv_src_rank=state.recv_src[:, 1], recv_src_idx=state.recv_src[:, 0], num_worst_tokens=0, state=state)
        return handle, to_merged

    def _em_targets(self, x, x_scales, rows: int, row_w, row_src, pair_row, recv_src, base, pidx, counts,
                    align: int) -> tuple:
        """``(recv_x [rows, H], recv_scales or None, ExpertMajorTargets)`` of an expert-major dispatch, its padding
        rows zeroed (``launch_em_pad`` with the per-expert ``counts``)."""
        from ..kernels.expert_major import ExpertMajorTargets, launch_em_pad

        recv_x = torch.empty(rows, x.size(1), dtype=x.dtype, device=self.device)
        recv_scales = (torch.empty(rows, x_scales.size(1), dtype=x_scales.dtype, device=self.device)
                       if x_scales is not None else None)
        targets = ExpertMajorTargets(
            recv_x.view(torch.int32), recv_scales.view(torch.int32) if recv_scales is not None else None, row_w,
            row_src, pair_row, recv_src, base, pidx, rows)
        if rows:
            launch_em_pad(targets, counts, align)
        return recv_x, recv_scales, targets

    def _cached_dispatch_expert_major(self, req: DispatchRequest) -> DispatchResult:
        """A cached dispatch of an expert-major handle: the receiving programs store every row straight into its
        expert-major rows again (the first dispatch's top-k ids, pair indices and placement table, kept in the
        handle), as the first dispatch did; no rank-major copy and no permute."""
        h: DispatchHandle = req.handle
        if isinstance(h.state, _LocalState):
            return self._local_cached_dispatch(req)
        st: _NVLinkState = h.state
        dev, x, rows = self.device, req.x, h.num_recv_rows
        k, m = h.num_topk, h.num_recv_tokens
        self.first_call("Buffer.dispatch", ("barrier",), self._barrier)
        plan_req = DispatchRequest(x, req.x_scales, st.topk_idx, None, st.num_tokens_per_rank, h.is_token_in_rank, None,
                                   h.num_experts, h.expert_alignment, h.num_worst_tokens, None, req.config, None,
                                   req.overlapped, layout="expert_major")
        # the placement the first dispatch recorded in the handle is written again into scratch (same values)
        recv_x, recv_scales, targets = self._em_targets(
            x, req.x_scales, rows, None, torch.empty(rows, dtype=torch.int32, device=dev),
            torch.empty(m, k, dtype=torch.int32, device=dev), torch.empty(m, 2, dtype=torch.int32, device=dev),
            st.em_base, st.em_pidx, h.num_recv_tokens_per_expert, h.expert_alignment)
        self._run_dispatch(plan_req, h.is_token_in_rank, st, None, m, h.num_worst_tokens, em=targets)
        return DispatchResult(recv_x, recv_scales, None, None, None, h)

    # ------------------------------------------------------------------ one rank, expert-major: nothing travels
    def _local_dispatch_expert_major(self, req: DispatchRequest) -> DispatchResult:
        """The expert-major dispatch of a one-rank group, where every valid pair is local and nothing travels: no
        exchange, no symmetric memory. ``local_pairs_kernel`` places the pairs from the layout's counts and checks
        them, a permute copies each token's row to its rows (padding zeroed); the host then reads the summary once
        (exact mode: the outputs are made for the bound ``N * K + E * (A - 1)`` rows and cut to the real count;
        ``num_worst_tokens``: no read, errors deferred). Its combine is the local reduction alone
        (``combine_expert_major``), its cached dispatches the permute alone."""
        from ..core.layout import expert_major_rows
        from ..kernels.expert_major import LOCAL_HEAD, launch_local_pairs

        fn = "Buffer.dispatch"
        x, scales, dev, align, worst = req.x, req.x_scales, self.device, req.expert_alignment, req.num_worst_tokens
        n, k = req.topk_idx.shape
        e = req.num_experts
        rows, cap = (expert_major_rows(worst, e, align), worst) if worst else (n * k + e * (align - 1), n)
        summary = torch.zeros(LOCAL_HEAD + e, dtype=torch.int32, device=dev)
        offs = torch.empty(e, dtype=torch.int32, device=dev)
        pair_row = (torch.full if worst else _empty)((cap, k), -1, dtype=torch.int32, device=dev)
        recv_src = (torch.full if worst else _empty)((cap, 2), -1, dtype=torch.int32, device=dev)
        pair_row_t = torch.empty(n, k, dtype=torch.int32, device=dev)
        row_src = torch.empty(rows, dtype=torch.int32, device=dev)
        row_w = torch.empty(rows, dtype=torch.float32, device=dev) if req.topk_weights is not None else None
        launch_local_pairs(req.topk_idx, req.num_tokens_per_expert, req.topk_weights, req.is_token_in_rank,
                           req.num_tokens_per_rank, offs, pair_row, pair_row_t, row_src, row_w, recv_src, summary,
                           self.deferred if worst else None, rows, align)
        recv_x, recv_scales = _permuted(x, scales, pair_row_t, rows, req.num_tokens_per_expert, align)
        counts = summary[LOCAL_HEAD:]
        if worst:
            num_recv, per_expert_list, sent = worst, [], None
        else:
            host = host_list(summary, fn, f"rank {self.rank}: the expert-major placement", backstop_s())
            num_recv, bad_topk, bad_layout, lost = host[:4]
            raise_if_bad_routing(fn, bad_topk, bad_layout, e)
            if lost:
                raise ValueError(f"{fn}: num_tokens_per_expert does not match topk_idx ({lost} pairs found no row); "
                                 f"pass both from the same get_dispatch_layout call")
            per_expert_list = align_all(host[LOCAL_HEAD:], align)
            rows = sum(per_expert_list)
            recv_x, row_src, row_w = recv_x[:rows], row_src[:rows], row_w[:rows] if row_w is not None else None
            pair_row, recv_src = pair_row[:num_recv], recv_src[:num_recv]
            recv_scales = recv_scales[:rows] if recv_scales is not None else None
            sent = (num_recv,)
        handle = DispatchHandle(
            buffer_id=self.buffer_id, transport=self.name, num_ranks=1, num_experts=e, num_tokens=n, hidden=x.size(1),
            is_token_in_rank=req.is_token_in_rank, num_tokens_per_rank=sent, num_recv_tokens=num_recv,
            num_recv_tokens_per_rank=sent, num_recv_tokens_per_expert=counts, recv_src_rank=recv_src[:, 1],
            recv_src_idx=recv_src[:, 0], num_worst_tokens=worst, state=_LocalState(pair_row_t),
            layout="expert_major", expert_alignment=align, num_recv_rows=rows, num_topk=k, expert_offsets=offs,
            recv_pair_row=pair_row, recv_row_src=row_src, recv_row_weights=row_w)
        return DispatchResult(recv_x, recv_scales, offs, row_w, per_expert_list, handle)

    def _local_cached_dispatch(self, req: DispatchRequest) -> DispatchResult:
        h: DispatchHandle = req.handle
        recv_x, recv_scales = _permuted(req.x, req.x_scales, h.state.pair_row_t, h.num_recv_rows,
                                        h.num_recv_tokens_per_expert, h.expert_alignment)
        return DispatchResult(recv_x, recv_scales, None, None, None, h)

    def combine_expert_major(self, req: CombineRequest) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One rank (a handle of ``_local_dispatch_expert_major``): the local reduction by token, straight into the
        output without bias (what the rank-major combine of the one partial returns, bit for bit: ``+0.0 +
        float(partial)`` is the partial, never -0.0), with biases added by the ordered reduction of that one row;
        other handles: the reduction and the rank-major combine of its partials (``Transport.combine_expert_major``)."""
        h: DispatchHandle = req.handle
        if not isinstance(h.state, _LocalState):
            return super().combine_expert_major(req)
        from ..kernels.expert_major import launch_expert_reduce
        from ..kernels.reduce import reduce_rows

        n, dev = h.num_tokens, self.device
        out = torch.empty(n, req.x.size(1), dtype=req.x.dtype, device=dev)
        values = torch.empty(n, h.num_topk, dtype=torch.float32, device=dev) if req.topk_weights is not None else None
        partial = torch.empty_like(out) if req.bias else out
        launch_expert_reduce(req.x.contiguous(), h.state.pair_row_t, req.row_weights, req.topk_weights, partial, values)
        if req.bias:
            reduce_rows(partial, torch.arange(n, dtype=torch.int32, device=dev).view(n, 1), req.bias, out=out)
        return out, values

    def combine(self, req: CombineRequest) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        from ..kernels.reduce import OwnRows

        h: DispatchHandle = req.handle
        st: _NVLinkState = h.state
        x, dev = req.x, self.device
        m, n = x.size(0), h.num_tokens
        xw = _words(x)
        k = req.topk_weights.size(1) if req.topk_weights is not None else 0
        geometry = st.rounds((xw + k) * 4, self.area_bytes, self.num_ranks, h.num_worst_tokens, "Buffer.combine")
        if req.out is not None:
            out, out_w = req.out
            if (tuple(out.shape) != (n, x.size(1)) or out.dtype != x.dtype or (out_w is None) != (k == 0)
                    or (k and (tuple(out_w.shape) != (n, k) or out_w.dtype != torch.float32))):
                raise ValueError(f"Buffer.combine: the outputs to write into are {tuple(out.shape)} {out.dtype} and "
                                 f"{None if out_w is None else (tuple(out_w.shape), out_w.dtype)}; this combine makes "
                                 f"{(n, x.size(1))} {x.dtype} and {(n, k) if k else None} float32")
        else:
            out = torch.empty(n, x.size(1), dtype=x.dtype, device=dev)
            out_w = torch.empty(n, k, dtype=torch.float32, device=dev) if k else None
        grid = self._num_sms(req.config, m, (xw + k) * 4)
        own_x = x if m else self.area[:xw * 4].view(x.dtype).view(1, -1)  # nothing to read when no rows came
        own = OwnRows(own_x, req.topk_weights.contiguous() if k else None, st.recv_prefix,
                      self.rank)
        # the first combine of a kind compiles its kernels before any rank waits (Transport.first_call)
        self.first_call("Buffer.combine", ("combine", x.dtype, x.size(1), k, len(req.bias), bool(h.num_worst_tokens),
                         geometry.num_rounds == 1), lambda: self._combine_rounds(req, geometry, out, out_w, grid, own))
        return out, out_w

    def _combine_rounds(self, req: CombineRequest, geometry: _Rounds, out, out_w, grid: int, own) -> None:
        """The combine's launches, round by round: push (barrier, rows, arrival) and reduce."""
        from ..kernels.ep import PUSH_WARPS, chunk_block, combine_push_kernel, pow2_block
        from ..kernels.reduce import reduce_from_layout

        h: DispatchHandle = req.handle
        st: _NVLinkState = h.state
        num_ranks, rank, dev = self.num_ranks, self.rank, self.device
        x = req.x
        m, n = x.size(0), h.num_tokens
        xw = _words(x)
        k = req.topk_weights.size(1) if req.topk_weights is not None else 0
        cap, num_rounds = geometry.cap, geometry.num_rounds
        area_off = self._off(self.area)
        w_rel = align_up(num_ranks * cap * xw * 4, 256)
        buf = self.area[:num_ranks * cap * xw * 4].view(x.dtype).view(num_ranks * cap, -1)
        wbuf = self.area[w_rel:w_rel + num_ranks * cap * k * 4].view(torch.float32).view(num_ranks * cap, k) if k else None
        recv_src = st.recv_src if m else self.counters
        x_words = x.view(torch.int32) if m else torch.empty(1, xw, dtype=torch.int32, device=dev)
        w_in = req.topk_weights.contiguous() if k else self.counters
        tok = _tokens_per_step(req.config)
        single = num_rounds == 1
        cum = None
        if not single:
            cum = torch.cat([torch.zeros(1, num_ranks, dtype=torch.int64, device=dev),
                             torch.cumsum(h.is_token_in_rank, dim=0, dtype=torch.int64)])
            src_rank = h.recv_src_rank.long()
            src_tok = h.recv_src_idx.long()
            valid = src_rank >= 0
            src_safe = src_rank.clamp(min=0)
            k_in_src = torch.arange(m, device=dev) - st.recv_prefix.long()[src_safe]
        for j in range(num_rounds):
            lo, hi = (0, n) if single else (min(j * cap, n), min((j + 1) * cap, n))
            dst_row = self.counters
            if not single:
                lo_t, hi_t = j * cap, (j + 1) * cap
                in_rng = valid & (src_tok >= lo_t) & (src_tok < hi_t)
                before = torch.zeros(num_ranks, dtype=torch.int64, device=dev)
                before.index_add_(0, src_safe, (valid & (src_tok < lo_t)).long())
                dst_row = torch.where(in_rng, rank * cap + k_in_src - before[src_safe], -1)
            # one launch: barrier, push, wait for every rank's rows (combine_push_kernel)
            launch(combine_push_kernel, (grid,),
                x_words, w_in, recv_src, st.recv_prefix, dst_row, self.heap.peer_bases, area_off, area_off + w_rel,
                self._off(self.flags), self._off(self.arrive), self.epoch, self.counters[1:], self.err, m, cap, rank,
                num_ranks, self._timeout(), XW=xw, K=max(k, 1), R_POW2=self.r_pow2, TOK=tok,
                BLOCK=chunk_block(xw, tok), BLOCK_K=pow2_block(k), HAS_W=k > 0, SINGLE_ROUND=single,
                VEC=xw % 4 == 0, INTERLEAVE=num_ranks > NARROW_RANKS, num_warps=PUSH_WARPS, **self.flags_kw,
                **self.timer_kw)
            if hi > lo:
                first = None if single else cum[lo].to(torch.int32)
                reduce_from_layout(buf, h.is_token_in_rank, st.pos, cap, lo, hi, req.bias, out, first, wbuf, out_w,
                                   programs=grid if _strict(req) else None, own=own)

    # ------------------------------------------------------------------ low-latency mode (epcomm.transports.low_latency)
    def low_latency_dispatch(self, req: LowLatencyDispatchRequest) -> LowLatencyDispatchResult:
        return self._ll.dispatch(req)

    def low_latency_combine(self, req: LowLatencyCombineRequest) -> LowLatencyCombineResult:
        return self._ll.combine(req)

    def low_latency_combine_buffer(self, handle):
        return self._ll.combine_buffer(handle)

    def warmup_low_latency(self, shape: tuple) -> None:
        self._ll.warmup(shape)

    def destroy(self) -> None:
        self._ll.destroy()
        if self.heap is not None:
            self.heap.destroy()


class P2PTransport(NVLinkTransport):
    """The same one-sided protocol for P2P without NVLink or without native P2P atomics (PCIe boards): it
    needs no remote atomics (single-writer flags only)."""

    name = "p2p"
    link_gbps = 25.0  # PCIe 4/5 x16 in practice
    description = "one-sided Triton kernels with single-writer flags, for P2P without NVLink or atomics"


def _permuted(x, scales, pair_row_t, rows: int, counts, align: int) -> tuple:
    """``(recv_x [rows, H], recv_scales or None)`` of a one-rank expert-major dispatch: the rows of ``x`` (and its
    scales) at ``pair_row_t [N, K]``, padding rows of the segments of ``counts`` zeroed (``expert_major.permute``)."""
    from .expert_major import permute

    return (permute(x, pair_row_t, rows, counts, align),
            permute(scales, pair_row_t, rows, counts, align) if scales is not None else None)


def _known_summary(known, num_ranks: int, e_local: int, has_experts: bool) -> list:
    """The summary the exchange kernel writes (``kernels.ep``), made from counts known beforehand (``KnownCounts``)."""
    from ..kernels.ep import SUMMARY_HEAD

    recv = list(known.num_recv_tokens_per_rank)
    if len(recv) != num_ranks or len(known.num_tokens_per_rank) != num_ranks or (
            has_experts and len(known.num_recv_tokens_per_expert) != e_local):
        raise ValueError(f"Buffer.dispatch: the known counts are for another group ({len(recv)} ranks, "
                         f"{len(known.num_recv_tokens_per_expert)} local experts; this one has {num_ranks} and "
                         f"{e_local})")
    prefix, total = [], 0
    for c in recv:
        prefix.append(total)
        total += c
    head = [total, known.max_pair, known.num_tokens_max] + [0] * (SUMMARY_HEAD - 3)
    experts = list(known.num_recv_tokens_per_expert) if has_experts else [0] * max(e_local, 1)
    return head + prefix + recv + list(known.num_tokens_per_rank) + experts


def _recv_per_expert(summary: torch.Tensor, num_ranks: int, e_local: int) -> torch.Tensor:
    """The rows this rank receives per local expert, from the exchange's summary (int32 on the device)."""
    from ..kernels.ep import summary_per_expert

    return summary_per_expert(summary, num_ranks, e_local)


def _tag(epoch: int) -> int:
    """``epoch << 32`` as an int64 (the low 32 bits of the epoch in the high half), as the kernels tag words."""
    tag = (epoch & 0xFFFFFFFF) << 32
    return tag - (1 << 64) if tag >= 1 << 63 else tag


def _words(t: torch.Tensor) -> int:
    nbytes = t.size(1) * t.element_size()
    if nbytes % 4:
        raise ValueError(f"Buffer.dispatch: rows of {nbytes} bytes; the one-sided transports need rows that are a "
                         f"multiple of 4 bytes (hidden a multiple of 8)")
    return nbytes // 4


def _strict(req) -> bool:
    """Whether the local passes keep to ``num_sms`` programs too (``Config.strict_sms``; None: when the call is
    meant to overlap the caller's kernels). Bounded, they cost ~100 us (dispatch) and ~110-210 us (combine)
    more at DeepSeek sizes on 4xH200."""
    strict = req.config.strict_sms
    return req.overlapped if strict is None else strict


def _tokens_per_step(config) -> int:
    """Tokens a program moves per step: ``Config.num_max_nvl_chunked_send_tokens`` rounded down to a power
    of two, at most 16."""
    v = max(1, min(16, config.num_max_nvl_chunked_send_tokens))
    return 1 << (v.bit_length() - 1)


def _columns(t: Optional[torch.Tensor]) -> Optional[tuple]:
    """``(columns, dtype)`` of a 2-D tensor, or None (``alloc_recv``'s ``scales``)."""
    return None if t is None else (t.size(1), t.dtype)


def _empty(shape, fill, dtype, device):
    return torch.empty(shape, dtype=dtype, device=device)


def _interpreted() -> bool:
    from ..kernels.shmem import interpreted

    return interpreted()
