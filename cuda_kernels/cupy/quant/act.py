"""Activation quantization on the GPU: fp8 e4m3 / int8 codes with fp32 scales (quant/act.cu).

    T tokens, M rows (T for GEMM1's input, P = T*K for GEMM2's), Kdim columns, G = cdiv(Kdim, gs)

Every function has the name, arguments and returns of its twin in reference/quant.py and
matches it bit for bit (same fp32 operations in the same order):

    per_token_group_quant_fp8(x, group_size, eps=1e-10, use_ue8m0=False) -> q [M, Kdim], s [M, G]
    per_token_group_quant_int8(x, group_size, eps=1e-10)                -> q, s [M, G]
    per_token_quant_int8(x)                                             -> q, s [M, 1]
    scaled_fp8_quant(x, scale=None, use_per_token_if_dynamic=False)     -> q, s [1] or [M, 1]
    scaled_int8_quant(x, scale=None)                                    -> q, s [1] or [M, 1]
    moe_kernel_quantize_input(a, a_scale, quant_dtype, per_act_token_quant=False,
                              block_shape=None, use_ue8m0=False)       -> (a_q, a_scale)

fp8 codes travel as uint8 CuPy arrays holding the e4m3fn bytes (CuPy has no fp8 dtype):
`fp8_to_host(q)` views them as ml_dtypes.float8_e4m3fn, `fp8_to_device(q)` uploads an
ml_dtypes fp8 array as bytes. int8 codes are int8 arrays.

Kernels (launch geometry in act.cu): group_quant_kernel<QT> (one warp per (row,
group), WARPS_PER_BLOCK warps a block) and absmax_kernel (dynamic per-tensor scales, a
device-side reduction: no host synchronisation).

Run as a script to validate against the reference and time (bytes moved / time):
    python -m cuda_kernels.cupy.quant.act [--quick]
"""
from __future__ import annotations

import numpy as np

from reference.quant import block_shape_of

from .. import _arrays as A
from .. import _compile as C
from .._geometry import cdiv
from .._script import script_start

CU = "quant/act.cu"
CONFIGS = {"group_quant_kernel": {"WARPS_PER_BLOCK": 8}}
QT = {"fp8": 0, "int8": 1}
_NAMES = tuple(f"group_quant_kernel<{v}>" for v in QT.values())
FP8_MAX, INT8_MAX = 448.0, 127.0
GROUP_EPS = 1e-10
FP8_MIN_SCALE = 1.0 / (448.0 * 512.0)   # vLLM's floor on dynamic per-token / per-tensor fp8 scales
ABSMAX_THREADS, ABSMAX_MAX_BLOCKS = 256, 1024


def _in_dtypes():
    # fp32, fp16, bf16, and uint16 as bf16's bytes (a CuPy without ml_dtypes' bfloat16)
    return A.float_dtypes() + [np.dtype(np.uint16)]


def _defines(dtype) -> dict:
    dt = np.dtype(dtype)
    ctype = "__nv_bfloat16" if dt == np.uint16 else A.ctype_of(dt)
    return {"IN_T": ctype, **CONFIGS["group_quant_kernel"]}


# Every instantiation launched below, for the CPU compile checks.
for _dt in A.float_dtypes():
    C.register_compile_case(CU, _defines(_dt), _NAMES)
    C.register_compile_case(CU, _defines(_dt))            # absmax_kernel (extern "C")


# ----------------------------------------------------------------------------- fp8 transport
def fp8_to_device(q):
    """An ml_dtypes.float8_e4m3fn NumPy array -> its bytes as a uint8 CuPy array."""
    import cupy
    import ml_dtypes

    q = np.ascontiguousarray(q)
    if q.dtype != np.dtype(ml_dtypes.float8_e4m3fn):
        raise TypeError(f"q: expected ml_dtypes.float8_e4m3fn, got {q.dtype}")
    return cupy.asarray(q.view(np.uint8))


def fp8_to_host(q):
    """uint8 e4m3fn bytes on the GPU -> an ml_dtypes.float8_e4m3fn NumPy array."""
    import ml_dtypes

    return A.to_host(q).view(ml_dtypes.float8_e4m3fn)


# ----------------------------------------------------------------------------- launchers
def _check_x(x):
    A.check_array("x", x, ndim=2, dtypes=_in_dtypes())
    return x.shape


def _static_scale(scale):
    """A static per-tensor scale as a one-element fp32 device array (a Python/NumPy float is
    uploaded; a device array stays there, so no host synchronisation)."""
    import cupy

    if isinstance(scale, cupy.ndarray):
        if scale.size != 1:
            raise ValueError(f"scale: expected one static per-tensor scale, got shape "
                             f"{scale.shape}")
        return cupy.ascontiguousarray(scale.reshape(1).astype(cupy.float32))
    s = np.asarray(scale, dtype=np.float32).reshape(-1)
    if s.size != 1:
        raise ValueError(f"scale: expected one static per-tensor scale, got shape "
                         f"{np.shape(scale)}")
    return cupy.asarray(s)


def _launch_group(x, qt, group_size, eps, min_scale, use_ue8m0, static=None, tensor_amax=None,
                  num_groups=None):
    """q [M, Kdim] and scales [M, G] (G = 1 for the per-tensor modes: then only [0] is set)."""
    import cupy

    M, K = x.shape
    q = cupy.empty((M, K), dtype=cupy.uint8 if qt == "fp8" else cupy.int8)
    G = num_groups if num_groups is not None else cdiv(K, group_size)
    scales = cupy.empty((M, G), dtype=cupy.float32) if static is None and tensor_amax is None \
        else cupy.empty((1,), dtype=cupy.float32)
    ngroups = M * (cdiv(K, group_size) if K else 0)
    if ngroups == 0:                       # nothing to launch (the callers set empty scales)
        return q, (static.copy() if static is not None else scales)
    A.check_fits_int32("x", x.size, "M * Kdim")
    defines = _defines(x.dtype)
    kern = C.get_kernel(CU, f"group_quant_kernel<{QT[qt]}>", defines, _NAMES)
    wpb = defines["WARPS_PER_BLOCK"]
    qmax = FP8_MAX if qt == "fp8" else INT8_MAX
    kern((cdiv(ngroups, wpb),), (wpb * 32,),
         (A.raw(x), q, scales, static if static is not None else A.null_ptr(),
          tensor_amax if tensor_amax is not None else A.null_ptr(),
          np.int32(M), np.int32(K), np.int32(group_size), np.int32(cdiv(K, group_size)),
          np.float32(qmax), np.float32(eps), np.float32(min_scale), np.int32(bool(use_ue8m0))))
    return q, scales


def _tensor_absmax(x):
    """max |x| over the whole tensor as a one-element fp32 device array (0 when empty)."""
    import cupy

    bits = cupy.zeros((1,), dtype=cupy.uint32)
    n = x.size
    if n:
        kern = C.get_kernel(CU, "absmax_kernel", _defines(x.dtype))
        blocks = min(cdiv(n, ABSMAX_THREADS * 8), ABSMAX_MAX_BLOCKS)
        kern((blocks,), (ABSMAX_THREADS,), (A.raw(x), bits, np.int64(n)))
    return bits.view(cupy.float32)


def per_token_group_quant_fp8(x, group_size, eps=GROUP_EPS, use_ue8m0=False):
    """fp8 per 1 x group_size column groups: s = max(absmax, eps) / 448 (a power of two with
    use_ue8m0), q = e4m3(clamp(x / s)). x [M, Kdim] -> q uint8 (e4m3 bytes), s f32 [M, G]."""
    M, K = _check_x(x)
    group_size = A.check_int("group_size", group_size, 1)
    if K % group_size:
        raise ValueError(f"group_size: expected a divisor of x's {K} columns, got {group_size}")
    return _launch_group(x, "fp8", group_size, eps, 0.0, use_ue8m0)


def per_token_group_quant_int8(x, group_size, eps=GROUP_EPS):
    """int8 per 1 x group_size groups: s = max(absmax, eps) / 127, q = round_half_away(x / s)."""
    M, K = _check_x(x)
    group_size = A.check_int("group_size", group_size, 1)
    if K % group_size:
        raise ValueError(f"group_size: expected a divisor of x's {K} columns, got {group_size}")
    return _launch_group(x, "int8", group_size, eps, 0.0, False)


def per_token_quant_int8(x):
    """int8 per row: a group as wide as the row. x [M, Kdim] -> q int8, s f32 [M, 1]."""
    import cupy

    M, K = _check_x(x)
    if K == 0:
        return (cupy.empty((M, 0), dtype=cupy.int8),
                cupy.full((M, 1), np.float32(GROUP_EPS) / np.float32(INT8_MAX), cupy.float32))
    return _launch_group(x, "int8", K, GROUP_EPS, 0.0, False)


def scaled_fp8_quant(x, scale=None, use_per_token_if_dynamic=False):
    """fp8 with a static per-tensor scale, or dynamic s = max(absmax / 448, 1/(448*512)) over
    the tensor or per row. Returns q uint8 (e4m3 bytes) [M, Kdim], s f32 [1] or [M, 1]."""
    import cupy

    M, K = _check_x(x)
    if scale is not None:
        s = _static_scale(scale)
        q, _ = _launch_group(x, "fp8", max(K, 1), 0.0, 0.0, False, static=s)
        return q, s
    if use_per_token_if_dynamic:
        if K == 0:
            return (cupy.empty((M, 0), cupy.uint8),
                    cupy.full((M, 1), np.float32(FP8_MIN_SCALE), cupy.float32))
        return _launch_group(x, "fp8", K, 0.0, FP8_MIN_SCALE, False)
    amax = _tensor_absmax(x)
    if x.size == 0:
        return cupy.empty((M, K), cupy.uint8), cupy.full((1,), np.float32(FP8_MIN_SCALE),
                                                         cupy.float32)
    return _launch_group(x, "fp8", K, 0.0, FP8_MIN_SCALE, False, tensor_amax=amax)


def scaled_int8_quant(x, scale=None):
    """int8 with a static per-tensor scale (given) or dynamic per-row scales."""
    M, K = _check_x(x)
    if scale is None:
        return per_token_quant_int8(x)
    s = _static_scale(scale)
    q, _ = _launch_group(x, "int8", max(K, 1), 0.0, 0.0, False, static=s)
    return q, s


def _scaled_int8_tensor_dynamic(x):
    import cupy

    M, K = _check_x(x)
    amax = _tensor_absmax(x)
    if x.size == 0:
        return cupy.empty((M, K), cupy.int8), cupy.full((1,), np.float32(GROUP_EPS) /
                                                        np.float32(INT8_MAX), cupy.float32)
    return _launch_group(x, "int8", K, GROUP_EPS, 0.0, False, tensor_amax=amax)


def moe_kernel_quantize_input(a, a_scale, quant_dtype, per_act_token_quant=False,
                              block_shape=None, use_ue8m0=False):
    """Quantize a GEMM's activations as fused_experts does (see reference/quant.py):
    None -> (a, None); block_shape [bn, bk] -> per-group [M, cdiv(Kdim, bk)] (a partial last
    group is fine); per_act_token_quant -> per-token [M, 1]; else per-tensor [1]."""
    if quant_dtype is None:
        return a, None
    if quant_dtype not in QT:
        raise ValueError(f"quant_dtype: expected one of {sorted(QT)} or None, got {quant_dtype!r}")
    if block_shape is not None:
        bk = block_shape_of(block_shape)[1]
        if a_scale is not None:
            raise ValueError("a_scale: block quantization computes its own per-group scales; "
                             "expected None, got an array")
        _check_x(a)
        if quant_dtype == "fp8":
            return _launch_group(a, "fp8", bk, GROUP_EPS, 0.0, use_ue8m0)
        return _launch_group(a, "int8", bk, GROUP_EPS, 0.0, False)
    if per_act_token_quant:
        if a_scale is not None:
            raise ValueError("a_scale: per_act_token_quant computes dynamic per-token scales; "
                             "expected None, got an array")
        if quant_dtype == "fp8":
            return scaled_fp8_quant(a, None, use_per_token_if_dynamic=True)
        return per_token_quant_int8(a)
    if quant_dtype == "fp8":
        return scaled_fp8_quant(a, a_scale)
    if a_scale is None:
        return _scaled_int8_tensor_dynamic(a)
    return scaled_int8_quant(a, a_scale)


# ----------------------------------------------------------------------------- script
def _main(argv=None):  # pragma: no cover - needs a GPU
    """Validate every mode against reference/quant.py (bit-exact codes and scales), then time
    the 1x128 fp8 group quantizer at DeepSeek-V3's shapes. --quick: validation only, small
    shapes (for compute-sanitizer)."""
    import ml_dtypes

    from reference import quant as RQ

    quick, timed = script_start(argv)  # (exits with the reason when no GPU is usable)
    rng = np.random.default_rng(0)
    bf16 = ml_dtypes.bfloat16
    failures = 0
    for (M, K) in ((1, 128), (37, 384), (5, 200)):
        x = (rng.standard_normal((M, K)) * rng.uniform(0.01, 5, (M, 1))).astype(bf16)
        xd = A.to_device(x)
        cases = [("fp8 group", lambda a: RQ.moe_kernel_quantize_input(a, None, "fp8", False,
                                                                       [128, 128]),
                  lambda a: moe_kernel_quantize_input(a, None, "fp8", False, [128, 128])),
                 ("fp8 group ue8m0",
                  lambda a: RQ.moe_kernel_quantize_input(a, None, "fp8", False, [128, 128], True),
                  lambda a: moe_kernel_quantize_input(a, None, "fp8", False, [128, 128], True)),
                 ("fp8 token", lambda a: RQ.moe_kernel_quantize_input(a, None, "fp8", True),
                  lambda a: moe_kernel_quantize_input(a, None, "fp8", True)),
                 ("fp8 tensor", lambda a: RQ.moe_kernel_quantize_input(a, None, "fp8"),
                  lambda a: moe_kernel_quantize_input(a, None, "fp8")),
                 ("int8 token", lambda a: RQ.moe_kernel_quantize_input(a, None, "int8", True),
                  lambda a: moe_kernel_quantize_input(a, None, "int8", True)),
                 ("int8 group", lambda a: RQ.moe_kernel_quantize_input(a, None, "int8", False,
                                                                        [128, 128]),
                  lambda a: moe_kernel_quantize_input(a, None, "int8", False, [128, 128]))]
        for name, ref_fn, gpu_fn in cases:
            rq, rs = ref_fn(x)
            gq, gs = gpu_fn(xd)
            gq_h = A.to_host(gq)
            same_q = np.array_equal(gq_h.view(np.uint8), rq.view(np.uint8))
            same_s = np.array_equal(A.to_host(gs).reshape(rs.shape), rs)
            status = "ok" if same_q and same_s else "MISMATCH"
            failures += status != "ok"
            print(f"{name:16s} M={M:4d} Kdim={K:5d}  codes {'=' if same_q else '!='}  "
                  f"scales {'=' if same_s else '!='}  {status}")
    if quick:
        raise SystemExit(1 if failures else 0)
    for M, K in ((1, 7168), (64, 7168), (4096, 7168), (32768, 2048)):
        xd = A.to_device(rng.standard_normal((M, K)).astype(bf16))
        t = timed(lambda: per_token_group_quant_fp8(xd, 128)).median * 1e-3
        nbytes = M * K * (2 + 1) + M * (K // 128) * 4   # read bf16, write fp8 + scales
        print(f"per_token_group_quant_fp8 M={M:6d} Kdim={K}: {t * 1e6:8.1f} us  "
              f"{nbytes / t / 1e9:7.1f} GB/s")
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":  # pragma: no cover
    _main()
