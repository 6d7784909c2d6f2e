"""One representative launch of every kernel, each checked against the reference: the run
`compute-sanitizer` watches on the GPU (tests/numba/test_sanitize.py runs it under memcheck and
racecheck when the tool is installed).

    compute-sanitizer --tool memcheck --error-exitcode 9 python -m cuda_kernels.numba._sanitize
    compute-sanitizer --tool racecheck --error-exitcode 9 python -m cuda_kernels.numba._sanitize

Every kernel, flavour and load mode the stages launch: routing "keys", "warp" and "block" (softmax,
bias, groups), alignment single-block and count/scan/scatter with "warp" and "block" ranks
and the one-launch "grid" kernel (one block, and a grid of three blocks behind its barrier; an
expert map, ignored experts), permute / unpermute (compile-time and runtime K),
each activation, moe_sum (compile-time and runtime K), GEMM v1 / v2 / v3 (8-byte words and
single elements, expert_ids == -1 blocks) / v3v (16-byte loads). Small shapes: the tools slow kernels ~100x.
Prints one line per case; exit code 1 if any output differs from the reference.
"""
from __future__ import annotations

import importlib
import sys

import ml_dtypes
import numpy as np

from . import _arrays as A
from ._script import main as script_main
from ._script import rel_err

BF16 = np.dtype(ml_dtypes.bfloat16)


def _mods():
    names = ("routing", "align", "permute", "activation", "combine", "gemm")
    return [importlib.import_module(f"{__package__}.{n}") for n in names]


def _ids(rng, T, E, K):
    return np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int32)


def cases():
    """[(name, fn)]: fn() returns None when the kernel matches the reference, else why not."""
    import reference

    R, Al, Pm, Ac, Cb, G = _mods()
    rng = np.random.default_rng(0)
    out = []

    def route_case(flavor, dtype, bias, groups):
        def run():
            x = rng.standard_normal((37, 64)).astype(dtype)
            b = rng.standard_normal(64).astype(np.float32) * 0.1 if bias else None
            G_, TG = (8, 3) if groups else (1, 1)
            call = A.Call("gating_output", x)
            got = R._launch(call, x, b, 6, G_, TG, "sigmoid" if groups else "softmax", True,
                            2.5 if groups else 1.0, False, np.dtype(np.int32), flavor=flavor,
                            mode=R.MODE_GROUPED if groups else R.MODE_TOPK)
            want = (reference.grouped_topk(None, x, 6, True, G_, TG, "sigmoid", 2.5, b)
                    if groups else reference.fused_topk_bias(None, x, "softmax", b, 6, True)
                    if bias else reference.fused_topk(None, x, 6, True)[:2])
            if not np.array_equal(got[1], want[1]):
                return "ids differ"
            return None if rel_err(got[0], want[0]) <= 1e-5 else "weights differ"
        return run

    for flavor in ("keys", "warp", "block"):
        for dtype, bias, groups in ((np.float32, False, False), (BF16, True, False),
                                    (np.float16, True, True)):
            out.append((f"routing {flavor} {np.dtype(dtype).name} bias={bias} groups={groups}",
                        route_case(flavor, dtype, bias, groups)))

    def align_case(path, rank, mapped):
        def run():
            ids = _ids(rng, 700 if path == "multi" else 90, 40, 4)
            emap = reference.determine_expert_map(4, 1, 40)[1] if mapped else None
            call = A.Call("topk_ids", ids)
            cap = Al.max_num_tokens_padded(ids.size, 16, 40)
            res = Al._sort_slots(call, ids, 40, 16, emap, mapped, cap, True, False, path=path,
                                 rank=rank)
            got = [call.result(v) for v in res[:3]]
            want = reference.moe_align_block_size(ids, 16, 40, emap, False, mapped)
            same = all(np.array_equal(g, w) for g, w in zip(got, want))
            return None if same else "alignment differs"
        return run

    for path in ("single", "multi"):
        for rank in ("warp", "block"):
            for mapped in (False, True):
                out.append((f"align {path} rank={rank} expert_map={mapped}",
                            align_case(path, rank, mapped)))

    def grid_case(blocks, mapped):
        """align_grid.py's one-launch kernel: one block, or a grid of `blocks` blocks (small
        SMALL_P, GRID_WARPS and WARP_SLOTS force the grid barrier at 360 slots)."""
        def run():
            Ag = importlib.import_module(f"{__package__}.align_grid")
            saved = dict(Ag.CONFIGS["grid"])
            if blocks > 1:
                Ag.CONFIGS["grid"].update(SMALL_P=64, GRID_WARPS=2, WARP_SLOTS=32,
                                          MAX_BLOCKS=blocks)
            try:
                return align_case("single", "grid", mapped)()
            finally:
                Ag.CONFIGS["grid"].clear()
                Ag.CONFIGS["grid"].update(saved)
        return run

    for blocks in (1, 3):  # (not G: that name is the gemm module here)
        for mapped in (False, True):
            out.append((f"align grid blocks={blocks} expert_map={mapped}",
                        grid_case(blocks, mapped)))

    def permute_case(K):
        def run():
            x = rng.standard_normal((45, 136)).astype(BF16)
            ids = _ids(rng, 45, 64, K)
            got, want = Pm.moe_permute(x, ids, 64), reference.moe_permute(x, ids, 64)
            if not all(np.array_equal(g.view(np.uint8), w.view(np.uint8))
                       for g, w in zip(got, want)):
                return "permute differs"
            y = rng.standard_normal((45 * K, 136)).astype(BF16)
            tw = rng.random((45, K)).astype(np.float32)
            err = rel_err(Pm.moe_unpermute(y, tw, want[2]),
                          reference.moe_unpermute(y.astype(np.float64), tw, want[2]))
            return None if err <= 1e-2 else f"unpermute rel err {err:.1e}"
        return run

    out += [("permute + unpermute K=8", permute_case(8)),
            ("permute + unpermute K=40 (runtime K)", permute_case(40))]

    def act_case(act, gated, dtype):
        def run():
            x = (rng.standard_normal((33, 200)) * 3).astype(dtype)
            err = rel_err(Ac.apply_activation(x, act, gated),
                          reference.apply_activation(x.astype(np.float64), act, gated))
            return None if err <= 1e-2 else f"rel err {err:.1e}"
        return run

    for act, gated in (("silu", True), ("gelu", True), ("gelu_tanh", True),
                       ("swigluoai", True), ("relu2", False), ("silu", False)):
        out.append((f"activation {act} gated={gated} fp16", act_case(act, gated, np.float16)))
    out.append(("activation silu gated bf16", act_case("silu", True, BF16)))

    def sum_case(K):
        def run():
            x = rng.standard_normal((19, K, 300)).astype(BF16)
            err = rel_err(Cb.moe_sum(x), reference.moe_sum(x.astype(np.float64)))
            return None if err <= 1e-2 else f"rel err {err:.1e}"
        return run

    out += [("moe_sum K=8 bf16", sum_case(8)), ("moe_sum K=40 bf16 (runtime K)", sum_case(40))]

    def gemm_case(version, dtype, Kd, B, mapped):
        def run():
            T, E, K, N = 29, 8, 2, 136
            ids = _ids(rng, T, E, K)
            emap = reference.determine_expert_map(2, 1, E)[1] if mapped else None
            El = 4 if mapped else E
            a = rng.standard_normal((T, Kd)).astype(dtype)
            w = (rng.standard_normal((El, N, Kd)) / np.sqrt(Kd)).astype(dtype)
            bias = rng.standard_normal((El, N)).astype(np.float32)
            tw = rng.random((T, K)).astype(np.float32)
            al = reference.moe_align_block_size(ids, B, E, emap)
            got = G.grouped_gemm(a, w, *al, K, B, tw, True, bias, version=version)
            want = reference.grouped_gemm(a.astype(np.float64), w.astype(np.float64), *al, K,
                                          B, tw, True, bias)
            tol = 1e-5 if np.dtype(dtype) == np.float32 else 1e-2
            err = rel_err(got, want)
            return None if err <= tol else f"rel err {err:.1e}"
        return run

    for version, dtype, Kd, B, mapped in (("v1", np.float16, 72, 16, False),
                                          ("v2", BF16, 72, 16, True),
                                          ("v3", BF16, 72, 16, False),     # words, BM 16
                                          ("v3", BF16, 70, 32, False),     # elements
                                          ("v3", np.float32, 72, 64, True),
                                          ("v3", np.float16, 264, 64, False),
                                          ("v3v", BF16, 72, 16, False),    # 16-byte loads
                                          ("v3v", np.float32, 72, 64, True)):
        out.append((f"grouped_gemm {version} {np.dtype(dtype).name} Kd={Kd} B={B} "
                    f"expert_map={mapped}", gemm_case(version, dtype, Kd, B, mapped)))
    return out


def main():
    def lines(_rng):
        with A.poisoned_outputs():
            for name, run in cases():
                why = run()
                text = f"  {'ok  ' if why is None else 'FAIL'} {name}" + (f": {why}" if why else "")
                yield text, why is None

    return script_main("kernels", lines)


if __name__ == "__main__":
    sys.exit(main())
