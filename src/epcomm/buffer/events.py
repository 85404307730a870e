"""Events and the communication stream: DeepEP's ``EventOverlap`` and the stream discipline of every call."""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch


class EventOverlap:
    """A CUDA event (or nothing, on the CPU) marking the end of an asynchronous epcomm call.

    ``event.current_stream_wait()`` makes the current stream wait for it; ``with event:`` does the same on
    exit, so code in the block overlaps the communication. ``extra_tensors`` are kept alive until then."""

    def __init__(self, event: Optional[torch.cuda.Event] = None, extra_tensors: Optional[tuple] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Make ``torch.cuda.current_stream()`` wait for the event (a no-op on the CPU)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.current_stream_wait()

    def __repr__(self) -> str:
        return f"EventOverlap({'cuda event' if self.event is not None else 'none'})"


def capture_event() -> EventOverlap:
    """An event recorded on the current CUDA stream (an empty ``EventOverlap`` without CUDA)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return EventOverlap(None)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream())
    return EventOverlap(event)


class StreamScope:
    """Runs one call on the communication stream with DeepEP's semantics.

    A call that asks for no overlap (no ``async_finish``, ``previous_event`` or ``allocate_on_comm_stream``)
    simply runs on the current stream. Otherwise, on entry the communication stream waits for
    ``previous_event`` (or for the current stream). Work inside
    runs on the communication stream. ``finish(outputs, inputs)`` then records an event and either returns
    it (``async_finish``) or makes the current stream wait for it. Tensors that cross streams are protected
    with ``record_stream``: outputs allocated on the communication stream are marked as used by the compute
    stream unless ``allocate_on_comm_stream`` asks that they stay owned by the communication stream."""

    def __init__(self, comm_stream: Optional[torch.cuda.Stream], previous_event: Optional[EventOverlap],
                 async_finish: bool, allocate_on_comm_stream: bool) -> None:
        # a call that asks for no overlap runs on the current stream: the same ordering as fork + join,
        # without the stream waits, events and record_stream calls (host time on every call)
        wants_comm_stream = async_finish or allocate_on_comm_stream or (
            previous_event is not None and previous_event.event is not None)
        self.comm_stream = comm_stream if wants_comm_stream else None
        self.previous_event = previous_event
        self.async_finish = async_finish
        self.allocate_on_comm_stream = allocate_on_comm_stream
        self.compute_stream = torch.cuda.current_stream() if comm_stream is not None else None
        self._ctx = None

    def __enter__(self) -> "StreamScope":
        if self.comm_stream is None:
            return self
        if self.previous_event is not None and self.previous_event.event is not None:
            self.comm_stream.wait_event(self.previous_event.event)
        else:
            self.comm_stream.wait_stream(self.compute_stream)
        self._ctx = torch.cuda.stream(self.comm_stream)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
            self._ctx = None

    def finish(self, outputs: Iterable[Any] = (), inputs: Iterable[Any] = ()) -> EventOverlap:
        """Call after leaving the ``with`` block. Returns the event of the call."""
        if self.comm_stream is None:
            return EventOverlap(None)
        for t in _tensors(inputs):
            t.record_stream(self.comm_stream)
        if not self.allocate_on_comm_stream:
            for t in _tensors(outputs):
                t.record_stream(self.compute_stream)
        event = torch.cuda.Event()
        event.record(self.comm_stream)
        if self.async_finish:
            return EventOverlap(event, extra_tensors=tuple(_tensors(inputs)))
        self.compute_stream.wait_event(event)
        return EventOverlap(None)


def _tensors(items: Iterable[Any]):
    for item in items:
        if isinstance(item, torch.Tensor):
            if item.is_cuda:
                yield item
        elif isinstance(item, (tuple, list)):
            yield from _tensors(item)
