"""``python -m epcomm doctor``: which transport works on this machine, and why.

Spawns one process per visible GPU (or ``--world-size N`` CPU processes over gloo when there are none), or joins
a torchrun job. Every rank probes the topology; the chosen transport runs a short correctness self-test
(normal and low-latency dispatch/combine against the reference); on GPUs each P2P pair's put bandwidth is
measured (a copy engine ``copy_`` into the peer's buffer mapped through torch symmetric memory, timed with CUDA
events, both directions, and checked to arrive). Prints the report as tables with NCCL hints; exits 0 when
the chosen transport passed its self-test.

    python -m epcomm doctor                        # one process per GPU (CPU: 2 processes)
    python -m epcomm doctor --world-size 4 --device cpu
    torchrun --nproc-per-node 8 -m epcomm doctor
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .. import env
from ..bench.report import format_table
from ..errors import TransportUnavailableError
from .choice import PREFERENCE, choose_transport, transport_failures
from .domains import find_domains, host_ids_from_report
from .probe import probe
from .report import TopologyReport

SLOW_P2P_GBPS = 2.0  # a P2P put slower than this is broken or disabled somewhere (ACS, IOMMU, VM)


def selftest_cases(world_size: int) -> list:
    """A couple of small normal and low-latency cases (every dtype path the transports special-case)."""
    from ..testing.checks import LowLatencyCase, NormalCase

    experts = 4 * world_size
    return [NormalCase(num_tokens=48, hidden=256, num_experts=experts, topk=2, seed=1),
            NormalCase(num_tokens=[40 + 8 * r for r in range(world_size)], hidden=256, num_experts=experts,
                       topk=3, dtype="fp8", seed=2),
            LowLatencyCase(num_tokens=6, max_tokens=8, hidden=256, num_experts=experts, topk=2, seed=3)]


# ---------------------------------------------------------------------------------------------- bandwidth
def _timed_put(handle, src: torch.Tensor, peer: int, iters: int) -> float:
    """GB/s of ``iters`` copies of ``src`` into ``peer``'s symmetric buffer (after one warm-up copy)."""
    dst = handle.get_buffer(peer, tuple(src.shape), src.dtype)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return src.numel() * src.element_size() * iters / (start.elapsed_time(end) * 1e-3) / 1e9


def measure_put_bandwidth(group, device: torch.device, report: TopologyReport, nbytes: int,
                          iters: int = 5) -> dict:
    """Put bandwidth of every same-host P2P pair, both directions, one pair and direction at a time.

    Collective over ``group``. Returns ``{"a->b": {"gbps": float | None, "arrived": bool | None, "note": str}}``
    (empty when no pair has P2P or there is no symmetric memory); the control flow depends only on the agreed
    report, so every rank takes the same path."""
    pairs = [p for p in report.pairs if p.p2p.ok and p.link.kind != "same-gpu"]
    if not pairs or not report.symmetric_memory.ok:
        return {}
    import torch.distributed._symmetric_memory as symm_mem

    rank = dist.get_rank(group)
    try:
        buf, err = symm_mem.empty(nbytes, dtype=torch.uint8, device=device), ""
        buf.zero_()
    except Exception as exc:  # noqa: BLE001 - reported, and agreed on before the collective rendezvous
        buf, err = None, f"symm_mem.empty({nbytes}) failed on rank {rank}: {type(exc).__name__}: {exc}"
    errors: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, err, group=group)
    if any(errors):
        note = next(e for e in errors if e)
        return {f"{s}->{r}": {"gbps": None, "arrived": None, "note": note}
                for p in pairs for s, r in (p.ranks, p.ranks[::-1])}
    handle = symm_mem.rendezvous(buf, group)
    src = torch.full((nbytes,), rank + 1, dtype=torch.uint8, device=device)
    mine = {}
    for p in pairs:
        for sender, receiver in (p.ranks, p.ranks[::-1]):
            key = f"{sender}->{receiver}"
            dist.barrier(group)
            if rank == sender:
                try:
                    mine[key] = {"gbps": _timed_put(handle, src, receiver, iters), "note": ""}
                except Exception as exc:  # noqa: BLE001 - one broken pair must not stop the others
                    mine[key] = {"gbps": None, "note": f"put failed: {type(exc).__name__}: {exc}"}
            dist.barrier(group)
            if rank == receiver:
                sample = buf[:: max(1, nbytes // 4096)]
                mine[key + "/arrived"] = bool((sample == sender + 1).all())
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    merged: dict = {}
    for part in gathered:
        merged.update(part)
    del handle, buf
    out = {}
    for p in pairs:
        for sender, receiver in (p.ranks, p.ranks[::-1]):
            key = f"{sender}->{receiver}"
            entry = dict(merged.get(key, {"gbps": None, "note": "not measured"}))
            entry["arrived"] = merged.get(key + "/arrived")
            if entry["arrived"] is False:
                entry["note"] = (entry["note"] + "; " if entry["note"] else "") + "the data did not arrive"
            out[key] = entry
    return out


# ---------------------------------------------------------------------------------------------- worker
def _worker(ctx, requested: str, bandwidth_bytes: int) -> dict:
    """Runs on every rank: probe, choose, self-test, measure; returns what the table needs."""
    from ..testing.checks import run_cases
    from ..transports import TRANSPORTS

    report = probe(ctx.group, ctx.device)
    requested = env.transport_override() or requested
    chosen, reason, failures, memory, path = None, "", [], {}, {}
    try:
        domains = find_domains(host_ids_from_report(report), env.ranks_per_node(), "EPCOMM_RANKS_PER_NODE")
    except ValueError as exc:
        domains, reason = None, f"the ranks cannot be split into domains: {exc}"
    if domains is not None and domains.num_domains > 1:  # the Buffer picks each domain's transport itself
        chosen, buffer_transport = "hierarchical", requested
    elif domains is not None:
        try:
            chosen, reason = choose_transport(report, requested, available=tuple(TRANSPORTS))
        except TransportUnavailableError as exc:
            reason = str(exc)
        buffer_transport = chosen

    def keep(buf) -> None:
        memory.update(buf.memory_usage)
        path["reason"] = buf.runtime.describe() if chosen == "hierarchical" else reason

    if chosen is not None:
        try:
            failures = run_cases(ctx, selftest_cases(ctx.world_size), transport=buffer_transport,
                                 before_destroy=keep)
            reason = path.get("reason", reason)
        except Exception as exc:  # noqa: BLE001 - e.g. the transport's constructor; reported, exit code 1
            failures = [("Buffer", [f"raised {type(exc).__name__}: {exc}"])]
    all_failures: list = [None] * ctx.world_size
    dist.all_gather_object(all_failures, failures, group=ctx.group)
    bandwidth = (measure_put_bandwidth(ctx.group, ctx.device, report, bandwidth_bytes)
                 if ctx.is_cuda and bandwidth_bytes > 0 else {})
    from ..deep_ep import status as deep_ep_status

    return {"rank": ctx.rank, "report": report, "requested": requested, "chosen": chosen, "reason": reason,
            "domains": domains.describe() if domains is not None else "not found",
            "available": tuple(TRANSPORTS), "selftest": all_failures, "bandwidth": bandwidth,
            "bandwidth_bytes": bandwidth_bytes, "nccl": env.nccl_settings(), "memory": memory,
            "deep_ep": deep_ep_status()}


# ---------------------------------------------------------------------------------------------- formatting
def transport_rows(report: TopologyReport, available: Sequence[str]) -> list:
    """One row per transport: whether it runs here and why (pure)."""
    rows = []
    for name in PREFERENCE:
        failures = transport_failures(report, name)
        if failures:
            more = f" (+{len(failures) - 1} more)" if len(failures) > 1 else ""
            rows.append({"transport": name, "runs here": "no", "why": failures[0].describe() + more})
        elif name not in available:
            rows.append({"transport": name, "runs here": "hardware yes, not in this build",
                         "why": "the transport is not registered in epcomm.transports.TRANSPORTS yet"})
        else:
            rows.append({"transport": name, "runs here": "yes", "why": "every requirement is met"})
    return rows


def nccl_hints(report: TopologyReport, bandwidth: dict, settings: dict) -> list:
    """NCCL settings worth knowing on this machine (pure)."""
    hints = []
    if not report.is_cuda:
        return ["the group communicates on CPU over gloo: NCCL settings do not apply"]
    if report.multi_node:
        hints.append(f"the ranks span {report.num_hosts} hosts: epcomm uses alltoall (NCCL over the network); "
                     "check NCCL_SOCKET_IFNAME / NCCL_IB_HCA, and keep InfiniBand on (NCCL_IB_DISABLE unset)")
    local = [p for p in report.pairs if p.same_host and p.link.kind != "same-gpu"]
    no_p2p = [p for p in local if p.p2p.available is False]
    pcie = [p for p in local if p.link.kind == "pcie" and p.p2p.ok]
    far = [p for p in pcie if p.link.crosses_root_complex or p.link.pcie_path == "PHB"]
    broken = sorted({k.split("->")[0] + "-" + k.split("->")[1] for k, v in bandwidth.items()
                     if v.get("arrived") is False or (v.get("gbps") is not None and v["gbps"] < SLOW_P2P_GBPS)})
    if no_p2p:
        hints.append(f"P2P is unavailable between ranks {_labels(no_p2p)} ({no_p2p[0].p2p.reason}): NCCL staging "
                     "through host memory is expected; if NCCL hangs or fails while setting up P2P, set "
                     "NCCL_P2P_DISABLE=1 (and check ACS / IOMMU in the BIOS or hypervisor)")
    if broken:
        hints.append(f"P2P is reported between ranks {', '.join(broken)} but the put test failed or ran below "
                     f"{SLOW_P2P_GBPS} GB/s: P2P looks broken (ACS, IOMMU, VM); set NCCL_P2P_DISABLE=1 and use "
                     "transport='alltoall' until it is fixed")
    if far:
        hints.append(f"ranks {_labels(far)} reach each other over PCIe through "
                     f"{'/'.join(sorted({p.link.pcie_path for p in far}))}: NCCL's default P2P level stops short "
                     "of host bridges on many platforms; NCCL_P2P_LEVEL=SYS (or PHB) makes it use P2P there: "
                     "measure both with `python -m epcomm bench dispatch`")
    if pcie and not far:
        hints.append(f"ranks {_labels(pcie)} use PCIe P2P within one root complex: NCCL's defaults use it "
                     "(NCCL_P2P_LEVEL=PXB at most matters only if it was lowered)")
    if not report.multi_node and any(p.link.kind != "nvlink" for p in local):
        hints.append("one host: NCCL_IB_DISABLE=1 keeps NCCL from probing network adapters it does not need")
    if settings.get("NCCL_P2P_DISABLE", "0") not in ("0", "") and local and all(p.p2p.ok for p in local):
        hints.append("NCCL_P2P_DISABLE is set although P2P works between every pair: unset it")
    return hints


def _labels(pairs) -> str:
    shown = ", ".join(p.label for p in pairs[:6])
    return shown + (f" and {len(pairs) - 6} more" if len(pairs) > 6 else "")


def _flag(cap) -> str:
    return {True: "yes", False: "no", None: "?"}[cap.available]


def format_result(result: dict) -> str:
    """The doctor's text output for one rank's result (pure)."""
    report: TopologyReport = result["report"]
    v = report.versions
    out = [f"epcomm doctor: {report.world_size} rank(s) on {report.num_hosts} host(s) ({', '.join(report.hosts)}), "
           f"device {report.device_type}, backend {report.backend}",
           f"software: torch {v['torch']}, Triton {v['triton']}, NCCL {v['nccl']}",
           f"torch symmetric memory: {report.symmetric_memory.describe()}",
           f"NVSHMEM: {report.nvshmem.describe()}"]
    out += [f"note: {n}" for n in report.notes]
    out += ["", "Ranks", format_table([{"rank": r.rank, "host": r.hostname, "device": r.device, "name": r.device_name,
                                        "SMs": r.sm_count if r.sm_count is not None else "-",
                                        "PCI bus id": r.pci_bus_id or "-"} for r in report.ranks])]
    if report.pairs:
        bw = result.get("bandwidth", {})
        rows = []
        for p in report.pairs:
            a, b = p.ranks
            row = {"ranks": p.label, "link": p.link.describe(), "P2P": _flag(p.p2p), "atomics": _flag(p.atomics),
                   "NVLink": _flag(p.nvlink)}
            if bw:
                row["put GB/s a->b / b->a"] = " / ".join(_gbps(bw.get(k)) for k in (f"{a}->{b}", f"{b}->{a}"))
            rows.append(row)
        title = "Pairs" + (f" (put: {result['bandwidth_bytes'] / 2 ** 20:.0f} MiB copy_ into the peer's symmetric "
                           "buffer, CUDA events)" if bw else "")
        out += ["", title, format_table(rows)]
        why: dict = {}  # (what is missing, why) -> pairs, so that one cause is printed once
        for p in report.pairs:
            missing = {}
            for name, cap in (("P2P", p.p2p), ("atomics", p.atomics), ("NVLink", p.nvlink)):
                if not cap.ok:
                    missing.setdefault(cap.describe(), []).append(name)
            for text, names in missing.items():
                why.setdefault((", ".join(names), text), []).append(p.label)
        out += [f"  {', '.join(labels)}: {names}: {text}" for (names, text), labels in why.items()]
        notes = [f"  put {k}: {e['note']}" for k, e in bw.items() if e.get("note")]
        out += notes
    out += ["", "Transports", format_table(transport_rows(report, result["available"]))]
    out += ["", f"domains (nodes): {result.get('domains', 'not found')}"]
    chosen = result["chosen"]
    out += ["", f"chosen: {chosen} ({result['reason']})" if chosen else f"no transport: {result['reason']}"]
    failed = [(r, label, f) for r, fails in enumerate(result["selftest"]) for label, f in (fails or [])]
    if chosen:
        if failed:
            out.append(f"self-test with {chosen}: FAILED")
            out += [f"  rank {r}: {label}: {'; '.join(f)[:500]}" for r, label, f in failed[:8]]
        else:
            out.append(f"self-test with {chosen} ({len(selftest_cases(report.world_size))} cases, "
                       f"{report.world_size} ranks): passed")
        if result.get("memory"):
            out.append("memory the self-test's Buffer held on rank 0 (Buffer.memory_usage): "
                       + ", ".join(f"{k} {_mib(v)}" for k, v in result["memory"].items()))
    if result.get("deep_ep"):
        out.append(f"deep_ep: {result['deep_ep'][1]}")
    hints = nccl_hints(report, result.get("bandwidth", {}), result.get("nccl", {}))
    if result.get("nccl"):
        out += ["", "NCCL variables set: " + ", ".join(f"{k}={val}" for k, val in result["nccl"].items())]
    if hints:
        out += ["", "Hints"] + [f"  - {h}" for h in hints]
    return "\n".join(out)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2 ** 20:.1f} MiB" if nbytes >= 2 ** 20 else f"{nbytes} B"


def _gbps(entry: Optional[dict]) -> str:
    if not entry:
        return "-"
    if entry.get("gbps") is None:
        return "failed"
    return f"{entry['gbps']:.1f}" + ("" if entry.get("arrived") is not False else " (data lost)")


def passed(result: dict) -> bool:
    """True when a transport was chosen and its self-test passed on every rank."""
    return result["chosen"] is not None and not any(result["selftest"])


def to_json(result: dict) -> str:
    """The result as JSON (the report as nested dicts)."""
    return json.dumps({**result, "report": dataclasses.asdict(result["report"])}, indent=2, default=str)


# ---------------------------------------------------------------------------------------------- CLI
def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m epcomm doctor``; returns the exit code (0: the chosen transport passed)."""
    from ..testing import run

    parser = argparse.ArgumentParser(prog="python -m epcomm doctor",
                                     description="Which transport works on this machine, and why.",
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=None,
                        help="processes to spawn (default: one per visible GPU, else 2 CPU processes); "
                             "ignored under torchrun")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--transport", choices=("auto", "nvlink", "p2p", "alltoall"), default="auto",
                        help="the transport to check (EPCOMM_TRANSPORT overrides it)")
    parser.add_argument("--bandwidth-mib", type=int, default=64,
                        help="bytes per put in the bandwidth test, in MiB (0: skip it)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of tables")
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.world_size is not None and args.world_size < 1:
        parser.error(f"--world-size {args.world_size} must be >= 1")
    if args.bandwidth_mib < 0:
        parser.error(f"--bandwidth-mib {args.bandwidth_mib} must be >= 0")
    world_size = args.world_size
    if world_size is None and env.distributed_env() is None:
        gpus = torch.cuda.device_count() if args.device != "cpu" and torch.cuda.is_available() else 0
        world_size = gpus or 2
    results = run(_worker, world_size, args.transport, args.bandwidth_mib * 2 ** 20, device=args.device)
    result = results[0]
    if result["rank"] == 0:
        print(to_json(result) if args.json else format_result(result), flush=True)
    return 0 if passed(result) else 1
