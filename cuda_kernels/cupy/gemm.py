"""Grouped GEMM of the fused MoE layer, as a ladder of CUDA kernels launched through CuPy.

    c[s] = (a[s // top_k] @ w[e].T + bias[e]) * (topk_weights.flat[s] if mul_routed_weight)

for every live position p of `sorted_token_ids` (slot s = sorted_token_ids[p] < P, block
b = p // B below num_tokens_post_padded / B, e = expert_ids[b]); fp32 accumulation, one
rounding to a.dtype; e == -1 writes c[s] = 0 (docs/stages.md, "gemm1 / gemm2").

Shape legend: T tokens, E_local experts on this rank, K top-k, H hidden, I intermediate,
B block_size, N output width (2I for GEMM1, H for GEMM2), Kdim reduction width (H, I),
P = a.shape[0] * top_k slots, L = len(sorted_token_ids).

    a                       [M_a, Kdim]         hidden_states [T, H] (GEMM1) or act [P, I] (GEMM2)
    w                       [E_local, N, Kdim]  w13 [E, 2I, H] or w2 [E, H, I] ([out, in])
    sorted_token_ids        [L]    int32        from moe_align_block_size
    expert_ids              [L/B]  int32
    num_tokens_post_padded  [1]    int32        read on the device, never synchronised
    c (returned)            [P, N]              a.dtype

The ladder (all kept, `version="v1".."v6"`; the default is the table's "default_version":
v4 for fp16/bf16 and v3 for fp32 as shipped, or the rung a card's measurements name for the
shape ("version_by_shape") or else the bucket ("version_by_m"), stepping down to the fastest
rung that applies):
    v1  gemm_v1_naive.cu     one thread per output element
    v2  gemm_v2_smem.cu      shared-memory tiles, one output per thread
    v3  gemm_v3_regblock.cu  TM x TN register micro-tiles, 16-byte loads, register prefetch
    v4  gemm_v4_mma.cu       mma.sync m16n8k16 (fp16/bf16, fp32 accumulators), ldmatrix,
                             cp.async ring of STAGES tiles; fp32 inputs fall back to v3
    v5  gemm_v5_wgmma.cu     Hopper wgmma.m64nNk16 from shared-memory descriptors, sm_90a
                             only, block_size a multiple of 64; chosen per bucket where a
                             card's "version_by_m" (gemm_configs.json) names it
    v6  gemm_v6_tma_ws.cu    prefill, the Hopper GEMM done properly: w by TMA (a CUtensorMap
                             from extra_args), a gathered by cp.async, an mbarrier ring between
                             a producer warpgroup and two consumer warpgroups (setmaxnreg), a
                             persistent grid of one CTA per SM (tiles of 64, 128 or 256 rows:
                             two 64-row pieces a consumer, one read of an expert's weights);
                             sm_90a, block_size % 64 == 0; chosen per bucket where a card's
                             "version_by_m" (or per shape where "version_by_shape") names it

Tunables are data (gemm_configs.py): gemm_configs.json maps (version, dtype, bucket of m =
tokens per expert, N, Kdim) to BLOCK_M, BLOCK_N, BLOCK_K, warps, stages (v3: TM, TN), injected
as #defines. BLOCK_M is the alignment block_size the caller should use: `get_config(M, N, K,
E, top_k, dtype)` gives it before moe_align_block_size runs. A kernel accepts any block_size
that its BLOCK_M divides (the tile then lies in one alignment block), so GEMM2 reuses GEMM1's
alignment with its own config, shrunk to fit when needed. tune.py regenerates the table.
v6's CUtensorMap of the weights is encoded by gemm_tensor_map.py.

Run as a script to validate every version against reference.grouped_gemm and time it
(TFLOP/s, GB/s and the fraction of the H200 roofline floor):
    python -m cuda_kernels.cupy.gemm [--versions v1,v2,v3,v4,v5,v6] [--dtype bf16]
    python -m cuda_kernels.cupy.gemm --quick      # tiny, for compute-sanitizer
The GEMMs of the benchmark's models at decode and prefill T (a new uniform routing per rep,
L2 flushed, validated against v4; TFLOP/s, GB/s, the fraction of the card's floor) are
tune.py's bench, beside the tuner that fills the table:
    python -m cuda_kernels.cupy.tune --bench --versions v4,v5,v6 --models mixtral,qwen3,deepseek \
        --tokens 1024,4096,16384 [--sweep]

Verification without a GPU: tests/cupy/test_gemm_emulated.py compiles every .cu with g++
against the emulator of tests/emulator (__syncthreads, cp.async, ldmatrix, mma.sync, wgmma, and
for v6 the mbarriers, the tensor-map copy with its swizzle, named barriers, with a checker of
the ring's protocol) and runs them on the CPU against the reference (and the launcher itself
with NumPy-backed arrays).
"""
from __future__ import annotations

import functools
import math

import numpy as np

from .. import timing
from . import _arrays, _compile
from ._arrays import bf16_dtype, raw
from ._compile import get_kernel, register_compile_case
from .gemm_configs import (
    _CTYPES,
    DTYPE_KEYS,
    M_BUCKETS,
    TENSOR_CORE_VERSIONS,
    VERSIONS,
    _row_config,
    default_version_key,
    device_name,
    dtype_key,
    fit_config,
    get_config,
    heuristic_config,
    kernel_defines,
    launch_geometry,
    load_table,
    lookup,
    m_bucket,
    vec_elems,
)
from .gemm_tensor_map import v6_tensor_map

CU_FILES = {"v1": "gemm_v1_naive.cu", "v2": "gemm_v2_smem.cu",
            "v3": "gemm_v3_regblock.cu", "v4": "gemm_v4_mma.cu", "v5": "gemm_v5_wgmma.cu",
            "v6": "gemm_v6_tma_ws.cu"}
KERNEL_NAMES = {v: f"grouped_gemm_{v}" for v in VERSIONS}
# wgmma exists only on the architecture-specific target; _compile builds such kernels through
# cuda.core (CuPy would add its own -arch) and CPU CI compiles them for sm_90a only
KERNEL_OPTIONS = {"v5": ("-arch=sm_90a",), "v6": ("-arch=sm_90a",)}
SM90A_VERSIONS = ("v5", "v6")     # built for sm_90a: they run on compute capability 9.0 only
INT32_MAX = 2**31 - 1
GRID_Y_MAX = 65535
BLOCK_SIZES = (16, 32, 64, 128)   # the alignment blocks whose kernels CPU CI compiles


# ----------------------------------------------------------------------------- compile cases
def compile_cases(table: dict | None = None) -> list[tuple[str, dict, tuple]]:
    """(cu_name, defines, options) of every instantiation the table can launch, for CPU CI.

    Each table row (the cards' sections too, and the heuristic of every bucket) fitted to the
    usual block sizes.
    """
    table = load_table() if table is None else table
    seen, out = set(), []
    every = table.get("configs", []) + [r for sec in table.get("devices", {}).values()
                                        for r in sec.get("configs", [])]
    rows = [(r["version"], r["dtype"], _row_config(r)) for r in every]
    for v in VERSIONS:
        for dkey in DTYPE_KEYS:
            for b in M_BUCKETS:
                rows.append((v, dkey, heuristic_config(v, dkey, b)))
    for version, dkey, cfg in rows:
        if version in TENSOR_CORE_VERSIONS and dkey == "fp32":
            continue
        for bs in BLOCK_SIZES:
            try:
                fitted = fit_config(version, dkey, cfg, bs)
            except ValueError:
                continue
            d = kernel_defines(version, dkey, fitted)
            key = (CU_FILES[version], tuple(sorted(d.items())))
            if key not in seen:
                seen.add(key)
                out.append((CU_FILES[version], d, KERNEL_OPTIONS.get(version, ())))
    return out


def _register_all():
    for cu, d, options in compile_cases():
        register_compile_case(cu, d, options=options)


_register_all()


# ----------------------------------------------------------------------------- checks
def _cupy():
    import cupy

    return cupy


def _check_gpu_array(name, x, cp, device_id, ndim=None, dtypes=None, contiguous=True):
    if not isinstance(x, cp.ndarray):
        raise TypeError(f"{name}: expected a cupy.ndarray on the GPU, got {type(x).__name__}")
    if x.device.id != device_id:
        raise ValueError(f"{name}: expected an array on device {device_id} (a's device), "
                         f"got device {x.device.id}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {x.shape}")
    if dtypes is not None and np.dtype(x.dtype) not in dtypes:
        raise TypeError(f"{name}: expected dtype in ({', '.join(map(str, dtypes))}), "
                        f"got {x.dtype}")
    if contiguous and not x.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array, got strides {x.strides} "
                         f"for shape {x.shape} (use cupy.ascontiguousarray)")
    return x


def usable(version: str, dkey: str, K: int, block_size: int, aligned: bool,
           sm90: bool = True) -> str | None:
    """Why `version` cannot run this problem, as "argument: reason" (None when it can)."""
    if version in SM90A_VERSIONS:
        if not sm90:
            return (f"a: {version} (wgmma, built for sm_90a) runs on compute capability 9.0 "
                    f"only")
        if dkey == "fp32":
            return f"a: {version} takes fp16 or bf16 (fp32 uses v3)"
        if block_size % 64:
            return (f"block_size: {version} needs a multiple of 64 (a warpgroup's wgmma covers "
                    f"64 rows), got {block_size}")
    if version == "v6" and K == 0:
        return "a: v6 needs a.shape[1] (Kdim) > 0 (its tensor map of w has no empty dimension)"
    if version == "v4":
        if dkey == "fp32":
            return "a: v4 takes fp16 or bf16 (fp32 uses v3)"
        if block_size % 16:
            return (f"block_size: v4 needs a multiple of 16 (its mma tiles are 16 rows), "
                    f"got {block_size}")
    if version in ("v3", "v4", "v5", "v6"):
        vec = vec_elems(dkey)
        if K % vec:
            return (f"a: {version} loads 16-byte chunks, so a.shape[1] (Kdim) must be a multiple "
                    f"of {vec} for {dkey}, got {K}")
        if not aligned:
            return f"a: {version} loads 16-byte chunks, so a and w must be 16-byte aligned"
    return None


def _is_float(dtype) -> bool:
    return np.dtype(dtype).kind == "f" or np.dtype(dtype) == bf16_dtype()


def _as_f32(x):
    """`x` as a contiguous fp32 CuPy array (bf16 widened exactly: its bits are fp32's top half)."""
    cp = _cupy()
    if x.dtype == np.float32:
        return cp.ascontiguousarray(x)
    if np.dtype(x.dtype) in (bf16_dtype(), np.dtype(np.uint16)):   # uint16: bf16's bytes
        return (raw(x).astype(cp.uint32) << 16).view(cp.float32)
    return x.astype(cp.float32)


_FALLBACK = {"v6": ("v6", "v5", "v4", "v3", "v2"), "v5": ("v5", "v4", "v3", "v2"),
             "v4": ("v4", "v3", "v2"), "v3": ("v3", "v2"), "v2": ("v2",), "v1": ("v1",)}


_DEVICE_SMS: dict = {}


def _sm_count(dev: int) -> int:
    """The multiprocessor count of device `dev` (v6's persistent grid), asked once."""
    n = _DEVICE_SMS.get(dev)
    if n is None:
        n = _DEVICE_SMS[dev] = int(_cupy().cuda.Device(dev).attributes["MultiProcessorCount"])
    return n


def extra_args(version: str, cfg: dict, *, dev: int, w=None) -> tuple:
    """What `version` takes after the common GG_KERNEL_ARGS (empty for v1-v5): v6 its
    CUtensorMap of the weights `w` (v6_tensor_map, cached)."""
    if version == "v6":
        return (v6_tensor_map(w.data.ptr, w.shape, dtype_key(w.dtype), cfg, dev),)
    return ()


# ----------------------------------------------------------------------------- the stage
def grouped_gemm(a, w, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k, block_size,
                 topk_weights=None, mul_routed_weight=False, bias=None, *, version=None,
                 config=None, out=None):
    """c [a.shape[0] * top_k, N] = the grouped GEMM of docs/stages.md on the GPU (see module doc).

    version: "v1".."v6" (None: default_version's rung, v4 for fp16/bf16 and v3 for fp32 unless
    the card's measurements name another for the shape or the bucket, stepping down to v3/v2
    when Kdim is not a multiple of 16 bytes or block_size not of 16; "v4"/"v5"/"v6" on fp32
    run v3; "v5" and "v6" need an sm_90 device and block_size % 64 == 0).
    config: a dict as returned by get_config (None: looked up in gemm_configs.json); its
    BLOCK_M is shrunk to divide block_size when needed. out: an optional [P, N] C-contiguous
    array of a.dtype to write into (only the rows of live slots are written; tests poison it).
    num_tokens_post_padded is read on the device: nothing here waits for the GPU.
    """
    cp = _cupy()
    if not isinstance(a, cp.ndarray):
        raise TypeError(f"a: expected a cupy.ndarray on the GPU, got {type(a).__name__}")
    dev = a.device.id
    floats = (np.dtype(np.float32), np.dtype(np.float16), bf16_dtype(), np.dtype(np.uint16))
    _check_gpu_array("a", a, cp, dev, ndim=2, dtypes=floats)
    dkey = dtype_key(a.dtype)
    _check_gpu_array("w", w, cp, dev, ndim=3)
    if np.dtype(w.dtype) != np.dtype(a.dtype):
        raise TypeError(f"w: expected dtype {a.dtype} (a's dtype), got {w.dtype}")
    M_a, K = a.shape
    E_local, N, Kw = w.shape
    if Kw != K:
        raise ValueError(f"w: expected shape [E_local, N, {K}] (last dim = a.shape[1]), "
                         f"got {tuple(w.shape)}")
    top_k = _arrays.check_int("top_k", top_k, 1)
    block_size = _arrays.check_int("block_size", block_size, 1)
    int32 = (np.dtype(np.int32),)
    _check_gpu_array("sorted_token_ids", sorted_token_ids, cp, dev, ndim=1, dtypes=int32)
    _check_gpu_array("expert_ids", expert_ids, cp, dev, ndim=1, dtypes=int32)
    L = sorted_token_ids.shape[0]
    if expert_ids.shape[0] != -(-L // block_size):
        raise ValueError(f"expert_ids: expected length cdiv(len(sorted_token_ids), block_size) "
                         f"= cdiv({L}, {block_size}) = {-(-L // block_size)}, "
                         f"got {expert_ids.shape[0]}")
    if isinstance(num_tokens_post_padded, (int, np.integer)) and \
            not isinstance(num_tokens_post_padded, bool):
        num_tokens_post_padded = cp.asarray([num_tokens_post_padded], dtype=cp.int32)
    _check_gpu_array("num_tokens_post_padded", num_tokens_post_padded, cp, dev, dtypes=int32)
    if num_tokens_post_padded.size < 1:
        raise ValueError("num_tokens_post_padded: expected shape (1,), got an empty array")
    P = M_a * top_k
    for name, value in (("a.shape[0] * top_k (P)", P), ("len(sorted_token_ids)", L),
                        ("w.shape[1] (N)", N), ("a.shape[1] (Kdim)", K)):
        if value > INT32_MAX:
            raise ValueError(f"{name}: expected at most {INT32_MAX} (kernels index with int32), "
                             f"got {value}")
    mul_routed_weight = bool(mul_routed_weight)
    tw = None
    if mul_routed_weight:
        if topk_weights is None:
            raise ValueError("topk_weights: expected an array [P] when mul_routed_weight=True, "
                             "got None")
        _check_gpu_array("topk_weights", topk_weights, cp, dev)
        if topk_weights.size != P:
            raise ValueError(f"topk_weights: expected {P} elements (a.shape[0] * top_k), "
                             f"got shape {tuple(topk_weights.shape)}")
        if not _is_float(topk_weights.dtype):
            raise TypeError(f"topk_weights: expected a floating dtype, got {topk_weights.dtype}")
        # the router weights are fp32 in vLLM; anything else is converted once ([P], tiny)
        tw = _as_f32(topk_weights)
    bias_kind, bias_arg = 0, None
    if bias is not None:
        _check_gpu_array("bias", bias, cp, dev)
        if tuple(bias.shape) != (E_local, N):
            raise ValueError(f"bias: expected shape ({E_local}, {N}) = [E_local, N], "
                             f"got {tuple(bias.shape)}")
        if np.dtype(bias.dtype) == np.dtype(a.dtype):
            bias_kind, bias_arg = 1, raw(bias)
        elif _is_float(bias.dtype):
            # added in fp32 anyway: an fp32 copy is exact for fp16/bf16 biases
            bias_kind, bias_arg = 2, _as_f32(bias)
        else:
            raise TypeError(f"bias: expected a floating dtype, got {bias.dtype}")

    aligned = a.data.ptr % 16 == 0 and w.data.ptr % 16 == 0
    version, cfg = _plan(version, dkey, m_bucket(max(1.0, P / max(E_local, 1))), N, K,
                         block_size, aligned, _is_sm90(cp, dev),
                         None if config is None else tuple(sorted(config.items())),
                         device_name(dev))

    if out is None:
        c = _arrays.empty((P, N), a.dtype)
    else:
        c = _check_gpu_array("out", out, cp, dev)
        if np.dtype(out.dtype) != np.dtype(a.dtype) or tuple(out.shape) != (P, N):
            raise ValueError(f"out: expected shape ({P}, {N}) and dtype {a.dtype}, got "
                             f"{tuple(out.shape)} {out.dtype}")
    if P == 0 or N == 0:
        return c
    if L == 0:  # no positions, no live slot: nothing to write
        return c
    grid, block, smem = launch_geometry(version, cfg, L, N,
                                        _sm_count(dev) if version == "v6" else None)
    if len(grid) >= 2 and grid[1] > GRID_Y_MAX:
        raise ValueError(f"w.shape[1] (N): {version} launches cdiv(N, BLOCK_N) = {grid[1]} CTAs "
                         f"along grid y, more than {GRID_Y_MAX}")
    if math.prod(grid) > INT32_MAX:
        raise ValueError(f"len(sorted_token_ids): the grid of {math.prod(grid)} CTAs overflows "
                         f"int32")
    kernel = _kernel(version, dkey, cfg, dev)
    dummy = _dummy(cp, dev)
    with cp.cuda.Device(dev):
        kernel(grid, block,
               (raw(a), raw(w), raw(c), sorted_token_ids, expert_ids, num_tokens_post_padded,
                tw if tw is not None else dummy, bias_arg if bias_arg is not None else dummy,
                np.int32(N), np.int32(K), np.int32(P), np.int32(top_k), np.int32(block_size),
                np.int32(L), np.int32(mul_routed_weight), np.int32(bias_kind))
               + extra_args(version, cfg, dev=dev, w=w),
               shared_mem=smem)
    return c


def _sm90_of(dev: int) -> bool:
    return _compile.is_sm90(dev)


def _is_sm90(cp, dev) -> bool:
    """Whether device `dev` runs sm_90a code (v5, v6), asked once per device."""
    return _sm90_of(dev)


@functools.lru_cache(maxsize=4096)
def _plan(version, dkey, bucket, N, K, block_size, aligned, sm90, config_items, device=None):
    """(version, fitted config) for a call on card `device`: the rung, the table lookup and
    the fit, cached (a decode step calls the GEMM twice per layer: the host work must stay
    small)."""
    if version in TENSOR_CORE_VERSIONS and dkey == "fp32":
        version = "v3"          # the tensor-core rungs take half types; fp32 uses FFMA
    if version is None:
        chain = _FALLBACK[default_version_key(dkey, bucket, device, N, K)]
        version = next(v for v in chain if usable(v, dkey, K, block_size, aligned, sm90) is None)
    elif version not in VERSIONS:
        raise ValueError(f"version: expected one of {VERSIONS} or None, got {version!r}")
    else:
        why = usable(version, dkey, K, block_size, aligned, sm90)
        if why is not None:
            raise ValueError(f"{why} (version={version!r} was asked for; version=None picks "
                             f"a rung that can run this)")
    config = (lookup(version, dkey, bucket, N, K, device=device) if config_items is None
              else dict(config_items))
    return version, fit_config(version, dkey, config, block_size)


_READY: dict = {}


def _kernel(version, dkey, cfg, dev):
    """The compiled kernel, with its dynamic shared-memory limit raised once when needed."""
    defines = kernel_defines(version, dkey, cfg)
    key = (version, tuple(sorted(defines.items())), dev)
    kern = _READY.get(key)
    if kern is None:
        options = KERNEL_OPTIONS.get(version, ())
        if version in SM90A_VERSIONS:
            cc = _cupy().cuda.Device(dev).compute_capability
            if cc != "90":
                raise ValueError(f"version: {version} (wgmma) runs on compute capability 9.0 "
                                 f"only (built for sm_90a), this device is {cc}")
        register_compile_case(CU_FILES[version], defines, options=options)
        kern = get_kernel(CU_FILES[version], KERNEL_NAMES[version], defines, options=options)
        if version in TENSOR_CORE_VERSIONS:
            smem = launch_geometry(version, cfg, 1, 1)[2]
            if smem > 48 * 1024:  # a CTA gets more than 48 KB only after opting in
                kern.max_dynamic_shared_size_bytes = smem
        _READY[key] = kern
    return kern


def prebuild(dtypes=DTYPE_KEYS, versions=VERSIONS, max_workers: int | None = None) -> dict:
    """Compile every instantiation the table can launch for `dtypes` x `versions`, in threads.

    NVRTC runs outside the GIL, so a 16-core host builds the ~50 kernels in the time of a few
    (a test session or a benchmark otherwise compiles them one by one on first use). Returns
    {"built": n, "failed": {case: error}}; failures are left for the first real call to report.
    """
    import concurrent.futures
    import os

    cp = _cupy()
    dev = cp.cuda.Device().id
    cc = cp.cuda.Device(dev).compute_capability
    ctypes_ = {_CTYPES[d] for d in dtypes}
    by_file = {f: v for v, f in CU_FILES.items()}
    todo = [(cu, d, o) for cu, d, o in compile_cases()
            if by_file[cu] in versions and d["GG_T"] in ctypes_
            and not (by_file[cu] in SM90A_VERSIONS and cc != "90")]

    def build(case):
        cu, d, options = case
        with cp.cuda.Device(dev):
            get_kernel(cu, KERNEL_NAMES[by_file[cu]], d, options=options)

    if any(o for _, _, o in todo):
        # import cuda.core (the sm_90a path) once here: threads importing it together find a
        # half-initialised module ("cannot import name 'Program' from 'cuda.core.cu13'")
        try:
            import cuda.core  # noqa: F401
            from cuda.core import Program, ProgramOptions  # noqa: F401
        except ImportError:
            pass
    failed = {}
    workers = max_workers or min(16, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {pool.submit(build, c): c for c in todo}
        for f in concurrent.futures.as_completed(futures):
            if f.exception() is not None:
                cu, d, _ = futures[f]
                failed[f"{cu} {d}"] = f"{type(f.exception()).__name__}: {f.exception()}"[:300]
    return {"built": len(todo) - len(failed), "failed": failed}


_DUMMIES: dict = {}


def _dummy(cp, dev):
    """A one-element fp32 array standing in for an absent pointer (never read)."""
    d = _DUMMIES.get(dev)
    if d is None:
        with cp.cuda.Device(dev):
            d = _DUMMIES[dev] = cp.zeros(1, dtype=cp.float32)
    return d


# ----------------------------------------------------------------------------- test data
def random_device(shape, dtype, scale=1.0, rng=None):
    """Normal(0, scale^2) values of `dtype` made on the GPU, a slab at a time.

    bf16 is rounded from fp32 with integer ops (round to nearest even), so this needs no
    CuPy support for ml_dtypes.bfloat16 beyond a view (uint16 when even that is missing).
    """
    cp = _cupy()
    rng = cp.random.default_rng() if rng is None else rng
    dkey = dtype_key(dtype)
    out = _arrays.empty(shape, dtype)
    flat = raw(out).reshape(-1)
    step = 1 << 26  # 64 M elements: a 256 MB fp32 slab at a time
    for i in range(0, flat.size, step):
        n = min(step, flat.size - i)
        x = rng.standard_normal(n, dtype=cp.float32)
        if scale != 1.0:
            x *= cp.float32(scale)
        if dkey == "bf16":
            u = x.view(cp.uint32)
            flat[i:i + n] = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(cp.uint16)
        else:
            flat[i:i + n] = x.astype(flat.dtype)
    return out


# ----------------------------------------------------------------------------- napkin math
def gemm_flops(num_slots: int, N: int, K: int) -> float:
    """2 * P * N * Kdim: one multiply and one add per product, live slots only."""
    return 2.0 * num_slots * N * K


def gemm_bytes(touched_experts: int, M_a: int, num_slots: int, N: int, K: int,
               itemsize: int) -> float:
    """The least traffic: each touched expert's w once, each a row once, each c row once."""
    return float(itemsize) * (touched_experts * N * K + M_a * K + num_slots * N)


HBM_BYTES_PER_S = 4.8e12          # H200 datasheet
PEAK_FLOPS = 989e12               # H200 dense bf16 datasheet


def roofline_floor_s(nbytes: float, flops: float) -> float:
    """max(bytes / 4.8 TB/s, flops / 989 TFLOP/s): no kernel can beat this on an H200."""
    return max(nbytes / HBM_BYTES_PER_S, flops / PEAK_FLOPS)


# ----------------------------------------------------------------------------- script
def _main(argv=None):  # pragma: no cover - needs a GPU
    """Validate every version against reference.grouped_gemm (float64 inputs), then time it.

    --quick: one tiny problem per version and dtype, one timed call (for compute-sanitizer).
    Prints one PASS/FAIL line per (shape, version); exits 1 when any check fails. The GEMMs of
    the benchmark's models at decode and prefill T: `python -m cuda_kernels.cupy.tune --bench`.
    """
    import argparse

    from reference import grouped_gemm as ref_grouped_gemm
    from reference import moe_align_block_size

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--versions", default="v1,v2,v3,v4,v5,v6")
    p.add_argument("--dtype", default="bf16", choices=DTYPE_KEYS)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="tiny shapes, one rep (sanitizers)")
    args = p.parse_args(argv)
    ok, why = _arrays.availability()
    if not ok:
        raise SystemExit(f"no GPU: {why}")
    cp = _cupy()
    api = timing.CudaApi("cupy")      # the one GPU timer, on CuPy's events (L2 flushed per call)
    dts = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16), "bf16": bf16_dtype()}
    rng = np.random.default_rng(0)
    # (name, T, E, top_k, N, Kdim, dtype key)
    if args.quick:
        shapes = [("quick N=72 K=136", 7, 4, 2, 72, 136, "bf16"),
                  ("quick N=72 K=136", 7, 4, 2, 72, 136, "fp32")]
        reps = 1
    else:
        d = args.dtype
        shapes = [("qwen3 gemm1 T=1", 1, 128, 8, 1536, 2048, d),
                  ("qwen3 gemm1 T=64", 64, 128, 8, 1536, 2048, d),
                  ("qwen3 gemm1 T=1024", 1024, 128, 8, 1536, 2048, d),
                  ("mixtral gemm2 T=16", 16, 8, 2, 4096, 14336, d),
                  ("mixtral gemm1 T=1024", 1024, 8, 2, 28672, 4096, d)]
        reps = args.reps
    print(f"{'shape':22s} {'dt':4s} {'ver':3s} {'check':5s} {'rel err':>9s} {'us':>9s} "
          f"{'TFLOP/s':>8s} {'GB/s':>7s} {'floor':>6s}")
    failed = 0
    for name, T, E, top_k, N, K, dkey in shapes:
        dt = dts[dkey]
        a_h = rng.standard_normal((T, K), dtype=np.float32).astype(dt)
        w_h = (rng.standard_normal((E, N, K), dtype=np.float32) / math.sqrt(K)).astype(dt)
        tw_h = rng.random((T, top_k), dtype=np.float32) + np.float32(0.05)
        ids = np.argsort(rng.random((T, E)), axis=1)[:, :top_k].astype(np.int32)
        B0 = get_config(T, N, K, E, top_k, dt)["BLOCK_M"]
        st, ex, nt = moe_align_block_size(ids, B0, E)
        # c[s] does not depend on the alignment block: one reference for every version
        ref = ref_grouped_gemm(a_h.astype(np.float64), w_h.astype(np.float64), st, ex, nt,
                               top_k, B0, tw_h.astype(np.float64), True)
        a, w = _arrays.to_device(a_h), _arrays.to_device(w_h)
        tw_d = cp.asarray(tw_h)
        touched = len(set(int(e) for e in ex[: int(nt[0]) // B0] if e >= 0))
        flops = gemm_flops(T * top_k, N, K)
        nbytes = gemm_bytes(touched, T, T * top_k, N, K, dt.itemsize)
        tol = 1e-5 if dkey == "fp32" else 1e-2
        aligned = {}

        def call(v, out=None):
            # each rung aligns with its own config's BLOCK_M (v5: 64 or 128)
            B = get_config(T, N, K, E, top_k, dt, v)["BLOCK_M"]
            if B not in aligned:
                aligned[B] = tuple(cp.asarray(x) for x in moe_align_block_size(ids, B, E))
            st_d, ex_d, nt_d = aligned[B]
            return grouped_gemm(a, w, st_d, ex_d, nt_d, top_k, B, tw_d, True, version=v, out=out)

        for v in args.versions.split(","):
            out = _arrays.empty((T * top_k, N), dt)
            raw(out).view(cp.uint8).fill(255)          # NaN poison: unwritten rows fail
            try:
                call(v, out)
            except ValueError as e:
                print(f"{name:22s} {dkey:4s} {v:3s} skip  {e}")
                continue
            got = _arrays.to_host(out)
            if got.dtype == np.uint16:
                got = got.view(bf16_dtype())
            got = got.astype(np.float64)
            err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref)) \
                if np.isfinite(got).all() else float("inf")
            verdict = "PASS" if err <= tol else "FAIL"
            failed += verdict == "FAIL"
            t = timing.time_cuda(lambda v=v: call(v), warmup=0 if args.quick else 3, reps=reps,
                                 flush_l2=not args.quick, api=api).median * 1e-3
            print(f"{name:22s} {dkey:4s} {v:3s} {verdict:5s} {err:9.2e} {t * 1e6:9.1f} "
                  f"{flops / t / 1e12:8.2f} {nbytes / t / 1e9:7.0f} "
                  f"{roofline_floor_s(nbytes, flops) / t:6.2f}")
    print("ok" if not failed else f"{failed} check(s) FAILED")
    return 1 if failed else 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(_main())
