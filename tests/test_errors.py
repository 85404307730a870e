"""Bad input raises a clear error that starts with the function name; nothing is silently dropped."""

import pytest
import torch

from epcomm import Buffer, Config
from epcomm.errors import EpcommError
from epcomm.testing import spawn


def _bad_calls(ctx):
    """Run every bad call on a 2-rank group; return {name: (exception type, message)}."""
    buf = Buffer(ctx.group)
    other = Buffer(ctx.group)
    n, h, e = 6, 128, 8
    x = torch.randn(n, h).to(torch.bfloat16)
    idx = torch.tensor([[0, 1]] * n)
    w = torch.rand(n, 2)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, e)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                  topk_idx=idx, topk_weights=w)
    _, _, _, _, handle, _ = buf.dispatch(x, **layout)
    ll_recv, _, ll_handle, _, _ = buf.low_latency_dispatch(x, idx, 8, e)
    calls = {
        "dispatch int x": lambda: buf.dispatch(x.to(torch.int32), **layout),
        "dispatch 1-D x": lambda: buf.dispatch(x[0], **layout),
        "dispatch fp8 without scales": lambda: buf.dispatch((x.to(torch.float8_e4m3fn),), **layout),
        "dispatch scales wrong rows": lambda: buf.dispatch(
            (x.to(torch.float8_e4m3fn), torch.ones(n + 1, 1)), **layout),
        "dispatch no layout": lambda: buf.dispatch(x, topk_idx=idx),
        "dispatch topk out of range": lambda: buf.dispatch(x, **{**layout, "topk_idx": idx + 7}),
        "dispatch topk float": lambda: buf.dispatch(x, **{**layout, "topk_idx": idx.float()}),
        "dispatch topk rows": lambda: buf.dispatch(x, **{**layout, "topk_idx": idx[:-1], "topk_weights": w[:-1]}),
        "dispatch weights dtype": lambda: buf.dispatch(x, **{**layout, "topk_weights": w.double()}),
        "dispatch weights a list": lambda: buf.dispatch(x, **{**layout, "topk_weights": w.tolist()}),
        "dispatch layout mismatch": lambda: buf.dispatch(x, **{**layout, "num_tokens_per_rank": per_rank + 1}),
        "dispatch alignment 0": lambda: buf.dispatch(x, **layout, expert_alignment=0),
        "dispatch cached with topk": lambda: buf.dispatch(x, handle=handle, topk_idx=idx),
        "dispatch handle of other buffer": lambda: other.dispatch(x, handle=handle),
        "dispatch handle wrong rows": lambda: buf.dispatch(x[:-1], handle=handle),
        "layout out of range": lambda: buf.get_dispatch_layout(idx - 2, e),
        "layout experts not divisible": lambda: buf.get_dispatch_layout(idx, 7),
        "combine wrong rows": lambda: buf.combine(torch.zeros(handle.num_recv_tokens + 1, h, dtype=torch.bfloat16),
                                                  handle),
        "combine other buffer": lambda: other.combine(torch.zeros(handle.num_recv_tokens, h, dtype=torch.bfloat16),
                                                      handle),
        "combine weights a list": lambda: buf.combine(torch.zeros(handle.num_recv_tokens, h, dtype=torch.bfloat16),
                                                      handle, topk_weights=[[1.0, 1.0]] * handle.num_recv_tokens),
        "combine bad bias": lambda: buf.combine(torch.zeros(handle.num_recv_tokens, h, dtype=torch.bfloat16), handle,
                                                bias=torch.zeros(n + 1, h)),
        "combine ll handle": lambda: buf.combine(torch.zeros(handle.num_recv_tokens, h, dtype=torch.bfloat16),
                                                 ll_handle),
        "ll too many tokens": lambda: buf.low_latency_dispatch(x, idx, n - 1, e),
        "ll hidden not 128": lambda: buf.low_latency_dispatch(x[:, :100], idx, 8, e),
        "ll experts not divisible": lambda: buf.low_latency_dispatch(x, idx, 8, 5),
        "ll ue8m0 without round": lambda: buf.low_latency_dispatch(x, idx, 8, e, use_ue8m0=True),
        "ll out of range": lambda: buf.low_latency_dispatch(x, idx + e, 8, e),
        "ll combine wrong shape": lambda: buf.low_latency_combine(ll_recv[0][:1].to(torch.bfloat16), idx, w,
                                                                  ll_handle),
        "ll combine other buffer": lambda: other.low_latency_combine(ll_recv[0].to(torch.bfloat16), idx, w, ll_handle),
        "ll combine logfmt": lambda: buf.low_latency_combine(ll_recv[0].to(torch.bfloat16), idx, w, ll_handle,
                                                             use_logfmt=True),
        "ll combine bad out": lambda: buf.low_latency_combine(ll_recv[0].to(torch.bfloat16), idx, w, ll_handle,
                                                              out=torch.empty(n, h)),
        "ll async with hook": lambda: buf.low_latency_dispatch(x, idx, 8, e, async_finish=True,
                                                               return_recv_hook=True),
        "ll combine async with hook": lambda: buf.low_latency_combine(ll_recv[0].to(torch.bfloat16), idx, w,
                                                                      ll_handle, async_finish=True,
                                                                      return_recv_hook=True),
    }
    seen = {}
    for name, call in calls.items():
        try:
            call()
            seen[name] = (None, "no exception")
        except Exception as exc:  # noqa: BLE001
            seen[name] = (type(exc).__name__, str(exc))
    other.destroy()
    buf.destroy()
    try:
        buf.dispatch(x, handle=handle)
        seen["use after destroy"] = (None, "no exception")
    except EpcommError as exc:
        seen["use after destroy"] = (type(exc).__name__, str(exc))
    return seen


EXPECTED_PREFIX = {
    "dispatch": "Buffer.dispatch:", "layout": "Buffer.get_dispatch_layout:", "combine": "Buffer.combine:",
    "ll combine": "Buffer.low_latency_combine:", "ll": "Buffer.low_latency_dispatch:", "use": "Buffer.dispatch:",
}


def _prefix(name: str) -> str:
    for key in sorted(EXPECTED_PREFIX, key=len, reverse=True):
        if name.startswith(key):
            return EXPECTED_PREFIX[key]
    raise KeyError(name)


@pytest.fixture(scope="module")
def bad_calls():
    return spawn(_bad_calls, 2, device="cpu")[0]


def test_every_bad_call_raises_with_function_name(bad_calls):
    problems = [f"{name}: {kind} {msg}" for name, (kind, msg) in bad_calls.items()
                if kind is None or not msg.startswith(_prefix(name))]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name, fragment", [
    ("dispatch topk out of range", "outside [-1, 8)"),
    ("layout out of range", "outside [-1, 8)"),
    ("layout experts not divisible", "multiple of the group size 2"),
    ("ll too many tokens", "more than num_max_dispatch_tokens_per_rank"),
    ("dispatch handle of other buffer", "another Buffer"),
    ("ll combine other buffer", "another Buffer"),
    ("dispatch layout mismatch", "does not match"),
    ("dispatch no layout", "get_dispatch_layout"),
    ("ll ue8m0 without round", "round_scale=True"),
    ("use after destroy", "destroyed"),
    ("ll async with hook", "cannot be combined"),
    ("ll combine async with hook", "cannot be combined"),
    ("dispatch weights a list", "got list"),
    ("combine weights a list", "got list"),
])
def test_messages_say_how_to_fix(bad_calls, name, fragment):
    assert fragment in bad_calls[name][1]


def test_config_and_num_sms_validation():
    with pytest.raises(ValueError, match="^Config: num_sms=3"):
        Config(3)
    with pytest.raises(ValueError, match="^Config: num_max_nvl_chunked_recv_tokens"):
        Config(20, 8, 4)
    with pytest.raises(ValueError, match="^Buffer.set_num_sms"):
        Buffer.set_num_sms(5)
    assert Config(24).num_channels == 12
    with pytest.raises(ValueError, match="^Config: strict_sms='yes'"):
        Config(24, strict_sms="yes")


@pytest.mark.parametrize("send_bytes, link_gbps, max_sms, num_ranks, expected", [
    (235 << 20, 400.0, 132, 4, 24),  # a DeepSeek-sized call over NVLink4: 24 SMs, DeepEP's tuned choice
    (235 << 20, 400.0, 132, 2, 36),  # 2 ranks: half of the work is the rank's own rows, 1.5x the SMs of 4 ranks
    (235 << 20, 400.0, 132, 3, 28),
    (235 << 20, 400.0, 132, 8, 40),  # stores fanned out to 8 ranks: each SM's rate falls, more SMs
    (235 << 20, 400.0, 132, 5, 40),
    (235 << 20, 400.0, 16, 4, 16),  # never more than the device has
    (3 << 20, 400.0, 132, 4, 4),  # a small call: about one SM per MiB, rounded up to even
    (3 << 20, 400.0, 132, 8, 4),
    (0, 400.0, 132, 4, 2),  # at least two
    (235 << 20, 25.0, 132, 4, 2),  # PCIe: two SMs already saturate the link
    (235 << 20, 25.0, 132, 2, 4),
    (235 << 20, 25.0, 132, 8, 4),
    (470 << 20, 400.0, 132, 1, 132),  # one rank: local copies, no link to saturate; bounded by the bytes
    (16 << 20, 400.0, 132, 1, 16),
])
def test_num_sms_traffic_model(send_bytes, link_gbps, max_sms, num_ranks, expected):
    from epcomm.core.config import model_num_sms

    got = model_num_sms(send_bytes, link_gbps, max_sms, num_ranks)
    assert got == expected and got % 2 == 0
    assert Config().num_sms is None and Config().num_channels is None  # the default: chosen per call
    with pytest.raises(ValueError, match="^model_num_sms: link_gbps"):
        model_num_sms(1, 0.0, 132, 4)
    with pytest.raises(ValueError, match="num_ranks=0 >= 1"):
        model_num_sms(1, 400.0, 132, 0)


def _capture_over_gloo(ctx):
    """A capture with the portable transport over a gloo group that carries CUDA tensors (ranks sharing a GPU):
    the CPU stands in for CUDA, the capture for torch's capture state."""
    from unittest import mock

    buf = Buffer(ctx.group, transport="alltoall")
    try:
        idx = torch.tensor([[0, 1]] * 4)
        x = torch.randn(4, 64).to(torch.bfloat16)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 4)
        buf.runtime._capturable = False  # what a gloo group on CUDA devices sets
        with mock.patch.object(torch.cuda, "is_current_stream_capturing", return_value=True):
            try:
                buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                             num_tokens_per_expert=per_expert, topk_idx=idx, num_worst_tokens=8)
            except EpcommError as exc:
                return str(exc)
        return None
    finally:
        buf.destroy()


def test_graph_capture_over_gloo_is_a_clear_error():
    msg = spawn(_capture_over_gloo, 2, device="cpu")[0]
    assert msg is not None and msg.startswith("AllToAllTransport: rank 0"), msg
    assert "cannot be captured in a CUDA graph" in msg and "NCCL" in msg and "transport='nvlink'" in msg
