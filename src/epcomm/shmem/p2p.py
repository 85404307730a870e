"""What the hardware allows between two GPUs: peer access and native peer atomics.

``p2p_atomics_supported(dev_a, dev_b)`` asks CUDA (``cudaDeviceGetP2PAttribute(NativeAtomicSupported)``)
through ``cuda.bindings`` when it is installed, else through the driver library with ctypes. Other modules
(transports, the doctor) call it to decide whether a remote ``atomic_add`` is allowed."""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import Optional

import torch

log = logging.getLogger(__name__)

# cudaDeviceP2PAttr / CUdevice_P2PAttribute (same values in the runtime and the driver API)
_ATTR_ACCESS_SUPPORTED = 2
_ATTR_NATIVE_ATOMIC_SUPPORTED = 3


def _query_cuda_bindings(attr: int, dev_a: int, dev_b: int) -> Optional[int]:
    try:
        try:
            from cuda.bindings import runtime as cudart  # cuda-bindings >= 12.6
        except ImportError:
            from cuda import cudart  # type: ignore[no-redef]  # older cuda-python
    except Exception:  # noqa: BLE001 - not installed or broken: try the next way
        return None
    names = {_ATTR_ACCESS_SUPPORTED: "cudaDevP2PAttrAccessSupported",
             _ATTR_NATIVE_ATOMIC_SUPPORTED: "cudaDevP2PAttrNativeAtomicSupported"}
    try:
        err, value = cudart.cudaDeviceGetP2PAttribute(getattr(cudart.cudaDeviceP2PAttr, names[attr]), dev_a, dev_b)
    except Exception as e:  # noqa: BLE001
        log.debug("p2p: cuda.bindings query failed: %s", e)
        return None
    if int(err) != 0:
        log.debug("p2p: cudaDeviceGetP2PAttribute(%s, %d, %d) returned error %s", names[attr], dev_a, dev_b, err)
        return None
    return int(value)


def _query_driver(attr: int, dev_a: int, dev_b: int) -> Optional[int]:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    try:
        if lib.cuInit(0) != 0:
            return None
        da, db, value = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        if lib.cuDeviceGet(ctypes.byref(da), dev_a) != 0 or lib.cuDeviceGet(ctypes.byref(db), dev_b) != 0:
            return None
        if lib.cuDeviceGetP2PAttribute(ctypes.byref(value), attr, da, db) != 0:
            return None
    except Exception as e:  # noqa: BLE001
        log.debug("p2p: driver query failed: %s", e)
        return None
    return int(value.value)


def _p2p_attribute(attr: int, dev_a: int, dev_b: int) -> Optional[int]:
    value = _query_cuda_bindings(attr, dev_a, dev_b)
    if value is None:
        value = _query_driver(attr, dev_a, dev_b)
    return value


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
