"""The ordered-reduction Triton kernel under the Triton interpreter (CPU), bit-exact against torch."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    from epcomm.kernels.reduce import reduce_rows as triton_reduce
    from epcomm.transports.alltoall import reduce_rows as torch_reduce
    from epcomm.testing.checks import same_bits
    gen = torch.Generator().manual_seed(0)
    for n, r, h, rows, nbias, dtype in [(7, 3, 200, 11, 0, torch.bfloat16), (5, 4, 1030, 9, 2, torch.bfloat16),
                                        (4, 2, 64, 0, 1, torch.float32), (3, 1, 96, 3, 0, torch.float16)]:
        buf = torch.randn(rows, h, generator=gen).to(dtype)
        slot = torch.randint(-1, max(rows, 1), (n, r), generator=gen) if rows else torch.full((n, r), -1)
        bias = tuple(torch.randn(n, h, generator=gen).to(dtype) for _ in range(nbias))
        a = triton_reduce(buf, slot, bias, dtype)
        b = torch_reduce(buf, slot, bias, dtype)
        assert same_bits(a, b), (n, r, h, rows, nbias, dtype, (a.float() - b.float()).abs().max())
    # the layout-driven form, one program per token vs a bounded number of persistent programs
    from epcomm.kernels.reduce import reduce_from_layout
    n, r, h, cap, k = 9, 3, 1030, 12, 4
    itr = torch.rand(n, r, generator=gen) < 0.6
    pos = (itr.to(torch.int32).cumsum(0) - itr.to(torch.int32)).to(torch.int32)
    buf = torch.randn(r * cap, h, generator=gen).to(torch.bfloat16)
    wbuf = torch.randn(r * cap, k, generator=gen)
    bias = (torch.randn(n, h, generator=gen).to(torch.bfloat16),)
    outs = []
    for programs in (None, 2, 5):
        out, w_out = torch.empty(n, h, dtype=torch.bfloat16), torch.empty(n, k)
        reduce_from_layout(buf, itr, pos, cap, 1, n, bias, out, w_buf=wbuf, w_out=w_out, programs=programs)
        outs.append((out[1:], w_out[1:]))
    slot = torch.where(itr, torch.arange(r)[None, :] * cap + pos, -1)
    want = torch_reduce(buf, slot[1:], (bias[0][1:],), torch.bfloat16)
    for out, w_out in outs:
        assert same_bits(out, want) and same_bits(w_out, outs[0][1]), "reduce_from_layout: persistent mode differs"
    # rows at a row stride wider than the row (partials landed beside their weights), written beside weights too:
    # the same bits; weights at another row stride are refused (the kernel reads them K apart)
    wide = torch.zeros(r * cap, h + 2 * k + 8, dtype=torch.bfloat16)
    wide[:, :h] = buf
    strided = wide[:, :h]
    o_wide = torch.full((n, h + 2 * k), 7.0, dtype=torch.bfloat16)
    fused_w = torch.full((n, 2 * k), 7.0)
    reduce_from_layout(strided, itr, pos, cap, 1, n, bias, o_wide[:, :h], w_buf=wbuf, w_out=fused_w[:, 1:k + 1])
    assert same_bits(o_wide[1:, :h], want) and same_bits(fused_w[1:, 1:k + 1], outs[0][1]), "strided rows differ"
    assert (o_wide[:, h:] == 7).all() and (fused_w[:, 0] == 7).all() and (fused_w[:, k + 1:] == 7).all()
    for bad, what in ((dict(w_buf=torch.randn(r * cap, 2 * k, generator=gen)[:, :k]), "w_buf"),
                      (dict(bias=(torch.randn(h, n, generator=gen).to(torch.bfloat16).t(),)), "bias[0]")):
        args = {"w_buf": wbuf, "bias": bias, **bad}
        try:
            reduce_from_layout(buf, itr, pos, cap, 1, n, args["bias"], out, w_buf=args["w_buf"], w_out=w_out)
        except ValueError as e:
            assert str(e).startswith("reduce_from_layout: " + what), e
        else:
            raise AssertionError(f"a {what} of another stride was accepted")
    # the rounding helper on every kind of float32: ties, overflow, inf, NaN, subnormals, negatives
    import triton, triton.language as tl
    from epcomm.kernels.numerics import f32_to_bf16_rne

    @triton.jit
    def cast(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + o, f32_to_bf16_rne(tl.load(x_ptr + o, mask=o < n)), mask=o < n)

    bits = torch.randint(-2**31, 2**31 - 1, (4096,), generator=gen, dtype=torch.int64).to(torch.int32)
    special = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -1.0 - 2**-8, 3.3895e38, float("inf"), -float("inf"),
                            0.0, -0.0, 1e-40, -1e-41])
    x = torch.cat([bits.view(torch.float32), special])
    x = x[~x.isnan()]
    y = torch.empty(x.shape, dtype=torch.bfloat16)
    cast[(triton.cdiv(x.numel(), 256),)](x, y, x.numel(), BLOCK=256)
    assert same_bits(y, x.to(torch.bfloat16)), "f32_to_bf16_rne differs from torch"
    nan = torch.full((4,), float("nan"))
    ynan = torch.empty(4, dtype=torch.bfloat16)
    cast[(1,)](nan, ynan, 4, BLOCK=256)
    assert ynan.isnan().all()
    print("OK")
""")


def test_reduce_kernel_matches_torch_bit_exact():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
