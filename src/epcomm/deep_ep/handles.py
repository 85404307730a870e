"""DeepEP's handles are tuples that its tests and some integrations index or unpack; epcomm's are typed frozen
dataclasses. These views give an epcomm handle DeepEP's tuple shape: ``len()``, ``handle[i]``, unpacking, and
every field of the epcomm handle as an attribute. The drop-in's calls take them back (or the epcomm handle)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core.handles import DispatchHandle, LowLatencyHandle


class _TupleView(Sequence):
    """Indexing by position (negative indices and slices too), unpacking and attribute access to ``handle``."""

    ITEMS: tuple = ()
    handle: Any

    def __len__(self) -> int:
        return len(self.ITEMS)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        if not isinstance(index, int):
            raise TypeError(f"{type(self).__name__}: indices must be integers or slices, not {type(index).__name__}")
        if not -len(self) <= index < len(self):
            raise IndexError(f"{type(self).__name__}: index {index} out of range for DeepEP's {len(self)}-tuple "
                             f"{self.ITEMS}")
        return self._item(index % len(self))

    def _item(self, i: int):
        raise NotImplementedError

    def __getattr__(self, name: str):
        if name == "handle":  # not set yet (unpickling): no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self.handle, name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.handle!r})"


@dataclass(frozen=True, eq=False, repr=False)
class DispatchHandleTuple(_TupleView):
    """A normal dispatch's handle in DeepEP's intranode shape ``(rank_prefix_matrix, channel_prefix_matrix,
    recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head)``.

    * ``[0]`` rank_prefix_matrix ``[R, R]`` int32: column ``rank`` is this rank's, entry ``[i, rank]`` the rows it
      received from ranks ``0..i`` (where each source rank's rows end in ``recv_x``). The other columns describe
      what the other ranks received, which epcomm's ranks never exchange: they are -1.
    * ``[3]`` recv_src_idx ``[M]`` int32, the source token of every received row; ``[4]`` is_token_in_rank
      ``[N, R]`` bool.
    * ``[1]``, ``[2]``, ``[5]`` describe DeepEP's kernel channels and send ring, which epcomm does not have:
      reading them raises NotImplementedError (so does unpacking the whole tuple).

    Attributes of the epcomm ``DispatchHandle`` (``num_recv_tokens``, ``recv_src_rank``, ...) read through."""

    handle: DispatchHandle
    rank: int  # this rank in the handle's group (the column of rank_prefix_matrix it can fill)
    ITEMS = ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx",
             "is_token_in_rank", "send_head")

    def _item(self, i: int):
        h = self.handle
        if i == 3:
            return h.recv_src_idx
        if i == 4:
            return h.is_token_in_rank
        if i == 0:
            return _rank_prefix_matrix(h, self.rank)
        raise NotImplementedError(f"DispatchHandleTuple[{i}]: DeepEP's {self.ITEMS[i]} describes its kernel "
                                  f"channels, which epcomm does not have; the handle offers rank_prefix_matrix "
                                  f"([0], this rank's column), recv_src_idx ([3]), is_token_in_rank ([4]) and the "
                                  f"epcomm DispatchHandle's fields as attributes (recv_src_rank, "
                                  f"num_recv_tokens_per_rank, ...)")


def _rank_prefix_matrix(h: DispatchHandle, rank: int) -> torch.Tensor:
    """``[R, R]`` int32, -1 but for column ``rank``: inclusive prefix sums of the rows received per source rank.
    Computed on the device from ``recv_src_rank`` (padding rows are -1), so no host value is needed."""
    src = h.recv_src_rank.long()
    r = h.num_ranks
    counts = torch.zeros(r + 1, dtype=torch.int32, device=src.device)
    counts.index_add_(0, torch.where(src >= 0, src, r), torch.ones_like(src, dtype=torch.int32))
    out = torch.full((r, r), -1, dtype=torch.int32, device=src.device)
    out[:, rank] = torch.cumsum(counts[:r], 0, dtype=torch.int32)
    return out


@dataclass(frozen=True, eq=False, repr=False)
class LowLatencyHandleTuple(_TupleView):
    """A low-latency dispatch's handle in DeepEP's shape ``(src_info, layout_range,
    num_max_dispatch_tokens_per_rank, hidden, num_experts)``.

    * ``[0]`` src_info ``[E_local, R * T]`` int32: the source token of every received row.
    * ``[1]`` layout_range ``[E_local, R]`` int64, DeepEP's packing ``(first row << 32) | count`` of each source
      rank's rows; made from the handle on each access, so read it once the receive completed (after the hook or
      the event), which is also when DeepEP's holds the values.
    * ``[2]``, ``[3]``, ``[4]``: T, hidden, E (ints).

    Attributes of the epcomm ``LowLatencyHandle`` read through."""

    handle: LowLatencyHandle
    ITEMS = ("src_info", "layout_range", "num_max_dispatch_tokens_per_rank", "hidden", "num_experts")

    def _item(self, i: int):
        h = self.handle
        if i == 1:
            pairs = h.layout_range.long()
            return (pairs[..., 0] << 32) | pairs[..., 1]
        return (h.src_info, None, h.num_max_dispatch_tokens_per_rank, h.hidden, h.num_experts)[i]


def unwrap(fn: str, handle, kind: type, required: bool = True):
    """The epcomm handle inside a drop-in handle (or an epcomm handle as given); None when allowed."""
    view = DispatchHandleTuple if kind is DispatchHandle else LowLatencyHandleTuple
    if isinstance(handle, view):
        return handle.handle
    if isinstance(handle, kind) or (handle is None and not required):
        return handle
    made_by = "dispatch" if kind is DispatchHandle else "low_latency_dispatch"
    raise TypeError(f"{fn}: handle must be the one Buffer.{made_by} returned; got {type(handle).__name__}")


__all__ = ["DispatchHandleTuple", "LowLatencyHandleTuple", "unwrap"]
