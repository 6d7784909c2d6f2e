"""Test-side oracles: the dumbest obviously-correct versions of every reference stage.

    T = tokens, E = experts, K = top-k, G = expert groups, H = hidden, I = intermediate,
    B = block size, P = T*K slots (s = t*K + k)

The reference (`reference/`) is vectorized NumPy; these are loops over tokens and top-k
slots written from docs/stages.md without looking at how the reference does it, so that
an agreement between the two means something. Three kinds:

    route_loop / llama4_loop / zero_experts_loop   one token at a time, Python floats (fp64),
                                                   ranking by sorted((-score, id))
    align_loop                                     one pass over the slots into per-expert lists
    fused_experts_loop                             one (token, slot) pair at a time, fp64 matvecs
    torch_route / torch_fused_moe                  an independent per-expert implementation with
                                                   torch ops only (for shapes too big for loops)

and the comparison helpers every test uses: `rel_err` (relative Frobenius error in
float64, NaN never passes; `rel_err_where_defined`: NaN in the same places, then the rest),
`TOL` (the tolerance of each dtype, with its reason), `assert_close` / `assert_output_close`
(a kernel's output: its dtype and shape too), `check_gemm` (a backend's grouped GEMM on a
`gemm_problem`) and `assert_same_blocks` (alignment compared per block as sets, as vLLM
leaves the order of slots inside an expert's run unspecified).
"""

from __future__ import annotations

import hashlib
import math

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)

# Relative Frobenius error allowed against a float64 oracle, keyed by the dtype the stage ran
# in. fp64: summation order only (~1e-15 * sqrt(H)). fp32: 24-bit mantissa, error grows like
# sqrt(K) * 6e-8 per dot product. fp16 / bf16: one rounding of each stage's output to an
# 11- / 8-bit mantissa (bf16 ~ 4e-3 per rounding, three roundings along the layer).
TOL = {
    np.dtype(np.float64): 1e-12,
    np.dtype(np.float32): 1e-5,
    np.dtype(np.float16): 1e-2,
    BF16: 1e-2,
}


def rel_err(got, want) -> float:
    """||got - want||_F / ||want||_F in float64; inf when either side holds a NaN or an inf."""
    got = np.asarray(got).astype(np.float64)
    want = np.asarray(want).astype(np.float64)
    assert got.shape == want.shape, f"shape {got.shape} != oracle's {want.shape}"
    if not (np.isfinite(got).all() and np.isfinite(want).all()):
        return math.inf
    denom = np.linalg.norm(want)
    num = np.linalg.norm(got - want)
    if denom == 0:
        return 0.0 if num == 0 else math.inf
    return float(num / denom)


def rel_err_where_defined(got, want) -> float:
    """rel_err over the elements where the oracle holds a number, once NaN is found at the
    same places on both sides (a NaN input stays confined to its outputs)."""
    got = np.asarray(got).astype(np.float64)
    want = np.asarray(want).astype(np.float64)
    assert got.shape == want.shape, f"shape {got.shape} != oracle's {want.shape}"
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg="NaN at other places")
    ok = ~np.isnan(want)
    return rel_err(got[ok], want[ok])


def assert_close(got, want, dtype, tol=None, what="output"):
    """Relative Frobenius error within the tolerance of `dtype` (NaN never passes)."""
    tol = TOL[np.dtype(dtype)] if tol is None else tol
    err = rel_err(got, want)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e} ({np.dtype(dtype)})"


def assert_close_where_defined(got, want, dtype, what="output"):
    """`got` has the dtype of `want`, NaN at the same places, the rest within TOL[dtype]."""
    assert np.asarray(got).dtype == np.asarray(want).dtype, f"{what}: dtype"
    err = rel_err_where_defined(got, want)
    assert err <= TOL[np.dtype(dtype)], f"{what}: relative error {err:.3e}"


def assert_output_close(got, want, dtype, what="output"):
    """A kernel's output (on the host) has the stage's `dtype` and the oracle's shape, and is
    within TOL[dtype] of the oracle (which may be float64)."""
    got = np.asarray(got)
    assert got.dtype == np.dtype(dtype), f"{what}: dtype {got.dtype} != {np.dtype(dtype)}"
    assert got.shape == np.shape(want), f"{what}: shape {got.shape} != {np.shape(want)}"
    assert_close(got, want, dtype, what=what)


# --------------------------------------------------------------------------------------------
# Random inputs. Seeded per parameter set so a failure reproduces; never zeros.
# --------------------------------------------------------------------------------------------

def seed_of(*params) -> int:
    """A stable seed from test parameters (Python's hash() of a str is salted per process)."""
    text = repr(params).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little")


def rng_for(*params) -> np.random.Generator:
    return np.random.default_rng(seed_of(*params))


def uniform(rng, shape, scale=1.0, dtype=np.float32):
    """Uniform in [-scale, scale), drawn in fp32 (fast for big weights), cast to dtype."""
    x = rng.random(shape, dtype=np.float32)
    x -= np.float32(0.5)
    x *= np.float32(2 * scale)
    return x if np.dtype(dtype) == np.float32 else x.astype(dtype)


# Experts of a pooled weight tensor start this many elements apart in one random pool:
# prime, so no two experts' rows line up.
_POOL_SHIFT = 9973


def pooled(rng, shape, scale, dtype=np.float32):
    """A read-only [E, N, Kdim] weight tensor whose experts are overlapping windows of one
    random pool: expert e is pool[e*shift : e*shift + N*Kdim] reshaped. Each expert's
    entries are i.i.d. uniform and no two experts are equal (shifted by a prime number of
    elements), but the whole tensor costs one expert's memory plus E*shift: vLLM's biggest
    grid case (E=64, I=H=1024) would otherwise draw and stream 800 MB per test."""
    num_experts, n, k = shape
    pool = uniform(rng, (n * k + num_experts * _POOL_SHIFT,), scale, dtype)
    step = pool.itemsize
    return np.lib.stride_tricks.as_strided(pool, shape=shape, strides=(_POOL_SHIFT * step, k * step, step),
                                           writeable=False)


def moe_weights(rng, num_experts, hidden, inter, dtype=np.float32, gated=True, bias=False,
                pool=False):
    """w1 [E, 2I or I, H] and w2 [E, H, I], scaled so every activation stays O(1);
    `pool=True` draws them as `pooled` views (for the big shapes).

    Returns (w1, w2, w1_bias, w2_bias), the biases None unless `bias`."""
    n1 = 2 * inter if gated else inter
    draw = pooled if pool else (lambda r, shape, scale, dt: uniform(r, shape, scale, dt))
    w1 = draw(rng, (num_experts, n1, hidden), 1.7 / math.sqrt(hidden), dtype)
    w2 = draw(rng, (num_experts, hidden, inter), 1.7 / math.sqrt(inter), dtype)
    if not bias:
        return w1, w2, None, None
    return w1, w2, uniform(rng, (num_experts, n1), 0.5, dtype), uniform(rng, (num_experts, hidden), 0.5, dtype)


def distinct_topk_ids(rng, num_tokens, num_experts, top_k):
    """K distinct experts per token, uniformly, as vLLM's tests draw them (randperm[:K])."""
    return np.argsort(rng.random((num_tokens, num_experts)), axis=1)[:, :top_k].astype(np.int32)


def random_weights(rng, num_tokens, top_k):
    """Router weights in (0.05, 1]: positive like softmax outputs, never zero."""
    return (0.05 + 0.95 * rng.random((num_tokens, top_k))).astype(np.float32)


def ids_with_runs(counts):
    """topk_ids [sum(counts) / 2, 2] putting counts[e] slots on expert e, the two experts of a
    token distinct: the sorted labels' first half against their second half (so no expert may
    hold more than half the slots). For runs of chosen lengths: a tile's padding exactly where
    a test wants it."""
    labels = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
    half = labels.size // 2
    ids = np.stack([labels[:half], labels[half:]], axis=1)
    if labels.size % 2 or (ids[:, 0] == ids[:, 1]).any():
        raise ValueError(f"counts: expected an even total, none over half of it, got {counts}")
    return ids


def gemm_problem(T, E, K, N, Kd, B, dtype, *, ids=None, expert_map=None, ignore=False,
                 E_local=None, bias=None, mul=False, gemm2=False, seed=0):
    """A grouped-GEMM problem drawn for these parameters, and its float64 answer.

    Returns ((a, w, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k, B,
    topk_weights, mul, bias), want): a [T, Kd] (GEMM1, top_k = K) or [T K, Kd] (gemm2: one row
    per slot, top_k = 1), w [E_local, N, Kd], ids K distinct experts per token unless given,
    bias [E_local, N] of dtype `bias` (None: no bias); the alignment and `want` are the
    reference's (reference.moe_align_block_size, reference.grouped_gemm in float64)."""
    import reference

    rng = rng_for("gemm", T, E, K, N, Kd, B, str(dtype), seed)
    E_local = E if E_local is None else E_local
    ids = distinct_topk_ids(rng, T, E, K) if ids is None else ids
    a = uniform(rng, (T * K if gemm2 else T, Kd), 1.0, dtype)
    w = uniform(rng, (E_local, N, Kd), 1.7 / math.sqrt(max(Kd, 1)), dtype)
    b = None if bias is None else uniform(rng, (E_local, N), 0.5).astype(bias)
    tw = random_weights(rng, T, K)
    align = reference.moe_align_block_size(ids, B, E, expert_map, False, ignore)
    top_k = 1 if gemm2 else K
    want = reference.grouped_gemm(a.astype(np.float64), w.astype(np.float64), *align, top_k, B,
                                  tw.astype(np.float64), mul,
                                  None if b is None else b.astype(np.float64))
    return (a, w) + tuple(align) + (top_k, B, tw, mul, b), want


def gemm_case(T, E, K, N, Kd, B, dtype, *, one_expert=None, **kw):
    """gemm_problem as a dict: a, w, st, ex, nt (the alignment), tw, bias, top_k (the call's),
    B, P = T*K, N, mul, dtype, and want (the float64 answer). The case tables' shorthands:
    bias="same" (a bias of the element dtype), expert_map=True (rank 1 of 2: the upper half
    of the experts local), one_expert=e (every slot on expert e)."""
    import reference

    if isinstance(kw.get("bias"), str):
        kw["bias"] = dtype
    if kw.get("expert_map") is True:
        kw["E_local"], kw["expert_map"] = reference.determine_expert_map(2, 1, E)
    if one_expert is not None:
        kw["ids"] = np.full((T, K), one_expert, np.int32)
    (a, w, st, ex, nt, top_k, B, tw, mul, b), want = gemm_problem(T, E, K, N, Kd, B, dtype, **kw)
    return dict(a=a, w=w, st=st, ex=ex, nt=nt, tw=tw, bias=b, want=want, top_k=top_k, B=B,
                P=T * K, N=N, mul=mul, dtype=np.dtype(dtype))


def check_gemm(grouped_gemm, args, want, version=None):
    """A backend's grouped_gemm(*args, version=version) on a gemm_problem: the dtype of a, the
    answer's shape, within TOL of the float64 answer (a row left unwritten in a poisoned output
    fails as NaN). Returns the output."""
    got = grouped_gemm(*args, version=version)
    dtype = np.dtype(args[0].dtype)
    assert got.dtype == dtype and got.shape == want.shape, \
        f"{version}: {got.dtype} {got.shape} != {dtype} {want.shape}"
    err = rel_err(got, want)
    assert err <= TOL[dtype], f"{version}: relative error {err:.3e}"
    return got


def non_finite_group_logits(num_experts, num_finite):
    """The row of vLLM's test_grouped_topk_single_group_nonfinite_scores: [1, E] bf16 logits
    0, 1, ..., num_finite - 1, then +inf, -inf, and NaN everywhere else."""
    logits = np.full((1, num_experts), np.nan, BF16)
    logits[0, :num_finite] = np.arange(num_finite)
    logits[0, num_finite] = np.inf
    logits[0, num_finite + 1] = -np.inf
    return logits


def selection_values(logits, scoring="softmax", bias=None, groups=1, topk_group=1,
                     kernel=None):
    """The reference's fp32 selection values [T, E] of a routing (NaN as -inf, invalid
    experts and the experts of masked groups -inf): what a kernel's ids are checked against
    at near-ties. kernel: "topk" (fused_topk / fused_topk_bias) or "grouped" (grouped_topk;
    the default with more than one group)."""
    import reference

    kernel = kernel or ("grouped" if groups > 1 else "topk")
    if kernel == "topk":
        scores = reference.routing.topk_scores(logits, scoring)
        valid = np.ones(scores.shape, bool)
    else:
        scores, valid = reference.routing.grouped_scores(logits, scoring)
    choice = scores + bias.astype(np.float32)[None, :] if bias is not None else scores
    choice = np.where(valid, choice, -np.inf)
    if groups > 1:
        T, E = choice.shape
        per = E // groups
        grouped = choice.reshape(T, groups, per)
        if bias is not None:
            two = reference.topk_indices(grouped, min(2, per))
            gscore = np.take_along_axis(grouped, two, axis=-1).sum(-1)
        else:   # a NaN choice ranks as -inf: it never knocks its group out
            gscore = np.where(np.isnan(grouped), -np.inf, grouped).max(-1)
        keep = np.zeros((T, groups), bool)
        np.put_along_axis(keep, reference.topk_indices(gscore, topk_group), True, axis=-1)
        choice = np.where(np.repeat(keep, per, axis=-1), choice, -np.inf)
    return np.where(np.isnan(choice), -np.inf, choice)


def assert_routing_matches(got, want, sel, what="routing", to_host=np.asarray):
    """A kernel's (weights, ids) against the reference's: ids exact except at true near-ties
    (selection values `sel` equal within 1e-6 relative, at most 1% of the rows), in range and
    distinct per token; weights within 1e-5 on the rows whose ids match, NaN where and only
    where the reference has NaN. `to_host` brings the kernel's arrays to NumPy."""
    g_w, g_ids = to_host(got[0]), to_host(got[1])
    w_w, w_ids = want[0], want[1]
    assert g_ids.shape == w_ids.shape and g_w.shape == w_w.shape, what
    assert g_ids.dtype == w_ids.dtype, f"{what}: ids dtype {g_ids.dtype} != {w_ids.dtype}"
    assert g_w.dtype == np.float32, f"{what}: weights dtype {g_w.dtype} != float32"
    T = w_ids.shape[0]
    if T == 0:
        return
    E = sel.shape[1]
    assert ((g_ids >= 0) & (g_ids < E)).all(), f"{what}: ids out of range (poison left?)"
    srt = np.sort(g_ids, axis=1)
    assert (np.diff(srt, axis=1) != 0).all(), f"{what}: a token got the same expert twice"
    differ = (g_ids != w_ids).any(axis=1)
    if differ.any():
        rows = np.nonzero(differ)[0]
        g_val = np.take_along_axis(sel[rows], g_ids[rows].astype(np.int64), axis=1)
        w_val = np.take_along_axis(sel[rows], w_ids[rows].astype(np.int64), axis=1)
        same_inf = np.isneginf(g_val) & np.isneginf(w_val)
        with np.errstate(invalid="ignore"):
            near = np.abs(g_val - w_val) <= 1e-6 * np.maximum(np.abs(w_val), 1e-30)
        bad = ~(near | same_inf)
        assert not bad.any(), (
            f"{what}: ids differ beyond a near-tie in {int(bad.any(axis=1).sum())} rows, "
            f"first row {rows[bad.any(axis=1)][0]}: got {g_ids[rows[bad.any(axis=1)][0]]}, "
            f"want {w_ids[rows[bad.any(axis=1)][0]]}")
        assert differ.mean() <= 0.01, f"{what}: {differ.sum()} of {T} rows at near-ties"
    same = ~differ
    gw, ww = g_w[same], w_w[same]
    nan_g, nan_w = np.isnan(gw), np.isnan(ww)
    np.testing.assert_array_equal(nan_g, nan_w, err_msg=f"{what}: NaN weights where the "
                                                        f"reference has none, or the reverse")
    ok_rows = ~nan_w.any(axis=1)
    if ok_rows.any():
        err = rel_err(gw[ok_rows], ww[ok_rows])
        assert err <= 1e-5, f"{what}: weights relative error {err:.3e}"


# --------------------------------------------------------------------------------------------
# Routing: one token at a time.
# --------------------------------------------------------------------------------------------

def _key(v: float) -> float:
    """The selection key: NaN counts as -inf (docs/stages.md, reference/routing.py)."""
    return -math.inf if math.isnan(v) else v


def top_ids(values, k, candidates=None):
    """The k best ids by value, descending, ties to the lowest id: sorted((-key, id))."""
    ids = range(len(values)) if candidates is None else candidates
    return [e for _, e in sorted((-_key(values[e]), e) for e in ids)[:k]]


def _sigmoid(v: float) -> float:
    if math.isnan(v):
        return math.nan
    if v >= 0:
        return 1.0 / (1.0 + math.exp(-v))
    z = math.exp(v)
    return z / (1.0 + z)


def softmax_row(row):
    """exp(x - max) / sum over a list of floats; a NaN anywhere, a +inf maximum or an all
    -inf row give all-NaN (inf - inf), as the contract says."""
    if any(math.isnan(v) for v in row):
        return [math.nan] * len(row)
    m = max(row)
    shifted = [v - m for v in row]                   # inf - inf = nan for those rows
    if any(math.isnan(v) for v in shifted):
        return [math.nan] * len(row)
    ex = [math.exp(v) for v in shifted]
    total = sum(ex)
    return [v / total for v in ex]


def sigmoid_row(row):
    return [_sigmoid(v) for v in row]


def sqrt_softplus_row(row):
    """sqrt(softplus(x)), softplus = log(1 + exp(x)), or x above 20; NaN stays NaN."""
    return [math.sqrt(v if v > 20 else math.log1p(math.exp(v))) if not math.isnan(v)
            else math.nan for v in row]


_SCORE_ROW = {"softmax": softmax_row, "sigmoid": sigmoid_row, "sqrtsoftplus": sqrt_softplus_row}


def route_loop(logits, topk, renormalize=False, scoring_func="softmax", bias=None,
               num_expert_group=1, topk_group=1, routed_scaling_factor=1.0, kernel=None):
    """Every routing function of the contract, one token at a time, in float64.

    fused_topk       = route_loop(softmax | sigmoid, no bias, one group, factor 1)   kernel "topk"
    fused_topk_bias  = route_loop(softmax | sigmoid | sqrtsoftplus, bias, one group, factor)
                                                                                     kernel "topk"
    grouped_topk     = route_loop(softmax | sigmoid, bias or not, G groups, factor)  kernel "grouped"

    (kernel defaults to "grouped" with more than one group, else "topk".) For each token:
    scores; the non-finite rule of the kernel: "topk" makes a non-finite score 0, "grouped"
    marks an expert invalid when its scoring input is not finite (the logit for sigmoid, the
    softmax score for softmax) and rounds the softmax scores to the logits' dtype; choice =
    scores + bias (or scores), -inf for an invalid expert; group score = the max of the
    group's choices (no bias) or the sum of its two best (bias); keep the topk_group best
    groups; ids = the K best choices inside them; weights = the unbiased scores of those ids
    (0 if invalid), divided by their sum if renormalize and the sum is > 0, then times
    routed_scaling_factor; a "grouped" token with no valid expert among its K gets 1/K each
    when renormalizing, else 0. NaN counts as -inf wherever something is ranked.
    Returns (weights float64 [T, K], ids int64 [T, K]).
    """
    kernel = kernel or ("grouped" if num_expert_group > 1 else "topk")
    in_dtype = np.asarray(logits).dtype
    logits = np.asarray(logits).astype(np.float64)
    num_tokens, num_experts = logits.shape
    per_group = num_experts // num_expert_group
    bias = None if bias is None else [float(b) for b in np.asarray(bias).astype(np.float32)]
    weights = np.zeros((num_tokens, topk))
    ids = np.zeros((num_tokens, topk), dtype=np.int64)
    for t in range(num_tokens):
        row = [float(v) for v in logits[t]]
        scores = _SCORE_ROW[scoring_func](row)
        if kernel == "topk":
            valid = [True] * num_experts
            scores = [v if math.isfinite(v) else 0.0 for v in scores]
        else:
            inputs = scores if scoring_func == "softmax" else row
            valid = [math.isfinite(v) for v in inputs]
            if scoring_func == "softmax" and in_dtype.itemsize == 2:   # bf16 / fp16 logits
                scores = [float(np.asarray(v).astype(in_dtype)) for v in scores]
            scores = [v if ok else 0.0 for v, ok in zip(scores, valid)]
        choice = scores if bias is None else [s + b for s, b in zip(scores, bias)]
        choice = [c if ok else -math.inf for c, ok in zip(choice, valid)]
        group_scores = []
        for g in range(num_expert_group):
            members = list(range(g * per_group, (g + 1) * per_group))
            if bias is None:
                group_scores.append(max(_key(choice[e]) for e in members))
            else:
                best = top_ids(choice, min(2, per_group), members)
                group_scores.append(sum(_key(choice[e]) for e in best))
        kept = top_ids(group_scores, topk_group)
        candidates = [e for g in kept for e in range(g * per_group, (g + 1) * per_group)]
        chosen = top_ids(choice, topk, candidates)
        w = [scores[e] if valid[e] else 0.0 for e in chosen]
        if renormalize:
            total = sum(w)
            if total > 0:
                w = [v / total for v in w]
        w = [v * routed_scaling_factor for v in w]
        if not any(valid[e] for e in chosen):
            w = [1.0 / topk if renormalize else 0.0] * topk
        weights[t] = w
        ids[t] = chosen
    return weights, ids


def llama4_loop(logits, topk):
    """Llama 4: ids = top-K of the raw logits, weight = sigmoid(logit)."""
    logits = np.asarray(logits).astype(np.float64)
    weights = np.zeros((logits.shape[0], topk))
    ids = np.zeros((logits.shape[0], topk), dtype=np.int64)
    for t, row in enumerate(logits):
        row = [float(v) for v in row]
        ids[t] = top_ids(row, topk)
        weights[t] = [_sigmoid(row[e]) for e in ids[t]]
    return weights, ids


def zero_experts_loop(topk_ids, topk_weights, num_experts, hidden_states):
    """LongCat-Flash "identity" zero experts: a slot with id >= E adds w * x[t] to the token
    and is pointed at expert 0 with weight 0 for the routed experts.
    Returns (zero_expert_result float64 [T, H], new ids, new weights)."""
    x = np.asarray(hidden_states).astype(np.float64)
    ids = np.array(topk_ids, copy=True)
    weights = np.array(topk_weights, dtype=np.float64, copy=True)
    result = np.zeros_like(x)
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            if ids[t, k] >= num_experts:
                result[t] += weights[t, k] * x[t]
                ids[t, k] = 0
                weights[t, k] = 0.0
    return result, ids, weights


# --------------------------------------------------------------------------------------------
# Alignment: one pass over the slots into per-expert lists.
# --------------------------------------------------------------------------------------------

def align_capacity(num_slots, block_size, num_experts, pad_sorted_ids=False):
    """The length of sorted_token_ids, from the contract's formula."""
    size = num_slots + num_experts * (block_size - 1)
    if pad_sorted_ids:
        size = (size + block_size - 1) // block_size * block_size
    if num_slots < num_experts:
        size = min(size, num_slots * block_size)
    return size


def align_loop(topk_ids, block_size, num_experts, expert_map=None, pad_sorted_ids=False,
               ignore_invalid_experts=False):
    """moe_align_block_size by hand: bucket the slots by expert (in slot order; a slot whose
    id is outside [0, E) goes nowhere), pad each bucket to a multiple of B with the value P,
    one expert id per block (the local id under an expert_map, -1 if elsewhere; or no blocks
    at all with ignore_invalid_experts).
    Returns (sorted_token_ids, expert_ids, num_tokens_post_padded) as int32 arrays."""
    flat = [int(v) for v in np.asarray(topk_ids).ravel()]
    num_slots = len(flat)
    buckets = [[] for _ in range(num_experts)]
    for s, e in enumerate(flat):
        if 0 <= e < num_experts:
            buckets[e].append(s)
    sorted_ids, block_experts = [], []
    for e in range(num_experts):
        local = e if expert_map is None else int(expert_map[e])
        if not buckets[e] or (ignore_invalid_experts and local < 0):
            continue
        run = buckets[e] + [num_slots] * (-len(buckets[e]) % block_size)
        sorted_ids += run
        block_experts += [local] * (len(run) // block_size)
    capacity = align_capacity(num_slots, block_size, num_experts, pad_sorted_ids)
    num_post_padded = len(sorted_ids)
    sorted_ids += [num_slots] * (capacity - len(sorted_ids))
    num_blocks = (capacity + block_size - 1) // block_size
    block_experts += [-1] * (num_blocks - len(block_experts))
    return (np.array(sorted_ids, dtype=np.int32), np.array(block_experts, dtype=np.int32),
            np.array([num_post_padded], dtype=np.int32))


def assert_same_blocks(got, want, block_size, num_slots):
    """The contract-level check a kernel must pass: same num_tokens_post_padded, same
    expert per block, the same *set* of slots per block (vLLM leaves the order of slots
    inside an expert's run unspecified; sorting each block compares them as sets, as a slot
    appears once), the padding value P everywhere else."""
    g_ids, g_experts, g_n = got
    w_ids, w_experts, w_n = want
    assert g_ids.shape == w_ids.shape, f"sorted_token_ids shape {g_ids.shape} != {w_ids.shape}"
    assert g_experts.shape == w_experts.shape, f"expert_ids shape {g_experts.shape} != {w_experts.shape}"
    n = int(w_n[0])
    assert int(g_n[0]) == n, f"num_tokens_post_padded {int(g_n[0])} != {n}"
    np.testing.assert_array_equal(g_experts, w_experts, err_msg="expert_ids")
    g_blocks = np.sort(g_ids[:n].reshape(-1, block_size), axis=1)      # [blocks, B]
    w_blocks = np.sort(w_ids[:n].reshape(-1, block_size), axis=1)
    np.testing.assert_array_equal(g_blocks, w_blocks, err_msg="the set of slots of a block")
    assert (g_ids[n:] == num_slots).all(), "the tail of sorted_token_ids is not the padding value P"


# --------------------------------------------------------------------------------------------
# Activations: one vector at a time, float64.
# --------------------------------------------------------------------------------------------

def _erf_vec(v):
    return np.array([math.erf(x) for x in v])


ELEMENTWISE = {
    "silu": lambda v: v / (1.0 + np.exp(-v)),
    "gelu": lambda v: 0.5 * v * (1.0 + _erf_vec(v / math.sqrt(2.0))),
    "gelu_tanh": lambda v: 0.5 * v * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3))),
    "relu2": lambda v: np.maximum(v, 0.0) ** 2,
}


def activation_vec(h, activation="silu", is_act_and_mul=True, alpha=1.702, limit=7.0):
    """One slot's activation: h [N] float64 -> [N/2] (gated) or [N] (no-mul)."""
    with np.errstate(over="ignore"):                  # exp(-x) -> inf gives 0, the right limit
        return _activation_vec(np.asarray(h, dtype=np.float64), activation, is_act_and_mul,
                               alpha, limit)


# Below this gate, gelu and gelu_tanh are 1 + erf / 1 + tanh of a number near -1: the sum
# cancels, so a one-ulp difference between two fp32 erf / tanh (CUDA's against NumPy's)
# changes the result by far more than one ulp, and the bf16 bits of about a quarter of such
# outputs differ (measured on uniform gates in [-9, 9]: 27%, against 0.07% at gate >= -3).
CANCELLING_BELOW = {"gelu": -3.0, "gelu_tanh": -3.0}


def rounding_comparable(x, activation="silu", is_act_and_mul=True):
    """The output elements of apply_activation(x, ...) whose bits two correct fp32
    implementations share but for rare last-ulp flips: every element, except for gelu and
    gelu_tanh those whose gate lies where 1 + erf / 1 + tanh cancels (CANCELLING_BELOW).
    A boolean mask of the output's shape."""
    x = np.asarray(x, dtype=np.float32)
    gate = x[:, : x.shape[1] // 2] if is_act_and_mul and activation != "swigluoai" else (
        x[:, 0::2] if is_act_and_mul else x)
    below = CANCELLING_BELOW.get(activation)
    return np.ones(gate.shape, bool) if below is None else gate >= below


def _activation_vec(h, activation, is_act_and_mul, alpha, limit):
    if activation.endswith("_no_mul"):
        activation, is_act_and_mul = activation[:-len("_no_mul")], False
    if not is_act_and_mul:
        return ELEMENTWISE[activation](h)
    if activation == "swigluoai":                      # gpt-oss: gate, up interleaved
        gate = np.minimum(h[0::2], limit)
        up = np.clip(h[1::2], -limit, limit)
        return (up + 1.0) * gate / (1.0 + np.exp(-alpha * gate))
    half = h.size // 2
    return ELEMENTWISE[activation](h[:half]) * h[half:]


# --------------------------------------------------------------------------------------------
# The experts: one (token, slot) pair at a time.
# --------------------------------------------------------------------------------------------

def fused_experts_loop(hidden_states, w1, w2, topk_weights, topk_ids, activation="silu",
                       is_act_and_mul=True, apply_router_weight_on_input=False, expert_map=None,
                       w1_bias=None, w2_bias=None):
    """out[t] = sum_k  w * (W2[e] @ act(W1[e] @ x[t] + b1[e]) + b2[e]),  e = ids[t, k]

    in float64 matvecs. The router weight w scales GEMM2's output including its bias (vLLM
    multiplies the accumulator after adding the bias), or with apply_router_weight_on_input
    GEMM1's output including its bias (vLLM's Triton path multiplies there). A slot whose
    id is outside [0, E) (-1) adds nothing; under an expert_map neither does a slot whose
    expert is not local; w1/w2 hold local experts.
    """
    x = np.asarray(hidden_states).astype(np.float64)
    b1 = None if w1_bias is None else np.asarray(w1_bias).astype(np.float64)
    b2 = None if w2_bias is None else np.asarray(w2_bias).astype(np.float64)
    weights = np.asarray(topk_weights).astype(np.float64)
    num_tokens, top_k = np.asarray(topk_ids).shape
    out = np.zeros((num_tokens, x.shape[1]))
    for t in range(num_tokens):
        for k in range(top_k):
            e = int(topk_ids[t, k])
            if not 0 <= e < (len(w1) if expert_map is None else len(expert_map)):
                continue                          # routed nowhere (-1)
            if expert_map is not None:
                e = int(expert_map[e])
                if e < 0:
                    continue                      # on another rank: adds nothing here
            w = weights[t, k]
            h = w1[e].astype(np.float64) @ x[t]
            if b1 is not None:
                h = h + b1[e]
            if apply_router_weight_on_input:
                h = h * w
            y = w2[e].astype(np.float64) @ activation_vec(h, activation, is_act_and_mul)
            if b2 is not None:
                y = y + b2[e]
            if not apply_router_weight_on_input:
                y = y * w
            out[t] += y
    return out


# --------------------------------------------------------------------------------------------
# EP helpers and an independent expert map.
# --------------------------------------------------------------------------------------------

def expert_map_loop(ep_size, ep_rank, num_experts, placement="linear"):
    """Which experts rank r holds, by hand: linear gives each rank a contiguous run, the
    first E % R ranks one extra; round_robin deals experts out like cards."""
    if placement == "linear":
        owner = []
        for r in range(ep_size):
            owner += [r] * (num_experts // ep_size + (1 if r < num_experts % ep_size else 0))
    else:
        owner = [e % ep_size for e in range(num_experts)]
    expert_map, local = [], 0
    for e in range(num_experts):
        if owner[e] == ep_rank:
            expert_map.append(local)
            local += 1
        else:
            expert_map.append(-1)
    return local, np.array(expert_map, dtype=np.int32)


def local_weights(expert_map, *weights):
    """Slice global per-expert tensors down to a rank's local experts, in local-id order."""
    order = np.argsort(np.where(expert_map >= 0, expert_map, np.iinfo(np.int32).max))
    order = order[: int((expert_map >= 0).sum())]
    if order.size and (np.diff(order) == 1).all():        # a contiguous run: a view, no copy
        run = slice(int(order[0]), int(order[-1]) + 1)
        return tuple(None if w is None else w[run] for w in weights)
    return tuple(None if w is None else w[order] for w in weights)


# --------------------------------------------------------------------------------------------
# torch: an independent per-expert implementation (torch ops only), for the big shapes.
# --------------------------------------------------------------------------------------------

def _torch():
    import torch  # optional: tests that use these are skipped without torch
    return torch


def _to_torch(a, dtype):
    torch = _torch()
    if a is None:
        return None
    a = np.asarray(a)
    if a.dtype == BF16 or a.dtype == np.float16:
        a = a.astype(np.float32)
    if not a.flags.writeable:                              # torch wants writable memory
        a = a.copy()
    return torch.from_numpy(np.ascontiguousarray(a)).to(dtype)


def torch_route(logits, topk, renormalize=False, scoring_func="softmax", bias=None,
                num_expert_group=1, topk_group=1, routed_scaling_factor=1.0):
    """The routing functions with torch ops in fp32, for finite fp32 logits (where the
    kernels' non-finite rules and grouped_topk's softmax rounding do nothing). Ranking uses a
    stable descending sort, which puts equal scores in id order (ties to the lowest id)."""
    torch = _torch()
    x = _to_torch(logits, torch.float32)
    num_tokens, num_experts = x.shape
    scores = torch.softmax(x, dim=-1) if scoring_func == "softmax" else torch.sigmoid(x)
    choice = scores if bias is None else scores + _to_torch(bias, torch.float32)[None, :]
    grouped = choice.view(num_tokens, num_expert_group, -1)
    if bias is None:
        group_scores = grouped.amax(dim=-1)
    else:
        two = min(2, grouped.shape[-1])
        group_scores = torch.sort(grouped, dim=-1, descending=True, stable=True).values[..., :two].sum(-1)
    kept = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, :topk_group]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
    expert_mask = group_mask.repeat_interleave(num_experts // num_expert_group, dim=1)
    masked = choice.masked_fill(~expert_mask, float("-inf"))
    ids = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :topk]
    weights = scores.gather(1, ids)
    if renormalize:
        total = weights.sum(-1, keepdim=True)
        weights = torch.where(total > 0, weights / total, weights)
    return (weights * routed_scaling_factor).numpy(), ids.numpy()


def _torch_activation(h, activation, is_act_and_mul):
    torch = _torch()
    F = torch.nn.functional
    if activation.endswith("_no_mul"):
        activation, is_act_and_mul = activation[:-len("_no_mul")], False
    act = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh"),
           "relu2": lambda v: torch.square(torch.relu(v))}
    if not is_act_and_mul:
        return act[activation](h)
    if activation == "swigluoai":
        gate = h[:, 0::2].clamp(max=7.0)
        up = h[:, 1::2].clamp(min=-7.0, max=7.0)
        return (up + 1) * gate * torch.sigmoid(1.702 * gate)
    half = h.shape[1] // 2
    return act[activation](h[:, :half]) * h[:, half:]


def torch_fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation="silu",
                        is_act_and_mul=True, apply_router_weight_on_input=False,
                        expert_map=None, w1_bias=None, w2_bias=None, compute_dtype="float64"):
    """The experts, one expert at a time: gather the (token, slot) pairs routed to e, two
    matmuls, scatter-add back with index_add_. Returns a float64 numpy [T, H]."""
    torch = _torch()
    dt = getattr(torch, compute_dtype)
    x = _to_torch(hidden_states, dt)
    ids = torch.from_numpy(np.asarray(topk_ids).astype(np.int64))
    weights = _to_torch(topk_weights, dt)
    out = torch.zeros(x.shape, dtype=dt)
    num_global = len(w1) if expert_map is None else len(expert_map)
    for e in range(num_global):
        local = e if expert_map is None else int(expert_map[e])
        if local < 0:
            continue
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        w = weights[tok, slot][:, None]
        h = x[tok] @ _to_torch(w1[local], dt).T
        if w1_bias is not None:
            h = h + _to_torch(w1_bias[local], dt)
        if apply_router_weight_on_input:
            h = h * w
        y = _torch_activation(h, activation, is_act_and_mul) @ _to_torch(w2[local], dt).T
        if w2_bias is not None:
            y = y + _to_torch(w2_bias[local], dt)
        if not apply_router_weight_on_input:
            y = y * w
        out.index_add_(0, tok, y)
    return out.to(torch.float64).numpy()


def torch_fused_moe(hidden_states, w1, w2, gating_output, topk, renormalize, expert_map=None,
                    compute_dtype="float64", **route_kwargs):
    """Route with torch_route, then torch_fused_experts."""
    weights, ids = torch_route(gating_output, topk, renormalize, **route_kwargs)
    return torch_fused_experts(hidden_states, w1, w2, weights, ids, expert_map=expert_map,
                               compute_dtype=compute_dtype)
