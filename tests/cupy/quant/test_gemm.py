"""The quantized grouped GEMM stage (cuda_kernels/cupy/quant/gemm.py: grouped_gemm_quant, which
hands each format to its ladder) against reference/quant.py.

CPU (always): the stage is one of cuda_kernels.cupy's stages, imports without a GPU, and the
ladders' modules import each other in one direction only (no circle).
GPU (`gpu` marker):
- every format (fp8 / int8 with block, per-tensor, per-channel scales; int4 / uint8 / int8
  weight-only with group sizes 32-256, zero points, one group per row) and the rungs v1-v3 and
  the route match grouped_gemm_quant on the same quantized operands (outputs poisoned with
  NaN first; tolerance: bf16 output rounding, 1e-2), and v1 == v2;
- the route's int4 decode batches (v4 up to 8 rows per expert, v5 above, at the block size
  configs.block_size_for gives, and t32's 32) match the reference;
- the whole quantized layer built from the GPU stages matches fused_experts_quant within
  vLLM's tolerances (block fp8 0.035, int8 0.065, weight-only 2e-2);
- empty batches, experts on other ranks (e = -1 -> zeros), fp16 output, argument errors.

Shape legend: T tokens, E experts, K top-k, H hidden, I intermediate, B block size, N output
width, Kdim reduction width.
"""
from __future__ import annotations

import numpy as np
import pytest

from cuda_kernels.cupy.quant import act as QA
from cuda_kernels.cupy.quant import configs as Q
from cuda_kernels.cupy.quant import gemm as QG
from tests.oracles import rel_err
from tests.quant_support import BF16, host, poisoned, routed, up, w8a8_operands, wna16_operands
from reference import apply_activation, fused_topk, moe_align_block_size, moe_sum
from reference import quant as RQ

VLLM_TOL = {"fp8_block": 0.035, "int8": 0.065, "wna16": 2e-2}   # vLLM's own test tolerances
GEMM_TOL = 1e-2   # same quantized operands, other accumulation order: bf16 output rounding


# ----------------------------------------------------------------------------- CPU
def test_a_stage_of_the_cupy_backend_without_a_circle():
    import ast
    import pathlib

    import cuda_kernels.cupy as cp

    assert cp._STAGES["grouped_gemm_quant"] == "quant.gemm"
    assert cp.grouped_gemm_quant is QG.grouped_gemm_quant
    # each module of quant/ imports only the modules below it: configs and epilogue import no
    # sibling but configs, the ladders import those and their rungs' modules, gemm the ladders
    folder = pathlib.Path(QG.__file__).parent
    below = {"configs": set(), "epilogue": set(), "act": set(),
             "wna16_packed": {"configs", "epilogue"},
             "wna16_staged": {"configs", "epilogue", "wna16_packed"},
             "wna16_wgmma": {"configs", "epilogue", "wna16_packed"},
             "w8a8": {"configs", "epilogue", "act"},
             "wna16": {"configs", "epilogue", "wna16_packed", "wna16_staged", "wna16_wgmma"},
             "gemm": {"epilogue", "w8a8", "wna16"}}
    for name, allowed in below.items():
        tree = ast.parse((folder / f"{name}.py").read_text())
        siblings = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                    and n.level == 1 and n.module is None for a in n.names}
        siblings |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                     and n.level == 1 and n.module}
        assert siblings <= allowed, f"quant/{name}.py imports {siblings - allowed}"


# ----------------------------------------------------------------------------- GPU
FORMATS = [
    # name,          format, w8a8 scale layout or (group size (0: one per row), zero points,
    #                        signed int8 codes),                          tolerance key
    ("fp8_block",    "fp8",   "block",                "fp8_block"),
    ("fp8_tensor",   "fp8",   "tensor",               "fp8_block"),
    ("fp8_channel",  "fp8",   "channel",              "fp8_block"),
    ("int8_channel", "int8",  "channel",              "int8"),
    ("int8_block",   "int8",  "block",                "int8"),
    ("int4_g128",    "int4",  (128, False, False),    "wna16"),
    ("int4_g32_zp",  "int4",  (32, True, False),      "wna16"),
    ("int4_channel", "int4",  (0, False, False),      "wna16"),
    ("int4_g256_zp", "int4",  (256, True, False),     "wna16"),
    ("uint8_g64_zp", "w8a16", (64, True, False),      "wna16"),
    ("int8_g128",    "w8a16", (128, False, True),     "wna16"),
]
SHAPES = [
    # M_a, E, top_k, N,   Kdim, B   (one row; rows not a multiple of the tile; Kdim / N not
    #                                 multiples of 128 (partial blocks); an expert with no
    #                                 tokens; everything on one expert)
    (1,   4, 2, 64,  256, 16),
    (29,  6, 2, 136, 320, 16),
    (70,  3, 1, 256, 384, 64),
    (40,  1, 1, 72,  128, 32),
]


def operands(rng, fmt, layout, M_a, E, N, Kd):
    """(a, a_scale, w, w_scale, w_zp, flags) of a random problem in `fmt`."""
    if fmt in ("fp8", "int8"):
        aq, as_, wq, ws, flags = w8a8_operands(rng, fmt, layout, M_a, E, N, Kd)
        return aq, as_, wq, ws, None, flags
    gs, zp, signed = layout
    a, wq, ws, wz, flags = wna16_operands(rng, 4 if fmt == "int4" else 8, gs, zp, M_a, E, N,
                                          Kd, signed=signed)
    return a, None, wq, ws, wz, flags


def _skip_unless_runs(fmt, version, a, w, K, block_size, w_scale):
    """Skips (with the rung's own reason) where `version` of fmt's ladder cannot run."""
    import cupy

    from cuda_kernels.cupy.quant import epilogue as EP
    from cuda_kernels.cupy.quant import w8a8 as W8
    from cuda_kernels.cupy.quant import wna16 as W16

    if version is None:
        return
    cc = int(cupy.cuda.Device().compute_capability)
    if fmt in ("fp8", "int8"):
        refuses = W8.refuses(fmt, cc, K, block_size, EP.aligned(a, w))
    else:
        G = w_scale.shape[2]
        refuses = W16.refuses(4 if fmt == "int4" else 8, cc, w.shape[1], K, K // G, G,
                              block_size, EP.aligned(a, w))
    try:
        Q.route(fmt, 1.0, K, refuses, version=version)
    except ValueError as e:
        pytest.skip(str(e))


@pytest.mark.gpu
@pytest.mark.parametrize("name,fmt,layout,tol", FORMATS, ids=[f[0] for f in FORMATS])
@pytest.mark.parametrize("version", ["v1", "v2", "v3", None])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(rng, name, fmt, layout, tol, version, shape):
    M_a, E, K, N, Kd, B = shape
    aq, as_, wq, ws, wz, flags = operands(rng, fmt, layout, M_a, E, N, Kd)
    _skip_unless_runs(fmt, version, up(aq), up(wq), Kd, B, ws)
    ids, tw, bias, st, ex, ntp = routed(rng, M_a, E, K, N, B)
    want = RQ.grouped_gemm_quant(aq, wq, st, ex, ntp, K, B, tw, True, bias, a_scale=as_,
                                 w_scale=ws, w_zp=wz, **flags)
    out = poisoned((M_a * K, N), BF16)
    got = QG.grouped_gemm_quant(up(aq), up(wq), up(st), up(ex), up(ntp), K, B, up(tw), True,
                                up(bias), a_scale=up(as_), w_scale=up(ws), w_zp=up(wz),
                                version=version, out=out, **flags)
    assert got is out
    err = rel_err(host(got, BF16), want)
    assert err <= GEMM_TOL, f"{name} {version}: rel_err {err:.3e}"
    assert err <= VLLM_TOL[tol]


@pytest.mark.gpu
@pytest.mark.parametrize("name,fmt,layout,tol", [FORMATS[0], FORMATS[3], FORMATS[5]],
                         ids=lambda v: str(v)[:12])
def test_v1_equals_v2(rng, name, fmt, layout, tol):
    M_a, E, K, N, Kd, B = 48, 5, 2, 192, 512, 64
    aq, as_, wq, ws, wz, flags = operands(rng, fmt, layout, M_a, E, N, Kd)
    _skip_unless_runs(fmt, "v2", up(aq), up(wq), Kd, B, ws)
    ids = rng.integers(0, E, (M_a, K)).astype(np.int32)
    st, ex, ntp = (up(v) for v in moe_align_block_size(ids, B, E))
    args = (up(aq), up(wq), st, ex, ntp, K, B)
    kw = dict(a_scale=up(as_), w_scale=up(ws), w_zp=up(wz), **flags)
    v1 = host(QG.grouped_gemm_quant(*args, version="v1", **kw), BF16)
    v2 = host(QG.grouped_gemm_quant(*args, version="v2", **kw), BF16)
    assert rel_err(v2, v1) <= GEMM_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("T,B", [(3, None), (32, None), (32, 32), (64, None)])
def test_route_int4_decode(rng, T, B):
    """The int4 route at decode: up to 8 rows per expert v4 (q8), above v5 (t24ws on sm_90,
    t24 elsewhere; t32 at block 32), at configs.block_size_for's block size unless given; each
    matches the reference with a poisoned output."""
    M_a, E, K, N, Kd = T, 4, 2, 256, 512
    B = B or Q.block_size_for("int4", M_a * K / E)
    a, wq, ws, _, flags = wna16_operands(rng, 4, 128, False, M_a, E, N, Kd)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(M_a)]).astype(np.int32)
    st, ex, ntp = moe_align_block_size(ids, B, E)
    tw = rng.uniform(0.1, 1, (M_a, K)).astype(np.float32)
    want = RQ.grouped_gemm_quant(a, wq, st, ex, ntp, K, B, tw, True, w_scale=ws, **flags)
    out = poisoned((M_a * K, N), BF16)
    got = QG.grouped_gemm_quant(up(a), up(wq), up(st), up(ex), up(ntp), K, B, up(tw), True,
                                w_scale=up(ws), out=out, **flags)
    assert got is out and rel_err(host(got, BF16), want) <= VLLM_TOL["wna16"]


@pytest.mark.gpu
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_other_rank_rows_are_zero_and_fp16_output(rng, version):
    M_a, E, N, Kd, B = 12, 4, 64, 256, 16
    aq, as_, wq, ws, flags = w8a8_operands(rng, "int8", "channel", M_a, 2, N, Kd)
    emap = np.array([0, -1, 1, -1], dtype=np.int32)
    ids = rng.integers(0, E, (M_a, 1)).astype(np.int32)
    st, ex, ntp = moe_align_block_size(ids, B, E, expert_map=emap)
    want = RQ.grouped_gemm_quant(aq, wq, st, ex, ntp, 1, B, a_scale=as_, w_scale=ws,
                                 out_dtype=np.float16, **flags)
    out = poisoned((M_a, N), np.float16)
    got = host(QG.grouped_gemm_quant(up(aq), up(wq), up(st), up(ex), up(ntp), 1, B,
                                     a_scale=up(as_), w_scale=up(ws), out_dtype=np.float16,
                                     version=version, out=out, **flags))
    assert got.dtype == np.float16
    assert (got[np.isin(ids[:, 0], [1, 3])] == 0).all()
    assert rel_err(got, want) <= GEMM_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,layout", [("fp8", "block"), ("int4", (128, False, False))])
def test_empty_batch(fmt, layout):
    rng = np.random.default_rng(0)
    aq, as_, wq, ws, wz, flags = operands(rng, fmt, layout, 0, 2, 64, 128)
    st, ex, ntp = moe_align_block_size(np.zeros((0, 2), np.int32), 16, 2)
    got = QG.grouped_gemm_quant(up(aq), up(wq), up(st), up(ex), up(ntp), 2, 16,
                                a_scale=up(as_), w_scale=up(ws), **flags)
    assert got.shape == (0, 64)


@pytest.mark.gpu
def test_argument_errors(rng):
    aq, as_, wq, ws, flags = w8a8_operands(rng, "fp8", "block", 8, 2, 64, 256)
    st, ex, ntp = (up(v) for v in moe_align_block_size(rng.integers(0, 2, (8, 1)).astype(
        np.int32), 16, 2))
    base = dict(a_scale=up(as_), w_scale=up(ws), **flags)
    with pytest.raises(TypeError, match="a:"):
        QG.grouped_gemm_quant(up(aq).view(np.int8), up(wq), st, ex, ntp, 1, 16, **base)
    with pytest.raises(ValueError, match="a_scale"):
        QG.grouped_gemm_quant(up(aq), up(wq), st, ex, ntp, 1, 16,
                              **{**base, "a_scale": up(as_[:, :1].copy())})
    with pytest.raises(ValueError, match="block_shape"):
        QG.grouped_gemm_quant(up(aq), up(wq), st, ex, ntp, 1, 16,
                              **{**base, "block_shape": [64, 64]})
    st8, ex8, ntp8 = (up(v) for v in moe_align_block_size(rng.integers(0, 2, (8, 1)).astype(
        np.int32), 8, 2))
    with pytest.raises(ValueError, match="version"):   # v2 tiles are 16 rows: block_size 8 is v1's
        QG.grouped_gemm_quant(up(aq), up(wq), st8, ex8, ntp8, 1, 8, version="v2", **base)
    with pytest.raises(ValueError, match="version: expected one of"):
        QG.grouped_gemm_quant(up(aq), up(wq), st, ex, ntp, 1, 16, version="v6", **base)
    with pytest.raises(ValueError, match="use_"):
        QG.grouped_gemm_quant(up(aq), up(wq), st, ex, ntp, 1, 16, a_scale=up(as_),
                              w_scale=up(ws))
    with pytest.raises(ValueError, match="at most one format"):
        QG.grouped_gemm_quant(up(aq), up(wq), st, ex, ntp, 1, 16, use_int4_w4a16=True, **base)


# ----------------------------------------------------------------------------- the layer
def gpu_quant_layer(x, w1q, w2q, tw, ids, kw, block_size):
    """fused_experts_quant from the GPU stages of this task: activation quantization and both
    GEMMs on the GPU; alignment, the activation and the combine from the reference (their
    GPU twins are other modules', tested there)."""
    T, K = ids.shape
    H = x.shape[1]
    E = w1q.shape[0]
    flags = {k: kw[k] for k in ("use_fp8_w8a8", "use_int8_w8a8", "use_int8_w8a16",
                                "use_int4_w4a16", "per_act_token_quant", "per_channel_quant",
                                "block_shape") if k in kw}
    qd = "fp8" if kw.get("use_fp8_w8a8") else ("int8" if kw.get("use_int8_w8a8") else None)
    st, ex, ntp = (up(v) for v in moe_align_block_size(ids, block_size, E))
    pat, bs = kw.get("per_act_token_quant", False), kw.get("block_shape")
    a1, s1 = QA.moe_kernel_quantize_input(up(x), None, qd, pat, bs)
    c1 = QG.grouped_gemm_quant(a1, up(w1q), st, ex, ntp, K, block_size, a_scale=s1,
                               w_scale=up(kw["w1_scale"]), w_zp=up(kw.get("w1_zp")), **flags)
    c2 = apply_activation(host(c1, BF16), "silu")
    a2, s2 = QA.moe_kernel_quantize_input(up(c2), None, qd, pat, bs)
    c3 = QG.grouped_gemm_quant(a2, up(w2q), st, ex, ntp, 1, block_size, up(tw), True,
                               a_scale=s2, w_scale=up(kw["w2_scale"]), w_zp=up(kw.get("w2_zp")),
                               **flags)
    return moe_sum(host(c3, BF16).reshape(T, K, H))


LAYER_SCHEMES = [("fp8_block", "fp8_block"), ("int8_channel", "int8"), ("int8_block", "int8"),
                 ("w4a16", "wna16"), ("w8a16", "wna16")]


@pytest.mark.gpu
@pytest.mark.parametrize("scheme,tol", LAYER_SCHEMES, ids=[s[0] for s in LAYER_SCHEMES])
@pytest.mark.parametrize("T,B", [(1, 16), (45, 16), (200, 64)])
def test_layer_matches_reference_within_vllm_tolerance(rng, scheme, tol, T, B):
    import cupy

    if scheme.startswith("fp8") and int(cupy.cuda.Device().compute_capability) < 89:
        pytest.skip("fp8 tensor cores need sm_89+")
    E, K, H, inter = 8, 2, 384, 256
    x = rng.standard_normal((T, H)).astype(BF16)
    w1 = (rng.standard_normal((E, 2 * inter, H)) / np.sqrt(H)).astype(BF16)
    w2 = (rng.standard_normal((E, H, inter)) / np.sqrt(inter)).astype(BF16)
    tw, ids, _ = fused_topk(x, rng.standard_normal((T, E)).astype(np.float32), K, True)
    kw = RQ.quantize_moe_layer(w1, w2, scheme, zero_point=scheme == "w4a16")
    w1q, w2q = kw.pop("w1"), kw.pop("w2")
    want = RQ.fused_experts_quant(x, w1q, w2q, tw, ids, block_size=B, **kw)
    got = gpu_quant_layer(x, w1q, w2q, tw, ids, kw, B)
    assert rel_err(got, want) <= VLLM_TOL[tol]
