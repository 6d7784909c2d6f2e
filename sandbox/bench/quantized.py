"""The quantized layer as bench candidates: `cupy-<scheme>` (and `reference-<scheme>` with
--cpu), one per scheme of sandbox/quant.py's SCHEMES, beside the bf16 layer on the same routings.

    T tokens, E experts, K top-k, H hidden, I intermediate, N a GEMM's output width, Kdim its
    reduction width, G = Kdim / group

    quant_candidate(backend, scheme)   the factory: the case's bf16 weights quantized once per
                                       preset (not timed), then the timed call is the layer's
                                       quantized experts (sandbox.pipeline.quant_experts):
                                       align -> quantize x -> grouped_gemm_quant GEMM1 ->
                                       activation -> quantize -> GEMM2 -> combine
    quant_candidate_names(schemes, device)   --quant fp8_block,w4a16 -> the candidates' names
    torch_quantize(cfg, w)             w [E, N, Kdim] -> (codes, scale, zp) on w's device,
                                       bit for bit reference/quant.py's quantizers
    torch_dequantize(cfg, codes, ...)  one expert's codes -> fp32 [N, Kdim]
    dequantized_loop(...)              the check: the torch per-expert loop on the dequantized
                                       experts (fp32), and the largest GEMM2 input it saw

The check holds a quantized point to its own experts dequantized, at twice vLLM's tolerance
for the format (sandbox.quant.tolerance; twice, because the w8a8 formats also quantize the
activations, which the loop does not: the bound tests/sandbox/test_quant_layer.py uses), not to the
bf16 weights it was quantized from (int4 groups of 128 move a GEMM's output ~10%). The
quantizers run in torch on the case's device because the NumPy ones take minutes on
DeepSeek-V3's 256 experts; tests/sandbox/test_bench_quant.py holds them to the NumPy ones bit for bit.
The quantized codes then live in the layer (host) and its device copies, as a loaded
checkpoint's do. fp8_static's activation scales are calibrated on each point's own batch
(absmax / 448 of x and of GEMM2's input), as a calibration pass would: scales calibrated on
one token clip the activations of 64 (a 10% error at the tiny preset's T = 64).
"""
from __future__ import annotations

import contextlib

import numpy as np

from .candidates import Unavailable, register_candidate
from .cases import Case
from .roofline import floor_format, quant_expert_bytes

QUANT_BACKENDS = ("cupy", "reference")
_GROUP_EPS = 1e-10        # reference/quant.py GROUP_EPS: the absmax floor of every quantizer
_FP8_MAX = 448.0
# (backend, scheme) -> (torch w13, torch w2, the quantized layer): one preset's at a time
_QUANT_LAYERS: dict = {}


def forget_quantized_layers() -> None:
    """Drop the quantized layers (a run holds one preset's at a time)."""
    _QUANT_LAYERS.clear()


def quant_candidate_names(schemes, device: str = "cuda") -> list[str]:
    """The candidates of --quant: `cupy-<scheme>` on a GPU, `reference-<scheme>` with --cpu."""
    from sandbox.quant import SCHEMES

    bad = [s for s in schemes if s not in SCHEMES]
    if bad:
        raise ValueError(f"quant: expected schemes from {', '.join(SCHEMES)}, got {bad}")
    return [f"{'reference' if device == 'cpu' else 'cupy'}-{s}" for s in schemes]


# ----------------------------------------------------------------------------- torch twins
def _round_half_away(x):
    """reference.quant.round_half_away in torch: float64, ties away from zero."""
    import torch

    x = x.double()
    return torch.trunc(x + torch.copysign(torch.full_like(x, 0.5), x))


def torch_quantize(cfg, w):
    """w [E, N, Kdim] (torch, any float dtype, any device) -> (codes, scale f32, zp uint8 or
    None) in cfg's format, the same bits as sandbox.quant.quantize_experts. fp8 codes come
    as their uint8 bytes; int4 codes packed two a byte, low nibble first."""
    import torch

    wf = w.float()
    e, n, k = wf.shape
    if cfg.weight_only:
        bits = 4 if cfg.weight_dtype == "int4" else 8
        qmax, gs = (1 << bits) - 1, cfg.group_size
        wg = wf.reshape(e, n, k // gs, gs)                                    # [E, N, G, gs]
        if cfg.has_zp:
            lo = wg.amin(dim=3).clamp_max(0)
            hi = wg.amax(dim=3).clamp_min(0)
            s = (hi - lo).clamp_min(_GROUP_EPS) / qmax                        # [E, N, G]
            zp = _round_half_away(-lo / s).clamp(0, qmax)
            zpf, zp = zp[..., None], zp.to(torch.uint8)
        else:
            s = wg.abs().amax(dim=3).clamp_min(_GROUP_EPS) / (qmax // 2)
            zp, zpf = None, float(8 if bits == 4 else 128)
        q = (_round_half_away(wg / s[..., None]) + zpf).clamp(0, qmax).to(torch.uint8)
        q = q.reshape(e, n, k)
        if bits == 4:
            q = q[..., 0::2] | (q[..., 1::2] << 4)
        return q.contiguous(), s.contiguous(), zp
    qmax = _FP8_MAX if cfg.weight_dtype == "fp8" else 127
    g = cfg.weight_granularity
    a = wf.abs()
    if g == "tensor":
        s = a.reshape(e, -1).amax(dim=1).clamp_min(_GROUP_EPS) / qmax         # [E]
        full = s[:, None, None]
    elif g == "channel":
        s = a.amax(dim=2).clamp_min(_GROUP_EPS) / qmax                        # [E, N]
        full = s[:, :, None]
    else:
        bn, bk = cfg.block_shape
        s = a.reshape(e, n // bn, bn, k // bk, bk).amax(dim=(2, 4)).clamp_min(_GROUP_EPS) / qmax
        full = s.repeat_interleave(bn, 1).repeat_interleave(bk, 2)           # [E, N, Kdim]
    y = wf / full
    if cfg.weight_dtype == "fp8":
        q = y.clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        q = torch.nan_to_num(_round_half_away(y).clamp(-128, 127), nan=0.0).to(torch.int8)
    return q.contiguous(), s.contiguous(), None


def torch_dequantize(cfg, codes, scale, zp=None):
    """One expert's codes [N, Kdim (/2 for int4)] (fp8 as uint8 bytes) with its scale (and
    zero points) -> fp32 [N, Kdim], as reference.quant.dequantize_weight."""
    import torch

    if cfg.weight_dtype == "fp8":
        q = codes.view(torch.float8_e4m3fn).float()
    elif cfg.weight_dtype == "int4":
        q = torch.stack((codes & 0xF, codes >> 4), dim=-1).reshape(codes.shape[0], -1).float()
    else:
        q = codes.float()
    if cfg.weight_only:
        gs = cfg.group_size
        z = (zp.float().repeat_interleave(gs, 1) if zp is not None
             else float(8 if cfg.weight_dtype == "int4" else 128))
        return (q - z) * scale.float().repeat_interleave(gs, 1)
    g = cfg.weight_granularity
    if g == "tensor":
        return q * scale.float().reshape(())
    if g == "channel":
        return q * scale.float().reshape(-1, 1)
    bn, bk = cfg.block_shape
    return q * scale.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)


def dequantized_loop(cfg, x, experts, topk_weights, topk_ids):
    """out [T, H] fp32 = sum_k w[t, k] * (silu(g) * u)(x[t] @ W13[e].T) @ W2[e].T over the
    experts dequantized one at a time (`experts(e)` -> (W13 [2I, H], W2 [H, I]) fp32), the
    dumbest loop; and the largest |GEMM2 input| (fp8_static's calibration)."""
    import torch

    xf = x.float()
    out = torch.zeros_like(xf)
    amax = 0.0
    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.where(topk_ids == e)
        w13, w2 = experts(e)
        g, u = (xf[tok] @ w13.T).chunk(2, dim=-1)
        h = torch.nn.functional.silu(g) * u                                    # [n_e, I]
        amax = max(amax, float(h.abs().max()))
        out.index_add_(0, tok, (h @ w2.T) * topk_weights[tok, slot, None])
    return out, amax


# ----------------------------------------------------------------------------- the candidates
def _as_torch(a, device):
    """A backend's array (NumPy on the host, CuPy on the GPU) as a torch tensor on `device`
    (CuPy: zero-copy through DLPack; fp8 codes are uint8 bytes there, ml_dtypes here)."""
    import torch

    if isinstance(a, (np.ndarray, np.generic)):      # a per-tensor scale is a NumPy scalar
        a = np.asarray(a)
        return torch.from_numpy(a.view(np.uint8) if a.dtype.name == "float8_e4m3fn"
                                else a).to(device)
    return torch.from_dlpack(a)


def _quantized_layer(case: Case, backend: str, scheme: str):
    """The FusedMoE of the case's preset in `scheme`, its experts quantized from the case's
    weights (on the case's device, a few experts at a time), cached per preset."""
    import torch

    from sandbox import FusedMoE, arrays

    hit = _QUANT_LAYERS.get((backend, scheme))
    if hit is not None and hit[0] is case.w13 and hit[1] is case.w2:
        return hit[2]
    _QUANT_LAYERS.pop((backend, scheme), None)
    p = case.preset
    dtype = {torch.bfloat16: arrays.BF16, torch.float16: np.dtype(np.float16)}.get(
        case.dtype, np.dtype(np.float32))
    layer = FusedMoE(p.num_experts, p.top_k, p.hidden_size, p.intermediate_size,
                     params_dtype=dtype, quant_config=scheme)
    cfg = layer.quant_config
    chunk = max(1, (1 << 28) // (3 * p.hidden_size * p.intermediate_size))  # ~1 GiB of fp32
    for base, w in (("w13", case.w13), ("w2", case.w2)):
        codes = getattr(layer, f"{base}_weight")
        codes = codes.view(np.uint8) if cfg.weight_dtype == "fp8" else codes
        for e0 in range(0, p.num_experts, chunk):
            q, s, z = torch_quantize(cfg, w[e0:e0 + chunk])
            codes[e0:e0 + chunk] = q.cpu().numpy().view(codes.dtype)
            getattr(layer, f"{base}_weight_scale")[e0:e0 + chunk] = s.cpu().numpy()
            if z is not None:
                getattr(layer, f"{base}_weight_zero_point")[e0:e0 + chunk] = z.cpu().numpy()
    layer.invalidate_device_cache()
    _QUANT_LAYERS[(backend, scheme)] = (case.w13, case.w2, layer)
    return layer


def quant_candidate(backend: str, scheme: str):
    """The factory of `<backend>-<scheme>`: see the module docstring."""
    def factory(case: Case):
        return _quant_fn(case, backend, scheme)
    factory.__doc__ = f"the quantized layer's experts in {scheme} on {backend}"
    return factory


def _quant_fn(case: Case, backend: str, scheme: str):
    from sandbox import arrays, pipeline, registry, streams
    from sandbox import quant as Q

    if backend == "cupy" and case.device == "cpu":
        raise Unavailable("the CuPy kernels run on CUDA only")
    if backend == "reference" and case.device != "cpu":
        raise Unavailable("the NumPy reference is timed with --cpu only")
    be = registry.get_backend(backend)
    if not be.ok:
        raise Unavailable(be.reason)
    for stage in registry.QUANT_STAGES:
        if not be.has_quant_stage(stage):
            raise Unavailable(f"{backend} has no {registry.QUANT_STAGE_FUNCTIONS[stage]}")
    layer = _quantized_layer(case, backend, scheme)
    cfg = layer.quant_config
    mapping = {s: backend for s in registry.STAGES}
    run = pipeline.start(mapping)
    block = pipeline.block_size_for(layer, mapping, case.num_tokens)

    def expert(e):
        # the layer's own device copies (cached per load, as the timed call reads them)
        # viewed in torch: the check moves no weights
        def one(name):
            a = getattr(layer, name) if be.is_host else layer.param_for(name, be)
            return None if a is None else _as_torch(a[e], case.device)
        return tuple(torch_dequantize(cfg, one(f"{b}_weight"), one(f"{b}_weight_scale"),
                                      one(f"{b}_weight_zero_point")) for b in ("w13", "w2"))

    expected, act_amax = dequantized_loop(cfg, case.x, expert, case.topk_weights, case.topk_ids)
    if cfg.static_input_scale:       # calibrated on this batch (timing does not depend on it)
        layer.w13_input_scale[:] = float(case.x.float().abs().max()) / _FP8_MAX
        layer.w2_input_scale[:] = act_amax / _FP8_MAX
        layer.invalidate_device_cache()
    if be.is_host:
        # the routing's NumPy views share the torch tensors' memory: redraw() reaches them
        x, tw, ti = (be.take(case.x), case.topk_weights.numpy(), case.topk_ids32.numpy())
        on_stream = contextlib.nullcontext
    else:
        x = be.take(case.x)          # bf16 through the host, once (not timed)
        tw = arrays.zero_copy(case.topk_weights, be.array_kind)
        ti = arrays.zero_copy(case.topk_ids32, be.array_kind)
        if tw is None or ti is None:
            raise Unavailable(f"the routing buffers cannot be shared with {backend} "
                              f"without a copy")
        on_stream = streams.torch_stream_for_cupy

    def fn():
        with on_stream():
            return pipeline.quant_experts(layer, run, x, tw, ti, block)               # [T, H]
    fn.to_host = be.get
    fn.expected = expected
    fn.check_tolerance = 2 * Q.tolerance(cfg)
    fn.check_against = "its experts dequantized"
    fn.expert_bytes = quant_expert_bytes(cfg, case.preset.hidden_size,
                                         case.preset.intermediate_size)
    fn.floor_format = floor_format(cfg)
    fn.point_fields = {"quant": scheme, "bf16_peer": backend}
    return fn


def _register_quant_candidates() -> tuple[str, ...]:
    """`cupy-<scheme>` and `reference-<scheme>` for every scheme of sandbox.quant.SCHEMES."""
    from sandbox.quant import SCHEMES

    names = []
    for backend in QUANT_BACKENDS:
        for scheme in SCHEMES:
            names.append(f"{backend}-{scheme}")
            register_candidate(names[-1], quant_candidate(backend, scheme))
    return tuple(names)


# timed only when asked by name or --quant (each quantizes a preset's experts first)
QUANT_CANDIDATES = _register_quant_candidates()
