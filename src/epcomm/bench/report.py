"""Recording benchmark results: CSV and Markdown with date, device, command and commit; optional PNG."""

from __future__ import annotations

import csv
import datetime
import os
import platform
import subprocess
import sys
from typing import Callable, Optional, Sequence

import torch


def environment() -> dict:
    """What a result row must carry to be reproducible."""
    from .. import env

    commit = env.commit_override()  # a copied tree may carry a stale .git: an explicit commit wins
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                                    timeout=10, cwd=os.path.dirname(__file__)).stdout.strip() or "unknown"
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                   text=True, timeout=10, cwd=os.path.dirname(__file__)).stdout.strip()
            if dirty and commit != "unknown":
                commit += "+dirty"
        except (OSError, subprocess.SubprocessError):
            commit = "unknown"
    if torch.cuda.is_available():
        device = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    else:
        device = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = "none"
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "none"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device,
        "torch": torch.__version__,
        "triton": triton_version,
        "nccl": nccl,
        "commit": commit,
        "command": "python -m epcomm " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith(
            ("__main__.py", "epcomm")) else " ".join(sys.argv),
    }


def format_table(rows: Sequence[dict], columns: Optional[Sequence[str]] = None) -> str:
    """A Markdown table of ``rows`` (floats with 1 decimal)."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())

    def fmt(v):
        if not isinstance(v, float):
            return str(v)
        return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 1 else f"{v:.3g}"

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_results(rows: Sequence[dict], name: str, out_dir: str, title: str, notes: str = "",
                  plot: Optional[Callable[[Sequence[dict], str], None]] = None) -> list[str]:
    """Write ``<out_dir>/<name>.csv`` (environment columns on every row), ``<name>.md`` (a header with the
    environment, notes and the table) and, with ``plot``, ``<name>.png``. Returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    env = environment()
    paths = []
    csv_path = os.path.join(out_dir, f"{name}.csv")
    columns = list(rows[0].keys()) if rows else []
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns + list(env.keys()))
        writer.writeheader()
        for r in rows:
            writer.writerow({**r, **env})
    paths.append(csv_path)
    md_path = os.path.join(out_dir, f"{name}.md")
    with open(md_path, "w") as f:
        f.write(f"# {title}\n\n")
        for k, v in env.items():
            f.write(f"- {k}: `{v}`\n")
        if notes:
            f.write(f"\n{notes.strip()}\n")
        f.write("\n" + format_table(rows, columns) + "\n")
    paths.append(md_path)
    if plot is not None and rows:
        try:
            import matplotlib

            matplotlib.use("Agg")
            png_path = os.path.join(out_dir, f"{name}.png")
            plot(rows, png_path)
            paths.append(png_path)
        except ImportError:
            pass
    return paths


def bench_parser(prog: str, doc: str, experts: int, iters: int):
    """The arguments every dispatch/combine benchmark takes: ``--world-size`` (default: one rank per GPU,
    at least 2), ``--hidden``, ``--topk``, ``--experts``, ``--transports`` (every registered one), ``--iters``,
    ``--out``, ``--name``. Returns the parser for the benchmark to add its own."""
    import argparse

    from ..transports import TRANSPORTS

    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=max(n_gpus, 2))
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=experts)
    parser.add_argument("--transports", default=",".join(TRANSPORTS), help="comma-separated epcomm transports")
    parser.add_argument("--iters", type=int, default=iters)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default=None, help="result file name")
    return parser


def finish(rows: Sequence[dict], name: str, out_dir: str, title: str, notes: str, plot, columns: Sequence[str]) -> int:
    """Write a benchmark's results (``write_results``), print the table's ``columns`` and the paths."""
    paths = write_results(rows, name, out_dir, title, notes, plot)
    print(format_table(rows, columns))
    print("\nwritten: " + ", ".join(paths))
    return 0
