"""The topology report: typed, frozen, agreed across ranks, and built from plain per-rank facts by pure code.

Each rank collects ``LocalFacts`` about its own device and host (``collect.py``, hardware-dependent); the ranks
exchange them (``probe.py``) and every rank runs ``build_report`` on the same list, so every rank holds the same
``TopologyReport``. Everything here is pure: it runs (and is tested) without GPUs.

Pair facts are matched by PCI bus id, not CUDA index, so they stay right when ranks see different
``CUDA_VISIBLE_DEVICES``. NVML sees every GPU of a host whatever ``CUDA_VISIBLE_DEVICES`` says; the CUDA runtime
only those made visible to the process.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

# nvmlGpuTopologyLevel_t -> the legend of ``nvidia-smi topo -m``
PCIE_LEVELS = {0: "BOARD", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
NODE_LEVEL = 40  # NVML_TOPOLOGY_NODE: the path leaves the PCIe root complex (host bridge) of one GPU
# NVLink bandwidth per link and direction (GB/s, nominal signalling rate as ``nvidia-smi nvlink -s`` shows it),
# by compute capability major: each GPU generation speaks one NVLink generation.
NVLINK_GBPS_PER_LINK = {6: 20.0, 7: 25.0, 8: 25.0, 9: 26.56, 10: 50.0}

_PCI_RE = re.compile(r"^(?:([0-9a-fA-F]+):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})(?:\.([0-9a-fA-F]))?$")


def normalize_pci_bus_id(value) -> str:
    """``domain:bus:device.function`` in lower-case hex with a 4-digit domain (``0000:18:00.0``), whatever the
    source wrote (NVML's 8-digit domain, bytes, no domain). Unparseable input comes back stripped and
    lower-cased; empty or None gives ``""``."""
    if value is None:
        return ""
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).split(b"\0", 1)[0].decode("ascii", "replace")
    text = str(value).strip().lower()
    m = _PCI_RE.match(text)
    if not m:
        return text
    domain, bus, dev, fn = m.groups()
    return f"{int(domain or '0', 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{int(fn or '0', 16):x}"


@dataclass(frozen=True)
class Capability:
    """One capability and why: ``available`` is True, False (missing) or None (could not be determined).

    A capability that is not available always carries the reason (``reason`` may also say how a present one
    was established)."""

    available: Optional[bool]
    reason: str = ""

    def __post_init__(self) -> None:
        if not any(self.available is v for v in (True, False, None)):
            raise ValueError(f"Capability: available={self.available!r} must be True, False or None")
        if not isinstance(self.reason, str):
            raise TypeError(f"Capability: reason must be a str, got {type(self.reason).__name__}")
        if self.available is not True and not self.reason:
            raise ValueError("Capability: a missing or unknown capability needs a reason")

    @classmethod
    def yes(cls, reason: str = "") -> "Capability":
        return cls(True, reason)

    @classmethod
    def no(cls, reason: str) -> "Capability":
        return cls(False, reason)

    @classmethod
    def unknown(cls, reason: str) -> "Capability":
        return cls(None, reason)

    @property
    def ok(self) -> bool:
        """True only when the capability is known to be present."""
        return self.available is True

    def describe(self) -> str:
        """``yes``, ``no: <reason>`` or ``unknown: <reason>``."""
        word = {True: "yes", False: "no", None: "unknown"}[self.available]
        return f"{word}: {self.reason}" if self.reason else word


def both_ways(forward: Optional[Capability], backward: Optional[Capability], a: int, b: int,
              what: str) -> Capability:
    """A pair capability from the two directions ``a -> b`` and ``b -> a`` (either may be None: not
    reported). Present only if both are; missing if either is; else unknown."""
    sides = [(f"rank {a} -> rank {b}", forward), (f"rank {b} -> rank {a}", backward)]
    for label, cap in sides:
        if cap is not None and cap.available is False:
            return Capability.no(f"{label}: {cap.reason}")
    for label, cap in sides:
        if cap is None:
            return Capability.unknown(f"{label}: {what} was not reported (the peer GPU is not visible there)")
        if cap.available is None:
            return Capability.unknown(f"{label}: {cap.reason}")
    reasons = {cap.reason for _, cap in sides if cap.reason}
    return Capability.yes("; ".join(sorted(reasons)))


# ---------------------------------------------------------------------------------------------- local facts
@dataclass(frozen=True)
class NvLinkFacts:
    """One active NVLink of a GPU (from NVML)."""

    link: int
    remote_pci_bus_id: str  # normalised; "" when NVML did not say
    remote_is_switch: Optional[bool]  # nvmlDeviceGetNvLinkRemoteDeviceType == SWITCH; None: not reported
    version: Optional[int]  # nvmlDeviceGetNvLinkVersion's raw value (its meaning changed between drivers)

    def __post_init__(self) -> None:
        if not isinstance(self.link, int) or self.link < 0:
            raise ValueError(f"NvLinkFacts: link={self.link!r} must be a non-negative int")


@dataclass(frozen=True)
class PeerFacts:
    """What one rank's process knows about another GPU of its host, in the direction own GPU -> that GPU."""

    pci_bus_id: str
    cuda_index: Optional[int]  # the peer's CUDA index in this process; None: not visible to CUDA here
    access: Capability  # P2P access (cudaDeviceCanAccessPeer and cudaDevP2PAttrAccessSupported)
    atomics: Capability  # native P2P atomics (cudaDevP2PAttrNativeAtomicSupported, else NVML P2P status)
    performance_rank: Optional[int]  # cudaDevP2PAttrPerformanceRank (lower is better)
    nvlink: Capability  # NVML P2P status for NVLink (nvmlDeviceGetP2PStatus(..., NVLINK))
    pcie_level: Optional[int]  # nvmlDeviceGetTopologyCommonAncestor (an NVML_TOPOLOGY_* value)
    pcie_reason: str = ""  # why pcie_level is None

    def __post_init__(self) -> None:
        if not self.pci_bus_id:
            raise ValueError("PeerFacts: pci_bus_id is required (peers are matched by PCI bus id)")
        if self.pcie_level is None and not self.pcie_reason:
            raise ValueError("PeerFacts: an unknown pcie_level needs pcie_reason")


@dataclass(frozen=True)
class LocalFacts:
    """Everything one rank reports about itself; plain data, sent to every rank with ``all_gather_object``.

    ``device`` is ``cuda:<index>`` or ``cpu``; the CUDA fields are empty on CPU and ``cuda_reason`` says why.
    ``nvlinks`` lists the active NVLinks of the rank's GPU (``()``: it has none, None: unknown, see
    ``nvlink_reason``). ``host_gpus`` are the PCI bus ids of every GPU NVML sees on the host (used to tell links
    to a GPU from links to an NVSwitch when NVML does not report the remote device type)."""

    rank: int
    hostname: str
    host_id: str  # hostname plus boot id: equal only for processes of one machine (and one kernel)
    device: str
    device_name: str
    sm_count: Optional[int]
    compute_capability: Optional[tuple]
    pci_bus_id: str
    cuda_reason: str
    peers: tuple
    nvlinks: Optional[tuple]
    nvlink_reason: str
    host_gpus: tuple
    symmetric_memory: Capability
    nvshmem: Capability
    torch_version: str
    triton_version: str
    nccl_version: str
    cuda_visible_devices: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"LocalFacts: rank={self.rank!r} must be a non-negative int")
        if self.device != "cpu" and not re.fullmatch(r"cuda:\d+", self.device):
            raise ValueError(f"LocalFacts: device={self.device!r} must be 'cpu' or 'cuda:<index>'")
        if self.device == "cpu" and not self.cuda_reason:
            raise ValueError("LocalFacts: a CPU rank needs cuda_reason (why it has no CUDA facts)")
        if self.nvlinks is None and not self.nvlink_reason:
            raise ValueError("LocalFacts: unknown nvlinks need nvlink_reason")
        for name, kind in (("peers", PeerFacts), ("nvlinks", NvLinkFacts)):
            items = getattr(self, name)
            if items is not None and not all(isinstance(x, kind) for x in items):
                raise TypeError(f"LocalFacts: {name} must be a tuple of {kind.__name__}")

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def peer(self, pci_bus_id: str) -> Optional[PeerFacts]:
        """The facts about the GPU at ``pci_bus_id``, or None if this rank reported none."""
        for p in self.peers:
            if p.pci_bus_id == pci_bus_id:
                return p
        return None


# ---------------------------------------------------------------------------------------------- the report
@dataclass(frozen=True)
class RankInfo:
    """One rank: where it runs and on what."""

    rank: int
    hostname: str
    device: str
    device_name: str
    sm_count: Optional[int]
    compute_capability: Optional[tuple]
    pci_bus_id: str
    torch_version: str
    triton_version: str
    nccl_version: str
    symmetric_memory: Capability
    nvshmem: Capability

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"RankInfo: rank={self.rank!r} must be a non-negative int")


@dataclass(frozen=True)
class LinkInfo:
    """How two ranks' devices are connected.

    kind: ``nvlink``, ``pcie``, ``same-gpu`` (both ranks use one GPU), ``network`` (different hosts),
    ``none`` (a CPU rank) or ``unknown``. ``nvlink_count`` is the number of NVLinks between the two GPUs (for
    NVSwitch systems: the links each GPU has into the switch fabric, as ``nvidia-smi topo -m`` counts them);
    ``nominal_gbps`` their nominal bandwidth per direction. ``pcie_path`` is the PCIe path in ``nvidia-smi
    topo`` terms (PIX, PXB, PHB, NODE, SYS), ``crosses_root_complex`` whether it leaves one root complex."""

    kind: str
    nvlink_count: Optional[int] = None
    via_switch: Optional[bool] = None
    nominal_gbps: Optional[float] = None
    pcie_path: Optional[str] = None
    crosses_root_complex: Optional[bool] = None
    reason: str = ""

    KINDS = ("nvlink", "pcie", "same-gpu", "network", "none", "unknown")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise ValueError(f"LinkInfo: kind={self.kind!r} must be one of {self.KINDS}")
        if self.nvlink_count is not None and self.nvlink_count < 0:
            raise ValueError(f"LinkInfo: nvlink_count={self.nvlink_count} must be >= 0")

    def describe(self) -> str:
        """A short label: ``NV18 (NVSwitch, 478 GB/s nominal)``, ``PCIe PXB``, ``network`` ..."""
        if self.kind == "nvlink":
            n = f"NV{self.nvlink_count}" if self.nvlink_count else "NVLink"
            extra = [x for x in ("NVSwitch" if self.via_switch else "",
                                 f"{self.nominal_gbps:.0f} GB/s nominal" if self.nominal_gbps else "") if x]
            return n + (f" ({', '.join(extra)})" if extra else "")
        if self.kind == "pcie":
            path = self.pcie_path or "path unknown"
            return f"PCIe {path}" + (" (crosses root complexes)" if self.crosses_root_complex else "")
        return self.kind


@dataclass(frozen=True)
class PairReport:
    """Two ranks ``ranks = (a, b)``, ``a < b``: their link and what one-sided transports need of it."""

    ranks: tuple
    same_host: bool
    link: LinkInfo
    p2p: Capability  # P2P access both ways
    atomics: Capability  # native P2P atomics both ways
    nvlink: Capability  # connected by NVLink

    def __post_init__(self) -> None:
        if len(self.ranks) != 2 or not self.ranks[0] < self.ranks[1]:
            raise ValueError(f"PairReport: ranks={self.ranks!r} must be (a, b) with a < b")

    @property
    def label(self) -> str:
        return f"{self.ranks[0]}-{self.ranks[1]}"


@dataclass(frozen=True)
class TopologyReport:
    """What every rank of a group knows about the group's hardware, identical on every rank.

    ``device_type`` is ``cuda``, ``cpu`` or ``mixed``; ``pairs`` holds every pair ``(a, b)``, ``a < b``, in
    order; ``hosts`` the distinct hostnames in rank order; ``symmetric_memory``/``nvshmem`` whether every rank
    has them; ``notes`` anything odd (different software versions across ranks, ...)."""

    world_size: int
    backend: str
    device_type: str
    ranks: tuple
    pairs: tuple
    hosts: tuple
    num_hosts: int
    symmetric_memory: Capability
    nvshmem: Capability
    notes: tuple = ()

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"TopologyReport: world_size={self.world_size!r} must be a positive int")
        if self.device_type not in ("cuda", "cpu", "mixed"):
            raise ValueError(f"TopologyReport: device_type={self.device_type!r} must be cuda, cpu or mixed")
        if [r.rank for r in self.ranks] != list(range(self.world_size)):
            raise ValueError(f"TopologyReport: ranks must be RankInfo for ranks 0..{self.world_size - 1} in order")
        want = [(a, b) for a in range(self.world_size) for b in range(a + 1, self.world_size)]
        if [tuple(p.ranks) for p in self.pairs] != want:
            raise ValueError("TopologyReport: pairs must hold every (a, b), a < b, in order")
        if not 1 <= self.num_hosts <= self.world_size:
            raise ValueError(f"TopologyReport: num_hosts={self.num_hosts} must be in 1..{self.world_size}")

    @property
    def multi_node(self) -> bool:
        """True when the ranks run on more than one host."""
        return self.num_hosts > 1

    @property
    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    def pair(self, a: int, b: int) -> PairReport:
        """The pair of ranks ``a`` and ``b`` (either order)."""
        a, b = min(a, b), max(a, b)
        if a == b or not 0 <= a < b < self.world_size:
            raise ValueError(f"TopologyReport.pair: ({a}, {b}) is not a pair of distinct ranks of {self.world_size}")
        return self.pairs[a * (2 * self.world_size - a - 1) // 2 + (b - a - 1)]

    @property
    def versions(self) -> dict:
        """torch, Triton and NCCL versions (rank 0's; ``notes`` says when ranks differ)."""
        r0 = self.ranks[0]
        return {"torch": r0.torch_version, "triton": r0.triton_version, "nccl": r0.nccl_version}


# ---------------------------------------------------------------------------------------------- building
def count_nvlinks(links_a: Optional[Sequence[NvLinkFacts]], links_b: Optional[Sequence[NvLinkFacts]],
                  pci_a: str, pci_b: str, host_gpus: Sequence[str]) -> tuple:
    """``(count, via_switch)`` NVLinks between GPUs ``pci_a`` and ``pci_b`` from each GPU's active links, or
    ``(None, None)`` when neither side's links are known.

    Direct links are those whose remote end is the other GPU. Links into an NVSwitch (remote type SWITCH, or,
    where NVML does not report the type, a remote that is no GPU of the host) connect the two GPUs when both
    have some; the pair then counts the smaller number, as ``nvidia-smi topo -m`` does."""
    gpus = set(host_gpus)

    def is_switch(link: NvLinkFacts) -> bool:
        if link.remote_is_switch is not None:
            return link.remote_is_switch
        return bool(link.remote_pci_bus_id) and link.remote_pci_bus_id not in gpus

    def direct(links, other):
        return sum(1 for x in links if not is_switch(x) and x.remote_pci_bus_id == other)

    known = [(links, other) for links, other in ((links_a, pci_b), (links_b, pci_a)) if links is not None]
    if not known:
        return None, None
    n_direct = min(direct(links, other) for links, other in known)
    if links_a is None or links_b is None:
        # one side unknown: switch links cannot be matched; direct links still count
        return (n_direct, False) if n_direct else (None, None)
    n_switch = min(sum(map(is_switch, links_a)), sum(map(is_switch, links_b)))
    return n_direct + n_switch, n_switch > 0 and n_direct == 0


def _cpu_pair(fa: LocalFacts, fb: LocalFacts, same_host: bool) -> PairReport:
    cpu = fa if not fa.is_cuda else fb
    why = f"rank {cpu.rank} communicates on {cpu.device}"
    cap = Capability.no(why)
    return PairReport((fa.rank, fb.rank), same_host, LinkInfo("none", reason=why), cap, cap, cap)


def _gpu_pair(fa: LocalFacts, fb: LocalFacts) -> PairReport:
    a, b = fa.rank, fb.rank
    ranks = (a, b)
    if not fa.pci_bus_id or not fb.pci_bus_id:
        which = a if not fa.pci_bus_id else b
        cap = Capability.unknown(f"the PCI bus id of rank {which}'s GPU is unknown, so the pair cannot be matched")
        return PairReport(ranks, True, LinkInfo("unknown", reason=cap.reason), cap, cap, cap)
    if fa.pci_bus_id == fb.pci_bus_id:
        why = f"ranks {a} and {b} share the GPU {fa.pci_bus_id}"
        cap = Capability.yes(why)
        return PairReport(ranks, True, LinkInfo("same-gpu", reason=why), cap, cap, cap)
    pa, pb = fa.peer(fb.pci_bus_id), fb.peer(fa.pci_bus_id)
    p2p = both_ways(pa and pa.access, pb and pb.access, a, b, "P2P access")
    atomics = both_ways(pa and pa.atomics, pb and pb.atomics, a, b, "native P2P atomics")
    host_gpus = tuple(fa.host_gpus) + tuple(fb.host_gpus)
    count, via_switch = count_nvlinks(fa.nvlinks, fb.nvlinks, fa.pci_bus_id, fb.pci_bus_id, host_gpus)
    nvml_nvlink = both_ways(pa and pa.nvlink, pb and pb.nvlink, a, b, "NVML's NVLink P2P status")
    if nvml_nvlink.available is not None:
        # NVML's P2P status is authoritative (an NVSwitch partition may separate GPUs that both have links)
        nvlink = nvml_nvlink
        if nvlink.ok and count is not None and count > 0:
            nvlink = Capability.yes(f"{count} NVLinks" + (" through NVSwitch" if via_switch else ""))
    elif count is not None:
        nvlink = (Capability.yes(f"{count} NVLinks" + (" through NVSwitch" if via_switch else "")) if count
                  else Capability.no("no active NVLink between the two GPUs (NVML)"))
    else:
        reasons = {f.nvlink_reason for f in (fa, fb) if f.nvlinks is None}
        nvlink = Capability.unknown("; ".join(sorted(reasons)) or nvml_nvlink.reason)
    level = next((p.pcie_level for p in (pa, pb) if p is not None and p.pcie_level is not None), None)
    path = PCIE_LEVELS.get(level) if level is not None else None
    crosses = None if level is None else level >= NODE_LEVEL
    if nvlink.ok:
        caps = [f.compute_capability[0] for f in (fa, fb) if f.compute_capability]
        per_link = min(NVLINK_GBPS_PER_LINK.get(c) or 0.0 for c in caps) if caps else 0.0
        gbps = round(per_link * count, 1) if count and per_link else None
        link = LinkInfo("nvlink", count, via_switch, gbps, path, crosses, nvlink.reason)
    elif nvlink.available is False:
        link = LinkInfo("pcie", 0, None, None, path, crosses,
                        f"no NVLink ({nvlink.reason})" + ("" if path else
                                                          f"; PCIe path unknown: {_pcie_reason(pa, pb)}"))
    else:
        link = LinkInfo("unknown", None, None, None, path, crosses, nvlink.reason)
    return PairReport(ranks, True, link, p2p, atomics, nvlink)


def _pcie_reason(pa: Optional[PeerFacts], pb: Optional[PeerFacts]) -> str:
    reasons = [p.pcie_reason for p in (pa, pb) if p is not None and p.pcie_reason]
    return reasons[0] if reasons else "no rank reported it"


def build_pair(fa: LocalFacts, fb: LocalFacts) -> PairReport:
    """The report for ranks ``fa.rank < fb.rank`` from their facts (pure)."""
    if fa.host_id != fb.host_id:
        why = f"ranks {fa.rank} and {fb.rank} are on different hosts ({fa.hostname}, {fb.hostname})"
        cap = Capability.no(why)
        return PairReport((fa.rank, fb.rank), False, LinkInfo("network", reason=why), cap, cap, cap)
    if not (fa.is_cuda and fb.is_cuda):
        return _cpu_pair(fa, fb, True)
    return _gpu_pair(fa, fb)


def _all_ranks(facts: Sequence[LocalFacts], attr: str, what: str) -> Capability:
    for f in facts:
        cap = getattr(f, attr)
        if not cap.ok:
            return Capability(cap.available, f"rank {f.rank}: {cap.reason}")
    return Capability.yes(f"{what} on every rank")


def build_report(facts: Sequence[LocalFacts], backend: str = "") -> TopologyReport:
    """The group's ``TopologyReport`` from every rank's ``LocalFacts`` (indexed by rank). Pure and
    deterministic: every rank that runs it on the same list gets an equal report."""
    facts = list(facts)
    if not facts:
        raise ValueError("build_report: no facts (the group has no ranks?)")
    for i, f in enumerate(facts):
        if not isinstance(f, LocalFacts):
            raise TypeError(f"build_report: facts[{i}] is {type(f).__name__}, not LocalFacts")
        if f.rank != i:
            raise ValueError(f"build_report: facts[{i}] is rank {f.rank}'s; pass them in rank order")
    n = len(facts)
    kinds = {f.is_cuda for f in facts}
    device_type = "mixed" if len(kinds) > 1 else ("cuda" if kinds == {True} else "cpu")
    ranks = tuple(RankInfo(f.rank, f.hostname, f.device, f.device_name, f.sm_count, f.compute_capability,
                           f.pci_bus_id, f.torch_version, f.triton_version, f.nccl_version, f.symmetric_memory,
                           f.nvshmem) for f in facts)
    pairs = tuple(build_pair(facts[a], facts[b]) for a in range(n) for b in range(a + 1, n))
    host_ids = list(dict.fromkeys(f.host_id for f in facts))
    hosts = tuple(dict.fromkeys(f.hostname for f in facts))
    notes = []
    for attr, what in (("torch_version", "torch"), ("triton_version", "Triton"), ("nccl_version", "NCCL")):
        values = {getattr(f, attr) for f in facts}
        if len(values) > 1:
            notes.append(f"ranks run different {what} versions: " +
                         ", ".join(f"rank {f.rank} {getattr(f, attr)}" for f in facts))
    if device_type == "mixed":
        notes.append("some ranks communicate on CUDA, others on CPU: " +
                     ", ".join(f"rank {f.rank} {f.device}" for f in facts))
    if len(host_ids) > len(hosts):
        notes.append("ranks share a hostname but not a boot id: treated as different machines")
    return TopologyReport(n, str(backend), device_type, ranks, pairs, hosts, len(host_ids),
                          _all_ranks(facts, "symmetric_memory", "torch symmetric memory"),
                          _all_ranks(facts, "nvshmem", "NVSHMEM"), tuple(notes))
