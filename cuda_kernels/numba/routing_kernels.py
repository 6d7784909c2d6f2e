"""The routing kernels in Numba: one kernel body in three flavours (routing.py launches them).

    T = tokens, E = experts, K = top-k, G = expert groups (num_expert_group),
    W = rows (warps) per block, NT = threads of a "block" row, VPT = values per thread

The math is routing.py's (reference/routing.py); a launch's non-finite rule and rounding is
its mode (MODE_TOPK, MODE_GROUPED below).

    route_kernel("warp", W, VPT)    a row per warp, butterfly cuda.shfl_xor_sync reductions
    route_kernel("block", NT, VPT)  a row per block of NT, shared-memory tree reductions
    route_keys_kernel(W, VPT)       a row per warp, routing.cu's 64-bit keys (GPU default)

"keys" (the GPU default, E <= 1024, K <= 32, G <= 32; else "warp") is the CuPy kernel line
for line: a (value, id) pair is one uint64 key (order-preserving value bits high, 0xFFFFFFFF
- id low), so the argmax is a branch-free unsigned max; lane g scores group g; lane k keeps
the k-th winner and recomputes its weight from the logit. The text below describes "warp"
and "block".

W = WARPS_PER_BLOCK rows per block. The simulator has no shuffles, so it always runs "block"
(ENVIRONMENT.md); the GPU runs "warp" by default and tests both. Thread l of a row owns
experts l, l + L, ..., l + (VPT - 1) L (L = 32 or NT; VPT, values per thread, a power of two
fixed at compile time: one kernel per row width) and keeps their logits, scores and keys in
registers; all its loads (logits, bias) are issued before any math, so they are in flight
together (the first version loaded one per loop step from shared memory and ran 1.2-2x
behind CuPy's register kernel on the H200). Consecutive threads read consecutive logits.
Dynamic shared memory per row, fp32 words: scores [E] (the winners' weights are read from
there), raw choices [E] and group scores [G] (for the group stage), reduction scratch [2 NT]
("block" only); bytes = rows per block * (2E + G + 2 NT) * 4. Top-k is K rounds of a
row-wide argmax over the registers; the winner's owner sets its bit in a `taken` mask.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import float32, int32, int64, uint32, uint64

from ._device import (FULL_MASK, NAN32, NEG_INF32, SIMULATOR, better, cu, device_function, exp_f32,
                      ix, kernel, max_nan, round_as, sel_key, sqrt_softplus_f32, to_f32)

# the non-finite rule and rounding of a launch (reference/routing.py):
MODE_TOPK = 0      # fused_topk / fused_topk_bias: a non-finite score is 0
MODE_GROUPED = 1   # grouped_topk: an expert with a non-finite scoring input is invalid
                   # (ranked last, weight 0; none valid: 1/K or 0), softmax rounded to the
                   # logits' dtype


# ----------------------------------------------------------------------------- reductions
# Every reduction takes (value(s), red_f, red_i, lane) so the kernel body is the same for both
# flavours; the warp versions ignore the scratch arrays.
@device_function
def _warp_max(v, red_f, red_i, lane):
    off = 16
    while off > 0:   # butterfly: after 5 steps every lane holds the row's max
        v = max_nan(v, cu.shfl_xor_sync(FULL_MASK, v, off))
        off >>= 1
    return v


@device_function
def _warp_sum(v, red_f, red_i, lane):
    off = 16
    while off > 0:
        v += cu.shfl_xor_sync(FULL_MASK, v, off)
        off >>= 1
    return v


@device_function
def _warp_argmax(v, i, red_f, red_i, lane):
    off = 16
    while off > 0:   # (value desc, index asc) is a total order: every lane ends on one winner
        ov = cu.shfl_xor_sync(FULL_MASK, v, off)
        oi = cu.shfl_xor_sync(FULL_MASK, i, off)
        if better(ov, oi, v, i):
            v = ov
            i = oi
        off >>= 1
    return v, i


@device_function
def _warp_sync(lane):
    cu.syncwarp(FULL_MASK)


@functools.lru_cache(maxsize=None)
def _block_reductions(NT):
    """Tree reductions over the NT threads of a block (NT a power of two) in shared memory."""

    @device_function
    def bmax(v, red_f, red_i, tid):
        red_f[tid] = v
        cu.syncthreads()
        s = NT // 2
        while s > 0:
            if tid < s:
                red_f[tid] = max_nan(red_f[tid], red_f[tid + s])
            cu.syncthreads()
            s //= 2
        r = red_f[0]
        cu.syncthreads()   # everyone has read the result before the scratch is reused
        return r

    @device_function
    def bsum(v, red_f, red_i, tid):
        red_f[tid] = v
        cu.syncthreads()
        s = NT // 2
        while s > 0:
            if tid < s:
                red_f[tid] = red_f[tid] + red_f[tid + s]
            cu.syncthreads()
            s //= 2
        r = red_f[0]
        cu.syncthreads()
        return r

    @device_function
    def bargmax(v, i, red_f, red_i, tid):
        red_f[tid] = v
        red_i[tid] = i
        cu.syncthreads()
        s = NT // 2
        while s > 0:
            if tid < s:
                if better(red_f[tid + s], red_i[tid + s], red_f[tid], red_i[tid]):
                    red_f[tid] = red_f[tid + s]
                    red_i[tid] = red_i[tid + s]
            cu.syncthreads()
            s //= 2
        rv = red_f[0]
        ri = red_i[0]
        cu.syncthreads()
        return rv, ri

    @device_function
    def bsync(tid):
        cu.syncthreads()

    return bmax, bsum, bargmax, bsync


# ----------------------------------------------------------------------------- the kernel
POS_INF32 = np.float32(np.inf)


@device_function
def is_finite(v):
    """v is neither NaN nor +-inf (comparisons: no floating-point exception raised)."""
    return v > NEG_INF32 and v < POS_INF32


@device_function
def elementwise_score(x, scoring):
    """The scores that need no row reduction: sigmoid(x) (scoring 1) or sqrt(softplus(x))
    (scoring 2, DeepSeek-V4's; MODE_TOPK only), fp32."""
    if scoring == 1:
        return float32(1.0) / (float32(1.0) + exp_f32(-x))
    return sqrt_softplus_f32(x)


@functools.lru_cache(maxsize=None)
def route_kernel(flavor: str, n: int, VPT: int = 1):
    """The routing kernel of one flavour: "warp" with n rows (warps) per block, or "block"
    with n threads (a power of two) per row; VPT (compile time) = values per thread, a power
    of two with E <= VPT * (32 or n)."""
    if flavor == "warp":
        if SIMULATOR:
            raise RuntimeError("flavor: the 'warp' routing kernel uses warp shuffles, which the "
                               "CUDA simulator lacks; use 'block'")
        LANES, NRED, ROWS = 32, 0, n
        rmax, rsum, rargmax, rsync = _warp_max, _warp_sum, _warp_argmax, _warp_sync
    elif flavor == "block":
        if n < 1 or n & (n - 1):
            raise ValueError(f"threads: expected a power of two, got {n}")
        LANES, NRED, ROWS = n, n, 1
        rmax, rsum, rargmax, rsync = _block_reductions(n)
    else:
        raise ValueError(f"flavor: expected 'warp' or 'block', got {flavor!r}")
    if VPT < 1 or VPT > 64 or VPT & (VPT - 1):
        raise ValueError(f"VPT: expected a power of two up to 64, got {VPT}")

    def route(logits, bias, weights, ids, tei, T, E, K, G, topk_group, scoring, renorm,
              has_bias, want_tei, mode, scale):
        """logits [T, E] -> weights f32 [T, K], ids [T, K], tei int32 [T, K] (see module doc).
        Thread l of a row holds experts e = l + LANES j, j < VPT, in registers."""
        tid = cu.threadIdx.x & 1023         # & 1023: LLVM learns tid >= 0
        lane = tid % LANES
        slot = tid // LANES                 # which row of this block
        row = cu.blockIdx.x * ROWS + slot
        if row >= T:                        # whole warps (warp flavour) leave together
            return
        stride = 2 * E + G + 2 * NRED
        base = slot * stride
        dynf = cu.shared.array(0, float32)  # all dynamic shared arrays alias: carve by offset
        dyni = cu.shared.array(0, int32)
        sc = dynf[base:base + E]                              # scores: the winners' weights
        key = dynf[base + E:base + 2 * E]                     # raw choices (groups only)
        gs = dynf[base + 2 * E:base + 2 * E + G]              # group scores
        red_f = dynf[base + 2 * E + G:base + 2 * E + G + NRED]
        red_i = dyni[base + 2 * E + G + NRED:base + stride]
        xs = cu.local.array(VPT, float32)   # this thread's logits, then scores
        ks = cu.local.array(VPT, float32)   # its bias, then selection keys

        # 1. every load first (registers; the GPU keeps them all in flight), fp32 from here
        for j in range(VPT):
            e = lane + LANES * j
            xs[j] = to_f32(logits[ix(row), ix(e)]) if e < E else NEG_INF32
        for j in range(VPT):
            e = lane + LANES * j
            ks[j] = to_f32(bias[ix(e)]) if has_bias and e < E else float32(0.0)

        # 2. scores: softmax (max, exp, sum, divide), sigmoid or sqrt-softplus, then the mode's
        #    rule: MODE_TOPK zeroes a non-finite score, MODE_GROUPED marks an invalid expert
        #    with a NaN score (its weight is 0, its choice -inf) and rounds a softmax score
        #    to the logits' dtype
        if scoring == 0:
            m = NEG_INF32
            for j in range(VPT):
                m = max_nan(m, xs[j])        # padding (-inf) never wins a max
            m = rmax(m, red_f, red_i, lane)
            s = float32(0.0)
            for j in range(VPT):
                if lane + LANES * j < E:
                    xs[j] = exp_f32(xs[j] - m)
                    s += xs[j]
            s = rsum(s, red_f, red_i, lane)
            for j in range(VPT):
                v = xs[j] / s
                if not is_finite(v):
                    v = float32(0.0) if mode == MODE_TOPK else NAN32
                elif mode == MODE_GROUPED:
                    v = round_as(logits, v)
                xs[j] = v
        else:
            for j in range(VPT):
                x = xs[j]
                v = elementwise_score(x, scoring)
                if mode == MODE_TOPK and not is_finite(v):
                    v = float32(0.0)
                if mode == MODE_GROUPED and not is_finite(x):
                    v = NAN32
                xs[j] = v

        # 3. choice = scores + bias (-inf for an invalid expert; a NaN bias stays NaN until
        #    the groups are scored)
        for j in range(VPT):
            e = lane + LANES * j
            ks[j] = xs[j] + ks[j] if has_bias else xs[j]
            if xs[j] != xs[j]:
                ks[j] = NEG_INF32
            if e < E:
                sc[ix(e)] = xs[j]
                if G > 1:
                    key[ix(e)] = ks[j]
        rsync(lane)   # from here on threads read entries other threads wrote

        # 4. groups: score each, keep the topk_group best, mask the rest to -inf
        if G > 1:
            per = E // G
            for g in range(lane, G, LANES):
                e0 = g * per
                if has_bias:   # sum of the two best choices (NaN ranks as -inf, ties low id)
                    b1 = e0
                    k1 = sel_key(key[ix(e0)])
                    b2 = -1
                    k2 = NEG_INF32
                    for e in range(e0 + 1, e0 + per):
                        k = sel_key(key[ix(e)])
                        if k > k1:
                            b2 = b1
                            k2 = k1
                            b1 = e
                            k1 = k
                        elif b2 < 0 or k > k2:
                            b2 = e
                            k2 = k
                    gsc = key[ix(b1)]
                    if b2 >= 0:
                        gsc = gsc + key[ix(b2)]
                else:          # max of the unbiased scores, a NaN ranking as -inf (a NaN
                    gsc = sel_key(sc[ix(e0)])   # score never knocks its whole group out)
                    for e in range(e0 + 1, e0 + per):
                        gsc = max(gsc, sel_key(sc[ix(e)]))
                gs[ix(g)] = sel_key(gsc)
            rsync(lane)
            for r in range(topk_group):
                bv = NEG_INF32
                bi = int32(G)
                for g in range(lane, G, LANES):
                    v = gs[ix(g)]
                    if v == v and better(v, g, bv, bi):
                        bv = v
                        bi = int32(g)
                bv, bi = rargmax(bv, bi, red_f, red_i, lane)
                if lane == bi % LANES:
                    gs[ix(bi)] = NAN32     # kept; only this thread scans group bi again
            rsync(lane)
            for j in range(VPT):
                e = lane + LANES * j
                if e < E:
                    kept = gs[ix(e // per)] != gs[ix(e // per)]
                    ks[j] = sel_key(ks[j]) if kept else NEG_INF32
        else:
            for j in range(VPT):
                ks[j] = sel_key(ks[j])

        # 5. top-k: K rounds of a row-wide argmax over the registers; `taken` marks winners
        taken = int64(0)
        for j in range(VPT):
            if lane + LANES * j >= E:
                taken |= int64(1) << j     # padding never competes
        total = float32(0.0)
        nvalid = 0
        for k in range(K):
            bv = NEG_INF32
            bi = int32(E)
            for j in range(VPT):           # increasing e: `better` keeps the first of a tie
                if not (taken >> j) & 1:
                    if ks[j] > bv or bi == E:
                        bv = ks[j]
                        bi = int32(lane + LANES * j)
            bv, bi = rargmax(bv, bi, red_f, red_i, lane)
            if lane == bi % LANES:
                taken |= int64(1) << (bi // LANES)
            w = sc[ix(bi)]
            if w != w:                     # invalid (MODE_GROUPED): weight 0
                w = float32(0.0)
            else:
                nvalid += 1
            total += w
            if lane == k % LANES:
                weights[ix(row), ix(k)] = w
                ids[ix(row), ix(k)] = bi
                if want_tei:
                    tei[ix(row), ix(k)] = k * T + row
        div = float32(1.0)
        if renorm and total > 0:
            div = total
        for k in range(lane, K, LANES):   # each thread rescales only what it wrote
            if nvalid == 0:                # no valid expert (MODE_GROUPED): 1/K or 0
                weights[ix(row), ix(k)] = float32(1.0) / float32(K) if renorm else float32(0.0)
            else:
                weights[ix(row), ix(k)] = (weights[ix(row), ix(k)] / div) * scale

    return kernel(route)


# ----------------------------------------------------------------------------- the "keys" kernel
# routing.cu's selection, line for line: every (value, id) pair is one 64-bit key, the
# order-preserving bits of the value in the high word and 0xFFFFFFFF - id in the low word, so
# "larger value, then lower id" is a plain unsigned max: one branch-free max per butterfly
# step (the "warp" flavour compares (value, index) pairs, with branches, two shuffles each).
def f32_bits(x):
    """The bits of an fp32 value as uint32 (simulator: NumPy's view)."""
    return np.float32(x).view(np.uint32)


if not SIMULATOR:
    from numba.cuda import libdevice
    from numba.cuda.extending import overload

    @overload(f32_bits, target="cuda", jit_options={"forceinline": True})
    def _f32_bits_cuda(x):
        def impl(x):
            return uint32(libdevice.float_as_int(float32(x)))
        return impl


@device_function
def order_bits(v):
    """fp32 -> uint32 with the same order; NaN counts as -inf, -0 as +0 (selection)."""
    if v != v:
        v = NEG_INF32
    if v == float32(0.0):
        v = float32(0.0)
    u = f32_bits(v)
    if u & uint32(0x80000000):
        return ~u
    return u | uint32(0x80000000)


@device_function
def make_key(v, e):
    """The selection key of value v for expert (or group) e: larger v, then lower e, wins;
    every real key is above 0, the key of nothing."""
    return (uint64(order_bits(v)) << uint64(32)) | (uint64(0xFFFFFFFF) - uint64(e))


@device_function
def key_id(key):
    return int32(uint64(0xFFFFFFFF) - (key & uint64(0xFFFFFFFF)))


@device_function
def warp_max_key(k):
    """The warp's largest key, in every lane (shuffled as int64: numba shuffles signed words)."""
    off = 16
    while off > 0:
        other = uint64(cu.shfl_xor_sync(FULL_MASK, int64(k), off))
        k = max(k, other)
        off >>= 1
    return k


@device_function
def score_rule(v, x, scoring, mode, logits):
    """A score v (of logit x) under the launch's mode: MODE_TOPK: 0 if not finite;
    MODE_GROUPED: NaN (invalid) when the scoring input is not finite (v for softmax, x for
    sigmoid), else a softmax score rounded to the logits' dtype."""
    if mode == MODE_TOPK:
        return v if is_finite(v) else float32(0.0)
    if scoring == 0:
        return round_as(logits, v) if is_finite(v) else NAN32
    return v if is_finite(x) else NAN32


@functools.lru_cache(maxsize=None)
def route_keys_kernel(WARPS: int, VPT: int):
    """routing.cu's route_topk_kernel in Numba: one warp per token row, WARPS rows per block,
    lane l holds experts e = 32 i + l, i < VPT (E <= 32 VPT <= 1024), K <= 32 (lane k keeps
    the k-th winner), G <= 32 expert groups (lane g scores group g).
    Launch: block = 32 WARPS, grid = cdiv(T, WARPS); dynamic shared memory (G > 1 only):
    WARPS * padded_row_floats(E) * 4 bytes, one padded fp32 row of choices per warp (index
    e + e / 32: the per-group scans of lanes g = 0, 1, ... hit different banks)."""
    if SIMULATOR:
        raise RuntimeError("flavor: the 'keys' routing kernel uses warp shuffles, which the "
                           "CUDA simulator lacks; use 'block'")
    if VPT < 1 or VPT > 32 or VPT & (VPT - 1):
        raise ValueError(f"VPT: expected a power of two up to 32, got {VPT}")

    def route_keys(logits, bias, weights, ids, tei, T, E, K, G, topk_group, scoring, renorm,
                   has_bias, want_tei, mode, scale):
        warp = cu.threadIdx.x >> 5
        lane = cu.threadIdx.x & 31
        t = cu.blockIdx.x * WARPS + warp
        if t >= T:              # the whole warp leaves together: no block-wide barrier below
            return

        # ---- scores (every load first: all in flight together) ----------------------------
        p = cu.local.array(VPT, float32)
        sel = cu.local.array(VPT, float32)
        for i in range(VPT):
            e = 32 * i + lane
            p[i] = to_f32(logits[ix(t), ix(e)]) if e < E else NEG_INF32
            sel[i] = to_f32(bias[ix(e)]) if has_bias and e < E else float32(0.0)
        row_max = float32(0.0)
        row_sum = float32(1.0)
        if scoring == 0:
            m = NEG_INF32
            for i in range(VPT):
                m = max_nan(m, p[i])            # padding (-inf) never wins a max
            m = _warp_max(m, None, None, lane)
            s = float32(0.0)
            for i in range(VPT):
                # x - max, then exp: the reference's order (inf - inf = NaN stays NaN)
                p[i] = exp_f32(p[i] - m) if 32 * i + lane < E else float32(0.0)
                s += p[i]
            s = _warp_sum(s, None, None, lane)
            for i in range(VPT):
                p[i] = score_rule(p[i] / s, float32(0.0), scoring, mode, logits)
            row_max = m
            row_sum = s
        else:
            for i in range(VPT):
                x = p[i]
                p[i] = score_rule(elementwise_score(x, scoring), x, scoring, mode, logits)

        # ---- selection values: the (biased) scores, -inf for an invalid expert (NaN score);
        #      make_key reads a NaN (bias) as -inf
        for i in range(VPT):
            sel[i] = p[i] + sel[i] if has_bias else p[i]
            if p[i] != p[i]:
                sel[i] = NEG_INF32

        # ---- groups: keep the topk_group best ---------------------------------------------
        keep = uint32(0xFFFFFFFF)               # bit i: expert 32 i + lane is in a kept group
        if G > 1:
            stride = E + E // 32 + 1
            row = cu.shared.array(0, float32)[warp * stride:(warp + 1) * stride]
            for i in range(VPT):
                e = 32 * i + lane
                if e < E:
                    row[ix(e + (e >> 5))] = sel[i]
            cu.syncwarp(FULL_MASK)
            per = E // G
            gkey = uint64(0)                    # lane g < G: the key of group g
            if lane < G:
                e0 = lane * per
                if has_bias:   # the two best choices (NaN ranks as -inf), summed as they are
                    b1 = e0
                    k1 = sel_key(row[ix(e0 + (e0 >> 5))])
                    b2 = -1
                    k2 = NEG_INF32
                    for e in range(e0 + 1, e0 + per):
                        k = sel_key(row[ix(e + (e >> 5))])
                        if k > k1:
                            b2 = b1
                            k2 = k1
                            b1 = e
                            k1 = k
                        elif b2 < 0 or k > k2:
                            b2 = e
                            k2 = k
                    gsc = row[ix(b1 + (b1 >> 5))]
                    if b2 >= 0:
                        gsc = gsc + row[ix(b2 + (b2 >> 5))]
                else:          # the max of the scores, a NaN ranking as -inf
                    gsc = NEG_INF32
                    for e in range(e0, e0 + per):
                        gsc = max(gsc, sel_key(row[ix(e + (e >> 5))]))
                gkey = make_key(sel_key(gsc), lane)
            keep = uint32(0)
            for r in range(topk_group):
                g = key_id(warp_max_key(gkey))
                if lane == g:
                    gkey = uint64(0)            # taken
                lo = g * per
                for i in range(VPT):
                    e = 32 * i + lane
                    if e >= lo and e < lo + per:
                        keep |= uint32(1) << uint32(i)

        # ---- top-k over the kept selection values -----------------------------------------
        key = cu.local.array(VPT, uint64)
        for i in range(VPT):
            e = 32 * i + lane
            v = sel[i] if (keep >> uint32(i)) & uint32(1) else NEG_INF32
            key[i] = make_key(v, e) if e < E else uint64(0)
        taken = uint32(0)                       # bit i: expert 32 i + lane already chosen
        my_id = int32(0)                        # lane k keeps the k-th winner
        for k in range(K):
            best = uint64(0)
            for i in range(VPT):
                if not (taken >> uint32(i)) & uint32(1):
                    best = max(best, key[i])
            e = key_id(warp_max_key(best))
            if (e & 31) == lane:
                taken |= uint32(1) << uint32(e >> 5)
            if lane == k:
                my_id = e

        # ---- weights ------------------------------------------------------------------------
        # Lane k recomputes its winner's score from the logit with the instructions that ranked
        # it (bitwise the same value): cheaper than indexing p[] by a runtime slot, which would
        # push the row into local memory.
        my_w = float32(0.0)
        valid = float32(0.0)
        if lane < K:
            x = to_f32(logits[ix(t), ix(my_id)])
            if scoring == 0:
                my_w = score_rule(exp_f32(x - row_max) / row_sum, x, scoring, mode, logits)
            else:
                my_w = score_rule(elementwise_score(x, scoring), x, scoring, mode, logits)
            if my_w != my_w:                 # invalid (MODE_GROUPED): weight 0
                my_w = float32(0.0)
            else:
                valid = float32(1.0)
        nvalid = _warp_sum(valid, None, None, lane)
        if renorm:
            total = _warp_sum(my_w, None, None, lane)   # lanes >= K add 0
            if total > float32(0.0):
                my_w = my_w / total
        my_w = my_w * scale
        if nvalid == float32(0.0):          # no valid expert (MODE_GROUPED): 1/K or 0
            my_w = float32(1.0) / float32(K) if renorm else float32(0.0)
        if lane < K:
            weights[ix(t), ix(lane)] = my_w
            ids[ix(t), ix(lane)] = my_id
            if want_tei:
                tei[ix(t), ix(lane)] = lane * T + t

    return kernel(route_keys)
