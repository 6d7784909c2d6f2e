"""What a run times: every candidate by name, each a factory of a call on one Case.

    CANDIDATES         name -> factory(case) -> fn(): cupy (our fused_experts), numba,
                       torch-stages (a backend's stages composed); the peers: vllm-triton
                       (vLLM's kernel, loaded from --peers), torch per-expert loop,
                       torch._grouped_mm; the NumPy reference (--cpu only)
    register_candidate(name, factory)   adds one (a kernel issue's ladder rung, a backend)
    backend_candidate(backend)          a registry backend's stages, composed (no routing)
    load_vllm_triton(peers_dir)         vLLM's Triton fused-MoE kernel, imported at run time
                                        from `<peers>/vllm_triton/peer.py`
    Unavailable                         what a factory raises when it cannot run here

The CuPy backend (on torch's stream, sandbox.streams), vLLM's Triton peer and
torch._grouped_mm capture in a CUDA graph; the torch per-expert loop (torch.where) records
the capture error instead of a time.
"""
from __future__ import annotations

import contextlib
import pathlib
from typing import Any, Callable

import numpy as np

from .cases import Case
from .results import REPO_ROOT
from .torch_peers import has_grouped_mm, torch_grouped_mm_moe, torch_per_expert_loop

UNAVAILABLE = "not available here"
# what `moe-sandbox bench` times on a GPU unless told: our best rung and the two peers a
# researcher would pick instead
GPU_CANDIDATES = ("cupy", "vllm-triton", "torch-grouped_mm")

class Unavailable(Exception):
    """Raised by a candidate factory that cannot run here; the message says why."""


# name -> factory(case) -> fn() returning [T, H]; the factory returns None or raises
# Unavailable(reason) when the candidate cannot run here
CANDIDATES: dict[str, Callable[[Case], Callable[[], Any] | None]] = {}


def register_candidate(name: str, factory: Callable[[Case], Callable[[], Any] | None]) -> None:
    """Add a timed candidate (a kernel issue's ladder rung, a backend, a peer)."""
    CANDIDATES[name] = factory


register_candidate("torch-loop", lambda c: lambda: torch_per_expert_loop(
    c.x, c.w13, c.w2, c.topk_weights, c.topk_ids))


def _grouped_mm_factory(case: Case):
    if not has_grouped_mm():
        raise Unavailable("this torch has no torch._grouped_mm")
    return lambda: torch_grouped_mm_moe(case.x, case.w13, case.w2, case.topk_weights,
                                        case.topk_ids)


register_candidate("torch-grouped_mm", _grouped_mm_factory)


def _reference_factory(case: Case):
    """The NumPy reference on the host (only sensible with --cpu)."""
    if case.device != "cpu":
        raise Unavailable("the NumPy reference is timed with --cpu only")
    import reference

    x, w13, w2 = (t.float().numpy() for t in (case.x, case.w13, case.w2))
    return lambda: reference.fused_experts(x, w13, w2, case.topk_weights.numpy(),
                                           case.topk_ids.numpy().astype(np.int32))


register_candidate("reference", _reference_factory)


def backend_candidate(backend: str):
    """A candidate that runs `backend`'s stages (sandbox.registry) on the case's routing:
    align -> gemm1 -> activation -> gemm2 -> combine, the layer without its route stage
    (what vLLM's fused_experts does). Unavailable here (None) when the backend is not, or
    lacks one of those stages."""
    def factory(case: Case):
        return _stages_fn(case, backend)
    factory.__doc__ = f"the {backend} backend's stages, composed (no routing)"
    return factory


_MOVED_WEIGHTS: dict = {}   # backend -> (torch w13, torch w2, its w13, its w2)


def forget_moved_weights() -> None:
    """Drop the weights moved to the backends (a run holds one preset's at a time)."""
    _MOVED_WEIGHTS.clear()


def _stages_fn(case: Case, backend: str):
    from sandbox import arrays, registry, streams

    be = registry.get_backend(backend)
    if not be.ok:
        raise Unavailable(be.reason)
    for s in ("align", "gemm1", "activation", "gemm2", "combine"):
        if not be.has_stage(s):
            raise Unavailable(f"{backend} has no {registry.STAGE_FUNCTIONS[s]} yet")
    T, K, H = case.num_tokens, case.preset.top_k, case.preset.hidden_size
    E, I = case.preset.num_experts, case.preset.intermediate_size  # noqa: E741
    # weights and x move once (through the host for bf16, which CUDA array interfaces
    # cannot describe); the routing buffers must be zero-copy views, because redraw()
    # rewrites them in place between reps
    x = be.take(case.x)
    hit = _MOVED_WEIGHTS.get(backend)
    if hit is not None and hit[0] is case.w13 and hit[1] is case.w2:
        w13, w2 = hit[2], hit[3]
    else:           # move a preset's weights once, not at every token count
        _MOVED_WEIGHTS.pop(backend, None)
        w13, w2 = be.take(case.w13), be.take(case.w2)
        _MOVED_WEIGHTS[backend] = (case.w13, case.w2, w13, w2)
    if be.is_host:
        tw, ti = be.take(case.topk_weights), be.take(case.topk_ids32)
        if arrays.kind(tw) != "torch" and case.device != "cpu":
            raise Unavailable(f"{backend} computes on the host, the case is on {case.device}")
    else:
        tw = arrays.zero_copy(case.topk_weights, be.array_kind)
        ti = arrays.zero_copy(case.topk_ids32, be.array_kind)
        if tw is None or ti is None:
            raise Unavailable(f"the routing buffers cannot be shared with {backend} "
                              f"without a copy")
    # the alignment block is the GEMM's BLOCK_M for this shape (as the layer asks it: M = T)
    cfg = be.gemm_config(T, 2 * I, H, E, K, arrays.dtype_of(case.x))
    block = int(cfg["BLOCK_M"]) if cfg and cfg.get("BLOCK_M") else be.default_block_size
    align, gemm = be.stage_fn("align"), be.stage_fn("gemm1")
    act, combine = be.stage_fn("activation"), be.stage_fn("combine")

    # the case is torch's: the GPU backends run on torch's stream and allocator, which is
    # what a torch caller and a torch.cuda.graph capture need (sandbox.streams)
    on_stream = (streams.torch_stream_for_cupy if case.device != "cpu" and not be.is_host
                 else contextlib.nullcontext)

    def fn():
        with on_stream():
            sorted_ids, expert_ids, ntpp = align(ti, block, E)
            c1 = gemm(x, w13, sorted_ids, expert_ids, ntpp, K, block, tw, False, None)  # [P, 2I]
            c2 = act(c1, "silu", True)                                                  # [P, I]
            c3 = gemm(c2, w2, sorted_ids, expert_ids, ntpp, 1, block, tw, True, None)   # [P, H]
            return combine(c3.reshape(T, K, H))                                         # [T, H]
    fn.to_host = be.to_host      # the check reads the output the backend's way (bf16 bits)
    return fn


def _cupy_factory(case: Case):
    """Our best rung: the CuPy backend's fused_experts (align .. combine, the stages' own
    kernels launched from a plan cached per shape) on the case's torch tensors, on torch's
    stream: no copies, no routing."""
    if case.device == "cpu":
        raise Unavailable("the CuPy kernels run on CUDA only")
    from sandbox import registry

    be = registry.get_backend("cupy")
    if not be.ok:
        raise Unavailable(be.reason)
    from cuda_kernels.cupy.experts import fused_experts, plan_of

    args = (case.x, case.w13, case.w2, case.topk_weights, case.topk_ids32)

    def fn():
        return fused_experts(*args)

    # the rungs the plan runs, and whether this card's table measured them (untuned_note)
    plan = plan_of(*args)
    fn.point_fields = {"rungs": list(plan.versions), "rungs_tuned": plan.rungs_tuned}
    return fn


register_candidate("cupy", _cupy_factory)
register_candidate("numba", backend_candidate("numba"))
register_candidate("torch-stages", backend_candidate("torch"))


# ----------------------------------------------------------------------------- the vLLM peer

def default_peers_dir() -> pathlib.Path | None:
    """Where the measuring instruments live: `.peers/` in the checkout (a copy, as on the GPU
    machine), else `../shared/peers` beside it; None when neither exists."""
    for path in (REPO_ROOT / ".peers", REPO_ROOT.parent / "shared" / "peers"):
        if (path / "vllm_triton" / "peer.py").is_file():
            return path
    return None


PEERS_DIR: list = [None]     # set by `moe-sandbox bench --peers DIR` (None: the default)


def load_vllm_triton(peers_dir=None):
    """vLLM's Triton fused-MoE kernel, the peer every vLLM user runs, imported at run time
    from `peers_dir/vllm_triton/peer.py` (never copied into this project). Raises
    Unavailable with the reason when it cannot be imported here."""
    import importlib.util
    import sys

    root = pathlib.Path(peers_dir or PEERS_DIR[0] or default_peers_dir() or "")
    path = root / "vllm_triton" / "peer.py"
    if not path.is_file():
        raise Unavailable(f"no vLLM Triton peer at {path} (pass --peers DIR)")
    name = "moe_sandbox_peer_vllm_triton"
    mod = sys.modules.get(name)
    if mod is not None and getattr(mod, "__file__", None) == str(path):
        return mod
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except Exception as exc:          # triton missing or too old, most often
        raise Unavailable(f"the vLLM Triton peer does not import here: "
                          f"{error_text(exc)}") from None
    sys.modules[name] = mod
    return mod


def _vllm_triton_factory(case: Case):
    """vLLM's fused_experts kernels on the case (bf16/fp16 on CUDA only). As the peer's README
    says, its expert assignment is made outside the timed call: the timed call is its GEMM1,
    silu_and_mul, GEMM2 and top-k sum (ours is timed from align on). The assignment is made
    again after every redraw of the routing (`Case.after_redraw`, into the buffers its call
    and a captured graph read), so each rep runs the routing ours runs, and the experts it
    reads are the ones the point's `touched_experts` counts."""
    if case.device == "cpu":
        raise Unavailable("the vLLM Triton peer runs on CUDA only")
    peer = load_vllm_triton()
    run = peer.fused_experts_runner(case.x, case.w13, case.w2, case.topk_weights,
                                    case.topk_ids32)
    case.after_redraw.append(_assignment_refresh(run, case))
    fn = lambda: run()  # noqa: E731
    fn.config_source = getattr(run, "config_source", "")
    return fn


def _assignment_refresh(run, case: Case):
    """A callable that remakes the peer runner's expert assignment from the case's current
    routing, in place. The peer keeps it in its pipeline (found through the runner's
    closure): sorted ids, expert ids and the padded count of vLLM's moe_align_block_size, or,
    at decode sizes, vLLM's naive assignment, a view of topk_ids itself (nothing to remake)."""
    pipe = None
    for cell in getattr(run, "__closure__", None) or ():
        owner = getattr(cell.cell_contents, "__self__", None)
        if all(hasattr(owner, a) for a in ("align_only", "sorted_ids", "expert_ids", "ntpp",
                                            "naive", "topk_ids", "topk_weights")):
            pipe = owner
    if pipe is None:
        raise Unavailable("the vLLM Triton peer's runner does not show its expert assignment: "
                          "it could not follow the redrawn routings")
    if (pipe.topk_ids.data_ptr() != case.topk_ids32.data_ptr()
            or pipe.topk_weights.data_ptr() != case.topk_weights.data_ptr()):
        raise Unavailable("the vLLM Triton peer copied the routing buffers: it could not "
                          "follow the redrawn routings")

    def refresh():
        if pipe.naive:
            return
        for buf, new in zip((pipe.sorted_ids, pipe.expert_ids, pipe.ntpp), pipe.align_only()):
            buf.copy_(new)
    return refresh


register_candidate("vllm-triton", _vllm_triton_factory)


def error_text(exc: BaseException) -> str:
    """An exception in one line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
