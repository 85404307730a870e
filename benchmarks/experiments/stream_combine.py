"""Experiment (NOTES row 39, not used by the library): streaming combine (single round). Push programs [0, NP) each serve one remote destination and
take its rows in steps of TOK dealt round-robin over that destination's programs, so rows arrive in token
order; each publishes tag | rounds done (every PUB rounds, every round in the last TAILR). Reduce programs
[NP, grid) take blocks of TR tokens in order, wait for exactly the progress those tokens need, and reduce
(same ordered FP32 math as epcomm.kernels.reduce)."""
import torch
import triton
import triton.language as tl

from epcomm.kernels.ep import _push_rows, _K_ERR_DONE, chunk_block, pow2_block
from epcomm.kernels.launch import launch, next_pow2
from epcomm.kernels.numerics import f32_to_bf16_rne, pick
from epcomm.kernels.shmem import _ld_acquire_lanes, expired, fence_sys, now, record_error, st_release


@triton.jit
def _wait_lanes(ptrs, target, live, timeout, err_ptr, rank, USE_PTX: tl.constexpr, USE_TIMER: tl.constexpr):
    big = tl.full([], 1 << 62, tl.int64)
    d = tl.min(tl.where(live, _ld_acquire_lanes(ptrs, USE_PTX) - target, big), axis=0)
    ok = (d >= 0).to(tl.int32)
    t0 = now(USE_TIMER)
    polls = tl.full([], 0, tl.int64)
    late = tl.full([], 0, tl.int32)
    while (ok == 0) & (late == 0):
        d = tl.min(tl.where(live, _ld_acquire_lanes(ptrs, USE_PTX) - target, big), axis=0)
        ok = (d >= 0).to(tl.int32)
        polls += 1
        late = expired(t0, polls, timeout, USE_TIMER)
    if ok == 0:
        record_error(err_ptr, _K_ERR_DONE, rank, -1, -1, 0, d, 3)
    return ok


@triton.jit
def stream_combine_kernel(x_ptr, xel_ptr, w_ptr, prefix_ptr, bases_ptr, area_off, w_off, prog_off, epoch_ptr, err_ptr,
                          timeout, itr_ptr, pos_ptr, buf_ptr, wbuf_ptr, out_ptr, wout_ptr, n, cap, rank, num_push,
                          R: tl.constexpr, R_POW2: tl.constexpr, XW: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
                          TOK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, HAS_W: tl.constexpr,
                          VEC: tl.constexpr, PUB: tl.constexpr, TAILR: tl.constexpr, GP: tl.constexpr,
                          PW: tl.constexpr, TR: tl.constexpr, RB: tl.constexpr, NT: tl.constexpr, OUT_BF16: tl.constexpr,
                          USE_PTX: tl.constexpr, USE_TIMER: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tag = tl.load(epoch_ptr) << 32
    rs = tl.arange(0, R_POW2)
    if pid < num_push:
        first = tl.load(prefix_ptr + rs, mask=rs < R, other=0)
        count = tl.load(prefix_ptr + R + rs, mask=(rs < R) & (rs != rank), other=0)
        ne = (count > 0).to(tl.int32)
        total = tl.sum(count)
        extra = (num_push - tl.sum(ne)).to(tl.int64)
        cinc = tl.cumsum(count, 0)
        neinc = tl.cumsum(ne, 0)
        st = tl.maximum(total, 1).to(tl.int64)
        b_inc = neinc + ((extra * cinc) // st).to(tl.int32)
        b_prev = neinc - ne + ((extra * (cinc - count)) // st).to(tl.int32)
        g = tl.where(total > 0, b_inc - b_prev, 0)
        if pid == 0:  # header: how many programs serve each destination
            live = (rs < R) & (rs != rank)
            hb = tl.load(bases_ptr + tl.where(live, rs, rank))
            hp = (hb + prog_off + (rank * PW) * 8).to(tl.pointer_type(tl.int64))
            st_release(hp, tag + tl.where(live, g, 0).to(tl.int64), USE_PTX)
        if total > 0:
            d = tl.sum(((b_inc <= pid) & (rs < R)).to(tl.int32))
            j = pid - pick(b_prev, rs, d)
            G = pick(g, rs, d)
            c = pick(count, rs, d)
            f0 = pick(first, rs, d).to(tl.int64)
            base = tl.load(bases_ptr + d)
            S = tl.cdiv(c, TOK)
            nr = tl.cdiv(tl.maximum(S - j, 0), G)
            toks = tl.arange(0, TOK)
            kcols = tl.arange(0, BLOCK_K)
            two = tl.arange(0, 2)
            myword = (base + prog_off + (rank * PW + 1 + j) * 8 + two * 0).to(tl.pointer_type(tl.int64))
            l = 0
            while l < nr:
                k = ((j + l * G) * TOK + toks).to(tl.int64)
                _push_rows(x_ptr, w_ptr, base, area_off, w_off, f0 + k, rank * cap + k, k < c, kcols, XW, K, BLOCK,
                           HAS_W, VEC)
                l += 1
                if (l % PUB == 0) | (l + TAILR >= nr):
                    fence_sys(USE_PTX)
                    tl.debug_barrier()
                    st_release(myword, tl.zeros([2], tl.int64) + tag + l, USE_PTX)
            if nr == 0:
                st_release(myword, tl.zeros([2], tl.int64) + tag, USE_PTX)
    else:
        q = pid - num_push
        nq = nprog - num_push
        prog_ptr = (tl.load(bases_ptr + rank) + prog_off).to(tl.pointer_type(tl.int64))
        # one element per thread everywhere a word is polled or read (no replicated small tensors)
        lane = tl.arange(0, NT) % (R_POW2 * GP)
        ls = lane // GP
        lj = lane % GP
        speer = (ls < R) & (ls != rank)
        hptr = prog_ptr + tl.where(speer, ls, rank) * PW
        ok = _wait_lanes(hptr, tag, speer, timeout, err_ptr, rank, USE_PTX, USE_TIMER)
        G_l = tl.where(speer, _ld_acquire_lanes(hptr, USE_PTX) - tag, 0).to(tl.int32)
        lpeer = speer & (lj < G_l)
        lptr = prog_ptr + tl.where(lpeer, ls * PW + 1 + lj, rank * PW)
        own0 = tl.load(prefix_ptr + rank).to(tl.int64)
        rows = tl.arange(0, TR)
        kc = tl.arange(0, BLOCK_K)
        b = q
        nb = tl.cdiv(n, TR)
        while b < nb:
            t = (b * TR + rows).to(tl.int64)
            tlive = t < n
            m2 = tlive[:, None] & (rs < R)[None, :]
            there = m2 & (tl.load(itr_ptr + t[:, None] * R + rs[None, :], mask=m2, other=0) != 0)
            p = tl.load(pos_ptr + t[:, None] * R + rs[None, :], mask=there, other=0)
            P = tl.max(tl.where(there, p + 1, 0), axis=0)
            S_l = tl.sum(tl.where(ls[:, None] == rs[None, :], tl.cdiv(P, TOK)[None, :], 0), axis=1)
            need = tl.cdiv(tl.maximum(S_l - lj, 0), tl.maximum(G_l, 1))
            if ok != 0:
                ok = _wait_lanes(lptr, tag + need.to(tl.int64), lpeer & (need > 0), timeout, err_ptr, rank, USE_PTX,
                                 USE_TIMER)
            for cb in tl.static_range(0, H, RB):
                cols = cb + tl.arange(0, RB)
                cm = cols < H
                acc = tl.zeros([TR, RB], tl.float32)
                wacc = tl.zeros([TR, BLOCK_K], tl.float32)
                for r in tl.static_range(R):
                    th = tl.sum(tl.where(rs[None, :] == r, there.to(tl.int32), 0), axis=1) != 0
                    pr = tl.sum(tl.where(rs[None, :] == r, p, 0), axis=1).to(tl.int64)
                    if r == rank:
                        v = tl.load(xel_ptr + (own0 + pr)[:, None] * H + cols[None, :], mask=th[:, None] & cm[None, :],
                                    other=0.0)
                    else:
                        v = tl.load(buf_ptr + (r * cap + pr)[:, None] * H + cols[None, :],
                                    mask=th[:, None] & cm[None, :], other=0.0, cache_modifier=".cg")
                    acc += v.to(tl.float32)
                    if HAS_W:
                        if cb == 0:
                            km = th[:, None] & (kc < K)[None, :]
                            if r == rank:
                                wv = tl.load(w_ptr + (own0 + pr)[:, None] * K + kc[None, :], mask=km, other=0.0)
                            else:
                                wv = tl.load(wbuf_ptr + (r * cap + pr)[:, None] * K + kc[None, :], mask=km, other=0.0,
                                             cache_modifier=".cg")
                            wacc += wv
                om = tlive[:, None] & cm[None, :]
                if OUT_BF16:
                    tl.store(out_ptr + t[:, None] * H + cols[None, :], f32_to_bf16_rne(acc), mask=om)
                else:
                    tl.store(out_ptr + t[:, None] * H + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=om)
                if HAS_W:
                    if cb == 0:
                        tl.store(wout_ptr + t[:, None] * K + kc[None, :], wacc, mask=tlive[:, None] & (kc < K)[None, :])
            b += nq


def stream_combine(self, req, v):
    """NVLinkTransport.combine replacement (single round, no bias) for the A/B."""
    from epcomm import env
    from epcomm.kernels.shmem import timeout_units
    from epcomm.transports.nvlink import _words
    h = req.handle
    st = h.state
    R, rank, dev = self.num_ranks, self.rank, self.device
    x = req.x
    m, n = x.size(0), h.num_tokens
    xw = _words(x)
    k = req.topk_weights.size(1) if req.topk_weights is not None else 0
    geo = st.rounds((xw + k) * 4, self.area_bytes, R, h.num_worst_tokens, "Buffer.combine")
    assert geo.num_rounds == 1 and not req.bias
    cap = geo.cap
    area_off = self._off(self.area)
    from epcomm.transports.nvlink import align_up
    w_rel = align_up(R * cap * xw * 4, 256)
    buf = self.area[:R * cap * xw * 4].view(x.dtype).view(R * cap, -1)
    wbuf = self.area[w_rel:w_rel + R * cap * k * 4].view(torch.float32).view(R * cap, k) if k else None
    out = torch.empty(n, x.size(1), dtype=x.dtype, device=dev)
    out_w = torch.empty(n, k, dtype=torch.float32, device=dev) if k else None
    x_words = x.view(torch.int32) if m else torch.empty(1, xw, dtype=torch.int32, device=dev)
    x_el = x if m else buf
    w_in = req.topk_weights.contiguous() if k else self.counters
    on_gpu = dev.type == "cuda"
    num_push = v.get("np", 18)
    grid = self.sms if on_gpu else num_push + 2
    tok = v.get("TOK", 8)
    gp = next_pow2(num_push)
    itr = h.is_token_in_rank.view(torch.int8)
    self._barrier()
    if True:
        launch(stream_combine_kernel, (grid,), x_words, x_el, w_in, st.recv_prefix, self.heap.peer_bases, area_off,
               area_off + w_rel, self._off(self.prog), self.epoch, self.err, timeout_units(env.timeout_s(), dev),
               itr, st.pos, buf, wbuf if k else buf, out, out_w if k else out, n, cap, rank, num_push, R=R,
               R_POW2=self.r_pow2, XW=xw, H=x.size(1), K=max(k, 1), TOK=tok, BLOCK=chunk_block(xw, tok),
               BLOCK_K=pow2_block(k), HAS_W=k > 0, VEC=xw % 4 == 0, PUB=v.get("PUB", 16), TAILR=v.get("TAILR", 4),
               GP=gp, PW=gp + 1, NT=max(256, 4 * gp) if on_gpu else self.r_pow2 * gp, TR=v.get("TR", 4), RB=v.get("RB", 1024), OUT_BF16=x.dtype == torch.bfloat16,
               num_warps=8, USE_PTX=on_gpu, USE_TIMER=on_gpu)
    return out, out_w
