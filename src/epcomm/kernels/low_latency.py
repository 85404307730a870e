"""Triton kernels of the one-sided low-latency (decode) dispatch and combine, and their launchers.

Used by ``epcomm.transports.low_latency.OneSidedLowLatency``, whose docstring describes the protocol; nothing
here talks to ``torch.distributed``. Every address of symmetric storage is ``bases[rank] + byte offset``
(``epcomm.shmem.SymmetricHeap``); the offsets of one call geometry are compile-time constants.

Per rank, symmetric (offsets from the heap base, see ``epcomm.core.layout.low_latency_area``):
  * ``flags`` int64 ``[2 kinds, 2 parities, R]``: slot ``(kind, p, s)`` is written only by rank ``s``, a
    release store of the epoch (call number + 1) of its latest call of that kind and parity;
  * dispatch area of parity p: ``pay [R, T, XW]`` int32 words of payload, ``scl [R, T, SW]`` scale words
    (row ``t`` of region ``s``: token ``t`` of source ``s``, if it selected an expert here), ``meta [R, C]``
    int32 records ``token * K + slot``, ``cnt [R, E_local]`` int32 records per (source, local expert).
    Source ``s`` writes only region ``s``: its records for this rank ordered by (expert, token, slot);
  * combine area of parity p: ``rows [T * K, H]`` bf16, row ``token * K + slot`` of this rank's tokens.
Per rank, local int64 control words ``ctl`` (``CTL_*``): call counters (the parity lives on the device, so a
captured CUDA graph alternates buffers on every replay), arrival counters, the error record, and a ring of
per-call words that carry a send's call number to its separately launched receive (hooks).

Ordering (``epcomm.kernels.shmem``): payload, scales, records and counts are plain stores; every program
fences (system scope) and arrives on a local counter; the last one releases the epoch into every peer's
flag. Receivers acquire-poll their flags with a timeout that records an error instead of hanging, then read
with ``.cg`` loads (L2, never a stale L1 line). A kernel may run the send half, the receive half or both
(``DO_SEND``/``DO_RECV``): fused, every program waits for flags that the same launch's last program releases,
so the fused form needs all programs resident at once: on a GPU it is launched cooperatively with at most as
many programs as fit (``StageLauncher``); under the interpreter, which runs programs one after another, with one
program.

Numerics: the FP8 cast is ``epcomm.fp8``'s definition computed in integer and correctly rounded float32
operations (bit-identical to torch on GPUs and under the interpreter), and the combine adds
``w * float(y)`` slot by slot from +0.0 with the product rounded first (launch with ``enable_fp_fusion=False``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..fp8 import FP8_AMAX_FLOOR, FP8_MAX_INV
from .numerics import f32_to_bf16_rne, pick
from .launch import Launcher
from .shmem import arrive_last, fence_sys, ld_acquire, st_release, wait_all_ge

# control words (int64) of ``OneSidedLowLatency._ctl``
CTL_STATE = 0  # [2] calls made: dispatch, combine
CTL_COUNTER = 2  # [2] arrival counters of the send halves
CTL_ERR = 8  # [8] first timeout: [code, rank, peer, slot, expected, seen, cmp, 0]
CTL_OVERFLOW = 16  # rows dropped: more than fit their region (expert ids within a token repeated)
CTL_BAD = 17  # top-k entries outside [-1, num_experts)
CTL_INFO = 32  # [2, INFO_RING] call number of each recent send, by kind
INFO_RING = 64
CTL_WORDS = CTL_INFO + 2 * INFO_RING

ERR_LL_DISPATCH = 21  # a peer's dispatch rows did not arrive in time
ERR_LL_COMBINE = 22  # a peer's combine rows did not arrive in time

_K_ERR_DISPATCH = tl.constexpr(ERR_LL_DISPATCH)
_K_ERR_COMBINE = tl.constexpr(ERR_LL_COMBINE)
_K_MAX_INV = tl.constexpr(FP8_MAX_INV)
_K_FLOOR = tl.constexpr(FP8_AMAX_FLOOR)
_K_CTL_COUNTER = tl.constexpr(CTL_COUNTER)
_K_CTL_ERR = tl.constexpr(CTL_ERR)
_K_CTL_OVERFLOW = tl.constexpr(CTL_OVERFLOW)
_K_CTL_BAD = tl.constexpr(CTL_BAD)
_K_CTL_INFO = tl.constexpr(CTL_INFO)
_K_INFO_RING = tl.constexpr(INFO_RING)


@triton.jit
def f32_to_e4m3_bits(v):
    """float32 -> float8_e4m3fn bits (uint8) as torch's ``.to(torch.float8_e4m3fn)`` (2.13) and CUDA's
    ``cvt.rn.satfinite`` do: round to nearest even, magnitudes above 448 (infinities too) saturate to +-448,
    NaN -> 0x7f with the sign. (Older torch CPU code gave NaN from 464 up; the cast here never produces more
    than 448 * (1 + 2**-23), where every convention agrees.) Integer operations plus one correctly rounded
    float32 add, so GPUs and the interpreter agree bit for bit."""
    bits = v.to(tl.int32, bitcast=True)
    a = bits & 0x7FFFFFFF
    af = a.to(tl.float32, bitcast=True)
    sub = (af + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)  # below 2**-6: denormal by a float add
    norm = tl.minimum((a - (120 << 23) + 0x7FFFF + ((a >> 20) & 1)) >> 20, 0x7E)
    r = tl.where(a > 0x7F800000, 0x7F, tl.where(a < (121 << 23), sub, norm)) & 0xFF
    r = r | tl.where(bits < 0, 0x80, 0)
    return r.to(tl.uint8)


@triton.jit(do_not_specialize=["n_tokens", "info_slot", "timeout"])
def ll_dispatch_kernel(x_ptr, xs_ptr, idx_ptr, out_x_ptr, out_s_ptr, hmeta_ptr, bases_ptr, ctl_ptr,
                       n_tokens, info_slot, local_base, timeout,
                       RANK: tl.constexpr, R: tl.constexpr, R_P: tl.constexpr, T: tl.constexpr, K: tl.constexpr,
                       K_P: tl.constexpr, KPER: tl.constexpr, E_L: tl.constexpr, E_LP: tl.constexpr, H: tl.constexpr,
                       FP8: tl.constexpr, ROUND: tl.constexpr, UE8M0: tl.constexpr, PRECAST: tl.constexpr,
                       XW: tl.constexpr,
                       XWP: tl.constexpr, SW: tl.constexpr, SWP: tl.constexpr, G4P: tl.constexpr, C: tl.constexpr,
                       OFF_FLAG: tl.constexpr, OFF_D: tl.constexpr, D_BYTES: tl.constexpr, OFF_PAY: tl.constexpr,
                       OFF_SCL: tl.constexpr, OFF_META: tl.constexpr, OFF_CNT: tl.constexpr, JB: tl.constexpr,
                       EB: tl.constexpr, ROWS: tl.constexpr, FB: tl.constexpr, DO_SEND: tl.constexpr,
                       DO_RECV: tl.constexpr, USE_PTX: tl.constexpr, USE_TIMER: tl.constexpr):
    """Low-latency dispatch, send half and/or receive half.

    Send (this rank's ``n_tokens`` tokens, ``x [N, H]``, ``idx [N, K]`` global expert ids): a work item is
    (token, ``KPER`` slots); per slot with a valid id ``g`` on rank ``d``, the row's position in region
    ``RANK`` of ``d``'s dispatch area is the number of (token, slot) pairs of this rank with an id of ``d`` that
    sort before it by (id, token, slot): computed from ``idx`` by every item, no communication; that position
    gets the record ``token * K + slot``. The token itself travels once per destination *rank* (not once per
    expert): read and (FP8) cast once per item, it is stored with its scales into row ``token`` of region
    ``RANK`` by the token's first slot on that rank (``K_P``: ``K`` rounded up to a power of two).
    ``PRECAST`` (with ``FP8``): the tokens were cast already (``epcomm.fp8``, e.g. at the source of a hierarchical
    call): ``x`` holds their e4m3 bytes ``[N, H]`` (uint8) and ``xs`` their float32 scales ``[N, H / 128]``
    (powers of two when ``ROUND``), which are stored as they are (``UE8M0``: their exponent bytes packed four to
    a word, as the cast packs them); unused otherwise. Programs
    also count the records of every expert into the receivers' ``cnt``. Then fence, arrive, and the last
    program releases the epoch to every rank.

    Receive: wait for every source's epoch, read ``cnt``, and copy each source's records (expert-major) into
    ``out_x [E_L, R * T, ...]`` at ``begin[e, s] + i``, the row and scales of each from the source's row of
    that record's token (a row is read once per expert that selected it); column-major scales; ``hmeta`` (int32) gets
    ``recv_count [E_L] | layout_range [E_L, R, 2] | src_info [E_L, R*T] (-1 past the count) | route [E_L, R*T]``
    (``route = s * T * K + token * K + slot``: where combine returns the row)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    err_ptr = ctl_ptr + _K_CTL_ERR
    E: tl.constexpr = E_L * R
    RT: tl.constexpr = R * T
    M_LR: tl.constexpr = E_L
    M_SRC: tl.constexpr = E_L + 2 * E_L * R
    M_ROUTE: tl.constexpr = M_SRC + E_L * RT
    G: tl.constexpr = H // 128
    if DO_SEND:
        call = tl.load(ctl_ptr)
        parity = call & 1
        area = OFF_D + parity * D_BYTES
        nk = n_tokens * K
        NG: tl.constexpr = (K + KPER - 1) // KPER
        lanes = tl.arange(0, KPER)
        jr = tl.arange(0, JB)
        a4 = tl.arange(0, G4P)[:, None, None]
        b4 = tl.arange(0, 4)[None, :, None]
        grp = a4 * 4 + b4  # [G4P, 4, 1] scale group of the chunk
        xoff = grp * 128 + tl.arange(0, 128)[None, None, :]  # element offsets in the row
        gmask = grp < G
        wcols = tl.arange(0, XWP)
        it = pid
        while it < n_tokens * NG:
            t = it // NG
            ks = (it - t * NG) * KPER + lanes
            kmask = ks < K
            g = tl.load(idx_ptr + t * K + ks, mask=kmask, other=-1).to(tl.int32)
            valid = (g >= 0) & (g < E)
            nbad = tl.sum(((g < -1) | (g >= E)).to(tl.int32))
            dest = tl.where(valid, g // E_L, 0)
            lo = dest * E_L
            flat = t * K + ks
            # the first slot of the token on each destination rank stores the row there
            kall = tl.arange(0, K_P)
            gall = tl.load(idx_ptr + t * K + kall, mask=kall < K, other=-1).to(tl.int32)
            dall = tl.where((gall >= 0) & (gall < E), gall // E_L, -1)
            earlier = (dall[None, :] == dest[:, None]) & (kall[None, :] < ks[:, None])
            first = valid & (tl.sum(earlier.to(tl.int32), axis=1) == 0)
            # the token, cast once for every slot
            if FP8:
                if PRECAST:  # cast already: its bytes and float32 scales as they are
                    q = tl.load(x_ptr.to(tl.pointer_type(tl.uint8)) + t.to(tl.int64) * H + xoff, mask=gmask,
                                other=0)
                    g2s = tl.reshape(grp, [G4P, 4])
                    scale = tl.load(xs_ptr.to(tl.pointer_type(tl.float32)) + t.to(tl.int64) * G + g2s,
                                    mask=g2s < G, other=0.0)  # [G4P, 4]
                else:
                    xv = tl.load(x_ptr + t.to(tl.int64) * H + xoff, mask=gmask, other=0.0).to(tl.float32)
                    amax = tl.maximum(tl.max(tl.abs(xv), axis=2), _K_FLOOR)  # [G4P, 4]
                    scale = amax * _K_MAX_INV
                    if ROUND:
                        sb = scale.to(tl.int32, bitcast=True)
                        eb = ((sb >> 23) & 0xFF) + ((sb & 0x7FFFFF) != 0).to(tl.int32)
                        scale = (eb << 23).to(tl.float32, bitcast=True)
                        inv = ((254 - eb) << 23).to(tl.float32, bitcast=True)
                    else:
                        inv = tl.math.div_rn(tl.zeros_like(amax) + 448.0, amax)
                    q = f32_to_e4m3_bits(xv * inv[:, :, None])
                if UE8M0:
                    ebm = tl.where(tl.reshape(gmask, [G4P, 4]), (scale.to(tl.int32, bitcast=True) >> 23) & 0xFF, 0)
                    shifts = (tl.arange(0, 4) * 8).to(tl.int64)
                    swords = tl.sum(ebm.to(tl.int64) << shifts[None, :], axis=1).to(tl.int32)  # [G4P]
                else:
                    swords = scale.to(tl.int32, bitcast=True)  # [G4P, 4]
            else:
                xw = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + t.to(tl.int64) * XW + wcols, mask=wcols < XW)
            # position of each slot in its destination's region: rank by (id, token, slot) within the rank
            pos = tl.zeros([KPER], tl.int32)
            j0 = 0
            while j0 < nk:
                jj = j0 + jr
                gj = tl.load(idx_ptr + jj, mask=jj < nk, other=-1).to(tl.int32)
                before = (gj[None, :] < g[:, None]) | ((gj[None, :] == g[:, None]) & (jj[None, :] < flat[:, None]))
                hit = (gj[None, :] >= lo[:, None]) & (gj[None, :] < E) & before
                pos += tl.sum(hit.to(tl.int32), axis=1)
                j0 += JB
            ok = valid & (pos < C)
            nover = tl.sum((valid & (pos >= C)).to(tl.int32))
            if nbad + nover > 0:
                tl.atomic_add(ctl_ptr + _K_CTL_BAD, nbad.to(tl.int64))
                tl.atomic_add(ctl_ptr + _K_CTL_OVERFLOW, nover.to(tl.int64))
            row = (RANK * C + pos).to(tl.int64)
            region = tl.load(bases_ptr + dest) + area
            tl.store((region + OFF_META + row * 4).to(tl.pointer_type(tl.int32)), flat, mask=ok)
            prow = (RANK * T + t).to(tl.int64)
            pay = region + OFF_PAY + prow * (XW * 4)
            scl = region + OFF_SCL + prow * (SW * 4)
            for i in tl.static_range(KPER):
                if pick(first.to(tl.int32), lanes, i) != 0:
                    if FP8:
                        dst8 = tl.multiple_of(pick(pay, lanes, i).to(tl.pointer_type(tl.uint8)), 16)
                        tl.store(dst8 + xoff, q, mask=gmask)
                        sdst = pick(scl, lanes, i).to(tl.pointer_type(tl.int32))
                        if UE8M0:
                            w1 = tl.arange(0, G4P)
                            tl.store(sdst + w1, swords, mask=w1 < SW)
                        else:
                            g2 = tl.arange(0, G4P)[:, None] * 4 + tl.arange(0, 4)[None, :]
                            tl.store(sdst + g2, swords, mask=g2 < SW)
                    else:
                        dst = tl.multiple_of(pick(pay, lanes, i).to(tl.pointer_type(tl.int32)), 16)
                        tl.store(dst + wcols, xw, mask=wcols < XW)
            it += nprog
        # rows per expert, into every receiver's cnt[RANK, :]
        er = tl.arange(0, EB)
        g0 = pid * EB
        while g0 < E:
            gg = g0 + er
            em = gg < E
            cnt = tl.zeros([EB], tl.int32)
            j0 = 0
            while j0 < nk:
                jj = j0 + jr
                gj = tl.load(idx_ptr + jj, mask=jj < nk, other=-1).to(tl.int32)
                cnt += tl.sum((gj[None, :] == gg[:, None]).to(tl.int32), axis=1)
                j0 += JB
            dd = tl.where(em, gg // E_L, 0)
            ca = tl.load(bases_ptr + dd) + area + OFF_CNT + (RANK * E_L + gg - dd * E_L) * 4
            tl.store(ca.to(tl.pointer_type(tl.int32)), cnt, mask=em)
            g0 += nprog * EB
        # data, then flag: the last program releases the epoch to every rank
        fence_sys(USE_PTX)
        tl.debug_barrier()
        if arrive_last(ctl_ptr + _K_CTL_COUNTER, nprog) != 0:
            fence_sys(USE_PTX)
            tl.store(ctl_ptr, call + 1)
            tl.store(ctl_ptr + _K_CTL_INFO + info_slot, call)
            peers = tl.arange(0, R_P)
            safe = tl.where(peers < R, peers, RANK)  # spare lanes repeat this rank's own slot
            fa = tl.load(bases_ptr + safe) + OFF_FLAG + (parity * R + RANK) * 8
            st_release(fa.to(tl.pointer_type(tl.int64)), tl.zeros([R_P], tl.int64) + call + 1, USE_PTX)
    if DO_RECV:
        if DO_SEND:
            rcall = call
        else:
            rcall = tl.load(ctl_ptr + _K_CTL_INFO + info_slot)
        rpar = rcall & 1
        rarea = local_base + OFF_D + rpar * D_BYTES
        if ld_acquire(err_ptr, USE_PTX) == 0:  # after a timeout every later receive fails fast
            wait_all_ge(local_base, OFF_FLAG + rpar * (R * 8), R, rcall + 1, timeout, err_ptr, _K_ERR_DISPATCH,
                        RANK, R_P, USE_PTX, USE_TIMER)
        tl.debug_barrier()
        s2 = tl.arange(0, R_P)[:, None]
        e2 = tl.arange(0, E_LP)[None, :]
        m2 = (s2 < R) & (e2 < E_L)
        cnt2 = tl.load((rarea + OFF_CNT + (s2 * E_L + e2) * 4).to(tl.pointer_type(tl.int32)), mask=m2, other=0,
                       cache_modifier=".cg")
        cnt2 = tl.minimum(tl.maximum(cnt2, 0), C)  # rows past a region's capacity were not sent
        incl = tl.cumsum(cnt2, axis=1)
        incl_c = tl.minimum(incl, C)
        cc = incl_c - tl.minimum(incl - cnt2, C)  # rows of (source, expert) in the source's region
        first = incl_c - cc  # their first row in that region
        begin = tl.cumsum(cc, axis=0) - cc  # their first row in the expert's output
        rc = tl.minimum(tl.sum(cc, axis=0), RT)  # [E_LP]
        e1 = tl.arange(0, E_LP)
        if pid == 0:
            tl.store(hmeta_ptr + e1, rc, mask=e1 < E_L)
            lr = hmeta_ptr + M_LR + (e2 * R + s2) * 2
            tl.store(lr, begin, mask=m2)
            tl.store(lr + 1, cc, mask=m2)
        # work units: ROWS consecutive output rows of one expert (contiguous stores, coalesced column-major
        # scales); a unit's rows come from one or more sources, found from the expert's column of begin
        nch = (rc + ROWS - 1) // ROWS  # [E_LP]
        uend = tl.cumsum(nch, 0)
        units = tl.sum(nch)
        if pid == 0:
            nover = tl.sum(tl.sum(cc, axis=0) - rc)  # rows past R * T (expert ids repeated within tokens)
            if nover > 0:
                tl.atomic_add(ctl_ptr + _K_CTL_OVERFLOW, nover.to(tl.int64))
        rr = tl.arange(0, ROWS)
        s1 = tl.arange(0, R_P)
        wc = tl.arange(0, XWP)
        sc = tl.arange(0, SWP)
        u = pid
        while u < units:
            e = tl.sum((uend <= u).to(tl.int32))
            eh = e1 == e
            p0 = (u - tl.sum(tl.where(eh, uend - nch, 0))) * ROWS
            ecol = e2 == e
            b_e = tl.sum(tl.where(ecol, begin, 0), axis=1)  # [R_P] first output row of each source
            f_e = tl.sum(tl.where(ecol, first, 0), axis=1)  # [R_P] its first record in the source's region
            c_e = tl.sum(tl.where(ecol, cc, 0), axis=1)
            pos = p0 + rr
            ok = pos < tl.sum(tl.where(eh, rc, 0))
            s = tl.sum((((b_e + c_e)[None, :] <= pos[:, None]) & (s1 < R)[None, :]).to(tl.int32), axis=1)
            sh = s1[None, :] == s[:, None]
            j = tl.sum(tl.where(sh, (f_e - b_e)[None, :], 0), axis=1) + pos
            m = tl.load((rarea + OFF_META + (s * C + j).to(tl.int64) * 4).to(tl.pointer_type(tl.int32)), mask=ok,
                        other=0, cache_modifier=".cg")
            src_row = (s * T + m // K).to(tl.int64)
            dst_row = e.to(tl.int64) * RT + pos
            src = tl.multiple_of((rarea + OFF_PAY + src_row * (XW * 4)).to(tl.pointer_type(tl.int32)), 16)
            cm = ok[:, None] & (wc < XW)[None, :]
            v = tl.load(src[:, None] + wc[None, :], mask=cm, cache_modifier=".cg")
            tl.store(out_x_ptr.to(tl.pointer_type(tl.int32)) + dst_row[:, None] * XW + wc[None, :], v, mask=cm)
            if FP8:
                smask = ok[:, None] & (sc < SW)[None, :]
                ssrc = (rarea + OFF_SCL + src_row * (SW * 4)).to(tl.pointer_type(tl.int32))
                sv = tl.load(ssrc[:, None] + sc[None, :], mask=smask, cache_modifier=".cg")
                sdst = out_s_ptr.to(tl.pointer_type(tl.int32)) + e.to(tl.int64) * (SW * RT)
                tl.store(sdst + sc[None, :].to(tl.int64) * RT + pos[:, None], sv, mask=smask)
            tl.store(hmeta_ptr + M_SRC + dst_row, m // K, mask=ok)
            tl.store(hmeta_ptr + M_ROUTE + dst_row, s * (T * K) + m, mask=ok)
            u += nprog
        # src_info = -1 past each expert's count
        fl = tl.arange(0, FB)
        ee = pid
        while ee < E_L:
            p0 = tl.sum(tl.where(e1 == ee, rc, 0))
            while p0 < RT:
                p = p0 + fl
                tl.store(hmeta_ptr + M_SRC + ee * RT + p, tl.full([FB], -1, tl.int32), mask=p < RT)
                p0 += FB
            ee += nprog


@triton.jit(do_not_specialize=["n_tokens", "info_slot", "timeout"])
def ll_combine_kernel(y_ptr, idx_ptr, w_ptr, out_ptr, hmeta_ptr, bases_ptr, ctl_ptr,
                      n_tokens, info_slot, local_base, timeout,
                      RANK: tl.constexpr, R: tl.constexpr, R_P: tl.constexpr, T: tl.constexpr, K: tl.constexpr,
                      E_L: tl.constexpr, E_LP: tl.constexpr, H: tl.constexpr, HWP: tl.constexpr,
                      OFF_FLAG: tl.constexpr, OFF_C: tl.constexpr, C_BYTES: tl.constexpr, ROWS: tl.constexpr,
                      BC: tl.constexpr, DO_SEND: tl.constexpr, DO_RECV: tl.constexpr, USE_PTX: tl.constexpr,
                      USE_TIMER: tl.constexpr):
    """Low-latency combine, send half and/or receive half.

    Send: every received row ``(e, i < recv_count[e])`` of ``y [E_L, R * T, H]`` bf16 goes to row
    ``token * K + slot`` of its source's combine area (``route`` in ``hmeta``); then fence, arrive, and the
    last program releases the epoch to every rank (every rank waits for every rank, rows or not).
    Receive: wait, then ``out[t] = bf16(sum over k ascending with a valid id of w[t, k] * float(row))``,
    from +0.0, each product rounded before the add."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    err_ptr = ctl_ptr + _K_CTL_ERR
    E: tl.constexpr = E_L * R
    RT: tl.constexpr = R * T
    TK: tl.constexpr = T * K
    HW: tl.constexpr = H // 2
    M_ROUTE: tl.constexpr = E_L + 2 * E_L * R + E_L * RT
    if DO_SEND:
        call = tl.load(ctl_ptr + 1)
        parity = call & 1
        area = OFF_C + parity * C_BYTES
        e1 = tl.arange(0, E_LP)
        rc = tl.load(hmeta_ptr + e1, mask=e1 < E_L, other=0)
        rc = tl.minimum(tl.maximum(rc, 0), RT)
        endc = tl.cumsum(rc, 0)
        total = tl.sum(rc)
        rr = tl.arange(0, ROWS)
        wc = tl.arange(0, HWP)
        q0 = pid * ROWS
        while q0 < total:
            q = q0 + rr
            qm = q < total
            e = tl.sum((endc[None, :] <= q[:, None]).to(tl.int32), axis=1)
            i = q - tl.sum(tl.where(e1[None, :] == e[:, None], (endc - rc)[None, :], 0), axis=1)
            row = (e * RT + i).to(tl.int64)
            route = tl.load(hmeta_ptr + M_ROUTE + row, mask=qm, other=0)
            s = route // TK
            ok = qm & (s >= 0) & (s < R)
            m = (route - s * TK).to(tl.int64)
            dst = tl.load(bases_ptr + tl.where(ok, s, 0)) + area + m * (H * 2)
            dst = tl.multiple_of(dst.to(tl.pointer_type(tl.int32)), 16)
            cm = ok[:, None] & (wc < HW)[None, :]
            v = tl.load(y_ptr.to(tl.pointer_type(tl.int32)) + row[:, None] * HW + wc[None, :], mask=cm)
            tl.store(dst[:, None] + wc[None, :], v, mask=cm)
            q0 += nprog * ROWS
        fence_sys(USE_PTX)
        tl.debug_barrier()
        if arrive_last(ctl_ptr + _K_CTL_COUNTER + 1, nprog) != 0:
            fence_sys(USE_PTX)
            tl.store(ctl_ptr + 1, call + 1)
            tl.store(ctl_ptr + _K_CTL_INFO + _K_INFO_RING + info_slot, call)
            peers = tl.arange(0, R_P)
            safe = tl.where(peers < R, peers, RANK)
            fa = tl.load(bases_ptr + safe) + OFF_FLAG + ((2 + parity) * R + RANK) * 8
            st_release(fa.to(tl.pointer_type(tl.int64)), tl.zeros([R_P], tl.int64) + call + 1, USE_PTX)
    if DO_RECV:
        if DO_SEND:
            rcall = call
        else:
            rcall = tl.load(ctl_ptr + _K_CTL_INFO + _K_INFO_RING + info_slot)
        rpar = rcall & 1
        rarea = local_base + OFF_C + rpar * C_BYTES
        if ld_acquire(err_ptr, USE_PTX) == 0:
            wait_all_ge(local_base, OFF_FLAG + (2 + rpar) * (R * 8), R, rcall + 1, timeout, err_ptr,
                        _K_ERR_COMBINE, RANK, R_P, USE_PTX, USE_TIMER)
        tl.debug_barrier()
        NCH: tl.constexpr = (H + BC - 1) // BC
        cols0 = tl.arange(0, BC)
        it = pid
        while it < n_tokens * NCH:
            t = it // NCH
            cols = (it - t * NCH) * BC + cols0
            cm = cols < H
            acc = tl.zeros([BC], tl.float32)
            for k in tl.static_range(K):
                g = tl.load(idx_ptr + t * K + k)
                valid = (g >= 0) & (g < E)
                wk = tl.load(w_ptr + t * K + k)
                src = (rarea + (t * K + k).to(tl.int64) * (H * 2)).to(tl.pointer_type(tl.bfloat16))
                y = tl.load(tl.multiple_of(src, 16) + cols, mask=cm & valid, other=0.0, cache_modifier=".cg")
                acc = tl.where(valid, acc + wk * y.to(tl.float32), acc)
            tl.store(out_ptr + t.to(tl.int64) * H + cols, f32_to_bf16_rne(acc), mask=cm)
            it += nprog


# ---------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------
# Registers per thread of a fused low-latency kernel (256 threads): 2 programs per SM. Uncapped, ptxas gave the FP8
# dispatch 166 (1 program per SM: one fused call filled the GPU) and, after small changes elsewhere in the kernel,
# 128 with spills; capped, 124 without spills (sm_90, hidden 7168, top-8).
FUSED_MAXNREG = 128


class StageLauncher:
    """``ll_dispatch_kernel`` / ``ll_combine_kernel`` with the transport's fixed constants; each call picks
    the halves to run (``DO_SEND`` / ``DO_RECV``). Launches go through ``launch.Launcher`` (no argument
    binding after the first launch of a variant); integer arguments are ``do_not_specialize`` except
    ``local_base``, which is always a multiple of 256. On GPUs the fused form (both halves: every program waits
    for the flag its launch's last program releases) is launched cooperatively, its grid capped at the programs
    the GPU holds at once (``epcomm.kernels.launch``, "Co-residency"), and compiled with at most ``FUSED_MAXNREG``
    registers per thread: two programs per SM, so that two fused calls (two Buffers, or two micro-batches on two
    streams) are resident together and cannot wait for each other."""

    def __init__(self, kernel, consts: dict, options: dict) -> None:
        self.launcher = Launcher(kernel)
        fused = dict(launch_cooperative_grid=True, maxnreg=FUSED_MAXNREG) if consts.get("USE_PTX") else {}
        self._kwargs = {(s, r): dict(consts, **options, DO_SEND=s, DO_RECV=r, **(fused if s and r else {}))
                        for s in (False, True) for r in (False, True)}
        self._grids: dict = {}

    def kwargs(self, send: bool, recv: bool) -> dict:
        """The constexprs and options of a launch running the given halves."""
        return self._kwargs[(send, recv)]

    def __call__(self, grid: int, args: tuple, send: bool, recv: bool) -> None:
        kwargs = self._kwargs[(send, recv)]
        if kwargs.get("launch_cooperative_grid"):  # at most ``grid`` programs, as many as fit at once
            fit = self._grids.get(grid)
            if fit is None:
                fit = self._grids[grid] = _capped(grid)
            self.launcher(fit, args, kwargs)
        else:
            self.launcher((grid,), args, kwargs)


def _capped(grid: int):
    """The grid function of a launch of ``grid`` programs that must all be resident at once."""
    return lambda resident: (grid if resident is None else max(1, min(grid, resident)),)


def dispatch_launcher(consts: dict) -> StageLauncher:
    """``ll_dispatch_kernel`` with the transport's constants (``num_warps`` among them)."""
    consts = dict(consts)
    return StageLauncher(ll_dispatch_kernel, consts, {"num_warps": consts.pop("num_warps", 8)})


def combine_launcher(consts: dict) -> StageLauncher:
    """``ll_combine_kernel``, compiled without FMA contraction (the reduction must round every product)."""
    consts = dict(consts)
    options = {"num_warps": consts.pop("num_warps", 8), "enable_fp_fusion": False}
    return StageLauncher(ll_combine_kernel, consts, options)
