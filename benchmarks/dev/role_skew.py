"""Dev probe: do runs skewed by each CTA's role on its SM balance wna16_staged (Mixtral, t24)?

Of an SM's two CTAs the one dispatched first runs ~11% faster a unit, and a CTA left alone on
its SM runs no faster than beside its partner (dev_wna16_20261201c), so with equal runs the
SM's second CTA ends alone, at half the SM's rate. Static skews by grid half were slower
(dev_wna16_20261201c call 4), but the grid halves are not the roles: CTAs 84-99 or so are
second on their SM and 132-139 first. Here the roles come from the GPU itself: a STAGED_TIMES
build records each CTA's SM in K_MAP launches (the lower q of an SM's two CTAs is the first
dispatched), and their agreement is printed. Then the launcher's build runs with run tables
(config RUN_TABLE, staged_run_table) whose first CTAs' runs are 1 + s and second CTAs' 1 - s
times the mean, s in --skews (per mille; 0 = no table), alternating, each timed as GEMM1,
GEMM2 and the layer (GEMM1 with the table, then GEMM2 programmatic without one: a
programmatic GEMM2's CTAs are dispatched as GEMM1's leave, so its roles are others), and each
once under STAGED_TIMES (the CTAs' ends, and whether the roles held).

    python benchmarks/dev/role_skew.py [--tokens 64] [--skews 0,30,50,70] [--rounds 2]
                                       [--out DIR]
Writes DIR/role_skew.json.
"""
import argparse
import collections
import json
import sys

import numpy as np

sys.path.insert(0, ".")
from benchmarks.bench_wna16 import E, H, I, K, Timer, draw_routing, mixtral_weights  # noqa: E402
from benchmarks.bench_wna16 import random_bf16  # noqa: E402
from benchmarks.dev.probe_staged import _module  # noqa: E402
from cuda_kernels.cupy import _compile as C  # noqa: E402
from cuda_kernels.cupy import quant_gemm_wna16 as W  # noqa: E402

K_MAP = 3


def roles_of(sm):
    """{q: 0 first on its SM, 1 second, -1 alone} from each CTA's SM (lower q: first)."""
    by = collections.defaultdict(list)
    for q, s in enumerate(sm):
        by[s].append(q)
    role = {}
    for qs in by.values():
        for i, q in enumerate(sorted(qs)):
            role[q] = -1 if len(qs) == 1 else min(i, 1)
    return role


def main():
    import cupy
    from reference import moe_align_block_size
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="64")
    p.add_argument("--skews", default="0,30,50,70")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="/tmp")
    args = p.parse_args()
    w1, w2, s1, s2 = mixtral_weights()
    timer, rows = Timer(), []
    fl = lambda: timer.flush.fill(1)  # noqa: E731
    dev = cupy.cuda.Device().id
    cfg0 = dict(W.STAGED_CONFIGS["t24"])
    skews = [int(v) for v in args.skews.split(",")]
    rng = np.random.default_rng(0)
    for T in map(int, args.tokens.split(",")):
        ids, tw = draw_routing(rng, T)
        x, act = random_bf16((T, H), 10 + T), random_bf16((T * K, I), 20 + T)
        B = 24
        st, ex, ntp = (C.to_device(v) for v in moe_align_block_size(ids, B, E))
        twd = C.to_device(tw)
        cfg = dict(cfg0)

        def g1():
            return W.grouped_gemm_wna16(x, w1, st, ex, ntp, K, B, w_scale=s1,
                                        use_int4_w4a16=True, config=cfg)

        def g2(programmatic=False, table=True):
            c2 = cfg if table else cfg0
            return W.grouped_gemm_wna16(act, w2, st, ex, ntp, 1, B, twd, True, w_scale=s2,
                                        use_int4_w4a16=True, config=c2,
                                        programmatic=programmatic)

        def layer():
            g1()
            g2(programmatic=True, table=False)

        def use(var):
            W._READY.clear()
            W._SMEM_SET.clear()
            name, mod, _ = _module(cupy, W.CU_STAGED, cfg0, var)
            W._READY[(name, 1, dev)] = mod.get_function(name)
            return mod

        def times(mod, g):
            """(SM, end us) of each CTA of one launch of g under the TIMES build."""
            tt = cupy.ndarray((4096, 16), cupy.uint64, memptr=mod.get_global("g_cta_times"))
            tt.fill(0)
            fl()
            cupy.cuda.runtime.deviceSynchronize()
            g()
            cupy.cuda.runtime.deviceSynchronize()
            h = cupy.asnumpy(tt)
            h = h[h[:, 1] > 0].astype(np.float64)
            return h[:, 2].astype(int).tolist(), ((h[:, 1] - h[:, 0].min()) / 1e3).tolist()

        # ---- the roles, from K_MAP launches of each GEMM (no table)
        tmod = use("TIMES=1")
        cfg.pop("RUN_TABLE", None)
        maps = {lab: [roles_of(times(tmod, g)[0]) for _ in range(K_MAP)]
                for lab, g in (("g1", g1), ("g2", g2))}
        for lab, ms in maps.items():
            agree = [sum(ms[0][q] == m[q] for q in ms[0]) for m in ms[1:]]
            print(f"T={T} {lab}: roles first/second/alone "
                  f"{[sum(r == v for r in ms[0].values()) for v in (0, 1, -1)]}, of "
                  f"{len(ms[0])} CTAs the same in the next launches: {agree}", flush=True)
        role = maps["g1"][0]
        Q = len(role)

        def table(s):
            if s == 0:
                return None
            wts = [1 + s / 1000 if role[q] == 0 else 1 - s / 1000 if role[q] == 1 else 1.0
                   for q in range(Q)]
            return cupy.asarray(W.staged_run_table(wts))

        tables = {s: table(s) for s in skews}
        # ---- each skew under TIMES: the CTAs' ends
        for s in skews:
            cfg.pop("RUN_TABLE", None)
            if tables[s] is not None:
                cfg["RUN_TABLE"] = tables[s]
            for lab, g in (("g1", g1), ("g2", g2)):
                sm, end = times(tmod, g)
                held = sum(roles_of(sm)[q] == role[q] for q in range(Q))
                e = np.array(end)
                print(f"T={T} skew {s}: {lab} TIMES end p0/50/90/100 "
                      + " ".join(f"{v:.1f}" for v in np.percentile(e, [0, 50, 90, 100]))
                      + f" us, roles held {held}/{Q}", flush=True)
                rows.append(dict(T=T, skew=s, gemm=lab, times=True, sm=sm, end_us=end,
                                 roles_held=held))
        # ---- timed, alternating
        use("base")
        for rnd in range(args.rounds):
            for s in skews:
                cfg.pop("RUN_TABLE", None)
                if tables[s] is not None:
                    cfg["RUN_TABLE"] = tables[s]
                t1, t2 = timer(g1, fl, 3, 20), timer(g2, fl, 3, 20)
                tl = timer(layer, fl, 3, 20)
                rows.append(dict(T=T, skew=s, round=rnd, gemm1_us=t1 * 1e3, gemm2_us=t2 * 1e3,
                                 layer_pdl_us=tl * 1e3))
                print(f"T={T} skew {s} (round {rnd}): g1 {t1 * 1e3:7.1f} us g2 {t2 * 1e3:7.1f} "
                      f"us, layer (GEMM1 with the table, GEMM2 programmatic) {tl * 1e3:7.1f} us",
                      flush=True)
        rows.append(dict(T=T, roles={str(q): r for q, r in role.items()}))
    json.dump(rows, open(f"{args.out}/role_skew.json", "w"), indent=1)


if __name__ == "__main__":
    main()
