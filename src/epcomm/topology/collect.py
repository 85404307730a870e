"""Collecting one rank's ``LocalFacts``: the hardware-dependent half of the probe.

CPU ranks touch no CUDA API at all. CUDA ranks ask:
- torch: device count, name, SMs, compute capability, PCI bus id, ``torch.cuda.can_device_access_peer``;
- the CUDA runtime (``cuda.bindings.runtime`` when importable, else ``libcudart`` through ctypes, else the
  driver's ``libcuda.so.1``): ``cudaDeviceGetP2PAttribute`` for access, native atomics and performance rank;
- NVML (``pynvml`` or ctypes, see ``_nvml``): active NVLinks and their remote ends, NVLink P2P status, the
  PCIe common ancestor of each GPU pair, and the PCI bus ids of every GPU of the host.

The CUDA and NVML entry points are parameters (``cuda=``, ``nvml=``) so the logic is tested with fakes.
"""

from __future__ import annotations

import importlib.metadata
import logging
import socket
from typing import Any, Optional

import torch

from .. import env
from . import _nvml
from .report import Capability, LocalFacts, NvLinkFacts, PeerFacts, normalize_pci_bus_id

log = logging.getLogger(__name__)



# ---------------------------------------------------------------------------------------------- host and software
def host_identity() -> tuple:
    """``(hostname, host_id)``; host_id adds the kernel boot id so equal hostnames on two machines differ."""
    hostname = socket.gethostname()
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return hostname, f"{hostname}/{boot}" if boot else hostname


def software_versions() -> dict:
    """torch, Triton and NCCL versions as strings, without initialising CUDA or importing Triton."""
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = "not installed"
    if torch.version.cuda is None:
        nccl = "none (CPU build of torch)"
    else:
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:  # noqa: BLE001 - builds without NCCL
            nccl = f"none ({type(exc).__name__}: {exc})"
    return {"torch": torch.__version__, "triton": triton_version, "nccl": nccl}


def symmetric_memory_capability(device: torch.device) -> tuple:
    """``(symmetric_memory, nvshmem)`` Capabilities for ``device``."""
    if device.type != "cuda":
        return (Capability.no(f"this rank communicates on {device.type}; torch symmetric memory needs CUDA"),
                Capability.no(f"this rank communicates on {device.type}; NVSHMEM needs CUDA"))
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except Exception as exc:  # noqa: BLE001 - any import failure makes it unavailable
        no = Capability.no(f"torch.distributed._symmetric_memory is not importable ({type(exc).__name__}: {exc})")
        return no, no
    symm = Capability.yes("torch.distributed._symmetric_memory importable, CUDA device")
    probe_fn = getattr(symm_mem, "is_nvshmem_available", None)
    if probe_fn is None:
        return symm, Capability.unknown(f"torch {torch.__version__} has no is_nvshmem_available()")
    try:
        ok = bool(probe_fn())
    except Exception as exc:  # noqa: BLE001
        return symm, Capability.unknown(f"is_nvshmem_available() raised {type(exc).__name__}: {exc}")
    return symm, (Capability.yes("torch reports NVSHMEM available") if ok else
                  Capability.no("torch.distributed._symmetric_memory.is_nvshmem_available() is False (no NVSHMEM "
                                "in this build, or the nvidia-nvshmem library is missing)"))


# ---------------------------------------------------------------------------------------------- CUDA
from ..shmem.p2p import P2PAttributeQuery as _P2PAttribute  # noqa: E402  (one implementation)





class TorchCuda:
    """The CUDA queries the probe makes, through torch and the CUDA runtime (see ``collect_local_facts``)."""

    def __init__(self) -> None:
        self._attr = None

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def properties(self, index: int) -> dict:
        """name, sm_count, capability, pci_bus_id ("" when torch does not expose it) and uuid."""
        p = torch.cuda.get_device_properties(index)
        pci = ""
        if getattr(p, "pci_bus_id", None) is not None:
            pci = normalize_pci_bus_id(f"{getattr(p, 'pci_domain_id', 0):x}:{p.pci_bus_id:x}:"
                                       f"{getattr(p, 'pci_device_id', 0):x}.0")
        uuid = str(getattr(p, "uuid", "") or "")
        return {"name": p.name, "sm_count": int(p.multi_processor_count), "capability": (p.major, p.minor),
                "pci_bus_id": pci, "uuid": uuid}

    def can_access_peer(self, index: int, peer: int) -> bool:
        return bool(torch.cuda.can_device_access_peer(index, peer))

    def p2p_attribute(self, attr: str, index: int, peer: int) -> int:
        """cudaDeviceGetP2PAttribute(attr) from ``index`` to ``peer``; raises RuntimeError with the reason."""
        if self._attr is None:
            self._attr = _P2PAttribute()
        return self._attr(attr, index, peer)


def _cuda_peer(cuda: Any, own: int, peer: int) -> tuple:
    """``(access, atomics, performance_rank)`` from CUDA, own GPU -> peer GPU (both CUDA indices here)."""
    try:
        torch_access = cuda.can_access_peer(own, peer)
    except Exception as exc:  # noqa: BLE001
        torch_access = None
        torch_reason = f"torch.cuda.can_device_access_peer({own}, {peer}) raised {type(exc).__name__}: {exc}"
    attrs, attr_reason = {}, ""
    for name in ("access", "atomics", "performance_rank"):
        try:
            attrs[name] = cuda.p2p_attribute(name, own, peer)
        except Exception as exc:  # noqa: BLE001 - the reason goes into the report
            attr_reason = str(exc)
            break
    if torch_access is False or attrs.get("access") == 0:
        access = Capability.no(f"CUDA reports no peer access from cuda:{own} to cuda:{peer} "
                               f"(cudaDeviceCanAccessPeer={int(bool(torch_access))}"
                               + (f", cudaDevP2PAttrAccessSupported={attrs['access']})" if "access" in attrs else ")"))
    elif torch_access is None:
        access = Capability.unknown(torch_reason)
    else:
        access = Capability.yes("cudaDeviceCanAccessPeer" + ("+AccessSupported" if "access" in attrs else ""))
    if "atomics" in attrs:
        atomics = (Capability.yes("cudaDevP2PAttrNativeAtomicSupported=1") if attrs["atomics"] else
                   Capability.no(f"cudaDevP2PAttrNativeAtomicSupported=0 from cuda:{own} to cuda:{peer}"))
    else:
        atomics = Capability.unknown(attr_reason)
    return access, atomics, attrs.get("performance_rank")


def _pci_by_uuid(nv: Any, uuid: str) -> str:
    """The PCI bus id NVML gives the GPU with torch's ``uuid``, or "" if it cannot say."""
    if not uuid:
        return ""
    uuid = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
    try:
        return normalize_pci_bus_id(nv.nvmlDeviceGetPciInfo(nv.nvmlDeviceGetHandleByUUID(uuid)).busId)
    except Exception as exc:  # noqa: BLE001
        if isinstance(exc, AttributeError) or _nvml.is_nvml_error(exc, nv):
            return ""
        raise


def _nvml_facts(nv: Any, own_pci: str) -> dict:
    """NVML's view of the host and of the GPU ``own_pci``: host GPUs, active NVLinks, per-peer NVLink/atomics
    P2P status and PCIe common ancestor. Every failure becomes a reason; nothing raises for NVML errors."""
    out = {"host_gpus": (), "links": None, "link_reason": "", "peers": {}}
    try:
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        pcis = [normalize_pci_bus_id(nv.nvmlDeviceGetPciInfo(h).busId) for h in handles]
    except Exception as exc:  # noqa: BLE001
        if not _nvml.is_nvml_error(exc, nv):
            raise
        out["link_reason"] = f"NVML device enumeration failed: {exc}"
        return out
    out["host_gpus"] = tuple(pcis)
    if own_pci not in pcis:
        out["link_reason"] = f"NVML does not list this rank's GPU {own_pci or '(PCI bus id unknown)'}"
        return out
    me = handles[pcis.index(own_pci)]
    out["links"], out["link_reason"] = _nvml_links(nv, me)
    for h, pci in zip(handles, pcis):
        if pci == own_pci:
            continue
        out["peers"][pci] = {
            "nvlink": _p2p_status(nv, me, h, _nvml.NVML_P2P_CAPS_INDEX_NVLINK, "NVLink"),
            "atomics": _p2p_status(nv, me, h, _nvml.NVML_P2P_CAPS_INDEX_ATOMICS, "atomics"),
        }
        try:
            out["peers"][pci]["level"] = int(nv.nvmlDeviceGetTopologyCommonAncestor(me, h))
            out["peers"][pci]["level_reason"] = ""
        except Exception as exc:  # noqa: BLE001
            if not _nvml.is_nvml_error(exc, nv):
                raise
            out["peers"][pci]["level"] = None
            out["peers"][pci]["level_reason"] = f"nvmlDeviceGetTopologyCommonAncestor failed: {exc}"
    return out


def _nvml_links(nv: Any, handle: Any) -> tuple:
    """``(active links, reason)``; ``((), reason)`` for a GPU without NVLink, ``(None, reason)`` on errors."""
    links, unsupported = [], 0
    max_links = int(getattr(nv, "NVML_NVLINK_MAX_LINKS", _nvml.NVML_NVLINK_MAX_LINKS))
    for link in range(max_links):
        try:
            state = nv.nvmlDeviceGetNvLinkState(handle, link)
        except Exception as exc:  # noqa: BLE001
            if not _nvml.is_nvml_error(exc, nv):
                raise
            if _nvml.error_code(exc) in (_nvml.NVML_ERROR_NOT_SUPPORTED, _nvml.NVML_ERROR_INVALID_ARGUMENT):
                unsupported += 1  # links past the GPU's last, or no NVLink at all
                continue
            return None, f"nvmlDeviceGetNvLinkState(link {link}) failed: {exc}"
        if state != _nvml.NVML_FEATURE_ENABLED:
            continue
        links.append(NvLinkFacts(link, _optional(nv, "nvmlDeviceGetNvLinkRemotePciInfo", handle, link, pci=True),
                                 _remote_is_switch(nv, handle, link),
                                 _optional(nv, "nvmlDeviceGetNvLinkVersion", handle, link)))
    if unsupported == max_links:
        return (), "NVML: this GPU has no NVLink"
    return tuple(links), f"NVML: {len(links)} active NVLinks"


def _optional(nv: Any, fn: str, handle: Any, link: int, pci: bool = False):
    try:
        value = getattr(nv, fn)(handle, link)
    except Exception as exc:  # noqa: BLE001
        if isinstance(exc, AttributeError) or _nvml.is_nvml_error(exc, nv):
            return "" if pci else None
        raise
    return normalize_pci_bus_id(value.busId) if pci else int(value)


def _remote_is_switch(nv: Any, handle: Any, link: int) -> Optional[bool]:
    kind = _optional(nv, "nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
    return None if kind is None or kind == 0xFF else kind == _nvml.NVML_NVLINK_DEVICE_TYPE_SWITCH


def _p2p_status(nv: Any, h1: Any, h2: Any, index: int, what: str) -> Capability:
    try:
        status = int(nv.nvmlDeviceGetP2PStatus(h1, h2, index))
    except Exception as exc:  # noqa: BLE001
        if not _nvml.is_nvml_error(exc, nv):
            raise
        return Capability.unknown(f"nvmlDeviceGetP2PStatus({what}) failed: {exc}")
    if status == 0:
        return Capability.yes(f"NVML P2P status {what} OK")
    return Capability.no(f"NVML P2P status {what}: {_nvml.NVML_P2P_STATUS.get(status, status)}")


def collect_local_facts(rank: int, device: torch.device, *, cuda: Any = None, nvml: Any = None) -> LocalFacts:
    """This rank's ``LocalFacts`` for ``device``.

    Arguments:
        rank: the rank in the group being probed.
        device: the device the group communicates on; ``cpu`` touches no CUDA API.
        cuda: the CUDA queries (default ``TorchCuda()``), for tests.
        nvml: ``(nvml_module, source_or_reason)`` with NVML initialised, or ``(None, reason)`` (default:
            ``_nvml.open_nvml()``, shut down again here), for tests.
    """
    device = torch.device(device)
    hostname, host_id = host_identity()
    versions = software_versions()
    common = dict(rank=rank, hostname=hostname, host_id=host_id, torch_version=versions["torch"],
                  triton_version=versions["triton"], nccl_version=versions["nccl"],
                  cuda_visible_devices=env.cuda_visible_devices())
    symm, nvshmem = symmetric_memory_capability(device)
    if device.type != "cuda":
        return LocalFacts(device="cpu", device_name="cpu", sm_count=None, compute_capability=None, pci_bus_id="",
                          cuda_reason=f"the group communicates on {device.type}", peers=(), nvlinks=None,
                          nvlink_reason="not probed: CPU rank", host_gpus=(), symmetric_memory=symm,
                          nvshmem=nvshmem, **common)
    cuda = cuda if cuda is not None else TorchCuda()
    own = device.index if device.index is not None else torch.cuda.current_device()
    count = cuda.device_count()
    props = [cuda.properties(i) for i in range(count)]
    opened = nvml is None
    nv, nv_source = _nvml.open_nvml() if opened else nvml
    try:
        if nv is not None:
            for p in props:  # PCI bus ids this torch does not expose: NVML by UUID
                p["pci_bus_id"] = p["pci_bus_id"] or _pci_by_uuid(nv, p["uuid"])
            nf = _nvml_facts(nv, props[own]["pci_bus_id"])
        else:
            nf = {"host_gpus": (), "links": None, "link_reason": nv_source, "peers": {}}
    finally:
        if opened and nv is not None:
            try:
                nv.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass
    log.debug("collect_local_facts: rank %d on cuda:%d (%s), NVML: %s", rank, own, props[own]["pci_bus_id"],
              nv_source)
    own_pci = props[own]["pci_bus_id"]
    peers = []
    seen = set()
    for j, p in enumerate(props):
        if j == own or not p["pci_bus_id"] or p["pci_bus_id"] == own_pci:
            continue
        access, atomics, perf = _cuda_peer(cuda, own, j)
        peers.append(_peer(p["pci_bus_id"], j, access, atomics, perf, nf))
        seen.add(p["pci_bus_id"])
    for pci in nf["host_gpus"]:  # GPUs of the host that CUDA does not show this process
        if pci != own_pci and pci not in seen:
            hidden = Capability.unknown(f"the GPU {pci} is not visible to CUDA in rank {rank}'s process "
                                        f"(CUDA_VISIBLE_DEVICES={env.cuda_visible_devices()!r})")
            peers.append(_peer(pci, None, hidden, hidden, None, nf))
    return LocalFacts(device=f"cuda:{own}", device_name=props[own]["name"], sm_count=props[own]["sm_count"],
                      compute_capability=tuple(props[own]["capability"]), pci_bus_id=own_pci, cuda_reason="",
                      peers=tuple(peers), nvlinks=nf["links"], nvlink_reason=nf["link_reason"],
                      host_gpus=tuple(nf["host_gpus"]), symmetric_memory=symm, nvshmem=nvshmem, **common)


def _peer(pci: str, index: Optional[int], access: Capability, atomics: Capability, perf: Optional[int],
          nf: dict) -> PeerFacts:
    n = nf["peers"].get(pci)
    if n is None:
        why = (nf["link_reason"] if nf["links"] is None else "") or "NVML does not list this GPU"
        return PeerFacts(pci, index, access, atomics, perf, Capability.unknown(why), None, why)
    if atomics.available is None and n["atomics"].available is not None:
        atomics = n["atomics"]  # CUDA could not say; NVML can
    return PeerFacts(pci, index, access, atomics, perf, n["nvlink"], n["level"], n["level_reason"])
