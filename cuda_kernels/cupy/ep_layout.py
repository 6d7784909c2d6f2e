"""The expert-parallel all-to-all-v layout on the GPU (ep_layout.cu): the send order, the row
gather and the combine of sandbox/ep/dispatch.py's fused path, in three launches and no host
round trip (the caller's one host sync is for the counts, after the exchange).

Shapes: T tokens, K top-k, W ranks (<= 32), epr experts per rank, S entries per token
(token rows: min(W, K); slot rows: K), H hidden, n rows sent (the sum of the counts).

    ep_layout(topk_ids, experts_per_rank, world_size, rank, slot_rows, chunks=1)
        -> counts2 int64 [2, W, C] ([0, p, c]: rows sent to rank p from token chunk c;
           [1, rank] = [0, rank], the rest of [1] zero for the counts exchange to fill), inv int32 [T S] (entry -> send
           position; "nowhere" entries at positions >= n), src int32 [T S] (position ->
           entry), n_real int32 [1] (n, on the device)
    ep_gather(x, topk_ids, topk_weights, inv, n_real, experts_per_rank, slot_rows)
        -> x_send [T S, H] (rows < n written), ids_send (token rows: int32 [T S, K] physical
           ids; slot rows: int32 [T S] local ids), w_send f32 (same shape as ids_send) or None
    ep_combine(y, weights, inv, n, num_tokens, token_range=None, out=None) -> out [T, H]:
        out[t] = sum_{j : inv[t S + j] < n} weights[t, j] * y[inv[t S + j]] (weights None: 1),
        fp32 in j order, rounded once to y's dtype
    ep_count_experts(topk_ids, counts): counts[e] += #{ids == e}, e in [0, E) (int64 [E] on
        the device, 64-bit atomics: no host sync; others ignored)

sandbox/ep/layout.py holds the NumPy twins (same names, same signatures) that the CPU
communicator runs; tests/cupy/test_ep_layout.py checks one against the other.
Run as a script to validate the kernels against a loop and time them:
    python -m cuda_kernels.cupy.ep_layout
"""
from __future__ import annotations


import numpy as np

from . import _arrays as A
from . import _compile as C
from ._geometry import block_threads, cdiv
from ._script import script_start

CONFIGS = {
    # one block does the whole layout: more threads = fewer tokens walked per thread (at
    # T = 4096, 1024 threads walk 4 tokens each); capped so that the per-(bucket, thread)
    # counters fit 48 KB of shared memory
    "ep_layout_kernel": {"LAYOUT_THREADS": 1024, "SMEM_BUDGET": 48 * 1024},
    # one block per token row: 128 threads x 16 B = 2 KB per step, 7 steps for H = 7168 bf16
    "ep_gather_kernel": {"GATHER_THREADS": 128},
    "ep_combine_kernel": {"COMBINE_THREADS": 128},
    "ep_count_experts_kernel": {"COUNT_THREADS": 256, "MAX_BLOCKS": 1024},
}
MAX_WORLD = 32   # a token's destinations are one 32-bit mask
MAX_S = 32       # ep_gather_kernel keeps a token's positions in shared memory
_WORDS = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short"}
_GATHER_NAMES = tuple(f"ep_gather_kernel<{w}>" for w in _WORDS.values())
_VECS = (1, 2, 4, 8)
_COMBINE_NAMES = tuple(f"ep_combine_kernel<{v}>" for v in _VECS)
_FIXED_NAMES = ("ep_layout_kernel", "ep_count_experts_kernel") + _GATHER_NAMES


def _defines(scalar_dtype=np.float32) -> dict:
    return {"SCALAR_T": A.ctype_of(scalar_dtype),
            "LAYOUT_THREADS": CONFIGS["ep_layout_kernel"]["LAYOUT_THREADS"],
            **CONFIGS["ep_gather_kernel"], **CONFIGS["ep_combine_kernel"],
            "COUNT_THREADS": CONFIGS["ep_count_experts_kernel"]["COUNT_THREADS"]}


# the layout, gathers and counts do not depend on the dtype (fp32 defines); the combine is
# compiled once per dtype
C.register_compile_case("ep_layout.cu", _defines(), _FIXED_NAMES)
for _dt in A.float_dtypes():
    C.register_compile_case("ep_layout.cu", _defines(_dt), _COMBINE_NAMES)


_CACHE = {}


def _kernel(name, scalar_dtype=np.float32):
    """get_kernel with a cache keyed by (name, dtype, device): these launches sit on the EP
    critical path, where get_kernel's key (the defines, sorted and formatted) costs
    microseconds per call."""
    import cupy

    key = (name, np.dtype(scalar_dtype).str, cupy.cuda.runtime.getDevice())
    kern = _CACHE.get(key)
    if kern is None:
        names = _COMBINE_NAMES if name.startswith("ep_combine") else _FIXED_NAMES
        kern = _CACHE[key] = C.get_kernel("ep_layout.cu", name, _defines(scalar_dtype), names)
    return kern


def entries_per_token(world_size: int, top_k: int, slot_rows: bool) -> int:
    """S: K for slot rows, min(W, K) for token rows."""
    return int(top_k) if slot_rows else min(int(world_size), int(top_k))


def supported(world_size: int, top_k: int, slot_rows: bool) -> bool:
    """Whether these kernels take the shape (else the caller keeps the stage path)."""
    return 1 <= world_size <= MAX_WORLD and 1 <= top_k and \
        entries_per_token(world_size, top_k, slot_rows) <= MAX_S


MAX_CHUNKS = 64


def _layout_threads(T: int, NB: int, chunks: int) -> int:
    cfg = CONFIGS["ep_layout_kernel"]
    fit = (cfg["SMEM_BUDGET"] // 4 - 32 - NB - 1 - (NB - 1) * chunks) // NB   # counters that fit
    nt = min(cfg["LAYOUT_THREADS"], fit, cdiv(max(T, 1), 32) * 32)
    return max(32, nt // 32 * 32)


def ep_layout(topk_ids, experts_per_rank, world_size, rank, slot_rows, chunks=1):
    """The send order of the entries (see the module docstring); counts2 is [2, W, chunks]
    (per chunk of tokens: chunk c = tokens [ceil(c T / chunks), ceil((c + 1) T / chunks))).
    One launch, one block."""
    import cupy

    A.check_array("topk_ids", topk_ids, ndim=2, dtypes=(np.int32,))
    W = A.check_int("world_size", world_size, 1, MAX_WORLD)
    epr = A.check_int("experts_per_rank", experts_per_rank, 1)
    r = A.check_int("rank", rank, 0, W - 1)
    nc = A.check_int("chunks", chunks, 1, MAX_CHUNKS)
    T, K = topk_ids.shape
    S = entries_per_token(W, K, slot_rows)
    if S > MAX_S:
        raise ValueError(f"topk_ids: expected at most {MAX_S} slots per token, got K = {K}")
    A.check_fits_int32("topk_ids", T * S + 1, "T * S entries")
    A.check_fits_int32("experts_per_rank", W * epr, "W * experts_per_rank")
    counts2 = cupy.empty((2, W, nc), dtype=cupy.int64)  # [2, W, C] (all written)
    inv = A.empty((T * S,), np.int32)                   # [T S]
    src = A.empty((T * S,), np.int32)                   # [T S]
    n_real = A.empty((1,), np.int32)                    # [1]
    NB = W + 1
    nt = _layout_threads(T, NB, nc)
    smem = (NB * nt + 32 + NB + 1 + W * nc) * 4
    kern = _kernel("ep_layout_kernel")
    kern((1,), (nt,), (topk_ids, inv, src, counts2, n_real, np.int32(T), np.int32(K),
                       np.int32(S), np.int32(W), np.int32(epr), np.int32(1 if slot_rows else 0),
                       np.int32(r), np.int32(nc)), shared_mem=smem)
    return counts2, inv, src, n_real


def _word_bytes(row_bytes: int, *arrays) -> int:
    for w in (16, 8, 4, 2):
        if row_bytes % w == 0 and all(a.data.ptr % w == 0 for a in arrays):
            return w
    raise ValueError(f"x: rows of {row_bytes} bytes cannot be copied in 2-byte words")


def ep_gather(x, topk_ids, topk_weights, inv, n_real, experts_per_rank, slot_rows):
    """x_send [T S, H] (rows < n: the token rows in send order) and the metadata that travels
    with them. One launch, one block per token."""
    A.check_array("x", x, ndim=2, dtypes=A.float_dtypes())
    A.check_array("topk_ids", topk_ids, ndim=2, dtypes=(np.int32,))
    T, H = x.shape
    K = topk_ids.shape[1]
    if topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids: expected {T} rows to match x {x.shape}, got {topk_ids.shape}")
    P = inv.shape[0]
    S = P // T if T else 0
    if T and (P != T * S or S > MAX_S):
        raise ValueError(f"inv: expected T * S entries (S <= {MAX_S}) for T = {T}, got {P}")
    if topk_weights is not None:
        A.check_array("topk_weights", topk_weights, ndim=2, dtypes=(np.float32,),
                      shape=(T, K))
    x_send = A.empty((P, H), x.dtype)                                      # [T S, H]
    meta_shape = (P,) if slot_rows else (P, K)
    ids_send = A.empty(meta_shape, np.int32)
    w_send = A.empty(meta_shape, np.float32) if topk_weights is not None else None
    if T == 0 or H == 0:
        return x_send, ids_send, w_send
    itemsize = np.dtype(x.dtype).itemsize
    wb = _word_bytes(H * itemsize, x, x_send)
    kern = _kernel(f"ep_gather_kernel<{_WORDS[wb]}>")
    threads = CONFIGS["ep_gather_kernel"]["GATHER_THREADS"]
    kern((T,), (threads,), (A.raw(x), topk_ids,
                            topk_weights if topk_weights is not None else A.null_ptr(), inv,
                            n_real, A.raw(x_send), ids_send,
                            w_send if w_send is not None else A.null_ptr(), np.int32(T),
                            np.int32(K), np.int32(S), np.int32(experts_per_rank),
                            np.int32(1 if slot_rows else 0), np.int32(H * itemsize // wb)))
    return x_send, ids_send, w_send


def ep_combine(y, weights, inv, n, num_tokens, token_range=None, out=None):
    """out [T, H] = sum over a token's sent entries (inv < n) of weights * y, fp32 in entry
    order, rounded once; weights [T, S] float32, or None for weights 1 (token rows).
    token_range (t0, t1): only those rows of out are computed (into `out` when given, a
    [T, H] array of y's dtype; the combine of one chunk of tokens)."""
    T = A.check_int("num_tokens", num_tokens, 0)
    n = A.check_int("n", n, 0)
    A.check_array("y", y, ndim=2, dtypes=A.float_dtypes())
    if y.shape[0] != n:
        raise ValueError(f"y: expected n = {n} rows (the rows sent), got shape {y.shape}")
    P = inv.shape[0]
    S = P // T if T else (0 if weights is None else weights.shape[1])
    if T * S != P:
        raise ValueError(f"inv: expected T * S entries for T = {T}, got {P}")
    if weights is not None:
        A.check_array("weights", weights, ndim=2, dtypes=(np.float32,), shape=(T, S))
    t0, t1 = (0, T) if token_range is None else (int(token_range[0]), int(token_range[1]))
    if not 0 <= t0 <= t1 <= T:
        raise ValueError(f"token_range: expected 0 <= t0 <= t1 <= {T}, got {token_range}")
    if out is None:
        out = A.empty((T, y.shape[1]), y.dtype)                            # [T, H]
    else:
        A.check_array("out", out, ndim=2, shape=(T, y.shape[1]))
        if np.dtype(out.dtype) != np.dtype(y.dtype):
            raise TypeError(f"out: expected dtype {y.dtype} (y's), got {out.dtype}")
    return _combine(y, weights, inv, n, S, t0, t1, out)


def _combine(y, weights, inv, n, S, t0, t1, out):
    H = y.shape[1]
    if t1 == t0 or H == 0:
        return out
    itemsize = np.dtype(y.dtype).itemsize
    vec = max(v for v in _VECS if v * itemsize <= 16 and H % v == 0
              and (y.data.ptr % (v * itemsize) == 0 or n == 0)
              and out.data.ptr % (v * itemsize) == 0)
    threads = block_threads(cdiv(H, vec), CONFIGS["ep_combine_kernel"]["COMBINE_THREADS"])
    chunks = cdiv(H, threads * vec)
    A.check_fits_int32("y", (t1 - t0) * chunks, "the grid size tokens * column chunks")
    kern = _kernel(f"ep_combine_kernel<{vec}>", y.dtype)
    kern(((t1 - t0) * chunks,), (threads,),
         (A.raw(y), weights if weights is not None else A.null_ptr(), inv, A.raw(out),
          np.int32(t0), np.int32(t1), np.int32(S), np.int32(H), np.int32(n), np.int32(chunks)))
    return out


def ep_count_experts(topk_ids, counts):
    """counts[e] += #{topk_ids == e} for e in [0, E), E = len(counts); in place, no sync."""
    A.check_array("topk_ids", topk_ids, dtypes=(np.int32,))
    A.check_array("counts", counts, ndim=1, dtypes=(np.int64,))
    N, E = int(topk_ids.size), int(counts.shape[0])
    if N == 0 or E == 0:
        return counts
    if E * 4 > 48 * 1024:
        raise ValueError(f"counts: expected at most {48 * 1024 // 4} experts (a shared-memory "
                         f"histogram), got {E}")
    cfg = CONFIGS["ep_count_experts_kernel"]
    threads = cfg["COUNT_THREADS"]
    blocks = max(1, min(cfg["MAX_BLOCKS"], cdiv(N, threads * 8)))
    kern = _kernel("ep_count_experts_kernel")
    kern((blocks,), (threads,), (topk_ids, counts, np.int32(N), np.int32(E)),
         shared_mem=E * 4)
    return counts


# ----------------------------------------------------------------------------- plans
class DispatchPlan:
    """The fused dispatch's launches for one shape, with the host work done once.

    ep_layout / ep_gather above check every argument, allocate every output and pick the
    kernel on each call: tens of microseconds of host time per launch, while the GPU (idle
    after the counts sync of the previous step) waits for them. A plan does all of that once
    per shape (T, H, K, dtype, weights or not, epr, W, rank, row mode, chunks): the checks,
    the kernels, the launch geometry and the constant kernel arguments, and the buffers that
    live only inside one dispatch (counts2 [2, W, C], src [T S], n_real [1], x_send [T S, H],
    ids_send, w_send). Those are reused from call to call: every use is on the stream the
    plan was made for, so the next call's kernels are ordered after this call's exchange
    (the caller keys its plans by stream). inv [T S] is returned to the caller (the combine
    needs it later), so it is a new array each call.

        plan = DispatchPlan(T, H, K, dtype, has_weights, epr, W, rank, slot_rows, chunks)
        inv = plan.layout(ids)                       # 1 launch: counts2, inv, src, n_real
        plan.gather(x, ids, w, inv)                  # 1 launch: x_send, ids_send, w_send
    The caller guarantees x [T, H] of `dtype`, ids int32 [T, K], w f32 [T, K] (or None), all
    C-contiguous on this device (what the plan was made for): the plan does not look again.
    """

    def __init__(self, T, H, K, dtype, has_weights, experts_per_rank, world_size, rank,
                 slot_rows, chunks=1):
        import cupy

        self.T = T = A.check_int("T", T, 0)
        self.H = H = A.check_int("H", H, 0)
        self.K = K = A.check_int("top_k", K, 1)
        W = A.check_int("world_size", world_size, 1, MAX_WORLD)
        epr = A.check_int("experts_per_rank", experts_per_rank, 1)
        r = A.check_int("rank", rank, 0, W - 1)
        nc = A.check_int("chunks", chunks, 1, MAX_CHUNKS)
        dtype = np.dtype(dtype)
        if dtype not in A.float_dtypes():
            raise TypeError(f"dtype: expected one of {A.FLOAT_NAMES}, got {dtype}")
        S = entries_per_token(W, K, slot_rows)
        if S > MAX_S:
            raise ValueError(f"topk_ids: expected at most {MAX_S} slots per token, got K = {K}")
        A.check_fits_int32("topk_ids", T * S + 1, "T * S entries")
        A.check_fits_int32("x", T * S * max(H, 1), "T * S * H send elements")
        A.check_fits_int32("experts_per_rank", W * epr, "W * experts_per_rank")
        self.S, self.W, self.rank, self.chunks, self.slot = S, W, r, nc, bool(slot_rows)
        self.dtype, self.epr = dtype, epr
        P = T * S
        self.counts2 = cupy.zeros((2, W, nc), dtype=cupy.int64)   # [2, W, C]
        self.src = cupy.empty((P,), dtype=cupy.int32)              # [T S]
        self.n_real = cupy.zeros((1,), dtype=cupy.int32)           # [1]
        self.x_send = A.empty((P, H), dtype)                       # [T S, H]
        meta = (P,) if slot_rows else (P, K)
        self.ids_send = cupy.empty(meta, dtype=cupy.int32)
        self.w_send = cupy.empty(meta, dtype=cupy.float32) if has_weights else None
        self._empty = A.empty if A.POISON else cupy.empty          # inv, new per call
        NB = W + 1
        nt = _layout_threads(T, NB, nc)
        self._layout = (_kernel("ep_layout_kernel"), (1,), (nt,),
                        (NB * nt + 32 + NB + 1 + W * nc) * 4)
        self._layout_tail = (np.int32(T), np.int32(K), np.int32(S), np.int32(W),
                             np.int32(epr), np.int32(1 if slot_rows else 0), np.int32(r),
                             np.int32(nc))
        self._gathers = {}
        self._w_null = A.null_ptr()
        itemsize = dtype.itemsize
        self.row_bytes = H * itemsize
        # the gather's word: 16 B when the row length and both row starts allow it; x_send
        # is the plan's (pool allocations are 256-B aligned), x's start is checked per call
        for wb in (16, 8, 4, 2):
            if self.row_bytes % wb == 0:
                self._gathers[wb] = (_kernel(f"ep_gather_kernel<{_WORDS[wb]}>"),
                                     np.int32(self.row_bytes // wb))
        self._gather_tail = (np.int32(T), np.int32(K), np.int32(S), np.int32(epr),
                             np.int32(1 if slot_rows else 0))
        self._x_send_raw = A.raw(self.x_send)
        # bf16 goes to the kernel as its uint16 bytes (A.raw, decided once here)
        self._raw = np.uint16 if dtype == A.bf16_dtype() else None

    def layout(self, ids):
        """One launch: the send order of ids [T, K] -> inv int32 [T S] (counts2, src and
        n_real in the plan's buffers)."""
        inv = self._empty((self.T * self.S,), np.int32)
        kern, grid, block, smem = self._layout
        kern(grid, block, (ids, inv, self.src, self.counts2, self.n_real) + self._layout_tail,
             shared_mem=smem)
        return inv

    def gather(self, x, ids, w, inv):
        """One launch: x_send / ids_send / w_send rows < n in send order (x [T, H], w [T, K]
        f32 or None as the plan was made)."""
        if self.T == 0 or self.H == 0:
            return
        ptr = x.data.ptr
        for wb, (kern, words) in self._gathers.items():
            if ptr % wb == 0:
                break
        else:
            raise ValueError("x: rows cannot be copied in 2-byte words (misaligned start)")
        kern((self.T,), (CONFIGS["ep_gather_kernel"]["GATHER_THREADS"],),
             (x if self._raw is None else x.view(self._raw), ids,
              self._w_null if w is None else w, inv, self.n_real,
              self._x_send_raw, self.ids_send,
              self._w_null if self.w_send is None else self.w_send) + self._gather_tail
             + (words,))


class CombinePlan:
    """ep_combine for one shape (T, S, H, dtype, weights or not), its kernels and geometry
    chosen once: out [T, H] = sum over a token's sent entries of w * y (see ep_combine).
    The caller guarantees y [n, H] and out [T, H] of `dtype`, weights f32 [T, S] or None,
    all C-contiguous on this device."""

    def __init__(self, T, S, H, dtype):
        self.T, self.S, self.H = A.check_int("num_tokens", T, 0), int(S), A.check_int("H", H, 0)
        dtype = np.dtype(dtype)
        if dtype not in A.float_dtypes():
            raise TypeError(f"dtype: expected one of {A.FLOAT_NAMES}, got {dtype}")
        self.dtype = dtype
        itemsize = dtype.itemsize
        # (bytes per thread access, kernel, threads, column chunks), widest first
        self._launch = []
        for vec in reversed(_VECS):
            if vec * itemsize > 16 or H % vec or H == 0:
                continue
            threads = block_threads(cdiv(H, vec),
                                      CONFIGS["ep_combine_kernel"]["COMBINE_THREADS"])
            chunks = cdiv(H, threads * vec)
            A.check_fits_int32("y", T * chunks, "the grid size tokens * column chunks")
            self._launch.append((vec * itemsize, _kernel(f"ep_combine_kernel<{vec}>", dtype),
                                 threads, chunks))
        self._null = A.null_ptr()
        self._tail = (np.int32(S), np.int32(H))
        self._raw = np.uint16 if dtype == A.bf16_dtype() else None   # bf16 as uint16

    def __call__(self, y, weights, inv, n, out, t0=0, t1=None):
        t1 = self.T if t1 is None else t1
        if t1 == t0 or self.H == 0:
            return out
        align = y.data.ptr | out.data.ptr if n else out.data.ptr
        for vb, kern, threads, chunks in self._launch:
            if align % vb == 0:
                break
        kern(((t1 - t0) * chunks,), (threads,),
             (y if self._raw is None else y.view(self._raw),
              self._null if weights is None else weights, inv,
              out if self._raw is None else out.view(self._raw),
              np.int32(t0), np.int32(t1)) + self._tail + (np.int32(n), np.int32(chunks)))
        return out


# ----------------------------------------------------------------------------- script
def _loop_layout(ids, epr, W, slot_rows):
    """The dumbest correct layout: (counts [W], inv [T S]) by walking buckets, then entries."""
    T, K = ids.shape
    S = entries_per_token(W, K, slot_rows)
    buckets = np.full((T, S), W, dtype=np.int64)
    for t in range(T):
        if slot_rows:
            for k in range(K):
                e = ids[t, k]
                buckets[t, k] = e // epr if 0 <= e < W * epr else W
        else:
            dests = sorted({int(e) // epr for e in ids[t] if 0 <= e < W * epr})
            buckets[t, :len(dests)] = dests
    flat = buckets.reshape(-1)
    inv = np.empty(T * S, dtype=np.int64)
    pos = 0
    for b in range(W + 1):
        for e in range(T * S):
            if flat[e] == b:
                inv[e] = pos
                pos += 1
    return np.bincount(flat, minlength=W + 1)[:W], inv


def _main(argv=None):
    _, timed = script_start(argv)   # --quick: 3 timed calls (sanitizers)
    rng = np.random.default_rng(0)
    bf16 = A.bf16_dtype()
    print(f"{'case':52s} {'check':>10s} {'median us':>10s} {'GB/s':>8s}")
    for T, E, K, W, H, slot in ((37, 16, 4, 2, 136, False), (37, 16, 4, 4, 136, True),
                                (300, 64, 6, 8, 200, False), (4096, 256, 8, 2, 7168, False),
                                (4096, 256, 8, 2, 7168, True)):
        ids = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int32)   # [T, K]
        ids[0, 0] = -1 if T > 1 else ids[0, 0]                                   # an invalid id
        epr = E // W
        want_counts, want_inv = _loop_layout(ids, epr, W, slot) if T <= 300 else (None, None)
        d_ids = A.to_device(ids)
        counts2, inv, src, n_real = ep_layout(d_ids, epr, W, 0, slot)
        ok_layout = want_inv is None or (
            (A.to_host(counts2)[0, :, 0] == want_counts).all()
            and (A.to_host(inv) == want_inv).all())
        us = timed(lambda: ep_layout(d_ids, epr, W, 0, slot)).median * 1e3
        print(f"{f'ep_layout T={T} K={K} W={W} slot={slot}':52s} "
              f"{'exact' if ok_layout else 'MISMATCH':>10s} {us:10.1f}")
        x = rng.standard_normal((T, H)).astype(bf16)
        w = rng.random((T, K)).astype(np.float32)
        d_x, d_w = A.to_device(x), A.to_device(w)
        x_send, _, _ = ep_gather(d_x, d_ids, d_w, inv, n_real, epr, slot)
        n = int(A.to_host(n_real)[0])
        S = entries_per_token(W, K, slot)
        h_src = A.to_host(src)[:n]
        ok_gather = (A.to_host(x_send)[:n].view(np.uint16) ==
                     x.view(np.uint16)[h_src // S]).all()
        us = timed(lambda: ep_gather(d_x, d_ids, d_w, inv, n_real, epr, slot)).median * 1e3
        nbytes = (T + n) * H * 2
        print(f"{f'ep_gather T={T} H={H} n={n}':52s} {'exact' if ok_gather else 'MISMATCH':>10s} "
              f"{us:10.1f} {nbytes / us / 1e3:8.1f}")
        y = x_send[:n]
        weights = d_w if slot else A.to_device(np.ones((T, S), np.float32))
        out = ep_combine(y, weights, inv, n, T)
        us = timed(lambda: ep_combine(y, weights, inv, n, T)).median * 1e3
        nbytes = (T + n) * H * 2
        print(f"{f'ep_combine T={T} H={H} n={n}':52s} {'ran':>10s} {us:10.1f} "
              f"{nbytes / us / 1e3:8.1f}")
        del out


if __name__ == "__main__":
    _main()
