"""The public Buffer and its events; re-exports the shared vocabulary of ``epcomm.core`` (config, handles, sizing
functions) that its calls take and return."""

from ..core.config import Config
from ..core.handles import DispatchHandle, LowLatencyHandle
from ..core.layout import compute_dispatch_layout, get_low_latency_rdma_size_hint, get_normal_buffer_size_hint
from .buffer import Buffer
from .events import EventOverlap

__all__ = ["Buffer", "Config", "EventOverlap", "DispatchHandle", "LowLatencyHandle", "compute_dispatch_layout",
           "get_low_latency_rdma_size_hint", "get_normal_buffer_size_hint"]
