"""Low-latency (decode) dispatch and combine over one-sided symmetric memory: ``OneSidedLowLatency``.

The one-sided transports (``nvlink``, ``p2p``) delegate their ``low_latency_*`` calls here. Results are
bit-identical to the portable transport and ``epcomm.reference`` (same layouts, same FP8 cast, same ordered
FP32 combine); the kernels are in ``epcomm.kernels.low_latency``.

Storage (symmetric, per rank): arrival flags ``[2 kinds, 2 parities, R]`` and an area partitioned once
into ``[D0 | D1 | C0 | C1]``: two dispatch areas (``R`` source regions of ``C = T * min(K, E_local)`` rows:
payload, scales, ``token * K + slot``, plus per (source, expert) counts) and two combine areas (``T * K``
bf16 rows, one per (token, slot) of this rank); ``epcomm.core.layout.low_latency_area`` lays out one
call shape, ``get_low_latency_rdma_size_hint`` states the total. The partition never depends on the call's
shape: a rank that has moved on to a call of another shape must not write where a slower peer still reads.
The storage is a ``SymmetricHeap`` of its own, created at construction when ``nbytes`` is given (DeepEP's
``num_rdma_bytes``: split in the proportions of the first call), else at the first call, and replaced by a
larger one (collectively: every rank makes the same calls) when a call does not fit; the old one stays
alive for results still pending. Allocating is refused while a CUDA graph is being captured. Or carve
it from a given heap (fixed size).

Protocol (no host synchronisation, fixed shapes, no remote atomics, single-writer flags):
  * dispatch call ``d`` (counted on the device, so a captured graph alternates buffers on every replay)
    uses parity ``d & 1``. The send half: every (token, slot) computes its row in region ``rank`` of its
    destination locally (its rank among this rank's pairs for that destination, ordered by (expert, token,
    slot)); each token is read and FP8-cast once and stored to every destination with its scales and
    ``token * K + slot`` (a pre-cast request, ``LowLatencyDispatchRequest.x_scales``: its e4m3 bytes and float32
    scales are stored as they are, UE8M0 exponents packed from the scales; the hierarchical path casts at the
    source and forwards); counts per (source, expert) go to the receivers; then every program fences and
    arrives, and the last one release-stores the epoch ``d + 1`` into flag ``(dispatch, d & 1, rank)`` of
    every rank. The receive half waits for all ``R`` flags (a timeout records an error instead of hanging),
    then compacts each source's rows into ``recv_x [E_local, R * T, H]`` (source-major, then token, slot)
    and writes ``recv_count``, ``layout_range``, ``src_info`` (-1 past the count) and a private ``route`` per
    row (source rank, token, slot) that combine uses.
  * combine call ``c`` uses parity ``c & 1``: the send half stores each received row into row
    ``token * K + slot`` of its source's combine area and releases epoch ``c + 1`` to every rank; the receive
    half waits for all ``R`` flags and reduces ``sum_k w * float(y)`` in slot order into bf16.
  * A plain call is one fused kernel on GPUs (the send half, then the receive half in the same programs; a
    cooperative launch of at most one program per SM, so that every program is resident whatever else runs) or
    two launches (``fused=False``; the interpreter). With
    ``return_recv_hook=True`` the call launches the send half and returns; ``hook()`` launches the receive
    half (the first time it is called).

How many results may be pending: the storage is double-buffered per kind, so call ``j`` of a kind (dispatch
or combine) reuses the storage of call ``j - 2`` of that kind, and every rank must have received call
``j - 2`` (run its hook) before any rank sends call ``j``. Plain calls, hooks run before the next call of
the same kind, and two micro-batches per layer (``D0 D1``, hooks, ``C0 C1``, hooks: two dispatch and two
combine results pending) satisfy this through the calls' own data dependencies; a third pending result of
one kind does not. All calls of one instance must be issued in one stream order (call and arrival counters are
per instance; the Buffer orders its calls across streams). A receive whose peer never sends records a timeout
(``EPCOMM_TIMEOUT_S``) into the error words of ``ctl`` (``describe_errors`` names the rank, the peer and the call);
later receives of the instance fail fast, and the owner raises (``transports.device_errors``) until ``reset()``
(collective) puts every rank's flags and counters back to their state after construction.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .. import env
from ..core.handles import LowLatencyHandle
from ..core.validate import check_precast
from ..core.layout import LOW_LATENCY_ALIGN, low_latency_area, low_latency_flag_bytes
from ..kernels.launch import next_pow2
from ..errors import BufferTooSmallError, EpcommError
from ..fp8 import FP8_DTYPE, GROUP
from .base import (LowLatencyCombineRequest, LowLatencyCombineResult, LowLatencyDispatchRequest,
                   LowLatencyDispatchResult, compile_then_meet)


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Geometry:
    """What the host computes once per call shape and storage: output shapes and the kernels' constants."""

    e_local: int
    scale_dtype: Optional[torch.dtype]
    scale_words: int
    payload_dtype: torch.dtype
    hmeta_words: int
    dispatch: object  # epcomm.kernels.low_latency.Launcher
    combine: object


@dataclass(frozen=True)
class _State:
    """Transport-private part of a LowLatencyHandle."""

    shape: tuple  # (T, hidden, topk, experts, fp8, round, ue8m0, x dtype)
    hmeta: torch.Tensor  # int32: recv_count | layout_range | src_info | route
    zero_copy_index: int


class OneSidedLowLatency:
    """Low-latency dispatch/combine with one-sided Triton kernels; see the module docstring.

    Arguments:
        group, device: the process group and this rank's device (CUDA, or the CPU under the Triton
            interpreter).
        buffer_id, name: stamped into handles (the owning Buffer's id, the transport's name).
        heap: carve the storage from this ``SymmetricHeap`` (``nbytes`` of it, fixed) instead of owning one.
        nbytes: bytes of storage to create now (0: size it at the first call and grow as needed).
        fused: one kernel per plain call (default on CUDA); False launches send and receive halves apart.
        ctl: the int64 ``[CTL_WORDS]`` control words (``epcomm.kernels.low_latency``) to use, e.g. a view into the
            owner's block of error words (default: made here).
    Collective: construction (when it allocates), every call and ``destroy``, on every rank of the group."""

    def __init__(self, group, device: torch.device, buffer_id: int = 0, name: str = "nvlink", heap=None,
                 nbytes: int = 0, fused: Optional[bool] = None, ctl: Optional[torch.Tensor] = None) -> None:
        from ..kernels import low_latency as K
        from ..kernels.shmem import num_sms

        self._K = K
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.device = torch.device(device)
        self.buffer_id = buffer_id
        self.name = name
        self._on_gpu = self.device.type == "cuda"
        self._ctl = ctl if ctl is not None else torch.zeros(K.CTL_WORDS, dtype=torch.int64, device=self.device)
        self._fused = self._on_gpu if fused is None else bool(fused)
        self._sms = num_sms(self.device)
        self._heaps: list = []  # heaps created here, kept until destroy (pending results may use an old one)
        self._given_heap = heap
        self._heap = None
        self._area = None
        self._budget = 0
        self._part: Optional[tuple] = None  # (bytes per dispatch area, bytes per combine area)
        self._geoms: dict = {}
        self._needs: dict = {}
        self._zero_copy: dict = {}
        self._calls = [0, 0]  # host-side dispatch / combine counts: info ring slot, zero-copy buffer choice
        self._ready: set = set()  # (shape, kind) whose first call on the present storage was made (_first)
        self._destroyed = False
        if heap is not None:
            self._attach(heap, int(nbytes))
        elif nbytes:
            self._grow(int(nbytes), f"{type(self).__name__}(nbytes={nbytes})")

    # ------------------------------------------------------------------ storage
    def _attach(self, heap, nbytes: int) -> None:
        flags = heap.empty((2, 2, self.num_ranks), torch.int64)
        area = heap.empty((max(nbytes, 1),), torch.uint8)
        # each kind's flags start at its call counter (0, unless start_epochs moved it): the calls of the counter
        # and after wait for later epochs
        state = self._ctl[self._K.CTL_STATE:self._K.CTL_STATE + 2]
        flags.copy_(state.view(2, 1, 1).expand(2, 2, self.num_ranks))
        if self._on_gpu:
            torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)  # every flag is zero before any peer may release into it
        self._heap, self._flags, self._area = heap, flags, area
        self._budget = nbytes
        self._part = None
        self._off_flag = heap.offset_of(flags)
        self._off_area = heap.offset_of(area)
        self._local_base = flags.data_ptr() - self._off_flag
        self._geoms.clear()
        self._ready.clear()

    def _grow(self, nbytes: int, why: str) -> None:
        from ..shmem import SymmetricHeap

        if self._given_heap is not None:
            raise BufferTooSmallError(f"{why}: needs {nbytes} bytes of low-latency storage, the part of the heap "
                                      f"given at construction has {self._budget}; pass a larger num_rdma_bytes "
                                      f"(Buffer.get_low_latency_rdma_size_hint)")
        if self._on_gpu and torch.cuda.is_current_stream_capturing():
            raise BufferTooSmallError(
                f"{why}: needs {nbytes} bytes of low-latency storage, this Buffer has {self._budget}, and storage "
                f"cannot be allocated while a CUDA graph is being captured: pass num_rdma_bytes >= "
                f"{nbytes + low_latency_flag_bytes(self.num_ranks)} (Buffer.get_low_latency_rdma_size_hint) or make "
                f"one call of this shape before capturing")
        try:
            heap = SymmetricHeap(self.group, low_latency_flag_bytes(self.num_ranks) + nbytes + LOW_LATENCY_ALIGN,
                                 self.device)
        except torch.cuda.OutOfMemoryError as exc:
            raise BufferTooSmallError(f"{why}: could not allocate {nbytes} bytes of symmetric memory for "
                                      f"low-latency mode ({exc})") from exc
        self._heaps.append(heap)
        self._attach(heap, nbytes)

    def _fit(self, need_d: int, need_c: int, roomy_d: int, why: str) -> None:
        """Make the partition hold a call needing ``need_d`` bytes per dispatch area and ``need_c`` per combine
        area: split storage sized by the caller in this call's proportions, or allocate new storage
        (``roomy_d``: the dispatch size to provision, room for the BF16 and FP8 variants of the shape)."""
        part = self._part
        if part is not None and need_d <= part[0] and need_c <= part[1]:
            return
        if part is None and self._area is not None:
            half = self._budget // 2
            for want_d in (max(roomy_d, need_d), need_d):  # room for both payload kinds if the budget allows
                if want_d + need_c > half:
                    continue
                d = max(want_d, half * want_d // (want_d + need_c) // LOW_LATENCY_ALIGN * LOW_LATENCY_ALIGN)
                c = (half - d) // LOW_LATENCY_ALIGN * LOW_LATENCY_ALIGN
                if c >= need_c:
                    self._set_part(d, c)
                    return
        d = max(roomy_d, need_d, part[0] if part else 0)
        c = max(need_c, part[1] if part else 0)
        if self._area is not None and self.rank == 0:
            log.warning("%s: %d bytes of low-latency storage do not hold this call's %d; allocating %d more (pass "
                        "num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(...) to avoid it)", why,
                        self._budget, 2 * (need_d + need_c), 2 * (d + c))
        self._grow(2 * (d + c), why)
        self._set_part(d, c)

    def _set_part(self, d: int, c: int) -> None:
        self._part = (d, c)
        self._geoms.clear()  # the kernels' offsets change: every variant compiles anew, first calls meet again
        self._ready.clear()

    # ------------------------------------------------------------------ geometry
    def _geometry(self, shape: tuple, n_tokens: int, why: str) -> _Geometry:
        """The constants of a call of ``shape = (T, hidden, topk, experts, fp8, round, ue8m0, x dtype)`` with
        ``n_tokens`` tokens on this rank, on storage made to fit it (cached: one lookup per repeated call;
        the cache is emptied whenever the storage changes)."""
        geo = self._geoms.get((shape, n_tokens))
        if geo is not None:
            return geo
        needs = self._needs.get(shape)
        if needs is None:
            needs = self._needs[shape] = self._shape_needs(shape)
        self._fit(*needs, why)
        key = shape + self._tuning(n_tokens, shape[2])
        geo = self._geoms.get(key)
        if geo is None:
            geo = self._geoms[key] = self._make_geometry(key)
        self._geoms[(shape, n_tokens)] = geo
        return geo

    def _shape_needs(self, shape: tuple) -> tuple:
        t_max, hidden, topk, num_experts, use_fp8, _round, use_ue8m0, x_dtype = shape
        r, e_local = self.num_ranks, num_experts // self.num_ranks
        pay, sw = self._payload(hidden, use_fp8, use_ue8m0, x_dtype)
        lay = low_latency_area(t_max, hidden, r, e_local, topk, pay, sw)
        bf16 = low_latency_area(t_max, hidden, r, e_local, topk, 2 * hidden, 0)
        fp8 = low_latency_area(t_max, hidden, r, e_local, topk, hidden, hidden // GROUP)
        roomy = max(bf16["dispatch_bytes"], fp8["dispatch_bytes"])  # what the size hint provisions
        return lay["dispatch_bytes"], lay["combine_bytes"], roomy

    @staticmethod
    def _payload(hidden: int, use_fp8: bool, use_ue8m0: bool, x_dtype: torch.dtype) -> tuple:
        """``(payload bytes per row, scale words per row)``."""
        if use_fp8:
            groups = hidden // GROUP
            return hidden, (-(-groups // 4) if use_ue8m0 else groups)
        return hidden * torch.empty((), dtype=x_dtype).element_size(), 0

    def _tuning(self, n_tokens: int, topk: int) -> tuple:
        """``(rows, kper)`` from this rank's token count (what the others send is alike when decoding): rows per
        step of the copy loops (1 when few rows arrive: spread them over programs) and slots per send item
        (fewer when there are few tokens, so that more programs share the stores)."""
        kp = next_pow2(topk)
        kper = kp
        while kper > 1 and n_tokens * (kp // kper) < self._sms:
            kper //= 2
        return (1 if n_tokens * topk < 2 * self._sms else 4), kper

    def _make_geometry(self, key: tuple) -> _Geometry:
        t_max, hidden, topk, num_experts, use_fp8, round_scale, use_ue8m0, x_dtype, rows, kper = key
        r = self.num_ranks
        e_local = num_experts // r
        groups = hidden // GROUP
        payload_bytes, scale_words = self._payload(hidden, use_fp8, use_ue8m0, x_dtype)
        lay = low_latency_area(t_max, hidden, r, e_local, topk, payload_bytes, scale_words)
        d_bytes, c_bytes = self._part
        xw = payload_bytes // 4
        xwp = next_pow2(xw)
        hwp = next_pow2(hidden // 2)
        jb = max(64, min(1024, 4096 // kper))
        common = dict(RANK=self.rank, R=r, R_P=max(2, next_pow2(r)), T=t_max, K=topk, E_L=e_local,
                      E_LP=max(2, next_pow2(e_local)), H=hidden, OFF_FLAG=self._off_flag, USE_PTX=self._on_gpu,
                      USE_TIMER=self._on_gpu, num_warps=8)
        dispatch_consts = dict(
            common, K_P=max(2, next_pow2(topk)), KPER=kper, FP8=use_fp8, ROUND=round_scale, UE8M0=use_ue8m0,
            PRECAST=x_dtype == FP8_DTYPE, XW=xw,
            XWP=xwp, SW=max(scale_words, 1), SWP=next_pow2(max(scale_words, 1)), G4P=next_pow2(-(-groups // 4)),
            C=lay["cap"],
            OFF_D=self._off_area, D_BYTES=d_bytes, OFF_PAY=lay["pay"], OFF_SCL=lay["scl"], OFF_META=lay["meta"],
            OFF_CNT=lay["cnt"], JB=jb, EB=max(8, min(64, 8192 // jb)), ROWS=max(1, min(rows, 8192 // xwp)),
            FB=1024)
        combine_consts = dict(common, HWP=hwp, OFF_C=self._off_area + 2 * d_bytes, C_BYTES=c_bytes,
                              ROWS=max(1, min(rows, 8192 // hwp)),
                              BC=min(1024 if rows == 1 else 2048, next_pow2(hidden)))
        return _Geometry(e_local=e_local,
                         scale_dtype=(torch.int32 if use_ue8m0 else torch.float32) if use_fp8 else None,
                         scale_words=scale_words, payload_dtype=FP8_DTYPE if use_fp8 else x_dtype,
                         hmeta_words=e_local * (1 + 2 * r + 2 * r * t_max),
                         dispatch=self._K.dispatch_launcher(dispatch_consts),
                         combine=self._K.combine_launcher(combine_consts))

    def _grid(self, fused: bool) -> int:
        # fused: every program must be resident (a cooperative launch on GPUs, capped at what fits: StageLauncher;
        # the interpreter runs programs in turn)
        return 1 if fused and not self._on_gpu else self._sms

    def _timeout(self) -> int:
        from ..kernels.shmem import timeout_units

        return timeout_units(env.timeout_s(), self.device)

    # ------------------------------------------------------------------ calls
    def dispatch(self, req: LowLatencyDispatchRequest) -> LowLatencyDispatchResult:
        fn = "Buffer.low_latency_dispatch"
        self._alive(fn)
        x, idx, xs = req.x, req.topk_idx, req.x_scales
        if xs is not None:  # pre-cast: the kernel stores the bytes and scales as they are
            check_precast(fn, x, xs, req.use_fp8)
        if idx.dtype != torch.int64 or not idx.is_contiguous():  # one kernel variant (what warmup compiles)
            idx = idx.to(torch.int64).contiguous()
        n, hidden = x.shape
        t_max, num_experts, topk = req.num_max_dispatch_tokens_per_rank, req.num_experts, idx.size(1)
        shape = call_shape(t_max, hidden, topk, num_experts, req.use_fp8, req.round_scale, req.use_ue8m0, x.dtype)
        geo = self._geometry(shape, n, fn)
        dev, e_local, rt = self.device, geo.e_local, self.num_ranks * t_max
        recv_x = torch.empty((e_local, rt, hidden), dtype=geo.payload_dtype, device=dev)
        if geo.scale_dtype is not None:
            scales = torch.empty((e_local, geo.scale_words, rt), dtype=geo.scale_dtype, device=dev)
            recv_scales = scales.transpose(1, 2)  # DeepEP's column-major scales
        else:
            scales, recv_scales = self._ctl, None
        hmeta = torch.empty(geo.hmeta_words, dtype=torch.int32, device=dev)
        calls = self._calls[0]
        self._calls[0] = calls + 1
        args = self._dispatch_args(n, x if xs is None else x.view(torch.uint8), xs, idx, recv_x, scales, hmeta,
                                   calls % self._K.INFO_RING)
        self._first(shape, "dispatch", geo.dispatch, args)
        hook = self._run(geo.dispatch, args, req.return_recv_hook)
        m_src = e_local + 2 * e_local * self.num_ranks
        handle = LowLatencyHandle(
            buffer_id=self.buffer_id, transport=self.name, num_max_dispatch_tokens_per_rank=t_max, hidden=hidden,
            num_experts=num_experts, num_ranks=self.num_ranks, num_tokens=n, num_topk=topk,
            src_info=hmeta[m_src:m_src + e_local * rt].view(e_local, rt),
            layout_range=hmeta[e_local:m_src].view(e_local, self.num_ranks, 2), recv_count=hmeta[:e_local],
            state=_State(shape=shape, hmeta=hmeta, zero_copy_index=calls % 2))
        return LowLatencyDispatchResult(recv_x, recv_scales, handle.recv_count, handle, hook)

    def combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The ``[E_local, R * T, H]`` bf16 tensor a ``zero_copy`` combine with ``handle`` reads: one of two, by
        the parity of its dispatch, so two micro-batches in flight get different ones."""
        e_local = handle.num_experts // handle.num_ranks
        shape = (e_local, handle.num_ranks * handle.num_max_dispatch_tokens_per_rank, handle.hidden)
        key = (shape, handle.state.zero_copy_index)
        buf = self._zero_copy.get(key)
        if buf is None:
            buf = self._zero_copy[key] = torch.empty(shape, dtype=torch.bfloat16, device=self.device)
        return buf

    def combine(self, req: LowLatencyCombineRequest) -> LowLatencyCombineResult:
        fn = "Buffer.low_latency_combine"
        self._alive(fn)
        h: LowLatencyHandle = req.handle
        st: _State = h.state
        geo = self._geometry(st.shape, h.num_tokens, fn)
        y = self.combine_buffer(h) if req.zero_copy else req.x
        if not y.is_contiguous():
            y = y.contiguous()
        n, hidden, dev = h.num_tokens, h.hidden, self.device
        out = req.out if req.out is not None else torch.empty((n, hidden), dtype=torch.bfloat16, device=dev)
        target = out if out.is_contiguous() else torch.empty((n, hidden), dtype=torch.bfloat16, device=dev)
        calls = self._calls[1]
        self._calls[1] = calls + 1
        args = self._combine_args(n, y, req.topk_idx.to(torch.int64).contiguous(), req.topk_weights.contiguous(),
                                  target, st.hmeta, calls % self._K.INFO_RING)
        self._first(st.shape, "combine", geo.combine, args)
        after = None if target is out else (lambda: out.copy_(target))
        hook = self._run(geo.combine, args, req.return_recv_hook, after)
        return LowLatencyCombineResult(out, hook)

    def _dispatch_args(self, n: int, x, xs, idx, recv_x, scales, hmeta, info_slot: int) -> tuple:
        """``ll_dispatch_kernel``'s runtime arguments (a ``torch.dtype`` may stand for a tensor: compile_only);
        ``xs``: the pre-cast scales (None: not pre-cast)."""
        ctl = self._ctl
        xs = ctl if xs is None or not n else xs
        return (x if n else ctl, xs, idx if n else ctl, recv_x, scales, hmeta, self._heap.peer_bases, ctl, n, info_slot,
                self._local_base, self._timeout())

    def _combine_args(self, n: int, y, idx, w, out, hmeta, info_slot: int) -> tuple:
        """``ll_combine_kernel``'s runtime arguments (as ``_dispatch_args``)."""
        ctl = self._ctl
        return (y, idx if n else ctl, w if n else ctl, out if n else ctl, hmeta, self._heap.peer_bases, ctl, n,
                info_slot, self._local_base, self._timeout())

    def _halves(self) -> tuple:
        """The ``(send, receive)`` launches a call can make: the fused kernel (plain calls on GPUs) and the halves
        (hooks, and plain calls elsewhere)."""
        return ((True, True),) * self._fused + ((True, False), (False, True))

    def _first(self, shape: tuple, kind: str, launch, args: tuple) -> None:
        """Before the first ``kind`` call of ``shape`` on this storage (the same call on every rank): compile the
        variants this call launches (``launch(..., args)``, plain or hook) and every other one that calls of this
        shape can launch (``_compile_variants``), and meet the other ranks, so that no receive starts its timeout
        while a peer compiles, now or at a later call whose token count only some ranks have."""
        if (shape, kind) in self._ready:
            return
        self._ready.add((shape, kind))
        self._compile_variants(shape, (kind,), f"Buffer.low_latency_{kind}",
                               lambda: [launch(self._grid(s and r), args, s, r) for s, r in self._halves()])

    def warmup(self, shape: tuple) -> None:
        """Collective: make the storage hold calls of ``shape`` (``call_shape``) and compile every kernel variant
        they can launch (``_compile_variants``), dispatch and combine; then meet the other ranks."""
        self._geometry(shape, shape[0], "Buffer.warmup")  # storage first: it fixes the kernels' offsets
        self._compile_variants(shape, ("dispatch", "combine"), "Buffer.warmup")
        self._ready.update({(shape, "dispatch"), (shape, "combine")})

    def _compile_variants(self, shape: tuple, kinds: tuple, what: str, also: Optional[Callable] = None) -> None:
        """Collective: compile every variant of the ``kinds`` kernels that calls of ``shape`` can launch (one token
        count per tuning range, and an empty rank, which passes other argument types; plain and hook), and those
        ``also()`` launches, several at once, then meet the other ranks (``compile_then_meet``)."""
        import os

        t_max, topk = shape[0], shape[2]
        counts = {}  # one token count per tuning range, and 0
        for n in range(t_max, -1, -1):
            counts.setdefault(self._tuning(n, topk) if n else None, n)

        def compile_all() -> None:
            for n in counts.values():
                geo = self._geometry(shape, n, what)
                scales = geo.scale_dtype or self._ctl
                precast = shape[7] == FP8_DTYPE  # x as bytes, float32 scales
                x_arg, xs_arg = (torch.uint8, torch.float32) if precast else (shape[7], None)
                calls = {"dispatch": (geo.dispatch, self._dispatch_args(n, x_arg, xs_arg, torch.int64,
                                                                        geo.payload_dtype, scales, torch.int32, 0)),
                         "combine": (geo.combine, self._combine_args(n, torch.bfloat16, torch.int64, torch.float32,
                                                                     torch.bfloat16, torch.int32, 0))}
                for kind in kinds:
                    launch, args = calls[kind]
                    for s, r in self._halves():
                        launch(self._grid(s and r), args, s, r)
            if also is not None:
                also()

        compile_then_meet(self.group, self.device, compile_all, what, threads=min(16, os.cpu_count() or 1))

    def _run(self, launch, args: tuple, hook: bool, after=None):
        """Launch a call: the send half now and the receive half in the returned hook, or both now (one fused
        kernel, or two launches). ``after``: host work that follows the receive half."""
        if hook:
            launch(self._grid(False), args, True, False)
            return _Once(self._receive, launch, args, after)
        if self._fused:
            launch(self._grid(True), args, True, True)
            if after is not None:
                after()
        else:
            launch(self._grid(False), args, True, False)
            self._receive(launch, args, after)
        return None

    def _receive(self, launch, args: tuple, after) -> None:
        launch(self._grid(False), args, False, True)
        if after is not None:
            after()

    # ------------------------------------------------------------------ errors, lifecycle
    def describe_errors(self, words: list) -> list[str]:
        """Messages for the error words ``ctl[CTL_ERR:CTL_BAD + 1]`` (as ints; all zero: none)."""
        K = self._K
        code, rank, peer, _slot, expected, seen = words[:6]
        errors = []
        if code:
            what = {K.ERR_LL_DISPATCH: "dispatch rows", K.ERR_LL_COMBINE: "combine rows"}.get(code, f"code {code}")
            errors.append(f"rank {rank}: low-latency receive timed out after {env.timeout_s():g} s waiting for rank "
                          f"{peer}'s {what} of call {expected - 1} (its flag holds epoch {seen}, expected "
                          f"{expected} or later); rank {peer} is stuck, died or did not make the same low_latency_* "
                          f"call")
        overflow, bad = words[K.CTL_OVERFLOW - K.CTL_ERR], words[K.CTL_BAD - K.CTL_ERR]
        if bad:
            errors.append(f"rank {self.rank}: {bad} low-latency top-k entries were outside [-1, num_experts) and were "
                          f"ignored")
        if overflow:
            errors.append(f"rank {self.rank}: {overflow} low-latency rows did not fit their slots and were dropped; "
                          f"expert ids within a token must be distinct")
        return errors

    def start_epochs(self, epoch: int) -> None:
        """For tests only (the owner makes it collective, with no call in flight): both call counters and every flag
        at ``epoch``, as if ``epoch`` calls of each kind had completed (e.g. just below 2**63: the next calls cross
        the int64 wrap). Storage made later starts its flags at the counters too (``_attach``)."""
        self._ctl[self._K.CTL_STATE:self._K.CTL_STATE + 2] = epoch
        if self._heap is not None:
            self._flags.fill_(epoch)

    def reset(self) -> None:
        """Collective, with no call of this instance in flight on any rank: zero the arrival flags of the present
        storage and the control words (call and arrival counters, error record, call ring), as after
        construction. Results still pending (hooks not run) are abandoned."""
        if self._on_gpu:
            torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)  # no rank still reads or releases flags
        if self._heap is not None:  # older storage is only read by results pending from before its replacement
            self._flags.zero_()
        self._ctl.zero_()
        self._calls = [0, 0]
        if self._on_gpu:
            torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)  # every flag is zero before any rank releases into it again

    def memory_bytes(self) -> dict:
        """Bytes held: symmetric storage (every heap made here, old ones kept for pending results) and the
        zero-copy input buffers."""
        return {"low_latency_symmetric": sum(h.layout.total_bytes for h in self._heaps),
                "low_latency_zero_copy": sum(t.numel() * t.element_size() for t in self._zero_copy.values())}

    def destroy(self) -> None:
        """Release the storage this instance created (collective)."""
        if self._destroyed:
            return
        self._destroyed = True
        self._zero_copy.clear()
        for heap in self._heaps:
            heap.destroy()
        self._heaps.clear()

    def _alive(self, fn: str) -> None:
        if self._destroyed:
            raise EpcommError(f"{fn}: the low-latency storage was destroyed")


def call_shape(t_max: int, hidden: int, topk: int, num_experts: int, use_fp8: bool, round_scale: bool,
               use_ue8m0: bool, x_dtype: torch.dtype) -> tuple:
    """What decides the storage and the kernels of a low-latency call: ``(T, hidden, topk, experts, fp8, round,
    ue8m0, x dtype)`` (UE8M0 scales are rounded; without FP8 neither applies; an x dtype of float8_e4m3fn: the
    input is pre-cast)."""
    return (t_max, hidden, topk, num_experts, bool(use_fp8), bool(round_scale or use_ue8m0),
            bool(use_fp8 and use_ue8m0), x_dtype)


class _Once:
    """A receive hook: the first call launches the receive half; later calls do nothing."""

    __slots__ = ("_fn", "_args")

    def __init__(self, fn, *args) -> None:
        self._fn, self._args = fn, args

    def __call__(self) -> None:
        fn, args = self._fn, self._args
        self._fn = self._args = None
        if fn is not None:
            fn(*args)


__all__ = ["OneSidedLowLatency", "call_shape"]
