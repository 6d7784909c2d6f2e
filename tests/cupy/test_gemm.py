"""The CuPy grouped GEMM ladder (cuda_kernels/cupy/gemm.py) against the reference, on the GPU.

    T tokens, E experts (E_local on this rank), K top-k, H hidden, I intermediate,
    B block size, N output width, Kdim reduction width, P = T*K slots

GPU (`gpu` marker, skipped without a device): every version x dtype against
reference.grouped_gemm fed float64 inputs (relative Frobenius error: fp32 <= 1e-5 for the
sqrt(Kdim) growth of fp32 sums; fp16/bf16 <= 1e-2 for one output rounding), on vLLM's
fused_moe test grid and on the nasty cases; outputs poisoned with NaN (all bytes 0xFF, a
NaN in fp32, fp16 and bf16) before every launch, so a row the kernel forgets stays NaN and
fails; the end-to-end layer with these GEMMs against reference.fused_experts; bad inputs
raise before any launch. CPU: every kernel source opens with its header; without CuPy the
call fails on its first argument. The kernels on the CPU emulator: test_gemm_emulated.py; the
config table: test_gemm_configs.py.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import pytest

import reference
from cuda_kernels.cupy import _compile as C
from cuda_kernels.cupy import _arrays as A
from cuda_kernels.cupy import gemm as gg
from cuda_kernels.cupy import gemm_configs as gcfg
from cuda_kernels.cupy import tune
from tests.oracles import (
    BF16,
    TOL,
    distinct_topk_ids,
    gemm_case,
    ids_with_runs,
    random_weights,
    rel_err,
    rng_for,
    uniform,
)
from tests.support import DTYPES


def test_kernel_sources_open_with_a_header():
    for cu in gg.CU_FILES.values():
        text = (C.KERNEL_DIR / cu).read_text()
        head = text[:text.index("#include")]
        for word in ("Math", "Launch geometry", "v1", "v4", "v5", "Run:"):
            assert word in head, f"{cu}: header lacks {word!r}"


# ============================================================================ GPU helpers
def _cp():
    import cupy

    return cupy


def _poisoned(shape, dtype):
    """A device array whose every byte is 0xFF: NaN in fp32, fp16 and bf16."""
    out = A.empty(shape, dtype)
    A.raw(out).view(_cp().uint8).fill(255)
    return out


def _host(x, dtype):
    h = x.get()
    return h.view(BF16) if np.dtype(dtype) == BF16 and h.dtype == np.uint16 else h


def _dev(a):
    return None if a is None else A.to_device(a)


def _problem(T, E, top_k, N, K, dtype, B, *, ignore_invalid=False, **kw):
    """oracles.gemm_case (host inputs, the float64 answer) and device copies of its arrays.

    gemm2=True: a is [P, K] (one row per slot), top_k = 1 in the call; else a is [T, K].
    """
    prob = gemm_case(T, E, top_k, N, K, B, dtype, ignore=ignore_invalid, **kw)
    prob["dev"] = {k: _dev(prob[k]) for k in ("a", "w", "st", "ex", "nt", "tw", "bias")}
    return prob


def _run(prob, version, **kw):
    d = prob["dev"]
    out = _poisoned((prob["P"], prob["N"]), prob["dtype"])
    got = gg.grouped_gemm(d["a"], d["w"], d["st"], d["ex"], d["nt"], prob["top_k"], prob["B"],
                          d["tw"], prob["mul"], d["bias"], version=version, out=out, **kw)
    assert got is out
    return _host(got, prob["dtype"])


def _check(prob, version, tol=None, **kw):
    got = _run(prob, version, **kw)
    want = prob["want"]
    tol = TOL[prob["dtype"]] if tol is None else tol
    err = rel_err(got, want)   # inf when a poisoned (NaN) row was left unwritten
    assert err <= tol, (f"{version} {prob['dtype']}: relative error {err:.3e} > {tol:.0e}; "
                        f"NaN rows: {int(np.isnan(got.astype(np.float64)).any(1).sum())}")
    return got


VERSIONS_ALL = ("v1", "v2", "v3", "v4")


@pytest.fixture(scope="module")
def prebuilt():
    """Compile the table's kernels once, in parallel threads (NVRTC runs outside the GIL):
    the GPU tests then find them built instead of compiling ~50 kernels one by one."""
    ok, _ = A.availability()
    if ok:
        gg.prebuild()


def gpu(test):
    """The `gpu` marker plus the prebuilt kernels."""
    return pytest.mark.gpu(pytest.mark.usefixtures("prebuilt")(test))


# ============================================================================ GPU: the grid
# vLLM's tests/kernels/moe/test_moe.py grid: (T, I, H) x E x top_k
VLLM_TIH = ((1, 128, 128), (1, 2048, 128), (33, 2048, 128), (222, 1024, 1024))


@functools.lru_cache(maxsize=2)
def _grid_problem(T, I, H, E, top_k, dkey, which):  # noqa: E741
    dt = DTYPES[dkey]
    B = gcfg.get_config(T, 2 * I, H, E, top_k, dt)["BLOCK_M"]   # the layer's choice
    if which == "gemm1":
        return _problem(T, E, top_k, 2 * I, H, dt, B, seed=1)
    return _problem(T, E, top_k, H, I, dt, B, seed=2, gemm2=True, mul=True)


# the first parametrize varies fastest: the versions run back to back on one cached problem
@gpu
@pytest.mark.parametrize("version", VERSIONS_ALL)
@pytest.mark.parametrize("which", ("gemm1", "gemm2"))
@pytest.mark.parametrize("dkey", tuple(DTYPES))
@pytest.mark.parametrize("top_k", (2, 6))
@pytest.mark.parametrize("E", (8, 64))
@pytest.mark.parametrize("T,I,H", VLLM_TIH)
def test_vllm_grid(version, T, I, H, E, top_k, dkey, which):  # noqa: E741
    _check(_grid_problem(T, I, H, E, top_k, dkey, which), version)


# ============================================================================ GPU: nasty cases
NASTY = {
    # name: (T, E, top_k, N, K, B, extra)
    "one_token": (1, 8, 2, 256, 128, 16, {}),
    "T_not_multiple_of_block": (37, 8, 2, 192, 256, 64, {}),
    "experts_without_tokens": (3, 64, 2, 128, 128, 16, {}),
    "N200_K136": (19, 8, 3, 200, 136, 16, {}),
    "block_128": (300, 4, 2, 256, 512, 128, {}),
    "block_32_bias_same_dtype": (25, 8, 2, 136, 264, 32, {"bias": "same"}),
    "bias_fp32_and_weights": (25, 8, 2, 136, 264, 16, {"bias": np.float32, "mul": True}),
    "gemm2_weights": (41, 16, 4, 120, 96, 32, {"gemm2": True, "mul": True}),
}


@functools.lru_cache(maxsize=1)
def _nasty_problem(case, dkey):
    T, E, top_k, N, K, B, extra = NASTY[case]
    return _problem(T, E, top_k, N, K, DTYPES[dkey], B, **extra)


@gpu
@pytest.mark.parametrize("version", VERSIONS_ALL)
@pytest.mark.parametrize("dkey", tuple(DTYPES))
@pytest.mark.parametrize("case", tuple(NASTY))
def test_nasty(version, case, dkey):
    _check(_nasty_problem(case, dkey), version)


@gpu
@pytest.mark.parametrize("dkey", tuple(DTYPES))
@pytest.mark.parametrize("version", VERSIONS_ALL)
def test_all_tokens_on_one_expert(version, dkey):
    T, E = 77, 8
    ids = np.full((T, 1), 5, dtype=np.int32)
    _check(_problem(T, E, 1, 192, 256, DTYPES[dkey], 16, ids=ids, mul=True), version)


@gpu
@pytest.mark.parametrize("dkey", tuple(DTYPES))
@pytest.mark.parametrize("version", VERSIONS_ALL)
def test_expert_map_minus_one_blocks_are_zero(version, dkey):
    """Blocks of experts on other ranks (expert_ids == -1) write zeros, bias or not."""
    T, E, top_k = 29, 8, 2
    _, emap = reference.determine_expert_map(2, 1, E)            # rank 1 of 2: experts 4..7
    prob = _problem(T, E, top_k, 160, 128, DTYPES[dkey], 16, expert_map=emap, E_local=4,
                    bias=np.float32, mul=True)
    assert (prob["ex"] == -1).any()
    got = _check(prob, version)
    zero_rows = np.isin(np.arange(prob["P"]), [
        s for b, e in enumerate(prob["ex"][: int(prob["nt"][0]) // 16]) if e == -1
        for s in prob["st"][b * 16:(b + 1) * 16] if s < prob["P"]])
    assert zero_rows.any() and (got[zero_rows].astype(np.float64) == 0).all()


@gpu
@pytest.mark.parametrize("version", VERSIONS_ALL)
def test_rows_named_by_no_block_are_left_alone(version):
    """ignore_invalid_experts drops non-local slots from the alignment: their rows are not
    written (the poison stays), all others are."""
    T, E, top_k = 21, 8, 2
    _, emap = reference.determine_expert_map(2, 0, E)
    prob = _problem(T, E, top_k, 128, 128, np.dtype(np.float16), 16, expert_map=emap,
                    E_local=4, ignore_invalid=True)
    got = _run(prob, version).astype(np.float64)
    live = np.isfinite(prob["want"]).all(axis=1)
    assert (~live).any() and live.any()
    assert np.isnan(got[~live]).all()
    assert rel_err(got[live], prob["want"][live]) <= TOL[np.dtype(np.float16)]


@gpu
@pytest.mark.parametrize("dkey", tuple(DTYPES))
def test_kdim_not_multiple_of_16_bytes(dkey):
    """Kdim = 100 (fp16/bf16: not a multiple of 8; fp32: 100 % 4 == 0): the default steps down
    to a rung that can (v2 or v3), explicit v3/v4 raise naming the requirement."""
    dt = DTYPES[dkey]
    prob = _problem(13, 8, 2, 96, 100, dt, 16, mul=True)
    _check(prob, None)
    if dkey != "fp32":
        for v in ("v3", "v4"):
            with pytest.raises(ValueError, match=r"a: v\d loads 16-byte chunks.*multiple of 8"):
                _run(prob, v)


@gpu
@pytest.mark.parametrize("version", VERSIONS_ALL)
def test_block_size_larger_than_the_tile(version):
    """B = 128 with a config whose BLOCK_M is 16: several CTA tiles per alignment block."""
    prob = _problem(90, 4, 2, 128, 128, np.dtype(np.float16), 128)
    cfg = gcfg.heuristic_config(version, "fp16", 1)
    _check(prob, version, config=cfg)


@gpu
def test_empty_batch():
    for dt in DTYPES.values():
        prob = _problem(0, 8, 2, 64, 64, dt, 16)
        got = gg.grouped_gemm(prob["dev"]["a"], prob["dev"]["w"], prob["dev"]["st"],
                              prob["dev"]["ex"], prob["dev"]["nt"], 2, 16)
        assert got.shape == (0, 64)


@gpu
def test_deterministic():
    """No atomics: two calls give the same bits."""
    prob = _problem(64, 8, 2, 256, 512, BF16, 16, mul=True)
    assert (_run(prob, "v4").view(np.uint16) == _run(prob, "v4").view(np.uint16)).all()


@gpu
def test_default_version_and_fp32_v4():
    prob = _problem(5, 8, 2, 64, 64, np.dtype(np.float32), 16)
    _check(prob, "v4")      # fp32 with v4 runs v3
    _check(prob, None)


# v5 (wgmma, opt-in): its own grid, with block sizes it can take (multiples of 64)
V5_CASES = {
    # name: (T, E, top_k, N, K, B, extra, config or None for the table's)
    "vllm_33_2048_128": (33, 8, 2, 4096, 128, 64, {}, None),
    "vllm_222_1024_1024_gemm1": (222, 64, 6, 2048, 1024, 64, {}, None),
    "vllm_222_1024_1024_gemm2": (222, 8, 6, 1024, 1024, 64, {"gemm2": True, "mul": True}, None),
    "one_token": (1, 8, 2, 256, 128, 64, {}, None),
    "N200_K136_bias_weights": (37, 8, 3, 200, 136, 64, {"bias": np.float32, "mul": True}, None),
    "block_128_n256": (300, 4, 2, 512, 256, 128, {"bias": "same"},
                       {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "warps": 8, "stages": 4}),
    "block_128_tile_64_n64_3_stages": (90, 4, 2, 136, 72, 128, {"mul": True},
                                       {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "warps": 4,
                                        "stages": 3}),
    "expert_map": (29, 8, 2, 160, 128, 64, {"expert_map": True, "bias": np.float32}, None),
    # ~60 rows an expert in 128-row tiles: a tile's second 64 rows all padding in some tiles
    "half_padded_tiles": (120, 4, 2, 264, 328, 128, {"mul": True},
                          {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "warps": 8,
                           "stages": 4}),
}


@gpu
@pytest.mark.parametrize("dkey", ("fp16", "bf16"))
@pytest.mark.parametrize("case", tuple(V5_CASES))
def test_v5_wgmma(case, dkey):
    cp = _cp()
    if cp.cuda.Device().compute_capability != "90":
        pytest.skip("v5 (wgmma, sm_90a) needs a compute capability 9.0 GPU")
    T, E, top_k, N, K, B, extra, cfg = V5_CASES[case]
    prob = _problem(T, E, top_k, N, K, DTYPES[dkey], B, **extra)
    _check(prob, "v5", **({"config": cfg} if cfg else {}))


# v6 (TMA + cp.async, warp-specialized, persistent; opt-in): the grid of v5 and the nasty
# cases, each under the table's config and under every kind of CTA v6 has (two consumers of
# two 64-row pieces or of 64 rows, two splitting 256 columns, one consumer; deep and shallow
# rings, GROUP_M 4 / 16)
V6_CASES = {
    # name: (T, E, top_k, N, K, B, extra)
    "vllm_33_2048_128": (33, 8, 2, 4096, 128, 64, {}),
    "vllm_222_1024_1024_gemm1": (222, 64, 6, 2048, 1024, 64, {}),
    "vllm_222_1024_1024_gemm2": (222, 8, 6, 1024, 1024, 64, {"gemm2": True, "mul": True}),
    "one_token": (1, 8, 2, 256, 128, 64, {}),
    "N200_K136_bias_weights": (37, 8, 3, 200, 136, 64, {"bias": np.float32, "mul": True}),
    "block_128_bias_same": (300, 4, 2, 512, 256, 128, {"bias": "same"}),
    "experts_without_tokens": (3, 64, 2, 128, 128, 64, {}),
    "all_tokens_on_one_expert": (77, 8, 1, 192, 256, 64, {"one_expert": 5, "mul": True}),
    "expert_map": (29, 8, 2, 160, 128, 64, {"expert_map": True, "bias": np.float32, "mul": True}),
    "N124_gemm2": (41, 16, 4, 124, 96, 64, {"gemm2": True, "mul": True}),
    # ~60 rows an expert in 128-row blocks: a tile's second 64 rows all padding in some tiles
    # (the second consumer's rows, under 128-row tiles) and not in others
    "half_padded_tiles": (120, 4, 2, 264, 328, 128, {"mul": True}),
    # ~70 m tiles x 8 n tiles, far more than the SMs: the persistent walk wraps many times
    "persistent_many_tiles": (4096, 8, 2, 1024, 512, 128, {"mul": True}),
    # 256-row blocks: runs of 30 .. 300 slots put 0, 1 or 2 live 64-row pieces on each consumer
    # of a 256-row tile, and a run's second 128-row tile all padding under 128-row tiles
    "block_256_runs": (418, 6, 2, 264, 200, 256,
                       {"ids": ids_with_runs((30, 100, 150, 0, 256, 300)), "mul": True,
                        "bias": np.float32}),
    "block_256_random": (2000, 16, 2, 384, 512, 256, {"gemm2": True, "mul": True}),
}
V6_CONFIGS = {
    "table": None,
    "256x128_s4": (256, 128, 64, 12, 4, 8, 80),
    "128x256_s4": (128, 256, 64, 12, 4, 8, 56),
    "128x128_s6_g16": (128, 128, 64, 12, 6, 16, 56),
    "64x256_split_n": (64, 256, 64, 12, 5, 4, 56),
    "64x128_one_consumer_s2": (64, 128, 64, 8, 2, 8, 56),
}


@functools.lru_cache(maxsize=1)     # the configs of a case run back to back (varied fastest)
def _v6_problem(case, dkey):
    T, E, top_k, N, K, B, extra = V6_CASES[case]
    return _problem(T, E, top_k, N, K, DTYPES[dkey], B, **extra)


def _need_sm90():
    if _cp().cuda.Device().compute_capability != "90":
        pytest.skip("v6 (wgmma, setmaxnreg: sm_90a) needs a compute capability 9.0 GPU")


@gpu
@pytest.mark.parametrize("config", tuple(V6_CONFIGS))
@pytest.mark.parametrize("dkey", ("fp16", "bf16"))
@pytest.mark.parametrize("case", tuple(V6_CASES))
def test_v6_tma_ws(case, dkey, config):
    _need_sm90()
    cand = V6_CONFIGS[config]
    kw = {} if cand is None else {"config": dict(zip(tune.CANDIDATE_KEYS["v6"], cand))}
    _check(_v6_problem(case, dkey), "v6", **kw)


@gpu
def test_v6_rows_named_by_no_block_are_left_alone():
    """ignore_invalid_experts: the rows of non-local slots keep their poison under v6 too."""
    _need_sm90()
    T, E, top_k = 21, 8, 2
    _, emap = reference.determine_expert_map(2, 0, E)
    prob = _problem(T, E, top_k, 128, 128, np.dtype(np.float16), 64, expert_map=emap,
                    E_local=4, ignore_invalid=True)
    got = _run(prob, "v6").astype(np.float64)
    live = np.isfinite(prob["want"]).all(axis=1)
    assert (~live).any() and live.any()
    assert np.isnan(got[~live]).all()
    assert rel_err(got[live], prob["want"][live]) <= TOL[np.dtype(np.float16)]


@gpu
def test_v6_deterministic_and_graph_capturable():
    """No atomics: two calls give the same bits; and a CUDA graph captured around the call
    (after a warm-up that compiles, encodes the tensor map and reads the SM count) replays
    to the same bits, with num_tokens_post_padded read on the device."""
    _need_sm90()
    cp = _cp()
    prob = _problem(300, 8, 2, 384, 512, BF16, 128, mul=True)
    first = _run(prob, "v6")
    assert (first.view(np.uint16) == _run(prob, "v6").view(np.uint16)).all()
    d = prob["dev"]
    out = _poisoned((prob["P"], prob["N"]), prob["dtype"])
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        gg.grouped_gemm(d["a"], d["w"], d["st"], d["ex"], d["nt"], prob["top_k"], prob["B"],
                        d["tw"], True, version="v6", out=out)
        graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    assert (_host(out, BF16).view(np.uint16) == first.view(np.uint16)).all()


# ============================================================================ GPU: end to end
def _stage(name):
    """The CuPy stage when the backend has it, else None (the test then runs it on the host)."""
    try:
        import cuda_kernels.cupy as ck

        return getattr(ck, name)
    except Exception:
        return None


E2E_RUNGS = ([(v, d) for v in ("v2", "v3", "v4") for d in ("fp32", "bf16")]
             + [(v, d) for v in ("v5", "v6") for d in ("fp16", "bf16")])


@gpu
@pytest.mark.parametrize("version,dkey", E2E_RUNGS)
@pytest.mark.parametrize("case", ("plain", "bias_ep"))
def test_fused_experts_end_to_end(version, dkey, case):
    """reference.fused_experts (exact) against: alignment -> GEMM1 (this) -> activation ->
    GEMM2 with the router weight (this) -> moe_sum. The sm_90a rungs (v5, v6) align to their
    own BLOCK_M (a multiple of 64)."""
    hopper = version in ("v5", "v6")
    if hopper:
        _need_sm90()
    dt = DTYPES[dkey]
    T, E, top_k, H, I = 45, 16, 4, 256, 192  # noqa: E741
    rng = rng_for("e2e-wgmma" if hopper else "e2e", version, dkey, case)
    x = uniform(rng, (T, H), 1.0, dt)
    w1 = uniform(rng, (E, 2 * I, H), 1.7 / math.sqrt(H), dt)
    w2 = uniform(rng, (E, H, I), 1.7 / math.sqrt(I), dt)
    ids = distinct_topk_ids(rng, T, E, top_k)
    tw = random_weights(rng, T, top_k)
    emap, b1, b2, E_local = None, None, None, E
    if case == "bias_ep":
        E_local, emap = reference.determine_expert_map(2, 1, E)
        w1, w2 = w1[emap >= 0].copy(), w2[emap >= 0].copy()
        b1 = uniform(rng, (E_local, 2 * I), 0.5, dt)
        b2 = uniform(rng, (E_local, H), 0.5, dt)
    want = reference.fused_experts(x, w1, w2, tw, ids, global_num_experts=E, expert_map=emap,
                                   w1_bias=b1, w2_bias=b2, precision="exact")
    B = gcfg.get_config(T, 2 * I, H, E_local, top_k, dt, version if hopper else None)["BLOCK_M"]
    st, ex, nt = reference.moe_align_block_size(ids, B, E, expert_map=emap)
    d = {k: _dev(v) for k, v in dict(x=x, w1=w1, w2=w2, tw=tw, st=st, ex=ex, nt=nt,
                                         b1=b1, b2=b2).items()}
    c1 = gg.grouped_gemm(d["x"], d["w1"], d["st"], d["ex"], d["nt"], top_k, B, d["tw"], False,
                         d["b1"], version=version)                               # [P, 2I]
    act = _stage("apply_activation")
    if act is not None:
        c2 = act(c1, "silu", True)                                               # [P, I]
    else:
        c2 = _dev(reference.apply_activation(_host(c1, dt), "silu", True))
    c3 = gg.grouped_gemm(c2, d["w2"], d["st"], d["ex"], d["nt"], 1, B, d["tw"], True, d["b2"],
                         version=version)                                        # [P, H]
    msum = _stage("moe_sum")
    if msum is not None:
        out = _host(msum(c3.reshape(T, top_k, H)), dt)
    else:
        out = reference.moe_sum(_host(c3, dt).reshape(T, top_k, H))
    err = rel_err(out, want)
    assert err <= TOL[dt], f"fused experts with {version} ({dkey}): rel err {err:.3e}"


# ============================================================================ GPU: bad input
def _good(dt=np.float16, T=6, E=4, top_k=2, N=64, K=64, B=16):
    prob = _problem(T, E, top_k, N, K, np.dtype(dt), B)
    d = prob["dev"]
    return [d["a"], d["w"], d["st"], d["ex"], d["nt"], top_k, B], prob


@gpu
def test_errors_before_launch():
    cp = _cp()
    args, prob = _good()
    a, w, st, ex, nt, top_k, B = args

    def call(*override, **kw):
        return gg.grouped_gemm(*override, **kw)

    with pytest.raises(TypeError, match="a: expected a cupy.ndarray"):
        call(prob["a"], w, st, ex, nt, top_k, B)
    with pytest.raises(TypeError, match=r"w: expected dtype float16"):
        call(a, w.astype(cp.float32), st, ex, nt, top_k, B)
    with pytest.raises(ValueError, match=r"w: expected shape \[E_local, N, 64\]"):
        call(a, w[:, :, :32].copy(), st, ex, nt, top_k, B)
    with pytest.raises(ValueError, match="a: expected a C-contiguous"):
        call(cp.asfortranarray(a), w, st, ex, nt, top_k, B)
    with pytest.raises(ValueError, match="w: expected a C-contiguous"):
        call(a, w[:, ::2], st, ex, nt, top_k, B)
    with pytest.raises(TypeError, match="sorted_token_ids: expected dtype"):
        call(a, w, st.astype(cp.int64), ex, nt, top_k, B)
    with pytest.raises(ValueError, match="expert_ids: expected length"):
        call(a, w, st, ex[:-1], nt, top_k, B)
    with pytest.raises(ValueError, match=r"bias: expected shape \(4, 64\)"):
        call(a, w, st, ex, nt, top_k, B, bias=cp.zeros((4, 63), cp.float16))
    with pytest.raises(ValueError, match="topk_weights: expected an array"):
        call(a, w, st, ex, nt, top_k, B, None, True)
    with pytest.raises(ValueError, match="topk_weights: expected 12 elements"):
        call(a, w, st, ex, nt, top_k, B, cp.ones(11, cp.float32), True)
    with pytest.raises(TypeError, match="top_k: expected an int"):
        call(a, w, st, ex, nt, 2.0, B)
    with pytest.raises(ValueError, match="version: expected one of"):
        call(a, w, st, ex, nt, top_k, B, version="v9")
    with pytest.raises(ValueError, match="block_size: v4 needs a multiple of 16"):
        st8, ex8, nt8 = (_dev(x) for x in reference.moe_align_block_size(
            np.zeros((6, 2), np.int32) + np.arange(2, dtype=np.int32), 8, 4))
        call(a, w, st8, ex8, nt8, top_k, 8, version="v4")
    with pytest.raises(ValueError, match=r"out: expected shape \(12, 64\)"):
        call(a, w, st, ex, nt, top_k, B, out=cp.empty((12, 63), cp.float16))
    # P = M_a * top_k beyond int32: raised from the sizes alone, nothing is allocated
    with pytest.raises(ValueError, match="int32"):
        call(a, w, st, ex, nt, 2**30, B)


@pytest.mark.multigpu
def test_wrong_device():
    cp = _cp()
    args, _ = _good()
    with cp.cuda.Device(1):
        w1 = cp.asarray(args[1].get())
    with pytest.raises(ValueError, match="w: expected an array on device 0"):
        gg.grouped_gemm(args[0], w1, *args[2:])


def test_cpu_arrays_are_refused_without_cupy_work():
    """Without CuPy (CPU CI) the call fails on the first argument with a clear error."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError):
            gg.grouped_gemm(np.zeros((1, 8), np.float32), None, None, None, None, 1, 16)
        return
    with pytest.raises(TypeError, match="a: expected a cupy.ndarray"):
        gg.grouped_gemm(np.zeros((1, 8), np.float32), None, None, None, None, 1, 16)
