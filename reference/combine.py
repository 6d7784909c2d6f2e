"""The combine: the K weighted expert outputs of each token summed into one row.

    T = tokens, K = top-k, H = hidden

    moe_sum(x [T, K, H], topk_ids=None, expert_map=None) -> [T, H]

The router weight was applied by GEMM2 (docs/stages.md), so the combine is a plain sum over
K in fp32, rounded once; with the ids it skips the slots routed nowhere (vLLM's pad-aware
moe_sum). slot_is_live is that rule as a [T, K] mask, which the tests and the sandbox share.
"""

from __future__ import annotations

import numpy as np

from ._checks import check_float, check_int
from .precision import to_compute


def moe_sum(x, topk_ids=None, expert_map=None):
    """The combine: out[t] = sum_k x[t, k] over the K slots, fp32, rounded once.  [T, K, H] -> [T, H]

    With topk_ids [T, K] (vLLM's pad-aware moe_sum) a slot whose id is negative (-1: routed
    nowhere), or, with expert_map, whose expert is not on this rank (an id past the map or
    mapped to -1), is skipped: its row of x is never read (alignment scheduled no GEMM row
    for it, so it holds nothing meaningful). A token with every slot skipped sums to 0.
    """
    check_float("x", x, ndim=3)
    acc = to_compute(x)
    if topk_ids is None:
        return acc.sum(axis=1).astype(x.dtype, copy=False)
    check_int("topk_ids", topk_ids, ndim=2, shape=x.shape[:2])
    live = slot_is_live(topk_ids, expert_map)                                  # [T, K]
    return np.where(live[:, :, None], acc, 0).sum(axis=1).astype(x.dtype, copy=False)


def slot_is_live(topk_ids, expert_map=None):
    """[T, K] bool: the slots the combine adds, id >= 0 and (with expert_map) local."""
    ids = np.asarray(topk_ids).astype(np.int64)
    live = ids >= 0
    if expert_map is not None:
        emap = np.asarray(expert_map).astype(np.int64)
        inside = live & (ids < emap.size)
        live = inside & (emap[np.where(inside, ids, 0)] >= 0)
    return live
