"""The activation in torch: act(gate) * up, or act(x) alone.

    M = rows (P slots), N = GEMM1's width (2I gated, I without mul)

    apply_activation(x, activation="silu", is_act_and_mul=True) -> [M, N/2] or [M, N]
    silu_and_mul(x), gelu_and_mul(x), gelu_tanh_and_mul(x), swigluoai_and_mul(x, alpha, limit)

The math and the rounding points are the reference's (reference/activation.py, vLLM's CUDA
kernels): a gated silu / gelu / gelu_tanh rounds act(gate) to x's dtype before the multiply
by up in fp32, then rounds again; swigluoai and the no-mul forms round once.
"""
from __future__ import annotations

from ._tensors import as_tensor, check_float, compute_dtype

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swigluoai", "relu2")


def _act(name, x):
    import torch
    import torch.nn.functional as F

    if name == "silu":
        return x * torch.sigmoid(x)
    if name == "gelu":
        return F.gelu(x, approximate="none")
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "relu2":
        return torch.relu(x) ** 2
    raise ValueError(name)


def _gate_up(x):
    check_float("x", x, ndim=2)
    if x.shape[1] % 2:
        raise ValueError(f"x: expected an even last dimension (gate and up), "
                         f"got shape {tuple(x.shape)}")
    xc = x.to(compute_dtype(x.dtype))
    h = x.shape[1] // 2
    return xc[:, :h], xc[:, h:]


def _gated(name, x):
    """act(gate) rounded to x's dtype, times up in fp32, rounded again: vLLM's
    (T)(ACT(gate) * (float)up), where ACT returns a T (exact for fp32 / fp64)."""
    x = as_tensor(x)
    gate, up = _gate_up(x)
    act = _act(name, gate).to(x.dtype).to(gate.dtype)
    return (act * up).to(x.dtype)


def silu_and_mul(x):
    """silu(x[:, :N/2]) * x[:, N/2:] -> [M, N/2]"""
    return _gated("silu", x)


def gelu_and_mul(x):
    """gelu(x[:, :N/2]) (exact erf) * x[:, N/2:] -> [M, N/2]"""
    return _gated("gelu", x)


def gelu_tanh_and_mul(x):
    """gelu_tanh(x[:, :N/2]) * x[:, N/2:] -> [M, N/2]"""
    return _gated("gelu_tanh", x)


def swigluoai_and_mul(x, alpha=1.702, limit=7.0):
    """gpt-oss: gate = min(x[:, 0::2], limit), up = clip(x[:, 1::2], -limit, limit),
    out = ((up + 1) * gate) / (1 + exp(-alpha * gate)) (vLLM's order, one rounding) -> [M, N/2]"""
    import torch

    x = as_tensor(x)
    check_float("x", x, ndim=2)
    if x.shape[1] % 2:
        raise ValueError(f"x: expected an even last dimension (gate and up), "
                         f"got shape {tuple(x.shape)}")
    xc = x.to(compute_dtype(x.dtype))
    gate = torch.clamp(xc[:, 0::2], max=limit)
    up = torch.clamp(xc[:, 1::2], -limit, limit)
    return (((up + 1) * gate) / (1 + torch.exp(-alpha * gate))).to(x.dtype)


_GATED = {"silu": silu_and_mul, "gelu": gelu_and_mul, "gelu_tanh": gelu_tanh_and_mul,
          "swigluoai": swigluoai_and_mul}


def apply_activation(x, activation="silu", is_act_and_mul=True):
    """[M, N] -> [M, N/2] (gated: act(gate) * up) or [M, N] (no-mul, elementwise).
    Accepts vLLM's "<name>_no_mul" spelling."""
    x = as_tensor(x)
    if isinstance(activation, str) and activation.endswith("_no_mul"):
        activation, is_act_and_mul = activation[: -len("_no_mul")], False
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {sorted(ACTIVATIONS)}, got {activation!r}")
    if is_act_and_mul:
        if activation not in _GATED:
            raise ValueError(f"activation: {activation!r} has no gated form; expected one of "
                             f"{sorted(_GATED)} with is_act_and_mul=True")
        return _GATED[activation](x)
    if activation == "swigluoai":
        raise ValueError("activation: 'swigluoai' needs is_act_and_mul=True")
    check_float("x", x, ndim=2)
    return _act(activation, x.to(compute_dtype(x.dtype))).to(x.dtype)
