"""Beyond one machine: the hierarchical path, an inter-domain leg composed with an intranode transport.

Where it sits::

    topology probe (hosts)  ->  Domains (epcomm.topology.domains: consecutive ranks per node, or
                                EPCOMM_RANKS_PER_NODE / Buffer(ranks_per_node=...))
        ->  inter-domain leg: a Transport over the *rail* group (the ranks with this rank's local index, one per
            domain), today ``AllToAllTransport`` = torch.distributed all_to_all (NCCL between hosts: InfiniBand,
            RoCE, EFA through NCCL's plugins, sockets; gloo on CPUs)
        ->  domain leg: the intranode transport the domain's hardware runs (nvlink, p2p or alltoall), over the
            domain group, unchanged
        ->  Buffer (the same API; ``Buffer.transport`` is ``hierarchical``)

Normal mode. Dispatch: (1) every token crosses to each destination domain once, to the rank there with its own
local index (the rail peer): a dispatch over the rail group in which a domain's experts count as its rail peer's
(dedup: one copy per domain, however many of its experts the domain holds); (2) that rank forwards it within its
domain to every rank holding one of its experts: a dispatch over the domain group with domain-local expert ids.
Combine mirrors it: (1) each domain adds the expert outputs of a forwarded row over its ranks (FP32 in rank
order, cast once to the dtype of ``x``: the *partial* that crosses back, BF16 for BF16 outputs, as in DeepEP);
(2) every source adds its domains' partials in FP32 in domain order, then the biases, and casts once. The
reference (``epcomm.reference`` with ``local_size``) composes its two oracles the same way, so every test is
bit-exact.

Counts: an exact-mode call learns both legs' counts of every chunk before any row moves, in one exchange: every
source sends its rail peer in each domain its tokens for that domain, for each of the domain's ranks and experts
(one all_to_all over the rail group); each rank's sums are what it forwards, gathered over its domain (one
all_gather); one host read. Neither leg then exchanges or reads counts of its own (``KnownCounts``: the one-sided
domain leg keeps its exchange on the device and checks it against them), so every launch of the call is enqueued
while its rows still cross between domains and the forwarding starts on the device as soon as they land, instead of
after a host read and the host's launches. The head chunk keeps the link busy during that round trip: a call's first
tokens (``head_share`` of the largest token count any rank had in the previous exact-mode call, the same number of
slots on every rank; the first call has none) cross right behind the counts in fixed slots, one per head token for
every domain (the inter-domain leg's ``send_ahead``: no counts needed), while the counts travel and the host reads
them; once they are read, the other chunks' rows are issued first and then the slots the sources filled become the
head's exact result (``receive_ahead``, on the caller's stream while those rows cross), which is forwarded, cached
and combined like any other chunk. Its slots that no token fills cross as padding (few where
almost every token goes to every domain, as at a 2-node split; at EP64 with 8 nodes about half the head's slots).
Once the chunk count is measured, so is the link's *reach* (the bytes of rows it moved during a call's count round
trip and host read): a head then holds at most ``HEAD_MARGIN`` (3) times the reach's rows, so that a small call
after a large one pads no more than a few round trips' worth, and a call whose quarter is under half the reach has
none (its collective would cost more than it hides; such a call is latency-bound). A head costs the host a chunk's
work more after the count read (its receive and forwarding), which only pays where the round trip it hides is
longer: whether calls send one is measured with the chunk count (below).

Pipelining: an exact-mode call moves its tokens in chunks (each rank's tokens split in order, the same count on every
rank); the inter-domain leg of chunk ``c + 1`` runs on a network stream while chunk ``c`` is forwarded within the
domain, so the forwarding hides behind the network for all but the last chunk. The chunks shrink where that helps:
each holds ``ratio`` times the previous one's tokens (``core.layout.chunk_bounds``), the forwarding's time over the
rows' time in the measured one-chunk calls (the slowest rank's, at least ``CHUNK_RATIO_FLOOR``; 1, even chunks, where
the forwarding is the slower leg or until it is measured; ``chunk_ratio`` fixes it): each chunk's forwarding then
fits behind the next one's rows and only the small last chunk's is left exposed. Every chunk's rows are issued
before the first is forwarded (cached dispatches too, whose FP8 scales ride at the end of each row across the
network; where the domain leg is one-sided, a cached call's domain leg is one gated push for all chunks that waits on
the device for each chunk's flag and writes every row and its scales at their place in the output's order:
``_mapped``; else the rows are gathered and split once at the end; an exact-mode call of several chunks without a
head chunk likewise issues one gated push for all chunks, each chunk's layout and positions made on the network stream
as its rows land: ``_gated``), so the link never waits for the host between chunks; a combine takes the chunks the
other way round, smallest first (a head chunk before a single chunk after it), each chunk's partials crossing while
the next chunk is summed within the domain; each chunk adds a few launches and collectives, so the best count depends
on the link. Chunk bounds fall at multiples of ``token_alignment``
tokens (1 at DeepSeek's shapes), so that every per-token tensor's chunks start aligned as the tensor does: no chunk
launches a kernel variant of its own (one first loaded in the middle of a call waits for the device, so for any
collective that hangs there: "Faults" below).
The count is measured: the first exact-mode dispatches try ``CHUNK_CANDIDATES`` in turn (1 first: it sizes the
domain's storage for whole calls), each without and (where the inter-domain leg can send one) with a head chunk,
``TUNE_CALLS`` rounds (the first not counted; in turn, so that a link whose rate drifts weighs on every candidate
alike), then the ranks agree (one all_reduce of their times, the slowest rank's counting) on the fastest and keep it
(a larger count, or a head, only when it is faster by more than ``CHUNK_GAIN``, 5%: the per-chunk costs and the
noise favour the simpler);
``EPCOMM_INTERNODE_CHUNKS`` or ``pipeline_chunks`` fixes the count instead (calls then send a head where they can).
Results do not depend on the count. Received rows are then put in the intranode path's order (by source rank, then
source token; one gather of the outputs, and one of the combine's input back), so the order does not depend on the
chunks or the domains, and ``handle.recv_src_rank`` / ``recv_src_idx`` hold each row's global source rank and token.
In exact mode over a one-sided domain leg every chunk's rows are written there directly instead, into one set of
outputs (``_rows_in_place``: the domain's gather also carries what each forwarder got from each source domain for
every rank in every chunk, so each (forwarder, source domain, chunk) block's place in that order is known before the
rows move; a kernel makes each chunk's map from the gathered counts): no sort and no gather after the call.
Early issue (``early_issue``): an exact-mode call of several chunks without a head chunk, of a kind (chunk count, row
shape) whose gated call has run before, issues that gated domain leg before its count read, sized by bounds: the
largest needs of the last ``EARLY_HISTORY`` such calls (``_Counts.needs``: landing rows, received rows, max_pair,
tokens; the same numbers on every rank of the domain, from its gathered counts) with ``EARLY_MARGIN`` more. Its row
maps and summaries are made on the device from the gathered counts, its outputs are the first rows of bound-sized
ones, and its push waits on the device for each chunk's flag; after the read the host issues only the rows'
collectives with their forward layouts, then makes the handles, while rows cross. Where the counts outgrow a bound,
every rank of the domain sees it in the same counts, lets the issued push go with empty chunks, and the call goes the
way above. GPUs only (the interpreter runs a launch to its end before the next); and only kinds whose gated call has
run, so that every kernel launched after the push is loaded by then (loading one waits for the device, where the push
waits for that kernel). The push is the one launch of a call that waits on the device for work issued after it, so
anything that keeps that work from running while the push waits stalls the call until the push's timeout. By default
(``early_issue_by_default``) it is issued early only where the inter-domain collectives are NCCL's, which the host
issues without waiting. Gloo's on CUDA tensors (which epcomm meets only between ranks that share GPUs) block the host
in each collective until its device copies are done; forced there, a DeepSeek-sized call (4 ranks on 2 GPUs, 2048
tokens of 7168 FP8 columns) stalled with every rank in its first chunk's collective. Between ranks sharing GPUs such
calls stalled with NCCL's collectives too, with the early leg or without it (likely: kernels that wait on the device
for another process's kernels on the shared GPU; not pinned down); with one GPU per rank they did not. Megatron-LM's
``CUDA_DEVICE_MAX_CONNECTIONS=1`` (one work queue: kernels of different streams start in issue order, and still run
side by side) does not stall it: the push is resident before the work it waits for starts, and every wait the call
enqueues is on an event recorded before it (measured: the early test, forced, with NCCL between the domains).
``early_issue = True`` takes it everywhere on GPUs (the tests' small calls over gloo).
``num_worst_tokens`` (no host synchronisation): each rank sends at most ``num_worst_tokens // num_ranks`` tokens to
each domain (the inter-domain leg has fixed slots of that many rows per peer); more tokens raise at once.

Low-latency mode: (1) with ``use_fp8`` every source casts its tokens once (``epcomm.fp8``; float32 scales, powers
of two with ``round_scale`` / ``use_ue8m0``); the tokens (FP8 rows and scales, about half the bytes of BF16; else
BF16) cross to their domains as in normal mode with fixed slots of ``T`` rows per domain (no host synchronisation,
CUDA-graph capturable over NCCL); the forwarding rank puts each received token in a fixed slot of its ``D * T``
forwarded rows: row ``s * T + t`` is token ``t`` of its rail peer in domain ``s`` (slots of tokens not bound to
this domain hold no expert ids). (2) A low-latency dispatch within the domain of the forwarded rows, pre-cast
(``LowLatencyDispatchRequest.x_scales``: the domain's kernel stores the FP8 bytes and scales as they are, packing
UE8M0 exponents from the scales, so the receiver gets the bits of a cast anywhere else), which gives the
receiver the usual ``[E_local, R * T, H]`` layout, rows of each expert ordered by forwarding rank ``l``, then by
forwarded row ``j = s * T + t``: each (forwarding rank, source domain) group is the block of source rank
``s * L + l``. ``handle.src_info`` / ``layout_range`` name the true sources as DeepEP's do (source token; (first
row, count) per global source rank, the blocks ordered by (local index, domain)), computed on the device from the
domain leg's handle after its receive (no host synchronisation; with ``return_recv_hook``, when the hook runs);
the domain leg's own handle stays in the private state for the combine. The combine sends the top-k weights to the
forwarding ranks (a small all_to_all), runs the domain's low-latency combine there (weighted, FP32, cast once to
BF16: the partial), and adds the domains' partials at the source (FP32, domain order, cast once).

Faults: a dead or stalled rank becomes an exception on every other rank within ``EPCOMM_TIMEOUT_S`` (and a few
seconds), naming the rank, the leg, the phase (tokens to their domains, forwarding the tokens, sums within the
domain, partial sums back to their sources, chunk agreement ...) and the missing rank; nothing waits forever. Every
host wait of the path (the legs' count reads, the chunk agreement, the timings) polls its work's event
(``transports.faults.host_wait``) until ``EPCOMM_TIMEOUT_S`` has passed since the collective was issued; calls
that never synchronise (``num_worst_tokens``, combine, low-latency) leave an event behind them that the next call
and ``pending_errors`` (``Buffer.check_errors``, ``destroy``) look at, waiting (bounded) once ``MAX_IN_FLIGHT`` are
still running. When a wait expires (or gloo's collective ends at its group's timeout, ``EPCOMM_TIMEOUT_S`` there),
the rank writes where it is stuck into the default store and reads, for a moment, where its leg's other ranks are:
a rank that wrote nothing never joined (it is named as such); then it aborts the inter-domain and domain groups
(``torch.distributed``'s abort marks them aborted first: NCCL's watchdog, whose own timeout on these groups is
longer, ``2 * EPCOMM_TIMEOUT_S + 40`` s, leaves the process alone, and the stuck kernels exit) and raises
``EpcommTimeoutError`` (the Buffer keeps it as its sticky error and raises that). Every later call of any Buffer on
these groups raises at once with the same message; such a Buffer cannot be used again (make a new one once the ranks
are back).
The domain leg's one-sided kernels keep their own device timeouts (their count read has a longer backstop). One wait
is out of reach: a kernel module's first load waits for the device (holding the CUDA context's lock), so behind a
hung collective the host blocks there and NCCL's watchdog ends the process; calls launch no variant their first call
of the kind did not (chunk bounds above; the legs pass empty and one-row tensors as full ones), and a call watch
(``faults.WATCH``) logs any host that blocks anyway, with the frame and the ranks that never joined (``_blocked``). Bad
input that differs between ranks (hidden size, top-k, experts, ``num_max_dispatch_tokens_per_rank``, dtypes) is
caught at the first call of each kind, before any data moves: the ranks compare the call's shape.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from .. import env
from ..core.config import Config
from ..core.device import device_uuid
from ..core.handles import DispatchHandle, LowLatencyHandle, evolve
from ..core.layout import align_all, align_up, chunk_bounds, token_alignment
from ..core.validate import raise_if_bad_topk
from ..errors import EpcommError, EpcommTimeoutError
from ..fp8 import FP8_DTYPE, per_token_cast_to_fp8
from ..kernels import use_kernels
from ..kernels.launch import one_variant
from ..topology.domains import Domains
from .alltoall import AllToAllTransport, _as_bytes, columns_of_rows, fused_width
from .base import (Capabilities, CombineRequest, DispatchRequest, DispatchResult, KnownCounts,
                   LowLatencyCombineRequest, LowLatencyCombineResult, LowLatencyDispatchRequest,
                   LowLatencyDispatchResult, Transport, counts_to_device, meet)
from . import faults
from .device_errors import NORMAL, CombinedErrors
from .low_latency import _Once, call_shape

# The inter-domain legs this build has, by name: a Transport class whose calls run between hosts. A
# device-initiated leg (NCCL's GPU-initiated networking, NVSHMEM) would be one more entry.
INTER_DOMAIN_LEGS = {"nccl": AllToAllTransport}
COUNTS_PHASE = "counts of both legs"  # an exact-mode dispatch's one count exchange (faults name it; benchmarks time it)
# a gated call's part of it that its first rows do not wait for: the domain's gather, read once they are issued
DOMAIN_COUNTS_PHASE = "counts within the domain, read after the first rows"
PACK_PHASE = "packing the tokens"  # the inter-domain leg's local work, issued while the counts travel
ROWS_PHASE = "tokens to their domains"  # the inter-domain leg's rows (benchmarks time the host's path up to it)
HEAD_PHASE = "the first tokens to their domains, ahead of their counts"  # the head chunk's rows (fixed slots)
# (a point, not a part) an exact-mode dispatch's device work is all enqueued: what the host does after it (the
# handle) runs beside the device's last forwarding (benchmarks time it)
ISSUED_MILESTONE = "the call's device work issued"
# (a point) an inter-domain rows' collective is issued: the host's lead after the count read ends at the first
# (``AllToAllTransport.on_collective``; the rows' leg begins earlier, with the request's views and checks)
COLLECTIVE_MILESTONE = "an inter-domain rows' collective issued"
# (points) the steps of that lead, each reached after the one before it (``host_milestones``' "lead steps"; benchmarks
# report the time up to each): the counts taken from the read (``_Counts``, the bad id check), the rows' landing
# buffer (a gated call's: its bounds checked, each chunk's landing rows; a one-chunk call's: ``_first_rows``), the
# switch to the network stream, the chunk's request
LEAD_COUNTS = "lead: the counts taken from the read"
LEAD_LANDING = "lead: the rows' landing buffer"
LEAD_STREAM = "lead: on the network stream"
LEAD_REQUEST = "lead: the chunk's request"
LEAD_STEPS = (LEAD_COUNTS, LEAD_LANDING, LEAD_STREAM, LEAD_REQUEST)
MILESTONES = (ISSUED_MILESTONE, COLLECTIVE_MILESTONE) + LEAD_STEPS

_subgroups: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
# per rail group: {"message": why its groups were aborted}, shared by every transport that uses them
_faults: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()

log = logging.getLogger(__name__)


def rail_backend(group_backend: str, forced: bool, cuda: bool) -> Optional[str]:
    """The backend of the rail (inter-domain) groups made out of a group whose backend is ``group_backend`` (as
    ``torch.distributed.get_backend`` names it): None (the group's) unless ``forced`` (``EPCOMM_RAIL_NCCL``) asks for
    NCCL where the group's CUDA collectives are not NCCL's (ranks sharing GPUs) and CUDA is there
    (``cpu:gloo,cuda:nccl``)."""
    if not forced or not cuda or "nccl" in group_backend.lower():
        return None
    return "cpu:gloo,cuda:nccl"


def domain_backend(rail_over: Optional[str], gpus: list) -> Optional[str]:
    """The backend of a domain group whose ranks are on ``gpus`` (a GPU's UUID per rank), given the rail groups'
    ``rail_over`` (``rail_backend``): that one too where it forces NCCL and no two of the domain's ranks share a GPU
    (NCCL's own condition), so that simulated nodes whose ranks share GPUs with other nodes' ranks gather their counts
    over NVLink as a real node does; else None (the group's)."""
    return rail_over if rail_over is not None and len(set(gpus)) == len(gpus) else None


def subgroups(group: Any, domains: Domains, rank: int, cuda: bool = False) -> tuple:
    """``(domain group, rail group)`` of ``rank`` (a rank of ``group``, on a CUDA device where ``cuda``), made once
    per (group, domains) with ``faults.group_timeout`` as their timeout (``EPCOMM_TIMEOUT_S`` over gloo; longer over
    NCCL, so that the transport's own deadline and abort come before NCCL's watchdog). Only the members of a subgroup
    take part in making it. Groups that were aborted (a rank never joined) are made anew. The rail group over NCCL
    where ``rail_backend`` says so (``EPCOMM_RAIL_NCCL``, testing), and then the domain group too where
    ``domain_backend`` allows it, else with ``group``'s backend."""
    cache = _subgroups.setdefault(group, {})
    rail_over = rail_backend(str(dist.get_backend(group)), env.rail_nccl(), cuda)
    key = (domains.num_domains, domains.local_size, env.timeout_s(), rail_over)
    if key not in cache:
        ranks = dist.get_process_group_ranks(group)
        mine = domains.domain_ranks(domains.domain_of(rank))
        own = [ranks[r] for r in mine]
        rail = [ranks[r] for r in domains.rail_ranks(domains.local_index(rank))]
        own_over = None
        if rail_over is not None:  # (every rank of the group makes its subgroups at once: a collective here is safe)
            gpus = [None] * len(ranks)
            dist.all_gather_object(gpus, device_uuid(torch.device("cuda", torch.cuda.current_device())), group=group)
            own_over = domain_backend(rail_over, [gpus[r] for r in mine])
        made = []
        for members, backend in ((own, own_over), (rail, rail_over)):
            made.append(dist.new_group(members, timeout=faults.group_timeout(group, backend),
                                       use_local_synchronization=True, backend=backend))
        cache[key] = tuple(made)
    return cache[key]


def _forget_subgroups(aborted: tuple) -> None:
    """Drop aborted subgroups from the cache (a later Buffer makes new ones)."""
    for cache in list(_subgroups.values()):
        for key in [k for k, v in cache.items() if any(g in aborted for g in v)]:
            del cache[key]


def _guarded(fn: str):
    """Decorate a call of the transport (``fn``: its name for messages): at its entry, raise at once if this
    transport's groups were aborted, count the call and look at the calls still running on the stream (``_settle``);
    on GPUs, the call is watched while it runs (``faults.WATCH``: a host blocked in a native call behind a hung
    collective is reported, ``_blocked``); at its exit, note the call as running on the stream until its end event
    completes (CUDA, not while capturing)."""

    def wrap(method):
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            self._enter(fn)
            # (on GPUs a native call can wait for a hung collective)
            watched = faults.WATCH.begin(functools.partial(self._blocked, fn)) if self.device.type == "cuda" else None
            try:
                out = method(self, *args, **kwargs)
            finally:
                if watched is not None:
                    faults.WATCH.end(watched)
            self._leave(fn)
            return out

        return run

    return wrap


@dataclass(frozen=True)
class _HandleState:
    """Per pipelined chunk of the dispatch: the legs' handles, this rank's token bounds, the rows it received."""

    # the inter-domain leg's handles (this rank as forwarder), each or a function that makes it (``rail``: when first
    # asked, as ``domain``)
    rail_handles: tuple
    # the domain leg's handles, or a function that makes them (``domain``: when first asked, by a combine or cached
    # dispatch, whose host work a step hides, instead of the dispatch's, after its count read)
    domain_handles: Any
    bounds: tuple  # (first, end) token of each chunk of this rank's x
    rows: tuple  # rows of the outputs from each chunk, in order
    back: torch.Tensor  # [M] int64: row i of the chunks' rows, one after the other, is output row back[i]
    ordered: Optional[torch.Tensor]  # its inverse (``order``), or None where the rows were written in place
    head: bool = False  # the first chunk is a head chunk (sent ahead of the counts)
    # mapped cached dispatches (``_mapped``), by row bytes: (the domain leg's merged handle, the output row of each of
    # its rows, where each chunk's rows start in the rows received from the inter-domain leg (and their end; on the
    # host and on the device), the inter-domain leg's merged packing; the last three None for one chunk), or None
    # where the domain leg cannot merge them
    merged: dict = field(default_factory=dict, compare=False, repr=False)

    @functools.cached_property
    def rail(self) -> tuple:
        """The inter-domain leg's handles, per chunk (made here where functions were given)."""
        if any(callable(h) for h in self.rail_handles):
            object.__setattr__(self, "rail_handles", tuple(h() if callable(h) else h for h in self.rail_handles))
        return self.rail_handles

    @functools.cached_property
    def domain(self) -> tuple:
        """The domain leg's handles, per chunk (made here where a function was given, which is then let go)."""
        if callable(self.domain_handles):
            object.__setattr__(self, "domain_handles", self.domain_handles())
        return self.domain_handles

    @functools.cached_property
    def order(self) -> torch.Tensor:
        """``[M]`` int64: output row i is row order[i] of the chunks' rows (made from ``back`` where first needed:
        cached dispatches that gather their rows)."""
        return self.ordered if self.ordered is not None else _inverse(self.back)


@dataclass(frozen=True)
class _LowLatencyState:
    rail: DispatchHandle
    domain: LowLatencyHandle
    forwarded_idx: torch.Tensor  # [D * T, K] int64 domain-local expert ids of the forwarded rows (-1: none)
    slot: torch.Tensor  # [D * T] int64: the forwarded row (s * T + t) of each row the rail leg received, D * T: none


class HierarchicalTransport(Transport):
    """The hierarchical path (module docstring). ``domain_transport`` names the intranode transport of the domain
    leg (``auto``, ``nvlink``, ``p2p``, ``alltoall``, or a Transport class); ``leg`` the inter-domain leg."""

    name = "hierarchical"
    # a normal-mode call moves its tokens in this many chunks (the same on every rank): chunk c + 1 crosses the
    # network while chunk c is forwarded within the domain. num_worst_tokens and low-latency calls use one.
    # None: measured (module docstring); EPCOMM_INTERNODE_CHUNKS takes precedence.
    pipeline_chunks: Optional[int] = None
    CHUNK_CANDIDATES = (1, 2, 3, 4)
    # each chunk's share of a call's tokens over the previous chunk's: None, measured with the count (see
    # _ChunkTuner: the forwarding's time over the rows' time in one-chunk calls, at least CHUNK_RATIO_FLOOR); 1: even
    chunk_ratio: Optional[float] = None
    TUNE_CALLS = 4  # rounds of one dispatch per candidate (the first round is not counted: it may compile or size)
    # the head chunk of an exact-mode dispatch (module docstring, "Counts"): its fixed slots per domain are this share
    # of the largest token count any rank had in the previous exact-mode dispatch (0: no head chunk). A quarter: the
    # traffic model's best at EP64 (its rows cover the count exchange and the host's lead there; more pads more)
    head_share: float = 0.25
    # whether exact-mode calls send a head chunk: None, measured with the chunk count (a fixed count: sent where the
    # leg can); True: sent wherever the leg can; False: never
    head_chunk: Optional[bool] = None
    # whether an exact-mode dispatch of several chunks (without a head chunk) moves them through the domain leg in one
    # gated call where the domain transport can (``_gated``); False: one call per chunk
    gated_exact: bool = True
    # whether such a call (several chunks, no head chunk) issues that gated domain leg before its count read, sized by
    # the needs of the last EARLY_HISTORY gated calls of its kind with EARLY_MARGIN more (``_early_issue``; GPUs, kinds
    # whose gated call has run): the host's work after the read is then the rows' collectives and the handles. None:
    # where ``early_issue_by_default`` allows it (module docstring, "Early issue"); True: everywhere on GPUs
    early_issue: Optional[bool] = None
    EARLY_MARGIN = 0.125
    EARLY_HISTORY = 4

    def __init__(self, group, device: torch.device, buffer_id: int, domains: Domains,
                 domain_transport: Any = "auto", leg: str = "nccl", num_nvl_bytes: int = 0,
                 num_rdma_bytes: int = 0) -> None:
        from . import create_transport

        super().__init__(group, device, buffer_id)
        if domains.world_size != self.num_ranks or domains.num_domains < 2:
            raise ValueError(f"HierarchicalTransport: {domains.describe()} does not split a group of "
                             f"{self.num_ranks} ranks into several domains")
        if leg not in INTER_DOMAIN_LEGS:
            raise ValueError(f"HierarchicalTransport: leg={leg!r} is not one of {tuple(INTER_DOMAIN_LEGS)}")
        self.domains = domains
        self.num_domains, self.local_size = domains.num_domains, domains.local_size
        self.local_index, self.domain_index = domains.local_index(self.rank), domains.domain_of(self.rank)
        self.domain_group, self.rail_group = subgroups(group, domains, self.rank, device.type == "cuda")
        self.rail_ranks = domains.rail_ranks(self.local_index)
        if self.local_size == 1:  # nothing to forward within a domain of one rank: a copy
            domain_transport = "alltoall"
        self.domain, self.domain_reason = create_transport(domain_transport, self.domain_group, device, buffer_id,
                                                           num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes)
        self.leg_name = leg
        self.rail = INTER_DOMAIN_LEGS[leg](self.rail_group, device, buffer_id)
        # (why a gated call's domain leg does not go before its count read by default, or None: ``_early_plan``)
        self._early_off = ("GPUs only" if device.type != "cuda" else
                           _early_off_reason(str(dist.get_backend(self.rail_group))))
        self.rail.fuse_rows = True  # rows with their records (weights) in one all_to_all: a round trip fewer
        if isinstance(self.domain, AllToAllTransport):  # (the same within a domain that runs the portable transport)
            self.domain.fuse_rows = True
        else:  # a one-sided node leg reads the landed rows in place (its streaming push takes any row stride)
            self.rail.rows_as_views = True
        self.errors = CombinedErrors((self.domain.errors, self.rail.errors), device)
        self._agreed: set = set()
        self.phase_log = None  # see _leg (a property: it also sets the inter-domain leg's on_collective)
        self.phase_events = True  # phase_log entries with CUDA events (False: the host's times alone, no events)
        self._net: Optional[torch.cuda.Stream] = None  # the inter-domain leg's stream while a dispatch pipelines
        self._gate_flags: Optional[torch.Tensor] = None  # int64 per chunk of a gated cached dispatch (_mapped)
        self._gate_value = 0  # the last value released into them: one more per call
        self._early_seen: dict = {}  # a gated call's kind -> the needs of its last calls (_early_plan)
        # calls issued early, let go, and let go with their first rows landed in them ("first rows moved": _gated)
        self.early_stats: collections.Counter = collections.Counter()
        self._pinned: dict = {}  # pinned host blocks for the count read (faults.read_later)
        self._tuner = _ChunkTuner(self.CHUNK_CANDIDATES, self.TUNE_CALLS, device)
        self._head = 0  # the next exact-mode dispatch's head chunk: slots per domain (the same on every rank; 0: none)
        self._head_from: Optional[tuple] = None  # (what it is sized from, when asked: ``_next_head``)
        self._fault = _faults.setdefault(self.rail_group, {})  # shared with every Buffer on these groups
        self._calls = 0  # calls made (the same count on every rank): names a call in the fault reports
        self._in_flight: collections.deque = collections.deque()  # (end event, issued at, call, fn) per call
        self._report_scope = f"epcomm/fault/{getattr(group, 'group_name', '')}/{buffer_id}"
        self._phase: Optional[tuple] = None  # (phase, within) of the part running now (_leg), for fault reports
        self._warm_chunks: Optional[int] = None  # the chunk count of Buffer.warmup's calls (warm_normal)
        self._warm_nohead = False  # and whether they send no head chunk
        self._unmerged = False  # cached dispatches through the chunks one by one (warm_normal's last round)

    @classmethod
    def capabilities(cls) -> Capabilities:
        return Capabilities(
            name=cls.name, devices=("cpu", "cuda"), one_sided=False, sync_free_normal=True,
            graph_capturable_low_latency=True, needs_p2p=False, needs_p2p_atomics=False,
            description="tokens cross between domains (nodes) once per destination domain over torch.distributed, "
                        "then the domain's intranode transport forwards them")

    def describe(self) -> str:
        if self._fault:
            return f"{self.domains.describe()}; aborted: {self._fault['message']}"
        return (f"{self.domains.describe()}; inter-domain leg: {self.leg_name} (torch.distributed all_to_all over "
                f"{dist.get_backend(self.rail_group)}, rail peers {self.rail_ranks}); domain leg: "
                f"{self.domain.name} ({self.domain_reason}); normal-mode chunks: {self.chunks_description()}; gated "
                f"node leg before the count read: {self.early_description()}")

    def early_description(self) -> str:
        """Whether a gated exact call's domain leg is issued before its count read (``early_issue``), and why."""
        if self.early_issue is not None:
            return f"{'on' if self.early_issue else 'off'} (early_issue={self.early_issue})"
        if self._early_off is not None:
            return f"off ({self._early_off})"
        return "on where a kind repeats (NCCL between the domains)"

    def _fixed_chunks(self) -> tuple:
        """``(count, where it was set)`` when the chunk count is fixed (``EPCOMM_INTERNODE_CHUNKS``, else
        ``pipeline_chunks``), ``(None, "")`` when it is measured."""
        from_env = env.internode_chunks()
        if from_env:
            return from_env, "EPCOMM_INTERNODE_CHUNKS"
        return (self.pipeline_chunks, "pipeline_chunks") if self.pipeline_chunks else (None, "")

    def _chunk_ratio(self) -> float:
        """Each pipelined chunk's share of a call's tokens over the previous one's (``chunk_bounds``): ``chunk_ratio``
        when set, else the one the chunk tuner measured (1, even chunks, until it has)."""
        return self.chunk_ratio if self.chunk_ratio is not None else self._tuner.ratio

    def chunks_description(self) -> str:
        """How many pipelined chunks exact-mode calls use, and why."""
        fixed, source = self._fixed_chunks()
        if not fixed:
            return self._tuner.describe()
        how = " (chunk_ratio)" if self.chunk_ratio is not None else ""
        return f"{fixed} ({source}); chunks {split_description(self._chunk_ratio())}{how}"

    # ------------------------------------------------------------------ helpers
    @contextlib.contextmanager
    def _leg(self, fn: str, phase: str, within: bool = False):
        """Run a part of a call; a wait of it that expired (``faults.WaitExpired``) or a failure of
        torch.distributed in it (gloo's timeout, a peer that closed its connection) ends this transport
        (``_fail``). ``within``: the domain leg (its one-sided kernels report their own timeouts). With
        ``phase_log`` a list (a benchmark's breakdown), each part appends ``(phase, start, end, host seconds, host
        start)``: CUDA events on the stream it ran on (or host times (s) on CPUs; None with ``phase_events`` False: the
        host's times alone, which cost the host nothing measurable), the seconds the host spent in it and when it began
        (``time.perf_counter``)."""
        log = self.phase_log
        events = log is not None and self.phase_events
        start = _mark(self.device) if events else None
        began = time.perf_counter() if log is not None else 0.0
        outer, self._phase = self._phase, (phase, within)
        try:
            yield
            if log is not None:
                log.append((phase, start, _mark(self.device) if events else None, time.perf_counter() - began, began))
        except faults.WaitExpired as exc:
            raise self._fail(fn, phase, within, exc) from exc
        except EpcommError:
            raise
        except RuntimeError as exc:
            raise self._fail(fn, phase, within, exc) from exc
        finally:
            self._phase = outer

    @property
    def phase_log(self) -> Optional[list]:
        return self._phase_log

    @phase_log.setter
    def phase_log(self, log: Optional[list]) -> None:
        self._phase_log = log
        if hasattr(self.rail, "on_collective"):  # (the leg marks when each of its rows' collectives is issued)
            self.rail.on_collective = None if log is None else functools.partial(self._milestone, COLLECTIVE_MILESTONE)

    def _milestone(self, name: str) -> None:
        """With ``phase_log`` a list, append a point of the call named ``name``: a part that takes no time
        (``_leg``'s entry, its start and end the same)."""
        log = self.phase_log
        if log is not None:
            mark = _mark(self.device) if self.phase_events else None
            log.append((name, mark, mark, 0.0, time.perf_counter()))

    def _fail(self, fn: str, phase: str, within: bool, exc: Exception) -> EpcommTimeoutError:
        """A collective of ``phase`` did not complete in time: ask the ranks of its leg where they are (the store,
        bounded), abort the inter-domain and domain groups (their stuck kernels exit; NCCL's watchdog leaves the
        process alone), mark every transport on these groups as ended, and return the error to raise. A call
        still running on the stream from before (``_in_flight``) is the one blamed when it has not completed."""
        late = next(((c, f) for e, _, c, f in self._in_flight if not faults.done(e)), None)
        here, peers, where = self._locate(phase, within, late)
        message = (f"rank {self.rank}: {here} with {peers} did not complete within EPCOMM_TIMEOUT_S="
                   f"{env.timeout_s():g} s: {where}; the inter-domain and domain groups were aborted, this Buffer "
                   f"cannot be used again ({type(exc).__name__}: {str(exc)[:400]})")
        self._abort(message)
        self.errors.record(NORMAL, f"{fn}: {message}")
        return EpcommTimeoutError(f"{fn}: {message}")

    def _locate(self, phase: str, within: bool, late: Optional[tuple] = None) -> tuple:
        """``(where this rank is stuck, with which ranks, where they are in words)`` after a wait expired; the other
        ranks of the leg are asked (``faults.where_are``: the store, bounded). ``late``: an earlier call ``(number,
        fn)`` still running on the stream, blamed first."""
        call = self._calls
        if late is not None:  # an earlier call's collectives (over either group) are what this wait is behind
            call, members = late[0], list(range(self.num_ranks))
            here, peers = f"the collectives of {late[1]}, still running on the stream", f"ranks {members}"
        elif within:
            members = self.domains.domain_ranks(self.domain_index)
            here, peers = f"the domain leg ({phase})", f"the ranks of its domain {members}"
        else:
            members = self.rail_ranks
            here, peers = f"the inter-domain leg ({phase})", f"the rail peers {members}"
        grace = min(max(1.0, 0.25 * env.timeout_s()), 10.0)
        where = faults.where_are(f"{self._report_scope}/{call}", self.rank, here,
                                 [r for r in members if r != self.rank], grace)
        return here, peers, faults.describe_peers(where)

    def _blocked(self, fn: str, seconds: float, where: str) -> None:
        """``faults.WATCH``'s report (from its thread) that this call's host has been blocked in one native call for
        ``seconds``, at ``where``. The one such call known to block for good: a kernel module's first load, which
        waits for the device's queue to drain, behind a collective a peer never joined. It holds the CUDA context's
        lock while it waits, so no thread of this process can abort the groups (an abort's CUDA calls wait behind it;
        measured on torch 2.11 with NCCL 2.28): NCCL's watchdog ends the process at the groups' timeout. What can be
        done is said here first, with the ranks that never joined, in the log (an error). No CUDA call here."""
        phase, within = self._phase if self._phase is not None else ("the call's host work", False)
        here, peers, seen = self._locate(phase, within)
        log.error("rank %d: %s: the host has been blocked for %.0f s in one native call at %s (a kernel's first load "
                  "waits for the device, behind a collective that does not complete), in %s with %s: %s; no thread "
                  "can end it (its CUDA calls would wait behind the load): NCCL's watchdog ends this process at the "
                  "groups' timeout", self.rank, fn, seconds, where, here, peers, seen)

    def _abort(self, message: str) -> None:
        if self._fault:
            return
        self._fault["message"] = message
        self._in_flight.clear()
        groups = (self.rail_group, self.domain_group)
        faults.abort_groups(groups)
        _forget_subgroups(groups)

    def _enter(self, fn: str) -> None:
        if self._fault:
            raise EpcommTimeoutError(f"{fn}: this Buffer's groups were aborted at an earlier call: "
                                     f"{self._fault['message']}")
        self._calls += 1
        if self._in_flight and not torch.cuda.is_current_stream_capturing():  # (no event queries while capturing)
            self._settle(fn, wait=False)

    def _leave(self, fn: str) -> None:
        if self.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return
        end = torch.cuda.Event()
        end.record()
        self._in_flight.append((end, time.monotonic(), self._calls, fn))

    # calls that may run on the stream at once (no host synchronisation between them); one more waits (bounded)
    # for the oldest, so that the launch queue never fills behind a collective that a rank never joins
    MAX_IN_FLIGHT = 32

    def _settle(self, fn: str, wait: bool) -> None:
        """Forget the calls that completed on the stream; if the oldest still running was issued more than
        ``EPCOMM_TIMEOUT_S`` ago, fail (``_fail``); ``wait`` (or more than ``MAX_IN_FLIGHT`` running): wait for all
        (bounded)."""
        q = self._in_flight
        while q and faults.done(q[0][0]):
            q.popleft()
        with self._leg(fn, "calls still running on the stream"):
            while q and (wait or len(q) > self.MAX_IN_FLIGHT or time.monotonic() > q[0][1] + env.timeout_s()):
                end, issued, call, was = q[0]
                faults.host_wait(end, fn, f"rank {self.rank}: {was} (call {call})", issued)
                q.popleft()

    def _slowest(self, fn: str, times: torch.Tensor) -> list:
        """The largest of every rank's ``times`` (float64 ``[n]``), over the domain group then the rail group (the
        transport's own groups: their collectives can be aborted), read by the host with a bounded wait."""
        every = times.to(self.device) if self.device.type == "cuda" else times.clone()
        with self._leg(fn, "chunk agreement"):
            dist.all_reduce(every, op=dist.ReduceOp.MAX, group=self.domain_group)
            dist.all_reduce(every, op=dist.ReduceOp.MAX, group=self.rail_group)
            return faults.host_list(every, fn, f"rank {self.rank}: the chunk agreement")

    def _agree(self, fn: str, key: tuple) -> None:
        """At the first call of each kind, the ranks compare its shape (``key``) before any data moves; a rank
        whose key differs makes every rank raise, naming the ranks and their values."""
        if key in self._agreed or (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return
        meet(self.group, fn)
        keys: list = [None] * self.num_ranks
        dist.all_gather_object(keys, key, group=self.group)
        if any(k != key for k in keys):
            groups: dict = {}
            for r, k in enumerate(keys):
                groups.setdefault(repr(k), []).append(r)
            raise ValueError(f"{fn}: the ranks disagree on this call's shape (each must pass the same hidden size, "
                             f"dtypes, top-k, number of experts and token limits): "
                             + "; ".join(f"ranks {v}: {k}" for k, v in groups.items()))
        self._agreed.add(key)

    def checks_topk(self, x: torch.Tensor, num_worst_tokens: int) -> bool:
        # the inter-domain leg is given its counts and reads none: the Buffer counts bad ids, read with the counts
        return False

    @property
    def deferred_errors(self) -> torch.Tensor:
        return self.rail.deferred_errors  # one of the words its DeviceErrors watch

    # ------------------------------------------------------------------ normal mode
    @_guarded("Buffer.dispatch")
    def dispatch(self, req: DispatchRequest) -> DispatchResult:
        fn = "Buffer.dispatch"
        if req.handle is not None:
            return self._cached_dispatch(req)
        if req.topk_idx is None:
            return self._dispatch_by_rank(req)
        x, n = req.x, req.x.size(0)
        W = req.num_worst_tokens
        cap = W // self.num_ranks if W else 0
        if W and n > cap:
            raise ValueError(f"{fn}: across domains, num_worst_tokens bounds each rank's tokens by num_worst_tokens // "
                             f"num_ranks = {cap} (the inter-domain leg has that many slots per domain); x has {n} "
                             f"tokens: pass num_worst_tokens >= {n * self.num_ranks}")
        self._agree(fn, ("dispatch", x.dtype, x.size(1), req.x_scales is not None, req.topk_idx.size(1),
                         req.topk_weights is not None, req.num_experts, bool(W)))
        forced = self._warm_chunks or self._fixed_chunks()[0]
        into = not W and getattr(self.rail, "can_send_ahead", lambda _: False)(x)  # (the leg's kernel path)
        can_head = into and self.head_share > 0 and self.head_chunk is not False
        candidate = None  # the tuner's (chunks, head) of this call, while it measures
        with self._leg(fn, "chunk agreement"):
            if W:
                chunks, with_head = 1, False
            elif forced:
                chunks, with_head = forced, not self._warm_nohead
            else:
                self._tuner.offer_head(can_head and self.head_chunk is None)
                candidate = self._tuner.next(lambda times: self._slowest(fn, times), fn)
                chunks, with_head = candidate[0], candidate[1] or bool(self.head_chunk)
        row_bytes = x.size(1) * x.element_size() + (0 if req.x_scales is None else
                                                    req.x_scales.size(1) * req.x_scales.element_size())
        timing = None if candidate is None else self._tuner.start(candidate, n * row_bytes)
        # slots per domain of the head chunk (sent ahead of the counts; 0: none, as where the leg cannot or the tuner
        # measured the calls faster without one)
        head = self._head_slots(self._next_head(), row_bytes) if can_head and with_head else 0
        # chunk bounds at multiples of `align` tokens: every per-token tensor's chunks start 16-byte aligned, as the
        # whole tensor does, so no chunk launches a kernel variant of its own (which would be compiled and loaded
        # mid-call, where loading waits for the device and so for any collective that hangs there)
        align = token_alignment(*(t.stride(0) * t.element_size() for t in (
            x, req.x_scales, req.topk_idx, req.topk_weights, req.is_token_in_rank) if t is not None and t.dim() == 2))
        h = min(n, head)  # this rank's tokens in it (the slots are the same on every rank)
        h = h if h == n else h - h % align
        bounds = [(h + a, h + b) for a, b in chunk_bounds(n - h, chunks, self._chunk_ratio() if chunks > 1 else 1.0,
                                                          align)]
        if head:
            bounds.insert(0, (0, h))
        ahead = landed = None
        place = gate = False  # (the domain leg writes rows in place; the chunks' domain legs are one gated call)
        marks = timing[2] if timing is not None and chunks == 1 else None  # a one-chunk call's legs, timed
        if W:  # fixed slots, no counts to learn
            subs, counts, starts, gathered = [req], None, None, None
        else:  # every chunk's layout computed here (the counts below are made from it), both legs' counts learnt
            subs = [self._chunk(req, a, b, c == 0) for c, (a, b) in enumerate(bounds)]
            place = self.domain.gates_cached_dispatch and self.domain.can_gate(subs[0])
            gate = place and len(subs) > 1 and not head and self.gated_exact and self.domain.gates_exact_dispatch
            plan = self._early_plan(req, len(subs)) if gate else None
            early = None if plan is None else self._early_landing(req, len(subs), plan)
            # the first rows issued once the inter-domain leg's own counts are read, before the domain's: a gated
            # call's (the call they land in), or a one-chunk call's on the leg's kernel path (the rows they land in)
            first = []

            def rail_first(sends: list, recvs: list, leg: DispatchRequest, chunk_starts: Any) -> None:
                first.append(self._gated_first(fn, req, early, len(subs), sends, recvs, leg, chunk_starts) if gate
                             else self._first_rows(fn, sends, recvs, leg, marks))

            counts, starts, ahead, gathered = self._exchange_counts(
                fn, req, subs, bounds, head, None if early is None else functools.partial(self._early_issue, fn, req,
                                                                                          early),
                needs=gate, rail_first=rail_first if gate or (into and len(subs) == 1 and not head) else None)
            # with its counts known, every chunk's domain leg writes each row where the intranode path's order puts
            # it, into one set of outputs (no sort, no gather after the call), where it can (the one-sided
            # transports' streaming dispatch); each chunk's map is made once its rows cross (nothing crosses while the
            # host works between the count read and them)
            if gate:  # (its first rows issued: done, unless the domain's storage cannot hold it)
                got, landed = self._gated(fn, req, early, first[0], counts, gathered, bounds, timing)
                if got is not None:
                    return got
            elif first:
                landed = first[0]
        shared = None  # (made once the first rows' collective is issued, as the domain leg's counts are)
        parts = []
        if landed is None:  # (else marked where its rows were issued)
            _mark_into(marks, self.device)
        for c, r1 in enumerate(self._rail_chunks(fn, subs, cap, counts, ahead, landed)):
            h1 = r1.handle
            known, sources = (None, None) if counts is None else counts.domain[c]
            if place:
                if shared is None:
                    shared = self._outputs(req, sum(sum(d[1]) for d in counts.domain))
                in_place, summary = self._rows_in_place(fn, sources, gathered, c, len(subs), req.num_experts)
                known = evolve(known, summary_tensor=summary)
            else:
                in_place = None
            _mark_into(marks, self.device)
            r2, src_rank, src_idx = self._forward(fn, subs[c], r1, h1, None if starts is None else starts[:, c],
                                                  known, in_place, shared)
            _mark_into(marks, self.device)
            parts.append((r2, src_rank, src_idx, h1, in_place))
        self._join()
        r2s = [p[0] for p in parts]
        if place:  # (there already: the rows' sources and the scales split from the carried columns once)
            order, back = None, _cat([p[4] for p in parts])
            outs, src_rank, src_idx = self._split_carried(shared)
        else:  # the rows in the order of the intranode path: by source rank, then source token (padding rows last)
            fields = ("recv_x", "recv_scales", "recv_topk_idx", "recv_topk_weights")
            src_rank, src_idx = _cat([p[1] for p in parts]), _cat([p[2] for p in parts])
            order, back = _canonical_order(src_rank, self.num_ranks)
            outs = tuple(_take([getattr(r, f) for r in r2s], order) for f in fields)
            src_rank, src_idx = src_rank[order], src_idx[order]
        return self._finish(req, outs, src_rank, src_idx, [p[3] for p in parts], [r.handle for r in r2s], bounds,
                            back, order, ahead is not None, [r.num_recv_tokens_per_expert_list for r in r2s], timing)

    def _gated_first(self, fn: str, req: DispatchRequest, early: Optional["_GatedCall"], C: int, sends: list,
                     recvs: list, leg: DispatchRequest, starts: Optional[torch.Tensor]) -> "_GatedCall":
        """The first step of an exact-mode dispatch of ``C`` chunks (without a head chunk) whose domain legs may be one
        gated call (``_gated``), once the inter-domain leg's counts are read and before the domain's are
        (``_exchange_counts``' ``rail_first``: ``sends``, ``recvs`` ``[D, C]`` host lists by domain then chunk, ``leg``
        chunk 0's request, prepared): every chunk's landing rows (``_landing_at``), the call they land in (``early``'s,
        whose domain leg went before the count read, where chunk 0's rows fit its landing buffer; else one of its own),
        and chunk 0's rows issued into it (``_GatedCall.first``). Every rank issues them, whatever its domain then
        decides (``_gated``): the rows' collectives are the same on every path."""
        m1 = [sum(recvs[c::C]) for c in range(C)]  # the rows each chunk lands here
        at = _landing_at(m1)
        fits = early is not None and m1[0] <= early.landed.size(0)
        if fits:
            call, early.starts = early, starts
        else:
            if early is not None:  # (its bounds are outgrown: let go now, before the network stream waits below for
                self._let_go(early)  # the caller's stream, where its push is)
            call = self._gated_landing(req, C, at[-1], starts)
        self._milestone(LEAD_LANDING)
        # (an early call's: the network stream already waits for the rows' packing, and its landing buffer was made
        # before the call's first device work; a call of its own was made just now, on the caller's stream)
        call.first = (m1, at, self._first_issued(fn, leg, sends[0::C], recvs[0::C], call.landed[:m1[0]], not fits,
                                                 call.streams))
        return call

    def _first_issued(self, fn: str, leg: DispatchRequest, sends: list, recvs: list, out: torch.Tensor, wait: bool,
                      streams: Optional[tuple] = None, marks: Optional[list] = None) -> Callable:
        """A call's first inter-domain rows (``leg``, prepared: ``sends`` / ``recvs`` rows to and from each rail peer)
        issued into ``out`` on the network stream (``_network``: ``wait``, ``streams``) once the leg's own counts are
        read (``_gated_first``, ``_first_rows``); ``marks``: the tuner's timing of a one-chunk call, the rows' start
        marked there. Returns what ``AllToAllTransport.dispatch_into`` returned."""
        into = []

        def issue() -> None:
            _mark_into(marks, self.device)
            self._milestone(LEAD_REQUEST)
            with self._leg(fn, ROWS_PHASE):
                into.append(self.rail.dispatch_into(leg, sends, recvs, out))

        self._network(issue, wait=wait, streams=streams)
        return into[0]

    def _first_rows(self, fn: str, sends: list, recvs: list, leg: DispatchRequest,
                    marks: Optional[list]) -> torch.Tensor:
        """A one-chunk exact-mode dispatch's inter-domain rows (no head chunk, the leg on its kernel path), issued as a
        gated call's first rows are (``_exchange_counts``' ``rail_first``: ``sends``, ``recvs`` ``[D]`` host lists,
        ``leg`` its request, prepared): once the leg's own counts are read, before the domain's, on the network stream
        (which waits for their packing alone, not for the domain's gather), into rows of their own
        (``AllToAllTransport.dispatch_into``), which the caller's stream waits for and unpacks once the counts are
        known (``AllToAllTransport.landed_result``, ``_rail_chunks``). Returns those rows. ``marks``: the tuner's
        timing of a one-chunk call, its rows' start marked on the network stream."""
        m = sum(recvs)
        landed = _landing(leg, m, self.device)[:m]
        self._milestone(LEAD_LANDING)
        self._first_issued(fn, leg, sends, recvs, landed, False, marks=marks)
        self._join()  # (what the caller's stream does next reads them)
        return landed

    def _gated(self, fn: str, req: DispatchRequest, early: Optional["_GatedCall"], call: "_GatedCall",
               counts: "_Counts", gathered: torch.Tensor, bounds: list, timing) -> tuple:
        """An exact-mode dispatch of several chunks (without a head chunk) whose domain leg is one gated push for all
        of them, as the cached dispatch's (``_mapped``), once its counts are read; ``call``: ``_gated_first``'s, its
        first chunk's rows issued; ``early``: the call whose domain leg ``_early_issue`` issued before the count read,
        or None. Returns ``(result, None)``, or ``(None, chunk 0's landed rows)`` where the domain's storage cannot
        hold the merged call and may not grow: then the chunks go one by one, the first from its landed rows (every
        rank of the domain decides the same).

        Every chunk's inter-domain rows land beside their records in one buffer, each chunk's at a multiple of 16
        rows (``AllToAllTransport.dispatch_into``, on the network stream), each chunk's collective followed there by
        ``launch_forward_layout``: its records unpacked into the merged input of the domain leg (scales and sources,
        top-k ids, weights), its layout within the domain, its positions in the merged call and in its own, its sends
        checked against the counts its rank promised in the count exchange (a deferred error), then its flag. The
        domain leg's one call (``DispatchRequest.positions``: no count exchange), issued on the caller's stream once
        every collective is, waits on the device for each chunk's flag and forwards its rows while the later chunks
        still cross, every row written where the intranode path's order puts it (``launch_rows_merged``'s map, made
        from the domain's gathered counts with each chunk's summary). Each chunk keeps a handle of its own
        (``known_handle``: its own positions and rows, as its own call would have left them), which the combine's
        pipelining and the cached dispatches take as before. Host work per further chunk: its collective, two
        launches and its handles.

        An early call goes on where the counts fit the bounds it was issued with; else (every rank of the domain sees
        the same counts) its push is let go with no rows (its chunks' bounds empty, their flags released), and the
        call goes the way it would have without it, chunk 0's rows moved into a call of their own where they landed
        in the early one's buffer."""
        C = call.chunks
        need = counts.needs()
        rails = [None]  # (chunk 0's handle, made below from the call that keeps its rows)
        if call is early:
            if all(n <= b for n, b in zip(need, early.plan)):  # (its bounds hold every chunk's rows)
                early.streams[1].wait_event(early.ready)  # (what its forward layouts read: made before its push)
                early.m1, early.at = early.first[:2]
                rails[0] = self._rail_handle(early, counts, 0, early.first[2])
                self._network(lambda: self._gated_legs(fn, early, counts, rails), wait=False, streams=early.streams)
                self._early_seen_add(req, C, need)  # (after the rows' collectives: not in the host's lead)
                return self._gated_result(req, early, counts, rails, bounds, timing), None
            self._let_go(early)
            # chunk 0's rows into a call of their own (on the network stream, after they land)
            m1 = early.first[0]
            call = own = self._gated_landing(req, C, early.first[1][-1], early.starts)
            own.first = early.first
            self._network(lambda: own.landed[:m1[0]].copy_(early.landed[:m1[0]]), streams=own.streams)
            self.early_stats["first rows moved"] += 1
        m1, at, into = call.first
        if not self.domain.holds_merged(need[2], need[3], req=req, extra_scales=2):  # (+ the carried sources)
            return None, call.landed[:m1[0]]
        self._early_seen_add(req, C, need)
        call.m1, call.at = m1, at
        # the merged input's other parts, while chunk 0's rows cross
        self._gated_merged(req, call, gathered)
        rails[0] = self._rail_handle(call, counts, 0, into)
        self._network(lambda: self._gated_legs(fn, call, counts, rails), wait=False, streams=call.streams)
        rows = sum(sum(d[1]) for d in counts.domain)
        self._gated_domain(fn, req, call, gathered, rows, need[2], need[3], counts.domain)
        return self._gated_result(req, call, counts, rails, bounds, timing), None

    def _gated_landing(self, req: DispatchRequest, C: int, rows: int, starts: Optional[torch.Tensor]) -> "_GatedCall":
        """A gated call of ``C`` chunks: the buffer its ``rows`` inter-domain rows land in beside their records, the
        carried columns (scales, then each row's source domain and token), the gate's flags and chunk bounds;
        ``starts``: the rail peers' chunk starts (``_exchange_counts``), None until the counts are read."""
        dev = self.device
        ns = 0 if req.x_scales is None else req.x_scales.size(1)
        landed = _landing(req, rows, dev)
        rows = landed.size(0)
        carried = torch.empty(rows, ns + 2, dtype=torch.float32, device=dev)
        flags, value = self._next_gate(C)  # (before the network stream's wait: a first call zeroes them on this stream)
        # the chunks' bounds, then their forward layouts' tickets (zeroed: also loads the kernel that empties the bounds
        # in a call let go, _gated)
        at = -(-(C + 1) // 4) * 4  # (the tickets 16-byte aligned, whatever the chunk count: one kernel variant)
        words = torch.zeros(at + C, dtype=torch.int32, device=dev)
        call = _GatedCall(C, landed, carried, flags, value, words[:C + 1], starts, words[at:])
        carried_words = carried.view(torch.int32)
        call.sources = (carried_words[:, ns], carried_words[:, ns + 1])
        call.streams = self._streams() if dev.type == "cuda" else None
        return call

    def _gated_merged(self, req: DispatchRequest, call: "_GatedCall", gathered: torch.Tensor) -> None:
        """The merged input's other parts (the domain leg's request over the landed rows), the chunks' sends and the
        rows of their own positions (``_GatedCall.own_pos``), and the views of them the chunks' forward layouts take
        (``_GatedCall.views``; ``gathered``: the domain's gathered counts)."""
        x, L, dev, rows = req.x, self.local_size, self.device, call.landed.size(0)
        k, e_dom = req.topk_idx.size(1), req.num_experts // self.num_domains
        w = torch.empty(rows, k, dtype=torch.float32, device=dev) if req.topk_weights is not None else None
        call.merged = DispatchRequest(columns_of_rows(call.landed, x.dtype, x.size(1)), call.carried,
                                      torch.empty(rows, k, dtype=torch.int64, device=dev), w, None,
                                      torch.empty(rows, L, dtype=torch.bool, device=dev), None, e_dom, 1, 0, None,
                                      req.config, None, req.overlapped,
                                      positions=torch.empty(rows, L, dtype=torch.int32, device=dev))
        call.sends = torch.empty(call.chunks, -(-L // 4) * 4, dtype=torch.int32, device=dev)  # (rows 16 bytes apart)
        call.own_rows = torch.empty(rows, L, dtype=torch.int32, device=dev)
        C, xb = call.chunks, x.size(1) * x.element_size()
        call.views = (call.landed.view(torch.int32)[:, xb // 4:], call.carried.view(torch.int32),
                      call.merged.is_token_in_rank.view(torch.int8), None if w is None else w.view(torch.int32),
                      gathered[self.local_index * C:(self.local_index + 1) * C])  # (records, ..., this rank's counts)

    def _gated_rail(self, fn: str, call: "_GatedCall", counts: "_Counts", c: int, rails: list) -> None:
        """Chunk ``c``'s inter-domain rows into their place in the landing buffer (on the network stream)."""
        a, b = call.at[c], call.at[c] + call.m1[c]
        sends, recvs = counts.rail_lists(c)  # (the request's counts: its KnownCounts only when a handle is made)
        with self._leg(fn, ROWS_PHASE):
            into = self.rail.dispatch_into(counts.leg(c), sends, recvs, call.landed[a:b])
        rails.append(self._rail_handle(call, counts, c, into))

    @staticmethod
    def _rail_handle(call: "_GatedCall", counts: "_Counts", c: int, into: Callable) -> Callable[[], DispatchHandle]:
        """The function that makes chunk ``c``'s inter-domain handle when first asked (``into``: what
        ``AllToAllTransport.dispatch_into`` returned for its rows): its rows' sources, the carried columns the
        forward layout unpacks at its landing rows, and its received per-expert counts."""
        a, b = call.at[c], call.at[c] + call.m1[c]
        domain, token, per_expert = call.sources + (counts.per_expert(c),)
        return lambda: into((domain[a:b], token[a:b]), per_expert)

    def _gated_legs(self, fn: str, call: "_GatedCall", counts: "_Counts", rails: list) -> None:
        """On the network stream (which already waits for the caller's work the chunks read): every chunk's rows (the
        first's, where ``rails`` has it, already issued), each followed by ``launch_forward_layout``, its flag last."""
        from ..kernels.ep import launch_forward_layout

        L, C, merged, at = self.local_size, call.chunks, call.merged, call.at
        e_dom = merged.num_experts
        records, carried, itr, w, mine = call.views  # (made with the merged input: before the count read if early)
        for c in range(C):
            if c >= len(rails):
                self._gated_rail(fn, call, counts, c, rails)
            launch_forward_layout(records, at[c], call.m1[c], at[c + 1] - at[c], call.starts, c, carried,
                                  merged.topk_idx, w, itr, merged.positions, call.own_pos[c],
                                  call.sends, mine, self.domain.deferred_errors, call.flags, call.rows_at, call.value,
                                  e_dom // L, e_dom, call.tickets)

    def _gated_domain(self, fn: str, req: DispatchRequest, call: "_GatedCall", gathered: torch.Tensor, rows: int,
                      max_pair: int, most: int, domain: Optional[list]) -> None:
        """The domain leg's one gated call over the merged input, on the caller's stream: its row maps and summaries
        made from the domain's gathered counts, its outputs (``rows`` rows), the push. ``domain``: the chunks' domain
        counts (``_Counts.domain``), or None where they are not read yet (``_early_issue``: ``rows``, ``max_pair`` and
        ``most`` are then bounds, and the host knows nothing else of the call)."""
        from ..kernels.ep import Gate, launch_rows_merged, summary_words

        D, L, C, dev = self.num_domains, self.local_size, call.chunks, self.device
        e_dom = req.num_experts // D
        call.row_map = torch.empty(rows, dtype=torch.int64, device=dev)
        call.back = torch.empty_like(call.row_map)
        call.summaries = torch.empty(C + 1, summary_words(L, e_dom // L), dtype=torch.int32, device=dev)
        launch_rows_merged(gathered, call.row_map, call.back, call.summaries, gathered.stride(0) * C,
                           gathered.size(1) - D * L + self.local_index, L, D, C, gathered.stride(0), self.local_index,
                           e_dom // L)
        call.shared = self._outputs(req, rows)
        if domain is None:  # (the push takes the host's counts only as bounds: out rows, rows per source, tokens)
            total = KnownCounts((0,) * L, (rows,) + (0,) * (L - 1), (0,) * (e_dom // L), num_tokens_max=most,
                                max_pair=max_pair, summary_tensor=call.summaries[C])
        else:
            known = [d[0] for d in domain]
            total = KnownCounts(*(tuple(map(sum, zip(*(getattr(kc, f) for kc in known)))) for f in (
                "num_tokens_per_rank", "num_recv_tokens_per_rank", "num_recv_tokens_per_expert")),
                num_tokens_max=most, max_pair=max_pair, summary_tensor=call.summaries[C])
        gate = Gate(call.rows_at, call.flags, call.value, C)
        with self._leg(fn, "forwarding the tokens", within=True):
            self.domain.dispatch(evolve(call.merged, known=total, gate=gate, row_map=call.row_map, outs=call.shared))

    def _gated_result(self, req: DispatchRequest, call: "_GatedCall", counts: "_Counts", rails: list, bounds: list,
                      timing) -> DispatchResult:
        """A gated call's result once every launch is issued: its output rows (the first of its outputs: those the
        domain counts give), and each chunk's own handle (its rows' sources in its own order, its positions and
        sends), made when the combine or a cached dispatch first asks for them (``_HandleState.domain``), as
        ``_finish`` takes them."""
        from ..kernels.ep import summary_per_expert

        self._join(call.streams)
        counts.drop_requests()  # (the handles below keep the counts: not this call's requests and packed rows)
        L, C, e_dom = self.local_size, call.chunks, req.num_experts // self.num_domains
        per_chunk, per_expert = counts.received()  # (the domain leg's KnownCounts made when the handles are)
        rows = sum(per_chunk)
        shared = tuple(None if t is None else t[:rows] for t in call.shared)
        outs, src_rank, src_idx = self._split_carried(shared)
        # (what the handles need, not the landed rows: those are let go with the call)
        src, domain, itr, back, own_pos, sends, summaries = (shared[4], self.domain, call.merged.is_token_in_rank,
                                                              call.back, call.own_pos, call.sends, call.summaries)
        at, m1, config = call.at, call.m1, req.config
        hidden, dtype = call.merged.x.size(1), call.merged.x.dtype

        def handles() -> tuple:
            made, start = [], 0
            known = [d[0] for d in counts.domain]
            for c in range(C):
                a, b = at[c], at[c] + m1[c]
                own = src.index_select(0, back[start:start + per_chunk[c]])
                start += per_chunk[c]
                rows_of = torch.empty(m1[c], hidden, dtype=dtype, device="meta")  # (the handle reads their shape)
                made.append(domain.known_handle(
                    DispatchRequest(rows_of, None, None, None, None, itr[a:b], None, e_dom, 1, 0, None, config, None,
                                    known=evolve(known[c], summary_tensor=summaries[c])),
                    own_pos[c], sends[c, :L], own))
            return tuple(made)

        return self._finish(req, outs, src_rank, src_idx, rails, handles, bounds, back[:rows], None, False,
                            [per_expert], timing, rows=per_chunk,
                            per_expert=summary_per_expert(summaries[C], L, e_dom // L))

    def _early_plan(self, req: DispatchRequest, chunks: int) -> Optional[tuple]:
        """The bounds ``(landing rows, received rows, max_pair, num_tokens_max)`` an exact-mode call of ``req`` in
        ``chunks`` chunks, which the caller found can take its domain legs in one gated call, issues its domain leg
        with before its count read (``_early_issue``), or None where it does not: no earlier gated call of that kind
        (``_early_key``), or the early leg off. Each is the largest of the last ``EARLY_HISTORY`` such calls' needs
        (``_Counts.needs``) with ``EARLY_MARGIN`` more: the same numbers on every rank of the domain (they come from
        its gathered counts). An earlier gated call of the same kind is required, not only for its needs: every
        kernel the call launches after its push (the rows' collectives, the forward layouts, the handles' torch
        operations) must be loaded by then, since loading one waits for the device, where the push waits for them."""
        seen = self._early_seen.get(self._early_key(req, chunks))
        early = self.early_issue if self.early_issue is not None else self._early_off is None
        if not seen or not early or self.device.type != "cuda":
            return None
        return early_bounds(seen, self.EARLY_MARGIN)

    @staticmethod
    def _early_key(req: DispatchRequest, chunks: int) -> tuple:
        """The kind of a gated call (which kernel variants it launches): its chunks and the shape of its rows."""
        x, s = req.x, req.x_scales
        return (chunks, x.dtype, x.size(1), None if s is None else (s.dtype, s.size(1)), req.topk_idx.size(1),
                req.topk_weights is not None, req.num_experts)

    def _early_seen_add(self, req: DispatchRequest, chunks: int, need: tuple) -> None:
        """Keep a gated call's needs (``_Counts.needs``) for the next calls' bounds of its kind (``_early_plan``)."""
        seen = self._early_seen.setdefault(self._early_key(req, chunks), collections.deque(maxlen=self.EARLY_HISTORY))
        seen.append(need)

    def _early_landing(self, req: DispatchRequest, C: int, plan: tuple) -> Optional["_GatedCall"]:
        """A gated call (``_gated``) of ``C`` chunks whose domain leg goes before its count read (``_early_issue``),
        sized by ``plan`` (``_early_plan``), made before the call's first device work: its landing buffer and flags,
        and the flags' values if it is let go (``_gated``). Made first, so that its first rows may land in it before
        anything the caller's stream runs later (``_gated_first``: the network stream waits for the rows' packing
        alone). None where the domain's storage cannot hold the bounds and may not grow (every rank of the domain
        decides the same)."""
        land, rows, max_pair, most = plan
        if not self.domain.holds_merged(max_pair, most, req=req, extra_scales=2):
            return None
        call = self._gated_landing(req, C, land, None)
        # (made before the push: letting it go then copies them, a device copy, launching no kernel that might first be
        # loaded behind the push, where loading waits for it)
        call.release = torch.full((C,), call.value, dtype=torch.int64, device=self.device)
        call.plan = plan
        return call

    def _early_issue(self, fn: str, req: DispatchRequest, call: "_GatedCall", gathered: torch.Tensor) -> None:
        """Before the count read (``_exchange_counts``' ``before_read``): the domain leg of ``_early_landing``'s call
        issued on the caller's stream, where it waits on the device for the chunks' flags; the host's work after the
        read is then the rows' collectives with their forward layouts and the handles, all while rows cross. The
        network stream's forward layouts wait for ``call.ready``, the caller's stream before the push (the merged
        input made; not the push, which waits for them)."""
        land, rows, max_pair, most = call.plan
        self.early_stats["issued"] += 1
        self._gated_merged(req, call, gathered)
        call.ready = torch.cuda.Event()
        call.ready.record(call.streams[0])
        self._gated_domain(fn, req, call, gathered, rows, max_pair, most, None)

    def _let_go(self, call: "_GatedCall") -> None:
        """Let an early call's push (``_early_issue``) go with no rows, where the domain's needs outgrew its bounds
        (every rank of the domain sees the same): its chunks' bounds emptied and their flags released, on the network
        stream (copies, launching no kernel that might first be loaded behind the push, where loading waits for it).
        The network stream may then wait for the caller's stream, the push included."""
        def let_go() -> None:
            call.rows_at.zero_()  # (the kernel that zeroed them before the push)
            call.flags[:call.chunks].copy_(call.release)

        call.streams[1].wait_event(call.ready)  # (what it reads: made before the push)
        self._network(let_go, wait=False, streams=call.streams)
        self.early_stats["let go"] += 1

    def _next_gate(self, chunks: int) -> tuple:
        """``(flags, value)`` of a gated call of ``chunks`` chunks: int64 flags on the device (at least ``chunks``,
        kept from call to call) and the value this call releases into them (one more than the last call's)."""
        if self._gate_flags is None or self._gate_flags.numel() < chunks:
            self._gate_flags = torch.zeros(max(chunks, 8), dtype=torch.int64, device=self.device)
        self._gate_value += 1
        return self._gate_flags, self._gate_value

    def _split_carried(self, shared: tuple) -> tuple:
        """``(outs, src_rank, src_idx)`` of a dispatch whose domain leg wrote its rows in place (``_outputs``): the
        scales split from the carried columns, each row's source rank and token from them and from its forwarder."""
        out_x, carried, out_idx, out_w, out_src = shared
        ns = carried.size(1) - 2
        got = carried[:, ns:].view(torch.int32)  # (source domain, source token) of every row
        src_rank, src_idx = torch.add(out_src[:, 1], got[:, 0], alpha=self.local_size), got[:, 1].contiguous()
        return (out_x, carried[:, :ns].contiguous() if ns else None, out_idx, out_w), src_rank, src_idx

    def _finish(self, req: DispatchRequest, outs: tuple, src_rank: torch.Tensor, src_idx: torch.Tensor, rails: list,
                domains, bounds: list, back, order, head: bool, lists: list, timing, rows: Optional[list] = None,
                per_expert: Optional[torch.Tensor] = None) -> DispatchResult:
        """An exact-mode (or ``num_worst_tokens``) dispatch's result from its legs: ``outs`` (x, scales, top-k ids,
        weights) in the intranode path's order, each row's source rank and token, per chunk the inter-domain leg's
        and the domain leg's handles and the domain leg's per-expert counts (``lists``, host lists), ``bounds`` its
        token bounds, ``back``/``order`` as ``_HandleState`` keeps them. ``domains`` may be a function that makes
        the domain leg's handles when first asked (``_HandleState.domain``); then ``rows`` (the rows each chunk
        received) and ``per_expert`` (the received per-expert counts, on the device) are given."""
        W, n, x = req.num_worst_tokens, req.x.size(0), req.x
        if not callable(domains):
            per_expert = domains[0].num_recv_tokens_per_expert
            for h in domains[1:]:
                per_expert = per_expert + h.num_recv_tokens_per_expert
            rows, domains = [h.num_recv_tokens for h in domains], tuple(domains)
        self._milestone(ISSUED_MILESTONE)
        counts = []
        if not W and req.num_tokens_per_expert is not None:  # the domain leg counted without alignment
            counts = align_all([sum(cs) for cs in zip(*lists)], req.expert_alignment)
        if timing is not None:
            self._tuner.stop(timing)
        handle = DispatchHandle(
            buffer_id=self.buffer_id, transport=self.name, num_ranks=self.num_ranks, num_experts=req.num_experts,
            num_tokens=n, hidden=x.size(1), is_token_in_rank=req.is_token_in_rank, num_tokens_per_rank=None,
            num_recv_tokens=sum(rows), num_recv_tokens_per_rank=None, num_recv_tokens_per_expert=per_expert,
            recv_src_rank=src_rank, recv_src_idx=src_idx,
            num_worst_tokens=W, state=_HandleState(tuple(rails), domains, tuple(bounds), tuple(rows), back, order,
                                                   head))
        return DispatchResult(*outs, counts, handle)

    def _chunk(self, req: DispatchRequest, a: int, b: int, first: bool) -> DispatchRequest:
        """Tokens ``[a, b)`` of ``req`` as a request of their own (their layout computed on the device)."""
        idx = _tokens(req.topk_idx, a, b)
        per_rank, per_expert, itr = self.get_dispatch_layout(idx, req.num_experts)
        return evolve(req, x=_tokens(req.x, a, b), x_scales=_tokens(req.x_scales, a, b), topk_idx=idx,
                       topk_weights=_tokens(req.topk_weights, a, b),
                       num_tokens_per_rank=per_rank, is_token_in_rank=itr, num_tokens_per_expert=per_expert,
                       bad_topk=req.bad_topk if first else None)

    def _exchange_counts(self, fn: str, req: DispatchRequest, subs: list, bounds: list, head: int,
                         before_read: Optional[Callable[[torch.Tensor], None]] = None, needs: bool = False,
                         rail_first: Optional[Callable[[list, list, DispatchRequest, Any], None]] = None) -> tuple:
        """Both legs' counts of every chunk of an exact-mode dispatch, learnt before any row moves: one all_to_all over
        the rail group, one all_gather over the domain group, one host read. Every source sends its rail peer in each
        domain, per chunk, ``[tokens with an expert in that domain, tokens for each of its ranks (L), tokens for each
        of its experts (E / D), the chunk's first token]``; a rank's sums over its sources are what it forwards, and
        the domain's gathered sums give every forwarding rank's sends: so neither leg exchanges counts or reads them
        on its own (``KnownCounts``), and the domain leg's launches are enqueued while the rows still cross between
        domains. While the counts travel, the inter-domain leg's local work for every chunk is enqueued
        (``Transport.prepare``: the portable transport packs the rows), so that once they are read only the rows'
        collectives are left before the rows cross. The counts are copied to the host before that work is enqueued,
        so the host's read waits for them alone and the packing runs while the host reads them and issues the rows'
        collectives. With ``head`` slots (the first chunk is the head chunk), the head's rows are sent in them right
        behind the count all_to_all, on the network stream, so that they cross while the counts travel and the host
        reads them (issued after the domain's gather and the counts' copy to the host: the read does not wait for
        the host's work on the head). Every rank also learns the largest token count of any rank (its rail peers'
        largest, gathered over its domain), which sizes the next call's head chunk, and the rows it receives from
        each source rank through each forwarding rank. Returns ``(_Counts: the inter-domain leg's requests with their
        counts known and their local work prepared, ``rails``, and per chunk the domain KnownCounts and this rank's
        rows from each source, by forwarding rank then source domain, ``domain``, made when first asked: after the
        first rows' collective; [D, chunks] int32 first token of each chunk of every rail peer, or None for one
        chunk; the head's ``Ahead`` or None; the domain's gathered counts ``[L * chunks, W]`` int32 on the
        device)``; raises on bad expert ids (``req.bad_topk``). ``before_read(gathered)`` runs once the rows' packing
        is enqueued, before the host reads the counts (``_early_issue``). ``needs``: the chunks may take their domain
        legs in one gated call: what it needs (``_Counts.needs``) is computed on the device from the gathered counts
        (``launch_merged_needs``, one program) and read with them, so that the host's lead to the first rows'
        collective holds no arithmetic over them. ``rail_first(sends, recvs, leg, starts)`` (a gated call's first rows:
        ``_gated_first``; a one-chunk call's rows: ``_first_rows``): the inter-domain leg's words (this rank's sends
        and receives, ``[D, C]`` host lists by domain then chunk, and the bad id count) are copied to the host on their
        own right after the all_to_all, the rows' packing follows them, and the network stream waits for that packing
        alone (not for the domain's gather); once they are read (``COUNTS_PHASE``' last part), ``rail_first`` issues
        the first chunk's rows (``leg``: its request, prepared; ``starts`` as returned), and only then are the domain's
        counts read (``DOMAIN_COUNTS_PHASE``): the domain's gather is off the path to the first rows."""
        D, L, C, dev = self.num_domains, self.local_size, len(subs), req.x.device
        e_dom = req.num_experts // D
        tables, legs = [], []
        for sub in subs:
            in_domain = sub.is_token_in_rank.view(-1, D, L).any(2)
            per_domain = in_domain.sum(0, dtype=torch.int32)
            legs.append(self._rail_request(sub, per_domain, in_domain, 0))
            tables.append(torch.cat([per_domain.view(D, 1), sub.num_tokens_per_rank.view(D, L),
                                     sub.num_tokens_per_expert.view(D, e_dom)], 1))
        marks = counts_to_device([a for a, _ in bounds] + [req.x.size(0)], dev)  # each chunk's first token, the tokens
        send = torch.cat([torch.stack(tables, 1), marks[:C].view(1, C, 1).expand(D, C, 1),
                          marks[C:].view(1, 1, 1).expand(D, C, 1)], 2)  # [D, C, V + 2]
        recv = torch.empty_like(send)  # [source domain, C, V + 2]
        net = None
        if head and self.device.type == "cuda":  # the head's packing waits for its layout, not for the counts
            net = self._streams()[1]
            net.wait_stream(torch.cuda.current_stream(self.device))
        with self._leg(fn, COUNTS_PHASE):
            dist.all_to_all_single(recv, send, group=self.rail_group)
        # (in the count phase's part: its device time is the count exchange's, which the benchmarks time)
        V = send.size(2) - 2  # (the sums' columns)
        fused = use_kernels(recv)  # (one launch each for the row and the read's words: ~9 torch operations else)
        read_rail = None
        if rail_first is not None:
            with self._leg(fn, COUNTS_PHASE, within=True):  # what the first rows' collective needs, on its own
                read_rail = faults.read_later(_read_words(None, send, recv, req.bad_topk, L, False, fused), fn,
                                              f"rank {self.rank}: the inter-domain leg's counts", self._pinned,
                                              array=True)
            legs = self._prepared(fn, legs, 0)
            if self.device.type == "cuda":  # the first rows wait for their packing, not for the domain's gather below
                self._streams()[1].wait_stream(torch.cuda.current_stream(self.device))
        with self._leg(fn, COUNTS_PHASE if rail_first is None else DOMAIN_COUNTS_PHASE, within=True):
            # the row gathered over the domain ([C, V + 1 + D L]): what this rank forwards (the sums over the source
            # domains), the most tokens of a rail peer, and, unsummed, what it forwards from each source domain to each
            # rank of this domain: every rank learns the rows it gets from each source rank, where they land in its
            # output (``_rows_in_place``)
            row = _gather_row(recv, L, fused)
            every = torch.empty(L * C, row.size(1), dtype=torch.int32, device=dev)  # [L, C, V + 1 + D L]
            _all_gather_single(every, row, group=self.domain_group)
            words = _read_words(every, send, recv, req.bad_topk, L, needs, fused)
            # copied to the host ahead of the packing below (without rail_first; with it, after): the host's read
            # waits for the counts alone, and the packing runs on the device while the host reads them and issues the
            # rows' collectives
            read = faults.read_later(words, fn, f"rank {self.rank}: the counts of both legs", self._pinned, array=True)
        ahead = None
        if head:  # behind the counts on the link; its packing on the network stream meanwhile. Issued after the
            # domain's gather and the copy to the host: the count read waits for the counts alone, not for the host's
            # work on the head
            with torch.cuda.stream(net) if net is not None else contextlib.nullcontext(), self._leg(fn, HEAD_PHASE):
                ahead = self.rail.send_ahead(legs[0], head)
        if rail_first is None:  # the inter-domain leg's local work, while the counts travel
            legs = self._prepared(fn, legs, 1 if head else 0)  # (the head's leg was sent ahead: nothing to prepare)
        if before_read is not None:
            before_read(every)
        # before the read, what the host's lead to the first rows' collective would otherwise do: the views it takes
        # (the inter-domain leg's received per-expert counts, this rank's sums, a view per chunk), and dropping the
        # temporaries (freeing a tensor costs the host ~1-2 us; ~20 us of lead as the frame's return freed them)
        starts = recv[:, :, -2] if C > 1 else None
        per_expert = row[:, 1 + L:V].unbind(0)
        del tables, marks, send, recv, row, words, in_domain, per_domain
        if rail_first is not None:  # the inter-domain leg's words, its first rows, then the domain's counts
            with self._leg(fn, COUNTS_PHASE):
                got = read_rail()
            raise_if_bad_topk(fn, int(got[-1]), req.num_experts)
            self._milestone(LEAD_COUNTS)
            rail_first(got[:D * C].tolist(), got[D * C:2 * D * C].tolist(), legs[0], starts)
        with self._leg(fn, COUNTS_PHASE if rail_first is None else DOMAIN_COUNTS_PHASE):
            host = read()
        if rail_first is None:
            raise_if_bad_topk(fn, int(host[-1]), req.num_experts)
        counts = _Counts(host, C, L, D, e_dom, self.local_index, needs)
        # (the next call's head, sized when it asks: ``_next_head``; from the read's words alone, not the counts, which
        # hold this call's requests and their packed rows)
        self._head_from = (functools.partial(_Counts.most_of, host, C, L, D, e_dom), self.head_share)
        counts.with_legs(legs, per_expert)  # (each chunk's request made when first asked)
        if rail_first is None:  # (with it, marked before the first rows)
            self._milestone(LEAD_COUNTS)
        return counts, starts, ahead, every

    def _prepared(self, fn: str, legs: list, sent: int) -> list:
        """The inter-domain leg's requests with their local work enqueued (``Transport.prepare``: the portable
        transport packs the rows), those past the first ``sent`` (sent ahead: nothing to prepare)."""
        with self._leg(fn, PACK_PHASE):
            return legs[:sent] + [evolve(leg, prepared=self.rail.prepare(leg)) for leg in legs[sent:]]

    def _next_head(self) -> int:
        """The next exact-mode dispatch's head chunk, slots per domain: ``head_share`` of the largest token count any
        rank had in the last such call (the same on every rank), sized when first asked, not in that call's lead."""
        if self._head_from is not None:
            most, share = self._head_from
            self._head, self._head_from = math.ceil(most() * share), None
        return self._head

    def _rows_in_place(self, fn: str, sources: tuple, gathered: torch.Tensor, chunk: int, chunks: int,
                       num_experts: int) -> tuple:
        """``(row_map [M] int64, summary)``: where each row of chunk ``chunk`` (of ``chunks``) of an exact-mode
        dispatch's domain leg goes in the call's outputs, and the one-sided domain leg's summary of the chunk's counts
        (``KnownCounts.summary_tensor``), both made on the device from the domain's gathered counts by one launch
        (``_rows_in_place``; ``gathered``: ``_exchange_counts``'s; ``sources``: the chunk's counts as the host read
        them, which give ``M``)."""
        from ..kernels.ep import summary_words

        L, D = self.local_size, self.num_domains
        e_local = num_experts // D // L
        row_map = torch.empty(sum(sources), dtype=torch.int64, device=self.device)
        summary = torch.empty(summary_words(L, e_local), dtype=torch.int32, device=self.device)
        col = gathered.size(1) - D * L + self.local_index  # (the columns by source domain, then rank of this domain)
        self.first_call(fn, ("rows in place",), lambda: _rows_in_place(
            gathered, row_map, col, L, D, chunk, chunks, summary, self.local_index, e_local))
        return row_map, summary

    def _outputs(self, req: DispatchRequest, rows: int) -> tuple:
        """The outputs every chunk's domain leg writes in place (``DispatchRequest.outs``), as the one-sided domain
        leg allocates them (``alloc_recv``) for ``rows`` rows whose scales are ``_forward``'s carried columns: x's
        scales and each row's (source domain, source token), float32 words."""
        ns = 0 if req.x_scales is None else req.x_scales.size(1)
        return self.domain.alloc_recv(rows, req.x, (ns + 2, torch.float32), req.topk_idx.size(1),
                                      req.topk_weights is not None, False)

    def _head_slots(self, slots: int, row_bytes: int) -> int:
        """An exact-mode dispatch's head chunk, slots per domain (0: none; the same on every rank): ``slots``
        (``head_share`` of the previous call's largest token count) within ``head_bounds`` of the link's measured
        reach in rows of ``row_bytes`` (x's and its scales' bytes per token), once the chunk count is agreed."""
        if self._tuner.reach is None or not slots:
            return slots
        fewest, most = head_bounds(self._tuner.reach / row_bytes)
        return 0 if slots < fewest else min(slots, most)

    def _rail_chunks(self, fn: str, subs: list, cap: int, counts: Optional["_Counts"], ahead: Any = None,
                     landed: Optional[torch.Tensor] = None):
        """The inter-domain leg of each chunk of a dispatch (a generator of its results, in order). With several
        chunks on GPUs every chunk's rows are issued on the network stream before the first result is yielded (with
        their counts known, or one count exchange for all: ``Transport.dispatch_many``), so the link moves chunk
        after chunk while the caller forwards the earlier ones within the domain; each result is yielded once the
        caller's stream waits for it. ``ahead``: the head chunk's rows, already sent (``_exchange_counts``);
        ``landed``: the first chunk's rows, already issued into their own rows (a gated call that went no further:
        ``_gated``; a one-chunk call: ``_first_rows``)."""
        D, L = self.num_domains, self.local_size

        def head() -> DispatchResult:  # its slots, or its landed rows, as the exact result (on the stream they came on)
            if landed is not None:
                return self.rail.landed_result(counts.rail(0), landed)
            return self.rail.receive_ahead(ahead, counts.rail(0).known)

        def request(c: int, req: DispatchRequest) -> DispatchRequest:
            if counts is not None:
                got = counts.rail(c)
                self._milestone(LEAD_REQUEST)
                return got
            in_domain = req.is_token_in_rank.view(req.x.size(0), D, L).any(2)
            return self._rail_request(req, in_domain.sum(0, dtype=torch.int32), in_domain, cap)

        first = 1 if ahead is not None or landed is not None else 0
        if self.device.type != "cuda" or len(subs) == 1:
            for c, req in enumerate(subs):
                leg = None if c < first else request(c, req)  # (made before the leg, as _gated_rail's)
                with self._leg(fn, HEAD_PHASE if c < first and landed is None else ROWS_PHASE):
                    r1 = head() if c < first else self.rail.dispatch(leg)
                yield r1
            return
        main, net = self._streams()
        net.wait_stream(main)
        outs = []
        sent = None
        if first:  # the head's slots are in once the network stream's work so far (its collective) is done
            sent = torch.cuda.Event()
            sent.record(net)

        def issued(r1: DispatchResult) -> None:  # its end on the network stream: its collectives are issued
            done = torch.cuda.Event()
            done.record(net)
            outs.append((r1, done))

        # the other chunks' collectives first, so that the link never waits for the host's work on the head's slots
        legs = [request(c, r) for c, r in enumerate(subs) if c >= first]  # (made before the leg, as _gated_rail's)
        with torch.cuda.stream(net), self._leg(fn, ROWS_PHASE):
            for r1 in self.rail.dispatch_many(legs):
                issued(r1)
        if first:  # then the head's slots made into its result on the caller's stream, while those rows cross
            main.wait_event(sent)
            (ahead.recv if landed is None else landed).record_stream(main)
            with self._leg(fn, HEAD_PHASE):
                r1 = head()
            yield r1
        for r1, done in outs:
            yield _handed_over(r1, done, main)

    def _rail_request(self, req: DispatchRequest, per_domain: torch.Tensor, in_domain: torch.Tensor,
                      cap: int) -> DispatchRequest:
        """The inter-domain leg's request for (a chunk of) ``req``: each domain's experts count as its rail peer's
        (``per_domain [D]`` int32 tokens, ``in_domain [n, D]`` bool); ``cap``: fixed slots per domain
        (``num_worst_tokens``), 0 in exact mode."""
        return DispatchRequest(req.x, req.x_scales, req.topk_idx, req.topk_weights, per_domain, in_domain,
                               req.num_tokens_per_expert, req.num_experts, 1, self.num_domains * cap, None, req.config,
                               req.bad_topk, req.overlapped, peer_capacity=cap)

    def _forward(self, fn: str, req: DispatchRequest, r1: DispatchResult, h1: DispatchHandle,
                 starts: Optional[torch.Tensor], known: Optional[KnownCounts],
                 row_map: Optional[torch.Tensor] = None, outs: Optional[tuple] = None) -> tuple:
        """The domain leg of (a chunk of) a dispatch: ``(result, recv_src_rank, recv_src_idx)``, the source token
        index within the source's x (``starts``: ``[D]`` int32, this chunk's first token on each rail peer; None
        for a single chunk). ``known``: its counts (``_exchange_counts``), None with ``num_worst_tokens``.
        ``row_map`` (``_rows_in_place``, exact mode) and ``outs`` (``_outputs``): the rows written into ``outs`` where
        it says (every chunk's into the same outputs), the source columns left in them (the caller splits them once:
        the source rank and token returned are None); the domain leg's handle keeps its own order (its combine and
        cached dispatches read it)."""
        e_dom, L, W = req.num_experts // self.num_domains, self.local_size, req.num_worst_tokens
        per_rank, per_expert, itr = self.domain.get_dispatch_layout(r1.recv_topk_idx, e_dom)
        # every row's source, (domain, token) as the forwarding rank received it, rides along as two more scale
        # columns (4-byte words, which every transport moves as they are): no second dispatch within the domain
        # (starts: a chunk of an exact-mode call, whose rows all have a source)
        src = torch.stack([h1.recv_src_rank, h1.recv_src_idx if starts is None
                           else h1.recv_src_idx + starts[h1.recv_src_rank]], 1)
        ns = 0 if r1.recv_scales is None else r1.recv_scales.size(1)
        carried = src.view(torch.float32) if not ns else torch.cat([r1.recv_scales, src.view(torch.float32)], 1)
        with self._leg(fn, "forwarding the tokens", within=True):
            r2 = self.domain.dispatch(DispatchRequest(
                r1.recv_x, carried, r1.recv_topk_idx, r1.recv_topk_weights, per_rank, itr, per_expert, e_dom,
                req.expert_alignment if W else 1, W, None, req.config, None, req.overlapped, known=known,
                row_map=row_map, outs=outs))
        if row_map is not None:  # (exact sizes: every row has a source)
            h2 = r2.handle
            own = h2.state.recv_src.index_select(0, row_map)  # its rows' sources in its own order
            h2 = evolve(h2, recv_src_rank=own[:, 1], recv_src_idx=own[:, 0], state=evolve(h2.state, recv_src=own))
            return evolve(r2, handle=h2), None, None
        got = r2.recv_scales[:, ns:].view(torch.int32)
        fwd = r2.handle.recv_src_rank
        r2 = evolve(r2, recv_scales=r2.recv_scales[:, :ns] if ns else None)
        if not W:  # exact sizes: every row has a source
            return r2, torch.add(fwd, got[:, 0], alpha=L), got[:, 1]
        real = fwd >= 0
        return r2, torch.where(real, got[:, 0] * L + fwd, -1), torch.where(real, got[:, 1], -1)

    def _pipelined(self, legs: list):
        """Yield ``legs[c]()`` (inter-domain legs) in order. On GPUs every leg is issued on the network stream before
        the first is yielded, so the link moves leg after leg while the caller forwards the earlier ones within the
        domain and never waits for the host between them. Tensors cross the two streams with events and
        ``record_stream`` (``_handed_over``); ``_join`` makes the caller's stream wait for the network stream at the
        end."""
        if self.device.type != "cuda" or len(legs) == 1:
            for leg in legs:
                yield leg()
            return
        main = self._streams()[0]
        issued = [self._on_network(leg) for leg in legs]
        for out, done in issued:
            yield _handed_over(out, done, main)

    def _on_network(self, leg: Callable):
        """``(leg(), its end event)``: ``leg`` issued on the network stream once the caller's stream has reached this
        point (its work so far is what the leg reads)."""
        main, net = self._streams()
        net.wait_stream(main)
        with torch.cuda.stream(net):
            out = leg()
            done = torch.cuda.Event()
            done.record(net)
        return out, done

    def _network(self, work: Callable[[], None], wait: bool = True, streams: Optional[tuple] = None) -> None:
        """``work()`` issued on the network stream once the caller's stream has reached this point (its work so far
        is what ``work`` reads; ``wait`` False: where the network stream already waits for all of it, nothing having
        been enqueued on the caller's stream since); on CPUs run now (every collective has ended when it returns).
        Tensors are allocated outside ``work``, on the caller's stream. ``streams``: ``_streams()`` as the call
        already has them. The switch to the network stream and back is two ``set_stream`` calls where this device is
        the current one (``torch.cuda.stream`` makes stream objects and asks for the current device and stream: ~60 us
        of a gated call's lead on the GPU machines, measured)."""
        if self.device.type != "cuda":
            self._milestone(LEAD_STREAM)
            work()
            return
        main, net = streams if streams is not None else self._streams()
        if wait:
            net.wait_stream(main)
        if torch.cuda.current_device() != net.device_index:  # (set_stream would make the stream's device current)
            with torch.cuda.stream(net):
                self._milestone(LEAD_STREAM)
                work()
            return
        torch.cuda.set_stream(net)
        try:
            self._milestone(LEAD_STREAM)
            work()
        finally:
            torch.cuda.set_stream(main)

    def _streams(self) -> tuple:
        """``(the caller's stream, the network stream)`` of a pipelined call."""
        if self._net is None:
            self._net = torch.cuda.Stream(self.device)
        return torch.cuda.current_stream(self.device), self._net

    def _join(self, streams: Optional[tuple] = None) -> None:
        """The caller's stream waits for everything issued on the network stream (``streams``: ``_streams()`` as the
        call already has them)."""
        if self._net is not None:
            (streams[0] if streams is not None else torch.cuda.current_stream(self.device)).wait_stream(self._net)

    def _dispatch_by_rank(self, req: DispatchRequest) -> DispatchResult:
        """A dispatch without expert ids (``is_token_in_rank`` alone): the forwarding ranks route by ranks, so each
        rank counts as one expert here; the per-expert counts of ``num_tokens_per_expert`` (when given) are
        exchanged on their own, as the intranode transports exchange them."""
        r, dev = self.num_ranks, req.x.device
        by_rank = torch.where(req.is_token_in_rank, torch.arange(r, device=dev).unsqueeze(0), -1)
        res = self.dispatch(evolve(req, topk_idx=by_rank, topk_weights=None, num_experts=r, expert_alignment=1,
                                    num_tokens_per_expert=req.num_tokens_per_rank, bad_topk=None))
        e_local = req.num_experts // r
        per_expert = torch.zeros(e_local, dtype=torch.int32, device=dev)
        counts = []
        if req.num_tokens_per_expert is not None:
            D, L = self.num_domains, self.local_size
            with self._leg("Buffer.dispatch", "per-expert counts"):
                # over the two subgroups (which a fault can abort), not the Buffer's group: the rail peer in
                # domain d gets this rank's counts for d's ranks; then each rank of the domain gets, from every
                # rail, the counts for itself
                mine = req.num_tokens_per_expert.view(D, L, e_local).contiguous()
                via_rail = torch.empty(D, L, e_local, dtype=torch.int32, device=dev)  # [source domain, dest, e]
                dist.all_to_all_single(via_rail, mine, group=self.rail_group)
                recv = torch.empty(L, D, e_local, dtype=torch.int32, device=dev)  # [source local index, domain, e]
                dist.all_to_all_single(recv, via_rail.transpose(0, 1).contiguous(), group=self.domain_group)
                per_expert = recv.sum((0, 1), dtype=torch.int32)
                if not req.num_worst_tokens:
                    counts = align_all(faults.host_list(per_expert, "Buffer.dispatch", "the per-expert counts"),
                                       req.expert_alignment)
        handle = evolve(res.handle, num_experts=req.num_experts, num_recv_tokens_per_expert=per_expert)
        return DispatchResult(res.recv_x, res.recv_scales, None, None, counts, handle)

    def _cached_dispatch(self, req: DispatchRequest) -> DispatchResult:
        """Each token's row, with its FP8 scales at its end (one row of bytes: no records, fewer copies and
        launches per chunk), through the inter-domain leg. Where the domain leg can (``_mapped``) it is issued once
        for all chunks and writes the rows where they belong (no gather after it); else once per chunk, the rows
        put in order and split once at the end."""
        fn = "Buffer.dispatch"
        st: _HandleState = req.handle.state
        x, scales = req.x, req.x_scales
        rows = x if scales is None else torch.cat([_as_bytes(x), _as_bytes(scales.contiguous())], 1)
        mapped = self._mapped(fn, st, rows, req)
        if mapped is not None:
            return DispatchResult(*mapped, None, None, None, req.handle)

        def leg(c):
            a, b = st.bounds[c]
            with self._leg(fn, "cached tokens to their domains"):
                return self.rail.dispatch(_cached(_tokens(rows, a, b), None, st.rail[c], req))

        outs = []
        for c, r1 in enumerate(self._pipelined([lambda c=c: leg(c) for c in range(len(st.rail))])):
            with self._leg(fn, "forwarding the cached tokens", within=True):
                outs.append(self.domain.dispatch(_cached(r1.recv_x, None, st.domain[c], req)).recv_x)
        self._join()
        if scales is None:
            return DispatchResult(_take(outs, st.order), None, None, None, None, req.handle)
        got, width = _cat(outs), x.size(1) * x.element_size()
        return DispatchResult(got[:, :width].index_select(0, st.order).view(x.dtype),
                              got[:, width:].index_select(0, st.order).view(scales.dtype), None, None, None, req.handle)

    def _mapped(self, fn: str, st: _HandleState, rows: torch.Tensor, req: DispatchRequest) -> Optional[tuple]:
        """A cached dispatch whose domain leg is issued once for all chunks and writes every row at its place in the
        intranode path's order (``DispatchRequest.row_map``: no gather after the call, the FP8 scales split from the
        rows as they are written): ``(recv_x, recv_scales or None)``, or None where the domain transport cannot (no
        ``gates_cached_dispatch``, ``strict_sms``, a CUDA graph being captured, storage it may not grow:
        ``merge_cached``). With several chunks it is *gated*: every chunk's inter-domain rows land side by side in
        one buffer (on GPUs from the network stream, each chunk's collective followed by a one-program kernel that
        releases the chunk's flag); the domain leg's one push, issued on the caller's stream right away with the
        chunks' handles merged, waits on the device for each chunk's flag and forwards its rows while the later
        chunks still cross (``kernels.ep.Gate``; it holds about half the GPU's programs, spinning until its rows
        come). The inter-domain leg packs every chunk's rows at once (``AllToAllTransport.cached_rows_many``); host
        work per further chunk: its collective and the flag's launch. One chunk is not gated (nothing to overlap:
        one stream is cheaper to issue)."""
        from ..kernels.ep import Gate
        from ..kernels.shmem import launch_signal
        from ..kernels.shmem_codes import SIGNAL_SET

        if (self._unmerged or not self.domain.gates_cached_dispatch or not self.domain.can_gate(req)
                or (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing())):
            return None
        x, scales = req.x, req.x_scales
        xb, ns = x.size(1) * x.element_size(), 0 if scales is None else scales.size(1)
        width = _as_bytes(rows).size(1)
        chunks = len(st.rail)
        if width not in st.merged:  # (collective where it grows the domain's storage: every rank merges here)
            if chunks == 1:
                merged = (st.domain[0], st.back, None, None, None)
            else:
                merged = self.domain.merge_cached(list(st.domain), xb, ns)
                if merged is not None:
                    sizes = [h.num_recv_tokens for h in st.rail]
                    starts = [sum(sizes[:c]) for c in range(len(sizes) + 1)]
                    # row i of the chunks' rows (one after the other) is row to_merged[i] of the merged call's output
                    # and row back[i] in the intranode path's order
                    row_map = torch.empty_like(merged[1]).index_put_((merged[1],), st.back)
                    merged = (merged[0], row_map, starts, counts_to_device(starts, self.device),
                              self.rail.merge_cached(list(st.rail), list(st.bounds)))
            st.merged[width] = merged
        merged = st.merged[width]
        if merged is None:
            return None
        handle, row_map, starts, bounds, rail = merged
        gate = None
        if chunks == 1:
            with self._leg(fn, "cached tokens to their domains"):
                recv = _as_bytes(self.rail.dispatch(_cached(rows, None, st.rail[0], req)).recv_x)
        else:
            flags, value = self._next_gate(chunks)
            recv = torch.empty(starts[-1], width, dtype=torch.uint8, device=self.device)

            def legs() -> None:
                with self._leg(fn, "cached tokens to their domains"):
                    issued = self.rail.cached_rows_many(_as_bytes(rows), rail, [recv[a:b] for a, b in
                                                                                zip(starts, starts[1:])])
                    for c, _ in enumerate(issued):
                        if self.device.type == "cuda":
                            launch_signal(flags.data_ptr() + 8 * c, value, SIGNAL_SET, self.device)
                        else:  # (on CPUs every leg has ended here: the flag is a store)
                            flags[c] = value

            self._network(legs)
            gate = Gate(bounds, flags, value, chunks)
        # the domain leg reads each row's x bytes and its scales in place (rows of any stride)
        part = _cached(recv[:, :xb], recv[:, xb:].view(scales.dtype) if ns else None, handle, req)
        with self._leg(fn, "forwarding the cached tokens", within=True):
            got = self.domain.dispatch(evolve(part, gate=gate, row_map=row_map))
        if gate is not None:
            self._join()
        return got.recv_x.view(x.dtype), got.recv_scales

    @_guarded("Buffer.combine")
    def combine(self, req: CombineRequest) -> tuple:
        """Each chunk's sums within the domain, then its partials back over the network; on GPUs the partials of a
        chunk cross while the next chunk is summed (the network stream waits for each chunk's sums only), the chunks
        taken smallest first (the dispatch's chunks shrink: the last first; a head chunk before a single chunk after
        it; the same order on every rank), so that only the first, small chunk's sums are exposed before the link is
        busy."""
        fn = "Buffer.combine"
        st: _HandleState = req.handle.state
        x, w = _take([req.x], st.back), _take([req.topk_weights], st.back)  # back to the legs' order
        starts = [sum(st.rows[:c]) for c in range(len(st.rail))]
        pipelined = self.device.type == "cuda" and len(st.rail) > 1
        issued: list = [None] * len(st.rail)  # (each chunk's result, its end event on the network stream or None)
        partials = []  # alive until the caller's stream has waited for the network stream (made on the caller's)
        C = len(st.rail)
        for c in (range(C) if st.head and C == 2 else reversed(range(C))):
            rows = slice(starts[c], starts[c] + st.rows[c])
            with self._leg(fn, "sums within the domain", within=True):
                part, part_w = self.domain.combine(CombineRequest(
                    one_variant(x[rows]), st.domain[c], None if w is None else one_variant(w[rows]), (), req.config,
                    req.overlapped, out=self._partials_send_rows(st.domain[c].num_tokens, req.x, w)))
            partials.append((part, part_w))
            a, b = st.bounds[c]

            def leg(part=part, part_w=part_w, c=c, a=a, b=b):
                with self._leg(fn, "partial sums back to their sources"):
                    bias = tuple(_tokens(t, a, b) for t in req.bias)
                    return self.rail.combine(CombineRequest(part, st.rail[c], part_w, bias,
                                                            req.config, req.overlapped))

            issued[c] = self._on_network(leg) if pipelined else (leg(), None)
        if pipelined:
            main = self._streams()[0]
            outs = [_handed_over(out, done, main) for out, done in issued]
            self._join()
        else:
            outs = [out for out, _ in issued]
        return _cat([o[0] for o in outs]), _cat([o[1] for o in outs])

    def _partials_send_rows(self, n: int, x: torch.Tensor, w: Optional[torch.Tensor]) -> Optional[tuple]:
        """Where a combine's domain leg writes a chunk's ``n`` partial rows (of ``x``'s dtype and width) and their
        weights ``[n, K]`` float32: side by side in the rows of one buffer, which the inter-domain leg then sends as
        it is (its ``fuse_rows``: no copy into a send buffer); None (the domain leg's own outputs) where the domain
        leg cannot write into given views, the rail leg does not fuse, there are no weights or the widths do not
        divide into whole elements."""
        if w is None or not self.domain.combines_into or not getattr(self.rail, "fuse_rows", False):
            return None
        xb, wb = x.size(1) * x.element_size(), w.size(1) * 4
        width = fused_width((xb, wb))  # (as wide as the rows the inter-domain leg sends)
        if xb % 4:  # (then the weights start 4-byte aligned and the width divides into x's elements too)
            return None
        buf = torch.empty(n, width, dtype=torch.uint8, device=x.device)
        return columns_of_rows(buf, x.dtype, x.size(1)), columns_of_rows(buf, torch.float32, w.size(1), xb)

    # ------------------------------------------------------------------ low-latency mode
    @_guarded("Buffer.low_latency_dispatch")
    def low_latency_dispatch(self, req: LowLatencyDispatchRequest) -> LowLatencyDispatchResult:
        fn = "Buffer.low_latency_dispatch"
        x, t_max, D, L = req.x, req.num_max_dispatch_tokens_per_rank, self.num_domains, self.local_size
        k, dev = req.topk_idx.size(1), x.device
        self._agree(fn, ("low_latency", x.dtype, x.size(1), k, req.num_experts, t_max, req.use_fp8, req.round_scale,
                         req.use_ue8m0))
        # FP8: cast once here (epcomm.fp8, float32 scales: the domain leg packs UE8M0), the FP8 rows cross
        x_send, scales = per_token_cast_to_fp8(x, req.round_scale or req.use_ue8m0) if req.use_fp8 else (x, None)
        per_domain, per_expert, in_domain = self.rail.get_dispatch_layout(req.topk_idx, req.num_experts)
        with self._leg(fn, "tokens to their domains"):
            r1 = self.rail.dispatch(DispatchRequest(x_send, scales, req.topk_idx, None, per_domain, in_domain,
                                                    per_expert, req.num_experts, 1, D * t_max, None, Config(), None,
                                                    peer_capacity=t_max))
        # the forwarded rows in fixed slots: row s * T + t is token t of the rail peer in domain s (ids -1: none)
        h1 = r1.handle
        slot = torch.where(h1.recv_src_rank >= 0, h1.recv_src_rank.long() * t_max + h1.recv_src_idx.long(), D * t_max)
        fwd_x = _to_slots(r1.recv_x, slot, None)
        fwd_scales = None if scales is None else _to_slots(r1.recv_scales, slot, None)
        fwd_idx = _to_slots(r1.recv_topk_idx, slot, -1)
        with self._leg(fn, "forwarding the tokens", within=True):
            r2 = self.domain.low_latency_dispatch(LowLatencyDispatchRequest(
                fwd_x, fwd_idx, D * t_max, req.num_experts // D, req.use_fp8, req.round_scale, req.use_ue8m0,
                req.return_recv_hook, req.bad_topk, x_scales=fwd_scales))
        h2 = r2.handle
        e_local, rt = req.num_experts // self.num_ranks, self.num_ranks * t_max
        src_info = torch.empty(e_local, rt, dtype=torch.int32, device=dev)
        layout_range = torch.empty(e_local, self.num_ranks, 2, dtype=torch.int32, device=dev)
        handle = LowLatencyHandle(
            buffer_id=self.buffer_id, transport=self.name, num_max_dispatch_tokens_per_rank=t_max, hidden=x.size(1),
            num_experts=req.num_experts, num_ranks=self.num_ranks, num_tokens=x.size(0), num_topk=k,
            src_info=src_info, layout_range=layout_range, recv_count=h2.recv_count,
            state=_LowLatencyState(r1.handle, h2, fwd_idx, slot))

        def receive(hook: Optional[Callable[[], None]]) -> None:
            if hook is not None:
                with self._leg(fn, "forwarding the tokens", within=True):
                    hook()
            _true_sources(h2, t_max, D, L, src_info, layout_range)

        if req.return_recv_hook:
            return LowLatencyDispatchResult(r2.recv_x, r2.recv_scales, r2.recv_count, handle, _Once(receive, r2.hook))
        receive(None)
        return LowLatencyDispatchResult(r2.recv_x, r2.recv_scales, r2.recv_count, handle, None)

    def low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        return self.domain.low_latency_combine_buffer(handle.state.domain)

    @_guarded("Buffer.low_latency_combine")
    def low_latency_combine(self, req: LowLatencyCombineRequest) -> LowLatencyCombineResult:
        fn = "Buffer.low_latency_combine"
        h: LowLatencyHandle = req.handle
        st: _LowLatencyState = h.state
        with self._leg(fn, "top-k weights to the forwarding ranks"):
            w = self.rail.dispatch(DispatchRequest(req.topk_weights, None, None, None, None, None, None,
                                                   h.num_experts, 1, 0, st.rail, Config(), None)).recv_x
        w = torch.where(st.forwarded_idx >= 0, _to_slots(w, st.slot, 0.0), 0.0)  # in the forwarded rows' slots
        with self._leg(fn, "sums within the domain", within=True):
            r2 = self.domain.low_latency_combine(LowLatencyCombineRequest(req.x, st.forwarded_idx, w, st.domain,
                                                                          req.zero_copy, req.return_recv_hook, None))
        out = req.out if req.out is not None else torch.empty(h.num_tokens, h.hidden, dtype=torch.bfloat16,
                                                               device=self.device)

        def finish(hook: Optional[Callable[[], None]]) -> None:
            if hook is not None:
                with self._leg(fn, "sums within the domain", within=True):
                    hook()
            partials = r2.combined_x.index_select(0, st.slot.clamp(max=r2.combined_x.size(0) - 1))  # rail's order
            with self._leg(fn, "partial sums back to their sources"):
                combined, _ = self.rail.combine(CombineRequest(partials, st.rail, None, (), Config()))
            out.copy_(combined)

        if req.return_recv_hook:
            return LowLatencyCombineResult(out, _Once(finish, r2.hook))
        finish(None)
        return LowLatencyCombineResult(out, None)

    # ------------------------------------------------------------------ lifecycle
    def warm_normal(self, run: Callable[[], None]) -> None:
        """``Transport.warm_normal``: the round once per chunk count the calls may use (``CHUNK_CANDIDATES``, or the
        fixed count), the first count again with a head chunk (the later rounds have one, sized by the earlier) and
        its cached dispatch through the chunks one by one (the path ``_mapped`` leaves to storage that cannot hold
        the merged rows, and to calls captured in a CUDA graph), then the last count without a head chunk (the gated
        path, ``_gated``, where the domain leg takes it), so that the tuner's first calls, the gated cached and exact
        dispatches, the unmerged one and the head's path load no kernel in the middle of a later call (module
        docstring, "Faults"). The warm calls are not timed (the tuner's state is left as it was) and the next call's
        head is sized as before them."""
        fixed = self._fixed_chunks()[0]
        counts = (fixed,) if fixed else self.CHUNK_CANDIDATES
        head = self._next_head()
        try:
            for i, chunks in enumerate(counts + counts[:1] + counts[-1:]):
                self._warm_chunks, self._unmerged = chunks, i == len(counts)
                self._warm_nohead = i == len(counts) + 1
                run()
        finally:
            self._warm_chunks, self._head, self._unmerged, self._warm_nohead = None, head, False, False
            self._head_from = None

    def warmup_low_latency(self, shape: tuple) -> None:
        t_max, hidden, topk, num_experts, fp8, round_scale, ue8m0, dtype = shape
        D = self.num_domains
        self.domain.warmup_low_latency(call_shape(D * t_max, hidden, topk, num_experts // D, fp8, round_scale, ue8m0,
                                                  FP8_DTYPE if fp8 else dtype))  # FP8: forwarded pre-cast

    @_guarded("Buffer.clean_low_latency_buffer")
    def clean_low_latency(self) -> None:
        self.domain.clean_low_latency()
        self.rail.clean_low_latency()
        self.errors.clear("low_latency")

    def pending_errors(self) -> list:
        """The legs' errors, after waiting (bounded) for the calls still running on the stream: a collective that a
        rank never joined is found here at the latest (the groups are aborted and it is one of the errors)."""
        if not self._fault:
            try:
                self._settle("Buffer.check_errors", wait=True)
            except EpcommTimeoutError:
                pass  # recorded in self.errors by _fail
        return self.errors.read()

    def memory_usage(self) -> dict:
        usage: dict = {"pinned_host": sum(t.nbytes for t in self._pinned.values())}
        for part in (self.domain.memory_usage(), self.rail.memory_usage()):
            for k, v in part.items():
                usage[k] = usage.get(k, 0) + v
        return usage

    def destroy(self) -> None:
        if self._fault:  # the groups were aborted: nothing collective can run on them (what they held is dropped)
            return
        self.domain.destroy()
        self.rail.destroy()


class _ChunkTuner:
    """Measures the exact-mode dispatch in each of its candidates (``calls`` rounds of one dispatch per candidate, in
    turn; the first round not counted), then the ranks agree on the fastest (module docstring, "Pipelining"). A
    candidate is ``(chunks, head)``: a chunk count of ``counts`` and whether the call sends a head chunk ahead of its
    counts (both, where the inter-domain leg can: ``offer_head``; the head trades the host's time of one chunk more
    for the link's time during the count round trip, which only a measurement weighs). A dispatch's time runs from
    its start to the end of its work on the caller's stream (CUDA events, read at a later call: no extra
    synchronisation), or its host time on CPUs. Every rank makes the same dispatches, so every rank is at the same
    step of the schedule at each call."""

    def __init__(self, counts: tuple, calls: int, device: torch.device) -> None:
        self.counts, self.calls, self.device = tuple(counts), int(calls), device
        self.candidates: tuple = tuple((c, False) for c in self.counts)
        self.times: dict = {c: [] for c in self.candidates}
        self.seen = 0  # exact-mode dispatches so far
        self.pending: list = []  # (candidate, start event, end event, issued, marks) not yet read
        self.chosen: Optional[int] = None  # the chunk count, once agreed
        self.head = False  # whether the chosen calls send a head chunk, once agreed
        self.medians: dict = {}
        self.ratios: list = []  # one-chunk calls: the forwarding's time over the rows' (their legs' marks)
        self.ratio = 1.0  # each chunk's share over the previous one's, once chosen (even until then)
        self.reaches: list = []  # one-chunk calls: the bytes the link moves while the counts travel (see next)
        # once agreed (None until then): the bytes of rows the link moved during a call's count round trip and host
        # read (the slowest rank's median), which bound the head chunk (``HierarchicalTransport._head_slots``)
        self.reach: Optional[float] = None

    def offer_head(self, can: bool) -> None:
        """Before the first measured call: whether the calls can send a head chunk (the same on every rank); if so,
        every chunk count is measured with and without one (the one without first: kept unless the head is faster by
        more than ``CHUNK_GAIN``)."""
        if can and self.seen == 0 and not any(h for _, h in self.candidates):
            self.candidates = tuple((c, h) for c in self.counts for h in (False, True))
            self.times = {c: [] for c in self.candidates}

    def next(self, slowest_of: Callable[[torch.Tensor], list], fn: str) -> tuple:
        """``(chunks, head)`` of this dispatch (collective when the schedule ends here: the agreement;
        ``slowest_of(times)`` returns the largest of every rank's ``times``, a float64 tensor). The candidates take
        turns, one dispatch each per round, so that a link whose rate drifts weighs on every candidate alike."""
        if self.chosen is not None:
            return self.chosen, self.head
        if self.seen < self.calls * len(self.candidates):
            return self.candidates[self.seen % len(self.candidates)]
        self._read(fn)
        mine = torch.tensor([_median(self.times[c]) for c in self.candidates]
                            + [_median(self.ratios), _median(self.reaches)], dtype=torch.float64)
        slowest = slowest_of(mine)  # (the largest ratio of any rank: the evenest split; the largest reach)
        self.medians = dict(zip(self.candidates, slowest))
        self.chosen, self.head = pick_chunks(self.candidates, slowest[:len(self.candidates)])
        self.ratio = chunk_ratio(slowest[-2])
        if math.isfinite(slowest[-1]):
            self.reach = float(slowest[-1])
        log.info("%s: %s", fn, self.describe())
        return self.chosen, self.head

    def start(self, candidate: tuple, nbytes: int = 0):
        """Begin timing a dispatch of ``candidate`` (``(chunks, head)``) with ``nbytes`` of this rank's rows (x and its
        scales); None once the count is chosen."""
        if self.chosen is not None:
            return None
        counted = self.seen >= len(self.candidates)  # the first round may compile or size storage
        self.seen += 1
        if not counted:
            return None
        # (the call fills the list with 3 marks when it runs in one chunk: its counts read (the rows start), rows
        # end, forwarding end; 5 with a head chunk)
        return candidate, _mark(self.device), [], nbytes

    def stop(self, timing) -> None:
        candidate, begin, marks, nbytes = timing
        if self.device.type == "cuda":
            self.pending.append((candidate, begin, _mark(self.device), time.monotonic(), marks, nbytes))
        else:
            self.times[candidate].append((time.perf_counter() - begin) * 1e6)
            self._add_ratio(begin, marks, nbytes, lambda a, b: b - a)

    def _add_ratio(self, begin, marks: list, nbytes: int, elapsed: Callable) -> None:
        # (a head chunk adds two marks before the last two: the rows then run from the first mark to the last but one)
        if len(marks) >= 3:
            rows, forwarding = elapsed(marks[0], marks[-2]), elapsed(marks[-2], marks[-1])
            if rows > 0:
                self.ratios.append(forwarding / rows)
            moving = elapsed(begin, marks[-2])  # the call's start to its last rows' arrival
            if nbytes and moving > 0:  # the bytes crossing per unit of time, over the counts' time
                self.reaches.append(nbytes * elapsed(begin, marks[0]) / moving)

    def _read(self, fn: str) -> None:
        for candidate, begin, end, issued, marks, nbytes in self.pending:
            faults.host_wait(end, fn, "a timed dispatch", issued)
            self.times[candidate].append(begin.elapsed_time(end) * 1e3)
            self._add_ratio(begin, marks, nbytes, lambda a, b: a.elapsed_time(b))
        self.pending = []

    def describe(self) -> str:
        if self.chosen is None:
            return f"measuring {self.candidates} ({self.seen} of {self.calls * len(self.candidates)} dispatches made)"
        times = ", ".join(f"{_candidate(c, h)}: {t:.0f} us" for (c, h), t in self.medians.items())
        head = "" if self.reach is None or not self.head else (
            f"; a head chunk of 1/2 to {HEAD_MARGIN:g} times the {self.reach / 1e3:.0f} KB of rows the link moves "
            f"during a count round trip, else none")
        return (f"{_candidate(self.chosen, self.head)}, measured fastest (slowest rank's median per candidate: "
                f"{times}); chunks {split_description(self.ratio)}{head}")


def _candidate(chunks: int, head: bool) -> str:
    return f"{chunks} chunk{'s' * (chunks > 1)}{' with a head chunk' if head else ''}"


# A head chunk holds at most this many times the rows the link moved during a measured call's count round trip (and
# its host read): enough to cover it and the host's lead after it (which that measurement leaves out) with room for
# the link's drift, bounded so that a small call after a large one pads no more than a few round trips' worth.
HEAD_MARGIN = 3.0


def head_bounds(reach: float) -> tuple:
    """``(fewest, most)`` tokens of a head chunk, given the rows (in tokens) the link moves during a count round trip
    (``reach``): a head of fewer than half of them hides less of the round trip than its own collective costs (a
    small call: no head), one of more than ``HEAD_MARGIN`` times them only pads."""
    return max(1, math.ceil(reach / 2)), max(1, math.ceil(HEAD_MARGIN * reach))


# More chunks add fixed costs (a count exchange, a host read, launches per chunk) and more variance: a count is
# taken over a smaller one only when its measured time is lower by more than this share (a gain within the
# measurement's noise is none; seen over NCCL's sockets, where the link drifts by ~20% between repeats).
CHUNK_GAIN = 0.05


# The shrinking chunks' smallest ratio (a chunk count's last chunk holds at least ratio**(chunks - 1) of the first
# one's tokens). Each chunk costs the host the same whatever its size; the chunk count that pays is measured (few
# chunks on a host that issues slowly), so the ratio follows the legs' own: 0.26 at EP64 (row 86 of the journal:
# 2 chunks split 79 / 21 hide all but 21% of the forwarding, against 33% with 0.5)
CHUNK_RATIO_FLOOR = 0.25


LANDING_ROWS = 16  # each chunk's rows start at a multiple of this many rows of a gated call's landing buffer


def _landing(req: DispatchRequest, rows: int, device: torch.device) -> torch.Tensor:
    """``[max(rows, 1), fused_width]`` uint8: rows that an exact-mode dispatch's inter-domain rows of ``req`` land in
    beside their records (``AllToAllTransport.dispatch_into``; at least one: an empty tensor's address is 0, which
    kernels reading it would take as another variant)."""
    from ..kernels.ep import record_words

    x, ns = req.x, 0 if req.x_scales is None else req.x_scales.size(1)
    width = fused_width((x.size(1) * x.element_size(), 4 * record_words(ns, req.topk_idx.size(1),
                                                                         req.topk_weights is not None)))
    return torch.empty(max(rows, 1), width, dtype=torch.uint8, device=device)


def _landing_at(rows: list) -> list:
    """Where each chunk's ``rows`` start in a gated call's landing buffer, then the rows it takes: each chunk's from a
    multiple of ``LANDING_ROWS`` rows (its slices start 16-byte aligned, one kernel variant)."""
    at = [0]
    for m in rows:
        at.append(at[-1] + align_up(m, LANDING_ROWS))
    return at


def early_issue_by_default(rail_backend: str) -> bool:
    """Whether a gated call's domain leg is issued before its count read by default (``HierarchicalTransport.
    early_issue`` None; module docstring, "Early issue"): where the inter-domain collectives are NCCL's
    (``rail_backend``, as ``torch.distributed.get_backend`` names the group's)."""
    return _early_off_reason(rail_backend) is None


def _early_off_reason(rail_backend: str) -> Optional[str]:
    """Why ``early_issue_by_default`` says no (as ``describe`` words it), or None where it says yes."""
    if "nccl" not in rail_backend.lower():
        return f"the collectives between the domains are {rail_backend}'s, not NCCL's"
    return None


def early_bounds(seen, margin: float) -> tuple:
    """The bounds of an exact-mode call's domain leg issued before its count read
    (``HierarchicalTransport._early_plan``): each of the four needs (``_Counts.needs``) the largest in ``seen`` (earlier
    calls' needs), ``margin`` more, rounded up to a multiple of 16, and 16 more."""
    return tuple(align_up(int(max(s[i] for s in seen) * (1 + margin)), 16) + 16 for i in range(4))


def split_description(ratio: float) -> str:
    return "even" if ratio == 1.0 else f"each {ratio:.2f} times the previous one's tokens"


def chunk_ratio(forwarding_over_rows: float) -> float:
    """Each pipelined chunk's share of a call's tokens over the previous chunk's, from the forwarding's time over the
    rows' time in a one-chunk call (inf: not measured). Where the forwarding is faster than the rows' transfer, chunks
    that shrink by that ratio hide each chunk's forwarding behind the next one's transfer, so only the small last
    chunk's forwarding is left exposed (even chunks leave a 1 / chunks share of it); the ratio is kept within
    ``[CHUNK_RATIO_FLOOR, 1]`` (1: even chunks, also where the forwarding is the slower leg)."""
    if not forwarding_over_rows < 1.0:
        return 1.0
    return max(CHUNK_RATIO_FLOOR, float(forwarding_over_rows))


def pick_chunks(candidates: tuple, times: list, gain: float = CHUNK_GAIN) -> Any:
    """The candidate to keep (a chunk count, or the tuner's ``(chunks, head)``): going up ``candidates`` (the
    simplest first), each one that is faster than the one kept so far by more than ``gain`` (a share of the kept
    one's time) replaces it."""
    kept = 0
    for i in range(1, len(candidates)):
        if times[i] < times[kept] * (1.0 - gain):
            kept = i
    return candidates[kept]


def _mark_into(marks: Optional[list], device: torch.device) -> None:
    """Append a point in time (``_mark``) to ``marks`` (nothing when None)."""
    if marks is not None:
        marks.append(_mark(device))


def _mark(device: torch.device):
    """A point in time of the current stream (a recorded CUDA event), or of the host on CPUs."""
    if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def phase_durations_us(log: list, host: bool = False) -> dict:
    """``{phase: [microseconds, ...]}`` of a ``phase_log``: as the device ran them (synchronises with the device to
    read its events), or with ``host`` the time the host spent in them."""
    if not host and any(entry[1] is None for entry in log):
        raise ValueError("phase_durations_us: this log has the host's times alone (phase_events was False)")
    if not host and any(isinstance(entry[1], torch.cuda.Event) for entry in log):
        torch.cuda.synchronize()
    out: dict = {}
    for phase, start, end, on_host, _ in log:
        if phase in MILESTONES:  # (points, not parts: ``host_milestones``)
            continue
        if host:
            us = on_host * 1e6
        else:
            us = start.elapsed_time(end) * 1e3 if isinstance(start, torch.cuda.Event) else (end - start) * 1e6
        out.setdefault(phase, []).append(us)
    return out


def host_milestones(log: list) -> dict:
    """When the host reached the points of an exact-mode dispatch that bound its exposed time, from its ``phase_log``
    (``time.perf_counter`` seconds): ``"counts read"``, the count read's return (the last part of ``COUNTS_PHASE``; a
    gated call's read of the inter-domain leg's words, its node's counts being read after its first rows),
    and ``"rows issued"``, the first inter-domain rows' collective issued after it (``COLLECTIVE_MILESTONE``; where
    the leg marks none, the first part of the inter-domain rows, ``ROWS_PHASE``, beginning), and ``"device work
    issued"``, the point after which the call enqueues no more device work (``ISSUED_MILESTONE``); with the first
    two, ``"lead steps"``: ``[(step, when)]`` in the order reached, the first of each of ``LEAD_STEPS`` between them.
    Missing ones are absent."""
    out = {}
    issued = [began for phase, _, _, _, began in log if phase == ISSUED_MILESTONE]
    if issued:
        out["device work issued"] = max(issued)
    counts = [began + on_host for phase, _, _, on_host, began in log if phase == COUNTS_PHASE]
    if counts:
        out["counts read"] = max(counts)
    # (a head chunk's collective, issued before the read, is not the lead's end)
    after = [began for phase, _, _, _, began in log if phase == COLLECTIVE_MILESTONE and began >= out.get(
        "counts read", float("-inf"))]
    rows = after or [began for phase, _, _, _, began in log if phase == ROWS_PHASE]
    if rows:
        out["rows issued"] = min(rows)
    if "counts read" in out and "rows issued" in out:  # the lead's steps: the first of each between the two
        steps: dict = {}
        for phase, _, _, _, began in log:
            if phase in LEAD_STEPS and out["counts read"] <= began <= out["rows issued"]:
                steps.setdefault(phase, began)
        out["lead steps"] = sorted(steps.items(), key=lambda step: step[1])
    return out


def _median(values: list) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else float("inf")


def _tokens(t: Optional[torch.Tensor], a: int, b: int) -> Optional[torch.Tensor]:
    """Tokens ``[a, b)`` (a chunk's bounds) of a per-token tensor ``t`` (None: None); an empty chunk is sliced at 0, so
    that it starts aligned as ``t`` does (its end bound need not be: no kernel variant of its own)."""
    if t is None:
        return None
    return t[a:b] if a < b else t[:0]


def _cached(x: torch.Tensor, scales: Optional[torch.Tensor], handle: DispatchHandle,
            req: DispatchRequest) -> DispatchRequest:
    return DispatchRequest(x, scales, None, None, None, None, None, handle.num_experts, 1, 0, handle, req.config, None,
                           req.overlapped)


def _to_slots(t: torch.Tensor, slot: torch.Tensor, fill) -> torch.Tensor:
    """``out[slot[i]] = t[i]`` into ``[D * T, ...]`` (``slot == D * T``: dropped); rows nothing lands on hold ``fill``
    (None: left unwritten). Moved as bytes where index ops lack the dtype (FP8)."""
    raw = t.view(torch.uint8) if t.dtype == FP8_DTYPE else t
    out = torch.empty(t.size(0) + 1, *t.shape[1:], dtype=raw.dtype, device=t.device)
    if fill is not None:
        out.fill_(fill)
    out.index_copy_(0, slot, raw)
    return out[:t.size(0)].view(t.dtype)


def _true_sources(h2: LowLatencyHandle, t_max: int, D: int, L: int, src_info: torch.Tensor,
                  layout_range: torch.Tensor) -> None:
    """Fill the user-visible ``src_info [E_local, R * T]`` int32 and ``layout_range [E_local, R, 2]`` int32 of a
    hierarchical low-latency dispatch from the domain leg's handle ``h2`` (on the device, no host synchronisation).
    The domain leg's row of an expert from forwarding rank ``l`` with forwarded row ``j = s * T + t`` (fixed slots)
    is token ``t`` of source rank ``s * L + l``; an expert's rows from forwarding rank ``l`` are ordered by ``j``,
    so each source rank's rows are one block, the blocks in the order (local index, domain)."""
    e_local, rt = src_info.shape
    j = h2.src_info.long()  # [E_local, R * T]: forwarded row, -1 past the count
    lr = h2.layout_range.long()  # [E_local, L, 2]: each forwarding rank's (first row, count)
    rows = torch.arange(rt, device=j.device)
    fwd = (rows.view(1, 1, rt) >= (lr[:, :, 0] + lr[:, :, 1]).unsqueeze(2)).sum(1)  # [E_local, R * T]
    valid = j >= 0
    src_info.copy_(torch.where(valid, j % t_max, -1))
    num_ranks = D * L
    src_rank = torch.where(valid, (j // t_max) * L + fwd, num_ranks)
    counts = torch.zeros(e_local, num_ranks + 1, dtype=torch.int64, device=j.device)
    counts.scatter_add_(1, src_rank, torch.ones_like(src_rank))
    per = counts[:, :num_ranks].view(e_local, D, L)
    begin = lr[:, :, 0].unsqueeze(1) + torch.cumsum(per, 1) - per  # [E_local, D, L]
    layout_range[:, :, 0] = begin.reshape(e_local, num_ranks)
    layout_range[:, :, 1] = per.reshape(e_local, num_ranks)


# torch >= 2.13 names it all_gather_single (all_gather_into_tensor is deprecated there)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(eq=False)
class _GatedCall:
    """A gated exact-mode call's buffers (``HierarchicalTransport._gated``), made in steps: the landing rows and the
    carried columns, the gate; the merged input and the sends; the chunks' own positions; the row maps, summaries and
    outputs. ``plan``: the bounds it was sized by before its count read (``_early_issue``), else None."""

    chunks: int
    landed: torch.Tensor  # [rows, fused width] uint8: every chunk's inter-domain rows beside their records
    carried: torch.Tensor  # [rows, scales + 2] float32: scales, then each row's source domain and token (int32 words)
    flags: torch.Tensor  # int64 gate flags (HierarchicalTransport._next_gate)
    value: int  # the value this call releases into them
    rows_at: torch.Tensor  # [chunks + 1] int32: the chunks' bounds in the merged input, written on the device
    starts: Optional[torch.Tensor]  # [D, chunks] int32 each rail peer's chunk starts (None until the counts are read)
    tickets: Optional[torch.Tensor] = None  # [chunks] int32, zero: each chunk's forward layout counts its programs
    merged: Optional[DispatchRequest] = None
    sends: Optional[torch.Tensor] = None
    m1: Optional[list] = None  # the rows each chunk lands here (once the counts are read)
    at: Optional[list] = None  # where each chunk's rows start in the landing buffer, and their end (_landing_at)
    own_rows: Optional[torch.Tensor] = None  # [rows, L] int32: every chunk's own positions, at its landing rows
    row_map: Optional[torch.Tensor] = None
    back: Optional[torch.Tensor] = None
    summaries: Optional[torch.Tensor] = None
    shared: Optional[tuple] = None
    plan: Optional[tuple] = None
    release: Optional[torch.Tensor] = None  # [chunks] int64 the flags' values, where the call may be let go
    ready: Any = None  # an early call's event on the caller's stream before its push (_early_issue)
    first: Optional[tuple] = None  # (m1, at, dispatch_into's handle function): its chunk 0's rows issued (_gated_first)
    sources: Optional[tuple] = None  # the carried columns of each row's source domain and token (int32 views)
    views: Optional[tuple] = None  # the forward layouts' views of the merged input (_gated_merged)
    streams: Optional[tuple] = None  # (the caller's stream, the network stream) of the call, on GPUs

    @functools.cached_property
    def own_pos(self) -> list:
        """Each chunk's own positions (``[m1[c], L]`` int32, the forward layout writes them), once ``m1`` and ``at``
        are set: views of ``own_rows`` at the chunk's landing rows, made with the merged input. An early call
        (``_early_issue``) then allocates no device memory between its push and the kernels the push waits for (an
        allocation the caching allocator cannot serve may make later work wait for earlier work, the push)."""
        return [self.own_rows[a:a + m] for a, m in zip(self.at, self.m1)]


class _Counts:
    """Both legs' counts of every chunk of an exact-mode dispatch, from the host read of ``_exchange_counts`` (the
    domain's gathered rows ``[L, C, V + D L]``: sums with ``V = 2 + L + e_dom``, the last their rail peers' most
    tokens, then the rows each source domain sends each rank of this domain through that forwarder; then this rank's
    sends ``[D, C]`` and receives ``[D, C]`` over the rail; with ``needs``, then the four numbers ``needs`` returns) for
    local index ``l``. The inter-domain leg's counts
    (``rail_known``) are what its first rows' collective waits for; the domain leg's (``domain``: per chunk, its
    ``KnownCounts`` and this rank's rows from each source, ``[L * D]``, from source rank ``d * L + f`` at
    ``f * D + d``, the domain leg's order: by forwarding rank, then source domain) are made when first asked, after
    that collective is issued. ``rail(c)``: chunk ``c``'s inter-domain leg request with its counts, made when first
    asked from the requests the caller sets (``with_legs``)."""

    def __init__(self, host, C: int, L: int, D: int, e_dom: int, l: int, needs: bool = False) -> None:
        V = 2 + L + e_dom
        W = V + D * L
        # (the read's numpy array, or a list. The lead to the first rows' collective takes from it only what chunk 0's
        # request needs, as Python ints: the sends and receives, the needs, chunk 0's per-expert counts; the [L, C, W]
        # array, whose sums and maxima the rest takes in a few numpy operations, and the most tokens when first asked)
        self._host = host if isinstance(host, np.ndarray) else np.asarray(host, dtype=np.int64)
        base = L * C * W
        sr = self._host[base:base + 2 * D * C + (4 if needs else 0)].tolist()
        self._sends, self._recvs = sr[:D * C], sr[D * C:2 * D * C]
        # (``needs``: the read holds them after the sends and receives, made on the device: launch_merged_needs)
        self._needs = tuple(sr[2 * D * C:]) if needs else None
        self._shape = (C, L, D, e_dom, l, V)
        self._legs: list = []  # the inter-domain leg's requests without their counts (``with_legs``)
        self._per_expert: Optional[torch.Tensor] = None  # [C, e_dom] received per-expert counts on the device
        self._rails: dict = {}

    @functools.cached_property
    def _every(self) -> np.ndarray:
        """The domain's gathered rows, ``[L, C, W]`` (a view of the read)."""
        C, L, D, e_dom, l, V = self._shape
        return self._host[:L * C * (V + D * L)].reshape(L, C, V + D * L)

    @staticmethod
    def most_of(host: np.ndarray, C: int, L: int, D: int, e_dom: int) -> int:
        """The largest token count any rank had in a call (the same on every rank: the next call's head), from the
        read's words ``host`` (column ``V - 1`` of every forwarder's chunk-0 row)."""
        V = 2 + L + e_dom
        W = V + D * L
        return int(host[V - 1:L * C * W:C * W].max())

    def with_legs(self, legs: list, per_expert) -> None:
        """Set the inter-domain leg's requests of the chunks (their counts not yet known) and the received per-expert
        counts on the device (``[C, e_dom]`` int32 or its ``C`` rows, or None), from which ``rail`` makes each
        chunk's."""
        self._legs, self._per_expert = legs, per_expert

    def drop_requests(self) -> None:
        """Let go of the inter-domain leg's requests (their packed rows among them) and the received per-expert counts
        once the call has issued every chunk's leg: what keeps these counts after the call (a handle whose domain
        ``KnownCounts`` are made when first asked) needs the read's words alone."""
        self._legs, self._rails, self._per_expert = [], {}, None

    def leg(self, c: int) -> DispatchRequest:
        """Chunk ``c``'s inter-domain leg request without its counts (``with_legs``), its local work prepared."""
        return self._legs[c]

    def rail_lists(self, c: int) -> tuple:
        """``(sends, recvs)``: the rows chunk ``c``'s inter-domain leg sends to and receives from each rail peer (host
        lists, by domain), as ``rail_known`` has them."""
        C = self._shape[0]
        return self._sends[c::C], self._recvs[c::C]

    def per_expert(self, c: int) -> torch.Tensor:
        """Chunk ``c``'s received per-expert counts on the device (``with_legs``': ``[e_dom]`` int32)."""
        return self._per_expert[c]

    def rail(self, c: int) -> DispatchRequest:
        """Chunk ``c``'s inter-domain leg request with its counts known, made when first asked (a gated call's later
        chunks' after its first rows' collective is issued)."""
        got = self._rails.get(c)
        if got is None:
            got = self._rails[c] = evolve(self._legs[c], known=self.rail_known(c, self._per_expert))
        return got

    def needs(self) -> tuple:
        """What the domain leg of this call's chunks merged into one gated call needs, the same numbers on every rank
        of the domain: ``(rows landing on the rank that lands the most, each chunk's from a multiple of 16; rows the
        rank that receives the most gets through the domain leg; the merged call's max_pair and num_tokens_max)``
        (``early_bounds``), made on the device from the gathered counts (``launch_merged_needs``) and read with them
        (``needs=True``)."""
        if self._needs is None:
            raise EpcommError("_Counts.needs: these counts were read without the needs: pass needs=True to "
                              "_exchange_counts for a call whose domain legs may be one gated call")
        return self._needs

    def received(self) -> tuple:
        """``(rows, per_expert)``: the rows this rank's domain leg receives in each chunk (``[C]``, the sums of
        ``domain``'s second parts) and, over all chunks, per expert of this rank (``[e_dom / L]``, the sum of
        ``domain``'s ``num_recv_tokens_per_expert``), Python lists made from the counts in two sums, without
        ``domain``."""
        C, L, D, e_dom, l, V = self._shape
        e_local = e_dom // L
        rows = self._every[:, :, V + l:V + D * L:L].sum(axis=(0, 2))
        per_expert = self._every[:, :, 1 + L + l * e_local:1 + L + (l + 1) * e_local].sum(axis=(0, 1))
        return rows.tolist(), per_expert.tolist()

    def _bounds(self, c: int) -> tuple:
        """``(max_pair, num_tokens_max)`` of chunk ``c``'s domain leg: the most rows any forwarder sends any rank of
        the domain, and the most rows any forwarder forwards."""
        L = self._shape[1]
        rows = self._every[:, c]
        return int(rows[:, 1:1 + L].max()), int(rows[:, 0].max())

    def rail_known(self, c: int, per_expert=None) -> KnownCounts:
        """The inter-domain leg's ``KnownCounts`` of chunk ``c`` (``per_expert``: ``[C, e_dom]`` the same received
        per-expert counts on the device or its ``C`` rows, or None)."""
        C, L, D, e_dom, l, V = self._shape
        at = (l * C + c) * (V + D * L)  # (this rank's row of chunk c in the read: no [L, C, W] array in the lead)
        sends, recvs = self.rail_lists(c)
        return KnownCounts(tuple(sends), tuple(recvs),
                           tuple(self._host[at + 1 + L:at + V - 1].tolist()),
                           recv_per_expert_tensor=None if per_expert is None else per_expert[c])

    @functools.cached_property
    def domain(self) -> list:
        """``[(domain KnownCounts, rows from each source)]`` per chunk."""
        C, L, D, e_dom, l, V = self._shape
        e_local = e_dom // L
        mine = slice(1 + L + l * e_local, 1 + L + (l + 1) * e_local)  # this rank's experts in a forwarder's sums
        out = []
        for c in range(C):  # (slices and zips)
            rows = self._every[:, c].tolist()
            max_pair, most = self._bounds(c)
            known = KnownCounts(
                tuple(rows[l][1:1 + L]), tuple(r[1 + l] for r in rows),
                tuple(map(sum, zip(*(r[mine] for r in rows)))), num_tokens_max=most, max_pair=max_pair)
            out.append((known, tuple(r[V + d * L + l] for r in rows for d in range(D))))
        return out


def _gather_row(recv: torch.Tensor, L: int, fused: bool) -> torch.Tensor:
    """The row an exact-mode dispatch's count exchange gathers over the domain, ``[C, V + 1 + D L]`` int32, from what
    its rail peers sent, ``recv [D, C, V + 2]`` int32 (``_exchange_counts``): per chunk the sums over the source
    domains (what this rank forwards), the most tokens of any rail peer, then, unsummed, the rows each source domain
    sends each rank of this domain. ``fused``: one launch (``launch_counts_gather_row``), else torch operations."""
    D, C = recv.shape[:2]
    if fused:
        from ..kernels.ep import launch_counts_gather_row

        row = torch.empty(C, recv.size(2) - 1 + D * L, dtype=torch.int32, device=recv.device)
        launch_counts_gather_row(recv, row, L)
        return row
    return torch.cat([recv[:, :, :-2].sum(0, dtype=torch.int32), recv[:, 0, -1].amax().view(1, 1).expand(C, 1),
                      recv[:, :, 1:1 + L].transpose(0, 1).reshape(C, D * L)], 1)


def _read_words(every: Optional[torch.Tensor], send: torch.Tensor, recv: torch.Tensor, bad: Optional[torch.Tensor],
                L: int, needs: bool, fused: bool) -> torch.Tensor:
    """The words the host reads after an exact-mode dispatch's count exchange (``_Counts``' layout), int32: the
    domain's gathered counts ``every [L * C, W]`` (None: none, the inter-domain leg's words alone), this rank's sends
    and receives over the rail (column 0 of ``send`` and ``recv``, ``[D, C, V + 2]``), with ``needs`` the four numbers
    a gated call's domain leg needs (``launch_merged_needs``), then the bad top-k id count (``bad``, a device scalar
    int32, or None: 0). ``fused``: one launch (``launch_counts_read``), else torch operations."""
    C = send.size(1)
    n = 0 if every is None else every.numel()
    if fused:
        from ..kernels.ep import launch_counts_read

        words = torch.empty(n + 2 * send.size(0) * C + (4 if needs else 0) + 1, dtype=torch.int32, device=send.device)
        launch_counts_read(every, send, recv, None if bad is None else bad.view(1), words, L, C, needs, LANDING_ROWS)
        return words
    parts = [send[:, :, 0].reshape(-1), recv[:, :, 0].reshape(-1)]
    if every is not None:
        parts.insert(0, every.view(-1))
    if needs:
        from ..kernels.ep import launch_merged_needs

        parts.append(torch.empty(4, dtype=torch.int32, device=every.device))
        launch_merged_needs(every, parts[-1], L, C, LANDING_ROWS)
    bad = bad if bad is not None else torch.zeros((), dtype=torch.int32, device=send.device)
    return torch.cat(parts + [bad.view(1).to(torch.int32)])


def _cat(parts: list) -> Optional[torch.Tensor]:
    """The chunks' outputs in order, as one tensor (None for absent outputs; a single chunk's as it is)."""
    if parts[0] is None:
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _rows_in_place(counts: torch.Tensor, row_map: torch.Tensor, col: int, L: int, D: int, chunk: int = 0,
                   chunks: int = 1, summary: Optional[torch.Tensor] = None, local: int = 0, e_local: int = 0) -> None:
    """Fill ``row_map [M]`` int64 (``DispatchRequest.row_map``): the output row of each row chunk ``chunk`` of an
    exact-mode dispatch's domain leg receives. That leg's rows come by forwarding rank ``f``, then source domain ``d``
    (its input, the inter-domain leg's rows, is by source then token), then token; the output's, as the intranode
    path's, by source rank ``d * L + f``, then token, so every (``f``, ``d``) block of a chunk moves as a whole, after
    the same block of the chunks before it (their tokens come first). ``counts [L * chunks, W]`` int32: the domain's
    gathered counts of the call on the device (``_exchange_counts``), this rank's rows from source rank ``d * L + f``
    in chunk ``c`` at ``[f * chunks + c, col + d * L]``. With ``summary`` (int32 ``[SUMMARY_HEAD + 3 L + e_local]``),
    the same launch writes there the one-sided domain leg's summary of the chunk's counts on the rank of local index
    ``local`` (``e_local`` experts a rank; a forwarder's row of a chunk: its rows, its rows per rank of the domain, per
    expert of the domain, ``_exchange_counts``). One launch (``rows_in_place_kernel``) and no other host work: it is
    made after the count read, which the host's time there holds up."""
    from ..kernels.ep import launch_rows_in_place

    launch_rows_in_place(counts, row_map, counts.stride(0) * chunks, col, L, D, chunk, chunks, counts.stride(0),
                         summary, local, e_local)


def _canonical_order(src_rank: torch.Tensor, num_ranks: int) -> tuple:
    """``(order, back)``: the permutation that sorts rows by (source rank, source token), rows without a source
    (-1: padding) last, and its inverse. The legs' rows of any one source already come in token order (each leg
    orders its output by source, then source token; the forwarded rows are in (source domain, token) order and a
    chunk's tokens precede the next chunk's), so a stable sort by source rank alone puts them in that order."""
    order = torch.sort(torch.remainder(src_rank, num_ranks + 1), stable=True).indices  # -1 -> num_ranks: last
    return order, _inverse(order)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """The inverse of the permutation ``perm`` ([M] int64): ``_inverse(perm)[perm[i]] == i``."""
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))


def _take(parts: list, order: torch.Tensor) -> Optional[torch.Tensor]:
    """The chunks' outputs, one after the other, in the rows' ``order`` (moved as bytes: index ops lack FP8)."""
    t = _cat(parts)
    if t is None:
        return None
    raw = t.view(torch.uint8) if t.element_size() == 1 else t
    return raw.index_select(0, order).view(t.dtype)


def _handed_over(out, done: torch.cuda.Event, main: torch.cuda.Stream):
    """``out`` (a leg's result, made on the network stream up to ``done``) for use on ``main``: ``main`` waits for
    ``done`` and every tensor of ``out`` is marked as used there (``record_stream``)."""
    main.wait_event(done)
    for t in _tensors(out):
        t.record_stream(main)
    return out


def _tensors(out) -> list:
    """The tensors of an inter-domain leg's result: a dispatch's ``DispatchResult`` (with its handle's), or a
    combine's ``(combined, combined weights)``."""
    if isinstance(out, DispatchResult):
        h = out.handle
        found = [out.recv_x, out.recv_scales, out.recv_topk_idx, out.recv_topk_weights, h.recv_src_rank,
                 h.recv_src_idx, h.num_recv_tokens_per_expert]
    else:
        found = list(out)
    return [t for t in found if isinstance(t, torch.Tensor)]


__all__ = ["HierarchicalTransport", "INTER_DOMAIN_LEGS", "ISSUED_MILESTONE", "LEAD_STEPS", "host_milestones",
           "subgroups"]
