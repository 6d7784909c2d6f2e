"""How `validate` judges a quantized layer's stages (sandbox/quant.py; validate.py calls it).

    P = T*K slots, M a quantizer's rows (T, then P), G its scale columns

A quantized layer's trace runs route, align, quantize1, gemm1, activation, quantize2, gemm2,
combine (weight-only formats have no quantize rows). Every backend's stage is fed the
reference's inputs, as for a float layer, and judged:

    quantize1/2   exactly: the codes byte for byte and the scales bit for bit (the CuPy
                  quantizers do the reference's fp32 operations in the same order)
    gemm1/2       against the reference's grouped_gemm_quant on the same codes and scales,
                  unrounded (fp32 accumulation, no cast to bf16), within the format's
                  tolerance as vLLM's tests give it (block fp8 0.035 relative, int8 0.065,
                  weight-only 2e-2; sandbox.quant.tolerance)
    end_to_end    the backend's whole quantized layer against the reference's quantized
                  layer (the activation codes may flip where an intermediate rounds
                  differently), within the same tolerance
    dequantized   the reference row only: the quantized layer against its dequantized
                  experts in float64, i.e. what the format costs: "ok" within the format's
                  tolerance times 2 (activation quantization adds its own error to the
                  weights' one), else "info": a format's cost (a static activation scale far
                  from the data, say) is reported, not a divergence of any backend

A backend without the quantized stages (numba, torch) gets its quantize / gemm rows and its
end-to-end row skipped with the reason (registry.QUANT_NOT_IMPLEMENTED).
"""
from __future__ import annotations

import numpy as np

from . import arrays
from .pipeline import _codes
from .quant import FP8, tolerance
from .registry import QUANT_NOT_IMPLEMENTED, QUANT_STAGE_FUNCTIONS, STAGES

DEQUANTIZED = "dequantized"
__all__ = ["DEQUANTIZED", "tolerance", "stage_order", "exact_call", "run_call", "judge"]


def stage_order(layer) -> tuple[str, ...]:
    """The stages of the layer's trace, in order."""
    qc = layer.quant_config
    if qc is None:
        return STAGES
    out = []
    for s in STAGES:
        if s in ("gemm1", "gemm2") and qc.quant_dtype is not None:
            out.append("quantize" + s[-1])
        out.append(s)
    return tuple(out)


def is_quant_call(call) -> bool:
    return getattr(call, "fn", None) in QUANT_STAGE_FUNCTIONS.values()


def asked(stage, stages) -> bool:
    """A quantize stage is judged when its GEMM is."""
    return stage in stages or (stage.startswith("quantize") and "gemm" + stage[-1] in stages)


def missing_detail(backend_name, stage) -> str:
    return QUANT_NOT_IMPLEMENTED.get(backend_name, f"{backend_name} has no "
                                                   f"{QUANT_STAGE_FUNCTIONS[stage]}")


def exact_call(call):
    """The yardstick of a quantized stage: the reference's own output for a quantizer (judged
    exactly), the reference's GEMM unrounded (out_dtype float64) for a GEMM."""
    import reference

    if call.fn == "moe_kernel_quantize_input":
        return call.outputs
    kwargs = dict(call.kwargs, out_dtype=np.float64)
    return reference.grouped_gemm_quant(*call.args, **kwargs)


def run_call(backend, call, fp8):
    """The backend's function of a quantized stage on the reference's inputs, outputs on
    the host (fp8 codes as ml_dtypes e4m3fn)."""
    fn = backend.quant_fn(call.stage)
    args = tuple(_codes(backend, a, fp8) if _is_array(a) else a for a in call.args)
    kwargs = {k: _codes(backend, v, fp8) if _is_array(v) else v
              for k, v in call.kwargs.items()}
    out = fn(*args, **kwargs)
    if isinstance(out, tuple):
        return tuple(_host(backend, v, fp8) for v in out)
    return _host(backend, out, False)


def _is_array(v):
    return arrays.kind(v) not in ("none", "other") and not isinstance(v, np.generic)


def _host(backend, v, fp8):
    if v is None:
        return None
    h = backend.get(v)
    return h.view(FP8) if fp8 and h.dtype == np.uint8 else h


def judge(stage, got, want_exact, want_engine, layer, rows, compare_float) -> dict:
    """The row fields of a quantized stage (see the module docstring)."""
    if stage.startswith("quantize"):
        return _judge_codes(got, want_exact)
    tol = tolerance(layer.quant_config)
    res = compare_float(got, want_exact, want_engine.dtype, rows=rows, tol=tol)
    return dict(status=res["status"], dtype=res["dtype"], tol=res["tol"],
                max_abs_err=res["max_abs_err"], rel_err=res["rel_err"], detail=res["detail"])


def _judge_codes(got, want) -> dict:
    if not isinstance(got, tuple) or len(got) != 2:
        return dict(status="fail", detail="expected (codes, scales)")
    problems = []
    for what, g, w in (("codes", got[0], want[0]), ("scales", got[1], want[1])):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape or g.dtype != w.dtype:
            problems.append(f"{what}: expected {w.dtype}{list(w.shape)}, got "
                            f"{g.dtype}{list(g.shape)}")
            continue
        # bytes, so that fp8 NaN codes and -0 compare as stored
        differ = int(np.count_nonzero(g.view(np.uint8).reshape(g.shape + (-1,))
                                      != w.view(np.uint8).reshape(w.shape + (-1,))))
        if differ:
            problems.append(f"{what}: {differ} differ")
    dtype = str(np.asarray(want[0]).dtype)
    return dict(status="fail" if problems else "ok", dtype=dtype, tol=0.0,
                detail="; ".join(problems) if problems else "exact (codes and scales)")


def dequantized_row(engine_out, exact_out, layer, compare_float) -> dict:
    """The reference's quantized layer against its dequantized experts in float64."""
    tol = 2 * tolerance(layer.quant_config)
    res = compare_float(engine_out, exact_out, layer.params_dtype, tol=tol)
    status = "info" if res["status"] == "fail" else res["status"]
    return dict(status=status, dtype=res["dtype"], tol=res["tol"],
                max_abs_err=res["max_abs_err"], rel_err=res["rel_err"],
                detail=("quantization error: " + layer.quant_config.describe()
                        + ("; " + res["detail"] if res["detail"] else "")))
