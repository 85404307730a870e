"""``deep_ep.utils``: DeepEP's events (``EventHandle``, ``EventOverlap``) and ``check_nvlink_connections``.

DeepEP's ``EventHandle`` is a CUDA event recorded on the current stream when it is made; its
``EventOverlap`` wraps one (or nothing: a call without ``async_finish`` returns ``EventOverlap(None)``).
Here an ``EventHandle`` holds a ``torch.cuda.Event``, or nothing on the CPU, where every call has finished
when it returns and waiting is a no-op."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from ..buffer.events import EventOverlap as _EpcommEvent
from ..buffer.events import capture_event


class EventHandle:
    """A CUDA event recorded on ``torch.cuda.current_stream()`` when made (DeepEP's ``EventHandle()``); on a
    process without CUDA it holds no event and stands for work that has already finished."""

    __slots__ = ("cuda_event",)

    def __init__(self) -> None:
        self.cuda_event: Optional[torch.cuda.Event] = capture_event().event

    @classmethod
    def _wrap(cls, cuda_event: Optional[torch.cuda.Event]) -> "EventHandle":
        handle = cls.__new__(cls)
        handle.cuda_event = cuda_event
        return handle

    def current_stream_wait(self) -> None:
        """Make ``torch.cuda.current_stream()`` wait for the event (nothing to wait for on the CPU)."""
        if self.cuda_event is not None:
            torch.cuda.current_stream().wait_event(self.cuda_event)

    def __repr__(self) -> str:
        return f"EventHandle({'cuda event' if self.cuda_event is not None else 'finished'})"


class EventOverlap:
    """DeepEP's event wrapper.

    Attributes:
        event: the ``EventHandle`` of an asynchronous call (``async_finish=True``), else None.
        extra_tensors: tensors kept alive until the event is waited for (DeepEP's replacement for
            ``record_stream`` that works with CUDA graphs).

    ``current_stream_wait()`` makes the current stream wait for the event; ``with event:`` does so on exit, so the
    block overlaps the communication."""

    def __init__(self, event: Optional[EventHandle] = None,
                 extra_tensors: Optional[Tuple[torch.Tensor]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """The current stream waits for the event. Raises (as DeepEP asserts) for an empty event: a call made
        without ``async_finish`` returns one, and its work is already ordered before the current stream's."""
        if self.event is None:
            raise AssertionError("EventOverlap.current_stream_wait: this EventOverlap holds no event (the call ran "
                                 "without async_finish=True, so its work is already ordered on the current stream); "
                                 "check `event.event is not None` first, or pass async_finish=True")
        self.event.current_stream_wait()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.event.current_stream_wait()

    def __repr__(self) -> str:
        return f"EventOverlap({self.event!r})"


def to_epcomm_event(fn: str, previous_event) -> Optional[_EpcommEvent]:
    """A ``previous_event`` as epcomm's Buffer takes it: DeepEP's ``EventOverlap`` or ``EventHandle`` (V2 passes
    handles), epcomm's own ``EventOverlap``, or None."""
    if previous_event is None:
        return None
    if isinstance(previous_event, _EpcommEvent):
        return previous_event
    if isinstance(previous_event, EventOverlap):
        previous_event = previous_event.event
        if previous_event is None:
            return None
    if isinstance(previous_event, EventHandle):
        return _EpcommEvent(previous_event.cuda_event)
    raise TypeError(f"{fn}: previous_event must be an EventOverlap or EventHandle (from Buffer.capture() or an "
                    f"earlier call with async_finish=True); got {type(previous_event).__name__}")


def from_epcomm_event(event: _EpcommEvent, async_finish: bool) -> EventOverlap:
    """The ``EventOverlap`` a DeepEP call returns for epcomm's: an event (finished on the CPU) exactly when the call
    was asynchronous, as DeepEP returns one only then."""
    if not async_finish:
        return EventOverlap(None)
    return EventOverlap(EventHandle._wrap(event.event), event.extra_tensors)


def check_nvlink_connections(group) -> None:
    """DeepEP refuses PCIe GPUs without pairwise NVLink here. epcomm needs no NVLink (its ``p2p`` and ``alltoall``
    transports run without it, and ``python -m epcomm doctor`` reports the links), so there is nothing to
    refuse: this returns without checking."""
    return None


__all__ = ["EventHandle", "EventOverlap", "check_nvlink_connections"]
