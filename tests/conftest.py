import os

import pytest
import torch

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def gpu_count() -> int:
    """CUDA GPUs on this machine (hardware tests: topology, P2P attributes)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_ranks() -> int:
    """How many ranks a GPU test may start: one per GPU, or more under ``EPCOMM_RANKS_PER_GPU`` (several ranks
    sharing a GPU, see ``epcomm.testing.launcher``)."""
    from epcomm.testing.launcher import gpu_rank_slots

    return gpu_rank_slots()


def splits_shared_gpus(world_size: int, group_size: int) -> bool:
    """Whether the launcher's placement of ``world_size`` ranks puts a group (consecutive blocks of ``group_size``)
    on shared GPUs that span several: a one-sided transport's symmetric heap refuses such a group."""
    from epcomm import env
    from epcomm.core.device import split_shared_group
    from epcomm.testing.launcher import gpu_placement

    if world_size <= gpu_count():
        return False
    gpus = [gpu_placement(r, world_size, gpu_count(), env.ranks_per_gpu(), env.ranks_per_node() or 0)[0]
            for r in range(world_size)]
    return any(split_shared_group(gpus[i:i + group_size]) for i in range(0, world_size, group_size))


def skip_split_shared_group(transport: str, world_size: int, group_size: int) -> None:
    """Skip a one-sided transport whose groups (consecutive blocks of ``group_size`` ranks) would share GPUs and
    span several at once as the launcher places them: the symmetric heap refuses such a group (CUDA IPC mappings of
    another GPU's memory are out of its kernels' reach)."""
    if transport != "alltoall" and splits_shared_gpus(world_size, group_size):
        pytest.skip(f"{transport}: groups of {group_size} of {world_size} ranks on {gpu_count()} GPUs would share "
                    "GPUs and span several (set EPCOMM_RANKS_PER_NODE to the group size, or use more GPUs)")


def skip_gloo_graph(transport: str, world_size: int) -> None:
    """Ranks that share a GPU talk over gloo, whose all_to_all cannot be captured in a CUDA graph (the transport
    says so: tests/test_errors.py::test_graph_capture_over_gloo_is_a_clear_error)."""
    if transport == "alltoall" and world_size > gpu_count():
        pytest.skip("alltoall over gloo (ranks sharing a GPU) cannot be captured in a CUDA graph")


def skip_unless_runnable(transport: str, world_size: int, graph: bool = False) -> None:
    """Skip a GPU case of ``world_size`` ranks (one group of them all) that this machine cannot run: too few GPU rank
    slots, a one-sided group split across shared GPUs (``skip_split_shared_group``), or, for a CUDA-graph case, the
    portable transport over gloo (``skip_gloo_graph``)."""
    if gpu_ranks() < world_size:
        pytest.skip(f"needs {world_size} GPU rank slots")
    skip_split_shared_group(transport, world_size, world_size)
    if graph:
        skip_gloo_graph(transport, world_size)


def sm90_compiler():
    """``epcomm.testing.compile_check.offline_compiler()`` (compiles kernels for sm_90 without a GPU), or a skip
    where this process interprets the kernels or this Triton's internals cannot be driven offline."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("kernels are interpreted in this process")
    from epcomm.testing.compile_check import offline_compiler

    try:
        return offline_compiler()
    except Exception as e:  # noqa: BLE001 - another Triton version's internals
        pytest.skip(f"cannot drive Triton's compiler offline here: {e}")


def pytest_collection_modifyitems(config, items):
    if gpu_count() > 0:
        return
    skip = pytest.mark.skip(reason="needs CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_addoption(parser):
    parser.addoption("--instafail", action="store_true", default=False,
                     help="print each failure's traceback as soon as the test fails (GPU runs that a time limit may "
                          "stop before pytest's final summary)")


def pytest_runtest_logreport(report):
    if report.failed and getattr(report, "_instafail", None) is None:
        config = getattr(pytest_runtest_logreport, "config", None)
        if config is not None and config.getoption("--instafail"):
            import sys

            report._instafail = True
            sys.stderr.write(f"\n===== FAILED {report.nodeid} ({report.when}) =====\n{report.longreprtext}\n")
            sys.stderr.flush()


def pytest_configure(config):
    pytest_runtest_logreport.config = config
