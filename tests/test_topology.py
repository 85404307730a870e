"""Topology probe, transport choice and ``epcomm doctor`` on CPU: the pure parts on synthetic facts, the
collector with fake CUDA/NVML, and the real thing on a 2-rank gloo group."""

from __future__ import annotations

import os

import pytest
import torch

from epcomm.errors import TransportUnavailableError
from epcomm.testing import spawn
from epcomm.topology import (Capability, LocalFacts, NvLinkFacts, PeerFacts, TopologyReport, build_report,
                             choose_transport, collect_local_facts, normalize_pci_bus_id, transport_failures)
from epcomm.topology import _nvml, doctor
from epcomm.topology.report import count_nvlinks

SWITCH_PCI = "0000:c0:00.0"
YES, NO = Capability.yes("test"), Capability.no("test says no")


def pci(i: int) -> str:
    return f"0000:{0x18 + i:02x}:00.0"


def facts(n: int, *, gpus_per_host: int | None = None, nvlink="switch", links: int = 18, nvml: bool = True,
          access=lambda a, b: True, atomics=lambda a, b: True, level=lambda a, b: 20, cc=(9, 0),
          device: str = "cuda") -> list:
    """Synthetic LocalFacts of ``n`` ranks, one GPU each, ``gpus_per_host`` per host (PCI ids repeat per host).

    nvlink: ``"switch"`` (every GPU has ``links`` links into an NVSwitch), a set of frozenset pairs of ranks
    joined by ``links`` direct links, or None (PCIe only)."""
    per_host = gpus_per_host or n
    out = []
    for r in range(n):
        host = f"node{r // per_host}"
        local = range((r // per_host) * per_host, (r // per_host + 1) * per_host)
        if device == "cpu":
            no = Capability.no("cpu rank")
            out.append(LocalFacts(r, host, host + "/boot", "cpu", "cpu", None, None, "", "the group is on cpu", (),
                                  None, "not probed", (), no, no, "2.13", "3.6", "none"))
            continue
        if nvlink == "switch":
            my_links = tuple(NvLinkFacts(k, SWITCH_PCI, True, 6) for k in range(links))
        elif nvlink:
            partners = [j for j in local if frozenset((r, j)) in nvlink]
            my_links = tuple(NvLinkFacts(k, pci(j % per_host), False, 6) for j in partners for k in range(links))
        else:
            my_links = ()
        peers = []
        for j in local:
            if j == r:
                continue
            joined = nvlink == "switch" or (nvlink and frozenset((r, j)) in nvlink)
            peers.append(PeerFacts(pci(j % per_host), j % per_host,
                                   YES if access(r, j) else Capability.no(f"no access {r}->{j}"),
                                   YES if atomics(r, j) else Capability.no(f"no atomics {r}->{j}"), 0,
                                   (YES if joined else Capability.no("NVML P2P status NVLink: NOT_SUPPORTED"))
                                   if nvml else Capability.unknown("NVML unavailable"),
                                   level(r, j) if nvml else None, "" if nvml else "NVML unavailable"))
        out.append(LocalFacts(r, host, host + "/boot", f"cuda:{r % per_host}", "NVIDIA H200", 132, cc,
                              pci(r % per_host), "", tuple(peers), my_links if nvml else None,
                              "NVML test" if nvml else "NVML unavailable: test",
                              tuple(pci(j % per_host) for j in local) if nvml else (), YES, YES,
                              "2.11", "3.6", "2.28.9"))
    return out


def report(*args, **kwargs) -> TopologyReport:
    return build_report(facts(*args, **kwargs), backend="cpu:gloo,cuda:nccl")


# ---------------------------------------------------------------------------------------------- choice
def test_all_nvlink_picks_nvlink():
    rep = report(4)
    name, reason = choose_transport(rep, "auto")
    assert name == "nvlink" and reason.startswith("auto: nvlink") and "NV18" in reason
    pair = rep.pair(3, 1)
    assert pair.ranks == (1, 3) and pair.link.kind == "nvlink" and pair.link.nvlink_count == 18
    assert pair.link.via_switch and pair.link.nominal_gbps == pytest.approx(478.1)
    assert pair.link.describe() == "NV18 (NVSwitch, 478 GB/s nominal)"
    assert not rep.multi_node and rep.num_hosts == 1 and rep.device_type == "cuda"
    for forced in ("nvlink", "p2p", "alltoall"):
        assert choose_transport(rep, forced)[0] == forced


def test_pcie_without_atomics_picks_p2p():
    rep = report(4, nvlink=None, atomics=lambda a, b: False, level=lambda a, b: 30)
    name, reason = choose_transport(rep, "auto")
    assert name == "p2p", reason
    assert "not nvlink: it needs native P2P atomics between ranks 0 and 1" in reason
    assert rep.pair(0, 1).link.describe() == "PCIe PHB" and rep.pair(0, 1).link.crosses_root_complex is False
    with pytest.raises(TransportUnavailableError, match=r"native P2P atomics between ranks 0 and 1: rank 0 -> "
                                                        r"rank 1: no atomics 0->1 \(and 5 more"):
        choose_transport(rep, "nvlink")


def test_pcie_with_atomics_but_no_nvlink_picks_p2p():
    rep = report(2, nvlink=None, level=lambda a, b: 50)
    assert choose_transport(rep)[0] == "p2p"
    assert rep.pair(0, 1).link.crosses_root_complex and rep.pair(0, 1).link.pcie_path == "SYS"
    with pytest.raises(TransportUnavailableError, match="NVLink between ranks 0 and 1"):
        choose_transport(rep, "nvlink")


def test_mixed_pairs_pick_p2p_and_name_the_pcie_pair():
    rep = report(4, nvlink={frozenset((0, 1)), frozenset((2, 3))}, links=4)
    assert rep.pair(0, 1).link.describe() == "NV4 (106 GB/s nominal)"
    assert rep.pair(0, 2).link.kind == "pcie"
    name, reason = choose_transport(rep)
    assert name == "p2p" and "NVLink between ranks 0 and 2" in reason
    failures = transport_failures(rep, "nvlink")
    assert [f.ranks for f in failures] == [(0, 2), (0, 3), (1, 2), (1, 3)]
    assert all(f.capability == "NVLink" for f in failures)


def test_one_pair_without_p2p_falls_back_to_alltoall():
    rep = report(4, access=lambda a, b: {a, b} != {1, 2})
    name, reason = choose_transport(rep)
    assert name == "alltoall"
    assert "P2P access between ranks 1 and 2" in reason
    with pytest.raises(TransportUnavailableError) as err:
        choose_transport(rep, "p2p")
    msg = str(err.value)
    assert msg.startswith("choose_transport: transport 'p2p' cannot run")
    assert "P2P access between ranks 1 and 2: rank 1 -> rank 2: no access 1->2" in msg


def test_cpu_group_picks_alltoall_and_forced_nvlink_names_cuda():
    rep = report(2, device="cpu")
    assert rep.device_type == "cpu" and rep.pair(0, 1).link.kind == "none"
    name, reason = choose_transport(rep)
    assert name == "alltoall" and "CUDA on rank 0" in reason
    with pytest.raises(TransportUnavailableError, match="needs CUDA on rank 0: rank 0 communicates on cpu"):
        choose_transport(rep, "nvlink")
    assert choose_transport(rep, "alltoall")[0] == "alltoall"


def test_multi_node_is_detected_and_picks_alltoall():
    rep = report(4, gpus_per_host=2)  # two hosts with the same PCI bus ids
    assert rep.multi_node and rep.num_hosts == 2 and rep.hosts == ("node0", "node1")
    assert rep.pair(0, 1).link.kind == "nvlink"
    assert rep.pair(1, 2).link.kind == "network" and not rep.pair(1, 2).same_host
    name, reason = choose_transport(rep)
    assert name == "alltoall"
    with pytest.raises(TransportUnavailableError, match="one host between ranks 0 and 2: ranks 0 and 2 are on "
                                                        "different hosts"):
        choose_transport(rep, "nvlink")


def test_hostname_alone_does_not_make_one_host():
    f = facts(2)
    f[1] = LocalFacts(**{**f[1].__dict__, "host_id": "node0/other-boot"})
    rep = build_report(f)
    assert rep.multi_node and rep.hosts == ("node0",) and any("boot id" in n for n in rep.notes)


def test_unknown_nvlink_is_not_chosen():
    rep = report(2, nvml=False)
    assert rep.pair(0, 1).nvlink.available is None and rep.pair(0, 1).link.kind == "unknown"
    name, reason = choose_transport(rep)
    assert name == "p2p" and "could not be determined (NVML unavailable: test)" in reason


def test_transport_missing_from_build():
    rep = report(2)
    name, reason = choose_transport(rep, "auto", available=("alltoall",))
    assert name == "alltoall"
    assert "not nvlink: it would run here but is not available in this build" in reason
    assert choose_transport(rep, "auto", available=("alltoall", "p2p"))[0] == "p2p"
    with pytest.raises(TransportUnavailableError, match="'nvlink' would run on this hardware but is not available"):
        choose_transport(rep, "nvlink", available=("alltoall",))


def test_requested_must_be_a_choice():
    with pytest.raises(ValueError, match="choose_transport: requested='fast'"):
        choose_transport(report(2), "fast")


def test_two_ranks_on_one_gpu_and_single_rank():
    f = facts(2)
    f[1] = LocalFacts(**{**f[1].__dict__, "pci_bus_id": pci(0), "device": "cuda:0"})
    rep = build_report(f)
    assert rep.pair(0, 1).link.kind == "same-gpu" and choose_transport(rep)[0] == "nvlink"
    # four ranks on two GPUs, two on each: the one-sided transports cannot map across them (CUDA IPC); auto says why
    f = facts(4)
    f = [LocalFacts(**{**x.__dict__, "pci_bus_id": pci(x.rank % 2), "device": f"cuda:{x.rank % 2}"}) for x in f]
    rep = build_report(f, backend="cpu:gloo,cuda:gloo")
    chosen, reason = choose_transport(rep)
    assert chosen == "alltoall" and "ranks 0 and 2 share a GPU while ranks 0 and 1 are on different GPUs" in reason
    with pytest.raises(TransportUnavailableError, match="all ranks on one GPU, or a GPU each between ranks 0 and 2"):
        choose_transport(rep, "nvlink")
    one = report(1)
    assert one.pairs == () and choose_transport(one) == ("nvlink", "auto: nvlink: a single CUDA rank")


# ---------------------------------------------------------------------------------------------- report pieces
def test_count_nvlinks():
    gpus = (pci(0), pci(1), pci(2))
    sw = [NvLinkFacts(k, "0000:99:00.0", None, None) for k in range(4)]  # type unknown, remote not a GPU
    direct = [NvLinkFacts(k, pci(1), None, 4) for k in range(2)]
    assert count_nvlinks(sw, sw[:3], pci(0), pci(1), gpus) == (3, True)
    assert count_nvlinks(direct, [NvLinkFacts(0, pci(0), False, 4), NvLinkFacts(1, pci(0), False, 4)],
                         pci(0), pci(1), gpus) == (2, False)
    assert count_nvlinks(direct, None, pci(0), pci(1), gpus) == (2, False)
    assert count_nvlinks(sw, None, pci(0), pci(1), gpus) == (None, None)
    assert count_nvlinks(None, None, pci(0), pci(1), gpus) == (None, None)
    assert count_nvlinks((), (), pci(0), pci(1), gpus) == (0, False)


def test_normalize_pci_bus_id():
    assert normalize_pci_bus_id("00000000:18:00.0") == "0000:18:00.0"
    assert normalize_pci_bus_id(b"0000:AF:00.0\0\0\0") == "0000:af:00.0"
    assert normalize_pci_bus_id("af:1.3") == "0000:af:01.3"
    assert normalize_pci_bus_id(None) == "" and normalize_pci_bus_id(" odd ") == "odd"


def test_dataclasses_validate():
    with pytest.raises(ValueError, match="Capability: a missing or unknown capability needs a reason"):
        Capability(False)
    with pytest.raises(ValueError, match="Capability: available="):
        Capability(1, "x")
    rep = report(3)
    with pytest.raises(ValueError, match="TopologyReport: pairs must hold every"):
        TopologyReport(**{**rep.__dict__, "pairs": rep.pairs[::-1]})
    with pytest.raises(ValueError, match="build_report: facts\\[0\\] is rank 1's"):
        build_report(facts(2)[::-1])
    with pytest.raises(ValueError, match="LocalFacts: device='gpu0'"):
        LocalFacts(**{**facts(1)[0].__dict__, "device": "gpu0"})
    five = report(5)
    assert all(five.pair(a, b).ranks == (a, b) for a in range(5) for b in range(a + 1, 5))


# ---------------------------------------------------------------------------------------------- collector
class FakeNvml:
    """pynvml's names over a scripted 4-GPU NVSwitch box (handles are indices)."""

    NVMLError = _nvml.NVMLError

    def __init__(self, n=4, links=18, nvlink=True, p2p_status=0):
        self.n, self.links, self.nvlink, self.p2p_status = n, links, nvlink, p2p_status

    def nvmlDeviceGetCount(self):
        return self.n

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return int(uuid.rsplit("-", 1)[1])

    def nvmlDeviceGetPciInfo(self, h):
        return type("Pci", (), {"busId": ("0000" + pci(h)).encode()})()  # NVML's 8-digit domain

    def nvmlDeviceGetNvLinkState(self, h, link):
        if not self.nvlink or link >= self.links:
            raise _nvml.NVMLError(_nvml.NVML_ERROR_NOT_SUPPORTED)
        return 1

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return type("Pci", (), {"busId": SWITCH_PCI})()

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h, link):
        return _nvml.NVML_NVLINK_DEVICE_TYPE_SWITCH

    def nvmlDeviceGetNvLinkVersion(self, h, link):
        raise _nvml.NVMLError(_nvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetTopologyCommonAncestor(self, h1, h2):
        return 50 if (h1 < 2) != (h2 < 2) else 20

    def nvmlDeviceGetP2PStatus(self, h1, h2, index):
        return self.p2p_status

    def nvmlShutdown(self):
        raise AssertionError("an injected NVML is not shut down by the collector")


class FakeCuda:
    def __init__(self, n=4, attrs_fail=False, no_pci=False):
        self.n, self.attrs_fail, self.no_pci = n, attrs_fail, no_pci

    def device_count(self):
        return self.n

    def properties(self, i):
        return {"name": "NVIDIA H200", "sm_count": 132, "capability": (9, 0),
                "pci_bus_id": "" if self.no_pci else pci(i), "uuid": f"abc-{i}"}

    def can_access_peer(self, i, j):
        return True

    def p2p_attribute(self, attr, i, j):
        if self.attrs_fail:
            raise RuntimeError("cudaDeviceGetP2PAttribute unavailable (test)")
        return {"access": 1, "atomics": 1, "performance_rank": 0}[attr]


def test_collect_local_facts_with_fake_cuda_and_nvml():
    nv = FakeNvml()
    got = [collect_local_facts(r, torch.device("cuda", r), cuda=FakeCuda(), nvml=(nv, "fake")) for r in range(4)]
    f = got[1]
    assert f.device == "cuda:1" and f.pci_bus_id == pci(1) and f.sm_count == 132
    assert len(f.nvlinks) == 18 and all(x.remote_is_switch and x.version is None for x in f.nvlinks)
    assert f.host_gpus == tuple(pci(i) for i in range(4))
    p = f.peer(pci(3))
    assert p.cuda_index == 3 and p.access.ok and p.atomics.ok and p.nvlink.ok and p.pcie_level == 50
    rep = build_report(got, "nccl")
    assert choose_transport(rep)[0] == "nvlink"
    assert rep.pair(0, 2).link.describe().startswith("NV18 (NVSwitch") and rep.pair(0, 2).link.pcie_path == "SYS"


def test_collect_falls_back_to_nvml_for_atomics_and_pci_ids():
    nv = FakeNvml(nvlink=False, p2p_status=5)  # PCIe box: NVML says NOT_SUPPORTED for NVLink and atomics
    got = [collect_local_facts(r, torch.device("cuda", r), cuda=FakeCuda(attrs_fail=True, no_pci=True),
                               nvml=(nv, "fake")) for r in range(2)]
    assert got[0].pci_bus_id == pci(0) and got[0].nvlinks == () and got[0].nvlink_reason == \
        "NVML: this GPU has no NVLink"
    assert got[0].peer(pci(1)).atomics.reason == "NVML P2P status atomics: NOT_SUPPORTED"
    rep = build_report(got)
    assert rep.pair(0, 1).link.kind == "pcie"
    assert choose_transport(rep)[0] == "p2p"


def test_collect_without_nvml_and_hidden_gpus():
    got = collect_local_facts(0, torch.device("cuda", 0), cuda=FakeCuda(n=2), nvml=(None, "NVML unavailable: x"))
    assert got.nvlinks is None and got.nvlink_reason == "NVML unavailable: x"
    assert got.peer(pci(1)).nvlink.available is None and got.peer(pci(1)).pcie_level is None
    hidden = collect_local_facts(0, torch.device("cuda", 0), cuda=FakeCuda(n=1), nvml=(FakeNvml(n=2), "fake"))
    assert hidden.peer(pci(1)).cuda_index is None and "not visible to CUDA" in hidden.peer(pci(1)).access.reason


def test_collect_on_cpu_touches_no_cuda():
    class Boom:
        def __getattr__(self, name):
            raise AssertionError(f"CUDA queried on a CPU rank: {name}")

    f = collect_local_facts(3, torch.device("cpu"), cuda=Boom(), nvml=Boom())
    assert f.device == "cpu" and not f.symmetric_memory.ok and f.rank == 3


def test_p2p_attribute_reports_why_it_is_unavailable():
    from epcomm.topology.collect import _P2PAttribute

    attr = _P2PAttribute()
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    if attr.source:  # a CUDA runtime library without a GPU: the query itself fails, with the CUDA error
        with pytest.raises(RuntimeError, match=r"cudaDeviceGetP2PAttribute\(3, 0, 1\) returned"):
            attr("atomics", 0, 1)
        return
    assert attr.reason.startswith("cudaDeviceGetP2PAttribute unavailable (cuda_bindings: ")
    assert "libcudart" in attr.reason and "libcuda" in attr.reason
    with pytest.raises(RuntimeError, match="cudaDeviceGetP2PAttribute unavailable"):
        attr("atomics", 0, 1)


def test_open_nvml_reports_why_it_failed():
    nv, why = _nvml.open_nvml()
    if nv is None:
        assert why.startswith("NVML unavailable: ")
    else:  # a machine with a driver
        nv.nvmlShutdown()


# ---------------------------------------------------------------------------------------------- doctor (pure)
def _result(rep, **extra):
    return {"rank": 0, "report": rep, "requested": "auto", "chosen": choose_transport(rep)[0],
            "reason": choose_transport(rep)[1], "available": ("alltoall", "nvlink", "p2p"),
            "selftest": [[] for _ in range(rep.world_size)], "bandwidth": {}, "bandwidth_bytes": 64 << 20,
            "nccl": {}, **extra}


def test_doctor_table_and_hints_nvlink():
    rep = report(2)
    bw = {"0->1": {"gbps": 371.9, "arrived": True, "note": ""}, "1->0": {"gbps": 370.2, "arrived": True, "note": ""}}
    memory = {"normal_symmetric": 3 << 20, "low_latency_symmetric": 0, "pinned_host": 272, "total": (3 << 20) + 272}
    text = doctor.format_result(_result(rep, bandwidth=bw, memory=memory))
    assert "| 0-1 | NV18 (NVSwitch, 478 GB/s nominal) | yes | yes | yes | 371.9 / 370.2 |" in text
    assert ("memory the self-test's Buffer held on rank 0 (Buffer.memory_usage): normal_symmetric 3.0 MiB, "
            "low_latency_symmetric 0 B, pinned_host 272 B, total 3.0 MiB") in text
    assert "chosen: nvlink" in text and "self-test with nvlink" in text and "passed" in text
    assert doctor.nccl_hints(rep, bw, {}) == []
    assert doctor.passed(_result(rep))
    assert not doctor.passed(_result(rep, selftest=[[], [("case", ["recv_x differs"])]]))
    assert '"device_type": "cuda"' in doctor.to_json(_result(rep))


def test_doctor_hints_pcie():
    far = report(2, nvlink=None, level=lambda a, b: 50)
    hints = " ".join(doctor.nccl_hints(far, {}, {}))
    assert "NCCL_P2P_LEVEL=SYS" in hints and "NCCL_IB_DISABLE=1" in hints
    broken = {"0->1": {"gbps": 0.3, "arrived": False, "note": "the data did not arrive"}}
    assert "NCCL_P2P_DISABLE=1" in " ".join(doctor.nccl_hints(far, broken, {}))
    no_p2p = report(2, nvlink=None, access=lambda a, b: False)
    text = doctor.format_result(_result(no_p2p))
    assert "NCCL_P2P_DISABLE=1" in text and "chosen: alltoall" in text
    assert "P2P is unavailable between ranks 0-1" in text
    assert "unset it" in " ".join(doctor.nccl_hints(far, {}, {"NCCL_P2P_DISABLE": "1"}))
    assert "NCCL_SOCKET_IFNAME" in " ".join(doctor.nccl_hints(report(4, gpus_per_host=2), {}, {}))


# ---------------------------------------------------------------------------------------------- real CPU group
def _probe_worker(ctx):
    from epcomm import Buffer
    from epcomm.topology import probe
    from epcomm.transports import create_transport

    first = probe(ctx.group)
    cached = probe(ctx.group) is first
    transport, reason = create_transport("auto", ctx.group, ctx.device, 901)
    auto = (transport.name, reason)
    os.environ["EPCOMM_TRANSPORT"] = "nvlink"
    try:
        Buffer(ctx.group)
        forced_error = ""
    except TransportUnavailableError as exc:
        forced_error = str(exc)
    os.environ["EPCOMM_TRANSPORT"] = "alltoall"
    buf = Buffer(ctx.group, transport="nvlink")  # the environment wins
    overridden = (buf.transport, create_transport("p2p", ctx.group, ctx.device, 902)[1])
    buf.destroy()
    del os.environ["EPCOMM_TRANSPORT"]
    return {"report": first, "cached": cached, "auto": auto, "forced_error": forced_error,
            "overridden": overridden, "cuda_initialized": torch.cuda.is_initialized()}


def test_probe_on_gloo_group():
    out = spawn(_probe_worker, 2, device="cpu")
    rep = out[0]["report"]
    assert out[1]["report"] == rep
    assert rep.world_size == 2 and rep.device_type == "cpu" and rep.num_hosts == 1 and not rep.multi_node
    assert rep.backend == "gloo" and rep.ranks[1].device == "cpu"
    pair = rep.pair(0, 1)
    assert pair.same_host and pair.link.kind == "none" and pair.p2p.reason == "rank 0 communicates on cpu"
    for o in out:
        assert o["cached"] and not o["cuda_initialized"]
        assert o["auto"][0] == "alltoall" and o["auto"][1].startswith("auto: alltoall: the portable all_to_all")
        assert o["forced_error"].startswith("Buffer (EPCOMM_TRANSPORT=nvlink): choose_transport: transport "
                                            "'nvlink' cannot run on this group: it needs CUDA on rank 0")
        assert o["overridden"] == ("alltoall", "forced by EPCOMM_TRANSPORT=alltoall")


def test_doctor_on_cpu(capsys):
    assert doctor.main(["--world-size", "2"]) == 0
    text = capsys.readouterr().out
    assert "chosen: alltoall" in text and "self-test with alltoall" in text and "passed" in text
    assert "memory the self-test's Buffer held on rank 0 (Buffer.memory_usage): normal_symmetric 0 B" in text
    from epcomm.deep_ep import status

    assert f"deep_ep: {status()[1]}" in text  # which `import deep_ep` the ranks would get


def test_doctor_forced_transport_that_cannot_run(capsys):
    assert doctor.main(["--world-size", "2", "--transport", "p2p", "--json"]) == 1
    text = capsys.readouterr().out
    assert '"chosen": null' in text
    assert "transport 'p2p' cannot run on this group: it needs CUDA on rank 0" in text
