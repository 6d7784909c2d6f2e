"""Activations between the two GEMMs.

    M = rows (slots), N = GEMM1 width (2I for the gated forms)

*_and_mul (is_act_and_mul=True): gate = x[:, :N/2], up = x[:, N/2:], out = act(gate) * up
    silu        gate * sigmoid(gate)                                        (Mixtral, Qwen, DeepSeek)
    gelu        0.5 * gate * (1 + erf(gate / sqrt 2))       exact erf
    gelu_tanh   0.5 * gate * (1 + tanh(sqrt(2/pi) * (gate + 0.044715 gate^3)))
    swigluoai   gpt-oss: gate and up *interleaved* (gate = x[:, 0::2], up = x[:, 1::2]),
                gate = min(gate, limit), up = clip(up, -limit, limit),
                out = (up + 1) * gate * sigmoid(alpha * gate), alpha 1.702, limit 7.0
no-mul (is_act_and_mul=False): silu, gelu, gelu_tanh, relu2 (relu(x)^2) elementwise, [M, N] -> [M, N]

All math in fp32 (fp64 for fp64 inputs). Rounding follows vLLM's CUDA activation kernels
(the GPU path of its fused MoE): a gated silu / gelu / gelu_tanh rounds act(gate) to the input
dtype, then multiplies by up in fp32 and rounds again (`(T)((float)ACT(gate) * (float)up)`);
swigluoai and the no-mul forms round once, swigluoai computed as
((up + 1) * gate) / (1 + exp(-alpha * gate)). In fp32 and fp64 the extra rounding is exact.
"""

from __future__ import annotations

import math

import numpy as np

from ._checks import check_choice, check_float
from .precision import to_compute

_erf = np.frompyfunc(math.erf, 1, 1)   # NumPy has no erf; math.erf is exact to the last ulp


def _silu(x):
    with np.errstate(over="ignore"):
        return x / (1 + np.exp(-x))


def _gelu(x):
    return 0.5 * x * (1 + _erf(x / math.sqrt(2.0)).astype(x.dtype))


def _gelu_tanh(x):
    c = math.sqrt(2.0 / math.pi)
    return 0.5 * x * (1 + np.tanh(c * (x + 0.044715 * x * x * x)))


def _relu2(x):
    r = np.maximum(x, 0)
    return r * r


_GATED = {"silu": _silu, "gelu": _gelu, "gelu_tanh": _gelu_tanh}
_ELEMENTWISE = {"silu": _silu, "gelu": _gelu, "gelu_tanh": _gelu_tanh, "relu2": _relu2}
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swigluoai", "relu2")


def _split_gate_up(name, x):
    check_float(name, x, ndim=2)
    if x.shape[1] % 2:
        raise ValueError(f"{name}: expected an even last dimension (gate and up), got shape {x.shape}")
    half = x.shape[1] // 2
    xc = to_compute(x)
    return xc[:, :half], xc[:, half:]


def _gated(act, x):
    gate, up = _split_gate_up("x", x)
    act_gate = act(gate).astype(x.dtype, copy=False).astype(gate.dtype, copy=False)  # rounded
    return (act_gate * up).astype(x.dtype, copy=False)


def silu_and_mul(x):
    """silu(x[:, :N/2]) * x[:, N/2:]  ->  [M, N/2]"""
    return _gated(_silu, x)


def gelu_and_mul(x):
    """gelu(x[:, :N/2]) * x[:, N/2:] with the exact erf gelu  ->  [M, N/2]"""
    return _gated(_gelu, x)


def gelu_tanh_and_mul(x):
    """gelu_tanh(x[:, :N/2]) * x[:, N/2:]  ->  [M, N/2]"""
    return _gated(_gelu_tanh, x)


def swigluoai_and_mul(x, alpha=1.702, limit=7.0):
    """gpt-oss's clamped SwiGLU on interleaved gate/up columns  ->  [M, N/2]"""
    check_float("x", x, ndim=2)
    if x.shape[1] % 2:
        raise ValueError(f"x: expected an even last dimension (gate and up), got shape {x.shape}")
    xc = to_compute(x)
    gate = np.minimum(xc[:, 0::2], limit)
    up = np.clip(xc[:, 1::2], -limit, limit)
    with np.errstate(over="ignore"):
        # vLLM's order: ((up + 1) * gate) / (1 + exp(-alpha gate)), one rounding
        out = ((up + 1) * gate) / (1 + np.exp(-alpha * gate))
    return out.astype(x.dtype, copy=False)


def apply_activation(x, activation="silu", is_act_and_mul=True):
    """The activation stage: [M, N] -> [M, N/2] (gated) or [M, N] (no-mul).

    `activation` also accepts vLLM's "<name>_no_mul" spelling, which implies no-mul.
    """
    if isinstance(activation, str) and activation.endswith("_no_mul"):
        activation, is_act_and_mul = activation[: -len("_no_mul")], False
    check_choice("activation", activation, ACTIVATIONS)
    if is_act_and_mul:
        if activation == "swigluoai":
            return swigluoai_and_mul(x)
        if activation not in _GATED:
            raise ValueError(f"activation: {activation!r} has no gated form; expected one of "
                             f"{sorted(_GATED) + ['swigluoai']} with is_act_and_mul=True")
        return _gated(_GATED[activation], x)
    if activation not in _ELEMENTWISE:
        raise ValueError(f"activation: {activation!r} needs is_act_and_mul=True; expected one of "
                         f"{sorted(_ELEMENTWISE)} without mul")
    check_float("x", x, ndim=2)
    return _ELEMENTWISE[activation](to_compute(x)).astype(x.dtype, copy=False)
