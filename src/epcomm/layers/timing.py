"""Per-phase timings of the MoE layer (router, layout, dispatch, experts, combine, ...).

Enabled by ``EPCOMM_DEBUG=1`` (then every rank logs each forward's phases) or explicitly with
``PhaseTimer.enabled = True`` (then only ``summary()`` reports). On CUDA each phase is bracketed by two
timing events on the current stream and resolved lazily (``flush`` synchronises); on CPUs
``time.perf_counter`` is used. Nothing is recorded while a CUDA graph is being captured. A phase issued
asynchronously (``async_combine``) measures its issue time; the wait is its own phase (``combine_wait``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict

import torch

log = logging.getLogger("epcomm.layers")

COMMUNICATION = ("dispatch", "combine", "combine_wait", "bwd_dispatch", "bwd_combine")


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class PhaseTimer:
    """Accumulates milliseconds per phase name; see the module docstring."""

    def __init__(self, device: torch.device, enabled: bool = False, log_each_step: bool = False,
                 label: str = "MoE") -> None:
        self.device = torch.device(device)
        self.enabled = enabled
        self.log_each_step = log_each_step
        self.label = label
        self._pending: list = []
        self._step: dict = defaultdict(float)
        self.total_ms: dict = defaultdict(float)
        self.count: dict = defaultdict(int)

    @contextlib.contextmanager
    def phase(self, name: str):
        if not self.enabled or _capturing():
            yield
            return
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._pending.append((name, start, end))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._add(name, (time.perf_counter() - t0) * 1e3)

    def _add(self, name: str, ms: float) -> None:
        self._step[name] += ms
        self.total_ms[name] += ms
        self.count[name] += 1

    def flush(self) -> dict:
        """Resolve pending CUDA events (synchronises); return and clear the phases since the last flush."""
        for name, start, end in self._pending:
            end.synchronize()
            self._add(name, start.elapsed_time(end))
        self._pending.clear()
        step, self._step = dict(self._step), defaultdict(float)
        return step

    def end_step(self, rank: int) -> None:
        """Called by the layer after each forward: logs the step's phases when ``log_each_step``."""
        if self.enabled and self.log_each_step and not _capturing():
            step = self.flush()
            log.warning("[rank %d] %s phases (ms): %s | %s", rank, self.label,
                        ", ".join(f"{k} {v:.3f}" for k, v in step.items()), _split(step))

    def summary(self) -> dict:
        """``{phase: {"calls": n, "total_ms": t, "mean_ms": t / n}}`` over everything recorded."""
        self.flush()
        return {k: {"calls": self.count[k], "total_ms": v, "mean_ms": v / max(self.count[k], 1)}
                for k, v in self.total_ms.items()}

    def format_summary(self) -> str:
        """A small table of ``summary()`` plus the communication/compute split."""
        s = self.summary()
        if not s:
            return f"{self.label}: no phases recorded"
        lines = [f"{'phase':<14}{'calls':>7}{'total ms':>12}{'mean ms':>10}"]
        for k, v in s.items():
            lines.append(f"{k:<14}{v['calls']:>7}{v['total_ms']:>12.2f}{v['mean_ms']:>10.3f}")
        lines.append(_split({k: v["total_ms"] for k, v in s.items()}))
        return "\n".join(lines)

    def reset(self) -> None:
        self.flush()
        self.total_ms.clear()
        self.count.clear()


def _split(ms: dict) -> str:
    comm = sum(v for k, v in ms.items() if k in COMMUNICATION)
    total = sum(ms.values())
    if total <= 0:
        return "communication -"
    return f"communication {comm:.2f} ms ({100 * comm / total:.0f}%), compute {total - comm:.2f} ms " \
           f"({100 * (total - comm) / total:.0f}%)"


# ---------------------------------------------------------------------------------------------- benchmark models
def expert_gemm_flops(pairs: int, hidden: int, ffn_hidden: int) -> float:
    """FLOPs of the experts' forward GEMMs over ``pairs`` (token, expert) rows: gate/up ``[P, H] x [H, 2F]`` and
    down ``[P, F] x [F, H]``, 2 FLOPs per multiply-add: ``6 P H F``."""
    return 6.0 * pairs * hidden * ffn_hidden


def expert_glue_bytes(layout: str, pairs: int, padded_pairs: int, recv_tokens: int, hidden: int,
                      elem: int = 2) -> int:
    """Bytes the forward's glue around the expert GEMMs moves through memory on one rank (a model: every tensor
    operation reads and writes its whole operands once), for ``pairs`` (token, local expert) rows (``padded_pairs``
    with each expert's group rounded up to the alignment) out of ``recv_tokens`` received rows of ``hidden``
    elements of ``elem`` bytes.

    ``rank_major`` (``experts.normal_experts``): gather the pairs' rows (2P), a zeroed padded copy and its
    out-of-place fill (3P' + 2P), gather the outputs back (2P), cast to float32 (3P), scale by the weights (4P),
    a float32 accumulator (2M) added into out of place (4M + 6P), the cast back (3M): ``19 P + 3 P' + 9 M`` rows
    of ``hidden * elem`` bytes.
    ``expert_major``: the permute after the rank-major receive (read M, write P', zeroing the padding) and the
    weighted reduction of the combine (read P, write M): ``P + P' + 2 M`` rows. (The one-sided transports
    place rows directly where they run the expert-major copy-out, saving the M rows read; not modelled.)"""
    row = hidden * elem
    if layout == "rank_major":
        return row * (19 * pairs + 3 * padded_pairs + 9 * recv_tokens)
    if layout == "expert_major":
        return row * (pairs + padded_pairs + 2 * recv_tokens)
    raise ValueError(f"expert_glue_bytes: layout={layout!r} must be 'rank_major' or 'expert_major'")
