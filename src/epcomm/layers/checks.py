"""Correctness cases of the MoE layer, run inside a worker of ``epcomm.testing.spawn``: the expert-parallel
layer against ``DenseMoE`` holding the same weights, values and gradients. Shared by the CPU tests, the
GPU tests and anyone checking a new transport (``run_layer_cases(ctx, cases, dtype, ep_dispatch)``).

Every rank rebuilds every rank's inputs and upstream gradients from the seed and runs the dense reference
on each rank's tokens, so a rank compares its own outputs and ``x`` gradients, its experts' weight
gradients, and the replicated parameters' gradients after ``sync_replicated_grads`` (summed over ranks).

Error measure: ``max |got - want| / max |want|`` per tensor (0 when both are exactly zero). For the
tensors with one row per token (the output, ``x.grad``, ``topk_weights.grad``) ``max |want|`` is taken over
every rank's tokens: the measure a check of the whole, unsharded batch makes. A rank holding one token would
otherwise be judged against one or two values, and a routing-weight gradient ``<grad, expert output>`` can
be small by cancellation while its rounding error scales with its terms (seen on 8 GPUs in bfloat16: one
token's gradient off by 4.4% of its own largest value, the same with all three transports). Tolerances
(``TOLERANCES``):

* float32, normal path: 1e-5 everywhere (only the summation order differs).
* float32, low-latency path: the output 4e-3 (the low-latency combine is bfloat16 by API; the reference
  applies the same roundings, so only a rounding flip, at most one bfloat16 ulp, can differ), the ``x``
  gradient 1e-2 (it comes back through the bfloat16 combine), expert-weight gradients 1e-5 (float32
  paths), router and routing-weight gradients 2e-3 (they are ``<grad, bf16(expert output)>``: a rounding
  flip of one expert-output element, from the float32 matmuls' different summation order, moves one dot
  product by about 2^-8 of one of its H terms).
* bfloat16, against a float32 reference of the same (bfloat16-valued) weights and inputs: 3e-2 everywhere
  (a handful of bfloat16 roundings, each 2^-9 relative).
* across domains (nodes), the float32 low-latency path: the output and ``x`` gradient twice the above (each
  domain's partial is rounded to bfloat16 before the domains' partials are added and rounded again).
* FP8 dispatch: the reference applies the same per-token FP8 quantise-dequantise (straight-through), so the
  tolerances are those of the dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..testing.routing import make_topk, tokens_per_rank
from .config import MoEConfig
from .dense import DenseMoE
from .moe import MoE

BASE = dict(hidden=128, ffn_hidden=64, num_experts=8, topk=2)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOLERANCES = {
    ("fp32", "normal"): dict(out=1e-5, x=1e-5, experts=1e-5, routing=1e-5),
    ("fp32", "low_latency"): dict(out=4e-3, x=1e-2, experts=1e-5, routing=2e-3),
    ("bf16", "normal"): dict(out=3e-2, x=3e-2, experts=3e-2, routing=3e-2),
    ("bf16", "low_latency"): dict(out=3e-2, x=3e-2, experts=3e-2, routing=3e-2),
}


@dataclass(frozen=True)
class LayerCase:
    """One forward + backward of the layer. ``tokens``: per rank (an int, or a tuple repeated over the
    ranks, see ``tokens_per_rank``). ``routing``: None (the layer's router) or a ``make_topk`` routing
    (``uniform``, ``skewed``, ``dropped`` with -1 entries, ``one_rank``) passed as explicit
    ``topk_idx``/``topk_weights`` (whose gradient is then checked too). ``checkpoint``: None,
    ``"non_reentrant"`` or ``"reentrant"``."""

    label: str
    config: dict = field(default_factory=dict)
    tokens: object = 12
    mode: Optional[str] = None
    routing: Optional[str] = None
    checkpoint: Optional[str] = None
    async_wait: bool = False
    from_dense: bool = True
    expect_mode: Optional[str] = None
    timing: bool = False
    dtype: Optional[str] = None  # overrides the run's dtype ("fp32" / "bf16")
    seed: int = 0


def _rel(got: Optional[torch.Tensor], want: torch.Tensor, batch: Optional[Sequence[torch.Tensor]] = None) -> float:
    """``max |got - want| / max |want|``; with ``batch`` (the reference of every rank's tokens, ``want``
    among them) the denominator is the whole batch's ``max |want|``."""
    want = want.detach().float().cpu()
    got = torch.zeros_like(want) if got is None else got.detach().float().cpu()
    if got.shape != want.shape:
        return float("inf")
    scale = float(want.abs().max()) if want.numel() else 0.0
    if batch is not None:
        scale = max([scale] + [float(b.detach().abs().max()) for b in batch if b.numel()])
    err = float((got - want).abs().max()) if want.numel() else 0.0
    if scale == 0.0:
        return 0.0 if err == 0.0 else float("inf")
    return err / scale


def check_layer(ctx, case: LayerCase, dtype: str = "fp32", ep_dispatch: str = "alltoall") -> list:
    """Run ``case``; return a list of failure messages (empty when it passes)."""
    num_ranks, rank, dev = ctx.world_size, ctx.rank, ctx.device
    dtype = case.dtype or dtype
    cfg = MoEConfig(**{**BASE, "dtype": DTYPES[dtype], "ep_dispatch": ep_dispatch, **case.config})
    counts = tokens_per_rank(case.tokens, num_ranks)
    gen = torch.Generator().manual_seed(1000 + case.seed)
    xs = [torch.randn(n, cfg.hidden, generator=gen).to(cfg.dtype) for n in counts]
    gs = [torch.randn(n, cfg.hidden, generator=gen) for n in counts]
    routing = None
    if case.routing is not None:
        routing = []
        for n in counts:
            idx = make_topk(n, cfg.num_experts, cfg.topk, case.routing, generator=gen, num_ranks=num_ranks)
            w = (torch.rand(n, cfg.topk, generator=gen) + 0.1).masked_fill(idx < 0, 0.0)
            routing.append((idx, w))

    dense = DenseMoE(cfg, seed=case.seed, device=dev)
    moe = MoE.from_dense(dense, ctx.group) if case.from_dense else MoE(cfg, ctx.group, seed=case.seed)
    failures = []
    if not case.from_dense:
        first, n_local = moe.first_expert, moe.num_local_experts
        if not (torch.equal(moe.w13, dense.w13[first:first + n_local]) and torch.equal(moe.router_weight,
                                                                                       dense.router_weight)):
            failures.append("MoE(seed) and DenseMoE(seed) weights differ")
    moe.timer.enabled = moe.timer.enabled or case.timing
    dense = dense.float()

    # the layer
    x = xs[rank].to(dev).clone().requires_grad_()
    idx = w = None
    if routing is not None:
        idx = routing[rank][0].to(dev)
        w = routing[rank][1].to(dev).clone().requires_grad_()

    def run(x_, w_):
        if case.async_wait:
            fut = moe.forward_async(x_, idx, w_, mode=case.mode)
            (x_.detach().float() * 2).sum()  # other work while the combine runs
            out_ = fut.wait()
            if fut.wait() is not out_:
                failures.append("MoEFuture.wait() is not idempotent")
            return out_
        return moe(x_, idx, w_, mode=case.mode)

    if case.checkpoint is not None:
        out = torch.utils.checkpoint.checkpoint(run, x, w, use_reentrant=case.checkpoint == "reentrant")
    else:
        out = run(x, w)
    out.backward(gs[rank].to(dev).to(out.dtype))
    moe.sync_replicated_grads()
    mode = moe.last_mode
    if case.expect_mode is not None and mode != case.expect_mode:
        failures.append(f"path: got {mode}, want {case.expect_mode}")

    # the reference: every rank's tokens through the dense model, gradients summed over ranks
    ref_x = [t.to(dev).float().clone().requires_grad_() for t in xs]
    ref_w = [r[1].to(dev).clone().requires_grad_() for r in routing] if routing is not None else None
    ref_out = []
    for r in range(num_ranks):
        ri, rw = (routing[r][0].to(dev), ref_w[r]) if routing is not None else (None, None)
        ref_out.append(dense(ref_x[r], ri, rw, low_latency_rounding=mode == "low_latency"))
    sum((o * g.to(dev)).sum() for o, g in zip(ref_out, gs)).backward()

    tol = TOLERANCES[(dtype, mode)]
    if mode == "low_latency" and dtype == "fp32" and moe.buffer.num_domains > 1:
        # across domains the low-latency combine rounds twice (each domain's partial, then the sum), as documented
        tol = {**tol, "out": 2 * tol["out"], "x": 2 * tol["x"]}
    first, n_local = moe.first_expert, moe.num_local_experts
    # per-token tensors are measured against the whole batch's magnitude (every rank's reference)
    checks = [("out", out, ref_out[rank], tol["out"], ref_out),
              ("x.grad", x.grad, ref_x[rank].grad, tol["x"], [t.grad for t in ref_x]),
              ("w13.grad", moe.w13.grad, dense.w13.grad[first:first + n_local], tol["experts"], None),
              ("w2.grad", moe.w2.grad, dense.w2.grad[first:first + n_local], tol["experts"], None)]
    if routing is None:
        checks.append(("router_weight.grad", moe.router_weight.grad, dense.router_weight.grad, tol["routing"], None))
    else:
        checks.append(("topk_weights.grad", w.grad, ref_w[rank].grad, tol["routing"], [t.grad for t in ref_w]))
    if moe.shared_w13 is not None:
        checks += [("shared_w13.grad", moe.shared_w13.grad, dense.shared_w13.grad, tol["experts"], None),
                   ("shared_w2.grad", moe.shared_w2.grad, dense.shared_w2.grad, tol["experts"], None)]
    for name, got, want, limit, batch in checks:
        err = _rel(got, want, batch)
        if not err <= limit:
            failures.append(f"{name}: relative error {err:.3g} > {limit:g}")
    if case.timing:
        phases = set(moe.timer.summary())
        want = {"router", "dispatch", "experts", "combine", "bwd_dispatch", "bwd_combine"}
        if mode == "normal":
            want.add("layout")
        if not want <= phases:
            failures.append(f"timer phases {sorted(phases)} miss {sorted(want - phases)}")
    return failures


def run_layer_cases(ctx, cases: Sequence[LayerCase], dtype: str = "fp32", ep_dispatch: str = "alltoall") -> list:
    """Worker entry: ``[(label, failures)]`` of the failing cases (exceptions are failures too)."""
    import traceback

    failed = []
    for case in cases:
        try:
            failures = check_layer(ctx, case, dtype, ep_dispatch)
        except Exception as exc:  # noqa: BLE001 - report which case raised
            failures = [f"raised {type(exc).__name__}: {exc}\n{traceback.format_exc()}"]
        if failures:
            failed.append((case.label, failures))
    dist.barrier(group=ctx.group)
    return failed


def check_graph_replay(ctx, dtype: str = "bf16", ep_dispatch: str = "alltoall", steps: int = 3) -> list:
    """CUDA only: a low-latency forward captured in a CUDA graph and replayed equals the eager forward."""
    cfg = MoEConfig(**{**BASE, "dtype": DTYPES[dtype], "ep_dispatch": ep_dispatch, "low_latency_max_tokens": 16})
    moe = MoE(cfg, ctx.group, seed=5)
    gen = torch.Generator().manual_seed(77 + ctx.rank)
    inputs = [torch.randn(16, cfg.hidden, generator=gen).to(cfg.dtype).to(ctx.device) for _ in range(steps)]
    failures = []
    with torch.no_grad():
        eager = [moe(x, mode="low_latency").clone() for x in inputs]
        static_x = inputs[0].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                moe(static_x, mode="low_latency")
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = moe(static_x, mode="low_latency")
        for i, x in enumerate(inputs):
            static_x.copy_(x)
            graph.replay()
            err = _rel(static_out, eager[i])
            if err > 1e-6:
                failures.append(f"graph replay {i}: relative difference {err:.3g} from the eager forward")
    torch.cuda.synchronize()
    dist.barrier(group=ctx.group)
    return failures
