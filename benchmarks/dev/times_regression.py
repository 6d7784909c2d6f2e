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
Then views that need no common split: every launch's CTAs by grid half and by the order
they started on their SM (the younger one started second), their mean pace each (normalized by
the launch's median); and the SMs' pairs: an SM's end (its later CTA's) against the units of
live-token-tile count LT = 2 and 3 that its two CTAs ran, t = n2 tau2 + n3 tau3 by least
squares (after a fixed start and end of OVERHEAD_US), whose ratio tau3 / tau2 = (3 + c) / (2 + c)
names the unit cost LT + c that would even the SMs out if the pairs were what they are; and
per launch where the last CTA ends against the worst mean of an SM's two ends; and the SMs'
ends against where the launch would end if every k SMs shared their work perfectly
(balance_bound: the bound of balancing inside groups of k SMs), with the SM clock the CTAs ran
at (cycles / ns, from dev_wna16_20261201e's probes).
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
    mhz = np.array(r["sm_mhz"], float) if "sm_mhz" in r else None   # (recorded from 20261201e)
    return dict(duration=end - start, pace=(end - start) / cost, cost=cost, units=units,
                lt_units=lt_units, parts=parts, sm=sm, older=older, end=end, mhz=mhz)


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


OVERHEAD_US = 10.0     # a CTA's first stage lands ~8 us in, its last block ends ~2 us


def age_table(fs: list[dict]) -> dict:
    """{(second half of the grid, started second on its SM): mean normalized pace}."""
    acc: dict = {}
    for f in fs:
        Q = len(f["pace"])
        half = np.arange(Q) >= Q // 2
        pace = f["pace"] / np.median(f["pace"])
        for h in (False, True):
            for y in (False, True):
                acc.setdefault((h, y), []).extend(pace[(half == h) & (f["older"] != y)])
    return {k: (len(v), float(np.mean(v))) for k, v in acc.items() if v}


def sm_ends(f: dict) -> dict:
    """One launch's SMs with two CTAs: the last CTA's end, the worst mean of a pair's two ends
    (where the kernel would end if each SM's two CTAs shared their work perfectly), and the SMs
    whose two CTAs ran mostly LT = 3 units (mean LT summed over the pair >= 5.5) against the
    others (their mean end, NaN if none)."""
    lt = f["lt_units"] / np.maximum(f["units"], 1)
    pairs = [np.flatnonzero(f["sm"] == s) for s in np.unique(f["sm"])]
    pairs = [on for on in pairs if len(on) == 2]
    mean = np.array([f["end"][on].mean() for on in pairs])
    last = np.array([f["end"][on].max() for on in pairs])
    heavy = np.array([lt[on].sum() >= 5.5 for on in pairs])
    return dict(last=float(f["end"].max()), worst_mean=float(mean.max()),
                heavy=int(heavy.sum()),
                heavy_end=float(last[heavy].mean()) if heavy.any() else float("nan"),
                other_end=float(last[~heavy].mean()) if (~heavy).any() else float("nan"))


def sm_last_ends(f: dict) -> np.ndarray:
    """Each SM's end in one launch: its last CTA's."""
    return np.array([f["end"][f["sm"] == s].max() for s in np.unique(f["sm"])])


def balance_bound(f: dict, ks=(1, 2, 4, 8, 16), draws: int = 200, seed: int = 0) -> dict:
    """{k: where the launch would end if the work of every k SMs (drawn at random, `draws`
    times) were shared perfectly among them}: the mean over the draws of the worst group's mean
    SM end (an SM's end: its last CTA's). k = 1 is the launch's last end; k = all the SMs' mean
    end, the bound of any balance across the GPU. Dynamic schemes that move work only inside
    groups of k SMs (a cluster's, say) can at best reach k's figure."""
    ends = sm_last_ends(f)
    rng = np.random.default_rng(seed)
    out = {1: float(ends.max())}
    for k in ks:
        if 1 < k < len(ends):
            n = len(ends) // k * k
            out[k] = float(np.mean([ends[rng.permutation(len(ends))[:n]].reshape(-1, k)
                                    .mean(1).max() for _ in range(draws)]))
    out[len(ends)] = float(ends.mean())
    return out


def pair_fit(f: dict) -> tuple[float, float, float] | None:
    """(tau2, tau3, c) of one launch's SMs with two CTAs (LT 2 and 3 units), None without any
    LT = 3 units."""
    n3 = f["lt_units"] - 2 * f["units"]              # LT in {2, 3}: lt_units = 2 n2 + 3 n3
    n2 = f["units"] - n3
    rows = []
    for s in np.unique(f["sm"]):
        on = np.flatnonzero(f["sm"] == s)
        if len(on) == 2:
            rows.append((n2[on].sum(), n3[on].sum(), f["end"][on].max() - OVERHEAD_US))
    a = np.array(rows, float)
    if not len(a) or a[:, 1].max() <= 0 or np.any(n3 < 0):
        return None
    tau2, tau3 = np.linalg.lstsq(a[:, :2], a[:, 2], rcond=None)[0]
    r = tau3 / tau2
    return float(tau2), float(tau3), float((3 - 2 * r) / (r - 1))


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("files", nargs="+", help="probe JSON files, FILE or FILE:VARIANT")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--config", default="t24")
    args = p.parse_args(argv)
    launches = [load(s, args.tokens, args.config) for s in args.files]
    for gemm in sorted({g for rows in launches for g in rows}):
        fs = [features(rows[gemm]) for rows in launches if gemm in rows]
        print(f"{gemm}: {len(fs)} launches at T = {args.tokens}")
        for (h, y), (n, pace) in sorted(age_table(fs).items()):
            print(f"  pace of the {'second' if h else 'first'} half's CTAs that started "
                  f"{'second' if y else 'first'} on their SM: {pace:.3f} ({n} CTAs)")
        for i, f in enumerate(fs):
            fit = pair_fit(f)
            ends = sm_ends(f)
            print(f"  launch {i}: last CTA ends {ends['last']:.1f} us, the SMs' worst pair mean "
                  f"{ends['worst_mean']:.1f}; SMs of two mostly-LT-3 CTAs (LT sum >= 5.5): "
                  f"{ends['heavy']}, ending at {ends['heavy_end']:.1f} us against "
                  f"{ends['other_end']:.1f}" + (f"; SM pairs tau2 {fit[0]:.3f} tau3 {fit[1]:.3f}"
                                                f" us a unit, the even unit cost LT + "
                                                f"{fit[2]:.2f}" if fit else ""))
            bound = balance_bound(f)
            print(f"  launch {i}: SMs' ends p0/50/100 " +
                  " ".join(f"{v:.1f}" for v in np.percentile(sm_last_ends(f), [0, 50, 100])) +
                  " us; the work of every k SMs shared perfectly: " +
                  ", ".join(f"k={k} {v:.1f}" for k, v in bound.items()) +
                  (f"; SM clock p50 {np.median(f['mhz']):.0f} MHz" if f.get("mhz") is not None
                   else ""))
        if len(fs) < 2 or len({len(f["duration"]) for f in fs}) != 1:
            print("  correlations and the fit need two launches or more of one grid")
            continue
        Q = len(fs[0]["duration"])
        young = (np.arange(Q) >= Q // 2).astype(float)
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
