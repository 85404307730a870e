"""``epcomm.deep_ep``: DeepEP's Python API (``deep_ep``) on epcomm, so that code written for DeepEP runs
unchanged where DeepEP cannot be built (no NVSHMEM, no NVLink, a PCIe workstation, CPU processes).

    import epcomm.deep_ep; epcomm.deep_ep.install()   # then `import deep_ep` gives this module

or, without touching the program: ``python -m epcomm deep-ep train.py ARGS`` (``torchrun ... -m epcomm deep-ep
train.py ARGS``). A DeepEP installation is never shadowed unless forced (``install(force=True)``,
``--force``); ``python -m epcomm doctor`` and ``python -m epcomm deep-ep --status`` say which ``deep_ep`` is
active.

Names: DeepEP V1's ``Buffer``, ``Config``, ``EventOverlap``, ``topk_idx_t`` and ``deep_ep.utils``
(``EventHandle``, ``EventOverlap``, ``check_nvlink_connections``) with V1's exact signatures, defaults and
return tuples; handles index and unpack like DeepEP's tuples. DeepEP V2's ``ElasticBuffer`` and ``EPHandle``
map its intranode dispatch/combine (normal and CUDA-graph / decode mode). What epcomm lacks raises
NotImplementedError naming the feature (see ``buffer`` and ``elastic``)."""

import torch

from ._install import install, status, uninstall
from .buffer import Buffer
from .config import Config
from .elastic import ElasticBuffer, EPHandle
from .handles import DispatchHandleTuple, LowLatencyHandleTuple
from .utils import EventHandle, EventOverlap

topk_idx_t = torch.int64  # DeepEP's default build (TOPK_IDX_BITS=64)

__all__ = ["Buffer", "Config", "EventOverlap", "EventHandle", "topk_idx_t", "ElasticBuffer", "EPHandle",
           "DispatchHandleTuple", "LowLatencyHandleTuple", "install", "uninstall", "status"]
