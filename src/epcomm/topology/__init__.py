"""Topology probe and transport choice: which transport this group's hardware runs, and why.

``probe(group)`` returns a ``TopologyReport`` that every rank agrees on; ``choose_transport(report, requested)``
picks ``nvlink``, ``p2p`` or ``alltoall`` from it (``Buffer(group, transport="auto")`` does both);
``python -m epcomm doctor`` prints it all with measured bandwidth and a self-test."""

from .choice import CHOICES, PREFERENCE, Failure, choose_transport, transport_failures
from .collect import collect_local_facts
from .probe import clear_cache, probe
from .report import (Capability, LinkInfo, LocalFacts, NvLinkFacts, PairReport, PeerFacts, RankInfo, TopologyReport,
                     build_report, normalize_pci_bus_id)

__all__ = ["probe", "clear_cache", "choose_transport", "transport_failures", "Failure", "CHOICES", "PREFERENCE",
           "TopologyReport", "RankInfo", "PairReport", "LinkInfo", "Capability", "LocalFacts", "PeerFacts",
           "NvLinkFacts", "build_report", "collect_local_facts", "normalize_pci_bus_id"]
