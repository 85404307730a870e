"""Events and the communication stream: DeepEP's ``EventOverlap`` and the stream discipline of every call."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch


class EventOverlap:
    """A CUDA event (or nothing, on the CPU) marking the end of an asynchronous epcomm call.

    ``event.current_stream_wait()`` makes the current stream wait for it; ``with event:`` does the same on
    exit, so code in the block overlaps the communication. ``extra_tensors`` are kept alive until then.
    ``check``: called with the waiting function's name before the wait; raises if the Buffer that made the
    event has seen a device error (``Buffer``'s "Errors" section)."""

    def __init__(self, event: Optional[torch.cuda.Event] = None, extra_tensors: Optional[tuple] = None,
                 check: Optional[Callable[[str], None]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors
        self._check = check

    def current_stream_wait(self) -> None:
        """Make ``torch.cuda.current_stream()`` wait for the event (a no-op on the CPU)."""
        if self._check is not None:
            self._check("EventOverlap.current_stream_wait")
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type, *exc: Any) -> None:
        if exc_type is None and self._check is not None:  # an exception already on its way is not replaced
            self._check("EventOverlap.__exit__")
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __repr__(self) -> str:
        return f"EventOverlap({'cuda event' if self.event is not None else 'none'})"


def capture_event() -> EventOverlap:
    """An event recorded on the current CUDA stream (an empty ``EventOverlap`` without CUDA)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return EventOverlap(None)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream())
    return EventOverlap(event)


class StreamOrder:
    """Keeps every call of one Buffer in one order on the device. Plain calls run on the current stream, calls
    with ``async_finish``/``previous_event``/``allocate_on_comm_stream`` on the communication stream, hooks on
    whatever stream is current; all of them use the same storage, epochs and counters. ``enter(stream)``, called
    before a call enqueues work on ``stream``, makes ``stream`` wait for the stream of the Buffer's previous call
    when they differ (what DeepEP gets by running every call on its communication stream).

    CUDA graphs: a wait between a stream that is capturing and one that is not cannot be enqueued (it would
    break the capture), so it is left out there: the first call captured after eager calls relies on the
    synchronisation that starts a capture (``torch.cuda.graph`` synchronises the device), an eager call after a
    capture waits for nothing the graph holds (replays are ordered by the stream they are replayed on)."""

    __slots__ = ("_stream",)

    def __init__(self) -> None:
        self._stream: Optional[torch.cuda.Stream] = None

    def enter(self, stream: torch.cuda.Stream, waited: Optional[torch.cuda.Stream] = None) -> None:
        """``waited``: a stream ``stream`` was just made to wait for (no second wait for it)."""
        last = self._stream
        if (last is not None and last.cuda_stream != stream.cuda_stream
                and (waited is None or last.cuda_stream != waited.cuda_stream)
                and _capturing(last) == _capturing(stream)):
            stream.wait_stream(last)
        self._stream = stream

    def enter_current(self, device_index: int) -> None:
        """``enter(torch.cuda.current_stream(device_index))``, without making a Stream object (host time on every
        call) when the current stream is the previous call's."""
        last = self._stream
        if last is not None and last.cuda_stream == torch._C._cuda_getCurrentRawStream(device_index):
            return
        self.enter(torch.cuda.current_stream(device_index))


def _capturing(stream: torch.cuda.Stream) -> bool:
    with torch.cuda.stream(stream):
        return torch.cuda.is_current_stream_capturing()


class StreamScope:
    """Runs one call on the communication stream with DeepEP's semantics.

    A call that asks for no overlap (no ``async_finish``, ``previous_event`` or ``allocate_on_comm_stream``)
    simply runs on the current stream. Otherwise, on entry the communication stream waits for
    ``previous_event`` (or for the current stream). Work inside
    runs on the communication stream. ``finish(outputs, inputs)`` then records an event and either returns
    it (``async_finish``) or makes the current stream wait for it. Tensors that cross streams are protected
    with ``record_stream``: outputs allocated on the communication stream are marked as used by the compute
    stream unless ``allocate_on_comm_stream`` asks that they stay owned by the communication stream.
    ``order`` (the Buffer's ``StreamOrder``) learns the stream the call runs on; ``check`` goes to the
    returned ``EventOverlap``."""

    def __init__(self, comm_stream: Optional[torch.cuda.Stream], previous_event: Optional[EventOverlap],
                 async_finish: bool, allocate_on_comm_stream: bool, order: Optional[StreamOrder] = None,
                 check: Optional[Callable[[str], None]] = None) -> None:
        # a call that asks for no overlap runs on the current stream: the same ordering as fork + join,
        # without the stream waits, events and record_stream calls (host time on every call)
        wants_comm_stream = async_finish or allocate_on_comm_stream or (
            previous_event is not None and previous_event.event is not None)
        self.comm_stream = comm_stream if wants_comm_stream else None
        self.previous_event = previous_event
        self.async_finish = async_finish
        self.allocate_on_comm_stream = allocate_on_comm_stream
        self.compute_stream = torch.cuda.current_stream() if self.comm_stream is not None else None
        self._device = comm_stream.device_index if comm_stream is not None else None
        self._order = order
        self._check = check
        self._ctx = None

    def __enter__(self) -> "StreamScope":
        if self.comm_stream is None:
            if self._order is not None and self._device is not None:
                self._order.enter_current(self._device)
            return self
        waited = None
        if self.previous_event is not None and self.previous_event.event is not None:
            self.comm_stream.wait_event(self.previous_event.event)
        else:
            self.comm_stream.wait_stream(self.compute_stream)
            waited = self.compute_stream
        if self._order is not None:
            self._order.enter(self.comm_stream, waited)
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
            return EventOverlap(None, check=self._check)
        for t in _tensors(inputs):
            t.record_stream(self.comm_stream)
        if not self.allocate_on_comm_stream:
            for t in _tensors(outputs):
                t.record_stream(self.compute_stream)
        event = torch.cuda.Event()
        event.record(self.comm_stream)
        if self.async_finish:
            return EventOverlap(event, extra_tensors=tuple(_tensors(inputs)), check=self._check)
        self.compute_stream.wait_event(event)
        return EventOverlap(None, check=self._check)


def _tensors(items: Iterable[Any]):
    for item in items:
        if isinstance(item, torch.Tensor):
            if item.is_cuda:
                yield item
        elif isinstance(item, (tuple, list)):
            yield from _tensors(item)
