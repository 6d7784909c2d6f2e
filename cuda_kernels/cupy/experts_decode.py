"""A decode step's experts in one launch: GEMM1 + activation, a grid barrier, GEMM2 + router
weight + combine, in two rungs (one math, the same bits):

    rung 1  experts_decode.cu       16-byte loads per lane, the rows split evenly over the SMs
    rung 2  experts_decode_ring.cu  bulk copies into a shared-memory ring fed by a producer
                                    warp, phase 1's rows taken from a counter (sm_90)

`decode_launch` takes rung 2 where a block has at least CONFIGS["ring"]["MIN_BLOCK_BYTES"]
of routed weights to read (the measurements above CONFIGS), rung 1 elsewhere.

    T <= MAX_TOKENS tokens, K top-k, P = T*K slots, E experts, H hidden, I intermediate

experts.ExpertsPlan runs this instead of its five stage kernels when `eligible(...)` says so:
a decode batch of at most CONFIGS["decode"]["MAX_TOKENS"] tokens (the largest T measured faster
than the stages: the notes above CONFIGS), a gated
silu / gelu / gelu_tanh, the router weight applied to the output, no expert map, H and I
multiples of 8, 16-byte aligned arrays, and c2 [P, I] small enough to stage in shared memory.
The roundings are the stages'; the sums are in another order (fp32 fma per lane, then a warp
sum, not the tensor cores'), so the output matches the stages to bf16 rounding, not bit for bit.

Launch: one block per SM, cooperative (the grid barrier); shared memory `shared_bytes`
(rung 1: c2, ids, weights, the block's c3) or `shared_bytes_ring` (rung 2: and the ring);
the barrier word and rung 2's chunk counter are align.py's words, one of each per device and
stream.
"""
from __future__ import annotations

import numpy as np

from . import _arrays as A
from . import _compile as C
from ._geometry import cdiv
from ._launch import FastLaunch

CU = "experts_decode.cu"
CU_RING = "experts_decode_ring.cu"
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
# Rung 2 (CONFIGS["ring"]): CONSUMER_WARPS warps compute, one more issues the copies; RING
# stages of STAGE_BYTES (whole rows: a row of w1 and one of w2 must fit). Measured on an H100
# SXM against rung 1 in one process (CUDA graphs, L2 flushed, median us, two calls): Mixtral
# 254 -> 245-246 and DeepSeek-V3 256-257 -> 244-246 (5.3 MB of weights a block), Qwen3-30B-
# A3B 40 -> 43-44 (0.57 MB a block); 5 stages or 12 warps: the same; 3 stages of 48 KB or
# a phase-2 prefetch into L2: 1% slower; phase 2 taken from the counter too: slower.
CONFIGS = {"decode": {"MAX_TOKENS": 1, "DEC_THREADS": 1024, "U1": 4, "U2": 4,
                      "PHASE2_LOADS": 4, "PREFETCH": 65536},
           "ring": {"CONSUMER_WARPS": 8, "RING": 4, "STAGE_BYTES": 32768,
                    "MIN_BLOCK_BYTES": 2 << 20}}
DESC_BYTES = 32                    # rung 2: a stage's descriptor (experts_decode_ring.cu, Desc)
ACTS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
PAIRS_CHOICES = (1, 2, 4)
SHARED_LIMIT = 200 * 1024          # of the 227 KB an sm_90 block may opt in to
SHARED_LIMIT_RING = 227 * 1024     # rung 2: all of it (the ring is most of it)
_NAMES = tuple(f"moe_decode_kernel<{a}, {p}>" for a in ACTS.values() for p in PAIRS_CHOICES)
_NAMES_RING = tuple(f"moe_decode_ring_kernel<{a}>" for a in ACTS.values())
# both rungs: x, w1, w2, tw, ids, c2, out, bar, chunks | T, K, E, H, I
SIG = "ppppppppp" + "iiiii"


def _defines(dtype) -> dict:
    cfg = CONFIGS["decode"]
    return {"SCALAR_T": A.ctype_of(dtype),
            **{k: cfg[k] for k in ("DEC_THREADS", "U1", "U2", "PREFETCH")}}


def _defines_ring(dtype) -> dict:
    cfg = CONFIGS["ring"]
    return {"SCALAR_T": A.ctype_of(dtype),
            **{k: cfg[k] for k in ("CONSUMER_WARPS", "RING", "STAGE_BYTES")}}


for _dt in (np.dtype(np.float16), A.bf16_dtype()):
    C.register_compile_case(CU, _defines(_dt), _NAMES)
    C.register_compile_case(CU_RING, _defines_ring(_dt), _NAMES_RING, min_arch="sm_90")


def pairs_for(I: int) -> int:  # noqa: E741
    """Phase 2's pairs per warp at once: enough rows that a lane has about PHASE2_LOADS loads
    in flight (Qwen3's I = 768 gives 3 steps a lane per row: one pair for 4 loads, two for 8)."""
    cfg = CONFIGS["decode"]
    steps = min(cfg["U2"], cdiv(I // 8, 32))
    want = max(1, cfg["PHASE2_LOADS"] // max(steps, 1))
    return max(p for p in PAIRS_CHOICES if p <= want)


def shared_bytes(P: int, H: int, I: int, G: int, itemsize: int) -> int:  # noqa: E741
    return P * I * itemsize + 8 * P + 4 * cdiv(H, G) * P


def shared_bytes_ring(P: int, H: int, I: int, G: int, itemsize: int) -> int:  # noqa: E741
    """Rung 2's dynamic shared memory: the ring, c2 [P, I], ids and weights [P], the block's
    c3 [cdiv(H, G), P] and RING chunks' gate dot products [r1] in fp32 (r1 = the rows of w1 a
    stage holds), a 32-byte descriptor (16-byte aligned: 15 bytes of slack) and two mbarriers
    a stage, 8 bytes of slack."""
    cfg = CONFIGS["ring"]
    r1 = max(1, cfg["STAGE_BYTES"] // (H * itemsize))
    return (cfg["RING"] * cfg["STAGE_BYTES"] + P * I * itemsize + 8 * P
            + 4 * cdiv(H, G) * P + cfg["RING"] * (4 * r1 + 32 + 16) + 15 + 8)


def workspace_bytes(rung: str, P: int, I: int, G: int, itemsize: int) -> int:  # noqa: E741
    """The global scratch a launch of `rung` takes as its c2 argument: c2 [P, I], and for rung
    2 the G blocks' RING 32-byte descriptors from the next 256-byte boundary."""
    c2 = P * I * itemsize
    if rung != "decode-ring":
        return c2
    return cdiv(c2, 256) * 256 + G * CONFIGS["ring"]["RING"] * DESC_BYTES


def takes_ring(T, K, H, I, itemsize, G, sm90) -> bool:  # noqa: E741
    """Whether a decode launch of this shape runs rung 2: an sm_90 card, rows that fit a stage,
    its shared memory within the limit, and at least MIN_BLOCK_BYTES of routed weights (3 K H I
    elements) for each of the G blocks to read."""
    cfg = CONFIGS["ring"]
    stage = cfg["STAGE_BYTES"]
    return (bool(sm90) and H * itemsize <= stage and I * itemsize <= stage
            and 3 * T * K * H * I * itemsize >= cfg["MIN_BLOCK_BYTES"] * G
            and shared_bytes_ring(T * K, H, I, G, itemsize) <= SHARED_LIMIT_RING)


def eligible(T, K, H, I, dtype, activation, mul_on_input, expert_map, aligned,  # noqa: E741
             G) -> bool:
    """Whether a fused_experts call of this shape runs here (module docstring)."""
    return (1 <= T <= CONFIGS["decode"]["MAX_TOKENS"] and activation in ACTS
            and not mul_on_input and not expert_map and aligned and H % 8 == 0
            and I % 8 == 0 and I > 0 and np.dtype(dtype) in (np.dtype(np.float16), A.bf16_dtype())
            and shared_bytes(T * K, H, I, G, np.dtype(dtype).itemsize) <= SHARED_LIMIT)


def decode_launch(T, K, E, H, I, dtype, activation, G, sm90=False):  # noqa: E741
    """(rung, launch): the cooperative launch of the kernel for this shape on the current
    device, rung "decode" (1) or "decode-ring" (2, `takes_ring`); called as
    launch(stream, x, w1, w2, topk_weights, topk_ids, c2, out, barrier_word, chunk_word),
    c2 a scratch of workspace_bytes(rung, ...)."""
    isz = np.dtype(dtype).itemsize
    if takes_ring(T, K, H, I, isz, G, sm90):
        rung = "decode-ring"
        kern = C.get_kernel(CU_RING, f"moe_decode_ring_kernel<{ACTS[activation]}>",
                            _defines_ring(dtype), _NAMES_RING)
        smem = shared_bytes_ring(T * K, H, I, G, isz)
        threads = 32 * (CONFIGS["ring"]["CONSUMER_WARPS"] + 1)
    else:
        rung = "decode"
        kern = C.get_kernel(CU, f"moe_decode_kernel<{ACTS[activation]}, {pairs_for(I)}>",
                            _defines(dtype), _NAMES)
        smem = shared_bytes(T * K, H, I, G, isz)
        threads = CONFIGS["decode"]["DEC_THREADS"]
    if smem > 48 * 1024:
        kern.max_dynamic_shared_size_bytes = smem
    return rung, FastLaunch(kern, (G,), (threads,), smem, SIG, cooperative=True,
                            fixed={9: T, 10: K, 11: E, 12: H, 13: I})
