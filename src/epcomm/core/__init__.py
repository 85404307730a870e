"""The vocabulary shared by the public ``Buffer`` (``epcomm.buffer``) and the transports
(``epcomm.transports``): tuning configuration, typed handles, pure layout and sizing functions, input
checks and the default device of a process group. It imports neither of them, so both depend on it and
the arrows point one way: ``buffer -> transports -> core``."""

from .config import Config, model_num_sms
from .device import default_device
from .handles import DispatchHandle, LowLatencyHandle
from .layout import (align_up, compute_dispatch_layout, get_low_latency_rdma_size_hint,
                     get_normal_buffer_size_hint)

__all__ = ["Config", "model_num_sms", "default_device", "DispatchHandle", "LowLatencyHandle", "align_up",
           "compute_dispatch_layout", "get_low_latency_rdma_size_hint", "get_normal_buffer_size_hint"]
