"""The ``deep_ep`` drop-in on GPUs: the CPU suite's framework replays (``epcomm.testing.deep_ep``: vLLM, SGLang,
Megatron-Core, xorl, DeepEP's README and tests, V2's ElasticBuffer) with each transport, where the async paths
really run on the communication stream and vLLM's replays hand the Buffer a gloo group while the tensors are on
the GPU; and a decode step (the low-latency pair with hooks and cumulative expert counters, V2's no-sync pair)
captured in a CUDA graph and replayed with new data. Every output bit-exact against the reference."""

import pytest

from conftest import skip_unless_runnable
from epcomm.testing import spawn
from epcomm.testing.deep_ep import REPLAYS, run_replays


def _assert_clean(results) -> None:
    problems = [f"rank {r}: {label}: {fails}" for r, res in enumerate(results) for label, fails in res]
    assert not problems, "\n".join(problems)


@pytest.mark.gpu
@pytest.mark.parametrize("part", ["replays", "graph"])
@pytest.mark.parametrize("transport", ["nvlink", "p2p", "alltoall"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_gpu_deep_ep(world_size, transport, part):
    skip_unless_runnable(transport, world_size, graph=part == "graph")
    names = ["graph"] if part == "graph" else [n for n in REPLAYS if n != "graph"]
    _assert_clean(spawn(run_replays, world_size, transport, names, device="cuda", timeout_s=600))
