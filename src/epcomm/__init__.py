"""epcomm: expert-parallel communication for Mixture-of-Experts in pure Python.

``epcomm.Buffer`` has the semantics of DeepEP's ``deep_ep.Buffer`` (intranode): dispatch layout, normal
dispatch/combine (BF16, FP8, FP32), low-latency dispatch/combine, events, cached handles."""

from .buffer import Buffer, Config, DispatchHandle, EventOverlap, LowLatencyHandle
from .errors import BufferTooSmallError, EpcommError, EpcommTimeoutError, TransportUnavailableError
from .fp8 import per_token_cast_back, per_token_cast_to_fp8

__version__ = "0.1.0"

__all__ = ["Buffer", "Config", "EventOverlap", "DispatchHandle", "LowLatencyHandle", "EpcommError",
           "EpcommTimeoutError", "TransportUnavailableError", "BufferTooSmallError", "per_token_cast_to_fp8",
           "per_token_cast_back", "__version__"]
