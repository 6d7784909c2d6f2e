"""vLLM's `fused_experts` on the GPU: the five expert stages, launched from a plan per shape.

    out[t] = sum_k topk_weights[t, k] * (W2[e] @ act(W13[e] @ x[t]))      e = topk_ids[t, k]

    T tokens, E local experts, K top-k, H hidden, I intermediate, N1 = 2I (gated) or I,
    B block size, P = T*K slots, L = max_num_tokens_padded(P, B, E)

    align       moe_align_kernel        topk_ids [T, K]   -> sorted [L], expert_ids [L/B], ntpp [1]
    gemm1       grouped_gemm_<v>        x [T, H], w1 [E, N1, H] -> c1 [P, N1]   (router weight
                                        here when apply_router_weight_on_input)
    activation  act_and_mul_kernel      c1 -> c2 [P, I]
    gemm2       grouped_gemm_<v>        c2, w2 [E, H, I]   -> c3 [P, H]    (* router weight)
    combine     moe_sum_live_kernel     c3 [T, K, H]       -> out [T, H]  (pad-aware: slots
                                        alignment skipped, ids -1, are never read)

These are the stage modules' own kernels with the configs and arguments the stage functions
would pick (gemm._plan, align._align_geometry, _geometry.row_geometry): a call
gives the same bits as calling `moe_align_block_size`, `grouped_gemm`, `apply_activation`,
`grouped_gemm` and `moe_sum` one after the other (tests/cupy/test_experts.py checks it on the
GPU). What changes is the host's share. A decode step's GPU work is tens of microseconds, and
the stage functions spend about as much again each on checks, config look-ups and argument
conversions, so the layer would wait on Python. Here that work is done once per shape and
kept in an `ExpertsPlan`; a call then checks what can change between calls (contiguity,
device), allocates, and launches five kernels with their arguments as raw pointers.
`plan_of(...)` (fused_experts' arguments) returns that plan without launching: its rungs
(`.versions`) and whether this card's tuned table chose them (`.rungs_tuned`, False on a
card tune.py never ran on).

A decode batch (T <= experts_decode.CONFIGS["decode"]["MAX_TOKENS"], and no block_size asked
for) takes another plan: the whole expert part in one cooperative launch
(experts_decode.py: GEMM1 + activation, a grid barrier, GEMM2 + combine), `.versions`
("decode",), or ("decode-ring",) where each SM has megabytes of weights to read on an
H100/H200 (rung 2: bulk copies, phase 1 balanced over the SMs). There the fixed costs of five
launches, the alignment and two GEMM ramps are most of the step (Qwen3-30B-A3B at T = 1:
75 MB of weights, 22 us at the H100's datasheet bandwidth, 58 us staged); its output matches
the stages to bf16 rounding, not bit for bit (another summation order).

Streams and graphs: the arrays may be CuPy arrays (launched on CuPy's current stream, outputs
from CuPy's allocator) or torch CUDA tensors (torch's current stream and allocator, so a
`torch.cuda.graph` capture records the five launches). Nothing is synchronised and nothing is
read back; the grids come from host-known upper bounds (L), and kernels past
num_tokens_post_padded exit at once. Small plans keep their intermediates between eager calls
on one stream (a stream runs its kernels in order, so reusing them is safe); inside a capture
every buffer is a fresh allocation from the graph's pool.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import numpy as np

from reference.align import max_num_tokens_padded

from . import _arrays as A
from . import _compile as C
from . import activation as act_mod
from . import align as align_mod
from . import combine as sum_mod
from . import experts_decode as dec
from . import gemm as gg
from . import gemm_configs as gcfg
from ._geometry import ROW_VECS, block_threads, cdiv
from ._launch import FastLaunch
from .gemm_tensor_map import v6_tensor_map

# intermediates (sorted ids .. c3) up to this many bytes are kept per (plan, stream)
WORKSPACE_CACHE_BYTES = 64 << 20
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")      # the gated kinds with one kernel template


# ----------------------------------------------------------------------------- arrays
class _Arg(NamedTuple):
    """What a launch needs of an input: its pointer, and what the plan is keyed on (a tuple:
    made five times a call, it must cost less than a dataclass)."""

    ptr: int
    shape: tuple
    dtype: np.dtype
    contiguous: bool
    device: int


def _describe(name: str, x, kind: str) -> _Arg:
    if kind == "torch":
        device = x.get_device()         # -1 on the CPU (one call: this runs 5 times a call)
        if device < 0:
            raise ValueError(f"{name}: expected a CUDA tensor, got one on {x.device}")
        return _Arg(x.data_ptr(), tuple(x.shape), _torch_np_dtype(x.dtype), x.is_contiguous(),
                    device)
    if kind == "cupy":
        return _Arg(x.data.ptr, tuple(x.shape), np.dtype(x.dtype), x.flags.c_contiguous,
                    x.device.id)
    raise TypeError(f"{name}: expected a cupy.ndarray or a CUDA torch.Tensor, got "
                    f"{type(x).__name__}")


@functools.lru_cache(maxsize=None)
def _torch_np_dtype(tdt) -> np.dtype:
    import torch

    table = {torch.float32: np.dtype(np.float32), torch.float16: np.dtype(np.float16),
             torch.bfloat16: A.bf16_dtype(), torch.int32: np.dtype(np.int32),
             torch.int64: np.dtype(np.int64), torch.float64: np.dtype(np.float64)}
    if tdt not in table:
        raise TypeError(f"expected a float or int tensor, got {tdt}")
    return table[tdt]


def _kind(x) -> str:
    mod = type(x).__module__ or ""
    if mod.startswith("torch"):
        return "torch"
    if mod.startswith("cupy"):
        return "cupy"
    return "other"


class _Allocator:
    """Outputs in the caller's library: torch tensors (torch's allocator and stream) or CuPy
    arrays (CuPy's pool and current stream). `empty` returns (array, pointer)."""

    def __init__(self, kind: str, device: int):
        self.kind, self.device = kind, device
        if kind == "torch":
            import torch

            self.torch = torch
            self.tdtypes = {np.dtype(np.int32): torch.int32, np.dtype(np.float32): torch.float32,
                            np.dtype(np.float16): torch.float16, A.bf16_dtype(): torch.bfloat16}
            self.dev = torch.device("cuda", device)
            # the raw cudaStream_t of torch's current stream: the call Triton's launcher makes
            # (torch.cuda.current_stream() builds a Stream object, several us on a slow host)
            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            self._torch_stream = raw if raw is not None else (
                lambda d: torch.cuda.current_stream(d).cuda_stream)
            self._torch_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing",
                                            torch.cuda.is_current_stream_capturing)

    def empty(self, shape, dtype):
        if self.kind == "torch":
            t = self.torch.empty(shape, dtype=self.tdtypes[np.dtype(dtype)], device=self.dev)
            if A.POISON and t.numel():
                t.fill_(float("nan") if np.dtype(dtype).kind == "f" or np.dtype(dtype) ==
                        A.bf16_dtype() else A.POISON_INT)
            return t, t.data_ptr()
        a = A.empty(shape, dtype)
        return a, a.data.ptr

    def raw(self, nbytes: int):
        """(owner, pointer) of `nbytes` of scratch (never poisoned: intermediates)."""
        if self.kind == "torch":
            t = self.torch.empty((nbytes,), dtype=self.torch.uint8, device=self.dev)
            return t, t.data_ptr()
        import cupy

        a = cupy.empty((nbytes,), dtype=cupy.uint8)
        return a, a.data.ptr

    def stream(self):
        """(the stream pointer to launch on, whether it is being captured): torch's current
        stream for torch callers, CuPy's current stream otherwise."""
        import cupy

        if self.kind == "torch":
            return self._torch_stream(self.device), self._torch_capturing()
        ptr = cupy.cuda.get_current_stream().ptr
        return ptr, bool(cupy.cuda.runtime.streamIsCapturing(ptr))


# ----------------------------------------------------------------------------- the plan
# kernel signatures for FastLaunch: p pointer, i int32 (align.cu, gemm_common.cuh's
# GG_KERNEL_ARGS, elementwise kernels of activation.cu / combine.cu)
ALIGN_SIG = "ppppppp" + "iiiiii"
GEMM_SIG = "pppppppp" + "iiiiiiii"
# v6 (prefill) takes one more: the CUtensorMap of its weights, 128 bytes by value
# (gemm_tensor_map.v6_tensor_map)
GEMM_EXTRA_SIG = {"v6": "t"}
ROWS_SIG = "pp" + "iii"
SUM_SIG = "pppip" + "iiii"   # moe_sum_live_kernel: x, ids, emap, map_len, out, T, K, H, chunks


class ExpertsPlan:
    """Everything about a `fused_experts` call that depends only on its shapes, dtypes,
    options and device: the block size, the five kernels, their grids and fixed arguments
    (or, for a decode batch, the one launch of experts_decode.py).
    Made by `plan_for` (cached); `__call__` does the per-call work."""

    def __init__(self, T, H, E, N1, I, K, dtype, activation, mul_on_input, block_size,  # noqa: E741
                 device, a_aligned, w1_aligned, w2_aligned, E_align):
        import cupy

        self.T, self.H, self.E, self.N1, self.I, self.K = T, H, E, N1, I, K  # noqa: E741
        self.P = P = T * K
        self.dtype = np.dtype(dtype)
        self.device = device
        self.dkey = dkey = gcfg.dtype_key(dtype)
        card = gcfg.device_name(device)
        block_requested = block_size is not None
        if block_size is None:
            block_size = int(gcfg.get_config(T, N1, H, E, K, dtype, device=card)["BLOCK_M"])
        self.B = B = A.check_int("block_size", block_size, 1)
        # align bins by global ids (E_align = the expert map's length, else E)
        self.E_align = E_align
        self.L = L = max_num_tokens_padded(P, B, E_align)
        self.num_blocks = cdiv(L, B)
        self.mul_on_input = bool(mul_on_input)
        isz = self.dtype.itemsize
        self._workspaces: dict = {}
        self._captured: list = []
        self.decode = None
        with cupy.cuda.Device(device):
            # a decode batch: the whole expert part in one launch (experts_decode.py), unless
            # the caller asked for an alignment block (that is, for the staged path)
            sms = gg._sm_count(device)         # the decode launch's grid: a block per SM
            sm90 = gg._is_sm90(cupy, device)
            if not block_requested and dec.eligible(
                    T, K, H, I, dtype, activation, mul_on_input, E_align != E,
                    a_aligned and w1_aligned and w2_aligned, sms):
                rung, self.decode = dec.decode_launch(T, K, E, H, I, dtype, activation, sms,
                                                      sm90)
                self.versions, self.rungs_tuned = (rung,), True       # no per-card table
                self._ws_sizes = (dec.workspace_bytes(rung, P, I, sms, isz),)  # c2 (+ descs)
                self.ws_bytes = _round256(self._ws_sizes[0])
                return
            bucket = gcfg.m_bucket(max(1.0, P / max(E, 1)))
            # align: one launch (cooperative above SMALL_P slots)
            G, W, smem = align_mod._align_geometry(
                P, E_align,
                align_mod._max_blocks() if P > align_mod.CONFIGS["align"]["SMALL_P"] else 1)
            k = C.get_kernel("align.cu", "moe_align_kernel", align_mod._defines(),
                             align_mod.KERNEL_NAMES)
            if smem > 48 * 1024:
                k.max_dynamic_shared_size_bytes = smem
            # the sizes are the plan's: their slots are set once (FastLaunch's fixed)
            self.align = FastLaunch(k, (G,), (W * 32,), smem, ALIGN_SIG, cooperative=G > 1,
                                    fixed=_after(7, P, E_align, B, L, self.num_blocks, 0))
            self.align_G = G
            self.dummy = gg._dummy(cupy, device).data.ptr
            # the two GEMMs: the rung and config grouped_gemm would pick
            self.gemms = []
            for n, kd, aligned, top_k, mul in (
                    (N1, H, a_aligned and w1_aligned, K, self.mul_on_input),
                    (H, I, w2_aligned, 1, not self.mul_on_input)):
                version, cfg = gg._plan(None, dkey, bucket, n, kd, B, aligned, sm90, None, card)
                grid, block, gsmem = gcfg.launch_geometry(
                    version, cfg, L, n, gg._sm_count(device) if version == "v6" else None)
                kern = gg._kernel(version, dkey, cfg, device)
                launch = FastLaunch(kern, grid, block, gsmem,
                                    GEMM_SIG + GEMM_EXTRA_SIG.get(version, ""),
                                    fixed=_after(7, self.dummy, n, kd, P, top_k, B, L, int(mul), 0))
                self.gemms.append(_Gemm(version, cfg, launch, n, kd))
            self.versions = tuple(g.version for g in self.gemms)
            # whether the rungs were measured on this card or are the table's default
            self.rungs_tuned = all(gcfg.rung_is_tuned(dtype, bucket, card, g.n, g.kd)
                                   for g in self.gemms)
            # activation and combine: the workspaces are 256-byte aligned, so the vector
            # width depends on the row widths only
            name_fmt = f"act_and_mul_kernel<{act_mod._AND_MUL[activation]}, {{vec}}>"
            self.act = self._rows(act_mod, "activation.cu", name_fmt, P, I, "ACT_THREADS",
                                  "activation", act_mod._NAMES, ROWS_SIG, first_size=2,
                                  sizes=(P, I))
            self.combine = self._rows(sum_mod, "combine.cu", "moe_sum_live_kernel<{vec}>", T, H,
                                      "SUM_THREADS", "moe_sum_kernel", sum_mod._NAMES, SUM_SIG,
                                      first_size=5, sizes=(T, K, H))
        # workspace layout: [sorted L][expert_ids L/B][ntpp 1][hist G*E], then c1, c2, c3
        self.n_ints = L + self.num_blocks + 1 + (G * E_align if G > 1 else 0)
        self._ws_sizes = (4 * self.n_ints,) + tuple(P * w * isz for w in (N1, I, H))
        self.ws_bytes = sum(_round256(n) for n in self._ws_sizes)

    def _rows(self, mod, cu, name_fmt, rows, width, threads_key, cfg_key, names, sig,
              first_size, sizes):
        """The launch of a row-wise kernel (activation, combine) over `rows` rows of `width`,
        its `sizes` and the column chunks fixed from argument `first_size` on."""
        threads_max = mod.CONFIGS[cfg_key][threads_key]
        isz = self.dtype.itemsize
        vec = max(v for v in ROW_VECS if v * isz <= 16 and width % v == 0)
        threads = block_threads(cdiv(width, vec), threads_max)
        chunks = cdiv(width, threads * vec)
        A.check_fits_int32("x", rows * chunks, "the grid size rows * column chunks")
        k = C.get_kernel(cu, name_fmt.format(vec=vec), mod._defines(self.dtype), names)
        return FastLaunch(k, (max(rows * chunks, 1),), (threads,), 0, sig,
                          fixed=_after(first_size, *sizes, chunks))

    # --- per call
    def _workspace(self, alloc, stream_ptr, capturing):
        """(ints pointer, c1, c2, c3 pointers, owner), or (c2 pointer, owner) for a decode
        plan: cached per stream for small plans outside a capture (a capture gets fresh
        buffers from the graph's pool)."""
        key = (alloc.kind, stream_ptr)
        if not capturing:
            hit = self._workspaces.get(key)
            if hit is not None:
                return hit
        owner, base = alloc.raw(self.ws_bytes)
        ptrs, off = [], 0
        for nbytes in self._ws_sizes:
            ptrs.append(base + off)
            off += _round256(nbytes)
        ws = (*ptrs, owner)
        if capturing:
            # the graph keeps these addresses: the buffers must outlive it, so they live as
            # long as the plan (a capture is rare; torch's come from the graph's own pool)
            self._captured.append(owner)
        elif self.ws_bytes <= WORKSPACE_CACHE_BYTES:
            self._workspaces[key] = ws
        return ws

    def __call__(self, x: _Arg, w1: _Arg, w2: _Arg, tw: _Arg, ids: _Arg, emap_ptr: int,
                 alloc: _Allocator):
        out, out_ptr = alloc.empty((self.T, self.H), self.dtype)
        if self.P == 0 or self.H == 0:
            return out
        stream_ptr, capturing = alloc.stream()
        if self.decode is not None:
            c2, _owner = self._workspace(alloc, stream_ptr, capturing)
            words = (align_mod._barrier_word(stream_ptr, self.device).data.ptr,
                     align_mod._barrier_word(stream_ptr, self.device, "decode chunks").data.ptr)
            self.decode(stream_ptr, x.ptr, w1.ptr, w2.ptr, tw.ptr, ids.ptr, c2, out_ptr, *words)
            return out
        ints, c1, c2, c3, _owner = self._workspace(alloc, stream_ptr, capturing)
        E = self.E_align
        sorted_ids, expert_ids = ints, ints + 4 * self.L
        ntpp = expert_ids + 4 * self.num_blocks
        hist = ntpp + 4 if self.align_G > 1 else 0
        bar = (align_mod._barrier_word(stream_ptr, self.device).data.ptr
               if self.align_G > 1 else 0)
        self.align(stream_ptr, ids.ptr, emap_ptr, sorted_ids, expert_ids, ntpp, hist, bar)
        g1, g2 = self.gemms
        g1.launch(stream_ptr, x.ptr, w1.ptr, c1, sorted_ids, expert_ids, ntpp, tw.ptr,
                  *self._extra(g1, w1.ptr))
        self.act(stream_ptr, c1, c2)
        g2.launch(stream_ptr, c2, w2.ptr, c3, sorted_ids, expert_ids, ntpp, tw.ptr,
                  *self._extra(g2, w2.ptr))
        self.combine(stream_ptr, c3, ids.ptr, emap_ptr, E if emap_ptr else 0, out_ptr)
        return out

    def _extra(self, g, w_ptr):
        """The arguments `g`'s rung takes after the common ones (v6: the tensor map of its
        weights at w_ptr, [E, n, kd]; the last one is kept, so a layer that calls with its
        own weights again looks nothing up)."""
        if g.version != "v6":
            return ()
        if g.tmap_ptr != w_ptr:
            g.tmap = v6_tensor_map(w_ptr, (self.E, g.n, g.kd), self.dkey, g.cfg, self.device)
            g.tmap_ptr = w_ptr
        return (g.tmap,)


@dataclasses.dataclass
class _Gemm:
    """One of the plan's two GEMMs: its rung, fitted config, launch, output and reduction
    widths."""

    version: str
    cfg: dict
    launch: FastLaunch
    n: int
    kd: int
    tmap_ptr: int | None = None       # v6: the weights' address whose tensor map is `tmap`
    tmap: object = None


def _after(first: int, *values) -> dict:
    """FastLaunch's `fixed` for `values` as the arguments from index `first` on."""
    return {first + i: v for i, v in enumerate(values)}


def _round256(n: int) -> int:
    return (int(n) + 255) // 256 * 256


_PLANS: dict = {}


def plan_for(T, H, E, N1, I, K, dtype, activation="silu", mul_on_input=False,  # noqa: E741
             block_size=None, device=0, a_aligned=True, w1_aligned=True, w2_aligned=True,
             E_align=None) -> ExpertsPlan:
    """The cached ExpertsPlan of a shape (made on first use: compiles the kernels).
    E_align: the number of global experts when an expert map is used (None: E)."""
    E_align = E if E_align is None else E_align
    key = (T, H, E, N1, I, K, np.dtype(dtype).str, activation, bool(mul_on_input), block_size,
           device, a_aligned, w1_aligned, w2_aligned, E_align)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = ExpertsPlan(T, H, E, N1, I, K, dtype, activation, mul_on_input,
                                         block_size, device, a_aligned, w1_aligned, w2_aligned,
                                         E_align)
    return plan


# ----------------------------------------------------------------------------- the entry point
def fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation="silu",
                  apply_router_weight_on_input=False, *, block_size=None, expert_map=None):
    """out [T, H] = the MoE layer's experts (module docstring) for routed tokens.

    hidden_states [T, H] bf16/fp16, w1 [E, 2I, H] (gate rows then up rows), w2 [E, H, I],
    topk_weights [T, K] fp32, topk_ids [T, K] int32: CuPy arrays or CUDA torch tensors on one
    device, contiguous (the output, its allocator and stream are hidden_states' library's).
    A slot whose id is outside [0, E) (vLLM's -1) adds nothing: the alignment drops it and
    the combine skips it. expert_map [E_global] int32 (global -> local id or -1; topk_ids
    then hold global ids) or None; block_size: the alignment block (None: the GEMM config's
    BLOCK_M for this shape; a decode batch asked for no alignment block runs in one launch,
    module docstring). Returns the caller's kind of array.
    The gated activations silu / gelu / gelu_tanh; anything else (swigluoai, no-mul, biases)
    goes through the stage functions one by one.
    """
    plan, args, kind = _checked_call(hidden_states, w1, w2, topk_weights, topk_ids, activation,
                                     apply_router_weight_on_input, block_size, expert_map)
    return plan(*args, _allocator(kind, args[0].device))


def plan_of(hidden_states, w1, w2, topk_weights, topk_ids, activation="silu",
            apply_router_weight_on_input=False, *, block_size=None, expert_map=None):
    """The ExpertsPlan `fused_experts` runs for these arguments (its rungs: `.versions`,
    and whether this card's table chose them: `.rungs_tuned`), made and cached as a call
    would make it, without launching anything."""
    return _checked_call(hidden_states, w1, w2, topk_weights, topk_ids, activation,
                         apply_router_weight_on_input, block_size, expert_map)[0]


def _checked_call(hidden_states, w1, w2, topk_weights, topk_ids, activation,
                  apply_router_weight_on_input, block_size, expert_map):
    """(plan, the plan's call arguments but the allocator, the caller's array kind) for a
    `fused_experts` call, its arguments checked (fused_experts' doc)."""
    kind = _kind(hidden_states)
    args = {}
    for name, v in (("hidden_states", hidden_states), ("w1", w1), ("w2", w2),
                    ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        args[name] = a = _describe(name, v, _kind(v))
        if not a.contiguous:
            raise ValueError(f"{name}: expected a contiguous array, got shape {a.shape}")
        if a.device != args["hidden_states"].device:
            raise ValueError(f"{name}: expected an array on device "
                             f"{args['hidden_states'].device} (hidden_states'), got device "
                             f"{a.device}")
    x, a1, a2, tw, ids = args.values()
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS} (others run stage by "
                         f"stage), got {activation!r}")
    if len(x.shape) != 2:
        raise ValueError(f"hidden_states: expected [T, H], got shape {x.shape}")
    T, H = x.shape
    if x.dtype not in (np.dtype(np.float16), A.bf16_dtype()):
        raise TypeError(f"hidden_states: expected bfloat16 or float16, got {x.dtype}")
    if len(a1.shape) != 3 or a1.shape[2] != H or a1.shape[1] % 2:
        raise ValueError(f"w1: expected [E, 2I, {H}] (gate and up rows), got shape {a1.shape}")
    E, N1 = a1.shape[0], a1.shape[1]
    I = N1 // 2  # noqa: E741
    if a2.shape != (E, H, I):
        raise ValueError(f"w2: expected shape ({E}, {H}, {I}) = [E, H, I], got {a2.shape}")
    for name, a in (("w1", a1), ("w2", a2)):
        if a.dtype != x.dtype:
            raise TypeError(f"{name}: expected dtype {x.dtype} (hidden_states'), got {a.dtype}")
    if len(ids.shape) != 2 or ids.shape[0] != T:
        raise ValueError(f"topk_ids: expected [{T}, K], got shape {ids.shape}")
    K = ids.shape[1]
    if ids.dtype != np.dtype(np.int32):
        raise TypeError(f"topk_ids: expected int32, got {ids.dtype}")
    if tw.shape != ids.shape or tw.dtype != np.dtype(np.float32):
        raise ValueError(f"topk_weights: expected float32 of shape {ids.shape}, got "
                         f"{tw.dtype} {tw.shape}")
    if apply_router_weight_on_input and K != 1:
        raise ValueError(f"apply_router_weight_on_input: needs top_k == 1 (as vLLM), got "
                         f"top_k={K}")
    emap_ptr, E_align = 0, E
    if expert_map is not None:
        m = _describe("expert_map", expert_map, _kind(expert_map))
        if m.dtype != np.dtype(np.int32) or len(m.shape) != 1 or not m.contiguous:
            raise TypeError(f"expert_map: expected a contiguous 1-D int32 array, got "
                            f"{m.dtype} {m.shape}")
        emap_ptr, E_align = m.ptr, m.shape[0]    # align bins by the global ids
    plan = plan_for(T, H, E, N1, I, K, x.dtype, activation, apply_router_weight_on_input,
                    block_size, x.device, x.ptr % 16 == 0, a1.ptr % 16 == 0, a2.ptr % 16 == 0,
                    E_align)
    return plan, (x, a1, a2, tw, ids, emap_ptr), kind


_ALLOCATORS: dict = {}


def _allocator(kind: str, device: int) -> _Allocator:
    a = _ALLOCATORS.get((kind, device))
    if a is None:
        a = _ALLOCATORS[(kind, device)] = _Allocator(kind, device)
    return a


fused_experts.activations = ACTIVATIONS     # what a caller may route here (sandbox.pipeline)
