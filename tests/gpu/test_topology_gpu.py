"""Topology probe and ``epcomm doctor`` on GPUs (the 4xH200 NVSwitch box: NV18 between every pair)."""

from __future__ import annotations

import re

import pytest
import torch

from epcomm.testing import spawn

NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NGPU < 2, reason=f"needs >= 2 GPUs, found {NGPU}")]
# GPUs that come on NVLink (SXM) boards; on others only the agreement checks run
NVLINK_BOARDS = ("H200", "H100 80GB HBM3", "H100 SXM", "B200", "B300", "GB200", "A100-SXM")


def _probe_worker(ctx):
    from epcomm import Buffer
    from epcomm.topology import choose_transport, probe
    from epcomm.transports import TRANSPORTS

    report = probe(ctx.group)
    chosen = choose_transport(report, "auto", available=tuple(TRANSPORTS))
    buf = Buffer(ctx.group)
    name = buf.transport
    buf.destroy()
    return {"report": report, "chosen": chosen, "buffer": name, "registered": tuple(TRANSPORTS),
            "device": str(ctx.device)}


def test_probe_agrees_across_ranks_and_sees_nvlink():
    out = spawn(_probe_worker, NGPU, device="cuda")
    report = out[0]["report"]
    assert all(o["report"] == report for o in out), "ranks built different reports"
    assert report.device_type == "cuda" and report.world_size == NGPU and not report.multi_node
    assert [r.device for r in report.ranks] == [o["device"] for o in out]
    assert len({r.pci_bus_id for r in report.ranks}) == NGPU and all(r.pci_bus_id for r in report.ranks)
    assert report.symmetric_memory.ok, report.symmetric_memory
    assert all(p.p2p.ok for p in report.pairs), [(p.label, p.p2p) for p in report.pairs if not p.p2p.ok]
    if not all(any(b in r.device_name for b in NVLINK_BOARDS) for r in report.ranks):
        pytest.skip(f"agreement checked; NVLink expectations only on {NVLINK_BOARDS}, this is "
                    f"{report.ranks[0].device_name}")
    for p in report.pairs:
        assert p.nvlink.ok and p.atomics.ok and p.link.kind == "nvlink", p
        assert p.link.nvlink_count and p.link.nvlink_count >= 1, p.link
    registered = out[0]["registered"]
    want = next(t for t in ("nvlink", "p2p", "alltoall") if t in registered)
    for o in out:
        assert o["chosen"][0] == want and o["buffer"] == want, o["chosen"]
    if want != "nvlink":
        assert "not nvlink: it would run here but is not available in this build" in out[0]["chosen"][1]


def test_doctor_on_gpus(capsys):
    from epcomm.topology import doctor

    assert doctor.main(["--bandwidth-mib", "64"]) == 0
    text = capsys.readouterr().out
    assert "self-test with" in text and "passed" in text
    assert "put GB/s a->b / b->a" in text
    cells = re.findall(r"\| ([\d.]+) / ([\d.]+) \|$", text, re.M)
    assert len(cells) == NGPU * (NGPU - 1) // 2, text  # every pair measured both ways, data arrived
    assert all(float(x) > doctor.SLOW_P2P_GBPS for c in cells for x in c), cells
