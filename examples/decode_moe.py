"""A decode loop on the low-latency path of ``epcomm.layers.MoE``.

Each step takes the current hidden state of a batch of sequences (``--batch`` tokens per rank), applies
RMSNorm -> MoE (``mode="low_latency"``: ``low_latency_dispatch`` / ``low_latency_combine``, no host
synchronisation) -> residual, and feeds the result to the next step. On GPUs the step is captured once in
a CUDA graph and replayed (the first replay is checked against the eager step); on CPUs it just loops.

    python examples/decode_moe.py --world-size 2                 # CPU processes over gloo
    torchrun --nproc-per-node 4 examples/decode_moe.py --steps 200 --hidden 7168 --experts 256 --topk 8 \\
        --ffn 1024 --batch 128 --fp8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from epcomm.layers import MoE, MoEConfig, destroy_buffers
from epcomm.testing import run


def decode(ctx, args) -> dict:
    dev = ctx.device
    if dev.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.world_size))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = MoEConfig(hidden=args.hidden, ffn_hidden=args.ffn, num_experts=args.experts, topk=args.topk,
                    num_shared_experts=args.shared, dtype=dtype, ep_dispatch=args.ep_dispatch,
                    low_latency_max_tokens=args.batch, fp8_dispatch=args.fp8)
    moe = MoE(cfg, ctx.group, seed=0, max_tokens_per_rank=args.batch)
    norm = nn.RMSNorm(args.hidden, device=dev, dtype=dtype)
    gen = torch.Generator(device=dev).manual_seed(ctx.rank)
    state = torch.randn(args.batch, args.hidden, generator=gen, device=dev).to(dtype)

    def step(h: torch.Tensor) -> torch.Tensor:
        h = h + moe(norm(h), mode="low_latency")
        return h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype)  # keep it bounded

    use_graph = dev.type == "cuda" and not args.no_graph
    times, checksums = [], []
    with torch.no_grad():
        if use_graph:
            static_h = state.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):  # warm-up outside the graph (allocations, Triton compilation)
                    step(static_h)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = step(static_h)
            eager = step(state)
            static_h.copy_(state)
            graph.replay()
            diff = float((static_out.float() - eager.float()).abs().max())
            if diff > 0:
                print(f"[rank {ctx.rank}] graph replay differs from the eager step by {diff:g}", flush=True)
        h = state
        for _ in range(args.steps):
            if args.sync_steps:
                dist.barrier(group=ctx.group)
            t0 = time.perf_counter()
            if use_graph:
                static_h.copy_(h)
                graph.replay()
                h = static_out.clone()
                torch.cuda.synchronize()
            else:
                h = step(h)
            times.append((time.perf_counter() - t0) * 1e6)
            checksums.append(float(h.float().sum()))
    destroy_buffers()
    return {"rank": ctx.rank, "median_us": statistics.median(times), "min_us": min(times), "graph": use_graph,
            "checksums": checksums[-3:], "path": moe.last_mode}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2, help="processes to spawn (ignored under torchrun)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="tokens per rank per step (= low_latency_max_tokens)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--shared", type=int, default=1)
    p.add_argument("--fp8", action="store_true", help="FP8 low-latency dispatch")
    p.add_argument("--ep-dispatch", default="auto", choices=("auto", "nvlink", "deepep", "p2p", "alltoall"))
    p.add_argument("--no-graph", action="store_true", help="do not capture a CUDA graph on GPUs")
    p.add_argument("--sync-steps", action="store_true", help="barrier before each step (steadier timings)")
    args = p.parse_args(argv)
    results = run(decode, args.world_size, args, device=args.device)
    for r in results:
        print(f"rank {r['rank']}: {args.steps} decode steps on the {r['path']} path, "
              f"{'CUDA graph replay' if r['graph'] else 'eager'}: median {r['median_us']:.1f} us, "
              f"min {r['min_us']:.1f} us; last checksums {[round(c, 3) for c in r['checksums']]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
