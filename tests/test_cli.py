"""The command line on CPU processes (gloo): the demo (the main job) checks every call against the reference,
and the dispatch / low-latency benchmarks write their tables with date, device, command and commit."""

import csv
import os
import subprocess
import sys


def _epcomm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "epcomm", *args], capture_output=True, text=True, timeout=400,
                          env=dict(os.environ, EPCOMM_COMMIT="test-commit"))


def test_demo_matches_the_reference():
    out = _epcomm("demo", "--world-size", "2", "--tokens", "24", "--hidden", "256", "--experts", "8", "--topk", "2",
                  "--ll-tokens", "3", "--iters", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "all results match the reference" in out.stdout
    for op in ("get_dispatch_layout", "dispatch BF16", "dispatch FP8", "combine BF16", "low_latency_dispatch FP8",
               "low_latency_combine BF16"):
        assert f"| {op} |" in out.stdout, op


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_bench_dispatch_and_low_latency_tables(tmp_path):
    out = _epcomm("bench", "dispatch", "--world-size", "2", "--tokens", "16", "--hidden", "128", "--experts", "4",
                  "--topk", "2", "--iters", "2", "--transports", "alltoall", "--routings", "uniform,skewed",
                  "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _rows(tmp_path / "bench_dispatch_2ranks.csv")
    ops = {(r["routing"], r["impl"], r["op"]) for r in rows}
    for routing in ("uniform", "skewed"):
        for op in ("dispatch FP8", "dispatch BF16", "dispatch FP8 cached", "combine BF16", "layout + dispatch FP8"):
            assert (routing, "epcomm-alltoall", op) in ops, (routing, op)
        assert (routing, "nccl-baseline", "dispatch FP8") in ops
    assert all(float(r["time_us"]) > 0 and r["commit"] == "test-commit" and r["date"] for r in rows)
    text = (tmp_path / "bench_dispatch_2ranks.md").read_text()
    assert "- commit: `test-commit`" in text and "DeepEP" in text

    out = _epcomm("bench", "low-latency", "--world-size", "2", "--tokens", "1,3", "--hidden", "128", "--experts", "4",
                  "--topk", "2", "--iters", "2", "--transports", "alltoall", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _rows(tmp_path / "bench_low_latency_2ranks.csv")
    got = {(int(r["tokens"]), r["op"]) for r in rows}
    for n in (1, 3):
        for op in ("dispatch", "combine", "dispatch send (hook)", "dispatch recv (hook)"):
            assert (n, op) in got, (n, op)


def test_internode_ab_script_pairs_two_trees(tmp_path):
    """``scripts/internode_ab.sh`` (the internode benchmark of this tree against another tree's ``src``, alternating
    processes): on 2 CPU ranks, one pair with this repository as both trees, each run's tables written with the
    command that made them and its EP64 model rows and host terms in the summary."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, AB_BASE=str(root), AB_WORLD="2", AB_PAIRS="1", AB_WARMUP="0", EPCOMM_COMMIT="test-commit",
               AB_ARGS="--tokens 32 --hidden 128 --ll-tokens 4 --iters 1 --rounds 1 --routings uniform")
    out = subprocess.run(["bash", str(root / "scripts" / "internode_ab.sh"), str(tmp_path)], cwd=root, env=env,
                         capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = (tmp_path / "summary.txt").read_text()
    for tree in ("head", "base"):
        assert f"internode_ab_{tree}_1: rc=0" in summary, summary
        rows = _rows(tmp_path / f"internode_ab_{tree}_1.csv")
        assert rows and all(r["commit"] == "test-commit" and f"internode_ab_{tree}_1" in r["command"] for r in rows)
        line = next(x for x in summary.splitlines() if x.startswith(f"internode_ab_{tree}_1: EP64"))
        for op in ("uniform dispatch FP8", "group_limited dispatch FP8", "combine BF16"):
            assert op in line, line
    assert summary.count("1 chunk: lead ") == 2, summary
