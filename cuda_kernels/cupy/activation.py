"""Activations between the two expert GEMMs (activation.cu), fp32 math, vectorized.

Shapes: M rows (P = T * K in a MoE layer), N = 2 D input columns, D output columns.

    apply_activation(x, activation="silu", is_act_and_mul=True) -> [M, N/2] or [M, N]
    silu_and_mul(x), gelu_and_mul(x), gelu_tanh_and_mul(x)       gate = x[:, :D], up = x[:, D:]
    swigluoai_and_mul(x, alpha=1.702, limit=7.0)                  gate = x[:, 0::2], up = x[:, 1::2]
    no-mul (is_act_and_mul=False): silu, gelu, gelu_tanh, relu2 elementwise

Rounding as vLLM's CUDA kernels: a gated silu / gelu / gelu_tanh rounds act(gate) to the
dtype before the multiply (then the product); swigluoai ((up + 1) * gate) / (1 + exp(-alpha
gate)) and the no-mul forms round once.

Launch: block = min(ACT_THREADS, the row's VEC-words rounded up to a warp), each thread VEC
output columns (16-byte loads when the width
and the base pointers are multiples of 16 bytes; VEC halves until they are),
grid = M * cdiv(width, block * VEC).

Run as a script to validate against reference/ and time: python -m cuda_kernels.cupy.activation
"""
from __future__ import annotations


import numpy as np

from . import _arrays as A
from . import _compile as C
from ._geometry import row_geometry
from ._script import rel_err, script_start

CONFIGS = {"activation": {"ACT_THREADS": 256}}
_VECS = (1, 2, 4, 8)
_AND_MUL = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
_NO_MUL = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu2": 3}
_NAMES = (tuple(f"act_and_mul_kernel<{a}, {v}>" for a in _AND_MUL.values() for v in _VECS)
          + tuple(f"swigluoai_and_mul_kernel<{v}>" for v in _VECS)
          + tuple(f"act_kernel<{a}, {v}>" for a in _NO_MUL.values() for v in _VECS))


def _defines(dtype) -> dict:
    return {"SCALAR_T": A.ctype_of(dtype), **CONFIGS["activation"]}


for _dt in A.float_dtypes():
    C.register_compile_case("activation.cu", _defines(_dt), _NAMES)


def _launch(name_fmt, x, out, width, *extra):
    M = x.shape[0]
    if M == 0 or width == 0:
        return out
    g = row_geometry("x", M, width, CONFIGS["activation"]["ACT_THREADS"], x, out,
                       rows_symbol="M", vecs=_VECS)
    kernel = C.get_kernel("activation.cu", name_fmt.format(vec=g.vec), _defines(x.dtype), _NAMES)
    kernel((g.grid,), (g.threads,),
           (A.raw(x), A.raw(out), np.int32(M), np.int32(width), np.int32(g.chunks)) + extra)
    return out


def _check_x(x, paired: bool):
    A.check_array("x", x, ndim=2, dtypes=A.float_dtypes())
    if paired and x.shape[1] % 2:
        raise ValueError(f"x: expected an even number of columns (gate and up), got {x.shape}")
    return x


def _and_mul(x, activation):
    _check_x(x, True)
    M, N = x.shape
    out = A.empty((M, N // 2), x.dtype)  # [M, D]
    return _launch(f"act_and_mul_kernel<{_AND_MUL[activation]}, {{vec}}>", x, out, N // 2)


def silu_and_mul(x):
    """out = silu(x[:, :D]) * x[:, D:], silu(g) = g / (1 + exp(-g)); x [M, 2D] -> [M, D]."""
    return _and_mul(x, "silu")


def gelu_and_mul(x):
    """out = gelu(x[:, :D]) * x[:, D:], exact gelu (erf); x [M, 2D] -> [M, D]."""
    return _and_mul(x, "gelu")


def gelu_tanh_and_mul(x):
    """out = gelu_tanh(x[:, :D]) * x[:, D:], the tanh approximation; x [M, 2D] -> [M, D]."""
    return _and_mul(x, "gelu_tanh")


def swigluoai_and_mul(x, alpha=1.702, limit=7.0):
    """gpt-oss: gate = min(x[:, 0::2], limit), up = clip(x[:, 1::2], -limit, limit),
    out = (up + 1) * gate * sigmoid(alpha * gate); x [M, 2D] -> [M, D]."""
    _check_x(x, True)
    M, N = x.shape
    out = A.empty((M, N // 2), x.dtype)  # [M, D]
    return _launch("swigluoai_and_mul_kernel<{vec}>", x, out, N // 2,
                   np.float32(alpha), np.float32(limit))


def _no_mul(x, activation):
    _check_x(x, False)
    out = A.empty(x.shape, x.dtype)  # [M, N]
    return _launch(f"act_kernel<{_NO_MUL[activation]}, {{vec}}>", x, out, x.shape[1])


_WITH_MUL = {"silu": silu_and_mul, "gelu": gelu_and_mul, "gelu_tanh": gelu_tanh_and_mul,
             "swigluoai": swigluoai_and_mul}


def apply_activation(x, activation="silu", is_act_and_mul=True):
    """The activation of a MoE layer: x [M, N] -> [M, N/2] (act_and_mul) or [M, N] (no mul).

    vLLM's "<name>_no_mul" spelling implies is_act_and_mul=False.
    """
    if isinstance(activation, str) and activation.endswith("_no_mul"):
        activation, is_act_and_mul = activation[: -len("_no_mul")], False
    if is_act_and_mul:
        if activation not in _WITH_MUL:
            raise ValueError(f"activation: expected one of {sorted(_WITH_MUL)} with "
                             f"is_act_and_mul=True, got {activation!r}")
        return _WITH_MUL[activation](x)
    if activation not in _NO_MUL:
        raise ValueError(f"activation: expected one of {sorted(_NO_MUL)} with "
                         f"is_act_and_mul=False, got {activation!r}")
    return _no_mul(x, activation)


# ----------------------------------------------------------------------------- script
def _main(argv=None):
    quick, timed = script_start(argv)  # --quick: small shapes, 3 timed calls (sanitizers)
    import reference

    rng = np.random.default_rng(0)
    print(f"{'case':44s} {'rel err':>9s} {'median us':>10s} {'GB/s':>8s}")
    for dtype in A.float_dtypes():
        cases = ((32768, 2 * 768, "silu", True), (8192, 2 * 2048, "silu", True),
                 (8192, 2 * 2048, "swigluoai", True), (8192, 2 * 2048, "gelu", True),
                 (8192, 2048, "relu2", False))
        if quick:
            cases = tuple((33, N // 16 + 2, act, mul) for _, N, act, mul in cases)
        for M, N, act, mul in cases:
            x = (2 * rng.standard_normal((M, N))).astype(dtype)                 # [M, N]
            d_x = A.to_device(x)
            got = apply_activation(d_x, act, mul)
            err = rel_err(A.to_host(got), reference.apply_activation(x, act, mul))
            ms = timed(lambda d_x=d_x, act=act, mul=mul:
                       apply_activation(d_x, act, mul)).median
            nbytes = x.nbytes + got.nbytes  # read x once, write the output once
            name = f"{act}{'_and_mul' if mul else ''} M={M} N={N} {np.dtype(dtype).name}"
            print(f"{name:44s} {err:9.2e} {ms * 1e3:10.1f} {nbytes / ms / 1e6:8.1f}")


if __name__ == "__main__":
    _main()
