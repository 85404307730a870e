"""Train a tiny MoE transformer block (RMSNorm -> expert-parallel MoE -> residual -> RMSNorm -> head) with
``epcomm.layers.MoE``; attention is left out. The loss goes down; a per-phase timing summary closes.

    python examples/train_moe.py --world-size 2                  # CPU processes over gloo (GPUs if enough)
    torchrun --nproc-per-node 4 examples/train_moe.py --steps 50  # one process per GPU
    EPCOMM_DEBUG=1 python examples/train_moe.py --world-size 2 --steps 3   # per-forward phase logs

Benchmark (the layer's forward+backward at a DeepSeek-like shape, ``alltoall`` vs the fast path, each with the
old rank-major and the new expert-major layout side by side, plus the low-latency decode step), results in
``benchmarks/results/moe_layer.{csv,md}``:

    torchrun --nproc-per-node 4 examples/train_moe.py --bench
    python examples/train_moe.py --world-size 4 --bench           # same, spawning the 4 processes

On one GPU (64 local experts, 4096 tokens of top-8 per rank: 32768 pairs, hidden 7168, widths 1024 and 2048;
results in ``benchmarks/results/moe_layer_1gpu_*``): every expert local, or 2-4 ranks sharing the GPU (run an
MPS server, as ``scripts/gpu_suite.sh`` does, so that their kernels run at the same time):

    python examples/train_moe.py --bench --single-gpu --world-size 1
    python examples/train_moe.py --bench --single-gpu --world-size 4   # EPCOMM_RANKS_PER_GPU=4

Data parallelism over the expert-parallel group: every rank trains on its own tokens; the replicated
parameters (norms, head, router, shared experts) have their gradients summed over the ranks, each expert's
gradients already cover every rank's tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from epcomm.layers import MoE, MoEConfig, destroy_buffers
from epcomm.testing import run


def progress(iterable, enabled: bool, **kwargs):
    """tqdm when installed (and on rank 0), else the plain iterable."""
    if not enabled:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, **kwargs)


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig, group, seed: int, device, checkpoint: bool) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.hidden, device=device, dtype=cfg.dtype)
        self.moe = MoE(cfg, group, seed=seed, max_tokens_per_rank=1 << 12)
        self.norm2 = nn.RMSNorm(cfg.hidden, device=device, dtype=cfg.dtype)
        gen = torch.Generator(device=device).manual_seed(seed + 1)
        self.head = nn.Parameter((torch.randn(cfg.hidden, cfg.hidden, generator=gen, device=device)
                                  * cfg.hidden ** -0.5).to(cfg.dtype))
        self.checkpoint = checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        if self.checkpoint:
            h = torch.utils.checkpoint.checkpoint(self.moe, h, use_reentrant=False)
        else:
            h = self.moe(h)
        return nn.functional.linear(self.norm2(x + h), self.head)

    def replicated_parameters(self):
        return [*self.norm1.parameters(), *self.norm2.parameters(), self.head, *self.moe.replicated_parameters()]


def train(ctx, args) -> dict:
    torch.manual_seed(args.seed)
    if ctx.device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.world_size))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cfg = MoEConfig(hidden=args.hidden, ffn_hidden=args.ffn, num_experts=args.experts, topk=args.topk,
                    num_shared_experts=args.shared, dtype=dtype, ep_dispatch=args.ep_dispatch,
                    fp8_dispatch=args.fp8, async_combine=args.async_combine)
    model = Block(cfg, ctx.group, args.seed, ctx.device, args.checkpoint)
    model.moe.timer.enabled = True
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    # the task: regress a fixed random nonlinear map of the tokens (the same on every rank)
    teacher_gen = torch.Generator(device=ctx.device).manual_seed(1234)
    teacher = torch.randn(args.hidden, args.hidden, generator=teacher_gen, device=ctx.device) * args.hidden ** -0.5
    data_gen = torch.Generator(device=ctx.device).manual_seed(args.seed * 1000 + ctx.rank)
    losses = []
    t0 = time.perf_counter()
    for step in progress(range(args.steps), ctx.rank == 0, desc="train", unit="step"):
        x = torch.randn(args.tokens, args.hidden, generator=data_gen, device=ctx.device)
        target = torch.tanh(x @ teacher) * 2
        out = model(x.to(dtype))
        loss = nn.functional.mse_loss(out.float(), target) / ctx.world_size
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for p in model.replicated_parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=ctx.group)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total, group=ctx.group)
        losses.append(float(total))
        if ctx.rank == 0 and (step % max(1, args.steps // 10) == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.5f}", flush=True)
    elapsed = time.perf_counter() - t0
    summary = model.moe.timer.format_summary()
    transport = model.moe.buffer.transport
    destroy_buffers()
    return {"rank": ctx.rank, "losses": losses, "elapsed_s": elapsed, "timing": summary,
            "path": model.moe.last_mode, "transport": transport}


# ------------------------------------------------------------------------------------------ benchmark
LAYOUTS = ("rank_major", "expert_major")  # old (the layer sorts/gathers/pads/scatters itself) vs new


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _layer_stats(moe) -> dict:
    """Sizes of the last normal-mode dispatch on this rank: received tokens M (rows with a source: a sync-free
    dispatch's spare rows excluded), (token, expert) pairs P, padded pairs P' (each expert's group rounded up to the
    grouped GEMM's alignment) and the groups' ends."""
    from epcomm.layers.experts import ALIGN

    h = moe.last_handle
    counts = h.num_recv_tokens_per_expert.long()
    aligned = (counts + ALIGN - 1) // ALIGN * ALIGN
    offs = torch.cumsum(aligned, 0).to(torch.int32)
    return {"recv_tokens": int((h.recv_src_rank >= 0).sum()), "pairs": int(counts.sum()),
            "padded_pairs": int(aligned.sum()), "offs": offs}


def _gemms_alone(ctx, args, moe, stats, gen) -> dict:
    """The experts' two grouped GEMMs alone on this rank's group sizes (inputs prepared outside the timing), and
    dense GEMMs of the same FLOPs: the ceiling the expert phase is measured against."""
    from epcomm.bench.timing import time_op

    dev, dtype = ctx.device, moe.config.dtype
    h, f = moe.config.hidden, moe.config.ffn_hidden
    rows, pairs, offs = stats["padded_pairs"], max(stats["pairs"], 1), stats["offs"]
    x = torch.randn(rows, h, generator=gen, device=dev).to(dtype)
    act = torch.randn(rows, f, generator=gen, device=dev).to(dtype)
    w13t, w2t = moe.w13.detach().transpose(1, 2), moe.w2.detach().transpose(1, 2)
    out = {}
    if moe.grouped_gemm:
        t = time_op(lambda: (torch._grouped_mm(x, w13t, offs=offs), torch._grouped_mm(act, w2t, offs=offs)),
                    ctx.group, dev, iters=args.bench_iters, warmup=3)
        out["grouped_gemms_ms"] = round(t.median_us / 1e3, 3)
    a, b1 = x[:pairs], moe.w13.detach()[0].t().contiguous()
    c, b2 = act[:pairs], moe.w2.detach()[0].t().contiguous()
    t = time_op(lambda: (a @ b1, c @ b2), ctx.group, dev, iters=args.bench_iters, warmup=3)
    out["dense_gemms_ms"] = round(t.median_us / 1e3, 3)
    return out


def _bench_layer(ctx, args, cfg, gen, steps: int = 3) -> tuple:
    """Forward+backward and forward of one layer (normal path), then per-phase means over ``steps`` more steps;
    returns (row values, layer, stats)."""
    from epcomm.bench.timing import time_op
    from epcomm.layers.timing import expert_gemm_flops, expert_glue_bytes

    dev, dtype = ctx.device, cfg.dtype
    moe = MoE(cfg, ctx.group, seed=0, max_tokens_per_rank=args.bench_tokens)
    x = torch.randn(args.bench_tokens, cfg.hidden, generator=gen, device=dev).to(dtype).requires_grad_()
    grad = torch.randn(args.bench_tokens, cfg.hidden, generator=gen, device=dev).to(dtype)

    def fwd_bwd():
        moe(x, mode="normal").backward(grad)

    def fwd():
        with torch.no_grad():
            moe(x, mode="normal")

    def fresh_grads():  # as after optimizer.zero_grad(set_to_none=True): the backward writes, never accumulates
        moe.zero_grad(set_to_none=True)
        x.grad = None

    t_train = time_op(fwd_bwd, ctx.group, dev, iters=args.bench_iters, warmup=3, setup=fresh_grads)
    t_fwd = time_op(fwd, ctx.group, dev, iters=args.bench_iters, warmup=2)
    moe.timer.reset()
    moe.timer.enabled = True
    for _ in range(steps):
        fresh_grads()
        fwd_bwd()
    _sync(dev)
    phases = {k: v["mean_ms"] for k, v in moe.timer.summary().items()}
    moe.timer.enabled = False
    stats = _layer_stats(moe)
    flops = expert_gemm_flops(stats["pairs"], cfg.hidden, cfg.ffn_hidden)
    expert_phase = sum(phases.get(k, 0.0) for k in ("dispatch", "experts", "combine"))
    values = {"fwd_bwd_ms": round(t_train.median_us / 1e3, 3), "fwd_ms": round(t_fwd.median_us / 1e3, 3),
              **{f"{k}_ms": round(v, 3) for k, v in phases.items()},
              "dispatch_experts_combine_ms": round(expert_phase, 3),
              "experts_tflops": round(flops / (phases.get("experts", float("nan")) * 1e-3) / 1e12, 1),
              "recv_tokens": stats["recv_tokens"], "pairs": stats["pairs"],
              "glue_fwd_gb": round(expert_glue_bytes(cfg.normal_layout, stats["pairs"], stats["padded_pairs"],
                                                     stats["recv_tokens"], cfg.hidden, x.element_size()) / 1e9, 3)}
    return values, moe, stats


def bench(ctx, args) -> list:
    from epcomm.bench.timing import time_graph, time_op
    from epcomm.errors import EpcommError

    dev = ctx.device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    hidden, topk = args.bench_hidden, 8
    experts = args.bench_experts or args.bench_local_experts * ctx.world_size
    rows = []

    def row(kind, transport, ffn, **values):
        rows.append({"measure": kind, "ep_dispatch": transport, "ranks": ctx.world_size, "hidden": hidden,
                     "experts": experts, "local_experts": experts // ctx.world_size, "topk": topk,
                     "ffn_hidden": ffn, **values})

    gen = torch.Generator(device=dev).manual_seed(100 + ctx.rank)
    for ffn in [int(v) for v in str(args.bench_ffn).split(",")]:
        for transport in args.bench_transports.split(","):
            measured = {}
            for layout in LAYOUTS:
                gen.manual_seed(100 + ctx.rank)  # the same tokens (and so the same routing) for both layouts
                cfg = MoEConfig(hidden=hidden, ffn_hidden=ffn, num_experts=experts, topk=topk, dtype=dtype,
                                ep_dispatch=transport, normal_layout=layout)
                try:
                    values, moe, stats = _bench_layer(ctx, args, cfg, gen)
                except EpcommError as exc:  # TransportUnavailableError: not registered / not runnable here
                    row("train fwd+bwd", transport, ffn, layout=layout, tokens_per_rank=args.bench_tokens,
                        note=f"unavailable: {str(exc).splitlines()[0][:160]}")
                    break
                if layout == "expert_major" and dev.type == "cuda":
                    alone = _gemms_alone(ctx, args, moe, stats, gen)
                    values.update(alone)
                    ceiling = alone.get("grouped_gemms_ms")
                    if ceiling:
                        values["expert_phase_over_gemms"] = round(values["dispatch_experts_combine_ms"] / ceiling, 2)
                        measured["ceiling"] = ceiling
                measured[layout] = values
                row("train fwd+bwd", moe.buffer.transport, ffn, layout=layout, tokens_per_rank=args.bench_tokens,
                    grouped_gemm=moe.grouped_gemm, **values)
                del moe
                destroy_buffers()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            if all(k in measured for k in LAYOUTS):
                old, new = measured["rank_major"], measured["expert_major"]
                extra = {}
                if "ceiling" in measured:
                    extra["old_expert_phase_over_gemms"] = round(old["dispatch_experts_combine_ms"]
                                                                 / measured["ceiling"], 2)
                    extra["old_experts_over_gemms"] = round(old["experts_ms"] / measured["ceiling"], 2)
                row("new vs old", transport, ffn, layout="expert_major / rank_major",
                    tokens_per_rank=args.bench_tokens,
                    fwd_bwd_speedup=round(old["fwd_bwd_ms"] / new["fwd_bwd_ms"], 2),
                    fwd_speedup=round(old["fwd_ms"] / new["fwd_ms"], 2),
                    expert_phase_speedup=round(old["dispatch_experts_combine_ms"]
                                               / new["dispatch_experts_combine_ms"], 2),
                    glue_bytes_ratio=round(old["glue_fwd_gb"] / max(new["glue_fwd_gb"], 1e-9), 1), **extra)
            if args.single_gpu or args.no_decode:
                continue
            # decode: low-latency path, FP8 dispatch, CUDA graph on GPUs
            t = args.decode_tokens
            cfg_ll = MoEConfig(hidden=hidden, ffn_hidden=ffn, num_experts=experts, topk=topk, dtype=dtype,
                               ep_dispatch=transport, low_latency_max_tokens=t, fp8_dispatch=True)
            try:
                moe = MoE(cfg_ll, ctx.group, seed=0, max_tokens_per_rank=t)
            except EpcommError:
                continue
            xd = torch.randn(t, hidden, generator=gen, device=dev).to(dtype)

            def decode():
                with torch.no_grad():
                    moe(xd, mode="low_latency")

            note = "CUDA graph replay"
            if dev.type == "cuda":
                try:
                    t_dec = time_graph(decode, ctx.group, dev, iters=max(20, args.bench_iters), warmup=3)
                except Exception as exc:  # noqa: BLE001 - capture unsupported: time eagerly, say so
                    note = f"eager (graph capture failed: {type(exc).__name__}: {str(exc)[:120]})"
                    t_dec = time_op(decode, ctx.group, dev, iters=max(20, args.bench_iters), warmup=3)
            else:
                note = "eager (CPU)"
                t_dec = time_op(decode, ctx.group, dev, iters=max(20, args.bench_iters), warmup=3)
            row("decode step", moe.buffer.transport, ffn, tokens_per_rank=t,
                fwd_ms=round(t_dec.median_us / 1e3, 3), grouped_gemm=moe.grouped_gemm, note=note)
            del moe
            destroy_buffers()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def write_bench(rows: list, args, world_size: int) -> None:
    from epcomm.bench.report import write_results

    columns = []
    for r in rows:
        columns += [k for k in r if k not in columns]
    rows = [{c: r.get(c, "") for c in columns} for r in rows]
    notes = ("MoE layer (epcomm.layers.MoE): router + dispatch + SwiGLU experts + combine, BF16 on GPUs, normal path "
             "(`train fwd+bwd`: one layer's forward and backward per step, gradients set to None before each as an "
             "optimizer's zero_grad does, median over iterations of the slowest rank, epcomm.bench.timing), once "
             "with the rank-major layout (`rank_major`: the layer sorts, gathers, "
             "pads and scatters the (row, expert) pairs around the grouped GEMMs and reduces with an FP32 index_add, "
             "the earlier path) and once expert-major (`expert_major`: the dispatch delivers rows grouped by expert, "
             "the combine weights and reduces them). `*_ms` phases: per-rank CUDA-event means over 3 extra steps "
             "(issue to completion on the compute stream); `dispatch_experts_combine_ms`: the expert phase including "
             "the communication around it (at one rank all of it is local glue); `experts_tflops`: 6 P H F FLOPs "
             "over the `experts` phase (P pairs on this rank); `grouped_gemms_ms`: the two torch._grouped_mm calls "
             "alone on the same group sizes, `dense_gemms_ms` dense GEMMs of the same FLOPs; "
             "`expert_phase_over_gemms`: `dispatch_experts_combine_ms` over `grouped_gemms_ms` (target <= 1.25); "
             "`glue_fwd_gb`: bytes the forward's glue moves (modelled, epcomm.layers.timing.expert_glue_bytes). "
             "`new vs old`: ratios of the two rows above it. `decode step`: one forward on the low-latency path "
             "with FP8 dispatch.")
    if args.single_gpu:
        notes += (f" Single-GPU mode: {world_size} rank(s) on one GPU ({args.bench_local_experts} local experts "
                  f"each); ranks sharing a GPU run under MPS through EPCOMM_RANKS_PER_GPU, so their timings are not "
                  f"NVLink's.")
    name = "moe_layer" if not args.single_gpu else f"moe_layer_1gpu_{world_size}rank{'s' if world_size > 1 else ''}"
    paths = write_results(rows, name, args.out, "MoE layer: forward+backward, old vs new layout, and decode step",
                          notes)
    print("wrote " + ", ".join(paths))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2, help="processes to spawn (ignored under torchrun)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--tokens", type=int, default=64, help="tokens per rank per step")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ffn", type=int, default=64)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--shared", type=int, default=1, help="shared experts")
    p.add_argument("--dtype", default=None, choices=("bf16", "fp32"), help="default: bf16 on GPUs, fp32 on CPUs")
    p.add_argument("--ep-dispatch", default="alltoall", choices=("auto", "nvlink", "deepep", "p2p", "alltoall"))
    p.add_argument("--fp8", action="store_true", help="FP8 dispatch")
    p.add_argument("--async-combine", action="store_true")
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing of the MoE")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bench", action="store_true", help="benchmark the layer instead of training")
    p.add_argument("--bench-hidden", type=int, default=7168)
    p.add_argument("--bench-experts", type=int, default=None,
                   help="experts in total (default: 256, or 64 per rank with --single-gpu)")
    p.add_argument("--bench-local-experts", type=int, default=64, help="experts per rank with --single-gpu")
    p.add_argument("--bench-ffn", default="1024", help="expert width(s) in the benchmark, comma-separated")
    p.add_argument("--bench-transports", default=None,
                   help="comma-separated (default: alltoall,nvlink; nvlink with --single-gpu)")
    p.add_argument("--single-gpu", action="store_true",
                   help="benchmark on one GPU: --world-size ranks share it (EPCOMM_RANKS_PER_GPU; 1: all experts "
                        "local), 64 local experts, expert widths 1024 and 2048")
    p.add_argument("--no-decode", action="store_true", help="skip the decode-step benchmark")
    p.add_argument("--bench-tokens", type=int, default=4096, help="tokens per rank in the benchmark")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens per rank per decode step")
    p.add_argument("--bench-iters", type=int, default=10)
    p.add_argument("--out", default="benchmarks/results")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.bench:
        if args.single_gpu:
            if args.world_size > 1:
                os.environ.setdefault("EPCOMM_RANKS_PER_GPU", str(args.world_size))
            if args.bench_ffn == "1024":
                args.bench_ffn = "1024,2048"
        if args.bench_experts is None and not args.single_gpu:
            args.bench_experts = 256
        if args.bench_transports is None:
            args.bench_transports = "nvlink" if args.single_gpu else "alltoall,nvlink"
        results = run(bench, args.world_size, args, device=args.device, timeout_s=3600)
        if results and (int(os.environ.get("RANK", "0")) == 0):
            write_bench(results[0], args, int(os.environ.get("WORLD_SIZE", args.world_size)))
        return 0
    if args.dtype is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        args.dtype = "bf16" if args.device != "cpu" and gpus >= (int(os.environ.get("WORLD_SIZE", 0))
                                                                   or args.world_size) else "fp32"
    results = run(train, args.world_size, args, device=args.device)
    first = results[0]
    if first["rank"] == 0:
        losses = first["losses"]
        print(f"\nloss {losses[0]:.5f} -> {losses[-1]:.5f} in {len(losses)} steps ({first['elapsed_s']:.1f} s, "
              f"path {first['path']}, transport {first['transport']})")
        print("per-phase timings of the MoE layer (rank 0):")
        print(first["timing"])
        if not losses[-1] < losses[0]:
            print("warning: the loss did not decrease", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
