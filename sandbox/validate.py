"""Cross-validation: run the same inputs through each backend, stage by stage, and say where
a backend first leaves its tolerance.

    validate(layer, hidden_states, router_logits, backends=None, *, stages=STAGES, dtype=None)
        -> ValidationReport (.ok, .rows, .first_divergence, .table(), .to_json())

How it judges (T tokens, K top-k, P = T*K slots, B block size):

* **No compounding.** The reference runs the layer once in the working dtype and records
  every stage's inputs. Each backend's stage is fed *those* inputs, so a stage is judged on
  its own error, not on the error of the stages before it. The layer also runs end to end
  on each backend (`end_to_end` row).
* **Against the exact answer.** The yardstick of a stage is the reference fed the same
  inputs upcast to float64 (its exact mode), so the reference's own rounding shows as a row
  too and a backend is not punished for being more accurate than the reference.
* **Floats**: max abs error and relative Frobenius error ||got - exact||_F / ||exact||_F in
  float64; tolerance by the output's dtype (fp32 1e-5, fp16 / bf16 1e-2, fp64 1e-12). NaN
  never passes, except where the exact output is NaN itself (a NaN in the weights or the
  activations; a NaN logit no longer makes one: vLLM's routing gives its row defined
  weights, docs/stages.md): there the backend must be NaN at exactly the same places. The
  dtype must be the contract's.
* **Routing ids**: exact, except swaps at true near-ties: where the selection scores the
  reference ranks (softmax or sigmoid, + correction bias) of the two swapped experts agree
  within 4 fp32 ulps. Those tokens are counted separately (`near_ties`) and left out of the
  float comparisons of that stage and of the end-to-end output, where a swap at a tie
  legitimately changes the token's result.
* **Skipped slots**: a slot routed nowhere (id -1) is never computed: the GEMM and
  activation rows are judged on the slots alignment scheduled only (`written_rows`); the
  combine, which must leave the others out, is judged whole.
* **Alignment**: num_tokens_post_padded and expert_ids exact; sorted_token_ids compared as
  multisets per expert run (each run of consecutive blocks of one expert; an expert with one
  block is a per-block set), because kernels may order slots within an expert freely
  (docs/stages.md); everything after num_tokens_post_padded must be the padding value P.
* Backends not available here are listed with the reason and skipped, never failed; so is a
  stage a backend does not implement yet (a backend that ran no stage at all is listed in
  `skipped` too). But a report in which nothing but the reference ran is not ok: it
  compared nothing (`ValidationReport.nothing_compared`), unless the reference alone was
  asked for.
"""

from __future__ import annotations

import functools
import json
import math
import sys
import threading
import time
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from . import arrays
from . import validate_quant as VQ
from .registry import BACKENDS, STAGE_FUNCTIONS, STAGES, get_backend

END_TO_END = "end_to_end"
# a backend that has run this long gets progress lines on stderr (the CUDA simulator runs
# ~2,000 threads a second: minutes for a stage), a faster one none
PROGRESS_AFTER_S = 3.0
TOLERANCES = {
    np.dtype(np.float64): 1e-12,
    np.dtype(np.float32): 1e-5,
    np.dtype(np.float16): 1e-2,
    np.dtype(ml_dtypes.bfloat16): 1e-2,
}
TIE_ULPS = 4
_FAILING = ("fail", "error")


def tolerance(dtype) -> float:
    """The relative Frobenius tolerance for an output of `dtype`."""
    return TOLERANCES[np.dtype(dtype)]


# ----------------------------------------------------------------------------- report
@dataclass
class ValidationReport:
    """The result of `validate`: one row per (backend, stage), plus end-to-end rows.

    rows: dicts with backend, stage, status ("ok", "fail", "error", "skipped", "info"), dtype,
    tol, max_abs_err, rel_err, ids (a summary for id outputs), near_ties, detail.
    first_divergence: {backend: the first stage whose status is fail/error, or None}.
    skipped: {backend: why it did not run} (unavailable here, or no asked stage implemented).

    ok: no row failed, *and* something was compared: at least one backend other than the
    reference ran a stage (a report where nothing but the reference ran is not ok), unless
    the reference alone was asked for (its rounding against the exact answer is then the
    point). `diverged` and `compared` tell the two reasons apart.
    """

    rows: list = field(default_factory=list)
    first_divergence: dict = field(default_factory=dict)
    skipped: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    @property
    def diverged(self) -> bool:
        """Whether a row failed (a backend left its tolerance, or raised)."""
        return any(r["status"] in _FAILING for r in self.rows)

    @property
    def compared(self) -> list:
        """The backends other than the reference that ran at least one stage."""
        ran = [r["backend"] for r in self.rows
               if r["backend"] != "reference" and r["status"] != "skipped"]
        return list(dict.fromkeys(ran))

    @property
    def only_reference_asked(self) -> bool:
        asked = self.meta.get("backends") or list(dict.fromkeys(r["backend"]
                                                                for r in self.rows))
        return list(asked) == ["reference"]

    @property
    def nothing_compared(self) -> bool:
        """True when no backend but the reference ran although others were asked for."""
        if self.only_reference_asked:
            return not any(r["status"] != "skipped" for r in self.rows)
        return not self.compared

    @property
    def ok(self) -> bool:
        return not self.diverged and not self.nothing_compared

    @property
    def verdict(self) -> str:
        """"OK", "DIVERGENCE", or "NOTHING COMPARED (why)"."""
        if self.diverged:
            return "DIVERGENCE"
        if self.nothing_compared:
            why = "; ".join(f"{n}: {w}" for n, w in self.skipped.items()) or "nothing ran"
            return f"NOTHING COMPARED (no backend but the reference ran: {why})"
        return "OK"

    def row(self, backend, stage):
        """The row of (backend, stage), or None."""
        for r in self.rows:
            if r["backend"] == backend and r["stage"] == stage:
                return r
        return None

    def to_json(self) -> dict:
        """A JSON-safe dict (non-finite floats as the strings "nan", "inf", "-inf")."""
        return {
            "ok": self.ok,
            "meta": _json_safe(self.meta),
            "first_divergence": dict(self.first_divergence),
            "skipped": dict(self.skipped),
            "rows": [_json_safe(r) for r in self.rows],
        }

    @classmethod
    def from_json(cls, data) -> ValidationReport:
        """The inverse of to_json (accepts the dict or its JSON text)."""
        if isinstance(data, str):
            data = json.loads(data)
        return cls(rows=[_from_json_safe(r) for r in data["rows"]],
                   first_divergence=dict(data["first_divergence"]),
                   skipped=dict(data["skipped"]), meta=_from_json_safe(data["meta"]))

    def table(self) -> str:
        """A terminal table: one line per (backend, stage), then the verdict per backend."""
        head = ("backend", "stage", "status", "dtype", "max abs err", "rel err", "tol",
                "ids / detail")
        lines = []
        for r in self.rows:
            note = r.get("ids") or ""
            if r.get("near_ties"):
                note = (note + "; " if note else "") + f"{r['near_ties']} near-tie token(s)"
            if r.get("detail"):
                note = (note + "; " if note else "") + r["detail"]
            lines.append((r["backend"], r["stage"], r["status"].upper() if r["status"] in
                          _FAILING else r["status"], r.get("dtype") or "",
                          _fmt(r.get("max_abs_err")), _fmt(r.get("rel_err")),
                          _fmt(r.get("tol")), note))
        widths = [max([len(head[i])] + [len(str(line[i])) for line in lines])
                  for i in range(len(head) - 1)]
        def fmt(cols):
            return "  ".join(str(c).ljust(w) for c, w in zip(cols[:-1], widths)) + "  " + cols[-1]
        out = [fmt(head), fmt(tuple("-" * w for w in widths) + ("-" * 12,))]
        out += [fmt(line) for line in lines]
        out.append("")
        for name, stage in self.first_divergence.items():
            out.append(f"{name}: " + ("all stages within tolerance" if stage is None
                                      else f"first divergence at {stage}"))
        for name, why in self.skipped.items():
            out.append(f"{name}: skipped ({why})")
        if self.nothing_compared and not self.diverged:
            out.append("nothing compared: no backend but the reference ran, so this report "
                       "vouches for none (see the skipped lines above)")
        m = self.meta
        if m:
            blocks = m.get("block_sizes") or {}
            if len(set(blocks.values()) | {m.get("block_size")}) > 1:
                bs = ", ".join(f"{k} {v}" for k, v in blocks.items())
            else:
                bs = str(m.get("block_size"))
            out.append(f"T={m.get('T')} E={m.get('E')} K={m.get('K')} H={m.get('H')} "
                       f"I={m.get('I')} dtype={m.get('dtype')} block_size={bs}"
                       f"  -> {self.verdict.split(' (')[0]}")
        return "\n".join(out)

    def __str__(self):
        return self.table()


def _fmt(v):
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:.2e}" if v else "0"
    return str(v)


def _json_safe(obj):
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, (np.floating, float)):
        v = float(obj)
        if math.isfinite(v):
            return v
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    return obj


_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_FLOAT_KEYS = ("max_abs_err", "rel_err", "tol")


def _from_json_safe(obj):
    if isinstance(obj, dict):
        return {k: (_NONFINITE.get(v, v) if k in _FLOAT_KEYS and isinstance(v, str)
                    else _from_json_safe(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_from_json_safe(v) for v in obj]
    return obj


# ----------------------------------------------------------------------------- comparisons
def compare_float(got, want, expected_dtype, rows=None, tol=None) -> dict:
    """max abs / relative Frobenius error of `got` against the exact `want` (float64).

    `rows`: a boolean mask over the first axis of the rows to judge (None: all).
    `tol`: the relative tolerance (None: by expected_dtype; a quantized format's otherwise).
    NaN must appear in `got` exactly where `want` has NaN; elsewhere NaN fails.
    """
    res = {"dtype": str(np.dtype(expected_dtype)),
           "tol": tolerance(expected_dtype) if tol is None else tol,
           "max_abs_err": None, "rel_err": None, "detail": ""}
    if got is None or want is None:
        if got is None and want is None:
            res.update(status="ok", max_abs_err=0.0, rel_err=0.0)
        else:
            res.update(status="fail", detail=f"expected {'None' if want is None else 'an array'},"
                                             f" got {arrays.describe(got)}")
        return res
    if tuple(got.shape) != tuple(want.shape):
        res.update(status="fail", detail=f"shape: expected {tuple(want.shape)}, "
                                         f"got {tuple(got.shape)}")
        return res
    problems = []
    if np.dtype(got.dtype) != np.dtype(expected_dtype):
        problems.append(f"dtype: expected {np.dtype(expected_dtype)}, got {got.dtype}")
    g = np.asarray(got).astype(np.float64)
    w = np.asarray(want).astype(np.float64)
    if rows is not None:
        g, w = g[rows], w[rows]
    nan_g, nan_w = np.isnan(g), np.isnan(w)
    nan_mismatch = int(np.count_nonzero(nan_g != nan_w))
    if nan_mismatch:
        extra = int(np.count_nonzero(nan_g & ~nan_w))
        missing = int(np.count_nonzero(nan_w & ~nan_g))
        problems.append(f"NaN: {extra} where the reference is finite, "
                        f"{missing} missing where it is NaN")
    both = ~nan_g & ~nan_w
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.where(g[both] == w[both], 0.0, g[both] - w[both])     # equal infs: no error
    max_abs = float(np.max(np.abs(d))) if d.size else 0.0
    num = float(np.linalg.norm(d)) if d.size else 0.0
    den = float(np.linalg.norm(w[both][np.isfinite(w[both])])) if d.size else 0.0
    if not math.isfinite(num):
        rel = math.inf
    elif den == 0.0:
        rel = 0.0 if num == 0.0 else math.inf
    else:
        rel = num / den
    res.update(max_abs_err=max_abs, rel_err=rel)
    if rel > res["tol"] or not math.isfinite(rel):
        problems.append(f"rel err {rel:.2e} > tol {res['tol']:.0e}")
    res["status"] = "fail" if problems else "ok"
    res["detail"] = "; ".join(problems)
    return res


def selection_scores(layer, router_logits):
    """The scores the reference's router ranks experts by ([T, E+Z] fp32), or None for a
    custom routing function (whose ranking the harness cannot know)."""
    from reference import routing

    if layer.custom_routing_function is not None and not layer.use_grouped_topk:
        return None
    logits = arrays.to_numpy(router_logits)
    valid = None
    if layer.use_grouped_topk:   # grouped_topk's scores: softmax in the logits' dtype
        scores, valid = routing.grouped_scores(logits, layer.scoring_func)
    else:                        # vLLM's topk kernels: a non-finite score is 0
        scores = routing.topk_scores(logits, layer.scoring_func)
    if layer.e_score_correction_bias is not None:
        scores = scores + layer.e_score_correction_bias[None, :].astype(np.float32)
    if valid is not None:
        scores = np.where(valid, scores, -np.inf)
    return scores.astype(np.float32)


def compare_ids(got, want, scores, num_choices) -> dict:
    """Routing ids: exact except swaps at near-ties (scores within TIE_ULPS fp32 ulps).

    Returns {status, ids, near_tie_rows (bool [T]), mismatched_rows, detail}."""
    t = want.shape[0]
    res = {"near_tie_rows": np.zeros(t, bool), "mismatched_rows": 0, "detail": ""}
    if tuple(got.shape) != tuple(want.shape):
        res.update(status="fail", ids="shape", detail=f"topk_ids shape: expected "
                   f"{tuple(want.shape)}, got {tuple(got.shape)}")
        return res
    problems = []
    if np.dtype(got.dtype) != np.dtype(want.dtype):
        problems.append(f"topk_ids dtype: expected {want.dtype}, got {got.dtype}")
    g = np.asarray(got).astype(np.int64)
    w = np.asarray(want).astype(np.int64)
    bad_rows = np.flatnonzero((g != w).any(axis=1))
    mismatched = 0
    for r in bad_rows:
        row = g[r]
        tie = scores is not None and bool(((row >= 0) & (row < num_choices)).all()) \
            and len(set(row.tolist())) == row.size
        if tie:
            for k in np.flatnonzero(row != w[r]):
                sa, sb = scores[r, w[r, k]], scores[r, row[k]]
                if not (np.isfinite(sa) and np.isfinite(sb)):
                    tie = False
                    break
                ulp = np.spacing(np.float32(max(abs(sa), abs(sb))))
                if abs(float(sa) - float(sb)) > TIE_ULPS * float(ulp):
                    tie = False
                    break
        if tie:
            res["near_tie_rows"][r] = True
        else:
            mismatched += 1
    res["mismatched_rows"] = mismatched
    n_ties = int(res["near_tie_rows"].sum())
    if mismatched:
        problems.append(f"topk_ids: {mismatched}/{t} token(s) route to other experts")
        ids = f"{mismatched}/{t} rows differ"
    else:
        ids = "exact" if not n_ties else f"exact but {n_ties} near-tie swap(s)"
    res.update(status="fail" if problems else "ok", ids=ids, detail="; ".join(problems))
    return res


def compare_align(got, want, num_slots, block_size) -> dict:
    """(sorted_token_ids, expert_ids, num_tokens_post_padded) against the reference's."""
    gs, ge, gn = (np.asarray(v) for v in got)
    ws, we, wn = want
    problems = []
    for name, g, w in (("sorted_token_ids", gs, ws), ("expert_ids", ge, we),
                       ("num_tokens_post_padded", gn, wn)):
        if g.dtype != w.dtype:
            problems.append(f"{name} dtype: expected {w.dtype}, got {g.dtype}")
        if g.shape != w.shape:
            problems.append(f"{name} shape: expected {w.shape}, got {g.shape}")
    if problems:
        return {"status": "fail", "ids": "shape/dtype", "detail": "; ".join(problems)}
    n = int(wn.ravel()[0])
    if int(gn.ravel()[0]) != n:
        problems.append(f"num_tokens_post_padded: expected {n}, got {int(gn.ravel()[0])}")
    if not np.array_equal(ge, we):
        diff = int(np.count_nonzero(ge != we))
        problems.append(f"expert_ids: {diff} of {we.size} blocks differ")
    if not problems:
        if np.any(gs[n:] != num_slots):
            problems.append(f"sorted_token_ids: entries past num_tokens_post_padded ({n}) "
                            f"must be the padding value {num_slots}")
        blocks = we[: n // block_size]
        starts = np.flatnonzero(np.r_[True, blocks[1:] != blocks[:-1]]) if blocks.size else []
        ends = list(starts[1:]) + [blocks.size]
        bad_runs = 0
        for a, b in zip(starts, ends):
            lo, hi = a * block_size, b * block_size
            if not np.array_equal(np.sort(gs[lo:hi]), np.sort(ws[lo:hi])):
                bad_runs += 1
        if bad_runs:
            problems.append(f"sorted_token_ids: {bad_runs} expert run(s) hold other slots")
    if problems:
        return {"status": "fail", "ids": "differ", "detail": "; ".join(problems)}
    same_order = np.array_equal(gs, ws)
    return {"status": "ok", "ids": "exact" if same_order else "exact (as sets per expert)",
            "detail": ""}


# ----------------------------------------------------------------------------- progress
class _Progress:
    """Lines on stderr for a backend that runs longer than PROGRESS_AFTER_S seconds: one
    when it passes the mark (from a timer, even in the middle of a stage), then one per
    stage it starts, and one when it is done. Nothing for a faster backend, nothing at all
    when quiet."""

    def __init__(self, quiet):
        self.quiet = quiet
        self.after = PROGRESS_AFTER_S          # read per call: tests and users may change it
        self.lock = threading.Lock()
        self.timer = None
        self.name = self.current = None
        self.t0 = 0.0
        self.loud = False
        self.token = 0

    def _say(self, text):
        print(f"validate: {self.name}: {text}", file=sys.stderr, flush=True)

    def _elapsed(self):
        return time.perf_counter() - self.t0

    def _cancel(self):
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def backend(self, name):
        self.done()
        self.name, self.t0, self.loud, self.current = name, time.perf_counter(), False, None

    def stage(self, stage):
        if self.quiet:
            return
        with self.lock:
            self._cancel()
            self.current = stage
            self.token += 1
            if not self.loud and self._elapsed() >= self.after:
                self.loud = True
            if self.loud:
                self._say(f"{stage} ({self._elapsed():.1f} s so far)")
                return
            self.timer = threading.Timer(self.after - self._elapsed(), self._wake,
                                         args=(self.token,))
            self.timer.daemon = True
            self.timer.start()

    def _wake(self, token):
        with self.lock:
            if token != self.token or self.loud or self.name is None:
                return                      # that stage is over: the next one will tell
            self.loud = True
            self._say(f"{self.current} ({self._elapsed():.1f} s so far, still running)")

    def done(self):
        with self.lock:
            self._cancel()
            self.token += 1
            if self.loud and not self.quiet:
                self._say(f"done in {self._elapsed():.1f} s")
            self.name, self.loud = None, False


# ----------------------------------------------------------------------------- the harness
def _host(backend, v):
    return None if v is None else backend.get(v)


def _exact_call(call):
    """The reference stage on float64 copies of the same inputs."""
    import reference

    fn = getattr(reference, STAGE_FUNCTIONS[call.stage])
    args = tuple(reference.exact(a) for a in call.args)
    kwargs = {k: reference.exact(v) for k, v in call.kwargs.items()}
    if call.stage == "route":
        # routing math is fp32 by contract: the correction bias stays as the engine has it
        kwargs["e_score_correction_bias"] = call.kwargs.get("e_score_correction_bias")
    return fn(*args, **kwargs)


def _stage_row(backend, stage, **kw):
    row = {"backend": backend, "stage": stage, "status": "ok", "dtype": None, "tol": None,
           "max_abs_err": None, "rel_err": None, "ids": None, "near_ties": 0, "detail": ""}
    row.update(kw)
    return row


def written_rows(align_outputs, num_slots):
    """bool [P]: the slots alignment scheduled, the only rows of the GEMM and activation
    outputs a kernel writes (a slot routed nowhere, id -1, is skipped: its rows hold
    whatever the memory held, in every backend differently), or None when that is all."""
    sorted_ids, _, ntpp = (np.asarray(arrays.to_numpy(v)) for v in align_outputs)
    live = sorted_ids[:int(ntpp.reshape(-1)[0])]
    rows = np.zeros(num_slots, dtype=bool)
    rows[live[live < num_slots]] = True
    return None if rows.all() else rows


def _judge_stage(stage, got, want_exact, want_engine, call, scores, layer, rows=None):
    """One stage's row fields from the backend's outputs (host) vs exact and engine outputs.
    rows: the slots to judge in the GEMM / activation outputs (written_rows)."""
    if stage == "route":
        tw, ids, zr = (got + (None,) * 3)[:3] if isinstance(got, tuple) else (got, None, None)
        ew, _, ez = want_exact
        cmp_ids = compare_ids(ids, want_engine[1], scores, layer.num_router_experts) \
            if ids is not None else {"status": "fail", "ids": "missing", "detail": "no topk_ids",
                                     "near_tie_rows": np.zeros(ew.shape[0], bool)}
        keep = ~cmp_ids["near_tie_rows"]
        fw = compare_float(tw, ew, want_engine[0].dtype, rows=keep)
        fz = compare_float(zr, ez, want_engine[2].dtype if want_engine[2] is not None
                           else np.float32, rows=keep if ez is not None else None)
        status = "fail" if "fail" in (cmp_ids["status"], fw["status"], fz["status"]) else "ok"
        # the row's numbers are topk_weights'; the zero-expert result (in x's dtype, with
        # its own tolerance) is summarised in the detail
        details = [("topk_weights " + fw["detail"]) if fw["detail"] else "", cmp_ids["detail"]]
        if ez is not None:
            details.append(f"zero_expert_result rel err {_fmt(fz['rel_err'])} "
                           f"(tol {_fmt(fz['tol'])})" + (": " + fz["detail"] if fz["detail"]
                                                          else ""))
        return dict(status=status, dtype=fw["dtype"], tol=fw["tol"],
                    max_abs_err=fw["max_abs_err"], rel_err=fw["rel_err"],
                    ids=cmp_ids["ids"], near_ties=int(cmp_ids["near_tie_rows"].sum()),
                    detail="; ".join(d for d in details if d)), cmp_ids["near_tie_rows"]
    if stage == "align":
        if not isinstance(got, tuple) or len(got) != 3:
            return dict(status="fail", detail="expected 3 outputs"), None
        num_slots = int(np.asarray(call.args[0]).size)
        res = compare_align(got, want_engine, num_slots, int(call.args[1]))
        return dict(status=res["status"], ids=res["ids"], detail=res["detail"]), None
    res = compare_float(got, want_exact, want_engine.dtype,
                        rows=rows if stage in ("gemm1", "activation", "gemm2") else None)
    return dict(status=res["status"], dtype=res["dtype"], tol=res["tol"],
                max_abs_err=res["max_abs_err"], rel_err=res["rel_err"],
                detail=res["detail"]), None


def validate(layer, hidden_states, router_logits, backends=None, *, stages=STAGES, dtype=None,
             end_to_end=True, quiet=False) -> ValidationReport:
    """Run `layer` on the inputs through each backend, stage by stage and end to end.

    layer: a sandbox.FusedMoE (its own stage mapping is ignored: each backend runs every
    stage). backends: names (default: all of sandbox.registry.BACKENDS, the reference
    included: its row shows the engine's rounding against the exact answer). A backend
    that cannot run here is listed in `skipped` with the reason; the report is not ok when
    no backend but the reference ran. On a machine without a GPU the numba backend runs in
    the CUDA simulator (about 2,000 threads a second): give it a few tokens, as the CLI does.
    stages: the stages to judge. dtype: run the layer (and hidden_states) in this dtype
    instead of params_dtype; router_logits keep theirs.
    quiet: no progress lines. Otherwise a backend that runs longer than PROGRESS_AFTER_S
    (3 s) prints a line per stage to stderr; a fast run prints nothing.
    """
    backends = list(BACKENDS if backends is None else backends)
    for name in backends:
        if name not in BACKENDS:
            raise ValueError(f"backends: unknown backend {name!r}; expected names from "
                             f"{list(BACKENDS)}")
    stages = tuple(stages)
    for s in stages:
        if s not in STAGES:
            raise ValueError(f"stages: unknown stage {s!r}; expected stages from {list(STAGES)}")
    if dtype is not None:
        layer = layer.to_dtype(dtype)
    x = np.asarray(arrays.to_numpy(hidden_states)).astype(layer.params_dtype)
    logits = np.asarray(arrays.to_numpy(router_logits))

    ref = get_backend("reference")
    ref.require()
    t = int(x.shape[0])

    progress = _Progress(quiet)

    @functools.lru_cache(maxsize=None)
    def reference_at(block):
        """The reference's stage calls and their exact outputs, at one block size."""
        progress.stage(f"the reference's stages at block size {block}")
        _, trace = layer.run_stages(x, logits, backend="reference", block_size=block)
        calls = {c.stage: c for c in trace}
        return calls, {s: VQ.exact_call(c) if VQ.is_quant_call(c) else _exact_call(c)
                       for s, c in calls.items()}

    try:                                  # no progress timer outlives the call
        exact_e2e = None
        if end_to_end:
            progress.backend("reference")
            progress.stage("the exact end-to-end answer")
            exact_e2e, _ = layer.run_stages(x, logits, backend="reference", exact=True)
            if layer.quant_config is not None:
                # a quantized layer's end to end is judged against the reference's
                # quantized layer; the exact dequantized answer gives the reference a row
                # of its own (validate_quant.py)
                exact_e2e = (layer.run_stages(x, logits, backend="reference")[0], exact_e2e)
            progress.done()
        return _validate_backends(layer, x, logits, backends, stages, end_to_end, t,
                                  reference_at, exact_e2e, progress)
    finally:
        progress.done()


def _validate_backends(layer, x, logits, backends, stages, end_to_end, t, reference_at,
                       exact_e2e, progress) -> ValidationReport:
    """validate's loop over the backends (its arguments already checked)."""
    scores = selection_scores(layer, logits)
    ref_block = layer.block_size_for("reference", t)

    report = ValidationReport(meta={
        "T": t, "E": layer.num_experts, "K": layer.top_k, "H": layer.hidden_size,
        "I": layer.intermediate_size, "dtype": str(layer.params_dtype), "block_size": ref_block,
        "block_sizes": {}, "layer": repr(layer), "stages": list(stages), "backends": backends,
        "logits_dtype": str(logits.dtype),
        "nan_rows": int(np.isnan(logits).any(axis=1).sum()) if logits.size else 0,
    })
    for name in backends:
        b = get_backend(name)
        if not b.ok:
            report.skipped[name] = b.reason
            report.rows.append(_stage_row(name, "*", status="skipped", detail=b.reason))
            continue
        progress.backend(name)
        # each backend is judged at its own block size (its GEMM's BLOCK_M): the reference
        # is re-run there, so the alignment it is compared with is the one it must produce
        block = layer.block_size_for(name, t)
        report.meta["block_sizes"][name] = block
        calls, exact_out = reference_at(block)
        written = written_rows(calls["align"].outputs, t * layer.top_k)
        ties = np.zeros(t, bool)
        first = None
        complete = True
        qc = layer.quant_config
        for stage in VQ.stage_order(layer):
            quant = VQ.is_quant_call(calls[stage])
            if not (b.has_quant_stage(stage) if quant else b.has_stage(stage)):
                complete = False
                if VQ.asked(stage, stages):
                    report.rows.append(_stage_row(
                        name, stage, status="skipped",
                        detail=VQ.missing_detail(name, stage) if quant
                        else f"{name} has no {STAGE_FUNCTIONS[stage]} yet"))
                continue
            if not VQ.asked(stage, stages):
                continue
            call = calls[stage]
            progress.stage(stage)
            try:
                if quant:
                    got = VQ.run_call(b, call, qc.weight_dtype == "fp8")
                    fields = VQ.judge(stage, got, exact_out[stage], call.outputs, layer,
                                      written if stage.startswith("gemm") else None,
                                      compare_float)
                    tie_rows = None
                else:
                    args = tuple(b.take(a) for a in call.args)
                    kwargs = {k: b.take(v) for k, v in call.kwargs.items()}
                    out = b.stage_fn(stage)(*args, **kwargs)
                    got = (tuple(_host(b, v) for v in out) if isinstance(out, tuple)
                           else _host(b, out))
                    fields, tie_rows = _judge_stage(stage, got, exact_out[stage],
                                                    call.outputs, call, scores, layer, written)
            except Exception as e:  # a backend that raises has diverged at this stage
                fields, tie_rows = dict(status="error",
                                        detail=f"{type(e).__name__}: {e}".splitlines()[0]), None
            if tie_rows is not None:
                ties |= tie_rows
            report.rows.append(_stage_row(name, stage, **fields))
            if first is None and fields["status"] in _FAILING:
                first = stage
        if end_to_end:
            if not complete:
                report.rows.append(_stage_row(name, END_TO_END, status="skipped",
                                              detail="not every stage is implemented"))
            else:
                progress.stage(END_TO_END)
                want_e2e = exact_e2e if qc is None else exact_e2e[0]
                try:
                    got = layer.with_backend(name).forward(x, logits)
                    res = compare_float(got, want_e2e, layer.params_dtype,
                                        rows=~ties if ties.any() else None,
                                        tol=None if qc is None else VQ.tolerance(qc))
                    fields = dict(status=res["status"], dtype=res["dtype"], tol=res["tol"],
                                  max_abs_err=res["max_abs_err"], rel_err=res["rel_err"],
                                  near_ties=int(ties.sum()), detail=res["detail"])
                except Exception as e:
                    fields = dict(status="error",
                                  detail=f"{type(e).__name__}: {e}".splitlines()[0])
                report.rows.append(_stage_row(name, END_TO_END, **fields))
                if first is None and fields["status"] in _FAILING:
                    first = END_TO_END
                if qc is not None and name == "reference":
                    fields = VQ.dequantized_row(exact_e2e[0], exact_e2e[1], layer,
                                                compare_float)
                    report.rows.append(_stage_row(name, VQ.DEQUANTIZED, **fields))
                    if first is None and fields["status"] in _FAILING:
                        first = VQ.DEQUANTIZED
        report.first_divergence[name] = first
        if not any(r["backend"] == name and r["status"] != "skipped" for r in report.rows):
            del report.first_divergence[name]          # it ran nothing: no verdict of its own
            missing = [STAGE_FUNCTIONS[s] for s in stages if not b.has_stage(s)]
            report.skipped[name] = (f"no stage asked for is implemented "
                                    f"({', '.join(dict.fromkeys(missing))} missing)"
                                    if missing else "no stage asked for")
    return report
