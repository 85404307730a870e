"""Input checks shared by every Buffer call. Every message starts with the calling function's name and
says how to fix the input."""

from __future__ import annotations

from typing import Optional

import torch

from .. import env
from ..fp8 import FP8_DTYPE
from .layout import count_bad_topk

PAYLOAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def split_x(fn: str, x, device: torch.device) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Accept ``x [N, H]`` (bf16/fp16/fp32) or ``(x_fp8 [N, H] e4m3, scales [N, S] float32|int32)``."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise TypeError(f"{fn}: x must be a tensor or a pair (x_e4m3 [N, H], scales [N, H/128]); got a "
                            f"{type(x).__name__} of {len(x)} items")
        data, scales = x
        if not isinstance(data, torch.Tensor) or data.dtype != FP8_DTYPE:
            raise TypeError(f"{fn}: the first item of an FP8 x must be a torch.float8_e4m3fn tensor; got "
                            f"{getattr(data, 'dtype', type(data).__name__)} (cast with "
                            f"epcomm.per_token_cast_to_fp8)")
        if not isinstance(scales, torch.Tensor) or scales.dtype not in (torch.float32, torch.int32):
            raise TypeError(f"{fn}: FP8 scales must be a float32 (or packed UE8M0 int32) tensor; got "
                            f"{getattr(scales, 'dtype', type(scales).__name__)}")
        if data.dim() != 2 or scales.dim() != 2 or scales.size(0) != data.size(0):
            raise ValueError(f"{fn}: FP8 scales must be [num_tokens, num_scales] with num_tokens = x.size(0); "
                             f"got x {tuple(data.shape)} and scales {tuple(scales.shape)}")
        _check_tensor(fn, "x", data, device)
        _check_tensor(fn, "scales", scales, device, need_contiguous=False)
        return data, scales
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor or an FP8 pair; got {type(x).__name__}")
    if x.dtype not in PAYLOAD_DTYPES:
        raise TypeError(f"{fn}: x must be bfloat16, float16 or float32 (or an FP8 pair); got {x.dtype}")
    _check_tensor(fn, "x", x, device)
    return x, None


def check_precast(fn: str, x: torch.Tensor, x_scales: torch.Tensor, use_fp8: bool) -> None:
    """A pre-cast low-latency input (``LowLatencyDispatchRequest.x_scales``): ``x [N, H]`` float8_e4m3fn with
    contiguous rows and ``x_scales [N, H / 128]`` float32, contiguous, on the same device, with ``use_fp8``."""
    if not use_fp8:
        raise ValueError(f"{fn}: pre-cast FP8 input (x_scales given) needs use_fp8=True")
    if x.dtype != FP8_DTYPE or x.dim() != 2 or x.size(1) % 128:
        raise TypeError(f"{fn}: pre-cast x must be a float8_e4m3fn [num_tokens, hidden] tensor with hidden a "
                        f"multiple of 128 (epcomm.fp8.per_token_cast_to_fp8); got {x.dtype} {tuple(x.shape)}")
    want = (x.size(0), x.size(1) // 128)
    if x_scales.dtype != torch.float32 or tuple(x_scales.shape) != want:
        raise TypeError(f"{fn}: pre-cast scales must be float32 {list(want)} (one per token and 128 channels, "
                        f"unpacked even for UE8M0); got {x_scales.dtype} {tuple(x_scales.shape)}")
    if not x.is_contiguous() or not x_scales.is_contiguous() or x_scales.device != x.device:
        raise ValueError(f"{fn}: pre-cast x and scales must be contiguous (row-major) and on one device; got x on "
                         f"{x.device} with strides {x.stride()}, scales on {x_scales.device} with strides "
                         f"{x_scales.stride()}")


def _check_tensor(fn: str, name: str, t: torch.Tensor, device: torch.device, need_contiguous: bool = True) -> None:
    if t.dim() != 2:
        raise ValueError(f"{fn}: {name} must be 2-D [num_tokens, ...]; got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{fn}: {name} is on {t.device} but this Buffer communicates on {device}; move it with "
                         f".to({str(device)!r})")
    if need_contiguous and t.size(0) > 0 and t.stride(1) != 1:
        raise ValueError(f"{fn}: {name} must have contiguous rows (stride(1) == 1); call .contiguous() first")


def check_topk(fn: str, topk_idx: torch.Tensor, num_experts: int, num_tokens: Optional[int],
               device: torch.device, topk_weights: Optional[torch.Tensor] = None,
               values_checked_later: bool = False) -> Optional[torch.Tensor]:
    """Check shape and dtype now; check the values now on the CPU (or with EPCOMM_VALIDATE=full), else
    return a device scalar counting bad entries for the caller to check at its next host sync, or nothing
    when ``values_checked_later`` (a kernel that reads the ids anyway checks them)."""
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{fn}: topk_idx must be an int64 (or int32) tensor [num_tokens, num_topk]; got "
                        f"{getattr(topk_idx, 'dtype', type(topk_idx).__name__)}")
    if topk_idx.dim() != 2:
        raise ValueError(f"{fn}: topk_idx must be 2-D [num_tokens, num_topk]; got shape {tuple(topk_idx.shape)}")
    if num_tokens is not None and topk_idx.size(0) != num_tokens:
        raise ValueError(f"{fn}: topk_idx has {topk_idx.size(0)} rows but x has {num_tokens} tokens; they must match")
    if topk_idx.device != device:
        raise ValueError(f"{fn}: topk_idx is on {topk_idx.device} but this Buffer communicates on {device}")
    if topk_weights is not None:
        if not isinstance(topk_weights, torch.Tensor):
            raise TypeError(f"{fn}: topk_weights must be a float32 tensor [num_tokens, num_topk] or None; got "
                            f"{type(topk_weights).__name__}")
        if topk_weights.dtype != torch.float32 or topk_weights.shape != topk_idx.shape:
            raise ValueError(f"{fn}: topk_weights must be float32 with the shape of topk_idx "
                             f"{tuple(topk_idx.shape)}; got {topk_weights.dtype} {tuple(topk_weights.shape)}")
        if topk_weights.device != device:
            raise ValueError(f"{fn}: topk_weights is on {topk_weights.device}, expected {device}")
    level = env.validate_level()
    if level == "off" or topk_idx.numel() == 0:
        return None
    if values_checked_later and topk_idx.device.type != "cpu" and level != "full":
        return None
    bad = count_bad_topk(topk_idx, num_experts)
    if topk_idx.device.type == "cpu" or level == "full" and not _capturing():
        raise_if_bad_topk(fn, int(bad), num_experts)
        return None
    return bad


def raise_if_bad_topk(fn: str, bad: int, num_experts: int) -> None:
    if bad:
        raise ValueError(f"{fn}: topk_idx has {bad} entries outside [-1, {num_experts}); expert ids must be in "
                         f"[0, num_experts) and -1 marks an unused slot")


def raise_if_bad_routing(fn: str, bad_topk: int, bad_layout: int, num_experts: int) -> None:
    """The dispatch's host checks of what its kernels counted: expert ids outside ``[-1, num_experts)``, then a
    ``num_tokens_per_rank`` that disagrees with ``is_token_in_rank``."""
    raise_if_bad_topk(fn, bad_topk, num_experts)
    if bad_layout:
        raise ValueError(f"{fn}: num_tokens_per_rank does not match is_token_in_rank; pass both from the same "
                         f"get_dispatch_layout call")


def check_expert_stats(fn: str, stats, num_local_experts: int, device: torch.device) -> None:
    """A cumulative per-local-expert counter: a contiguous ``[num_local_experts]`` int32 tensor on ``device``."""
    if (not isinstance(stats, torch.Tensor) or stats.dtype != torch.int32 or stats.shape != (num_local_experts,)
            or not stats.is_contiguous() or stats.device != device):
        raise ValueError(f"{fn}: cumulative_local_expert_recv_stats must be a contiguous int32 "
                         f"[{num_local_experts}] tensor (one counter per local expert) on {device}; got "
                         f"{getattr(stats, 'dtype', type(stats).__name__)} {tuple(getattr(stats, 'shape', ()))} "
                         f"on {getattr(stats, 'device', None)}")


def check_num_experts(fn: str, num_experts: int, num_ranks: int) -> int:
    if not isinstance(num_experts, int) or num_experts <= 0 or num_experts % num_ranks:
        raise ValueError(f"{fn}: num_experts={num_experts!r} must be a positive multiple of the group size "
                         f"{num_ranks} (every rank holds the same number of experts)")
    return num_experts // num_ranks


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
