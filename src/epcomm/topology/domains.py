"""Domains: the sets of ranks joined by one-sided P2P (a node's NVLink island), found from the topology report.

A *domain* is what DeepEP calls a node: ranks that reach each other's memory (NVLink, or PCIe P2P on one
machine). Between domains there is only a network (``torch.distributed``'s backend). epcomm numbers ranks as the
launchers do: domain ``d`` holds the consecutive ranks ``[d * L, (d + 1) * L)`` and ``L`` (``local_size``) is the
same for every domain; rank ``r`` has local index ``r % L`` and its *rail peers* are the ranks with the same local
index in the other domains (``epcomm.transports.hierarchical`` sends each token across domains once, to a rail
peer, which forwards it within its domain).

``find_domains`` is pure: it groups ranks by host (the probe's host identity, which tells machines apart even when
hostnames repeat), unless ``ranks_per_node`` is given (``Buffer(ranks_per_node=...)``, else
``EPCOMM_RANKS_PER_NODE``), which splits the ranks into consecutive blocks: how one machine is split into simulated
nodes. Groups the hierarchical path cannot serve raise ``ValueError`` naming the ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class Domains:
    """``num_domains`` domains of ``local_size`` consecutive ranks each; ``source`` says who decided."""

    num_domains: int
    local_size: int
    source: str

    def __post_init__(self) -> None:
        for name in ("num_domains", "local_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Domains: {name}={value!r} must be a positive int")

    @property
    def world_size(self) -> int:
        return self.num_domains * self.local_size

    def domain_of(self, rank: int) -> int:
        return rank // self.local_size

    def local_index(self, rank: int) -> int:
        return rank % self.local_size

    def domain_ranks(self, domain: int) -> list:
        """The ranks of ``domain``, in order."""
        return list(range(domain * self.local_size, (domain + 1) * self.local_size))

    def rail_ranks(self, local_index: int) -> list:
        """The ranks with local index ``local_index``, one per domain, in domain order."""
        return [d * self.local_size + local_index for d in range(self.num_domains)]

    def describe(self) -> str:
        if self.num_domains == 1:
            return f"one domain of {self.local_size} ranks ({self.source})"
        return (f"{self.num_domains} domains of {self.local_size} ranks: "
                + ", ".join(f"[{d * self.local_size}-{(d + 1) * self.local_size - 1}]" if self.local_size > 1
                            else f"[{d}]" for d in range(self.num_domains)) + f" ({self.source})")


def find_domains(host_ids: Sequence[str], ranks_per_node: Optional[int] = None, source: str = "") -> Domains:
    """The domains of a group whose rank ``r`` runs on host ``host_ids[r]``.

    Arguments:
        host_ids: one host identity per rank, in rank order (``TopologyReport``'s hosts or ``LocalFacts.host_id``).
        ranks_per_node: consecutive blocks of this many ranks form the domains, whatever the hosts (simulated
            nodes on one machine); it must divide the group size and may not join ranks of different hosts.
        source: who chose ``ranks_per_node`` (for messages and reports).

    Raises ValueError, naming the ranks, for hosts with different numbers of ranks or whose ranks are not
    consecutive (launch one block of ranks per node, as torchrun does), and for a ``ranks_per_node`` that does not
    divide the group or spans hosts."""
    n = len(host_ids)
    if n < 1:
        raise ValueError("find_domains: no ranks")
    if ranks_per_node is not None:
        if not isinstance(ranks_per_node, int) or ranks_per_node < 1 or n % ranks_per_node:
            raise ValueError(f"find_domains: ranks_per_node={ranks_per_node!r} ({source}) must be a positive divisor "
                             f"of the group's {n} ranks")
        for d in range(n // ranks_per_node):
            block = range(d * ranks_per_node, (d + 1) * ranks_per_node)
            hosts = sorted({host_ids[r] for r in block})
            if len(hosts) > 1:
                raise ValueError(f"find_domains: ranks_per_node={ranks_per_node} ({source}) puts ranks "
                                 f"{block.start}-{block.stop - 1} into one domain, but they run on {len(hosts)} hosts "
                                 f"({', '.join(hosts)}): a domain's ranks must reach each other's memory; pass a "
                                 f"divisor of the ranks per host")
        return Domains(n // ranks_per_node, ranks_per_node, source or "ranks_per_node")
    blocks: list = []  # (host, first rank, last rank)
    for r, h in enumerate(host_ids):
        if blocks and blocks[-1][0] == h:
            blocks[-1][2] = r
        else:
            blocks.append([h, r, r])
    hosts = [b[0] for b in blocks]
    if len(set(hosts)) != len(hosts):
        where = {h: [f"{a}-{b}" if a != b else f"{a}" for hh, a, b in blocks if hh == h] for h in hosts}
        split = {h: v for h, v in where.items() if len(v) > 1}
        raise ValueError("find_domains: the ranks of a host must be consecutive (launch one block of ranks per node, "
                         "as torchrun does); " + "; ".join(f"host {h} has ranks {', '.join(v)}"
                                                           for h, v in split.items()))
    sizes = {b[2] - b[1] + 1 for b in blocks}
    if len(sizes) > 1:
        raise ValueError("find_domains: every node must run the same number of ranks; "
                         + ", ".join(f"ranks {a}-{b} on {h}" for h, a, b in blocks)
                         + " (use the same number of GPUs per node, or pass ranks_per_node to split them evenly)")
    return Domains(len(blocks), sizes.pop(), source or "one domain per host (topology probe)")





def host_ids_from_report(report) -> list:
    """One host identity per rank of a ``TopologyReport``: the lowest rank on the same host (the report's pairs
    know which ranks share a host, by hostname and boot id)."""
    ids = []
    for r in range(report.world_size):
        ids.append(next(s for s in range(r + 1) if s == r or report.pair(s, r).same_host))
    return [f"host of rank {i} ({report.ranks[i].hostname})" for i in ids]
__all__ = ["Domains", "find_domains", "host_ids_from_report"]
