"""What the workshop notebooks share: the run mode, figures, source listings, tables, results.

Each notebook starts with one parameters cell that calls `setup("NN_name")`:

    mode        "cpu": the NumPy reference, torch on the CPU and the Numba kernels in the
                CUDA simulator (NUMBA_ENABLE_CUDASIM=1, set here before numba is imported);
                "gpu": the real CuPy and Numba kernels. Detected (CuPy sees a CUDA device or
                not) unless MOE_SANDBOX_NOTEBOOK_MODE=cpu|gpu says otherwise.
    figures     `show(fig, "name")` displays a matplotlib figure in JupyterLab and, when
                MOE_SANDBOX_FIGURES is set, also saves it as $MOE_SANDBOX_FIGURES/NN_name_name.png.
                Outside a notebook (`python notebooks/NN_name.py`) the Agg backend is used and
                nothing blocks.
    listings    `show_source(path, start)` shows a kernel (or part of one) with syntax colours.
    results     `load_results(prefix)` reads the JSON that benchmarks/ wrote to
                benchmarks/results/ (none yet is a normal state: callers say so and go on).
    ring        `ring_run(...)`: notebook 07's step-by-step model of v6's mbarrier ring
                (`MBarrier`, the kernel's producer and consumer loops, a protocol checker),
                shared with its solutions.
    EP ranks    `launch_ranks(fn, W)` runs sandbox.ep.launch from a notebook or from the script
                form of one; the rank functions of notebook 05 live here because spawned
                processes import them by name.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import sys

MODE_ENV = "MOE_SANDBOX_NOTEBOOK_MODE"
FIGURES_ENV = "MOE_SANDBOX_FIGURES"
MODES = ("cpu", "gpu")


def _find_repo() -> pathlib.Path:
    """The repository root: the folder above notebooks/ (or $MOE_SANDBOX_REPO)."""
    env = os.environ.get("MOE_SANDBOX_REPO")
    if env:
        return pathlib.Path(env).resolve()
    return pathlib.Path(__file__).resolve().parents[1]


REPO = _find_repo()
# first on the path: the source tree wins over any installed copy of the project
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

_state = {"notebook": None, "mode": None}


# ----------------------------------------------------------------------------- mode
@dataclasses.dataclass(frozen=True)
class Setup:
    """The run mode of a notebook: `mode` "cpu" or "gpu", and why."""

    notebook: str
    mode: str
    why: str

    @property
    def gpu(self) -> bool:
        return self.mode == "gpu"

    def __str__(self):
        what = ("the real CuPy and Numba kernels on the GPU" if self.gpu else
                "the NumPy reference, torch on the CPU, Numba kernels in the CUDA simulator")
        return f"{self.notebook}: mode {self.mode} ({self.why}): {what}"


def in_notebook() -> bool:
    """True inside a Jupyter kernel (JupyterLab, nbclient), False for `python file.py`."""
    ip = sys.modules.get("IPython")
    if ip is None:
        return False
    shell = ip.get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def detect_mode() -> tuple[str, str]:
    """(mode, why): MOE_SANDBOX_NOTEBOOK_MODE when set, else "gpu" if CuPy sees a device.
    A forced "gpu" without a usable device is an error here, not halfway through a notebook."""
    env = os.environ.get(MODE_ENV, "").strip().lower()
    if env and env not in MODES:
        raise ValueError(f"{MODE_ENV}: expected one of {list(MODES)}, got {env!r}")
    if env == "cpu":
        return env, f"{MODE_ENV}={env}"
    from cuda_kernels.cupy import availability  # imports CuPy only, never numba

    ok, why = availability()
    if env == "gpu":
        if not ok:
            raise RuntimeError(f"{MODE_ENV}: expected a GPU that CuPy can use for 'gpu', got "
                               f"none ({why}); unset it or set it to 'cpu'")
        return env, f"{MODE_ENV}={env}"
    if ok:
        return "gpu", "CuPy sees a CUDA device"
    return "cpu", f"no GPU: {why}"


def setup(notebook: str) -> Setup:
    """Choose the mode, prepare numba and matplotlib for it, remember the notebook's name
    (figures are saved as <notebook>_<name>.png). Call it before importing numba."""
    mode, why = detect_mode()
    if mode == "cpu":
        if "numba" in sys.modules and os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
            print("warning: numba was imported before setup(): the CUDA simulator cannot be "
                  "switched on now; restart the kernel and run this cell first")
        # the simulator is chosen when numba is first imported
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    if not in_notebook():
        import matplotlib

        matplotlib.use("Agg")   # a script must never wait on a window
    import matplotlib.pyplot as plt

    plt.rcParams.update({"figure.dpi": 100, "savefig.dpi": 120, "axes.grid": True,
                         "grid.alpha": 0.3, "axes.spines.top": False,
                         "axes.spines.right": False, "font.size": 10})
    _state.update(notebook=notebook, mode=mode)
    s = Setup(notebook, mode, why)
    print(s)
    return s


# ----------------------------------------------------------------------------- display
def _display(obj, text: str):
    if in_notebook():
        from IPython.display import display

        display(obj)
    else:
        print(text)


def show(fig, name: str):
    """Display `fig` (in a notebook), save it when MOE_SANDBOX_FIGURES is set, close it."""
    import matplotlib.pyplot as plt

    out = os.environ.get(FIGURES_ENV)
    if out:
        folder = pathlib.Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{_state['notebook'] or 'figure'}_{name}.png"
        fig.savefig(path, bbox_inches="tight")
        if not in_notebook():
            print(f"figure: {path}")
    if in_notebook():
        from IPython.display import display

        display(fig)
    plt.close(fig)


def show_md(text: str):
    """Markdown in a notebook, plain text in a script."""
    if in_notebook():
        from IPython.display import Markdown

        _display(Markdown(text), text)
    else:
        print(text)


def show_table(headers, rows, floatfmt: str = ".3g"):
    """A small table: Markdown in a notebook, aligned text in a script."""
    def cell(v):
        if isinstance(v, float):
            return format(v, floatfmt)
        return "" if v is None else str(v)

    body = [[cell(v) for v in row] for row in rows]
    if in_notebook():
        lines = ["| " + " | ".join(map(str, headers)) + " |",
                 "|" + "|".join("---" for _ in headers) + "|"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in body]
        show_md("\n".join(lines))
        return
    widths = [max(len(str(h)), *(len(r[i]) for r in body)) if body else len(str(h))
              for i, h in enumerate(headers)]
    print("  ".join(str(h).ljust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for r in body:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


_LANGS = {".cu": "cuda", ".cuh": "cuda", ".py": "python", ".json": "json"}


def show_code(text: str, language: str = "python", title: str | None = None):
    """Source text with syntax colours in a notebook (pygments through IPython), plain in
    a script."""
    if in_notebook():
        from IPython.display import Code, display

        if title:
            show_md(f"`{title}`")
        display(Code(text, language=language))
    else:
        if title:
            print(f"--- {title}")
        print(text)


def excerpt(path, start: str, end: str | None = None, max_lines: int = 60,
            stop: str | None = None) -> tuple[str, int, int]:
    """Lines of a repository file from the first line containing `start`:
    up to the first later line containing `end` (inclusive), or up to the line before the
    first later line containing `stop`, else the whole block that begins there (braces
    balanced for C++, the indented body for Python).
    Returns (text, first line, last line), 1-based. A missing marker gives the file's head
    (sources change; a listing must not break a notebook)."""
    p = REPO / path
    lines = p.read_text().splitlines()
    i0 = next((i for i, line in enumerate(lines) if start in line), None)
    if i0 is None:
        i1 = min(len(lines), max_lines) - 1
        note = f"// (marker {start!r} not found: the head of the file)" if p.suffix in (
            ".cu", ".cuh") else f"# (marker {start!r} not found: the head of the file)"
        return note + "\n" + "\n".join(lines[:i1 + 1]), 1, i1 + 1
    if end is not None:
        i1 = next((i for i in range(i0 + 1, len(lines)) if end in lines[i]), len(lines) - 1)
    elif stop is not None:
        i1 = next((i for i in range(i0 + 1, len(lines)) if stop in lines[i]), len(lines)) - 1
        while i1 > i0 and not lines[i1].strip():
            i1 -= 1
    elif p.suffix in (".cu", ".cuh"):
        depth, seen, i1 = 0, False, len(lines) - 1
        for i in range(i0, len(lines)):
            code = re.sub(r"//.*", "", lines[i])
            depth += code.count("{") - code.count("}")
            seen = seen or "{" in code
            if seen and depth <= 0:
                i1 = i
                break
    else:
        indent = len(lines[i0]) - len(lines[i0].lstrip())
        i1 = i0
        for i in range(i0 + 1, len(lines)):
            s = lines[i]
            if s.strip() and len(s) - len(s.lstrip()) <= indent and not s.lstrip().startswith(")"):
                break
            i1 = i
        while i1 > i0 and not lines[i1].strip():
            i1 -= 1
    chunk = lines[i0:i1 + 1]
    if len(chunk) > max_lines:
        cut = len(chunk) - max_lines
        comment = "//" if p.suffix in (".cu", ".cuh") else "#"
        chunk = chunk[:max_lines] + [f"{comment} ... ({cut} more lines in {path})"]
        i1 = i0 + max_lines - 1
    return "\n".join(chunk), i0 + 1, i1 + 1


def show_source(path, start: str, end: str | None = None, max_lines: int = 60,
                stop: str | None = None):
    """Show `excerpt(path, start, end, max_lines, stop)` with its file name and line numbers."""
    text, a, b = excerpt(path, start, end, max_lines, stop)
    show_code(text, _LANGS.get(pathlib.Path(path).suffix, "text"), title=f"{path}, lines {a}-{b}")


# ----------------------------------------------------------------------------- numbers
def rel_err(got, want) -> float:
    """||got - want||_F / ||want||_F in float64 (the project's parity measure); NaN in
    `got` where `want` has none gives nan, i.e. never passes."""
    import numpy as np

    a = np.asarray(got, dtype=np.float64)
    b = np.asarray(want, dtype=np.float64)
    if np.isnan(a).any() and not np.isnan(b).any():
        return float("nan")
    d = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (d if d > 0 else 1.0))


def nvrtc_ready() -> bool:
    """Whether NVRTC can compile the CUDA sources here (no GPU needed); says what to install
    when it cannot, so a section that compiles can skip itself."""
    from cuda_kernels.cupy import _compile

    ok, why = _compile.nvrtc_available()
    if not ok:
        print(f"NVRTC is not usable here ({why}); `pip install cuda-core nvidia-cuda-nvrtc` "
              "enables this section.")
    return ok


def time_gpu_ms(fn, warmup: int = 3, reps: int = 20) -> float:
    """Median milliseconds of fn() by the one GPU timer (cuda_kernels/timing.py), as an eager
    caller sees it: each call starts from an idle GPU, so the CUDA events bracket the Python
    call too and small kernels show their launch overhead, and the inputs stay in the 50 MB
    L2 between repetitions (benchmarks/ flush it, and re-draw the routing, for the numbers
    we report). CuPy's events first: Numba's launches use the same default stream."""
    from cuda_kernels import timing

    return timing.time_cuda(fn, warmup, reps, flush_l2=False, mode="eager",
                            api=timing.cuda_api("cupy")).median


def plot_eager_times(times: dict, tokens, title: str, name: str):
    """µs per eager call against T, log-log, one line per kernel: `times` maps a kernel's name
    to its time_gpu_ms milliseconds at each of `tokens`."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.4))
    for kernel, ms in times.items():
        ax.plot(tokens, [m * 1e3 for m in ms], marker="o", label=kernel)
    ax.set(xscale="log", yscale="log", xlabel="tokens T", ylabel="µs per call (eager)",
           title=title)
    ax.legend()
    show(fig, name)


def load_results(prefix: str) -> list[tuple[pathlib.Path, dict]]:
    """The JSON files benchmarks/results/<prefix>*.json, oldest first; [] when none."""
    folder = REPO / "benchmarks" / "results"
    out = []
    for path in sorted(folder.glob(f"{prefix}*.json")):
        try:
            out.append((path, json.loads(path.read_text())))
        except (OSError, ValueError) as e:
            print(f"skipping {path.name}: {e}")
    return out


def stage_points(stages) -> list[dict]:
    """The committed per-stage GPU timings of `stages` (a name or a tuple of names):
    benchmarks/results/bench_cupy_stages_*.json (CuPy) and bench_numba_*.json (Numba, with
    CuPy beside it in the same run). One dict per point: source (file name), model, T, stage,
    backend ("cupy", "numba", or "numba-v3" / "cupy-v4" for GEMM rungs), device_us and
    eager_us (medians), and flops / tflops / gbps when the benchmark recorded them."""
    stages = (stages,) if isinstance(stages, str) else tuple(stages)
    out = []
    for prefix, default in (("bench_cupy_stages", "cupy"), ("bench_numba", None)):
        for path, rec in load_results(prefix):
            for p in rec.get("points", []):
                if not isinstance(p, dict) or p.get("stage") not in stages:
                    continue
                dev = (p.get("device_us") or {}).get("median")
                if dev is None:
                    continue
                out.append({"source": path.name, "model": p.get("model", "?"), "T": p.get("T"),
                            "stage": p["stage"], "backend": p.get("backend", default),
                            "device_us": dev, "eager_us": (p.get("eager_us") or {}).get("median"),
                            "flops": p.get("flops"), "tflops": p.get("tflops"),
                            "gbps": p.get("gbps")})
    return out


def plot_stage_times(stage: str, name: str, title: str):
    """One panel per model: the committed device time of `stage` against T, one line per
    (backend, results file). Prints why when there is nothing committed yet."""
    import matplotlib.pyplot as plt

    pts = stage_points(stage)
    if not pts:
        print(f"No committed GPU timings of '{stage}' in benchmarks/results/ yet: "
              "benchmarks/bench_cupy_stages.py and benchmarks/bench_numba.py write them on a GPU.")
        return
    models = list(dict.fromkeys(p["model"] for p in pts))
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.4), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [p for p in pts if p["model"] == model]
        for key in dict.fromkeys((p["backend"], p["source"]) for p in mine):
            q = sorted((p for p in mine if (p["backend"], p["source"]) == key),
                       key=lambda p: p["T"])
            ax.plot([p["T"] for p in q], [p["device_us"] for p in q], marker="o",
                    label=f"{key[0]} ({key[1][:28]})")
        ax.set(xscale="log", yscale="log", xlabel="tokens T", ylabel="µs (device, median)",
               title=model)
        ax.legend(fontsize=6)
    fig.suptitle(title, y=1.03)
    show(fig, name)


# ----------------------------------------------------------------------------- cubins
def cubin_resources(cubin: bytes) -> dict:
    """{kernel: {"registers", "static_shared_bytes", "code_bytes"}} read from a cubin (an ELF
    file), what `cuobjdump --dump-resource-usage` prints, without the CUDA toolkit.

    Registers per thread are EIATTR_REGCOUNT (attribute 0x2f) in the `.nv.info` section:
    (symbol index, count) pairs; static shared memory is the size of `.nv.shared.<kernel>`;
    code is the size of `.text.<kernel>`. Dynamic shared memory is a launch argument and
    does not appear here."""
    import struct

    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    hdrs = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize)
            for i in range(shnum)]

    def name(h):
        start = hdrs[shstrndx][4] + h[0]
        return cubin[start:cubin.index(b"\0", start)].decode()

    named = [(name(h), h) for h in hdrs]
    out, by_index = {}, {}
    symtab = next((h for n, h in named if n == ".symtab"), None)
    strtab = next((h for n, h in named if n == ".strtab"), None)
    if symtab is not None and strtab is not None:
        for i in range(symtab[5] // 24):              # Elf64_Sym: 24 bytes
            st_name, = struct.unpack_from("<I", cubin, symtab[4] + 24 * i)
            start = strtab[4] + st_name
            by_index[i] = cubin[start:cubin.index(b"\0", start)].decode()
    for n, h in named:
        if n.startswith(".text."):
            out.setdefault(n[6:], {})["code_bytes"] = h[5]
        elif n.startswith(".nv.shared.") and not n.startswith(".nv.shared.reserved"):
            out.setdefault(n[11:], {})["static_shared_bytes"] = h[5]
        elif n == ".nv.info":
            data = cubin[h[4]:h[4] + h[5]]
            i = 0
            while i + 2 <= len(data):
                fmt, attr = data[i], data[i + 1]
                i += 2
                size = {1: 0, 2: 1, 3: 2}.get(fmt)
                if size is None:                      # 4: a u16 length, then the payload
                    size, = struct.unpack_from("<H", data, i)
                    i += 2
                if attr == 0x2F and size == 8:        # EIATTR_REGCOUNT
                    sym, regs = struct.unpack_from("<II", data, i)
                    out.setdefault(by_index.get(sym, f"symbol {sym}"), {})["registers"] = regs
                i += size
    for v in out.values():
        v.setdefault("static_shared_bytes", 0)
    return out


# ----------------------------------------------------------------------------- the mbarrier ring
class MBarrier:
    """A shared-memory mbarrier as PTX defines it, for notebook 07's model of v6's ring.

    A phase completes when `count` arrivals have been made and every transaction byte that
    an arrival announced (`expect_tx`) has been counted down by the copy engine
    (`complete_tx`); the next phase then starts with the count re-armed. `try_wait(parity)`
    is true once the phase of that parity has completed, i.e. while the current (incomplete)
    phase has the other parity: a wait with parity 1 on a fresh barrier passes at once."""

    def __init__(self, count: int):
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def arrive(self, expect_tx: int = 0):
        self.tx += expect_tx
        self.pending -= 1
        self._complete()

    def complete_tx(self, nbytes: int):
        self.tx -= nbytes
        self._complete()

    def _complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def try_wait(self, parity: int) -> bool:
        return (self.phase & 1) != parity


def ring_run(k_tiles: int = 6, tiles: int = 2, stages: int = 4, consumers: int = 2,
             copy_steps: int = 4, mma_steps: int = 1, epilogue_steps: int = 4,
             release_early: bool = False, producer_parity: int = 1,
             max_steps: int = 400) -> dict:
    """v6's ring (cuda_kernels/cupy/gemm_v6_tma_ws.cu) as a step-by-step model to watch and
    to break: the kernel's loops, the kernel's barriers, time in abstract steps.

    One producer (its warpgroup's 128 cp.async arrivals count as one here, so a full barrier
    expects 2: the arrive.expect_tx of the TMA issuer and the cp.async one) and `consumers`
    consumer warpgroups (an empty barrier expects one arrival per consumer; the kernel: one
    per consumer warp). Each of the CTA's `tiles` tiles takes `k_tiles` ring stages; copies
    land `copy_steps` after issue; a wgmma batch holds the SM's tensor cores for `mma_steps`
    (all consumers' batches queue for them); each tile ends with an epilogue of
    `epilogue_steps` in the consumers, while the producer goes on filling the ring.
    release_early: a consumer arrives on empty[slot] right after issuing its batch, before
    wgmma.wait_group says the batch is done (a bug); producer_parity: the producer waits on
    empty[slot] with parity phase ^ producer_parity (the kernel: 1).
    A checker records each copy issued into a slot that a wgmma batch still reads, and each
    batch issued on a slot that does not hold its landed (tile, k) data.

    Returns {"done": all agents finished (False: a deadlock), "steps", "violations" [str],
    "spans" [(kind, row, start, end)] with kind "copy" (row = slot), "mma" (row = slot,
    one span per consumer batch), "epilogue" / "stall" (row = consumer; a stall is a wait
    on a full barrier), "stall_steps" [per consumer]}."""
    full = [MBarrier(2) for _ in range(stages)]
    empty = [MBarrier(consumers) for _ in range(stages)]
    clock = {"now": 0, "tc_free": 0}
    events = []                                   # (due step, action)
    content = [None] * stages                     # (tile, k) of the last copy into a slot
    landed = [False] * stages
    readers = [set() for _ in range(stages)]      # (consumer, tile, k) of unfinished batches
    inflight = [[] for _ in range(consumers)]     # each consumer's unfinished batches
    spans, violations, stall = [], [], [0] * consumers
    TILE_B = 1                                    # the TMA's bytes (any non-zero count)

    def later(steps, action):
        events.append((clock["now"] + steps, action))

    def producer():
        slot, phase = 0, 0
        for tile in range(tiles):
            for kt in range(k_tiles):
                yield lambda s=slot, p=phase: empty[s].try_wait(p ^ producer_parity)
                if readers[slot]:
                    violations.append(f"step {clock['now']}: the copy of (tile {tile}, k {kt}) "
                                      f"overwrites slot {slot} while wgmma batches "
                                      f"{sorted(readers[slot])} still read it")
                content[slot], landed[slot] = (tile, kt), False
                full[slot].arrive(expect_tx=TILE_B)               # thread 0: arrive.expect_tx
                spans.append(("copy", slot, clock["now"], clock["now"] + copy_steps))

                def land(s=slot):
                    landed[s] = True
                    full[s].complete_tx(TILE_B)                   # the TMA's bytes counted down
                    full[s].arrive()                              # cp.async.mbarrier.arrive
                later(copy_steps, land)
                slot, phase = (0, phase ^ 1) if slot + 1 == stages else (slot + 1, phase)

    def consumer(c):
        slot, phase = 0, 0
        for tile in range(tiles):
            prev = None
            for kt in range(k_tiles):
                t0 = clock["now"]
                yield lambda s=slot, p=phase: full[s].try_wait(p)
                if clock["now"] > t0:
                    spans.append(("stall", c, t0, clock["now"]))
                    stall[c] += clock["now"] - t0
                if content[slot] != (tile, kt) or not landed[slot]:
                    violations.append(f"step {clock['now']}: consumer {c} reads slot {slot} for "
                                      f"(tile {tile}, k {kt}) but it holds {content[slot]}"
                                      f"{'' if landed[slot] else ', not landed'}")
                start = max(clock["now"], clock["tc_free"])       # the tensor cores queue
                clock["tc_free"] = start + mma_steps
                batch = (c, tile, kt)
                readers[slot].add(batch)
                inflight[c].append(batch)
                spans.append(("mma", slot, start, start + mma_steps))

                def finish(s=slot, b=batch):
                    readers[s].discard(b)
                    inflight[b[0]].remove(b)
                later(clock["tc_free"] - clock["now"], finish)
                if release_early:
                    empty[slot].arrive()                          # the bug: still being read
                yield lambda: len(inflight[c]) <= 1               # wgmma.wait_group 1
                if not release_early and prev is not None:
                    empty[prev].arrive()                          # the batch before is done
                prev = slot
                slot, phase = (0, phase ^ 1) if slot + 1 == stages else (slot + 1, phase)
            yield lambda: not inflight[c]                         # wgmma.wait_group 0
            if not release_early and prev is not None:
                empty[prev].arrive()
            spans.append(("epilogue", c, clock["now"], clock["now"] + epilogue_steps))
            end = clock["now"] + epilogue_steps
            yield lambda end=end: clock["now"] >= end

    agents = [producer()] + [consumer(c) for c in range(consumers)]
    waits = [next(a) for a in agents]
    while clock["now"] < max_steps:
        for due, action in sorted((e for e in events if e[0] <= clock["now"]),
                                  key=lambda e: e[0]):
            events.remove((due, action))
            action()
        for i, a in enumerate(agents):
            while waits[i] is not None and waits[i]():
                waits[i] = next(a, None)
        if all(w is None for w in waits) and not events:
            break
        clock["now"] += 1
    return {"done": all(w is None for w in waits), "steps": clock["now"],
            "violations": violations, "spans": spans, "stall_steps": stall}


# ----------------------------------------------------------------------------- EP ranks
def launch_ranks(fn, world_size: int, backend: str = "cpu", **kwargs):
    """sandbox.ep.launch(fn, ...) from a notebook or from its script form.

    Ranks are spawned processes; a spawned child re-runs the parent's main *file* to rebuild
    its globals. In a notebook there is none; for `python notebooks/05_...py` that would run
    the whole notebook again in every rank, so the file name is hidden for the launch (the
    rank functions live in this module, which the children import by name)."""
    from sandbox.ep import launch

    main = sys.modules.get("__main__")
    saved = main.__dict__.pop("__file__", None) if main is not None else None
    try:
        return launch(fn, world_size, backend, **kwargs)
    finally:
        if saved is not None:
            main.__file__ = saved


def _ep_layer_kwargs(cfg):
    return dict(num_experts=cfg.num_experts, top_k=cfg.top_k, hidden_size=cfg.hidden_size,
                intermediate_size=cfg.intermediate_size, params_dtype=cfg.np_dtype,
                renormalize=cfg.renormalize)


def ep_parity_rank(comm, config: dict, tokens_per_rank: list, seed: int = 0,
                   backend: str = "reference"):
    """One rank of notebook 05's parity run: the EP layer (both schemes) against the
    single-device layer on this rank's tokens. Returns a dict of plain numbers."""
    import numpy as np

    from sandbox import FusedMoE
    from sandbox.ep import EPConfig, EPMoE

    cfg = EPConfig(**config)
    single = FusedMoE.random(seed=seed, **_ep_layer_kwargs(cfg))
    total = sum(tokens_per_rank)
    x_all, logits_all = single.random_inputs(total, seed=seed + 1)
    lo = sum(tokens_per_rank[:comm.rank])
    hi = lo + tokens_per_rank[comm.rank]
    x, logits = x_all[lo:hi], logits_all[lo:hi]                      # this rank's tokens
    want = single.forward(x, logits)
    layer = EPMoE(comm, cfg, backend=backend)
    layer.load_from(single)
    out = {"rank": comm.rank, "local_experts": layer.local_logical_experts().tolist()}
    for scheme in ("allgather", "alltoall"):
        twin = layer.with_scheme(scheme)
        got = np.asarray(comm.to_host(twin.forward(x, logits)))
        out[scheme] = {"rel_err": rel_err(got, want), "stats": twin.last_stats}
    return out


def ep_eplb_rank(comm, config: dict, tokens: int, logits_scale: float, hot: list,
                 seed: int = 0, backend: str = "reference"):
    """One rank of notebook 05's EPLB run: a skewed load (experts in `hot` preferred),
    recorded over a few forwards, then `rebalance()`; the outputs before and after the move
    must agree (replicas hold identical weights). Returns the placements, the recorded load
    and the rows each rank computed before and after."""
    import numpy as np

    from sandbox import FusedMoE
    from sandbox.ep import EPConfig, EPMoE

    cfg = EPConfig(**config)
    single = FusedMoE.random(seed=seed, **_ep_layer_kwargs(cfg))
    rng = np.random.default_rng(seed + 10 + comm.rank)
    x = rng.standard_normal((tokens, cfg.hidden_size), dtype=np.float32).astype(cfg.np_dtype)
    logits = rng.standard_normal((tokens, cfg.num_experts), dtype=np.float32)
    logits[:, hot] += np.float32(logits_scale)          # the hot experts win most tokens
    layer = EPMoE(comm, cfg, backend=backend)
    layer.load_from(single)
    before_placement = layer.placement.phys2log.tolist()
    before = np.asarray(comm.to_host(layer.forward(x, logits)))
    rows_before = layer.last_stats.get("rows_received")
    load = layer.load.global_load(comm)                 # summed over ranks (a collective)
    layer.rebalance(load)
    after = np.asarray(comm.to_host(layer.forward(x, logits)))
    rows_after = layer.last_stats.get("rows_received")
    return {"rank": comm.rank, "placement_before": before_placement,
            "placement_after": layer.placement.phys2log.tolist(),
            "load": load.astype(float).tolist(),
            "rows_before": rows_before, "rows_after": rows_after,
            "rows_computed_before": int(np.sum(rows_before)) if rows_before else None,
            "rows_computed_after": int(np.sum(rows_after)) if rows_after else None,
            "out_change": rel_err(after, before)}


def ep_notebook_rank(comm, parity: dict, eplb: dict):
    """Notebook 05 in one launch (spawning ranks costs seconds): the parity run, then the
    EPLB run, each a dict of keyword arguments for the functions above."""
    return {"parity": ep_parity_rank(comm, **parity), "eplb": ep_eplb_rank(comm, **eplb)}
