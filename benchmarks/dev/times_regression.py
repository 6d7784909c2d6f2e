"""What makes a staged CTA slow: a CPU analysis of committed STAGED_TIMES probes.

probe_staged.py's TIMES variants record, for every CTA of a launch, its start and end, its SM
and its units (json rows with "sm", "start_us", "end_us", "units", "lt_units", "parts"). Given
several such launches of the same kernel on the same routing (other calls, other machines),
this asks whether a CTA's pace (duration per unit of the run split's cost, LT + 5 per unit)
belongs to the SM it ran on or to the run it was given, and fits the CTAs' durations (their
mean over the launches) by least squares on what the run holds:
    duration ~ c0 + c1 units + c2 (units x LT) + c3 partial blocks + c4 younger x cost
where "younger" is a CTA of the second half of the grid (q >= Q / 2), which the block scheduler
puts second on its SM in ~90% of the SMs (the arrival order the probes record says so).
    python benchmarks/dev/times_regression.py FILE[:VARIANT] ... [--tokens 64] [--config t24]
"""
from __future__ import annotations

import argparse
import json

import numpy as np


def load(spec: str, T: int, config: str) -> dict:
    """{gemm: row} of one probe file (FILE or FILE:VARIANT, the TIMES variant's name)."""
    path, _, variant = spec.partition(":")
    rows = {}
    for r in json.load(open(path)):
        if (isinstance(r, dict) and "sm" in r and r.get("T") == T and r.get("config") == config
                and (not variant or r.get("variant") == variant)):
            rows.setdefault(r["gemm"], r)
    return rows


def features(r: dict) -> dict:
    start, end = np.array(r["start_us"]), np.array(r["end_us"])
    units, lt_units = np.array(r["units"], float), np.array(r["lt_units"], float)
    sm = np.array(r["sm"])
    older = np.zeros(len(sm), bool)                # the first CTA to start on its SM
    for s in np.unique(sm):
        on = np.flatnonzero(sm == s)
        older[on[np.argmin(start[on])]] = True
    cost = lt_units + 5 * units
    parts = np.array(r["parts"], float) if "parts" in r else None   # (recorded from eddde14)
    return dict(duration=end - start, pace=(end - start) / cost, cost=cost, units=units,
                lt_units=lt_units, parts=parts, sm=sm, older=older)


def mean_pairwise_corr(rows: list[np.ndarray]) -> float:
    rows = [np.asarray(x, float) for x in rows]
    cs = []
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            ok = ~np.isnan(rows[i]) & ~np.isnan(rows[j])
            cs.append(np.corrcoef(rows[i][ok], rows[j][ok])[0, 1])
    return float(np.mean(cs))


def per_sm(f: dict, which: bool) -> np.ndarray:
    """Pace of the older (which=True) or younger CTA of each SM, NaN where none ran."""
    out = np.full(int(f["sm"].max()) + 1, np.nan)
    sel = f["older"] == which
    out[f["sm"][sel]] = f["pace"][sel]
    return out


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("files", nargs="+", help="probe JSON files, FILE or FILE:VARIANT")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--config", default="t24")
    args = p.parse_args(argv)
    launches = [load(s, args.tokens, args.config) for s in args.files]
    for gemm in sorted({g for rows in launches for g in rows}):
        fs = [features(rows[gemm]) for rows in launches if gemm in rows]
        if len(fs) < 2 or len({len(f["duration"]) for f in fs}) != 1:
            print(f"{gemm}: needs two launches or more of one grid")
            continue
        Q = len(fs[0]["duration"])
        young = (np.arange(Q) >= Q // 2).astype(float)
        print(f"{gemm}: {len(fs)} launches of {Q} CTAs at T = {args.tokens}")
        print(f"  pace by run (CTA q), mean correlation between launches: "
              f"{mean_pairwise_corr([f['pace'] for f in fs]):.2f}")
        print(f"  pace by SM, older CTA: {mean_pairwise_corr([per_sm(f, True) for f in fs]):.2f}"
              f", younger CTA: {mean_pairwise_corr([per_sm(f, False) for f in fs]):.2f}")
        agree = np.mean([np.mean(f["older"] == (young == 0)) for f in fs])
        print(f"  the first half of the grid is the older CTA on its SM for {agree:.0%} of CTAs")
        if any(not np.array_equal(f["lt_units"], fs[0]["lt_units"]) for f in fs):
            print("  the launches split the work differently: no fit")
            continue
        d = np.mean([f["duration"] for f in fs], axis=0)
        f = next((f for f in fs if f["parts"] is not None), None)
        if f is None:
            print("  no launch recorded its partial blocks: no fit")
            continue
        cols = {"1": np.ones(Q), "units": f["units"], "units x LT": f["lt_units"],
                "partial blocks": f["parts"], "younger x cost": young * f["cost"]}
        for upto in (3, 4, 5):
            names = list(cols)[:upto]
            X = np.column_stack([cols[n] for n in names])
            coef = np.linalg.lstsq(X, d, rcond=None)[0]
            resid = d - X @ coef
            r2 = 1 - (resid ** 2).sum() / ((d - d.mean()) ** 2).sum()
            terms = ", ".join(f"{n} {c:+.3g}" for n, c in zip(names, coef))
            print(f"  R2 {r2:.2f}, residual sd {resid.std():.2f} us (durations sd {d.std():.2f}, "
                  f"{d.min():.1f}-{d.max():.1f} us): {terms}")


if __name__ == "__main__":
    main()
