"""The expert-major receive layout (``Buffer.dispatch(..., layout="expert_major")``) and its weighted combine,
against ``epcomm.reference``, bit for bit: the portable transport with torch (CPU processes over gloo) and with
its Triton kernels, and the one-sided transport, under the Triton interpreter."""

import pytest

from epcomm.testing import spawn
from epcomm.testing.checks import ExpertMajorCase, run_cases


def cases(world_size: int) -> list:
    uneven = (0, 9, 23, 5) if world_size > 1 else (13,)
    return [
        ExpertMajorCase(num_tokens=24, hidden=64, num_experts=8, topk=3, dtype="bf16", bias=1, seed=1),
        ExpertMajorCase(num_tokens=uneven, hidden=128, num_experts=8, topk=4, dtype="fp8", routing="dropped",
                        expert_alignment=4, seed=2),
        ExpertMajorCase(num_tokens=17, hidden=40, num_experts=8, topk=5, dtype="fp32", worst=True, bias=2, seed=3),
        ExpertMajorCase(num_tokens=uneven, hidden=24, num_experts=8, topk=5, dtype="fp16", routing="skewed",
                        expert_alignment=1, with_weights=False, seed=4),
        ExpertMajorCase(num_tokens=12, hidden=16, num_experts=8, topk=2, routing="one_expert", worst=True, seed=5),
        ExpertMajorCase(num_tokens=uneven, hidden=16, num_experts=8, topk=3, routing="one_rank", seed=6),
    ]


def _run(world_size, transport, buffer_kwargs, case_list):
    results = spawn(run_cases, world_size, case_list, transport, buffer_kwargs, device="cpu", timeout_s=600)
    problems = [f"rank {r}: {label}: {fails}" for r, res in enumerate(results) for label, fails in res]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_portable_transport_torch(world_size):
    _run(world_size, "alltoall", {}, cases(world_size))


def test_portable_transport_kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _run(2, "alltoall", {}, cases(2)[:3])


@pytest.mark.parametrize("world_size", [1, 2])
def test_one_sided_transport(monkeypatch, world_size):
    from epcomm.transports.nvlink import NVLinkTransport

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _run(world_size, NVLinkTransport, {"num_nvl_bytes": 1 << 20}, cases(world_size)[:3])


def _errors_worker(ctx):
    """Bad arguments raise at once with the function's name; an inconsistent count table becomes a device
    error of the call (CPU: seen before it returns), not a silent drop."""
    import torch

    from epcomm import Buffer
    from epcomm.errors import EpcommDeviceError

    buf = Buffer(ctx.group, transport="alltoall")
    x = torch.randn(6, 16)
    idx = torch.tensor([[0, 1], [1, 2], [3, -1], [2, 0], [1, 3], [0, 2]])
    w = torch.rand(6, 2)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 4)
    kw = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    problems = []

    def expect(label, fn, exc, match):
        try:
            fn()
            problems.append(f"{label}: no error")
        except exc as e:
            if match not in str(e):
                problems.append(f"{label}: message {str(e)!r} lacks {match!r}")

    expect("unknown layout", lambda: buf.dispatch(x, **kw, topk_idx=idx, layout="by_expert"), ValueError,
           "Buffer.dispatch: layout=")
    expect("expert-major without topk_idx", lambda: buf.dispatch(x, num_tokens_per_rank=per_rank,
                                                                  is_token_in_rank=in_rank, layout="expert_major"),
           ValueError, "pass topk_idx")
    recv, offs, row_w, counts, handle, _ = buf.dispatch(x, **kw, topk_idx=idx, topk_weights=w, expert_alignment=4,
                                                        layout="expert_major")
    if counts != [4, 4, 4, 4] or offs.tolist() != [4, 8, 12, 16] or recv.shape != (16, 16):
        problems.append(f"layout: counts {counts}, offsets {offs.tolist()}, rows {tuple(recv.shape)}")
    expect("cached with another layout", lambda: buf.dispatch(x, handle=handle, layout="rank_major"), ValueError,
           "cached dispatch returns its handle's layout")
    expect("combine rows", lambda: buf.combine(recv[:10], handle), ValueError, "one row per expert-major row")
    expect("row_weights shape", lambda: buf.combine(recv, handle, row_weights=torch.ones(3)), ValueError,
           "row_weights must be float32 [16]")
    expect("values shape", lambda: buf.combine(recv, handle, topk_weights=torch.ones(6, 2)), ValueError,
           "one value per row")
    _, _, _, _, rm_handle, _ = buf.dispatch(x, **kw, topk_idx=idx)
    expect("row_weights with a rank-major handle", lambda: buf.combine(x[:6], rm_handle, row_weights=torch.ones(6)),
           ValueError, "expert-major handles only")
    bad = per_expert.clone()
    bad[1] -= 1
    bad[2] += 1
    expect("inconsistent num_tokens_per_expert", lambda: buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=bad, topk_idx=idx,
        layout="expert_major"), EpcommDeviceError, "num_tokens_per_expert")
    buf2 = Buffer(ctx.group, transport="alltoall")
    buf2.warmup(16, 4, 2, num_tokens=8, num_worst_tokens=24, layouts=("rank_major", "expert_major"),
                expert_alignment=8)
    expect("warmup with an unknown layout", lambda: buf2.warmup(16, 4, 2, num_tokens=8, layouts=("by_rank",)),
           ValueError, "Buffer.warmup: layouts=")
    buf2.destroy()
    return problems


def test_expert_major_errors():
    problems = spawn(_errors_worker, 1, device="cpu", timeout_s=120)[0]
    assert not problems, problems


def test_one_sided_transport_strict_and_rounds(monkeypatch):
    """Bounded local passes (push, then copy-out) and a buffer of a few rows: the expert-major rows arrive in
    several rounds, placed by the copy-out of each."""
    from epcomm.transports.nvlink import P2PTransport

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    case_list = [ExpertMajorCase(num_tokens=(9, 4), hidden=64, num_experts=8, topk=3, dtype="bf16", bias=1,
                                 strict_sms=True, seed=7),
                 ExpertMajorCase(num_tokens=(3, 10), hidden=128, num_experts=8, topk=2, dtype="fp8",
                                 routing="dropped", expert_alignment=2, seed=8)]
    _run(2, P2PTransport, {"num_nvl_bytes": 2 * 3 * (256 + 64)}, case_list)


def _one_rank_errors_worker(ctx):
    """One rank, one-sided transport (the local placement: no exchange): inconsistent layouts and bad ids raise
    at the call, naming the function and what to pass; a later good call still works."""
    import torch

    from epcomm import Buffer
    from epcomm.transports.nvlink import NVLinkTransport

    buf = Buffer(ctx.group, transport=NVLinkTransport)
    x = torch.randn(6, 16).to(torch.bfloat16)
    idx = torch.tensor([[0, 1], [1, 2], [-1, -1], [2, 0], [1, 3], [0, 2]])
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 4)
    kw = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
              topk_idx=idx, layout="expert_major", expert_alignment=4)
    problems = []

    def expect(label, fn, match):
        try:
            fn()
            problems.append(f"{label}: no error")
        except ValueError as e:
            if not str(e).startswith("Buffer.dispatch:") or match not in str(e):
                problems.append(f"{label}: message {str(e)!r} lacks {match!r}")

    bad = per_expert.clone()
    bad[1] -= 1
    bad[2] += 1
    expect("counts", lambda: buf.dispatch(x, **{**kw, "num_tokens_per_expert": bad}),
           "num_tokens_per_expert does not match topk_idx")
    expect("layout", lambda: buf.dispatch(x, **{**kw, "num_tokens_per_rank": per_rank + 1}),
           "num_tokens_per_rank does not match is_token_in_rank")
    other = in_rank.clone()
    other[2] = True
    expect("is_token_in_rank", lambda: buf.dispatch(x, **{**kw, "is_token_in_rank": other}),
           "num_tokens_per_rank does not match is_token_in_rank")
    wrong = idx.clone()
    wrong[4, 1] = 9
    expect("ids", lambda: buf.dispatch(x, **{**kw, "topk_idx": wrong}), "topk_idx has 1 entries outside [-1, 4)")
    recv, offs, _, counts, handle, _ = buf.dispatch(x, **kw)
    if counts != [4, 4, 4, 4] or offs.tolist() != [4, 8, 12, 16] or handle.num_recv_tokens != 5:
        problems.append(f"good call: counts {counts}, offsets {offs.tolist()}, {handle.num_recv_tokens} tokens")
    if handle.recv_src_idx.tolist() != [0, 1, 3, 4, 5]:
        problems.append(f"received tokens {handle.recv_src_idx.tolist()}")
    buf.destroy()
    return problems


def test_one_rank_one_sided_errors(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    problems = spawn(_one_rank_errors_worker, 1, device="cpu", timeout_s=120)[0]
    assert not problems, problems
