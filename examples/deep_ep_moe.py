"""A Mixture-of-Experts block written against DeepEP's API only (``import deep_ep``), the way vLLM and SGLang
write theirs, running on epcomm's drop-in: prefill on the normal (high-throughput) path, decode steps on the
low-latency path, both checked against the same block computed densely on every rank.

    python examples/deep_ep_moe.py --world-size 2                      # CPU processes over gloo
    torchrun --nproc-per-node 4 examples/deep_ep_moe.py --hidden 2048 --experts 64 --topk 6

The one line below ``install()`` is all it takes: ``import deep_ep`` then resolves to ``epcomm.deep_ep``
(where a DeepEP installation is importable, that one is kept and this runs on DeepEP; run with
``python -m epcomm deep-ep --force examples/deep_ep_moe.py`` to use the drop-in anyway).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import epcomm.deep_ep

epcomm.deep_ep.install()

import deep_ep  # noqa: E402  (after install: the drop-in, unless DeepEP is installed)


class DeepEPMoE(nn.Module):
    """Top-k routed SwiGLU experts, expert-parallel over ``group`` through ``deep_ep``: every rank holds
    ``num_experts / group size`` experts. ``forward(x, mode)``: ``x [num_tokens, hidden]`` bf16 -> bf16."""

    def __init__(self, group, hidden: int, ffn: int, num_experts: int, topk: int, max_decode_tokens: int,
                 seed: int = 0) -> None:
        super().__init__()
        self.group, self.hidden, self.num_experts, self.topk = group, hidden, num_experts, topk
        self.max_decode_tokens = max_decode_tokens
        rank, size = group.rank(), group.size()
        self.num_local_experts = num_experts // size
        gen = torch.Generator().manual_seed(seed)  # every rank builds all weights alike, keeps its experts
        self.gate = nn.Parameter(torch.randn(num_experts, hidden, generator=gen) / hidden ** 0.5,
                                 requires_grad=False)
        w13 = torch.randn(num_experts, 2 * ffn, hidden, generator=gen) / hidden ** 0.5
        w2 = torch.randn(num_experts, hidden, ffn, generator=gen) / ffn ** 0.5
        self.all_w13, self.all_w2 = w13, w2  # kept only for the dense check
        first = rank * self.num_local_experts
        self.w13 = nn.Parameter(w13[first:first + self.num_local_experts].clone(), requires_grad=False)
        self.w2 = nn.Parameter(w2[first:first + self.num_local_experts].clone(), requires_grad=False)
        self.buffer = self._make_buffer(group)

    def _make_buffer(self, group) -> "deep_ep.Buffer":
        """One buffer for both modes, sized like DeepEP's README and SGLang's auto mode."""
        hidden_bytes = self.hidden * 2
        num_nvl_bytes, num_rdma_bytes = 0, 0
        for config in (deep_ep.Buffer.get_dispatch_config(group.size()),
                       deep_ep.Buffer.get_combine_config(group.size())):
            num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()), num_nvl_bytes)
            num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, group.size()), num_rdma_bytes)
        num_rdma_bytes = max(deep_ep.Buffer.get_low_latency_rdma_size_hint(
            self.max_decode_tokens, self.hidden, group.size(), self.num_experts), num_rdma_bytes)
        return deep_ep.Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode=True,
                              num_qps_per_rank=self.num_local_experts, explicitly_destroy=True)

    @staticmethod
    def _expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        gate, up = (x.float() @ w13.t()).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ w2.t()

    def route(self, x: torch.Tensor):
        probs = torch.softmax(x.float() @ self.gate.t(), dim=-1)
        topk_weights, topk_idx = torch.topk(probs, self.topk, dim=-1)
        topk_weights = topk_weights / topk_weights.sum(-1, keepdim=True)
        return topk_idx.to(deep_ep.topk_idx_t), topk_weights.float()

    def forward(self, x: torch.Tensor, mode: str = "normal") -> torch.Tensor:
        topk_idx, topk_weights = self.route(x)
        if mode == "low_latency":
            return self._decode(x, topk_idx, topk_weights)
        return self._prefill(x, topk_idx, topk_weights)

    def _prefill(self, x, topk_idx, topk_weights):
        previous_event = self.buffer.capture()
        num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, event = \
            self.buffer.get_dispatch_layout(topk_idx, self.num_experts, previous_event=previous_event,
                                            async_finish=True, allocate_on_comm_stream=True)
        recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event = \
            self.buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights,
                                 num_tokens_per_rank=num_tokens_per_rank,
                                 num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
                                 is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert,
                                 previous_event=event, async_finish=True, allocate_on_comm_stream=True)
        event.current_stream_wait()
        out = torch.zeros(recv_x.shape, dtype=torch.float32, device=recv_x.device)
        for e, count in enumerate(num_recv_tokens_per_expert_list):
            if count == 0:
                continue
            rows, slots = torch.nonzero(recv_topk_idx == e, as_tuple=True)
            y = self._expert(recv_x[rows], self.w13[e], self.w2[e])
            out.index_add_(0, rows, y * recv_topk_weights[rows, slots].unsqueeze(1))
        combined_x, _, event = self.buffer.combine(out.to(torch.bfloat16), handle, async_finish=True)
        event.current_stream_wait()
        return combined_x

    def _decode(self, x, topk_idx, topk_weights):
        recv_x, recv_count, handle, _, hook = self.buffer.low_latency_dispatch(
            x, topk_idx, self.max_decode_tokens, self.num_experts, use_fp8=False, async_finish=False,
            return_recv_hook=True)
        hook()  # the receive (a framework overlaps other work before it)
        y = torch.zeros(recv_x.shape, dtype=torch.bfloat16, device=recv_x.device)
        for e, count in enumerate(recv_count.tolist()):
            if count:
                y[e, :count] = self._expert(recv_x[e, :count], self.w13[e], self.w2[e]).to(torch.bfloat16)
        combined_x, _, _ = self.buffer.low_latency_combine(y, topk_idx, topk_weights, handle)
        return combined_x

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """The same block without expert parallelism (every expert's weights on this rank), in FP32."""
        topk_idx, topk_weights = self.route(x)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for k in range(self.topk):
            for e in topk_idx[:, k].unique().tolist():
                rows = torch.nonzero(topk_idx[:, k] == e).flatten()
                y = self._expert(x[rows], self.all_w13[e].to(x.device), self.all_w2[e].to(x.device))
                out.index_add_(0, rows, y * topk_weights[rows, k].unsqueeze(1))
        return out


def worker(ctx, args) -> dict:
    dev = ctx.device
    moe = DeepEPMoE(ctx.group, args.hidden, args.ffn, args.experts, args.topk, args.batch).to(dev)
    gen = torch.Generator().manual_seed(100 + ctx.rank)
    report = {"rank": ctx.rank, "module": deep_ep.__name__}
    num_prefill = args.prefill + 3 * ctx.rank  # uneven across ranks
    for mode, n in (("normal", num_prefill), ("low_latency", args.batch)):
        x = torch.randn(n, args.hidden, generator=gen).to(torch.bfloat16).to(dev)
        got = moe(x, mode).float()
        want = moe.dense(x)
        scale = want.abs().max().item() or 1.0
        report[mode] = (n, (got - want).abs().max().item() / scale)
    moe.buffer.destroy()
    dist.barrier(group=ctx.group)
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2, help="processes to spawn (ignored under torchrun)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--prefill", type=int, default=24, help="prefill tokens of rank 0 (rank r: 3 r more)")
    p.add_argument("--batch", type=int, default=4, help="decode tokens per rank (low-latency T)")
    p.add_argument("--tolerance", type=float, default=2e-2, help="largest error allowed, relative to the output")
    args = p.parse_args(argv)
    from epcomm.testing import run

    results = run(worker, args.world_size, args, device=args.device)
    ok = True
    for r in results:
        for mode in ("normal", "low_latency"):
            n, err = r[mode]
            good = err <= args.tolerance
            ok &= good
            print(f"rank {r['rank']}: {r['module']} {mode}: {n} tokens, max error {err:.2e} relative to the output "
                  f"-> {'matches' if good else 'DIFFERS FROM'} the dense MoE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
