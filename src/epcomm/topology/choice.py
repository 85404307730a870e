"""Which transport a group can run, and why: pure functions of a ``TopologyReport``.

| transport | needs |
|---|---|
| ``nvlink`` | CUDA on every rank, torch symmetric memory, one host, P2P access, native P2P atomics and NVLink between every pair |
| ``p2p`` | CUDA on every rank, torch symmetric memory, one host, P2P access between every pair (PCIe is fine, atomics are not needed) |
| ``alltoall`` | nothing: ``torch.distributed.all_to_all_single`` over the group's backend (CPU, multi-node, anything) |

The one-sided transports also need a group's ranks to share no GPU, or all one GPU (ranks that share a GPU map each
other's memory through CUDA IPC, out of reach of other GPUs' kernels). ``auto`` takes the first of ``nvlink``,
``p2p``, ``alltoall`` that the hardware runs (and that this build has).
A capability that could not be determined counts as missing: a transport is only chosen on evidence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Optional

from ..errors import TransportUnavailableError
from .report import TopologyReport

CHOICES = ("auto", "nvlink", "p2p", "alltoall")
PREFERENCE = ("nvlink", "p2p", "alltoall")
# per rank / per pair requirements, in the order they are checked (the first one missing is reported)
_RANK_NEEDS = {"nvlink": ("CUDA", "torch symmetric memory"), "p2p": ("CUDA", "torch symmetric memory"),
               "alltoall": ()}
_PAIR_NEEDS = {"nvlink": ("one host", "P2P access", "native P2P atomics", "NVLink"),
               "p2p": ("one host", "P2P access"), "alltoall": ()}


@dataclass(frozen=True)
class Failure:
    """A capability a transport needs that ``ranks`` (one rank or a pair) do not have, and why."""

    capability: str
    ranks: tuple
    reason: str

    def __post_init__(self) -> None:
        if len(self.ranks) not in (1, 2):
            raise ValueError(f"Failure: ranks={self.ranks!r} must name one rank or a pair")
        if not self.capability or not self.reason:
            raise ValueError("Failure: capability and reason are required")

    def describe(self) -> str:
        where = (f"on rank {self.ranks[0]}" if len(self.ranks) == 1
                 else f"between ranks {self.ranks[0]} and {self.ranks[1]}")
        return f"{self.capability} {where}: {self.reason}"


def _rank_capability(report: TopologyReport, rank: int, need: str):
    info = report.ranks[rank]
    if need == "CUDA":
        return info.device.startswith("cuda"), f"rank {rank} communicates on {info.device}"
    cap = info.symmetric_memory
    return cap.ok, cap.reason


def _pair_capability(pair, need: str):
    if need == "one host":
        return pair.same_host, pair.link.reason
    cap = {"P2P access": pair.p2p, "native P2P atomics": pair.atomics, "NVLink": pair.nvlink}[need]
    return cap.ok, (cap.reason if cap.available is False else f"could not be determined ({cap.reason})")


def transport_failures(report: TopologyReport, name: str) -> tuple:
    """Every ``Failure`` that keeps transport ``name`` from running on this group (empty: it can run). Per-rank
    needs are checked first; each pair reports only the first need it misses."""
    if name not in PREFERENCE:
        raise ValueError(f"transport_failures: transport {name!r} is not one of {PREFERENCE}")
    failures = []
    for need in _RANK_NEEDS[name]:
        for r in range(report.world_size):
            ok, reason = _rank_capability(report, r, need)
            if not ok:
                failures.append(Failure(need, (r,), reason))
    for pair in report.pairs:
        for need in _PAIR_NEEDS[name]:
            ok, reason = _pair_capability(pair, need)
            if not ok:
                failures.append(Failure(need, tuple(pair.ranks), reason))
                break
    return tuple(failures) + (_split_shared_gpus(report) if name != "alltoall" else ())


def _split_shared_gpus(report: TopologyReport) -> tuple:
    """The one-sided transports' group-wide need: a group whose ranks share a GPU must be on that GPU alone. Ranks
    that share a GPU map each other's memory through CUDA IPC, and a kernel on another GPU cannot reach memory
    mapped that way (an illegal address on H200s, peer access enabled or not; the heap refuses it too)."""
    shared = [p for p in report.pairs if p.link.kind == "same-gpu"]
    apart = [p for p in report.pairs if p.link.kind != "same-gpu"]
    if not shared or not apart:
        return ()
    (a, b), (c, d) = shared[0].ranks, apart[0].ranks
    return (Failure("all ranks on one GPU, or a GPU each", (a, b),
                    f"ranks {a} and {b} share a GPU while ranks {c} and {d} are on different GPUs; ranks that share "
                    "a GPU map each other's memory through CUDA IPC, which kernels on another GPU cannot reach"),)


def _summary(failures: tuple) -> str:
    more = len(failures) - 1
    return failures[0].describe() + (f" (and {more} more; `python -m epcomm doctor` lists them)" if more else "")


def _why_it_runs(report: TopologyReport, name: str) -> str:
    n = report.world_size
    if name == "alltoall":
        return f"the portable all_to_all transport over {report.backend or 'the group backend'}"
    if n == 1:
        return "a single CUDA rank"
    links = sorted({p.link.describe() for p in report.pairs})
    if name == "nvlink":
        return f"every pair of the {n} ranks has P2P over NVLink with native atomics ({', '.join(links)})"
    return f"every pair of the {n} ranks has P2P access ({', '.join(links)})"


def choose_transport(report: TopologyReport, requested: str = "auto",
                     available: Optional[Collection[str]] = None) -> tuple:
    """The transport to use on the group of ``report`` and the reason, as ``(name, reason)``.

    Arguments:
        report: the group's ``TopologyReport`` (``epcomm.topology.probe``).
        requested: ``auto`` (the best transport the hardware runs) or ``nvlink``, ``p2p``, ``alltoall``.
        available: the transports this build has (default: all of them); ``auto`` skips the others.

    Raises:
        TransportUnavailableError: a forced transport the hardware cannot run (the message names the missing
            capability and the ranks), or one this build does not have.
    """
    if requested not in CHOICES:
        raise ValueError(f"choose_transport: requested={requested!r} is not one of {CHOICES}")
    have = set(PREFERENCE if available is None else available) | {"alltoall"}
    if requested != "auto":
        failures = transport_failures(report, requested)
        if failures:
            raise TransportUnavailableError(f"choose_transport: transport {requested!r} cannot run on this group: "
                                            f"it needs {_summary(failures)}")
        if requested not in have:
            raise TransportUnavailableError(
                f"choose_transport: transport {requested!r} would run on this hardware but is not available in "
                f"this build (available: {', '.join(sorted(have))})")
        return requested, f"forced {requested}: {_why_it_runs(report, requested)}"
    skipped = []
    for name in PREFERENCE:
        failures = transport_failures(report, name)
        if failures:
            more = f" (+{len(failures) - 1} more)" if len(failures) > 1 else ""
            skipped.append(f"not {name}: it needs {failures[0].describe()}{more}")
        elif name not in have:
            skipped.append(f"not {name}: it would run here but is not available in this build")
        else:
            return name, "; ".join([f"auto: {name}: {_why_it_runs(report, name)}"] + skipped)
    raise AssertionError("choose_transport: alltoall always runs")  # pragma: no cover
