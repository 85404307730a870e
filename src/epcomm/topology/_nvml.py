"""NVML access for the topology probe: ``pynvml`` (nvidia-ml-py) when importable, else a minimal ctypes binding
of ``libnvidia-ml.so.1`` (it ships with the driver, so it is there wherever a GPU is) with pynvml's names for the
few calls the probe makes. Both raise an exception with an integer ``value`` (the nvmlReturn_t) on failure."""

from __future__ import annotations

import ctypes
import threading
from typing import Optional

NVML_SUCCESS = 0
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_FEATURE_ENABLED = 1
NVML_NVLINK_MAX_LINKS = 18
NVML_NVLINK_DEVICE_TYPE_SWITCH = 2
NVML_P2P_CAPS_INDEX_NVLINK = 2
NVML_P2P_CAPS_INDEX_ATOMICS = 3
NVML_P2P_STATUS = {0: "OK", 1: "CHIPSET_NOT_SUPPORTED", 2: "GPU_NOT_SUPPORTED", 3: "IOH_TOPOLOGY_NOT_SUPPORTED",
                   4: "DISABLED_BY_REGKEY", 5: "NOT_SUPPORTED", 6: "UNKNOWN"}


class NVMLError(Exception):
    """An NVML call failed; ``value`` is the nvmlReturn_t."""

    def __init__(self, value: int, message: str = "") -> None:
        super().__init__(message or f"NVML error {value}")
        self.value = value


class _PciInfo(ctypes.Structure):
    # nvmlPciInfo_t (nvml.h, the v3 PCI info / v2 remote PCI info calls)
    _fields_ = [("busIdLegacy", ctypes.c_char * 16), ("domain", ctypes.c_uint), ("bus", ctypes.c_uint),
                ("device", ctypes.c_uint), ("pciDeviceId", ctypes.c_uint), ("pciSubSystemId", ctypes.c_uint),
                ("busId", ctypes.c_char * 32)]


class CtypesNvml:
    """The subset of pynvml's API the probe uses, over ``libnvidia-ml.so.1``."""

    NVMLError = NVMLError

    def __init__(self, path: str = "libnvidia-ml.so.1") -> None:
        self._lib = ctypes.CDLL(path)  # OSError when there is no driver
        self._lib.nvmlErrorString.restype = ctypes.c_char_p

    def _call(self, name: str, *args) -> None:
        fn = getattr(self._lib, name, None)
        if fn is None:
            raise NVMLError(13, f"{name} is not in this driver's NVML")  # NVML_ERROR_FUNCTION_NOT_FOUND
        ret = fn(*args)
        if ret != NVML_SUCCESS:
            text = self._lib.nvmlErrorString(ret)
            raise NVMLError(ret, f"{name}: {text.decode() if text else ret}")

    def _uint(self, name: str, *args) -> int:
        out = ctypes.c_uint()
        self._call(name, *args, ctypes.byref(out))
        return out.value

    def nvmlInit(self) -> None:
        self._call("nvmlInit_v2")

    def nvmlShutdown(self) -> None:
        self._call("nvmlShutdown")

    def nvmlDeviceGetCount(self) -> int:
        return self._uint("nvmlDeviceGetCount_v2")

    def nvmlDeviceGetHandleByIndex(self, index: int):
        handle = ctypes.c_void_p()
        self._call("nvmlDeviceGetHandleByIndex_v2", ctypes.c_uint(index), ctypes.byref(handle))
        return handle

    def nvmlDeviceGetHandleByUUID(self, uuid: str):
        handle = ctypes.c_void_p()
        self._call("nvmlDeviceGetHandleByUUID", ctypes.c_char_p(uuid.encode()), ctypes.byref(handle))
        return handle

    def nvmlDeviceGetPciInfo(self, handle) -> _PciInfo:
        info = _PciInfo()
        self._call("nvmlDeviceGetPciInfo_v3", handle, ctypes.byref(info))
        return info

    def nvmlDeviceGetNvLinkState(self, handle, link: int) -> int:
        return self._uint("nvmlDeviceGetNvLinkState", handle, ctypes.c_uint(link))

    def nvmlDeviceGetNvLinkVersion(self, handle, link: int) -> int:
        return self._uint("nvmlDeviceGetNvLinkVersion", handle, ctypes.c_uint(link))

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle, link: int) -> _PciInfo:
        info = _PciInfo()
        self._call("nvmlDeviceGetNvLinkRemotePciInfo_v2", handle, ctypes.c_uint(link), ctypes.byref(info))
        return info

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle, link: int) -> int:
        return self._uint("nvmlDeviceGetNvLinkRemoteDeviceType", handle, ctypes.c_uint(link))

    def nvmlDeviceGetTopologyCommonAncestor(self, handle1, handle2) -> int:
        return self._uint("nvmlDeviceGetTopologyCommonAncestor", handle1, handle2)

    def nvmlDeviceGetP2PStatus(self, handle1, handle2, index: int) -> int:
        return self._uint("nvmlDeviceGetP2PStatus", handle1, handle2, ctypes.c_uint(index))


_lock = threading.Lock()


def open_nvml() -> tuple:
    """``(nvml, source)`` with NVML initialised (call ``nvml.nvmlShutdown()`` when done), or ``(None, reason)``."""
    problems = []
    with _lock:
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            return pynvml, "pynvml"
        except ImportError:
            problems.append("pynvml (nvidia-ml-py) is not installed")
        except Exception as exc:  # noqa: BLE001 - pynvml raises its own NVMLError family
            problems.append(f"pynvml.nvmlInit failed: {exc}")
        try:
            nv = CtypesNvml()
            nv.nvmlInit()
            return nv, "libnvidia-ml.so.1 (ctypes)"
        except OSError as exc:
            problems.append(f"libnvidia-ml.so.1 could not be loaded ({exc})")
        except NVMLError as exc:
            problems.append(f"nvmlInit failed ({exc})")
    return None, "NVML unavailable: " + "; ".join(problems)


def error_code(exc: BaseException) -> Optional[int]:
    """The nvmlReturn_t of an NVML exception (pynvml's or ours), else None."""
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def is_nvml_error(exc: BaseException, nv) -> bool:
    """True for NVML failures (pynvml's NVMLError family or ours), so that other bugs still propagate."""
    kinds = tuple(k for k in (getattr(nv, "NVMLError", None), NVMLError) if isinstance(k, type))
    return isinstance(exc, kinds)
