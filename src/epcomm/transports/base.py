"""The small interface every transport implements, and the capabilities it reports.

The Buffer validates inputs, manages streams and events and checks handles; a transport only moves data.
Requests carry already-validated, normalised arguments."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

import torch

from ..core.config import Config
from ..core.handles import DispatchHandle, LowLatencyHandle
from ..core.layout import compute_dispatch_layout
from .device_errors import LOW_LATENCY, DeviceErrors


@dataclass(frozen=True)
class Capabilities:
    """What a transport can do and what it needs from the hardware."""

    name: str
    devices: tuple  # ("cpu", "cuda") subsets
    one_sided: bool  # peers write into each other's memory from kernels
    sync_free_normal: bool  # cached / num_worst_tokens normal dispatch makes no host synchronisation
    graph_capturable_low_latency: bool
    needs_p2p: bool
    needs_p2p_atomics: bool
    description: str


@dataclass(frozen=True)
class KnownCounts:
    """What an exact-mode dispatch's count exchange would tell this rank's host, known to the caller beforehand
    (the hierarchical path learns both legs' counts in one exchange before either moves a row). A transport that
    accepts them (``Transport.accepts_known_counts``) makes no count exchange of its own, or keeps it on the device,
    and no host synchronisation: everything the call launches can be enqueued behind work still running."""

    num_tokens_per_rank: tuple  # rows this rank sends to each rank of the group (tokens of is_token_in_rank)
    num_recv_tokens_per_rank: tuple  # rows this rank receives from each rank
    num_recv_tokens_per_expert: tuple  # [E_local] (token, local expert) pairs received, not aligned
    num_tokens_max: Optional[int] = None  # the largest token count of any rank of the group (None: not known)
    max_pair: Optional[int] = None  # the most rows any rank sends any rank, itself included (None: not known)
    # num_recv_tokens_per_expert already on the device ([E_local] int32), where the caller has it: no copy to make
    # (the same counts: not compared, not printed)
    recv_per_expert_tensor: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)
    # the one-sided transports' summary of these counts (``kernels.ep``'s layout, what their exchange kernel checks
    # against), already made on the device by the caller: no copy from the host per call
    summary_tensor: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        lists = (self.num_tokens_per_rank, self.num_recv_tokens_per_rank, self.num_recv_tokens_per_expert)
        if len(self.num_tokens_per_rank) != len(self.num_recv_tokens_per_rank) or any(t and min(t) < 0 for t in lists):
            raise ValueError(f"KnownCounts: one non-negative count per rank for sends and receives, non-negative "
                             f"per-expert counts; got {lists}")

    @property
    def num_recv_tokens(self) -> int:
        return sum(self.num_recv_tokens_per_rank)


def counts_to_device(values, device: torch.device) -> torch.Tensor:
    """An int32 tensor of the host's ``values`` on ``device``, copied from pinned memory: the host does not wait for
    the work already queued on the device (as a pageable copy would)."""
    host = torch.tensor(list(values), dtype=torch.int32)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class DispatchRequest:
    x: torch.Tensor
    x_scales: Optional[torch.Tensor]
    topk_idx: Optional[torch.Tensor]
    topk_weights: Optional[torch.Tensor]
    num_tokens_per_rank: Optional[torch.Tensor]
    is_token_in_rank: Optional[torch.Tensor]
    num_tokens_per_expert: Optional[torch.Tensor]
    num_experts: int
    expert_alignment: int
    num_worst_tokens: int
    handle: Optional[DispatchHandle]
    config: Config
    bad_topk: Optional[torch.Tensor]  # device count of invalid topk entries, checked at the next host sync
    overlapped: bool = False  # runs on the communication stream, meant to overlap the caller's kernels
    # with num_worst_tokens, rows each peer may send (0: num_worst_tokens); the portable transport's padded slots
    peer_capacity: int = 0
    layout: str = "rank_major"  # "expert_major": Transport.dispatch_expert_major
    # exact mode: the counts, known beforehand (used by a transport with accepts_known_counts, else ignored)
    known: Optional[KnownCounts] = None
    # what ``Transport.prepare`` made of this request ahead of its counts (transport-specific; None: nothing)
    prepared: Any = None
    # a cached dispatch of rows another stream still writes (``kernels.ep.Gate``; transports with
    # ``gates_cached_dispatch``), or None
    gate: Any = None
    # int64 [num_recv_tokens] on the device: the output row of each received row (a permutation of the transport's
    # own order, applied as the rows are written; cached dispatches of transports with gates_cached_dispatch), or None
    row_map: Any = None
    # with row_map, the outputs to write (recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src: as the
    # transport would allocate them, with at least the rows row_map names; a hierarchical dispatch's chunks all write
    # into the same ones), or None (the transport allocates them)
    outs: Any = None
    # exact mode with ``known`` (its ``summary_tensor`` given): ``[N, R]`` int32 on the device, each token's index among
    # this rank's tokens for each destination, made by the caller, who has checked its layout against the known counts
    # (a transport with ``gates_exact_dispatch`` then makes no count exchange: a hierarchical dispatch's chunks merged
    # into one gated call, their rows still landing), or None
    positions: Any = None


@dataclass(frozen=True)
class DispatchResult:
    recv_x: torch.Tensor
    recv_scales: Optional[torch.Tensor]
    recv_topk_idx: Optional[torch.Tensor]
    recv_topk_weights: Optional[torch.Tensor]
    num_recv_tokens_per_expert_list: Optional[list]
    handle: DispatchHandle


@dataclass(frozen=True)
class CombineRequest:
    x: torch.Tensor
    handle: DispatchHandle
    topk_weights: Optional[torch.Tensor]
    bias: tuple
    config: Config
    overlapped: bool = False  # runs on the communication stream, meant to overlap the caller's kernels
    row_weights: Optional[torch.Tensor] = None  # expert-major combine: [rows] float32 weight of every row
    # (combined [N, H] of x's dtype, combined weights [N, K] float32 or None): where to write the result, views of any
    # row stride and unit column stride (transports with combines_into; e.g. side by side in one send buffer), or None
    out: Optional[tuple] = None


@dataclass(frozen=True)
class LowLatencyDispatchRequest:
    x: torch.Tensor
    topk_idx: torch.Tensor
    num_max_dispatch_tokens_per_rank: int
    num_experts: int
    use_fp8: bool
    round_scale: bool
    use_ue8m0: bool
    return_recv_hook: bool
    bad_topk: Optional[torch.Tensor]
    # pre-cast input (``use_fp8`` only): ``x`` is ``[N, H]`` float8_e4m3fn and ``x_scales`` ``[N, H / 128]``
    # float32, both from ``epcomm.fp8.per_token_cast_to_fp8(x, round_scale or use_ue8m0)`` (float32 scales even
    # with ``use_ue8m0``: the transport packs them); the transport moves them as they are, bit for bit what it
    # would have received had it cast ``x`` itself (``check_precast``). The hierarchical path casts at the source.
    x_scales: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class LowLatencyDispatchResult:
    recv_x: torch.Tensor  # [E_local, R * T, H]
    recv_scales: Optional[torch.Tensor]
    recv_count: torch.Tensor  # [E_local] int32
    handle: LowLatencyHandle
    hook: Optional[Callable[[], None]]


@dataclass(frozen=True)
class LowLatencyCombineRequest:
    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    handle: LowLatencyHandle
    zero_copy: bool
    return_recv_hook: bool
    out: Optional[torch.Tensor]


@dataclass(frozen=True)
class LowLatencyCombineResult:
    combined_x: torch.Tensor
    hook: Optional[Callable[[], None]]


class Transport(abc.ABC):
    """One way of moving dispatch/combine traffic between the ranks of a group."""

    name: ClassVar[str]
    validates_topk: ClassVar[bool] = False  # its kernels count invalid expert ids themselves (low latency too)
    # an exact-mode dispatch given DispatchRequest.known makes no host synchronisation
    accepts_known_counts: ClassVar[bool] = False
    # ``merge_cached`` and cached dispatches of rows another stream still writes (``DispatchRequest.gate``)
    gates_cached_dispatch: ClassVar[bool] = False
    # a rank-major combine writes into the views of CombineRequest.out where given
    combines_into: ClassVar[bool] = False
    # an exact-mode dispatch given DispatchRequest.positions (with known counts and their summary, gated or not), and
    # ``known_handle``: the handle of each chunk of such a merged dispatch
    gates_exact_dispatch: ClassVar[bool] = False

    def __init__(self, group: Any, device: torch.device, buffer_id: int) -> None:
        import torch.distributed as dist

        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.device = device
        self.buffer_id = buffer_id
        self.errors = DeviceErrors.none(device)  # transports whose kernels record errors replace it
        self._keys_met: set = set()  # first_call keys seen

    @classmethod
    @abc.abstractmethod
    def capabilities(cls) -> Capabilities:
        """What this transport can do."""

    def checks_topk(self, x: torch.Tensor, num_worst_tokens: int) -> bool:
        """Whether a normal dispatch of ``x`` checks the expert ids itself, so the Buffer need not spend
        device operations on it."""
        return self.validates_topk

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank)``; see ``Buffer``. On GPUs one
        Triton kernel (every host-side operation costs tens of microseconds), else torch ops."""
        from ..kernels import triton_available

        if not topk_idx.is_cuda or not triton_available():
            return compute_dispatch_layout(topk_idx, num_experts, self.num_ranks)
        from ..kernels.ep import launch_layout

        counts = torch.zeros(self.num_ranks + num_experts, dtype=torch.int32, device=topk_idx.device)  # one fill
        per_rank, per_expert = counts[:self.num_ranks], counts[self.num_ranks:]
        itr = torch.empty(topk_idx.size(0), self.num_ranks, dtype=torch.bool, device=topk_idx.device)
        launch_layout(topk_idx, num_experts, self.num_ranks, per_rank, per_expert, itr)
        return per_rank, per_expert, itr

    @abc.abstractmethod
    def dispatch(self, req: DispatchRequest) -> DispatchResult: ...

    def prepare(self, req: DispatchRequest) -> Any:
        """The local work of an exact-mode dispatch whose counts the caller will pass as ``req.known``: what this
        rank can do with its own routing alone (the portable transport's plan and packing of the rows), enqueued
        while the caller still waits for the counts, so that only the data's collectives and what follows them
        remain once they are known. Pass the result as ``DispatchRequest.prepared`` with the same inputs and the
        counts. None: nothing to do ahead (the default)."""
        return None

    def dispatch_many(self, reqs: list):
        """``dispatch`` of each of ``reqs`` (a generator). A transport may start every request's data moving
        before it yields the first result (``AllToAllTransport`` shares one count exchange among them), so a caller
        that records an event after each result must take them all before waiting for any."""
        for req in reqs:
            yield self.dispatch(req)

    @abc.abstractmethod
    def combine(self, req: CombineRequest) -> tuple[torch.Tensor, Optional[torch.Tensor]]: ...

    def dispatch_expert_major(self, req: DispatchRequest) -> DispatchResult:
        """The dispatch with ``layout="expert_major"`` (and cached dispatches of expert-major handles): here the
        rank-major dispatch followed by the permute of ``epcomm.transports.expert_major`` (``recv_topk_idx`` of
        the result holds the segment ends, ``recv_topk_weights`` the row weights)."""
        from .expert_major import cached_to_expert_major, to_expert_major

        res = self.dispatch(req)
        if req.handle is not None:
            key = ("expert_major", res.recv_x.dtype, res.recv_x.size(1), req.handle.num_topk, res.recv_scales is None)
            return self._local_pass("Buffer.dispatch", key, res.recv_x, lambda: cached_to_expert_major(res, req.handle))
        key = ("expert_major", res.recv_x.dtype, res.recv_x.size(1), req.topk_idx.size(1), res.recv_scales is None,
               req.topk_weights is None)
        return self._local_pass("Buffer.dispatch", key, res.recv_x,
                                lambda: to_expert_major(res, req, self.deferred_errors))

    def combine_expert_major(self, req: CombineRequest) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The combine of an expert-major handle: ``req.x [rows, H]``, ``req.topk_weights [rows]`` float32 values
        returned to their (token, slot), ``req.row_weights [rows]`` float32 or None. Here the local reduction of
        ``epcomm.transports.expert_major.reduce_pairs`` followed by the rank-major combine of its partials."""
        from .expert_major import reduce_pairs

        h: DispatchHandle = req.handle
        key = ("expert_major_combine", req.x.dtype, req.x.size(1), h.num_topk, req.row_weights is None,
               req.topk_weights is None)
        partial, values = self._local_pass("Buffer.combine", key, req.x, lambda: reduce_pairs(
            req.x, h.recv_pair_row, req.row_weights, req.topk_weights, req.x.dtype))
        return self.combine(CombineRequest(partial, h, values, req.bias, req.config, req.overlapped))

    def _local_pass(self, fn: str, key: tuple, t: torch.Tensor, run: Callable[[], Any]):
        """``run()`` (local kernels, no waits); where it launches kernels, the first call of ``key`` compiles
        them and meets the other ranks first (``first_call``), so that no rank compiles while its peers wait."""
        from ..kernels import use_kernels

        if not use_kernels(t):
            return run()
        out: list = []
        self.first_call(fn, key, lambda: out.append(run()))
        return out[-1]

    @property
    def deferred_errors(self) -> torch.Tensor:
        """An int32 ``[1]`` device word that the next error check raises as a normal-mode error when nonzero: what a
        call without a host synchronisation found wrong (pairs an expert-major dispatch could not place, a gated
        chunk's sends that differ from the counts its rank promised); transports with error words return one of
        theirs."""
        word = getattr(self, "_expert_major_err", None)
        if word is None:
            word = self._expert_major_err = torch.zeros(1, dtype=torch.int32, device=self.device)
        return word

    @abc.abstractmethod
    def low_latency_dispatch(self, req: LowLatencyDispatchRequest) -> LowLatencyDispatchResult: ...

    @abc.abstractmethod
    def low_latency_combine(self, req: LowLatencyCombineRequest) -> LowLatencyCombineResult: ...

    @abc.abstractmethod
    def low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The ``[E_local, R * T, H]`` bf16 tensor a zero-copy combine reads."""

    def first_call(self, fn: str, key: tuple, enqueue: Callable[[], None]) -> None:
        """Run ``enqueue()`` (launches of one call of ``fn``). The first time ``key`` is seen, compile those
        kernels and meet the other ranks first (``compile_then_meet``): ``key`` must be the same on every rank at
        the same call (built from shapes and dtypes the ranks must agree on, never from a rank's own token
        counts)."""
        if key not in self._keys_met:
            self._keys_met.add(key)
            compile_then_meet(self.group, self.device, enqueue, fn)
        enqueue()

    def warm_normal(self, run: Callable[[], None]) -> None:
        """Collective (``Buffer.warmup``): ``run()`` makes one normal-mode round of calls (dispatch, cached dispatch,
        combine) of a configuration; a transport whose later calls of it can take other paths (another chunk
        count ...) runs it once per path, so that none of them first loads a kernel in the middle of a later call.
        The default: once."""
        run()

    def warmup_low_latency(self, shape: tuple) -> None:
        """Collective: size the low-latency storage for calls of ``shape`` (``low_latency.call_shape``) and compile
        every kernel variant they can launch (any token count, plain or hook), then meet the other ranks. Nothing
        to do for transports without low-latency kernels."""

    def pending_errors(self) -> list[str]:
        """Errors recorded on the device (for example a timeout, or an overflowing ``num_worst_tokens``) and those
        already seen, as messages; reading them synchronises. They stay (``DeviceErrors``: sticky)."""
        return self.errors.read()

    def clean_low_latency(self) -> None:
        """Collective: reset the low-latency state (flags, call counters, error words) as after construction;
        pending low-latency results are abandoned. Every rank calls it with no low-latency call in flight."""
        self.errors.clear(LOW_LATENCY)

    def memory_usage(self) -> dict:
        """Bytes this transport holds between calls, by part (symmetric storage, buffers it keeps, pinned host
        memory); the Buffer adds them up."""
        return {"pinned_host": self.errors.nbytes_pinned}

    def destroy(self) -> None:
        """Release communication resources (collective where the transport holds shared memory)."""


# How long the ranks wait for each other at a first call's meeting point beyond EPCOMM_TIMEOUT_S: a peer may
# still be compiling that call's kernels (seconds each without Triton's cache, more on a loaded host).
COMPILE_ALLOWANCE_S = 300.0


def compile_then_meet(group: Any, device: torch.device, enqueue: Callable[[], None], what: str,
                      threads: int = 1) -> None:
    """Compile every kernel ``enqueue()`` launches without running any (``epcomm.kernels.launch.compile_only``;
    ``threads`` variants at once), then meet the other ranks of ``group`` at a host barrier; the caller runs
    ``enqueue()`` for real afterwards. Every rank must get here at the same call: compilation takes different
    times on different ranks, and no rank's kernel may start a timed wait while a peer still compiles. While a
    CUDA graph is being captured only the compilation happens (a capture must not synchronise). The barrier
    waits at most ``EPCOMM_TIMEOUT_S + COMPILE_ALLOWANCE_S`` and then raises ``EpcommTimeoutError`` (``what``:
    the call, for the message)."""
    from ..kernels.launch import compile_only

    with compile_only(threads):
        enqueue()
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        meet(group, what)


def meet(group: Any, what: str) -> None:
    """Host barrier of ``group`` that raises ``EpcommTimeoutError`` after ``EPCOMM_TIMEOUT_S +
    COMPILE_ALLOWANCE_S`` instead of waiting for torch.distributed's own timeout."""
    import time

    import torch.distributed as dist

    from .. import env
    from ..errors import EpcommTimeoutError

    limit = env.timeout_s() + COMPILE_ALLOWANCE_S
    rank = dist.get_rank(group)
    why = ("(each compiles its kernels first, so that compilation does not count against the device timeout): a "
           "rank is stuck, died or did not make the same call")
    try:
        work = dist.barrier(group=group, async_op=True)
        deadline = time.monotonic() + limit
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise EpcommTimeoutError(f"{what}: rank {rank} waited {limit:g} s at a host barrier for the other "
                                         f"ranks to reach the first call of this kind {why}")
            time.sleep(1e-3)
        work.wait()
    except RuntimeError as exc:  # the group's backend failed the barrier: a peer closed its connection or died
        if isinstance(exc, EpcommTimeoutError):
            raise
        raise EpcommTimeoutError(f"{what}: rank {rank} waited at a host barrier for the other ranks to reach the "
                                 f"first call of this kind, and the barrier failed {why} ({exc})") from exc
