"""``python -m epcomm demo``: layout, dispatch and combine (normal and low-latency) on every rank, checked
against the reference and timed. Without GPUs it spawns CPU processes that talk over gloo; with GPUs (or
under torchrun) one process per GPU over NCCL."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..testing import run
from ..testing.checks import LowLatencyCase, NormalCase, check_low_latency, check_normal
from .report import format_table
from .timing import time_op
from .traffic import low_latency_bytes, low_latency_pairs, normal_traffic

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoOptions:
    tokens: int
    hidden: int
    topk: int
    experts: int
    ll_tokens: int
    transport: str
    iters: int
    seed: int = 1


def _all_ok(ctx, ok: bool) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=ctx.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=ctx.group)
    return bool(flag.item())


def demo_worker(ctx, opts: DemoOptions) -> list:
    from ..buffer import Buffer
    from ..fp8 import per_token_cast_to_fp8
    from ..testing.routing import make_inputs

    buf = Buffer(ctx.group, transport=opts.transport)
    shape = dict(num_tokens=opts.tokens, hidden=opts.hidden, num_experts=opts.experts, topk=opts.topk,
                 seed=opts.seed)
    failures = {}
    for name, case in (("bf16", NormalCase(dtype="bf16", **shape)), ("fp8", NormalCase(dtype="fp8", **shape)),
                       ("ll", LowLatencyCase(num_tokens=opts.ll_tokens, max_tokens=opts.ll_tokens,
                                             hidden=opts.hidden, num_experts=opts.experts, topk=opts.topk,
                                             seed=opts.seed))):
        check = check_low_latency if name == "ll" else check_normal
        result = check(ctx, buf, case)
        for f in result.failures:
            log.error("demo: %s case failed: %s", name, f)
        failures[name] = not _all_ok(ctx, result.ok)

    inputs = make_inputs(opts.seed, ctx.world_size, opts.tokens, opts.hidden, opts.experts, opts.topk)
    mine = inputs[ctx.rank].to(ctx.device)
    x, idx, w = mine.x, mine.topk_idx, mine.topk_weights
    x_fp8 = per_token_cast_to_fp8(x)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, opts.experts)
    layout_kwargs = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                         topk_idx=idx, topk_weights=w)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, **layout_kwargs)
    traffic = normal_traffic([i.topk_idx for i in inputs], opts.experts)
    ll_in = make_inputs(opts.seed + 1, ctx.world_size, opts.ll_tokens, opts.hidden, opts.experts, opts.topk)
    ll_x, ll_idx, ll_w = (t.to(ctx.device) for t in (ll_in[ctx.rank].x, ll_in[ctx.rank].topk_idx,
                                                     ll_in[ctx.rank].topk_weights))
    ll_recv, _, ll_handle, _, _ = buf.low_latency_dispatch(ll_x, ll_idx, opts.ll_tokens, opts.experts)
    ll_y = torch.randn(ll_recv[0].shape, device=ctx.device).to(torch.bfloat16)
    pairs = low_latency_pairs([i.topk_idx for i in ll_in])
    ll_disp_bytes, ll_comb_bytes = low_latency_bytes(opts.hidden, True)

    def t(fn):
        return time_op(fn, ctx.group, ctx.device, iters=opts.iters, warmup=2)

    normal_shape = f"{opts.tokens}x{opts.hidden} top{opts.topk}/{opts.experts}"
    ll_shape = f"{opts.ll_tokens}x{opts.hidden} top{opts.topk}/{opts.experts}"
    ops = [
        ("get_dispatch_layout", normal_shape, t(lambda: buf.get_dispatch_layout(idx, opts.experts)), 0.0, "bf16"),
        ("dispatch BF16", normal_shape, t(lambda: buf.dispatch(x, **layout_kwargs)),
         traffic.mean_recv_bytes(opts.hidden, "bf16"), "bf16"),
        ("dispatch FP8", normal_shape, t(lambda: buf.dispatch(x_fp8, **layout_kwargs)),
         traffic.mean_recv_bytes(opts.hidden, "fp8"), "fp8"),
        ("combine BF16", normal_shape, t(lambda: buf.combine(recv_x, handle)),
         traffic.mean_recv_bytes(opts.hidden, "bf16"), "bf16"),
        ("low_latency_dispatch FP8", ll_shape,
         t(lambda: buf.low_latency_dispatch(ll_x, ll_idx, opts.ll_tokens, opts.experts)), pairs * ll_disp_bytes, "ll"),
        ("low_latency_combine BF16", ll_shape, t(lambda: buf.low_latency_combine(ll_y, ll_idx, ll_w, ll_handle)),
         pairs * ll_comb_bytes, "ll"),
    ]
    transport = buf.transport
    buf.destroy()
    return [{"op": op, "shape": shape_, "transport": transport, "ranks": ctx.world_size,
             "time_us": timing.median_us, "GB/s": timing.gbps(nbytes) if nbytes else float("nan"),
             "correct": "yes" if not failures[group] else "NO"}
            for op, shape_, timing, nbytes, group in ops]


def main(argv: list[str] | None = None) -> int:
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    parser = argparse.ArgumentParser(prog="python -m epcomm demo", description=__doc__)
    parser.add_argument("--world-size", type=int, default=n_gpus if n_gpus >= 2 else 4,
                        help="ranks to spawn (default: one per GPU, or 4 CPU processes)")
    parser.add_argument("--tokens", type=int, default=4096 if n_gpus >= 2 else 256, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=7168 if n_gpus >= 2 else 1024)
    parser.add_argument("--topk", type=int, default=8 if n_gpus >= 2 else 4)
    parser.add_argument("--experts", type=int, default=256 if n_gpus >= 2 else 32)
    parser.add_argument("--ll-tokens", type=int, default=128 if n_gpus >= 2 else 16,
                        help="tokens per rank in the low-latency calls")
    parser.add_argument("--transport", default="auto", choices=("auto", "nvlink", "p2p", "alltoall"))
    parser.add_argument("--iters", type=int, default=20 if n_gpus >= 2 else 5)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    opts = DemoOptions(args.tokens, args.hidden, args.topk, args.experts, args.ll_tokens, args.transport, args.iters)
    results = run(demo_worker, args.world_size, opts, device=args.device)
    rows = results[0]
    print(f"\nepcomm demo: {rows[0]['ranks']} ranks, transport {rows[0]['transport']}, "
          f"GB/s = mean bytes received per rank (self included) / median time\n")
    print(format_table(rows, ["op", "shape", "transport", "time_us", "GB/s", "correct"]))
    ok = all(r["correct"] == "yes" for r in rows)
    print("\nall results match the reference" if ok else "\nSOME RESULTS DO NOT MATCH THE REFERENCE")
    return 0 if ok else 1
