"""The public Buffer, its handles, events, config and the pure sizing functions."""

from .buffer import Buffer
from .config import Config
from .events import EventOverlap
from .handles import DispatchHandle, LowLatencyHandle
from .layout import compute_dispatch_layout, get_low_latency_rdma_size_hint, get_normal_buffer_size_hint

__all__ = ["Buffer", "Config", "EventOverlap", "DispatchHandle", "LowLatencyHandle", "compute_dispatch_layout",
           "get_low_latency_rdma_size_hint", "get_normal_buffer_size_hint"]
