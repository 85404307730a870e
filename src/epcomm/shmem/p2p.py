"""What the hardware allows between two GPUs: peer access and native peer atomics.

``p2p_atomics_supported(dev_a, dev_b)`` asks CUDA (``cudaDeviceGetP2PAttribute(NativeAtomicSupported)``)
through ``cuda.bindings`` when it is installed, else through the driver library with ctypes. Other modules
(transports, the doctor) call it to decide whether a remote ``atomic_add`` is allowed."""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import functools
import logging
from typing import Optional

import torch

log = logging.getLogger(__name__)

# cudaDeviceP2PAttr / CUdevice_P2PAttribute (same values in the runtime and the driver API)
_ATTR_ACCESS_SUPPORTED = 2
_ATTR_NATIVE_ATOMIC_SUPPORTED = 3


P2P_ATTRS = {"performance_rank": 1, "access": 2, "atomics": 3}  # cudaDeviceP2PAttr == CUdevice_P2PAttribute


class P2PAttributeQuery:
    """``cudaDeviceGetP2PAttribute`` through the first of: cuda.bindings.runtime, libcudart, libcuda."""

    def __init__(self) -> None:
        self.source, self.reason, self._fn = "", "", None
        problems = []
        for loader in (self._cuda_bindings, self._libcudart, self._libcuda):
            try:
                self._fn, self.source = loader()
                return
            except Exception as exc:  # noqa: BLE001 - try the next way
                problems.append(f"{loader.__name__.strip('_')}: {type(exc).__name__}: {exc}")
        self.reason = "cudaDeviceGetP2PAttribute unavailable (" + "; ".join(problems) + ")"

    @staticmethod
    def _cuda_bindings():
        try:
            from cuda.bindings import runtime as rt
        except ImportError:
            from cuda import cudart as rt  # cuda-python < 12.6

        names = {1: "cudaDevP2PAttrPerformanceRank", 2: "cudaDevP2PAttrAccessSupported",
                 3: "cudaDevP2PAttrNativeAtomicSupported"}

        def query(attr: int, src: int, dst: int) -> int:
            err, value = rt.cudaDeviceGetP2PAttribute(getattr(rt.cudaDeviceP2PAttr, names[attr]), src, dst)
            if err != rt.cudaError_t.cudaSuccess:
                raise RuntimeError(f"cudaDeviceGetP2PAttribute({attr}, {src}, {dst}) returned {err}")
            return int(value)

        return query, "cuda.bindings.runtime"

    @staticmethod
    def _libcudart():
        lib = _load_library(_cudart_candidates())

        def query(attr: int, src: int, dst: int) -> int:
            value = ctypes.c_int()
            err = lib.cudaDeviceGetP2PAttribute(ctypes.byref(value), ctypes.c_int(attr), ctypes.c_int(src),
                                                ctypes.c_int(dst))
            if err != 0:
                raise RuntimeError(f"cudaDeviceGetP2PAttribute({attr}, {src}, {dst}) returned cudaError {err}")
            return value.value

        return query, f"{lib._name} (ctypes)"

    @staticmethod
    def _libcuda():
        lib = ctypes.CDLL("libcuda.so.1")
        if lib.cuInit(0) != 0:
            raise RuntimeError("cuInit failed")

        def device(ordinal: int) -> ctypes.c_int:
            dev = ctypes.c_int()
            if lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(ordinal)) != 0:
                raise RuntimeError(f"cuDeviceGet({ordinal}) failed")
            return dev

        def query(attr: int, src: int, dst: int) -> int:
            value = ctypes.c_int()
            err = lib.cuDeviceGetP2PAttribute(ctypes.byref(value), ctypes.c_int(attr), device(src), device(dst))
            if err != 0:
                raise RuntimeError(f"cuDeviceGetP2PAttribute({attr}, {src}, {dst}) returned CUresult {err}")
            return value.value

        return query, "libcuda.so.1 (ctypes)"

    def __call__(self, attr: str, src: int, dst: int) -> int:
        if self._fn is None:
            raise RuntimeError(self.reason)
        return self._fn(P2P_ATTRS[attr], src, dst)


def _cudart_candidates() -> list:
    major = (torch.version.cuda or "").split(".")[0]
    names = ["libcudart.so"] + ([f"libcudart.so.{major}", f"libcudart.so.{major}.0"] if major else [])
    for base in sys.path:  # the pip wheels' copies (nvidia/cuda_runtime/lib, nvidia/cu13/lib)
        names += sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib", "libcudart.so*")))
    return names


def _load_library(names: list):
    problems = []
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError as exc:
            problems.append(str(exc))
    raise OSError("; ".join(problems[:3]) or "no candidate")


_QUERY: Optional["P2PAttributeQuery"] = None


def _p2p_attribute(attr: int, dev_a: int, dev_b: int) -> Optional[int]:
    """The attribute's value, or None when CUDA cannot tell (the reason is logged)."""
    global _QUERY
    if _QUERY is None:
        _QUERY = P2PAttributeQuery()
    name = {v: k for k, v in P2P_ATTRS.items()}[attr]
    try:
        return _QUERY(name, dev_a, dev_b)
    except RuntimeError as exc:
        log.debug("p2p: %s", exc)
        return None


def _check_devices(fn: str, dev_a: int, dev_b: int) -> bool:
    """False when there is no CUDA at all; raises for ordinals this process cannot see."""
    if not torch.cuda.is_available():
        return False
    n = torch.cuda.device_count()
    for d in (dev_a, dev_b):
        if not 0 <= int(d) < n:
            raise ValueError(f"{fn}: device {d} is not one of the {n} CUDA devices this process sees")
    return True


@functools.lru_cache(maxsize=None)
def p2p_atomics_supported(dev_a: int, dev_b: int) -> bool:
    """True when a kernel on CUDA device ``dev_a`` can do native atomics on memory of ``dev_b`` (NVLink; not
    PCIe). Same device: True. No CUDA, or the attribute cannot be read: False (atomics are then refused,
    never silently wrong)."""
    if not _check_devices("p2p_atomics_supported", dev_a, dev_b):
        return False
    if int(dev_a) == int(dev_b):
        return True
    value = _p2p_attribute(_ATTR_NATIVE_ATOMIC_SUPPORTED, int(dev_a), int(dev_b))
    if value is None:
        log.warning("p2p_atomics_supported: could not query cudaDevP2PAttrNativeAtomicSupported for %d -> %d "
                    "(neither cuda.bindings nor libcuda answered); assuming no native P2P atomics", dev_a, dev_b)
        return False
    return value == 1


@functools.lru_cache(maxsize=None)
def p2p_access_supported(dev_a: int, dev_b: int) -> bool:
    """True when CUDA device ``dev_a`` can load/store memory of ``dev_b`` directly (or they are the same)."""
    if not _check_devices("p2p_access_supported", dev_a, dev_b):
        return False
    if int(dev_a) == int(dev_b):
        return True
    return bool(torch.cuda.can_device_access_peer(int(dev_a), int(dev_b)))
