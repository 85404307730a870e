"""The examples run end to end on CPU processes (gloo): training lowers the loss and prints the per-phase
summary; the decode loop runs on the low-latency path on every rank; the MoE block written against ``deep_ep``
matches its dense computation on both paths."""

import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, *args: str) -> str:
    out = subprocess.run([sys.executable, str(EXAMPLES / script), "--world-size", "2", "--device", "cpu", *args],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout + out.stderr


def test_train_example_lowers_the_loss():
    text = _run("train_moe.py", "--steps", "10")
    m = re.search(r"loss ([0-9.]+) -> ([0-9.]+) in 10 steps", text)
    assert m, text[-2000:]
    assert float(m.group(2)) < float(m.group(1)), m.group(0)
    for phase in ("router", "dispatch", "experts", "combine", "bwd_dispatch", "bwd_combine"):
        assert re.search(rf"^{phase}\s+10\s", text, re.M), f"no '{phase}' row in the per-phase summary"


def test_decode_example_runs_on_the_low_latency_path():
    text = _run("decode_moe.py", "--steps", "3")
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: 3 decode steps on the low_latency path", text), text[-2000:]


def test_deep_ep_example_matches_the_dense_block():
    text = _run("deep_ep_moe.py")
    for rank in (0, 1):
        for mode in ("normal", "low_latency"):
            assert re.search(rf"rank {rank}: epcomm.deep_ep {mode}: \d+ tokens, .* matches the dense MoE", text), \
                text[-2000:]
