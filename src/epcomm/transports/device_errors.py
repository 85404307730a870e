"""What a transport's kernels record on the device when a call fails, seen by the host without a synchronisation.

A kernel cannot raise: a wait that times out, rows that do not fit (``num_worst_tokens``, repeated expert ids in
low-latency mode) or invalid expert ids in a call without host synchronisation are recorded into *error words* on
the device, and the kernels carry on. ``DeviceErrors`` holds those words (the kernels' error records are views
into them), a host copy of them and the failures the host has seen:

* on GPUs the host copy is pinned memory, refreshed by a non-blocking device-to-host copy that ``refresh()``
  enqueues on the current stream after each call (stream-ordered behind the call's kernels, and captured into
  CUDA graphs with them, so a replay refreshes it too); on CPUs (gloo, the Triton interpreter) the words are host
  memory already and the copy is the words themselves;
* ``failure()`` reads the host copy with plain loads (no synchronisation, about a microsecond): the Buffer calls it
  at every call's entry and exit, in receive hooks and in event waits;
* a failure is sticky: once seen it stays until ``clear(kind)`` resets the words of that kind (a low-latency
  failure by ``Buffer.clean_low_latency_buffer``; a normal-mode one only by destroying the Buffer).

Each transport lays out its words and says which stretches (``spans``) are all zero while nothing failed, of which
kind (``NORMAL`` or ``LOW_LATENCY``), and how to describe them (``describe(words) -> [(kind, message)]``).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..errors import EpcommDeviceError

NORMAL = "normal"
LOW_LATENCY = "low_latency"
_RECOVERY = {
    NORMAL: "destroy the Buffer on every rank and create a new one",
    LOW_LATENCY: "call clean_low_latency_buffer() on every rank (or destroy the Buffer and create a new one)",
}


class DeviceErrors:
    """Error words of one transport on its device, their host copy and the sticky failures (module docstring).

    Arguments:
        words: 1-D int32 or int64 tensor on the transport's device; the kernels' error records are views of it.
        spans: ``(start, stop, kind)`` stretches of ``words`` that are all zero while no call failed.
        describe: ``describe(words as a list of ints) -> [(kind, message)]``, messages naming the rank, the peer
            and what was awaited.
    """

    def __init__(self, words: torch.Tensor, spans: Sequence[tuple], describe: Callable[[list], list]) -> None:
        if words.dim() != 1 or any(not 0 <= a < b <= words.numel() for a, b, _ in spans):
            raise ValueError(f"DeviceErrors: spans {list(spans)} must lie within the 1-D words ({tuple(words.shape)})")
        self.words = words
        self._spans = tuple(spans)
        self._describe = describe
        self._host = (torch.zeros(words.numel(), dtype=words.dtype, pin_memory=True) if words.is_cuda else words)
        size = words.element_size()
        raw = memoryview(self._host.numpy()).cast("B")  # read as bytes: the cheapest test for "all zero"
        self._views = tuple((raw[a * size:b * size], bytes((b - a) * size)) for a, b, _ in self._spans)
        self._failures: dict = {}  # kind -> [message], in the order seen
        self._mirror: Optional[bool] = None  # refresh by a kernel (decided at the first refresh)
        self.reported = False  # a failure was raised to the caller

    @classmethod
    def none(cls, device: torch.device) -> "DeviceErrors":
        """For a transport whose calls record nothing on the device."""
        return cls(torch.zeros(1, dtype=torch.int32, device=device), (), lambda words: [])

    @property
    def nbytes_pinned(self) -> int:
        """Bytes of pinned host memory the host copy takes (0 on CPUs)."""
        return 0 if self._host is self.words else self._host.numel() * self._host.element_size()

    def refresh(self) -> None:
        """Enqueue the copy of the words to the host on the current stream (nothing to do on CPUs): a one-program
        kernel that stores them into the pinned host copy (``kernels.shmem.mirror_kernel``; a device-to-host copy
        costs the stream 10-15 us, a third of a low-latency call), else a non-blocking copy."""
        refresh_all((self,))

    def _mirrored(self) -> bool:
        """Whether ``refresh`` has a host copy to refresh by a kernel (False: nothing to do or a plain copy)."""
        if self._host is self.words:
            return False
        if self._mirror is None:
            from ..kernels import triton_available

            self._mirror = triton_available()
        return self._mirror

    def failure(self) -> Optional[str]:
        """The failures seen so far as one message, or None. Reads the host copy: no synchronisation."""
        if not self._failures:
            for view, zero in self._views:
                if bytes(view) != zero:
                    break
            else:
                return None
            self._note(self._describe(self._host.tolist()))
            if not self._failures:
                return None
        return self._message()

    def read(self) -> list:
        """Read the words on the device now (synchronises) and return every failure's message (empty: none)."""
        if self._spans:
            self._note(self._describe(self.words.tolist()))
        return [m for msgs in self._failures.values() for m in msgs]

    def record(self, kind: str, message: str) -> None:
        """A failure the host found at a synchronisation (e.g. a timeout in an exact-mode exchange)."""
        self._note([(kind, message)])

    def error(self, fn: str) -> EpcommDeviceError:
        """The exception to raise for the failures seen, its message starting with ``fn``."""
        self.reported = True
        return EpcommDeviceError(f"{fn}: {self._message()}")

    def clear(self, kind: str) -> None:
        """Forget the failures of ``kind`` and zero its words (on the current stream); collective where the
        transport's state is (the caller resets that state too)."""
        for a, b, k in self._spans:
            if k == kind:
                self.words[a:b].zero_()
                if self._host is not self.words:
                    self._host[a:b].zero_()
        self._failures.pop(kind, None)
        if not self._failures:
            self.reported = False

    def _note(self, found) -> None:
        for kind, message in found:
            msgs = self._failures.setdefault(kind, [])
            if message not in msgs:
                msgs.append(message)

    def _message(self) -> str:
        msgs = "; ".join(m for ms in self._failures.values() for m in ms)
        how = _RECOVERY[NORMAL] if NORMAL in self._failures else _RECOVERY[LOW_LATENCY]
        return (f"a call failed on the device ({msgs}); its results and those of every call made after it are not "
                f"valid, and this Buffer raises until it is reset: {how}")


class CombinedErrors:
    """The ``DeviceErrors`` of several transports that serve one Buffer (the hierarchical path's legs) behind
    ``DeviceErrors``' interface: a failure of any part is the Buffer's; host-found failures are kept apart."""

    def __init__(self, parts: Sequence[DeviceErrors], device: torch.device) -> None:
        self._own = DeviceErrors.none(device)  # failures the host records (timeouts of host waits)
        self.parts = tuple(parts) + (self._own,)

    @property
    def reported(self) -> bool:
        return any(p.reported for p in self.parts)

    @property
    def nbytes_pinned(self) -> int:
        return sum(p.nbytes_pinned for p in self.parts)

    def refresh(self) -> None:
        refresh_all(self.parts)

    def failure(self) -> Optional[str]:
        return next((f for f in (p.failure() for p in self.parts) if f is not None), None)

    def read(self) -> list:
        return [m for p in self.parts for m in p.read()]

    def record(self, kind: str, message: str) -> None:
        self._own.record(kind, message)

    def error(self, fn: str) -> EpcommDeviceError:
        for p in self.parts:
            if p.failure() is not None:
                return p.error(fn)
        return self._own.error(fn)

    def clear(self, kind: str) -> None:
        for p in self.parts:
            p.clear(kind)


def refresh_all(parts: Sequence[DeviceErrors]) -> None:
    """``refresh`` of every part, two parts per kernel launch (a launch costs the host 10-40 us, once per call);
    parts whose words no kernel writes (no spans) are left alone."""
    kernel = []
    for p in parts:
        if not p._spans or p._host is p.words:
            continue
        if p._mirrored():
            kernel.append(p)
        else:
            p._host.copy_(p.words, non_blocking=True)
    if kernel:
        from ..kernels.shmem import launch_mirror

        for i in range(0, len(kernel), 2):
            pair = kernel[i:i + 2]
            launch_mirror(pair[0].words, pair[0]._host, *((pair[1].words, pair[1]._host) if len(pair) > 1 else ()))


__all__ = ["DeviceErrors", "CombinedErrors", "NORMAL", "LOW_LATENCY", "refresh_all"]
