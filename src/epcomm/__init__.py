"""epcomm: expert-parallel communication for Mixture-of-Experts in pure Python.

``epcomm.Buffer`` has the semantics of DeepEP's ``deep_ep.Buffer`` (intranode): dispatch layout, normal
dispatch/combine (BF16, FP8, FP32), low-latency dispatch/combine, events, cached handles."""

from .errors import BufferTooSmallError, EpcommError, EpcommTimeoutError, TransportUnavailableError

__version__ = "0.1.0"

# imported on first use (PEP 562), so that importing a submodule (the test launcher's workers) loads neither Triton
# nor the kernels before the process has set its environment: Triton reads TRITON_INTERPRET when it compiles them
_LAZY = {"Buffer": "buffer", "Config": "buffer", "DispatchHandle": "buffer", "EventOverlap": "buffer",
         "LowLatencyHandle": "buffer", "per_token_cast_back": "fp8", "per_token_cast_to_fp8": "fp8"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'epcomm' has no attribute {name!r}")

__all__ = ["Buffer", "Config", "EventOverlap", "DispatchHandle", "LowLatencyHandle", "EpcommError",
           "EpcommTimeoutError", "TransportUnavailableError", "BufferTooSmallError", "per_token_cast_to_fp8",
           "per_token_cast_back", "__version__"]
