"""Train a tiny MoE transformer block (RMSNorm -> expert-parallel MoE -> residual -> RMSNorm -> head) with
``epcomm.layers.MoE``; attention is left out. The loss goes down; a per-phase timing summary closes.

    python examples/train_moe.py --world-size 2                  # CPU processes over gloo (GPUs if enough)
    torchrun --nproc-per-node 4 examples/train_moe.py --steps 50  # one process per GPU
    EPCOMM_DEBUG=1 python examples/train_moe.py --world-size 2 --steps 3   # per-forward phase logs

Benchmark (the layer's forward+backward at a DeepSeek-like shape, ``alltoall`` vs the fast path, plus the
low-latency decode step), results in ``benchmarks/results/moe_layer.{csv,md}``:

    torchrun --nproc-per-node 4 examples/train_moe.py --bench
    python examples/train_moe.py --world-size 4 --bench           # same, spawning the 4 processes

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
def bench(ctx, args) -> list:
    from epcomm.bench.timing import time_graph, time_op
    from epcomm.errors import EpcommError

    dev = ctx.device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    hidden, experts, topk = args.bench_hidden, args.bench_experts, 8
    rows = []

    def row(kind, transport, **values):
        rows.append({"measure": kind, "ep_dispatch": transport, "ranks": ctx.world_size, "hidden": hidden,
                     "experts": experts, "topk": topk, "ffn_hidden": args.bench_ffn, **values})

    gen = torch.Generator(device=dev).manual_seed(100 + ctx.rank)
    for transport in ("alltoall", "nvlink"):
        cfg = MoEConfig(hidden=hidden, ffn_hidden=args.bench_ffn, num_experts=experts, topk=topk, dtype=dtype,
                        ep_dispatch=transport)
        try:
            moe = MoE(cfg, ctx.group, seed=0, max_tokens_per_rank=args.bench_tokens)
        except EpcommError as exc:  # TransportUnavailableError: not registered / not runnable here
            note = f"unavailable: {str(exc).splitlines()[0][:160]}"
            row("train fwd+bwd", transport, tokens_per_rank=args.bench_tokens, median_us=float("nan"), note=note)
            row("decode step", transport, tokens_per_rank=args.decode_tokens, median_us=float("nan"), note=note)
            continue
        x = torch.randn(args.bench_tokens, hidden, generator=gen, device=dev).to(dtype).requires_grad_()
        grad = torch.randn(args.bench_tokens, hidden, generator=gen, device=dev).to(dtype)

        def fwd_bwd():
            moe(x, mode="normal").backward(grad)

        def fwd():
            with torch.no_grad():
                moe(x, mode="normal")

        t_train = time_op(fwd_bwd, ctx.group, dev, iters=args.bench_iters, warmup=3)
        t_fwd = time_op(fwd, ctx.group, dev, iters=args.bench_iters, warmup=2)
        moe.timer.enabled = True
        fwd_bwd()
        phases = {f"{k}_ms": round(v["mean_ms"], 3) for k, v in moe.timer.summary().items()}
        moe.timer.enabled = False
        row("train fwd+bwd", moe.buffer.transport, tokens_per_rank=args.bench_tokens, median_us=t_train.median_us,
            min_us=t_train.min_us, fwd_median_us=t_fwd.median_us, grouped_gemm=moe.grouped_gemm,
            note="phases from one extra step", **phases)
        del moe, x, grad
        destroy_buffers()
        if dev.type == "cuda":
            torch.cuda.empty_cache()

        # decode: low-latency path, FP8 dispatch, CUDA graph on GPUs
        t = args.decode_tokens
        cfg_ll = MoEConfig(hidden=hidden, ffn_hidden=args.bench_ffn, num_experts=experts, topk=topk, dtype=dtype,
                           ep_dispatch=transport, low_latency_max_tokens=t, fp8_dispatch=True)
        moe = MoE(cfg_ll, ctx.group, seed=0, max_tokens_per_rank=t)
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
        row("decode step", moe.buffer.transport, tokens_per_rank=t, median_us=t_dec.median_us, min_us=t_dec.min_us,
            grouped_gemm=moe.grouped_gemm, note=note)
        del moe
        destroy_buffers()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def write_bench(rows: list, args) -> None:
    from epcomm.bench.report import write_results

    columns = []
    for r in rows:
        columns += [k for k in r if k not in columns]
    rows = [{c: r.get(c, "") for c in columns} for r in rows]
    notes = ("MoE layer (epcomm.layers.MoE): router + dispatch + SwiGLU experts + combine, BF16 on GPUs. "
             "`train fwd+bwd`: forward and backward of one layer per step, normal path, median over iterations "
             "of the slowest rank (epcomm.bench.timing). `decode step`: one forward on the low-latency path with "
             "FP8 dispatch. Expert width reduced from DeepSeek-V3's 2048 to fit comfortably; phases (`*_ms`) are "
             "per-rank CUDA-event times of one extra step (issue to completion on the compute stream).")
    paths = write_results(rows, "moe_layer", args.out, "MoE layer: forward+backward and decode step", notes)
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
    p.add_argument("--bench-experts", type=int, default=256)
    p.add_argument("--bench-ffn", type=int, default=1024, help="expert width in the benchmark")
    p.add_argument("--bench-tokens", type=int, default=4096, help="tokens per rank in the benchmark")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens per rank per decode step")
    p.add_argument("--bench-iters", type=int, default=10)
    p.add_argument("--out", default="benchmarks/results")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.bench:
        results = run(bench, args.world_size, args, device=args.device, timeout_s=1800)
        if results and (int(os.environ.get("RANK", "0")) == 0):
            write_bench(results[0], args)
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
