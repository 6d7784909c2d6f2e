"""The contiguous layout on the GPU (permute.cu): rows grouped by expert, and back.

Shapes: T tokens, K top-k, P = T * K slots (s = t * K + k), E experts, H hidden.

    moe_permute(hidden_states, topk_ids, num_experts)
        -> x_grouped [P, H], expert_offsets int32 [E + 1], inv_permuted_idx int32 [P]
    moe_unpermute(y_grouped, topk_weights, inv_permuted_idx) -> out [T, H]

The index is the alignment's grouping (grouping.cuh) with B = 1 and no padding, so it shares
align.py's "group" tunables; the order inside an expert is increasing s, the reference's.
Ids outside [0, E) are not checked on the host (that would need a device-to-host copy):
moe_permute places their rows after every expert (expert_offsets[E] < P then says so).

Run as a script to validate against reference/ and time: python -m cuda_kernels.cupy.permute
"""
from __future__ import annotations

import numpy as np

from . import _arrays as A
from . import _compile as C
from . import align as align_mod
from ._geometry import cdiv, row_geometry
from ._script import rel_err, script_start

CONFIGS = {
    "gather_rows_kernel": {"ROW_WARPS": 4},
    "moe_unpermute_kernel": {"UNPERMUTE_THREADS": 128},
}
_WORDS = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short"}
_GATHER_NAMES = tuple(f"gather_rows_kernel<{w}>" for w in _WORDS.values())
_VECS = (1, 2, 4, 8)
_UNPERMUTE_NAMES = tuple(f"moe_unpermute_kernel<{v}>" for v in _VECS)


def _defines(scalar_dtype=np.float32) -> dict:
    return {"SCALAR_T": A.ctype_of(scalar_dtype),
            "PREFETCH": align_mod.CONFIGS["group"]["PREFETCH"],
            **CONFIGS["gather_rows_kernel"], **CONFIGS["moe_unpermute_kernel"]}


# The index kernel and the gathers do not depend on the dtype: they are compiled with the
# fp32 defines; moe_unpermute once per dtype.
_FIXED_NAMES = ("moe_permute_index_kernel",) + _GATHER_NAMES
C.register_compile_case("permute.cu", _defines(), _FIXED_NAMES)
for _dt in A.float_dtypes():
    C.register_compile_case("permute.cu", _defines(_dt), _UNPERMUTE_NAMES)


# ----------------------------------------------------------------------------- helpers
def _group_geometry(P: int, NB: int):
    """Warps W of the one-block grouping kernels, their chunk, and the shared memory bytes."""
    cfg = align_mod.CONFIGS["group"]
    ints = cfg["SMEM_BUDGET"] // 4
    W = min(cfg["MAX_WARPS"], (ints - NB - 33) // NB)
    if W < 1:
        raise ValueError(f"num_experts: {NB} buckets do not fit the grouping kernel's "
                         f"{cfg['SMEM_BUDGET']} bytes of shared memory")
    # no more warps than 32-slot steps: idle warps only cost scan time
    W = max(1, min(W, cdiv(max(P, 1), 32)))
    chunk = cdiv(cdiv(max(P, 1), W), 32) * 32  # whole 32-slot steps per warp
    smem = (W * NB + NB + 1 + 32) * 4
    return W, chunk, smem


def _word_bytes(row_bytes: int, *arrays) -> int:
    """The widest copy word (16, 8, 4, 2 bytes) that divides a row and every base address."""
    for w in (16, 8, 4, 2):
        if row_bytes % w == 0 and all(a.data.ptr % w == 0 for a in arrays):
            return w
    raise ValueError(f"hidden_states: rows of {row_bytes} bytes cannot be copied in 2-byte words")


# ----------------------------------------------------------------------------- stages
def moe_permute(hidden_states, topk_ids, num_experts):
    """Rows grouped by expert (increasing id, stable in s): the contiguous layout.

    Returns x_grouped [P, H] (x_grouped[inv_permuted_idx[s]] = hidden_states[s // K]),
    expert_offsets int32 [E + 1] (expert e owns rows expert_offsets[e] .. [e + 1] - 1),
    inv_permuted_idx int32 [P].
    """
    A.check_array("hidden_states", hidden_states, ndim=2, dtypes=A.float_dtypes())
    ids = align_mod._ids_i32("topk_ids", topk_ids)
    E = A.check_int("num_experts", num_experts, 1, align_mod.MAX_EXPERTS)
    T, H = hidden_states.shape
    if ids.shape[0] != T:
        raise ValueError(f"topk_ids: expected {T} rows to match hidden_states {hidden_states.shape}, "
                         f"got shape {ids.shape}")
    K = ids.shape[1]
    P = T * K
    A.check_fits_int32("topk_ids", P, "P = T * K")
    x_grouped = A.empty((P, H), hidden_states.dtype)    # [P, H]
    expert_offsets = A.empty((E + 1,), np.int32)         # [E + 1]
    inv_permuted_idx = A.empty((P,), np.int32)           # [P]

    W, chunk, smem = _group_geometry(P, E + 1)
    kernel = C.get_kernel("permute.cu", "moe_permute_index_kernel", _defines(), _FIXED_NAMES)
    kernel((1,), (W * 32,), (ids, expert_offsets, inv_permuted_idx, np.int32(P), np.int32(E),
                             np.int32(chunk)), shared_mem=smem)
    if P == 0 or H == 0:
        return x_grouped, expert_offsets, inv_permuted_idx

    itemsize = hidden_states.dtype.itemsize
    w = _word_bytes(H * itemsize, hidden_states, x_grouped)
    warps = CONFIGS["gather_rows_kernel"]["ROW_WARPS"]
    gather = C.get_kernel("permute.cu", f"gather_rows_kernel<{_WORDS[w]}>", _defines(),
                          _FIXED_NAMES)
    gather((cdiv(P, warps),), (warps * 32,),
           (A.raw(hidden_states), inv_permuted_idx, A.raw(x_grouped), np.int32(P), np.int32(K),
            np.int32(H * itemsize // w)))
    return x_grouped, expert_offsets, inv_permuted_idx


def moe_unpermute(y_grouped, topk_weights, inv_permuted_idx):
    """out[t] = sum_k topk_weights[t, k] * y_grouped[inv_permuted_idx[t * K + k]].

    fp32 accumulation in slot order, rounded once to y_grouped's dtype; one thread per VEC
    output columns, no atomics, so the result is bitwise reproducible.
    """
    import cupy

    A.check_array("y_grouped", y_grouped, ndim=2, dtypes=A.float_dtypes())
    A.check_array("topk_weights", topk_weights, ndim=2, dtypes=A.float_dtypes(with_f64=True))
    T, K = topk_weights.shape
    P, H = y_grouped.shape
    if P != T * K:
        raise ValueError(f"y_grouped: expected T * K = {T} * {K} = {T * K} rows to match "
                         f"topk_weights {topk_weights.shape}, got {P}")
    A.check_array("inv_permuted_idx", inv_permuted_idx, ndim=1, shape=(P,))
    if inv_permuted_idx.dtype.kind not in "iu":
        raise TypeError(f"inv_permuted_idx: expected an integer dtype, got {inv_permuted_idx.dtype}")
    inv = inv_permuted_idx if inv_permuted_idx.dtype == np.int32 else \
        inv_permuted_idx.astype(cupy.int32)
    weights = A.as_f32(topk_weights)
    out = A.empty((T, H), y_grouped.dtype)  # [T, H]
    if T == 0 or H == 0:
        return out
    g = row_geometry("topk_weights", T, H, CONFIGS["moe_unpermute_kernel"]["UNPERMUTE_THREADS"],
                       y_grouped, out, vecs=_VECS)
    kernel = C.get_kernel("permute.cu", f"moe_unpermute_kernel<{g.vec}>",
                          _defines(y_grouped.dtype), _UNPERMUTE_NAMES)
    kernel((g.grid,), (g.threads,),
           (A.raw(y_grouped), weights, inv, A.raw(out), np.int32(T), np.int32(K), np.int32(H),
            np.int32(g.chunks)))
    return out


# ----------------------------------------------------------------------------- script
def _main(argv=None):
    quick, timed = script_start(argv)  # --quick: small shapes, 3 timed calls (sanitizers)
    import reference

    rng = np.random.default_rng(0)
    bf16 = A.bf16_dtype()
    print(f"{'case':48s} {'check':>10s} {'median us':>10s} {'GB/s':>8s}")
    permute_cases = ((1024, 256, 8, 7168), (4096, 128, 8, 2048))
    if quick:
        permute_cases = ((33, 16, 4, 136),)
    for T, E, K, H in permute_cases:
        ids = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int32)
        x = rng.standard_normal((T, H)).astype(bf16)                              # [T, H]
        d_x, d_ids = A.to_device(x), A.to_device(ids)
        got = moe_permute(d_x, d_ids, E)
        want = reference.moe_permute(x, ids, E)
        same = all((A.to_host(g).view(np.uint8) == w.view(np.uint8)).all()
                   for g, w in zip(got, want))
        ms = timed(lambda d_x=d_x, d_ids=d_ids, E=E: moe_permute(d_x, d_ids, E)).median
        nbytes = (T * H + T * K * H) * 2 + ids.size * 8  # x once, x_grouped, ids + inv
        print(f"{f'moe_permute T={T} E={E} K={K} H={H} bf16':48s} "
              f"{'exact' if same else 'MISMATCH':>10s} {ms * 1e3:10.1f} {nbytes / ms / 1e6:8.1f}")
        y = rng.standard_normal((T * K, H)).astype(bf16)                          # [P, H]
        w8 = rng.random((T, K)).astype(np.float32)
        d_y, d_w, d_inv = A.to_device(y), A.to_device(w8), got[2]
        out = moe_unpermute(d_y, d_w, d_inv)
        err = rel_err(A.to_host(out), reference.moe_unpermute(y, w8, want[2]))
        ms = timed(lambda d_y=d_y, d_w=d_w, d_inv=d_inv: moe_unpermute(d_y, d_w, d_inv)).median
        nbytes = (T * K * H + T * H) * 2 + T * K * 8  # y in, out, weights + inv
        print(f"{f'moe_unpermute T={T} K={K} H={H} bf16':48s} {err:10.2e} {ms * 1e3:10.1f} "
              f"{nbytes / ms / 1e6:8.1f}")


if __name__ == "__main__":
    _main()
