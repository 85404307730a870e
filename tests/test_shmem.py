"""epcomm.shmem on CPUs: layout and sizing, capability queries, and the whole host API over the
shared-memory backing with torch copies and host polling (no Triton interpreter in this process; the
kernels under the interpreter are covered by test_shmem_kernels.py)."""

import pytest
import torch

from epcomm.bench.p2p import format_size, parse_size, parse_sizes
from epcomm.errors import BufferTooSmallError, EpcommTimeoutError, TransportUnavailableError
from epcomm.kernels import shmem_codes as codes
from epcomm.shmem import HEAP_ALIGNMENT, HeapLayout, heap_bytes_for, p2p_access_supported, p2p_atomics_supported
from epcomm.shmem.checks import run_all
from epcomm.testing import spawn


def test_layout_offsets_are_aligned_and_ordered():
    lay = HeapLayout.build(world_size=4, user_bytes=1000, num_signals=100)
    assert lay.signals_off == 0
    assert lay.barrier_off == 1024  # 100 int64 signals = 800 bytes, rounded up to 256
    assert lay.ident_off == 1280  # 4 int64 barrier flags after the signals
    assert lay.user_off == 1536  # (rank, nonce) after the flags
    assert lay.user_bytes == 1024 and lay.total_bytes == lay.user_off + 1024
    for off in (lay.barrier_off, lay.ident_off, lay.user_off, lay.total_bytes):
        assert off % HEAP_ALIGNMENT == 0


def test_layout_rejects_bad_arguments():
    with pytest.raises(ValueError, match="HeapLayout.build: world_size"):
        HeapLayout.build(0, 10)
    with pytest.raises(ValueError, match="HeapLayout.build: user_bytes"):
        HeapLayout.build(2, -1)
    with pytest.raises(ValueError, match="HeapLayout.build: num_signals"):
        HeapLayout.build(2, 10, num_signals=0)


def test_heap_bytes_for_counts_padding():
    assert heap_bytes_for([]) == 0
    assert heap_bytes_for([((10,), torch.uint8)]) == 256
    # 10 bytes, pad to 256, then 3 float64 = 24 bytes -> 280 -> 512
    assert heap_bytes_for([((10,), torch.uint8), ((3,), torch.float64)]) == 512
    assert heap_bytes_for([((4, 64), torch.float32)]) == 1024
    assert heap_bytes_for([(1 << 20, torch.bfloat16)]) == 2 << 20


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answers on a machine without CUDA")
def test_p2p_queries_without_cuda():
    assert p2p_atomics_supported(0, 1) is False
    assert p2p_atomics_supported(0, 0) is False
    assert p2p_access_supported(0, 1) is False


def test_codes_are_consistent():
    assert set(codes.CMP_CODES) == set(codes.CMP_SYMBOLS) == {"eq", "ne", "gt", "ge", "lt", "le"}
    assert sorted(codes.CMP_CODES.values()) == list(range(6))
    assert codes.SIGNAL_OPS == {"set": codes.SIGNAL_SET, "add": codes.SIGNAL_ADD}
    assert set(codes.ERROR_NAMES) == {codes.ERR_WAIT_TIMEOUT, codes.ERR_BARRIER_TIMEOUT, codes.ERR_READY_TIMEOUT,
                                      codes.ERR_DONE_TIMEOUT, codes.ERR_GATE_TIMEOUT}


def test_exception_types():
    assert issubclass(EpcommTimeoutError, TimeoutError)
    assert issubclass(BufferTooSmallError, RuntimeError) and issubclass(TransportUnavailableError, RuntimeError)


def test_host_api_on_cpu_shared_memory():
    """validation, ring put/get (both engines, unaligned lengths and addresses), typed tensors and the
    table layout, signals/waits with every comparison, barrier ordering, timeouts as exceptions."""
    results = spawn(run_all, 2, device="cpu", timeout_s=300)
    failures = [f"rank {r} {name}: {f}" for r, res in enumerate(results) for name, v in res.items()
                for f in v["failures"]]
    assert not failures, "\n".join(failures)
    assert results[0]["barrier"]["epoch"] > 0
    assert results[0]["signals"]["atomics"] is False  # the CPU backing refuses remote adds


def test_bench_size_parsing():
    assert parse_size("16K") == 16384 and parse_size("64MiB") == 64 << 20 and parse_size("1G") == 1 << 30
    assert parse_sizes("16K:128K") == [16384, 32768, 65536, 131072]
    assert parse_sizes("4,17,1M") == [4, 17, 1 << 20]
    assert format_size(16384) == "16 KiB" and format_size(100003) == "100003 B" and format_size(1 << 30) == "1 GiB"
    with pytest.raises(ValueError, match="parse_size"):
        parse_size("12 parsecs")
    with pytest.raises(ValueError, match="parse_sizes"):
        parse_sizes("1M:16K")


def test_bench_p2p_on_cpu(tmp_path):
    """The p2p benchmark end to end on two CPU ranks (gloo, shared memory): rows, data check, files."""
    from epcomm.bench import p2p

    assert p2p.main(["--world-size", "2", "--sizes", "4K,100003", "--iters", "2", "--warmup", "1",
                     "--out", str(tmp_path)]) == 0
    text = (tmp_path / "p2p_2ranks.md").read_text()
    assert "| 4 KiB |" in text and "100003 B" in text and "put_GBps" in text
    assert (tmp_path / "p2p_2ranks.csv").read_text().count("\n") == 3  # header + 2 sizes
