"""Bounded host waits, and what a transport does when a rank never joins one of its collectives.

A collective over NCCL runs on a stream: the host only waits where it reads a result (a count, a timing). Every
such read of the portable and hierarchical transports goes through ``host_wait`` / ``host_list``: they poll the
work's event (``torch.cuda.Event.query``, ``Work.is_completed``: neither blocks) and raise ``WaitExpired`` once
``EPCOMM_TIMEOUT_S`` has passed since the collective was issued, instead of blocking until NCCL's watchdog ends
the process. A transport that owns the groups of the stuck collective then ends them (``abort_groups``: the
group is marked aborted before its communicators are, so NCCL's watchdog does not take the process down, and the
stuck kernels exit) after asking the other ranks where they are (``where_are``), and raises.

A host wait that epcomm does not bound is one inside a native call that waits for the device: loading a kernel's
module the first time it is launched waits until the device's queue drains, so a call whose earlier collective hangs
(a peer never joined) blocks there for good, holding the CUDA context's lock: no thread of the process can then
abort the groups (an abort's CUDA calls wait behind the load), and NCCL's watchdog ends the process. The transports
keep such loads out of their calls (every kernel variant a call launches is one its first call of that kind loaded:
``core.layout.token_alignment``); ``CallWatch`` (one thread per process) finds a call that blocks anyway: its thread's
Python frame has not moved for ``EPCOMM_TIMEOUT_S`` outside this module's bounded waits; the call's transport is then
told (``on_blocked``, from the watch's thread; it must make no CUDA call) and says in the log where the host is stuck
and which ranks never joined, before the watchdog ends the process.

Groups that epcomm makes for itself get a timeout of ``group_timeout`` (longer than ``EPCOMM_TIMEOUT_S`` over
NCCL, so that epcomm's own deadline comes first; exactly ``EPCOMM_TIMEOUT_S`` over gloo, whose collectives block
the host and raise at the group's timeout by themselves).
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import threading
import time
from typing import Any, Optional, Sequence

import torch

from .. import env
from ..errors import EpcommTimeoutError

log = logging.getLogger(__name__)

# host polling: spin on the event for this long (yielding the GIL between polls), then sleep between polls, growing
# to POLL_MAX_SLEEP_S. A host that runs ahead of its GPU waits for the work queued before the count read (a whole
# backward pass in training: milliseconds), and every microsecond the wait ends late the GPU idles, waiting for the
# launches behind it: so the spin covers such waits, and only a straggler's wait (tens of ms) sleeps, briefly
POLL_SPIN_S = 20e-3
POLL_MAX_SLEEP_S = 2e-4


class WaitExpired(EpcommTimeoutError):
    """A bounded host wait ran past its limit; ``what`` names what was awaited. A transport that owns the groups
    turns it into its own ``EpcommTimeoutError`` (naming the leg, the phase and the missing ranks)."""

    def __init__(self, message: str, what: str) -> None:
        super().__init__(message)
        self.what = what


def group_timeout(parent: Any, backend: Optional[str] = None) -> datetime.timedelta:
    """The timeout of a group epcomm makes out of ``parent``'s ranks (with ``backend``, or ``parent``'s when None):
    ``EPCOMM_TIMEOUT_S`` over gloo; ``backstop_s()`` plus a margin over NCCL, whose watchdog would end the process at
    that timeout (epcomm's deadline and its abort must come first)."""
    import torch.distributed as dist

    t = env.timeout_s()
    if "nccl" in (backend or str(dist.get_backend(parent))).lower():
        t = backstop_s() + 30.0 + 0.5 * t
    return datetime.timedelta(seconds=t)


def backstop_s() -> float:
    """The limit of host waits behind which a device timeout of epcomm's own kernels should fire first (a
    one-sided transport's count read): ``1.5 * EPCOMM_TIMEOUT_S + 10`` s."""
    return 1.5 * env.timeout_s() + 10.0


def done(work: Any) -> bool:
    """True when ``work`` (a ``torch.cuda.Event`` or a ``torch.distributed`` ``Work``) has completed; never
    blocks."""
    return work.is_completed() if hasattr(work, "is_completed") else work.query()


def host_wait(work: Any, fn: str, what: Any, started: Optional[float] = None,
              limit_s: Optional[float] = None) -> None:
    """Wait until ``work`` (``done``) has completed, at most ``limit_s`` (default ``EPCOMM_TIMEOUT_S``) after
    ``started`` (``time.monotonic()`` when it was issued; default now); then raise ``WaitExpired`` whose message
    starts with ``fn`` and names ``what`` (e.g. "rank 0: the count exchange with ranks [0, 2]"; a string, or a
    function that returns one, called only then)."""
    if done(work):
        return
    limit = env.timeout_s() if limit_s is None else limit_s
    now = time.monotonic()
    deadline = (now if started is None else started) + limit
    spin_until, nap = now + POLL_SPIN_S, 0.0
    while not done(work):
        now = time.monotonic()
        if now > deadline:
            what = what() if callable(what) else what
            raise WaitExpired(f"{fn}: {what} did not complete within {limit:g} s (EPCOMM_TIMEOUT_S="
                              f"{env.timeout_s():g}): a rank is stuck, died or did not make the same call", what)
        if now > spin_until:
            nap = min(POLL_MAX_SLEEP_S, max(5e-5, 2 * nap))
        time.sleep(nap)  # 0 while spinning: lets other threads (an autograd worker) run


def host_list(t: torch.Tensor, fn: str, what: Any, limit_s: Optional[float] = None) -> list:
    """``t.tolist()`` where the wait for the work ahead of it on the current stream is bounded (``host_wait``);
    on CPUs the plain ``tolist``."""
    if not t.is_cuda or torch.cuda.is_current_stream_capturing():
        return t.tolist()
    ready = torch.cuda.Event()
    ready.record()
    host_wait(ready, fn, what, limit_s=limit_s)
    return t.tolist()


def read_later(t: torch.Tensor, fn: str, what: Any, pinned: dict, array: bool = False):
    """Start copying ``t`` (a few counts) to the host, into a pinned block of ``pinned`` (kept there by dtype and size
    for the next calls); returns a function that waits for that copy alone, not for work enqueued after it, and
    returns ``t`` as a list (``array``: as a numpy array of its own; thousands of counts become one ~3x faster than
    a list). The wait is bounded (``host_wait``, from this call; ``what`` names it). On CPUs the values are read at
    the call."""
    if not t.is_cuda:
        values = t.numpy().copy() if array else t.tolist()
        return lambda: values
    key = (t.dtype, t.numel())
    host = pinned.get(key)
    if host is None:
        host = pinned[key] = torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)
    host.copy_(t.view(-1), non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    started = time.monotonic()

    def read() -> list:
        host_wait(copied, fn, what, started)
        return host.numpy().copy() if array else host.tolist()

    return read


def where_are(scope: str, rank: int, here: str, peers: Sequence[int], grace_s: float) -> Optional[dict]:
    """After a wait expired: write where this rank is stuck (``here``) under ``scope`` in the default store, then
    wait up to ``grace_s`` for ``peers`` to write theirs (a peer that joined the stuck collective times out too,
    at about the same time). Returns ``{peer: where it is stuck, or None (it wrote nothing: it never joined)}``, or
    None when the store did not answer in time (it runs on another thread: nothing here can block longer than
    ``grace_s + 2`` s). Costs nothing until a wait expires."""
    import torch.distributed as dist

    found: dict = {}

    def ask() -> None:
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(f"{scope}/{rank}", here)
            end, seen = time.monotonic() + grace_s, {}
            while True:
                for p in peers:
                    if p not in seen and store.check([f"{scope}/{p}"]):
                        seen[p] = store.get(f"{scope}/{p}").decode()
                if len(seen) == len(peers) or time.monotonic() > end:
                    break
                time.sleep(0.05)
            found["seen"] = seen
        except Exception as exc:  # noqa: BLE001 - the store's host is gone (its rank ended): nothing to learn
            log.info("the fault report could not reach the store: %s: %s", type(exc).__name__, exc)

    asker = threading.Thread(target=ask, daemon=True, name="epcomm-fault-report")
    asker.start()
    asker.join(grace_s + 2.0)
    if "seen" not in found:
        return None
    return {p: found["seen"].get(p) for p in peers}


def describe_peers(where: Optional[dict]) -> str:
    """``where_are``'s answer in words."""
    if where is None:
        return "which rank is missing could not be found (the store did not answer)"
    missing = [p for p, w in where.items() if w is None]
    parts = []
    if missing:
        parts.append(f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} never joined it "
                     f"(stalled, dead, or making another call)")
    parts += [f"rank {p} is stuck in {w}" for p, w in where.items() if w is not None]
    return "; ".join(parts) if parts else "no other rank takes part"


def abort_groups(groups: Sequence[Any]) -> None:
    """Abort ``groups`` (``torch.distributed``'s ``_abort_process_group``: the group is marked aborted, then its
    communicators are, so the stuck kernels exit and NCCL's watchdog does not end the process). The groups are
    aborted at once, one thread each: aborting a communicator may wait for the whole device (it frees memory),
    and so for a kernel of another group's collective that is stuck too; one by one, the first abort would wait
    for that kernel until the group's timeout (NCCL's "group abort" problem: every abort must have started before
    any can finish). Failures are logged: the caller raises anyway."""
    import torch.distributed as dist

    def abort(g) -> None:
        try:
            dist.distributed_c10d._abort_process_group(g)
        except Exception as exc:  # noqa: BLE001 - already aborted, or a backend without abort
            log.warning("aborting a process group failed: %s: %s", type(exc).__name__, exc)

    threads = [threading.Thread(target=abort, args=(g,), name="epcomm-abort", daemon=True) for g in groups]
    for t in threads:
        t.start()
    limit = time.monotonic() + backstop_s()
    for t in threads:
        t.join(max(0.0, limit - time.monotonic()))
        if t.is_alive():
            log.warning("aborting a process group did not finish within %.0f s", backstop_s())


class CallWatch:
    """Watches the calls in progress (``begin`` / ``end``) from one daemon thread, started with the first call: a call
    whose thread has been in the same Python frame and line for more than ``EPCOMM_TIMEOUT_S`` (a native call that
    blocks, as a module load behind a hung collective does), outside this module's bounded waits (``host_wait``,
    ``where_are``, ``abort_groups``: they end by themselves), is reported once to its ``on_blocked(seconds, where)``
    (``where``: the frame, ``file:line in function``), from the watch's thread. Costs a call two dictionary operations;
    the thread looks every ``period_s``."""

    def __init__(self, period_s: float = 0.25) -> None:
        self.period_s = period_s
        self._calls: dict = {}
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    def begin(self, on_blocked) -> object:
        """A call starts on this thread: returns the key that ``end`` takes; ``on_blocked(seconds, where)``."""
        key = object()
        with self._lock:
            self._calls[key] = [threading.get_ident(), on_blocked, None, time.monotonic(), False]
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, daemon=True, name="epcomm-call-watch")
                self._thread.start()
        return key

    def end(self, key: object) -> None:
        with self._lock:
            self._calls.pop(key, None)

    def _run(self) -> None:
        while True:
            time.sleep(self.period_s)
            self.check()

    def check(self) -> None:
        """One look at the calls in progress (the watch's thread runs it every ``period_s``)."""
        frames = sys._current_frames()  # noqa: SLF001 - the one way to see where another thread is
        now, limit = time.monotonic(), env.timeout_s()
        fire = []
        with self._lock:
            for call in self._calls.values():
                frame = frames.get(call[0])
                spot = None if frame is None else (frame.f_code, frame.f_lineno)
                if spot != call[2] or _bounded(frame):
                    call[2], call[3] = spot, now
                elif not call[4] and now - call[3] > limit:
                    call[4] = True
                    fire.append((call[1], now - call[3], _where(frame)))
        for on_blocked, seconds, where in fire:
            try:
                on_blocked(seconds, where)
            except Exception:  # noqa: BLE001 - the watch must go on; the call raises on its own thread
                log.exception("reporting a blocked call failed")


_HERE = os.path.abspath(__file__)


def _bounded(frame) -> bool:
    """Whether ``frame`` or a caller of it runs one of this module's waits (bounded by themselves)."""
    while frame is not None:
        if os.path.abspath(frame.f_code.co_filename) == _HERE:
            return True
        frame = frame.f_back
    return False


_PACKAGE = os.path.dirname(os.path.dirname(_HERE))


def _where(frame) -> str:
    """``file:line in function`` of ``frame``, and of the innermost epcomm frame below it when that is another."""
    def spot(f) -> str:
        return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno} in {f.f_code.co_name}"

    own = frame
    while own is not None and not os.path.abspath(own.f_code.co_filename).startswith(_PACKAGE):
        own = own.f_back
    return spot(frame) if own is None or own is frame else f"{spot(frame)}, called from {spot(own)}"


# the process's watch of calls in progress (CUDA transports whose collectives can hang behind a native call)
WATCH = CallWatch()


__all__ = ["CallWatch", "WATCH", "WaitExpired", "group_timeout", "backstop_s", "done", "host_wait", "host_list",
           "where_are", "describe_peers", "abort_groups"]
