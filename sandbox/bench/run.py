"""The run: every (preset, T, candidate) point checked against the torch loop, then timed.

    run_bench(...)      build each point's inputs, check the candidate's output once
                        (relative Frobenius error in fp32, <= 5e-2; a quantized candidate
                        against its experts dequantized, at its format's tolerance), then
                        time it with the routing re-drawn every rep (time_cuda, plus
                        time_host when eager); returns the JSON-able record
                        (results.write_results)
    add_ratios(points)  each point's median over vllm-triton's and torch-grouped_mm's (and a
                        quantized point's over our bf16 layer's, vs_cupy)

A point carries its Stats, the bytes and flops of its napkin math (roofline.py) and, on a
card of known limits, its floor and the fraction of it; a time under the floor is an error.
A quantized point (quantized.py) also carries its scheme ("quant"), its bytes in its format
(codes, scales, zero points) and a floor at its format's peak ("floor_format").
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .candidates import CANDIDATES, UNAVAILABLE, Unavailable, error_text, forget_moved_weights
from .quantized import QUANT_CANDIDATES, forget_quantized_layers
from .cases import DEFAULT_TOKENS, GPU_PRESETS, PRESETS, Case, ModelPreset, make_case, make_weights
from .roofline import card_limits, expert_bytes, fraction_of_floor, moe_flops, roofline_floor
from cuda_kernels.timing import cuda_api, time_cpu, time_cuda, time_host
from .torch_peers import torch_per_expert_loop


def run_bench(presets=GPU_PRESETS, tokens=DEFAULT_TOKENS, candidates=None, device="cuda",
              dtype=None, warmup: int = 10, reps: int = 50, graph: bool = False,
              flush_l2: bool = True, routing: str = "uniform", seed: int = 0,
              progress: Callable | None = None, card: dict | None = None) -> dict:
    """Every (preset, T, candidate): build inputs, check the candidate's output once against
    the torch per-expert loop (relative Frobenius error in fp32), then time it with the
    routing re-drawn every rep. Returns the JSON-able record (see `write_results`)."""
    import torch

    candidates = list(candidates or default_candidates())
    unknown = [c for c in candidates if c not in CANDIDATES]
    if unknown:
        raise ValueError(f"candidates: expected names from {sorted(CANDIDATES)}, got {unknown}")
    api = cuda_api() if device != "cpu" else None
    if device != "cpu" and api is None:
        raise RuntimeError("run_bench: expected a CUDA device, found none")
    device_name = "cpu" if device == "cpu" else torch.cuda.get_device_name()
    limits = None if device == "cpu" else card_limits(device_name)
    points = []
    plan = [(PRESETS[p] if isinstance(p, str) else p, t) for p in presets for t in tokens]
    bar = progress(total=len(plan) * len(candidates)) if progress else None
    weights = {}
    for preset, T in plan:
        try:
            if preset.name not in weights:          # one preset's weights at a time
                weights.clear()
                forget_moved_weights()
                forget_quantized_layers()
                if device != "cpu":
                    torch.cuda.empty_cache()
                weights[preset.name] = make_weights(preset, device, dtype, seed)
            case = make_case(preset, T, device, dtype, routing, seed, weights[preset.name])
        except Exception as exc:  # out of memory at the largest points, most often
            for name in candidates:
                points.append(_point(preset, T, name, error=f"inputs: {error_text(exc)}"))
                if bar:
                    bar.update(1)
            continue
        wbytes = case.w13.element_size()
        # the check runs on the first routing; timing re-draws it, so keep a copy to restore
        first = (case.topk_weights.clone(), case.topk_ids.clone())
        with torch.inference_mode():
            expected = torch_per_expert_loop(case.x, case.w13, case.w2, case.topk_weights,
                                             case.topk_ids).float()
        for name in candidates:
            if bar:
                bar.set_description(f"{preset.name} T={T} {name}")
            case.topk_weights.copy_(first[0])
            case.topk_ids.copy_(first[1])
            case.topk_ids32.copy_(first[1])
            point = _time_candidate(case, name, expected, api, warmup, reps, graph, flush_l2,
                                    wbytes, limits, device_name)
            points.append(point)
            if bar:
                bar.update(1)
        del case, expected
    weights.clear()
    forget_moved_weights()
    forget_quantized_layers()
    if bar:
        bar.close()
    add_ratios(points)
    return {"benchmark": "fused MoE experts (no routing), end to end",
            "device": device_name, "card": card,
            "dtype": str(dtype or ("bfloat16" if device != "cpu"
                                   else "float32")).replace("torch.", ""),
            "routing": routing, "seed": seed, "warmup": warmup, "reps": reps, "graph": graph,
            "flush_l2": flush_l2,
            "peak_bandwidth": limits[0] if limits else None,
            "peak_flops": limits[1] if limits else None,
            "points": points}


RATIO_PEERS = ("vllm-triton", "torch-grouped_mm")


def default_candidates() -> list[str]:
    """What run_bench times unless told: every candidate but the quantized ones, which are
    asked for by name or --quant (each quantizes a preset's experts first)."""
    return [c for c in CANDIDATES if c not in QUANT_CANDIDATES]


def add_ratios(points: list) -> None:
    """Each timed point's median over the median of each peer of RATIO_PEERS at the same
    (model, T), as `vs_<peer>` (< 1: faster than the peer); a quantized point's also over
    its backend's bf16 layer (`bf16_peer`: vs_cupy)."""
    medians = {(p["model"], p["T"], p["candidate"]): p["stats"]["median"]
               for p in points if "stats" in p}
    for p in points:
        if "stats" not in p:
            continue
        for peer in RATIO_PEERS + ((p["bf16_peer"],) if "bf16_peer" in p else ()):
            ref = medians.get((p["model"], p["T"], peer))
            if ref:
                p[f"vs_{peer}"] = p["stats"]["median"] / ref


def _time_candidate(case: Case, name: str, expected, api, warmup, reps, graph, flush_l2,
                    wbytes, limits=None, device_name=None) -> dict:
    import torch

    preset, T = case.preset, case.num_tokens
    case.after_redraw.clear()          # a candidate's hooks are its own
    try:
        fn = CANDIDATES[name](case)
    except Unavailable as exc:
        return _point(preset, T, name, error=f"{UNAVAILABLE}: {exc}")
    except Exception as exc:
        return _point(preset, T, name, error=f"setup: {error_text(exc)}")
    if fn is None:
        return _point(preset, T, name, error=UNAVAILABLE)
    # a quantized candidate brings its own check (its experts dequantized, its format's
    # tolerance), its format's bytes per expert and the tensor cores its flops run on
    extra = getattr(fn, "point_fields", {})
    expected = getattr(fn, "expected", expected)
    tol = getattr(fn, "check_tolerance", 5e-2)
    against = getattr(fn, "check_against", "the torch loop")
    try:
        with torch.inference_mode():
            out = fn()
            host = getattr(fn, "to_host", None)
            got = _to_torch(host(out) if host else out).float().to(expected.device)
        rel = float(torch.linalg.vector_norm(got - expected)
                    / torch.linalg.vector_norm(expected).clamp_min(1e-30))
        case.touched.clear()
        if not rel <= tol:                # NaN fails too: a wrong answer is never timed
            return _point(preset, T, name, **extra, rel_err=rel,
                          error=f"check: relative error {rel:.3g} against {against} "
                                f"(tolerance {tol:.3g})")
        host = None
        with torch.inference_mode():
            if api is None:
                stats = time_cpu(fn, warmup=min(warmup, 2), reps=reps, rotate=case.redraw)
            else:
                stats = time_cuda(fn, warmup=warmup, reps=reps, rotate=case.redraw,
                                  flush_l2=flush_l2, graph=graph, api=api)
                if not graph:
                    host = time_host(fn, reps=min(reps, 20), rotate=case.redraw, api=api)
    except Exception as exc:
        return _point(preset, T, name, **extra, error=f"run: {error_text(exc)}")
    touched = float(np.mean(case.touched[-reps:])) if case.touched else float("nan")
    per_expert = getattr(fn, "expert_bytes", None) or expert_bytes(
        preset.hidden_size, preset.intermediate_size, wbytes)
    nbytes = touched * per_expert
    flops = moe_flops(T, preset.top_k, preset.hidden_size, preset.intermediate_size)
    sec = stats.median * 1e-3
    fields = dict(**extra, stats=stats.as_dict(), rel_err=rel, touched_experts=touched,
                  bytes=nbytes, flops=flops, TBps=nbytes / sec / 1e12,
                  TFLOPs=flops / sec / 1e12)
    if hasattr(fn, "floor_format"):      # the format's own peak (fp8 / int8 tensor cores)
        fields["floor_format"] = fn.floor_format
        limits = card_limits(device_name, fn.floor_format) if api is not None else None
    if host is not None:
        fields["host_us"] = host.median
    if limits is not None:              # a floor only for a card whose limits are known
        floor = roofline_floor(nbytes, flops, *limits)
        fields.update(floor_ms=floor * 1e3, fraction_of_floor=fraction_of_floor(sec, floor))
        if sec < floor:
            # nothing runs faster than the card's datasheet limits: the timing is broken
            # (work on another stream, a graph that captured nothing), not a result
            return _point(preset, T, name, **fields,
                          error=f"timing: {stats.median:.4f} ms is faster than the roofline "
                                f"floor {floor * 1e3:.4f} ms (a broken measurement)")
    return _point(preset, T, name, **fields)


def _point(preset: ModelPreset, T: int, name: str, **fields) -> dict:
    return {"model": preset.name, "E": preset.num_experts, "K": preset.top_k,
            "H": preset.hidden_size, "I": preset.intermediate_size, "T": T, "candidate": name,
            **fields}


def _to_torch(out):
    import torch

    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, np.ndarray):
        return torch.from_numpy(np.asarray(out, dtype=np.float32))
    try:
        return torch.from_dlpack(out)
    except Exception:                      # numba device arrays: __cuda_array_interface__
        return torch.as_tensor(out, device="cuda")


def tqdm_or_none():
    """tqdm's class when it is installed (a progress bar on long runs), else None."""
    try:
        from tqdm import tqdm
        return tqdm
    except ImportError:
        return None
