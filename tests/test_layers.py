"""The expert-parallel MoE layer (``epcomm.layers``) against its dense single-process reference, on CPU
processes over gloo with 1, 2 and 4 ranks. Tolerances are documented in ``epcomm.layers.checks``
(float32: 1e-5 relative on the normal path; the low-latency combine is bfloat16 by API: 4e-3 on the
output, 1e-2 on the input gradient, 1e-5 on expert-weight and 2e-3 on routing gradients; bfloat16
against a float32 reference: 3e-2).
"""

from __future__ import annotations

import pytest
import torch

from epcomm.errors import BufferTooSmallError, EpcommError
from epcomm.layers import MoE, MoEConfig, moe_buffer_size_bytes
from epcomm.layers.checks import LayerCase, run_layer_cases
from epcomm.testing import spawn

LL = dict(low_latency_max_tokens=16)

CASES_1 = [
    LayerCase("1 rank: normal, seeded init", from_dense=False, expect_mode="normal"),
    LayerCase("1 rank: low latency, fp8, shared", config=dict(**LL, fp8_dispatch=True, num_shared_experts=1),
              expect_mode="low_latency"),
    LayerCase("1 rank: bf16 grouped gemm", dtype="bf16", config=dict(grouped_gemm=True, topk=3)),
]

CASES_2 = [
    LayerCase("normal, router, seeded init, timings", from_dense=False, expect_mode="normal", timing=True),
    LayerCase("shared experts + sigmoid router without normalisation",
              config=dict(num_shared_experts=2, router="sigmoid", normalize_topk=False, topk=3)),
    LayerCase("fp8 dispatch", config=dict(fp8_dispatch=True), tokens=(12, 17)),
    LayerCase("skewed routing", routing="skewed", tokens=(20, 9)),
    LayerCase("dropped routing (-1 entries), a rank without tokens", routing="dropped", tokens=(16, 0)),
    LayerCase("all tokens to the last rank's experts", routing="one_rank"),
    LayerCase("low latency, auto", config=LL, tokens=(12, 7), expect_mode="low_latency", timing=True),
    LayerCase("low latency, fp8, shared, dropped routing", config=dict(**LL, fp8_dispatch=True, num_shared_experts=1),
              routing="dropped", mode="low_latency", tokens=(16, 5)),
    LayerCase("auto picks normal when one rank exceeds T", config=dict(low_latency_max_tokens=8), tokens=(4, 20),
              expect_mode="normal"),
    LayerCase("activation checkpointing (non-reentrant)", checkpoint="non_reentrant",
              config=dict(num_shared_experts=1)),
    LayerCase("activation checkpointing (reentrant), low latency", checkpoint="reentrant", config=LL,
              routing="uniform", expect_mode="low_latency"),
    LayerCase("async combine + shared", config=dict(async_combine=True, num_shared_experts=1), async_wait=True),
    LayerCase("async combine, low latency", config=dict(**LL, async_combine=True), async_wait=True,
              expect_mode="low_latency"),
    LayerCase("fp32 grouped gemm (padded groups), skewed routing", config=dict(grouped_gemm=True, topk=3),
              routing="skewed", tokens=(21, 13)),
    LayerCase("fp32 grouped gemm, low latency (compacted groups)", config=dict(**LL, grouped_gemm=True, topk=3),
              tokens=(16, 11), expect_mode="low_latency"),
    LayerCase("bf16", dtype="bf16", config=dict(num_shared_experts=1)),
    LayerCase("bf16 grouped gemm, low latency, fp8", dtype="bf16",
              config=dict(**LL, grouped_gemm=True, fp8_dispatch=True, topk=3), expect_mode="low_latency"),
    LayerCase("bf16 async low latency (receive hook)", dtype="bf16", config=dict(**LL, async_combine=True),
              async_wait=True),
    LayerCase("rank-major layout (the earlier path), shared", config=dict(normal_layout="rank_major",
                                                                         num_shared_experts=1)),
    LayerCase("rank-major layout, fp8, grouped gemm, skewed", routing="skewed",
              config=dict(normal_layout="rank_major", fp8_dispatch=True, grouped_gemm=True, topk=3)),
    LayerCase("rank-major layout, bf16, async", dtype="bf16", config=dict(normal_layout="rank_major",
                                                                         async_combine=True), async_wait=True),
    LayerCase("expert-major: all top-4 experts on the last rank", routing="one_rank", tokens=(9, 4),
              config=dict(topk=4, grouped_gemm=True)),
]

CASES_4 = [
    LayerCase("4 ranks: normal, shared, sigmoid", config=dict(num_shared_experts=1, router="sigmoid", topk=3),
              tokens=(10, 3, 0, 14)),
    LayerCase("4 ranks: skewed, fp8", routing="skewed", config=dict(fp8_dispatch=True)),
    LayerCase("4 ranks: low latency, dropped", config=LL, routing="dropped", mode="low_latency"),
    LayerCase("4 ranks: bf16 grouped gemm", dtype="bf16", config=dict(grouped_gemm=True)),
]


def _worker(ctx, cases):
    """Every case, then the errors a layer must raise inside a process group."""
    torch.set_num_threads(1)  # several ranks share few cores: avoid oversubscription
    failed = run_layer_cases(ctx, cases)
    cfg = MoEConfig(hidden=128, ffn_hidden=64, num_experts=8, topk=2, dtype=torch.float32, ep_dispatch="alltoall")
    x = torch.randn(20, 128)
    moe = MoE(cfg, ctx.group)
    problems = []
    for label, fn, exc in (
            ("low-latency mode without low_latency_max_tokens", lambda: moe(x, mode="low_latency"), ValueError),
            ("unknown mode", lambda: moe(x, mode="fast"), ValueError),
            ("wrong hidden", lambda: moe(torch.randn(3, 64)), ValueError),
            ("routing shape", lambda: moe(x, torch.zeros(20, 3, dtype=torch.long), torch.ones(20, 3)), ValueError)):
        try:
            fn()
            problems.append(f"{label}: no error")
        except exc:
            pass
    ll = MoE(MoEConfig(hidden=128, ffn_hidden=64, num_experts=8, topk=2, dtype=torch.float32, **LL), ctx.group)
    try:
        ll(x, mode="low_latency")
        problems.append("20 tokens > low_latency_max_tokens=16 in low-latency mode: no error")
    except ValueError as e:
        if "low_latency_max_tokens" not in str(e):
            problems.append(f"unhelpful message: {e}")
    if ctx.world_size > 1:
        try:
            MoE(MoEConfig(hidden=128, ffn_hidden=64, num_experts=ctx.world_size + 1, topk=1), ctx.group)
            problems.append("num_experts not a multiple of the group size: no error")
        except ValueError:
            pass
    if problems:
        failed.append(("error handling", problems))
    return failed


def _assert_passed(results):
    report = []
    for rank, failed in enumerate(results):
        for label, failures in failed:
            report.append(f"[rank {rank}] {label}:\n    " + "\n    ".join(failures))
    assert not report, "\n".join(report)


@pytest.mark.parametrize("world_size,cases", [(1, CASES_1), (2, CASES_2), (4, CASES_4)],
                         ids=["1rank", "2ranks", "4ranks"])
def test_layer_matches_dense_reference(world_size, cases):
    _assert_passed(spawn(_worker, world_size, cases, device="cpu", timeout_s=240))


# ------------------------------------------------------------------------------------------ in-process checks
BASE = dict(hidden=128, ffn_hidden=64, num_experts=8, topk=2)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_sms=21), "num_sms"),
    (dict(normal_layout="by_expert"), "normal_layout"),
    (dict(num_sms=0), "num_sms"),
    (dict(ep_dispatch="fastest"), "ep_dispatch"),
    (dict(router="relu"), "router"),
    (dict(topk=9), "topk"),
    (dict(dtype=torch.float16), "dtype"),
    (dict(hidden=96, fp8_dispatch=True), "fp8_dispatch"),
    (dict(hidden=96, low_latency_max_tokens=8), "low-latency"),
    (dict(low_latency_max_tokens=-1), "low_latency_max_tokens"),
    (dict(buffer_size_gb=0), "buffer_size_gb"),
    (dict(num_shared_experts=-1), "num_shared_experts"),
    (dict(grouped_gemm="yes"), "grouped_gemm"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(**{**BASE, **kwargs})


def test_config_aliases():
    cfg = MoEConfig(**BASE, ep_dispatch="DeepEP", dtype="bf16")
    assert cfg.ep_dispatch == "nvlink" and cfg.transport == "nvlink" and cfg.dtype == torch.bfloat16
    assert MoEConfig(**BASE, dtype="fp32").dtype == torch.float32


def test_buffer_size_rule_of_thumb():
    cfg = MoEConfig(hidden=7168, ffn_hidden=2048, num_experts=256, topk=8, low_latency_max_tokens=128)
    sizes = moe_buffer_size_bytes(cfg, 4096, 8)
    assert sizes.num_nvl_bytes == 8 * 4096 * (2 * 7168 + 12 * 8 + 64)  # ~475 MB, as documented
    assert 59e6 < sizes.num_rdma_bytes < 61e6  # ~60 MB, as documented
    assert moe_buffer_size_bytes(MoEConfig(**BASE, buffer_size_gb=2), 4096, 8).num_nvl_bytes == 2 << 30
    assert moe_buffer_size_bytes(MoEConfig(**BASE), 4096, 8).num_rdma_bytes == 0


def test_too_small_buffer_message_is_actionable():
    from epcomm.layers.autograd import CallState, actionable
    from epcomm.layers.timing import PhaseTimer

    state = CallState(buffer=None, timer=PhaseTimer("cpu"), sizes=moe_buffer_size_bytes(MoEConfig(**BASE), 64, 2))
    with pytest.raises(BufferTooSmallError, match="buffer_size_gb") as info:
        with actionable(state, "dispatch"):
            raise BufferTooSmallError("need 1000000 bytes")
    assert "num_nvl_bytes=" in str(info.value) and "need 1000000 bytes" in str(info.value)


def test_out_of_memory_at_init_is_actionable(monkeypatch):
    from epcomm.layers import buffers

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")

    monkeypatch.setattr(buffers, "Buffer", oom)
    sizes = moe_buffer_size_bytes(MoEConfig(**BASE, low_latency_max_tokens=128), 4096, 4)
    with pytest.raises(EpcommError, match="out of GPU memory") as info:
        buffers.get_buffer(object(), sizes, "alltoall", torch.device("cpu"))
    assert "buffer_size_gb" in str(info.value) and "num_rdma_bytes=" in str(info.value)


def test_low_latency_backward_encodings():
    """The low-latency backward carries float32 routing data through bfloat16 messages: bit-exact packing of
    the routing weights and expert ids, and weight gradients split into three bfloat16 parts that a
    single-contributor combine column carries exactly (joined back to float32 precision)."""
    from epcomm.layers.autograd import join_bf16x3, pack_routing, split_bf16x3, unpack_routing

    gen = torch.Generator().manual_seed(3)
    w = torch.rand(7, 5, generator=gen) * torch.exp2(torch.randint(-20, 20, (7, 5), generator=gen).float())
    idx = torch.randint(-1, 300, (7, 5), generator=gen)
    for dtype in (torch.bfloat16, torch.float32):
        packed = pack_routing(w, idx, dtype)
        assert packed.dtype == dtype and packed.size(1) % 128 == 0
        w2, idx2 = unpack_routing(packed.clone(), 5)
        assert torch.equal(w2.view(torch.int32), w.view(torch.int32)) and torch.equal(idx2, idx.to(torch.int32))
    dot = torch.randn(1000, generator=gen) * torch.exp2(torch.randint(-30, 30, (1000,), generator=gen).float())
    back = join_bf16x3(split_bf16x3(dot))
    assert ((back - dot).abs() <= dot.abs() * 2.0 ** -22).all()
    assert not ((split_bf16x3(dot)[..., 0].float() - dot).abs() <= dot.abs() * 2.0 ** -12).all()  # hi alone is not


def test_error_measure_of_per_token_tensors_uses_the_batch():
    """``_rel``: max |got - want| over max |want|, the latter over every rank's tokens when given the batch."""
    from epcomm.layers.checks import _rel

    want = torch.tensor([[2.0, -1.0]])
    got = want + torch.tensor([[0.0, 0.5]])
    other = torch.tensor([[10.0, -20.0], [3.0, 0.0]])
    assert _rel(got, want) == 0.25
    assert _rel(got, want, [want, other]) == 0.5 / 20
    assert _rel(got, want, [want, torch.empty(0, 2)]) == 0.25  # an empty rank changes nothing
    assert _rel(None, want, [want, other]) == 2.0 / 20  # a missing tensor counts as zeros
    assert _rel(got[:, :1], want, [want, other]) == float("inf")
    assert _rel(torch.zeros(1, 2), torch.zeros(1, 2), [torch.zeros(3, 2)]) == 0.0


# ------------------------------------------------------------------------------------------ hardening
def _num_sms_worker(ctx):
    default = MoE(MoEConfig(**BASE, dtype=torch.float32), ctx.group)
    explicit = MoE(MoEConfig(**BASE, dtype=torch.float32, num_sms=24), ctx.group)
    return (default.config.num_sms, default._dispatch_config.num_sms, default._combine_config.num_sms,
            explicit._dispatch_config.num_sms, explicit._combine_config.num_sms)


def test_num_sms_defaults_to_the_traffic_model():
    """``MoEConfig.num_sms`` is None by default (each call's SMs from the traffic model); Megatron's
    ``--moe-deepep-num-sms`` still maps when given."""
    assert spawn(_num_sms_worker, 1, device="cpu")[0] == (None, None, None, 24, 24)


def _real_error_worker(ctx):
    """A grouped GEMM that fails for real (a CUDA error, out of memory) propagates, and the layer keeps it."""
    cfg = MoEConfig(**BASE, dtype=torch.float32, grouped_gemm=True)
    moe = MoE(cfg, ctx.group)
    real = torch._grouped_mm
    seen = []
    for message in ("CUDA error: an illegal memory access was encountered", "CUDA out of memory. Tried to allocate"):
        def broken(*args, _m=message, **kwargs):
            raise RuntimeError(_m)

        torch._grouped_mm = broken
        try:
            moe(torch.randn(6, cfg.hidden))
            seen.append("no error")
        except RuntimeError as exc:
            seen.append(str(exc))
        finally:
            torch._grouped_mm = real
    out = moe(torch.randn(6, cfg.hidden))  # still the grouped GEMM, still working
    return seen, moe.grouped_gemm, tuple(out.shape)


def test_real_grouped_gemm_errors_propagate():
    seen, grouped, shape = spawn(_real_error_worker, 1, device="cpu")[0]
    assert seen[0].startswith("CUDA error: an illegal memory access") and seen[1].startswith("CUDA out of memory")
    assert grouped is True and shape == (6, 128)


def test_grouped_gemm_probe_decides_once(caplog):
    """Auto mode runs a tiny grouped GEMM once at construction: 'unsupported' falls back to the loop with a
    log line; any other error propagates."""
    from epcomm.layers.experts import grouped_mm_unsupported, probe_grouped_mm

    def raising(exc):
        def run():
            raise exc
        return run

    assert probe_grouped_mm(torch.device("cpu"), torch.float32) == (True, "auto: torch._grouped_mm")
    with caplog.at_level("WARNING", logger="epcomm.layers"):
        ok, reason = probe_grouped_mm(torch.device("cpu"), torch.bfloat16,
                                      run=raising(RuntimeError("grouped gemm is only supported on SM90")))
    assert not ok and "unsupported" in reason and "run as a loop" in caplog.text
    assert not probe_grouped_mm(torch.device("cpu"), torch.bfloat16, run=raising(NotImplementedError("x")))[0]
    for exc in (RuntimeError("CUDA error: an illegal memory access was encountered"),
                torch.OutOfMemoryError("CUDA out of memory"), RuntimeError("shape mismatch"), ValueError("bad")):
        with pytest.raises(type(exc)):
            probe_grouped_mm(torch.device("cpu"), torch.bfloat16, run=raising(exc))
    assert grouped_mm_unsupported(RuntimeError("Could not run 'aten::_grouped_mm' with arguments from the CPU"))
    assert not grouped_mm_unsupported(RuntimeError("CUDA error: device-side assert triggered (not supported)"))
    assert grouped_mm_unsupported(RuntimeError("CUDA error: no kernel image is available for execution on the device"))


def _order_worker(ctx, dtype):
    """The normal path's result is the reference expert-major combine of the layer's own expert outputs, bit for
    bit: the per-token reduction has one fixed order (no index_add, nothing that depends on timing)."""
    import torch.distributed as dist

    from epcomm import reference
    import epcomm.layers.moe as moe_module
    from epcomm.testing.routing import make_topk

    cfg = MoEConfig(hidden=64, ffn_hidden=32, num_experts=4 * ctx.world_size, topk=4, dtype=dtype)
    counts = [7, 11][:ctx.world_size] if ctx.world_size > 1 else [13]
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(n, cfg.hidden, generator=gen).to(dtype) for n in counts]
    # every token's 4 experts on as few ranks as possible: several pairs of a token on one rank
    idxs = [make_topk(n, cfg.num_experts, cfg.topk, "skewed", generator=gen) for n in counts]
    ws = [torch.rand(n, cfg.topk, generator=gen) + 0.1 for n in counts]
    moe = MoE(cfg, ctx.group, seed=3)
    recorded = []
    original = moe_module.expert_major_down  # the expert outputs the combine reduces

    def record(*args, **kwargs):
        recorded.append(original(*args, **kwargs))
        return recorded[-1]

    moe_module.expert_major_down = record
    try:
        with torch.no_grad():
            out = moe(xs[ctx.rank], idxs[ctx.rank], ws[ctx.rank])
            again = moe(xs[ctx.rank], idxs[ctx.rank], ws[ctx.rank])
    finally:
        moe_module.expert_major_down = original
    ys = [None] * ctx.world_size
    dist.all_gather_object(ys, recorded[0])
    ref = reference.expert_major_dispatch(xs, idxs, cfg.num_experts, ws, expert_alignment=8)
    want = reference.expert_major_combine(ys, ref, counts, [r.row_weights for r in ref])[ctx.rank][0]
    from epcomm.testing.checks import same_bits

    return same_bits(out, want), same_bits(again, out), float((out.float() - want.float()).abs().max())


@pytest.mark.parametrize("world_size,dtype", [(1, torch.bfloat16), (2, torch.float32), (2, torch.bfloat16)])
def test_normal_path_reduces_in_a_fixed_order(world_size, dtype):
    for exact, repeat, diff in spawn(_order_worker, world_size, dtype, device="cpu"):
        assert exact and repeat, f"max difference {diff}"
