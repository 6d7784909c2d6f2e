"""Activations between the two GEMMs, in Numba.

    M = rows (slots), N = GEMM1 width (2I for the gated forms), I = N / 2

    apply_activation(x, activation="silu", is_act_and_mul=True) -> [M, N/2] or [M, N]
    silu_and_mul(x), gelu_and_mul(x), gelu_tanh_and_mul(x)        [M, N] -> [M, N/2]
    swigluoai_and_mul(x, alpha=1.702, limit=7.0)                   [M, N] -> [M, N/2]

The math (reference/activation.py), in fp32, rounded to x's dtype where vLLM's CUDA kernels
round: *_and_mul rounds act(gate) before the multiply, and the product again; swigluoai and
the no-mul forms round once:
    *_and_mul   gate = x[:, :I], up = x[:, I:], out = round(act(gate)) * up
    silu(g)      = g / (1 + exp(-g))
    gelu(g)      = 0.5 g (1 + erf(g / sqrt 2))                                 exact erf
    gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
    swigluoai    gate = x[:, 0::2], up = x[:, 1::2] (interleaved, gpt-oss),
                 gate = min(gate, limit), up = clip(up, -limit, limit),
                 out = ((up + 1) * gate) / (1 + exp(-alpha gate))   (vLLM's order)
    no-mul (is_act_and_mul=False): silu, gelu, gelu_tanh, relu2 = max(x, 0)^2 elementwise

One kernel, specialised at compile time on (activation, layout, load width):
`act_kernel(name, mode, NT, WORD)`, mode GATED (halves), INTERLEAVED (swigluoai) or
ELEMENTWISE. Launch: block = NT threads over output columns, grid = (cdiv(C, 4 NT),
min(M, 65535)), rows strided by gridDim.y, 4 columns NT apart per thread and step (their
loads issued first); no shared memory. A column is an 8-byte word of
VEC outputs (two fp32 or four fp16 / bf16; x and out viewed as uint64) when the rows (and,
gated, their halves) are whole words, else one element (swigluoai always: its gate and up
alternate inside a word). Each thread reads its gate and up words (coalesced across the warp:
consecutive threads, consecutive columns) and writes one.

When the output rows are whole 16-byte chunks (GATED, ELEMENTWISE), `act16_kernel` runs
instead: CuPy's geometry (activation.cu), one 16-byte chunk of outputs per thread, grid =
M * cdiv(C16, block), gate and up loads as ld.global.v2.u64 (_wide.py); config "WIDE"
turns it off.

dtypes: fp32, fp16, bf16 (uint16 bits, converted by shifts in the kernel: _device.py).

Run as a script to validate against reference/ and time: python -m cuda_kernels.numba.activation
"""
from __future__ import annotations

import functools
import math
import sys

import numpy as np
from numba import float32, uint64

from . import _arrays as A
from ._device import (PACK, ROUND, SIMULATOR, UNPACK, WORD_ELEMENTS, WORD_OF, cast_out, cu,
                      device_function, erf_f32, exp_f32, ix, kernel, round_as,
                      tanh_f32, to_f32, words)
from ._wide import chunk_grid, load16, store16, words16

CONFIGS = {"act": {"THREADS": 256, "WIDE": True}}
SIM_CONFIGS = {"act": {"THREADS": 16, "WIDE": True}}
MAX_GRID_Y = 65535
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swigluoai", "relu2")
GATED, INTERLEAVED, ELEMENTWISE = 0, 1, 2
_SQRT2 = np.float32(math.sqrt(2.0))
_TANH_C = np.float32(math.sqrt(2.0 / math.pi))
_GELU_CUBIC = np.float32(0.044715)


def config(name):
    return (SIM_CONFIGS if SIMULATOR else CONFIGS)[name]


# ----------------------------------------------------------------------------- the functions
@device_function
def silu(g):
    return g / (float32(1.0) + exp_f32(-g))


@device_function
def gelu(g):
    return float32(0.5) * g * (float32(1.0) + erf_f32(g / _SQRT2))


@device_function
def gelu_tanh(g):
    return float32(0.5) * g * (float32(1.0) + tanh_f32(_TANH_C * (g + _GELU_CUBIC * g * g * g)))


@device_function
def relu2(g):
    r = g if g > float32(0.0) or g != g else float32(0.0)   # np.maximum keeps NaN
    return r * r


@device_function
def swiglu_oai(g, u, alpha, limit):
    """((clip(u) + 1) * min(g, limit)) / (1 + exp(-alpha min(g, limit))), in vLLM's order;
    NaN propagates like NumPy."""
    if not (g != g or g < limit):
        g = limit
    if u > limit:
        u = limit
    elif u < -limit:
        u = -limit
    return ((u + float32(1.0)) * g) / (float32(1.0) + exp_f32(-alpha * g))


_FUNCS = {"silu": silu, "gelu": gelu, "gelu_tanh": gelu_tanh, "relu2": relu2}


@functools.lru_cache(maxsize=None)
def act_kernel(name: str, mode: int, NT: int, WORD: str = "", U: int = 4):
    """The activation kernel for one (function, layout, load width): see the module docstring.
    WORD ("f32" | "f16" | "bf16", GATED and ELEMENTWISE only): x and out are uint64 views and
    a thread computes the VEC outputs of one 8-byte word; "" computes one element. Each
    thread takes U columns NT apart per step and issues all their loads first."""
    f = _FUNCS.get(name, silu)   # swigluoai has its own two-argument form below
    VEC = WORD_ELEMENTS[WORD] if WORD else 1
    if WORD and mode == INTERLEAVED:
        raise ValueError("WORD: the interleaved layout (swigluoai) reads single elements")
    REG = uint64 if WORD else float32

    if WORD:
        unpack, pack, rnd = UNPACK[WORD], PACK[WORD], ROUND[WORD]

        @device_function
        def load(x, r, c, C, gs, us, u):
            gs[u] = x[r, c]
            if mode == GATED:
                us[u] = x[r, ix(c + C)]

        @device_function
        def finish(out, r, c, gs, us, u, alpha, limit):
            wd = uint64(0)
            for v in range(VEC):
                gv = f(unpack(gs[u], v))
                # gated: act(gate) rounded to the dtype first (vLLM's act_and_mul kernel)
                wd = pack(wd, v, rnd(gv) * unpack(us[u], v) if mode == GATED else gv)
            out[r, c] = wd
    else:
        @device_function
        def load(x, r, c, C, gs, us, u):
            if mode == INTERLEAVED:
                gs[u] = to_f32(x[r, ix(2 * c)])
                us[u] = to_f32(x[r, ix(2 * c + 1)])
            else:
                gs[u] = to_f32(x[r, c])
                if mode == GATED:
                    us[u] = to_f32(x[r, ix(c + C)])

        @device_function
        def finish(out, r, c, gs, us, u, alpha, limit):
            if mode == GATED:
                v = round_as(out, f(gs[u])) * us[u]   # act(gate) rounded first, as vLLM
            elif mode == INTERLEAVED:
                v = swiglu_oai(gs[u], us[u], alpha, limit)
            else:
                v = f(gs[u])
            out[r, c] = cast_out(out, v)

    def act(x, out, M, C, alpha, limit):
        """x [M, N] -> out [M, N_out], N_out = N/2 (GATED, INTERLEAVED) or N (ELEMENTWISE);
        C = N_out in words (WORD) or elements; U columns NT apart per thread and step."""
        gs = cu.local.array(U, REG)   # gate (or input) words / values of the step
        us = cu.local.array(U, REG)   # up words / values
        for row in range(cu.blockIdx.y, M, cu.gridDim.y):
            r = ix(row)               # unsigned: no negative-index wrap on every access
            for c0 in range(cu.blockIdx.x * NT * U + cu.threadIdx.x, C, cu.gridDim.x * NT * U):
                for u in range(U):    # every load of the step first, then the math
                    if c0 + u * NT < C:
                        load(x, r, ix(c0 + u * NT), C, gs, us, u)
                for u in range(U):
                    if c0 + u * NT < C:
                        finish(out, r, ix(c0 + u * NT), gs, us, u, alpha, limit)

    return kernel(act)


@functools.lru_cache(maxsize=None)
def act16_kernel(name: str, mode: int, NT: int, WORD: str):
    """The activation on 16-byte chunks (_wide.py), CuPy's geometry (activation.cu): block
    = NT threads over a row's output chunks, grid = M * cdiv(C16, NT) (flattened: no 65535
    limit on M), one 16-byte chunk (2 VEC outputs) per thread, its gate chunk and (GATED)
    its up chunk C words further. GATED and ELEMENTWISE only; x and out are uint64 views
    (words16) and C = the output row in words (even)."""
    if mode == INTERLEAVED:
        raise ValueError("mode: the interleaved layout (swigluoai) reads single elements")
    f = _FUNCS[name]
    VEC = WORD_ELEMENTS[WORD]
    unpack, pack, rnd = UNPACK[WORD], PACK[WORD], ROUND[WORD]

    @device_function
    def word_out(g, u):
        wd = uint64(0)
        for v in range(VEC):
            gv = f(unpack(g, v))
            wd = pack(wd, v, rnd(gv) * unpack(u, v) if mode == GATED else gv)
        return wd

    def act16(x, out, M, C, nbx):
        """out[m, chunk] = act(gate chunk) (* up chunk); nbx = blocks per row."""
        m = cu.blockIdx.x // nbx
        c = ((cu.blockIdx.x % nbx) * NT + cu.threadIdx.x) * 2   # first word of the chunk
        if m >= M or c >= C:
            return
        width = 2 * C if mode == GATED else C                    # words per input row
        g0, g1 = load16(x, m * width + c)
        u0 = g0
        u1 = g1
        if mode == GATED:
            u0, u1 = load16(x, m * width + C + c)
        store16(out, m * C + c, word_out(g0, u0), word_out(g1, u1))

    return kernel(act16)


def _run(x, name, mode, alpha=1.702, limit=7.0):
    A.check_float("x", x, ndim=2)
    M, N = A.shape_of(x)
    if mode != ELEMENTWISE and N % 2:
        raise ValueError(f"x: expected an even last dimension (gate and up), got shape {(M, N)}")
    n_out = N if mode == ELEMENTWISE else N // 2
    call = A.Call("x", x)
    out = call.empty((M, n_out), A.dtype_of(x))                            # [M, N_out]
    if M and n_out:
        NT = config("act")["THREADS"]
        xd = call.dev("x", x)
        wide = None
        if mode != INTERLEAVED and config("act")["WIDE"]:
            # rows (and, gated, each half) of whole 16-byte chunks: the out view checks the half
            wide = words16(xd, out)
        if wide is not None:   # 16-byte chunks, one per thread (CuPy's activation)
            xw, outw = wide
            C = outw.shape[1]
            grid, nt, nbx = chunk_grid(C, NT, M)
            act16_kernel(name, mode, nt, WORD_OF[np.dtype(xd.dtype)])[grid, nt, A.launch_stream()](
                xw, outw, M, C, nbx)
            return call.result(out)
        word, cols, views = "", n_out, None
        if mode != INTERLEAVED:   # rows of whole words (and, gated, a word-aligned half)
            views = words(xd, out)
        if views is not None:
            word = WORD_OF[np.dtype(xd.dtype)]
            xd, out_k = views
            cols = n_out // WORD_ELEMENTS[word]
        else:
            out_k = out
        grid = (A.cdiv(cols, 4 * NT), min(M, MAX_GRID_Y))
        act_kernel(name, mode, NT, word)[grid, NT, A.launch_stream()](
            xd, out_k, M, cols, np.float32(alpha), np.float32(limit))
    return call.result(out)


def silu_and_mul(x):
    """silu(x[:, :N/2]) * x[:, N/2:]  ->  [M, N/2]"""
    return _run(x, "silu", GATED)


def gelu_and_mul(x):
    """gelu(x[:, :N/2]) * x[:, N/2:] with the exact erf gelu  ->  [M, N/2]"""
    return _run(x, "gelu", GATED)


def gelu_tanh_and_mul(x):
    """gelu_tanh(x[:, :N/2]) * x[:, N/2:]  ->  [M, N/2]"""
    return _run(x, "gelu_tanh", GATED)


def swigluoai_and_mul(x, alpha=1.702, limit=7.0):
    """gpt-oss's clamped SwiGLU on interleaved gate/up columns  ->  [M, N/2]"""
    return _run(x, "swigluoai", INTERLEAVED, float(alpha), float(limit))


def apply_activation(x, activation="silu", is_act_and_mul=True):
    """The activation stage: [M, N] -> [M, N/2] (gated) or [M, N] (no-mul).

    `activation` also accepts vLLM's "<name>_no_mul" spelling, which implies no-mul.
    """
    if isinstance(activation, str) and activation.endswith("_no_mul"):
        activation, is_act_and_mul = activation[: -len("_no_mul")], False
    A.check_choice("activation", activation, ACTIVATIONS)
    if is_act_and_mul:
        if activation == "swigluoai":
            return swigluoai_and_mul(x)
        if activation == "relu2":
            raise ValueError(f"activation: {activation!r} has no gated form; expected one of "
                             f"['gelu', 'gelu_tanh', 'silu', 'swigluoai'] with is_act_and_mul=True")
        return _run(x, activation, GATED)
    if activation == "swigluoai":
        raise ValueError(f"activation: {activation!r} needs is_act_and_mul=True; expected one of "
                         f"['gelu', 'gelu_tanh', 'relu2', 'silu'] without mul")
    return _run(x, activation, ELEMENTWISE)


# ----------------------------------------------------------------------------- compile checks
_MODES = (("silu", GATED), ("gelu", GATED), ("gelu_tanh", GATED), ("swigluoai", INTERLEAVED),
          ("silu", ELEMENTWISE), ("gelu", ELEMENTWISE), ("gelu_tanh", ELEMENTWISE),
          ("relu2", ELEMENTWISE))


def compile_cases():
    """(label, kernel, argument types) of every launch above, for the PTX checks (_ptx.py)."""
    from numba import types as t

    cases = []
    w64 = t.Array(t.uint64, 2, "C")
    for name, mode in _MODES:
        if mode == INTERLEAVED:
            continue
        for word in ("f32", "f16", "bf16"):
            cases.append((f"act16 {name} mode={mode} {word}",
                          act16_kernel(name, mode, CONFIGS["act"]["THREADS"], word),
                          (w64, w64, t.int64, t.int64, t.int64)))
    for name, mode in _MODES:
        for dt, word in ((t.float32, "f32"), (t.float16, "f16"), (t.uint16, "bf16")):
            for wk in ((word, "") if mode != INTERLEAVED else ("",)):
                a = t.Array(t.uint64 if wk else dt, 2, "C")
                k = act_kernel(name, mode, CONFIGS["act"]["THREADS"], wk)
                cases.append((f"act {name} mode={mode} {dt}" + (" words" if wk else ""), k,
                              (a, a, t.int64, t.int64, t.float32, t.float32)))
    return cases


# ----------------------------------------------------------------------------- as a script
def _main():
    import reference

    from . import _script as S

    def lines(rng):
        shapes = [(3, 8)] if SIMULATOR else [(8, 4096), (2048, 1536), (32768, 4096)]
        for M, N in shapes:
            for dt in (np.float32, np.float16):
                x = (rng.standard_normal((M, N)) * 2).astype(dt)              # [M, N]
                for act, gated in (("silu", True), ("gelu", True), ("gelu_tanh", True),
                                   ("swigluoai", True), ("relu2", False)):
                    err = S.rel_err(apply_activation(x, act, gated),
                                    reference.apply_activation(x, act, gated))
                    form = "gated" if gated else "no-mul"
                    yield (f"  {act:10s} {form} [{M}, {N}] {np.dtype(dt).name}: rel err {err:.1e}"
                           + S.timed(lambda d: apply_activation(d, act, gated), x,
                                     nbytes=x.nbytes * (1.5 if gated else 2)),  # read x, write out
                           err <= (1e-5 if dt == np.float32 else 1e-2))

    return S.main("activation", lines)


if __name__ == "__main__":
    sys.exit(_main())
