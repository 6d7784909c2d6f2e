"""A decode step's experts in one launch (experts_decode.cu): GEMM1 + activation, a grid
barrier, GEMM2 + router weight + combine.

    T <= MAX_TOKENS tokens, K top-k, P = T*K slots, E experts, H hidden, I intermediate

experts.ExpertsPlan runs this instead of its five stage kernels when `eligible(...)` says so:
a decode batch of at most CONFIGS["decode"]["MAX_TOKENS"] tokens (the largest T measured faster
than the stages: the notes above CONFIGS), a gated
silu / gelu / gelu_tanh, the router weight applied to the output, no expert map, H and I
multiples of 8, 16-byte aligned arrays, and c2 [P, I] small enough to stage in shared memory.
The roundings are the stages'; the sums are in another order (fp32 fma per lane, then a warp
sum, not the tensor cores'), so the output matches the stages to bf16 rounding, not bit for bit.

Launch: one block of DEC_THREADS per SM, cooperative (the grid barrier); shared memory
P I (c2) + 8 P (ids, weights) + 4 cdiv(H, G) P (the pairs' c3) bytes; the barrier word is
align.py's, one per device and stream.
"""
from __future__ import annotations

import numpy as np

from . import _arrays as A
from . import _compile as C
from ._geometry import cdiv
from ._launch import FastLaunch

CU = "experts_decode.cu"
# MAX_TOKENS: the largest decode batch run here; U1, U2: 16-byte loads in flight per lane per
# row (phase 1: of each of the gate and up rows; phase 2: of each pair); PHASE2_LOADS: the
# loads in flight per lane phase 2 aims at (pairs_for); PREFETCH: bytes of phase-2 weights per
# block pulled into L2 at the start. Measured on an H100 SXM against
# the five stage kernels and vLLM in one process (CUDA graphs, median ms): one launch wins at
# T = 1 (Qwen3-30B-A3B 0.044 against 0.058-0.063; Mixtral and DeepSeek-V3 tie) and loses from
# T = 2 on the large models (Mixtral 0.50 against 0.47, DeepSeek-V3 0.49 against 0.48);
# without PREFETCH the large models ran 1.1-1.5% slower, and a second prefetch once phase 1
# is done (128 KB or 1 MB a block) gained nothing; 16 loads a lane in phase 2 spilled (Qwen3
# 0.061-0.067); 1024 threads with 4 loads a lane ran 1-2% faster than 512 with 8 on the
# large models (Mixtral 0.2613 against 0.2638, DeepSeek-V3 0.2622 against 0.2681).
CONFIGS = {"decode": {"MAX_TOKENS": 1, "DEC_THREADS": 1024, "U1": 4, "U2": 4,
                      "PHASE2_LOADS": 4, "PREFETCH": 65536}}
ACTS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
PAIRS_CHOICES = (1, 2, 4)
SHARED_LIMIT = 200 * 1024          # of the 227 KB an sm_90 block may opt in to
_NAMES = tuple(f"moe_decode_kernel<{a}, {p}>" for a in ACTS.values() for p in PAIRS_CHOICES)
SIG = "pppppppp" + "iiiii"          # x, w1, w2, tw, ids, c2, out, bar | T, K, E, H, I


def _defines(dtype) -> dict:
    cfg = CONFIGS["decode"]
    return {"SCALAR_T": A.ctype_of(dtype),
            **{k: cfg[k] for k in ("DEC_THREADS", "U1", "U2", "PREFETCH")}}


for _dt in (np.dtype(np.float16), A.bf16_dtype()):
    C.register_compile_case(CU, _defines(_dt), _NAMES)


def pairs_for(I: int) -> int:  # noqa: E741
    """Phase 2's pairs per warp at once: enough rows that a lane has about PHASE2_LOADS loads
    in flight (Qwen3's I = 768 gives 3 steps a lane per row: one pair for 4 loads, two for 8)."""
    cfg = CONFIGS["decode"]
    steps = min(cfg["U2"], cdiv(I // 8, 32))
    want = max(1, cfg["PHASE2_LOADS"] // max(steps, 1))
    return max(p for p in PAIRS_CHOICES if p <= want)


def shared_bytes(P: int, H: int, I: int, G: int, itemsize: int) -> int:  # noqa: E741
    return P * I * itemsize + 8 * P + 4 * cdiv(H, G) * P


def eligible(T, K, H, I, dtype, activation, mul_on_input, expert_map, aligned,  # noqa: E741
             G) -> bool:
    """Whether a fused_experts call of this shape runs here (module docstring)."""
    return (1 <= T <= CONFIGS["decode"]["MAX_TOKENS"] and activation in ACTS
            and not mul_on_input and not expert_map and aligned and H % 8 == 0
            and I % 8 == 0 and I > 0 and np.dtype(dtype) in (np.dtype(np.float16), A.bf16_dtype())
            and shared_bytes(T * K, H, I, G, np.dtype(dtype).itemsize) <= SHARED_LIMIT)


def decode_launch(T, K, E, H, I, dtype, activation, G) -> FastLaunch:  # noqa: E741
    """The cooperative launch of the kernel for this shape on the current device; called as
    launch(stream, x, w1, w2, topk_weights, topk_ids, c2, out, barrier_word)."""
    name = f"moe_decode_kernel<{ACTS[activation]}, {pairs_for(I)}>"
    kern = C.get_kernel(CU, name, _defines(dtype), _NAMES)
    smem = shared_bytes(T * K, H, I, G, np.dtype(dtype).itemsize)
    if smem > 48 * 1024:
        kern.max_dynamic_shared_size_bytes = smem
    threads = CONFIGS["decode"]["DEC_THREADS"]
    return FastLaunch(kern, (G,), (threads,), smem, SIG, cooperative=True,
                      fixed={8: T, 9: K, 10: E, 11: H, 12: I})
