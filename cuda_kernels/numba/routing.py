"""Routing in Numba: softmax / sigmoid scores, optional bias and expert groups, top-k.

    T = tokens, E = experts, K = top-k, G = expert groups (num_expert_group)

    fused_topk(hidden_states, gating_output, topk, renormalize, indices_type=None,
               scoring_func="softmax")
        -> topk_weights f32 [T, K], topk_ids int32 [T, K], token_expert_indices int32 [T, K]
    fused_topk_bias(hidden_states, gating_output, scoring_func, e_score_correction_bias, topk,
                    renormalize, indices_type=None, routed_scaling_factor=1.0)
        -> topk_weights, topk_ids
    grouped_topk(hidden_states, gating_output, topk, renormalize, num_expert_group=0,
                 topk_group=0, scoring_func="softmax", routed_scaling_factor=1.0,
                 e_score_correction_bias=None) -> topk_weights, topk_ids
    select_experts(...)   vLLM's dispatcher: reference.routing.select_experts(ops=this module)

The math (reference/routing.py), per token row t, all in fp32:
    scores[e] = softmax(logits[t])[e] = exp(x_e - max x) / sum_e' exp(x_e' - max x)
                or sigmoid(x_e) = 1 / (1 + exp(-x_e))
    mode MODE_TOPK (fused_topk, fused_topk_bias): a non-finite score becomes 0
    mode MODE_GROUPED (grouped_topk): softmax scores rounded to the logits' dtype; an expert
                whose scoring input is not finite (the logit for sigmoid, the score for
                softmax) is invalid: choice -inf, weight 0; a row with no valid expert among
                its K gets 1/K (renormalize) or 0
    choice[e] = scores[e] + bias[e]   (or scores[e])
    groups:   group score = max of its scores, NaN as -inf (no bias) | sum of its two best
              choices (bias: ranked with NaN as -inf, summed as they are);
              keep the topk_group best groups, choice = -inf outside them
    topk_ids  = the K best experts by choice: descending, ties to the lowest id, NaN as -inf
    topk_weights[t, k] = scores[topk_ids[t, k]], / their sum if renormalize and the sum > 0,
                         then * routed_scaling_factor
    token_expert_indices[t, k] = k * T + t

One kernel serves all three functions, in flavours that differ in how a row's threads
reduce (max, sum, argmax) and synchronise:

    kernel       threads of a row   reductions                    launch
    "keys"       one warp           routing.cu's: 64-bit keys,     grid = cdiv(T, W), block = 32 W
                                    one shuffled max per step      (route_keys_kernel)
    "warp"       one warp           butterfly cuda.shfl_xor_sync   grid = cdiv(T, W), block = 32 W
    "block"      one block of NT    shared-memory tree + syncthreads  grid = T, block = NT

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

dtypes: gating_output fp32, fp16, bf16 (as uint16 bits, converted in the kernel by a shift:
see _device.py) or fp64; bias any of those; everything after the load is fp32.

Run as a script to validate against reference/ and time: python -m cuda_kernels.numba.routing
"""
from __future__ import annotations

import functools
import sys
from types import SimpleNamespace

import numpy as np
from numba import float32, int32, int64, uint32, uint64

from . import _arrays as A
from ._device import (
    FULL_MASK,
    NAN32,
    NEG_INF32,
    SIMULATOR,
    better,
    cu,
    device_function,
    exp_f32,
    ix,
    kernel,
    max_nan,
    round_as,
    sel_key,
    to_f32,
)

# Tunables are data: one dict per flavour (the simulator gets small blocks: 2,000 threads/s).
CONFIGS = {"keys": {"WARPS_PER_BLOCK": 4}, "warp": {"WARPS_PER_BLOCK": 4},
           "block": {"THREADS": 128}}
SIM_CONFIGS = {"block": {"THREADS": 32}}
DEFAULT_FLAVOR = "block" if SIMULATOR else "keys"
SHARED_LIMIT = 48 * 1024   # bytes of dynamic shared memory without an opt-in
SCORING_FUNCS = ("softmax", "sigmoid")
# the non-finite rule and rounding of a launch (reference/routing.py):
MODE_TOPK = 0      # fused_topk / fused_topk_bias: a non-finite score is 0
MODE_GROUPED = 1   # grouped_topk: an expert with a non-finite scoring input is invalid
                   # (ranked last, weight 0; none valid: 1/K or 0), softmax rounded to the
                   # logits' dtype


def _config(flavor):
    if SIMULATOR and flavor in SIM_CONFIGS:
        return SIM_CONFIGS[flavor]
    return CONFIGS[flavor]


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

        # 2. scores: softmax (max, exp, sum, divide) or sigmoid, then the mode's non-finite
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
                v = float32(1.0) / (float32(1.0) + exp_f32(-x))
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
                p[i] = score_rule(float32(1.0) / (float32(1.0) + exp_f32(-x)), x, scoring, mode,
                                  logits)

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
                my_w = score_rule(float32(1.0) / (float32(1.0) + exp_f32(-x)), x, scoring,
                                  mode, logits)
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


def _keys_fits(E, K, G):
    """The "keys" kernel's limits: a row in one warp's registers, a winner per lane, a group
    per lane."""
    return E <= 1024 and K <= 32 and G <= 32


def values_per_thread(E, lanes):
    """The smallest power of two VPT with E <= VPT * lanes (a kernel is compiled per VPT)."""
    vpt = 1
    while vpt * lanes < E:
        vpt *= 2
    return vpt


def _geometry(flavor, T, E, G):
    """(grid, block, shared bytes) of a launch, from the formulas in the module docstring."""
    if flavor == "keys":
        rows = CONFIGS["keys"]["WARPS_PER_BLOCK"]
        smem = rows * (E + E // 32 + 1) * 4 if G > 1 else 0
        return A.cdiv(T, rows), rows * 32, smem
    if flavor == "warp":
        stride = 2 * E + G
        rows = CONFIGS["warp"]["WARPS_PER_BLOCK"]
        while rows > 1 and rows * stride * 4 > SHARED_LIMIT:
            rows //= 2
        smem = rows * stride * 4
        geometry = (A.cdiv(T, rows), rows * 32, smem)
    else:
        nt = _config("block")["THREADS"]
        smem = (2 * E + G + 2 * nt) * 4
        geometry = (T, nt, smem)
    if geometry[2] > SHARED_LIMIT:
        raise ValueError(f"gating_output: expected at most {(SHARED_LIMIT // 4 - 256) // 2} "
                         f"experts (a row lives in shared memory), got {E}")
    return geometry


def _launch(call, gating_output, bias, topk, num_groups, topk_group, scoring, renormalize,
            scale, want_tei, ids_dtype, flavor=None, mode=MODE_TOPK):
    flavor = flavor or DEFAULT_FLAVOR
    T, E = A.shape_of(gating_output)
    weights = call.empty((T, topk), np.float32)     # [T, K]
    ids = call.empty((T, topk), ids_dtype)          # [T, K]
    tei = call.empty((T, topk), np.int32) if want_tei else None
    if flavor == "keys" and not _keys_fits(E, topk, num_groups):
        flavor = "warp"
    if T > 0:
        grid, block, smem = _geometry(flavor, T, E, num_groups)
        lanes = 32 if flavor in ("warp", "keys") else block
        if flavor == "keys":
            kernel = route_keys_kernel(block // 32, values_per_thread(E, 32))
        else:
            kernel = route_kernel(flavor, block // 32 if flavor == "warp" else block,
                                  values_per_thread(E, lanes))
        logits = call.dev("gating_output", gating_output)
        bias_d = (call.dev("e_score_correction_bias", bias) if bias is not None
                  else A.dummy(np.float32))
        kernel[grid, block, A.launch_stream(), smem](
            logits, bias_d, weights, ids, tei if tei is not None else A.dummy(np.int32, 2),
            T, E, topk, num_groups, topk_group, 0 if scoring == "softmax" else 1,
            1 if renormalize else 0, 1 if bias is not None else 0, 1 if want_tei else 0,
            mode, np.float32(scale))
    out = (call.result(weights), call.result(ids))
    return out + ((call.result(tei),) if want_tei else ())


# ----------------------------------------------------------------------------- argument checks
def _check_logits(hidden_states, gating_output, topk):
    A.check_float("gating_output", gating_output, ndim=2, with_f64=True)
    T, E = A.shape_of(gating_output)
    if hidden_states is not None:
        A.check_float("hidden_states", hidden_states, ndim=2, with_f64=True)
        if A.shape_of(hidden_states)[0] != T:
            raise ValueError(f"hidden_states: expected {T} rows to match gating_output, "
                             f"got shape {A.shape_of(hidden_states)}")
    topk = A.check_int("topk", topk, minimum=1)
    if topk > E:
        raise ValueError(f"topk: expected at most the number of experts ({E}), got {topk}")
    return T, E, topk


def _check_bias(bias, E):
    return A.check_float("e_score_correction_bias", bias, ndim=1, shape=(E,), with_f64=True)


def _ids_dtype(indices_type):
    if indices_type is None:
        return np.dtype(np.int32)
    if type(indices_type).__module__.split(".")[0] == "torch":
        dt = A._torch_dtypes()[0].get(indices_type)
    else:
        try:
            dt = np.dtype(indices_type)
        except TypeError:
            dt = None
    if dt is None or dt.kind not in "iu":
        raise TypeError(f"indices_type: expected an integer dtype, got {indices_type!r}")
    return dt


# ----------------------------------------------------------------------------- the stages
def fused_topk(hidden_states, gating_output, topk, renormalize, indices_type=None,
               scoring_func="softmax"):
    """Softmax (or sigmoid) top-k routing (Mixtral, Qwen3-MoE): vLLM's topk_softmax /
    topk_sigmoid.

    scores = softmax | sigmoid(gating_output) [T, E] fp32, a non-finite score 0; topk_ids =
    the K best, descending, ties to the lowest id; topk_weights = scores[topk_ids] (/ their
    sum if renormalize); token_expert_indices[t, k] = k * T + t. Kernel: `route_kernel`
    (module docstring).

    Returns topk_weights f32 [T, K], topk_ids int32 (or indices_type) [T, K],
    token_expert_indices int32 [T, K].
    """
    _check_scoring_func(scoring_func)
    _, _, topk = _check_logits(hidden_states, gating_output, topk)
    call = A.Call("gating_output", gating_output)
    return _launch(call, gating_output, None, topk, 1, 1, scoring_func, renormalize, 1.0, True,
                   _ids_dtype(indices_type))


def fused_topk_bias(hidden_states, gating_output, scoring_func, e_score_correction_bias, topk,
                    renormalize, indices_type=None, routed_scaling_factor=1.0):
    """Softmax (or sigmoid) scores, a non-finite one 0; experts chosen on scores + bias;
    weights are the unbiased scores, renormalized if asked, then * routed_scaling_factor.
    Returns topk_weights f32 [T, K], topk_ids int32 (or indices_type) [T, K]."""
    _check_scoring_func(scoring_func)
    _, E, topk = _check_logits(hidden_states, gating_output, topk)
    if e_score_correction_bias is not None:
        _check_bias(e_score_correction_bias, E)
    call = A.Call("gating_output", gating_output)
    return _launch(call, gating_output, e_score_correction_bias, topk, 1, 1, scoring_func,
                   renormalize, float(routed_scaling_factor), False, _ids_dtype(indices_type))


def _check_scoring_func(scoring_func):
    if not isinstance(scoring_func, str):
        raise TypeError(f"scoring_func: expected one of {sorted(SCORING_FUNCS)}, "
                        f"got {type(scoring_func).__name__}")
    A.check_choice("scoring_func", scoring_func, SCORING_FUNCS)


def grouped_topk(hidden_states, gating_output, topk, renormalize, num_expert_group=0,
                 topk_group=0, scoring_func="softmax", routed_scaling_factor=1.0,
                 e_score_correction_bias=None):
    """DeepSeek-V2/V3 group-limited routing.

    scores = softmax (rounded to the logits' dtype) | sigmoid(gating_output), an expert with
    a non-finite scoring input invalid; choice = scores (+ bias), -inf when invalid; groups
    of E / num_expert_group consecutive experts scored by their max choice (no bias) or the
    sum of their two best choices (bias); the topk_group best groups kept; top-K of the kept
    choices; weights the unbiased scores (0 when invalid), renormalized if asked, always
    * routed_scaling_factor; no valid expert among the K: 1/K (renormalize) or 0.
    Returns topk_weights f32 [T, K], topk_ids int32 [T, K].
    """
    _, E, topk = _check_logits(hidden_states, gating_output, topk)
    _check_scoring_func(scoring_func)
    G = A.check_int("num_expert_group", num_expert_group, minimum=1)
    topk_group = A.check_int("topk_group", topk_group, minimum=1)
    if E % G:
        raise ValueError(f"num_expert_group: expected a divisor of the number of experts "
                         f"({E}), got {G}")
    if topk_group > G:
        raise ValueError(f"topk_group: expected at most num_expert_group ({G}), got {topk_group}")
    per = E // G
    if topk > topk_group * per:
        raise ValueError(f"topk: expected at most topk_group * experts per group "
                         f"({topk_group} * {per}), got {topk}")
    if e_score_correction_bias is not None:
        _check_bias(e_score_correction_bias, E)
    call = A.Call("gating_output", gating_output)
    return _launch(call, gating_output, e_score_correction_bias, topk, G, topk_group,
                   scoring_func, renormalize, float(routed_scaling_factor), False,
                   np.dtype(np.int32), mode=MODE_GROUPED)


def _ids_astype(ids, dt):
    """Cast topk_ids of any kind (used after a custom routing function)."""
    root = type(ids).__module__.split(".")[0]
    if root == "torch":
        return ids.to(A._torch_dtypes()[1][dt])
    if hasattr(ids, "astype"):
        return ids.astype(dt)
    host = A.to_host(ids).astype(dt)
    return A.to_device(host)


def select_experts(hidden_states, router_logits, top_k, use_grouped_topk, renormalize,
                   topk_group=None, num_expert_group=None, custom_routing_function=None,
                   scoring_func="softmax", routed_scaling_factor=1.0,
                   e_score_correction_bias=None, indices_type=None, global_num_experts=None,
                   zero_expert_num=0, zero_expert_type=None, ops=None):
    """vLLM's FusedMoE.select_experts with this module's kernels: the reference's dispatcher
    (reference.routing.select_experts) called with ops=<these functions>.

    Returns (topk_weights f32 [T, K], topk_ids [T, K], zero_expert_result or None). Zero
    experts (LongCat-Flash) run through the reference on host arrays only.
    """
    from reference import routing as ref_routing

    kind = A.kind_of("router_logits", router_logits)
    zero = bool(zero_expert_num) and zero_expert_type is not None
    if zero and kind != "host":
        raise NotImplementedError("zero_expert_num: zero experts run on host (NumPy) arrays "
                                  "only in the numba backend")
    ids_dt = _ids_dtype(indices_type)
    if ops is None:
        # the dispatcher's ops, producing ids of the asked dtype directly (no extra cast)
        ops = SimpleNamespace(
            fused_topk=lambda h, g, k, r, indices_type=None, scoring_func="softmax":
                fused_topk(h, g, k, r, ids_dt, scoring_func=scoring_func),
            fused_topk_bias=lambda h, g, sf, b, k, r, indices_type=None,
                routed_scaling_factor=1.0: fused_topk_bias(
                    h, g, sf, b, k, r, ids_dt, routed_scaling_factor=routed_scaling_factor),
            grouped_topk=grouped_topk)
    weights, ids, zero_result = ref_routing.select_experts(
        hidden_states, router_logits, top_k, use_grouped_topk, renormalize,
        topk_group=topk_group, num_expert_group=num_expert_group,
        custom_routing_function=custom_routing_function, scoring_func=scoring_func,
        routed_scaling_factor=routed_scaling_factor,
        e_score_correction_bias=e_score_correction_bias, indices_type=None,
        global_num_experts=global_num_experts, zero_expert_num=zero_expert_num,
        zero_expert_type=zero_expert_type, ops=ops)
    if indices_type is not None and A.dtype_of(ids) != ids_dt:
        ids = _ids_astype(ids, ids_dt)
    return weights, ids, zero_result


# ----------------------------------------------------------------------------- compile checks
def compile_cases():
    """(label, kernel, argument types) of every launch above, for the PTX checks (_ptx.py)."""
    from numba import types as t

    def arr(dt, nd):
        return t.Array(dt, nd, "C")

    def sig(dt, ids_dt=t.int32):
        return ((arr(dt, 2), arr(t.float32, 1), arr(t.float32, 2), arr(ids_dt, 2),
                 arr(t.int32, 2)) + (t.int64,) * 10 + (t.float32,))

    warp = CONFIGS["warp"]["WARPS_PER_BLOCK"]
    block = CONFIGS["block"]["THREADS"]
    keys = CONFIGS["keys"]["WARPS_PER_BLOCK"]
    cases = [(f"routing keys VPT={v} logits={dt}", route_keys_kernel(keys, v), sig(dt))
             for v, dt in ((8, t.uint16), (4, t.uint16), (1, t.float32), (32, t.float16),
                           (8, t.float64))]
    # every logits dtype at E = 256 (VPT 8) on the default flavour; the other row widths
    # (E = 8, 128, 1024) once; the block flavour (shares all but the reductions) twice
    cases += [(f"routing warp VPT=8 logits={dt}", route_kernel("warp", warp, 8), sig(dt))
              for dt in (t.float32, t.float16, t.uint16, t.float64)]
    cases.append(("routing warp VPT=8 logits=float32 ids=int64", route_kernel("warp", warp, 8),
                  sig(t.float32, t.int64)))
    cases += [(f"routing warp VPT={v} logits=uint16", route_kernel("warp", warp, v),
               sig(t.uint16)) for v in (1, 4, 32)]
    cases += [(f"routing block VPT=2 logits={dt}", route_kernel("block", block, 2), sig(dt))
              for dt in (t.float32, t.uint16)]
    return cases


# ----------------------------------------------------------------------------- as a script
def _main():
    import reference

    from . import _script as S

    ok, why = A.availability()
    print(f"numba routing: {why}")
    if not ok:
        return 0
    rng = np.random.default_rng(0)
    cases = ([(5, 8, 2), (3, 16, 4)] if SIMULATOR
             else [(1, 8, 2), (256, 128, 8), (4096, 256, 8), (1024, 160, 6)])
    failures = 0
    for T, E, K in cases:
        logits = rng.standard_normal((T, E)).astype(np.float32)   # [T, E]
        bias = (rng.standard_normal(E) * 0.1).astype(np.float32)   # [E]
        G = 8 if E % 8 == 0 else 1
        TG = min(4, G)
        stages = {
            "fused_topk": lambda m, x: m.fused_topk(None, x, K, True)[:2],
            "fused_topk_bias": lambda m, x: m.fused_topk_bias(None, x, "softmax", bias, K, True,
                                                              routed_scaling_factor=2.5),
            "grouped_topk": lambda m, x: m.grouped_topk(None, x, K, True, G, TG, "sigmoid", 2.5,
                                                        bias),
        }
        this = sys.modules[__name__]
        for name, run in stages.items():
            (w, ids), (rw, rids) = run(this, logits), run(reference, logits)
            same = np.array_equal(ids, rids)
            err = S.rel_err(w, rw)
            failures += not (same and err <= 1e-5)
            line = (f"  {name:16s} T={T:5d} E={E:4d} K={K}: ids {'exact' if same else 'DIFFER'}, "
                    f"weights rel err {err:.1e}")
            if not SIMULATOR:
                d = A.to_device(logits)
                d_bias = A.to_device(bias)
                dev_stages = {
                    "fused_topk": lambda: fused_topk(None, d, K, True),
                    "fused_topk_bias": lambda: fused_topk_bias(None, d, "softmax", d_bias, K,
                                                               True, routed_scaling_factor=2.5),
                    "grouped_topk": lambda: grouped_topk(None, d, K, True, G, TG, "sigmoid", 2.5,
                                                         d_bias),
                }
                # bytes: the logits in, weights + ids out
                nbytes = T * E * 4 + T * K * 8
                ms = S.time_ms(dev_stages[name])
                line += f", {ms * 1e3:8.1f} us, {nbytes / ms / 1e6:7.1f} GB/s"
            print(line)
    print("all match" if not failures else f"{failures} mismatches")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(_main())
