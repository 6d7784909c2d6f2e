"""The record of a run: JSON beside the checkout's commit, a plot, a text table.

    write_results(record, out_dir)  <out>/bench_<card>_<eager|graph>.json (results_stem): one
                                    file per card and mode, ./moe-sandbox-results unless --out
                                    says otherwise; date, commit, command and machine added
    plot_results(record, path)      time over T per model, the floor dashed, the ratio to vLLM
    format_table(record)            the points as text
    untuned_note(record)            which points ran a rung this card's GEMM table never
                                    measured (the `cupy` points' rungs_tuned), or None
    git_commit()                    the commit the numbers belong to (MOE_SANDBOX_COMMIT on a
                                    GPU machine that gets the tree without .git)
    add_out_dir(parser, flag)       the results-folder option every benchmark script takes
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import pathlib
import platform
import subprocess

import numpy as np

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
# the committed results behind the README's tables: written only when asked (--out)
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
# where a run writes by default: the current folder, never the source tree
DEFAULT_OUT_DIR = pathlib.Path("moe-sandbox-results")


def add_out_dir(parser, flag: str = "--out-dir"):
    """The results folder option of a benchmark script: DEFAULT_OUT_DIR unless given."""
    parser.add_argument(flag, default=str(DEFAULT_OUT_DIR),
                        help=f"results folder ({flag} benchmarks/results updates the committed "
                             f"files)")


def git_commit() -> str:
    """The commit the numbers belong to. The GPU machine gets a copy of the working tree
    without .git, so a run there passes the hash in MOE_SANDBOX_COMMIT."""
    if os.environ.get("MOE_SANDBOX_COMMIT"):
        return os.environ["MOE_SANDBOX_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=REPO_ROOT, timeout=10).stdout.strip()
    except Exception:
        return ""


def results_stem(record: dict) -> str:
    """bench_<card>_<eager|graph>: one current file per card and mode (a new run of the same
    card and mode replaces it)."""
    card = record.get("card") or {}
    gpu = card.get("gpu") or record.get("device") or "gpu"
    return f"bench_{slug(gpu)}_{'graph' if record.get('graph') else 'eager'}"


def write_results(record: dict, out_dir: pathlib.Path = DEFAULT_OUT_DIR, command: str = "",
                  stem: str | None = None) -> pathlib.Path:
    """Write the record (plus date, commit, command, machine) to `out_dir/<stem>.json`
    (default stem: `results_stem`)."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    now = _dt.datetime.now(_dt.timezone.utc)
    stem = stem or results_stem(record)
    full = {"date": now.isoformat(timespec="seconds"), "commit": git_commit(),
            "command": command, "machine": f"{platform.node()} {platform.machine()}",
            **record}
    path = out_dir / f"{stem}.json"
    path.write_text(json.dumps(full, indent=1, default=_json_default) + "\n")
    return path


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    return str(o)


def slug(s: str) -> str:
    """A name fit for a file name: lower case, [a-z0-9-], at most 40 characters."""
    return "".join(ch if ch.isalnum() else "-" for ch in s.lower()).strip("-")[:40] or "x"


def plot_results(record: dict, path: pathlib.Path) -> pathlib.Path | None:
    """One column per model: time (ms, log-log over T) of each candidate, with the roofline
    floor dashed where the card's limits are known; below it each candidate's time over
    vLLM's (its ratio: under 1 is faster than vLLM), or the fraction of the floor when the
    vLLM peer did not run. Returns the path, or None when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ok = [p for p in record["points"] if "stats" in p and "error" not in p]
    models = list(dict.fromkeys(p["model"] for p in ok))
    if not models:
        return None
    ratio_key = "vs_vllm-triton" if any("vs_vllm-triton" in p for p in ok) else None
    fig, axes = plt.subplots(2, len(models), figsize=(5 * len(models), 7), squeeze=False)
    for col, model in enumerate(models):
        pts = [p for p in ok if p["model"] == model]
        top, bottom = axes[0][col], axes[1][col]
        for name in dict.fromkeys(p["candidate"] for p in pts):
            q = sorted((p for p in pts if p["candidate"] == name), key=lambda p: p["T"])
            ts = [p["T"] for p in q]
            top.plot(ts, [p["stats"]["median"] for p in q], marker="o", label=name)
            top.fill_between(ts, [p["stats"]["p20"] for p in q],
                             [p["stats"]["p80"] for p in q], alpha=0.2)
            key = ratio_key or "fraction_of_floor"
            r = [(p["T"], p[key]) for p in q if key in p]
            if r:
                bottom.plot([t for t, _ in r], [v for _, v in r], marker="o", label=name)
        floor = sorted({(p["T"], p["floor_ms"]) for p in pts if "floor_ms" in p})
        if floor:
            top.plot([f[0] for f in floor], [f[1] for f in floor], "k--",
                     label="roofline floor")
        top.set(xscale="log", yscale="log", title=model, xlabel="tokens T",
                ylabel="time (ms, median, p20-p80)")
        if ratio_key:
            bottom.axhline(1.0, color="k", lw=0.8)
            bottom.set(xscale="log", xlabel="tokens T", ylabel="time / vLLM Triton's")
        else:
            bottom.set(xscale="log", ylim=(0, 1.05), xlabel="tokens T",
                       ylabel="fraction of floor")
        top.legend(fontsize=7)
        if bottom.get_lines():
            bottom.legend(fontsize=7)
        top.grid(True, which="both", alpha=0.3)
        bottom.grid(True, alpha=0.3)
    card = record.get("card") or {}
    title = f"{record.get('device', '')}, {'CUDA graph' if record.get('graph') else 'eager'}"
    if card:
        title += (f": copy {card.get('copy_TBps', 0):.2f} TB/s, matmul "
                  f"{card.get('matmul_TFLOPs', 0):.0f} TFLOP/s measured")
    if record.get("peak_bandwidth"):
        title += (f"; floor at {record['peak_bandwidth'] / 1e12:.2f} TB/s, "
                  f"{record['peak_flops'] / 1e12:.0f} TFLOP/s")
    fig.suptitle(title)
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def format_table(record: dict) -> str:
    """The points as a text table: median [p20, p80] ms, the ratios to the peers (vs vLLM,
    vs torch._grouped_mm, and a quantized point's vs our bf16 layer), floor and fraction of
    it (blank on a card of unknown limits), host microseconds per eager call, relative error."""
    rows = [(f"{'model':14s} {'T':>6s} {'candidate':22s} {'median ms':>10s} "
             f"{'[p20, p80]':>20s} {'vs vLLM':>7s} {'vs gmm':>7s} {'vs bf16':>7s} "
             f"{'floor ms':>9s} {'frac':>5s} {'host us':>8s} {'rel err':>8s}")]

    def num(v, fmt, width):
        return f"{v:{width}{fmt}}" if isinstance(v, (int, float)) else " " * width

    for p in record["points"]:
        head = f"{p['model']:14s} {p['T']:6d} {p['candidate']:22s}"
        if "stats" not in p or "error" in p:
            rows.append(f"{head} {p.get('error', '')}")
            continue
        s = p["stats"]
        spread = f"[{s['p20']:.4f}, {s['p80']:.4f}]"
        rows.append(f"{head} {s['median']:10.4f} {spread:>20s} "
                    f"{num(p.get('vs_vllm-triton'), '.2f', 7)} "
                    f"{num(p.get('vs_torch-grouped_mm'), '.2f', 7)} "
                    f"{num(p.get('vs_' + p.get('bf16_peer', '')), '.2f', 7)} "
                    f"{num(p.get('floor_ms'), '.4f', 9)} "
                    f"{num(p.get('fraction_of_floor'), '.2f', 5)} "
                    f"{num(p.get('host_us'), '.1f', 8)} {p['rel_err']:8.1e}")
    return "\n".join(rows)


def untuned_note(record: dict) -> str | None:
    """A note naming the points where our layer (`cupy`) ran the GEMM table's default rung
    because tune.py never measured this card there (a point's `rungs_tuned` False), and how
    to tune it; None when every point's rungs were measured on the card. Such points time
    the untuned fallback, not the rung the card would pick."""
    untuned = [p for p in record["points"]
               if p["candidate"] == "cupy" and p.get("rungs_tuned") is False]
    if not untuned:
        return None
    where = ", ".join(f"{p['model']} T={p['T']} ({'/'.join(p['rungs'])})" for p in untuned)
    return (f"note: {record.get('device', 'this card')} has no tuned rung in "
            f"cuda_kernels/cupy/gemm_configs.json for {where}: the table's default ran "
            f"there. Tune this card first: python -m cuda_kernels.cupy.tune --versions v4,v5,v6")
