"""The benchmark harness: timers, roofline, peers, model presets, results (JSON + plot).

    T tokens, E experts, K top-k, H hidden, I intermediate, P = T*K routed slots

The pieces the kernel issues reuse:

    time_cuda(fn, warmup, reps, rotate=..., flush_l2=True, graph=False)   CUDA events (torch or
                                 CuPy, whichever is present) or a CUDA graph per rep; the L2 is
                                 flushed and `rotate(i)` (new inputs, new routing) runs before
                                 every rep, outside the timed region. -> Stats in milliseconds
    time_cpu(fn, warmup, reps, rotate=...)                               the same on the host
    summarize(samples)           median with p20/p80 (and mean, min, max, n)
    touched_experts(topk_ids)    how many distinct experts a routing touches
    touched_expert_bytes(...)    their weight bytes: n_touched * (2I*H + H*I) * bytes/weight
    moe_flops(T, K, H, I)        2 * P * (2I*H + I*H) (gated activation; 2 * P * 2*I*H without)
    roofline_floor(bytes, flops, bandwidth, peak_flops)  max(bytes / bandwidth, flops / peak):
                                 the card's datasheet limits (card_limits: H100, H200, A100;
                                 no floor on other cards or a CPU); fraction = floor / time
    measure_card()               the card's measured copy bandwidth and bf16 matmul peak
    PRESETS                      Mixtral-8x7B, Qwen3-30B-A3B, DeepSeek-V3 (+ "tiny" for CPUs)
    CANDIDATES                   name -> factory(case) -> fn(): cupy (our fused_experts), numba,
                                 torch-stages (a backend's stages composed); the peers:
                                 vllm-triton (vLLM's kernel, loaded from --peers), torch
                                 per-expert loop, torch._grouped_mm; `register_candidate` adds more
    run_bench(...)               every (preset, T, candidate) point: check against the torch loop
                                 once, then time; returns the JSON-able record
    time_host(fn)                the host's microseconds per eager call, the GPU idle before it
    add_ratios(points)           each point's median over vllm-triton's and torch-grouped_mm's
    write_results / plot_results <out>/bench_<card>_<eager|graph>.{json,png}: one file per card
                                 and mode (./moe-sandbox-results unless --out says otherwise)

The floor counts the bytes of the experts that this rep's routing touches (every rep draws a
new routing: random normal logits, or Zipf-skewed with `routing="zipf"`) and the flops of the
P slots; activations (x in, out) are left out. The limits are the card's datasheet's
(H200 4.8 TB/s, H100 SXM 3.35 TB/s, 989 dense bf16 TFLOP/s); `measure_card` measures the
copy bandwidth and the bf16 matmul rate of the card each run (an H100 read 3.0 TB/s and
790-810 TFLOP/s). A time under the floor is reported as an error, never as a result.

CUDA graphs (`graph=True`, `moe-sandbox bench --graph`) suit candidates with static shapes and
no host synchronisation: the CuPy backend (on torch's stream, sandbox.streams), vLLM's Triton
peer and torch._grouped_mm capture; the torch per-expert loop (torch.where) records the
capture error instead of a time. A capture that records nothing is an error, never a time.
Weights are drawn once per preset and moved once per backend; x and the routing are drawn
per token count.

Why flush and rotate: a small problem fits in the 50 MB L2 of an H200, so timing the same
inputs back to back measures L2, not HBM. Writing a buffer of twice the L2 size between reps
evicts everything; re-drawing the routing makes each rep touch a different set of experts.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import json
import os
import pathlib
import platform
import subprocess
import time
import warnings
from typing import Any, Callable

import numpy as np

UNAVAILABLE = "not available here"
PEAK_BANDWIDTH = 4.8e12   # bytes/s, H200 HBM3e datasheet
PEAK_FLOPS = 989e12       # flop/s, H200 dense bf16 datasheet
DEFAULT_TOKENS = (1, 16, 64, 256, 1024, 4096, 16384)
CPU_TOKENS = (1, 16, 64, 256)
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
# the committed results behind the README's tables: written only when asked (--out)
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
# where a run writes by default: the current folder, never the source tree
DEFAULT_OUT_DIR = pathlib.Path("moe-sandbox-results")

# Datasheet limits of the cards whose limits are known: (name fragment, HBM bytes/s, dense
# bf16 flop/s). The first fragment found in the device name wins, so the PCIe / NVL parts
# come before the SXM ones. A card not listed gets no floor (its points carry none).
KNOWN_CARDS = (
    ("H100 PCIe", 2.0e12, 756e12),
    ("H100 NVL", 3.9e12, 835e12),
    ("H100", 3.35e12, 989e12),          # H100 SXM5 80GB HBM3
    ("H200", 4.8e12, 989e12),           # H200 SXM 141GB HBM3e (and NVL: the same HBM)
    ("A100-SXM4-80GB", 2.039e12, 312e12),
    ("A100", 1.555e12, 312e12),
)


def card_limits(device_name: str | None) -> tuple[float, float] | None:
    """(HBM bytes/s, dense bf16 flop/s) of a card from its datasheet, or None when the card
    is not one whose limits this project knows (then no floor is printed)."""
    if not device_name:
        return None
    for fragment, bandwidth, flops in KNOWN_CARDS:
        if fragment.lower() in device_name.lower():
            return bandwidth, flops
    return None


# ----------------------------------------------------------------------------- presets

@dataclasses.dataclass(frozen=True)
class ModelPreset:
    """One MoE layer shape: E experts, K top-k, H hidden, I intermediate (per expert)."""

    name: str
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int

    def expert_bytes(self, weight_bytes: int = 2) -> int:
        return expert_bytes(self.hidden_size, self.intermediate_size, weight_bytes)


PRESETS = {
    "mixtral-8x7b": ModelPreset("mixtral-8x7b", 8, 2, 4096, 14336),
    "qwen3-30b-a3b": ModelPreset("qwen3-30b-a3b", 128, 8, 2048, 768),
    "deepseek-v3": ModelPreset("deepseek-v3", 256, 8, 7168, 2048),
    "tiny": ModelPreset("tiny", 8, 2, 256, 512),   # a laptop-size point for --cpu
}
GPU_PRESETS = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3")
# what `moe-sandbox bench` times on a GPU unless told: our best rung and the two peers a
# researcher would pick instead
GPU_CANDIDATES = ("cupy", "vllm-triton", "torch-grouped_mm")


# ----------------------------------------------------------------------------- pure math

@dataclasses.dataclass(frozen=True)
class Stats:
    """Timing summary in milliseconds; p20/p80 bracket the median."""

    median: float
    p20: float
    p80: float
    mean: float
    min: float
    max: float
    n: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def summarize(samples) -> Stats:
    """Median, 20th and 80th percentiles (linear interpolation), mean, min, max of `samples`."""
    a = np.asarray(list(samples), dtype=np.float64)
    if a.size == 0:
        raise ValueError("samples: expected at least one timing, got none")
    p20, med, p80 = np.percentile(a, [20, 50, 80])
    return Stats(float(med), float(p20), float(p80), float(a.mean()), float(a.min()),
                 float(a.max()), int(a.size))


def expert_bytes(hidden_size: int, intermediate_size: int, weight_bytes: int = 2,
                 gated: bool = True) -> int:
    """Weight bytes of one expert: w13 [2I, H] (or [I, H] without a gate) plus w2 [H, I]."""
    n1 = 2 * intermediate_size if gated else intermediate_size
    return (n1 + intermediate_size) * hidden_size * weight_bytes


def touched_experts(topk_ids, num_experts: int | None = None) -> int:
    """Number of distinct experts in `topk_ids` [T, K] (ids outside [0, E) are not counted)."""
    ids = np.asarray(_host(topk_ids)).reshape(-1)
    if num_experts is not None:
        ids = ids[(ids >= 0) & (ids < num_experts)]
    return int(np.unique(ids).size)


def touched_expert_bytes(topk_ids, hidden_size: int, intermediate_size: int,
                         weight_bytes: int = 2, gated: bool = True,
                         num_experts: int | None = None) -> int:
    """Bytes of the expert weights a routing must read: touched * expert_bytes."""
    return touched_experts(topk_ids, num_experts) * expert_bytes(
        hidden_size, intermediate_size, weight_bytes, gated)


def moe_flops(num_tokens: int, top_k: int, hidden_size: int, intermediate_size: int,
              gated: bool = True) -> int:
    """2 * P * (N1*H + I*H): GEMM1 [P, H] x [H, N1] (N1 = 2I gated, I otherwise), GEMM2
    [P, I] x [I, H]; the activation and the weighted sum are lower order."""
    n1 = 2 * intermediate_size if gated else intermediate_size
    return 2 * num_tokens * top_k * (n1 * hidden_size + intermediate_size * hidden_size)


def roofline_floor(nbytes: float, flops: float, bandwidth: float = PEAK_BANDWIDTH,
                   peak_flops: float = PEAK_FLOPS) -> float:
    """The least time in seconds a point can take: max(bytes / bandwidth, flops / peak)."""
    return max(nbytes / bandwidth, flops / peak_flops)


def fraction_of_floor(seconds: float, floor_seconds: float) -> float:
    """floor / measured (1.0 = at the roofline; 0.25 = four times slower than the floor)."""
    return floor_seconds / seconds if seconds > 0 else float("nan")


# ----------------------------------------------------------------------------- timers

class _Api:
    """CUDA events, synchronisation, L2 size and graphs through torch or CuPy."""

    def __init__(self, name: str):
        self.name = name
        if name == "torch":
            import torch
            self.lib = torch
        elif name == "cupy":
            import cupy
            self.lib = cupy
        else:
            raise ValueError(f"api: expected 'torch' or 'cupy', got {name!r}")
        self._flush_buf = None

    def event(self):
        if self.name == "torch":
            return self.lib.cuda.Event(enable_timing=True)
        return self.lib.cuda.Event()

    def synchronize(self):
        if self.name == "torch":
            self.lib.cuda.synchronize()
        else:
            self.lib.cuda.runtime.deviceSynchronize()

    def elapsed_ms(self, start, end) -> float:
        if self.name == "torch":
            return float(start.elapsed_time(end))
        return float(self.lib.cuda.get_elapsed_time(start, end))

    def l2_bytes(self) -> int:
        try:
            if self.name == "torch":
                return int(self.lib.cuda.get_device_properties(
                    self.lib.cuda.current_device()).L2_cache_size)
            dev = self.lib.cuda.runtime.getDevice()
            return int(self.lib.cuda.runtime.getDeviceProperties(dev)["l2CacheSize"])
        except Exception:
            return 64 << 20  # a safe guess above every current card's L2 but the B200's

    def flush_l2(self):
        """Write 2x the L2 size: every line that the previous rep left in L2 is evicted."""
        if self._flush_buf is None:
            n = 2 * self.l2_bytes()
            if self.name == "torch":
                self._flush_buf = self.lib.empty(n, dtype=self.lib.uint8, device="cuda")
            else:
                self._flush_buf = self.lib.empty(n, dtype=self.lib.uint8)
        if self.name == "torch":
            self._flush_buf.zero_()
        else:
            self._flush_buf.fill(0)

    def capture(self, fn: Callable[[], Any]):
        """Capture `fn` into a CUDA graph; returns replay()."""
        if self.name == "torch":
            torch = self.lib
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):   # allocations warm up off the default stream
                fn()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with torch.cuda.graph(graph):
                    fn()
            for w in caught:
                if "empty" in str(w.message).lower():
                    # the work ran on another stream than the capture's: a replay does
                    # nothing, and timing it would time nothing
                    raise EmptyGraph("the CUDA graph captured no work (torch: "
                                     f"{str(w.message).strip()[:120]})")
            return graph.replay
        cupy = self.lib
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            fn()
            stream.begin_capture()
            fn()
            graph = stream.end_capture()
        stream.synchronize()

        def replay():
            graph.launch(stream=cupy.cuda.get_current_stream())
        return replay


class EmptyGraph(RuntimeError):
    """A CUDA graph capture that recorded no work (a replay would time nothing)."""


def cuda_api(prefer: str | None = None) -> _Api | None:
    """The first of torch / CuPy that sees a CUDA device (or `prefer` when it does)."""
    order = [prefer] if prefer else []
    order += [n for n in ("torch", "cupy") if n not in order]
    for name in order:
        try:
            if name == "torch":
                import torch
                if torch.cuda.is_available():
                    return _Api("torch")
            else:
                import cupy
                if cupy.cuda.is_available():
                    return _Api("cupy")
        except Exception:
            continue
    return None


def time_cuda(fn: Callable[[], Any], warmup: int = 10, reps: int = 50,
              rotate: Callable[[int], Any] | None = None, flush_l2: bool = True,
              graph: bool = False, api: _Api | None = None) -> Stats:
    """Time `fn()` on the GPU: `warmup` untimed runs, then `reps` runs, each between two CUDA
    events on the current stream. Before every run (outside the events): `rotate(i)` when
    given (new routing, next input buffer: it must write into the buffers `fn` reads when
    `graph=True`), then an L2 flush. `graph=True` captures `fn` once into a CUDA graph and
    times its replays (launch overhead out of the picture). Returns Stats in milliseconds."""
    api = api or cuda_api()
    if api is None:
        raise RuntimeError("time_cuda: expected a CUDA device visible to torch or CuPy, "
                           "found none")
    run = fn
    if graph:
        if rotate:
            rotate(0)
        run = api.capture(fn)
    pairs = []
    for i in range(warmup + reps):
        if rotate:
            rotate(i)
        if flush_l2:
            api.flush_l2()
        if i < warmup:
            run()
            continue
        start, end = api.event(), api.event()
        start.record()
        run()
        end.record()
        pairs.append((start, end))
    api.synchronize()
    return summarize(api.elapsed_ms(s, e) for s, e in pairs)


def time_host(fn: Callable[[], Any], reps: int = 20,
              rotate: Callable[[int], Any] | None = None, api: _Api | None = None) -> Stats:
    """The host's time per call of an eager `fn` (launch parameters, checks, Python), with the
    GPU idle before each call: synchronize, then `perf_counter` around the call alone (its
    kernels are queued, not waited for). Returns Stats in microseconds."""
    api = api or cuda_api()
    samples = []
    for i in range(reps):
        if rotate:
            rotate(i)
        api.synchronize()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    api.synchronize()
    return summarize(samples)


def time_cpu(fn: Callable[[], Any], warmup: int = 1, reps: int = 5,
             rotate: Callable[[int], Any] | None = None) -> Stats:
    """Wall-clock `fn()` on the host with `perf_counter`, `rotate(i)` untimed before each run.
    Returns Stats in milliseconds."""
    samples = []
    for i in range(warmup + reps):
        if rotate:
            rotate(i)
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if i >= warmup:
            samples.append(dt * 1e3)
    return summarize(samples)


def measure_card(api: _Api | None = None, copy_mib: int = 1024, matmul_n: int = 8192,
                 reps: int = 10) -> dict:
    """Measured device-to-device copy bandwidth (read + write bytes / time) and the bf16
    matmul rate of a `matmul_n`^3 product (2 n^3 flops), best of `reps`."""
    api = api or cuda_api()
    if api is None:
        raise RuntimeError("measure_card: expected a CUDA device, found none")
    n_bytes = copy_mib << 20
    if api.name == "torch":
        torch = api.lib
        src = torch.empty(n_bytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        copy = lambda: dst.copy_(src)  # noqa: E731
        a = torch.randn(matmul_n, matmul_n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(matmul_n, matmul_n, device="cuda", dtype=torch.bfloat16)
        mm = lambda: torch.matmul(a, b)  # noqa: E731
        mm_dtype = "bf16"
        name = torch.cuda.get_device_name()
    else:
        cupy = api.lib
        src = cupy.empty(n_bytes, dtype=cupy.uint8)
        dst = cupy.empty_like(src)
        copy = lambda: dst.__setitem__(Ellipsis, src)  # noqa: E731
        # CuPy has no bf16 dtype: fp16 runs on the same tensor cores at the same rate
        a = cupy.random.standard_normal((matmul_n, matmul_n), dtype=cupy.float32).astype(
            cupy.float16)
        b = a.copy()
        mm = lambda: cupy.matmul(a, b)  # noqa: E731
        mm_dtype = "fp16"
        name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())["name"]
        name = name.decode() if isinstance(name, bytes) else name
    t_copy = time_cuda(copy, warmup=2, reps=reps, flush_l2=False, api=api)
    t_mm = time_cuda(mm, warmup=2, reps=reps, flush_l2=False, api=api)
    return {"gpu": name, "l2_bytes": api.l2_bytes(),
            "copy_TBps": 2 * n_bytes / (t_copy.min * 1e-3) / 1e12,
            "matmul_TFLOPs": 2 * matmul_n ** 3 / (t_mm.min * 1e-3) / 1e12,
            "matmul_dtype": mm_dtype, "matmul_n": matmul_n, "copy_MiB": copy_mib}


# ----------------------------------------------------------------------------- peers

def torch_per_expert_loop(x, w13, w2, topk_weights, topk_ids, activation: str = "silu"):
    """The baseline a user writes in torch: for each expert, gather its tokens, two matmuls,
    scale by the router weight, scatter-add. x [T, H], w13 [E, 2I, H], w2 [E, H, I],
    topk_weights [T, K], topk_ids [T, K] -> [T, H] (accumulated in fp32)."""
    import torch

    T, H = x.shape
    out = torch.zeros((T, H), dtype=torch.float32, device=x.device)
    inter = w2.shape[2]
    for e in range(w13.shape[0]):
        token, slot = torch.where(topk_ids == e)
        if token.numel() == 0:
            continue
        h = x[token] @ w13[e].T                                             # [n, 2I]
        a = _torch_act(torch, h, inter, activation)                         # [n, I]
        y = (a @ w2[e].T).float() * topk_weights[token, slot, None].float()  # [n, H]
        out.index_add_(0, token, y)
    return out.to(x.dtype)


def torch_grouped_mm_moe(x, w13, w2, topk_weights, topk_ids, activation: str = "silu"):
    """The same layer with `torch._grouped_mm`: sort the P slots by expert, one grouped GEMM
    per projection over the contiguous groups (`offs` = end offset of each expert's rows),
    then weight and scatter-add back to the tokens."""
    import torch

    T, H = x.shape
    E, K, inter = w13.shape[0], topk_ids.shape[1], w2.shape[2]
    flat = topk_ids.reshape(-1)                                             # [P]
    order = torch.argsort(flat, stable=True)                                # [P] slots by expert
    # rows per expert by a scatter-add, not bincount: bincount sizes its output from a max
    # read back to the host, which a CUDA graph capture refuses
    counts = torch.zeros(E, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))    # [E]
    offs = torch.cumsum(counts, 0, dtype=torch.int32)                       # [E]
    token = order // K                                                      # [P]
    x_grouped = x[token]                                                    # [P, H]
    h = torch._grouped_mm(x_grouped, w13.transpose(1, 2), offs=offs)        # [P, 2I]
    a = _torch_act(torch, h, inter, activation)                             # [P, I]
    y_grouped = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)         # [P, H]
    y = y_grouped.float() * topk_weights.reshape(-1)[order, None].float()
    out = torch.zeros((T, H), dtype=torch.float32, device=x.device)
    out.index_add_(0, token, y)
    return out.to(x.dtype)


def _torch_act(torch, h, inter, activation):
    if activation == "silu":
        return torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
    if activation == "gelu":
        return torch.nn.functional.gelu(h[:, :inter]) * h[:, inter:]
    raise ValueError(f"activation: expected 'silu' or 'gelu' in the torch peers, "
                     f"got {activation!r}")


def has_grouped_mm() -> bool:
    try:
        import torch
        return hasattr(torch, "_grouped_mm")
    except ImportError:
        return False


# ----------------------------------------------------------------------------- cases

@dataclasses.dataclass
class Case:
    """The inputs of one benchmark point, as torch tensors on `device`. `redraw(i)` writes a
    new routing into `topk_weights` / `topk_ids` in place (fixed buffers, so CUDA graphs
    and closures see it) and records the experts it touches."""

    preset: ModelPreset
    num_tokens: int
    device: str
    dtype: Any
    x: Any                 # [T, H]
    w13: Any               # [E, 2I, H]
    w2: Any                # [E, H, I]
    topk_weights: Any      # [T, K] fp32
    topk_ids: Any          # [T, K] int64 (torch indexing wants int64)
    topk_ids32: Any        # [T, K] int32, the same ids as the stage contract wants them
    routing: str = "uniform"
    seed: int = 0
    touched: list = dataclasses.field(default_factory=list)
    _gen: Any = None
    _log_pop: Any = None

    def redraw(self, i: int = 0) -> None:
        import torch

        T, E, K = self.num_tokens, self.preset.num_experts, self.preset.top_k
        logits = torch.randn((T, E), generator=self._gen, device=self.device)   # [T, E]
        if self._log_pop is not None:
            logits = logits + self._log_pop
        w, ids = torch.topk(torch.softmax(logits, dim=-1), K, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        self.topk_weights.copy_(w)
        self.topk_ids.copy_(ids)
        self.topk_ids32.copy_(ids)
        self.touched.append(int(torch.unique(ids).numel()))


def make_weights(preset: ModelPreset, device: str = "cuda", dtype=None, seed: int = 0):
    """(w13 [E, 2I, H] ~ N(0, 1/H), w2 [E, H, I] ~ N(0, 1/I)) in `dtype`, drawn one expert
    at a time so that the fp32 draw never needs more than one expert's worth of memory
    (DeepSeek-V3's w13 alone is 15 GB in bf16)."""
    import torch

    dtype = dtype or (torch.bfloat16 if device != "cpu" else torch.float32)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    E, H, I = preset.num_experts, preset.hidden_size, preset.intermediate_size  # noqa: E741
    w13 = torch.empty((E, 2 * I, H), dtype=dtype, device=device)
    w2 = torch.empty((E, H, I), dtype=dtype, device=device)
    for e in range(E):
        w13[e] = torch.randn((2 * I, H), generator=gen, device=device) * H ** -0.5
        w2[e] = torch.randn((H, I), generator=gen, device=device) * I ** -0.5
    return w13, w2


def make_case(preset: ModelPreset, num_tokens: int, device: str = "cuda", dtype=None,
              routing: str = "uniform", seed: int = 0, weights=None) -> Case:
    """Random inputs of the preset's shape: x ~ N(0, 1) and the weights of `make_weights`
    (pass `weights=(w13, w2)` to reuse them across token counts)."""
    import torch

    dtype = dtype or (torch.bfloat16 if device != "cpu" else torch.float32)
    gen = torch.Generator(device=device).manual_seed(seed)
    E, K, H = preset.num_experts, preset.top_k, preset.hidden_size
    T = num_tokens
    w13, w2 = weights if weights is not None else make_weights(preset, device, dtype, seed)
    case = Case(preset, T, device, dtype,
                x=torch.randn((T, H), generator=gen, device=device).to(dtype),
                w13=w13, w2=w2,
                topk_weights=torch.empty((T, K), dtype=torch.float32, device=device),
                topk_ids=torch.empty((T, K), dtype=torch.int64, device=device),
                topk_ids32=torch.empty((T, K), dtype=torch.int32, device=device),
                routing=routing, seed=seed, _gen=gen)
    if routing == "zipf":
        ranks = torch.randperm(E, generator=gen, device=device).float()
        case._log_pop = -1.2 * torch.log(ranks + 1.0)       # Zipf(1.2) popularity, log-space
    elif routing != "uniform":
        raise ValueError(f"routing: expected 'uniform' or 'zipf', got {routing!r}")
    case.redraw(0)
    case.touched.clear()
    return case


class Unavailable(Exception):
    """Raised by a candidate factory that cannot run here; the message says why."""


# name -> factory(case) -> fn() returning [T, H]; the factory returns None or raises
# Unavailable(reason) when the candidate cannot run here
CANDIDATES: dict[str, Callable[[Case], Callable[[], Any] | None]] = {}


def register_candidate(name: str, factory: Callable[[Case], Callable[[], Any] | None]) -> None:
    """Add a timed candidate (a kernel issue's ladder rung, a backend, a peer)."""
    CANDIDATES[name] = factory


register_candidate("torch-loop", lambda c: lambda: torch_per_expert_loop(
    c.x, c.w13, c.w2, c.topk_weights, c.topk_ids))
def _grouped_mm_factory(case: Case):
    if not has_grouped_mm():
        raise Unavailable("this torch has no torch._grouped_mm")
    return lambda: torch_grouped_mm_moe(case.x, case.w13, case.w2, case.topk_weights,
                                        case.topk_ids)


register_candidate("torch-grouped_mm", _grouped_mm_factory)


def _reference_factory(case: Case):
    """The NumPy reference on the host (only sensible with --cpu)."""
    if case.device != "cpu":
        raise Unavailable("the NumPy reference is timed with --cpu only")
    import reference

    x, w13, w2 = (t.float().numpy() for t in (case.x, case.w13, case.w2))
    return lambda: reference.fused_experts(x, w13, w2, case.topk_weights.numpy(),
                                           case.topk_ids.numpy().astype(np.int32))


register_candidate("reference", _reference_factory)


def backend_candidate(backend: str):
    """A candidate that runs `backend`'s stages (sandbox.registry) on the case's routing:
    align -> gemm1 -> activation -> gemm2 -> combine, the layer without its route stage
    (what vLLM's fused_experts does). Unavailable here (None) when the backend is not, or
    lacks one of those stages."""
    def factory(case: Case):
        return _stages_fn(case, backend)
    factory.__doc__ = f"the {backend} backend's stages, composed (no routing)"
    return factory


_MOVED_WEIGHTS: dict = {}   # backend -> (torch w13, torch w2, its w13, its w2)


def _stages_fn(case: Case, backend: str):
    from sandbox import arrays, registry, streams

    be = registry.get_backend(backend)
    if not be.ok:
        raise Unavailable(be.reason)
    for s in ("align", "gemm1", "activation", "gemm2", "combine"):
        if not be.has_stage(s):
            raise Unavailable(f"{backend} has no {registry.STAGE_FUNCTIONS[s]} yet")
    T, K, H = case.num_tokens, case.preset.top_k, case.preset.hidden_size
    E, I = case.preset.num_experts, case.preset.intermediate_size  # noqa: E741
    # weights and x move once (through the host for bf16, which CUDA array interfaces
    # cannot describe); the routing buffers must be zero-copy views, because redraw()
    # rewrites them in place between reps
    x = be.take(case.x)
    hit = _MOVED_WEIGHTS.get(backend)
    if hit is not None and hit[0] is case.w13 and hit[1] is case.w2:
        w13, w2 = hit[2], hit[3]
    else:           # move a preset's weights once, not at every token count
        _MOVED_WEIGHTS.pop(backend, None)
        w13, w2 = be.take(case.w13), be.take(case.w2)
        _MOVED_WEIGHTS[backend] = (case.w13, case.w2, w13, w2)
    if be.is_host:
        tw, ti = be.take(case.topk_weights), be.take(case.topk_ids32)
        if arrays.kind(tw) != "torch" and case.device != "cpu":
            raise Unavailable(f"{backend} computes on the host, the case is on {case.device}")
    else:
        tw = arrays.zero_copy(case.topk_weights, be.array_kind)
        ti = arrays.zero_copy(case.topk_ids32, be.array_kind)
        if tw is None or ti is None:
            raise Unavailable(f"the routing buffers cannot be shared with {backend} "
                              f"without a copy")
    # the alignment block is the GEMM's BLOCK_M for this shape (as the layer asks it: M = T)
    cfg = be.gemm_config(T, 2 * I, H, E, K, arrays.dtype_of(case.x))
    block = int(cfg["BLOCK_M"]) if cfg and cfg.get("BLOCK_M") else be.default_block_size
    align, gemm = be.stage_fn("align"), be.stage_fn("gemm1")
    act, combine = be.stage_fn("activation"), be.stage_fn("combine")

    # the case is torch's: the GPU backends run on torch's stream and allocator, which is
    # what a torch caller and a torch.cuda.graph capture need (sandbox.streams)
    on_stream = (streams.torch_stream_for_cupy if case.device != "cpu" and not be.is_host
                 else contextlib.nullcontext)

    def fn():
        with on_stream():
            sorted_ids, expert_ids, ntpp = align(ti, block, E)
            c1 = gemm(x, w13, sorted_ids, expert_ids, ntpp, K, block, tw, False, None)  # [P, 2I]
            c2 = act(c1, "silu", True)                                                  # [P, I]
            c3 = gemm(c2, w2, sorted_ids, expert_ids, ntpp, 1, block, tw, True, None)   # [P, H]
            return combine(c3.reshape(T, K, H))                                         # [T, H]
    fn.to_host = be.to_host      # the check reads the output the backend's way (bf16 bits)
    return fn


def _cupy_factory(case: Case):
    """Our best rung: the CuPy backend's fused_experts (align .. combine, the stages' own
    kernels launched from a plan cached per shape) on the case's torch tensors, on torch's
    stream: no copies, no routing."""
    if case.device == "cpu":
        raise Unavailable("the CuPy kernels run on CUDA only")
    from sandbox import registry

    be = registry.get_backend("cupy")
    if not be.ok:
        raise Unavailable(be.reason)
    from cuda_kernels.cupy.experts import fused_experts

    args = (case.x, case.w13, case.w2, case.topk_weights, case.topk_ids32)
    return lambda: fused_experts(*args)


register_candidate("cupy", _cupy_factory)
register_candidate("numba", backend_candidate("numba"))
register_candidate("torch-stages", backend_candidate("torch"))


# ----------------------------------------------------------------------------- the vLLM peer

def default_peers_dir() -> pathlib.Path | None:
    """Where the measuring instruments live: `.peers/` in the checkout (a copy, as on the GPU
    machine), else `../shared/peers` beside it; None when neither exists."""
    for path in (REPO_ROOT / ".peers", REPO_ROOT.parent / "shared" / "peers"):
        if (path / "vllm_triton" / "peer.py").is_file():
            return path
    return None


PEERS_DIR: list = [None]     # set by `moe-sandbox bench --peers DIR` (None: the default)


def load_vllm_triton(peers_dir=None):
    """vLLM's Triton fused-MoE kernel, the peer every vLLM user runs, imported at run time
    from `peers_dir/vllm_triton/peer.py` (never copied into this project). Raises
    Unavailable with the reason when it cannot be imported here."""
    import importlib.util
    import sys

    root = pathlib.Path(peers_dir or PEERS_DIR[0] or default_peers_dir() or "")
    path = root / "vllm_triton" / "peer.py"
    if not path.is_file():
        raise Unavailable(f"no vLLM Triton peer at {path} (pass --peers DIR)")
    name = "moe_sandbox_peer_vllm_triton"
    mod = sys.modules.get(name)
    if mod is not None and getattr(mod, "__file__", None) == str(path):
        return mod
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except Exception as exc:          # triton missing or too old, most often
        raise Unavailable(f"the vLLM Triton peer does not import here: {_err(exc)}") from None
    sys.modules[name] = mod
    return mod


def _vllm_triton_factory(case: Case):
    """vLLM's fused_experts kernels on the case (bf16/fp16 on CUDA only). As the peer's README
    says, its expert assignment is made once, when the runner is made, and is not timed: the
    timed call is its GEMM1, silu_and_mul, GEMM2 and top-k sum. Ours is timed from align on."""
    if case.device == "cpu":
        raise Unavailable("the vLLM Triton peer runs on CUDA only")
    peer = load_vllm_triton()
    run = peer.fused_experts_runner(case.x, case.w13, case.w2, case.topk_weights,
                                    case.topk_ids32)
    fn = lambda: run()  # noqa: E731
    fn.config_source = getattr(run, "config_source", "")
    return fn


register_candidate("vllm-triton", _vllm_triton_factory)


# ----------------------------------------------------------------------------- the run

def run_bench(presets=GPU_PRESETS, tokens=DEFAULT_TOKENS, candidates=None, device="cuda",
              dtype=None, warmup: int = 10, reps: int = 50, graph: bool = False,
              flush_l2: bool = True, routing: str = "uniform", seed: int = 0,
              progress: Callable | None = None, card: dict | None = None) -> dict:
    """Every (preset, T, candidate): build inputs, check the candidate's output once against
    the torch per-expert loop (relative Frobenius error in fp32), then time it with the
    routing re-drawn every rep. Returns the JSON-able record (see `write_results`)."""
    import torch

    candidates = list(candidates or CANDIDATES)
    unknown = [c for c in candidates if c not in CANDIDATES]
    if unknown:
        raise ValueError(f"candidates: expected names from {sorted(CANDIDATES)}, got {unknown}")
    api = cuda_api() if device != "cpu" else None
    if device != "cpu" and api is None:
        raise RuntimeError("run_bench: expected a CUDA device, found none")
    device_name = "cpu" if device == "cpu" else torch.cuda.get_device_name()
    limits = None if device == "cpu" else card_limits(device_name)
    points = []
    plan = [(PRESETS[p] if isinstance(p, str) else p, t) for p in presets for t in tokens]
    bar = progress(total=len(plan) * len(candidates)) if progress else None
    weights = {}
    for preset, T in plan:
        try:
            if preset.name not in weights:          # one preset's weights at a time
                weights.clear()
                _MOVED_WEIGHTS.clear()
                if device != "cpu":
                    torch.cuda.empty_cache()
                weights[preset.name] = make_weights(preset, device, dtype, seed)
            case = make_case(preset, T, device, dtype, routing, seed, weights[preset.name])
        except Exception as exc:  # out of memory at the largest points, most often
            for name in candidates:
                points.append(_point(preset, T, name, error=f"inputs: {_err(exc)}"))
                if bar:
                    bar.update(1)
            continue
        wbytes = case.w13.element_size()
        # the check runs on the first routing; timing re-draws it, so keep a copy to restore
        first = (case.topk_weights.clone(), case.topk_ids.clone())
        with torch.inference_mode():
            expected = torch_per_expert_loop(case.x, case.w13, case.w2, case.topk_weights,
                                             case.topk_ids).float()
        for name in candidates:
            if bar:
                bar.set_description(f"{preset.name} T={T} {name}")
            case.topk_weights.copy_(first[0])
            case.topk_ids.copy_(first[1])
            case.topk_ids32.copy_(first[1])
            point = _time_candidate(case, name, expected, api, warmup, reps, graph, flush_l2,
                                    wbytes, limits)
            points.append(point)
            if bar:
                bar.update(1)
        del case, expected
    weights.clear()
    _MOVED_WEIGHTS.clear()
    if bar:
        bar.close()
    add_ratios(points)
    return {"benchmark": "fused MoE experts (no routing), end to end",
            "device": device_name, "card": card,
            "dtype": str(dtype or ("bfloat16" if device != "cpu"
                                   else "float32")).replace("torch.", ""),
            "routing": routing, "seed": seed, "warmup": warmup, "reps": reps, "graph": graph,
            "flush_l2": flush_l2,
            "peak_bandwidth": limits[0] if limits else None,
            "peak_flops": limits[1] if limits else None,
            "points": points}


RATIO_PEERS = ("vllm-triton", "torch-grouped_mm")


def add_ratios(points: list) -> None:
    """Each timed point's median over the median of each peer of RATIO_PEERS at the same
    (model, T), as `vs_<peer>` (< 1: faster than the peer)."""
    medians = {(p["model"], p["T"], p["candidate"]): p["stats"]["median"]
               for p in points if "stats" in p}
    for p in points:
        if "stats" not in p:
            continue
        for peer in RATIO_PEERS:
            ref = medians.get((p["model"], p["T"], peer))
            if ref:
                p[f"vs_{peer}"] = p["stats"]["median"] / ref


def _time_candidate(case: Case, name: str, expected, api, warmup, reps, graph, flush_l2,
                    wbytes, limits=None) -> dict:
    import torch

    preset, T = case.preset, case.num_tokens
    try:
        fn = CANDIDATES[name](case)
    except Unavailable as exc:
        return _point(preset, T, name, error=f"{UNAVAILABLE}: {exc}")
    except Exception as exc:
        return _point(preset, T, name, error=f"setup: {_err(exc)}")
    if fn is None:
        return _point(preset, T, name, error=UNAVAILABLE)
    try:
        with torch.inference_mode():
            out = fn()
            host = getattr(fn, "to_host", None)
            got = _to_torch(host(out) if host else out).float().to(expected.device)
        rel = float(torch.linalg.vector_norm(got - expected)
                    / torch.linalg.vector_norm(expected).clamp_min(1e-30))
        case.touched.clear()
        if not rel <= 5e-2:               # NaN fails too: a wrong answer is never timed
            return _point(preset, T, name, rel_err=rel,
                          error=f"check: relative error {rel:.3g} against the torch loop")
        host = None
        with torch.inference_mode():
            if api is None:
                stats = time_cpu(fn, warmup=min(warmup, 2), reps=reps, rotate=case.redraw)
            else:
                stats = time_cuda(fn, warmup=warmup, reps=reps, rotate=case.redraw,
                                  flush_l2=flush_l2, graph=graph, api=api)
                if not graph:
                    host = time_host(fn, reps=min(reps, 20), rotate=case.redraw, api=api)
    except Exception as exc:
        return _point(preset, T, name, error=f"run: {_err(exc)}")
    touched = float(np.mean(case.touched[-reps:])) if case.touched else float("nan")
    nbytes = touched * expert_bytes(preset.hidden_size, preset.intermediate_size, wbytes)
    flops = moe_flops(T, preset.top_k, preset.hidden_size, preset.intermediate_size)
    sec = stats.median * 1e-3
    fields = dict(stats=stats.as_dict(), rel_err=rel, touched_experts=touched, bytes=nbytes,
                  flops=flops, TBps=nbytes / sec / 1e12, TFLOPs=flops / sec / 1e12)
    if host is not None:
        fields["host_us"] = host.median
    if limits is not None:              # a floor only for a card whose limits are known
        floor = roofline_floor(nbytes, flops, *limits)
        fields.update(floor_ms=floor * 1e3, fraction_of_floor=fraction_of_floor(sec, floor))
        if sec < floor:
            # nothing runs faster than the card's datasheet limits: the timing is broken
            # (work on another stream, a graph that captured nothing), not a result
            return _point(preset, T, name, **fields,
                          error=f"timing: {stats.median:.4f} ms is faster than the roofline "
                                f"floor {floor * 1e3:.4f} ms (a broken measurement)")
    return _point(preset, T, name, **fields)


def _point(preset: ModelPreset, T: int, name: str, **fields) -> dict:
    return {"model": preset.name, "E": preset.num_experts, "K": preset.top_k,
            "H": preset.hidden_size, "I": preset.intermediate_size, "T": T, "candidate": name,
            **fields}


def _to_torch(out):
    import torch

    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, np.ndarray):
        return torch.from_numpy(np.asarray(out, dtype=np.float32))
    try:
        return torch.from_dlpack(out)
    except Exception:                      # numba device arrays: __cuda_array_interface__
        return torch.as_tensor(out, device="cuda")


def _host(a):
    """A NumPy view/copy of a NumPy, torch or CuPy array."""
    if isinstance(a, np.ndarray):
        return a
    mod = type(a).__module__ or ""
    if mod.startswith("torch"):
        return a.detach().cpu().numpy()
    if mod.startswith("cupy"):
        return a.get()
    return np.asarray(a)


def _err(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


# ----------------------------------------------------------------------------- results

def git_commit() -> str:
    """The commit the numbers belong to. The GPU machine gets a copy of the working tree
    without .git, so a run there passes the hash in MOE_SANDBOX_COMMIT."""
    if os.environ.get("MOE_SANDBOX_COMMIT"):
        return os.environ["MOE_SANDBOX_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=pathlib.Path(__file__).resolve().parents[1],
                              timeout=10).stdout.strip()
    except Exception:
        return ""


def results_stem(record: dict) -> str:
    """bench_<card>_<eager|graph>: one current file per card and mode (a new run of the same
    card and mode replaces it)."""
    card = record.get("card") or {}
    gpu = card.get("gpu") or record.get("device") or "gpu"
    return f"bench_{_slug(gpu)}_{'graph' if record.get('graph') else 'eager'}"


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


def _slug(s: str) -> str:
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
    vs torch._grouped_mm), floor and fraction of it (blank on a card of unknown limits),
    host microseconds per eager call, relative error."""
    rows = [(f"{'model':14s} {'T':>6s} {'candidate':18s} {'median ms':>10s} "
             f"{'[p20, p80]':>20s} {'vs vLLM':>7s} {'vs gmm':>7s} {'floor ms':>9s} "
             f"{'frac':>5s} {'host us':>8s} {'rel err':>8s}")]

    def num(v, fmt, width):
        return f"{v:{width}{fmt}}" if isinstance(v, (int, float)) else " " * width

    for p in record["points"]:
        head = f"{p['model']:14s} {p['T']:6d} {p['candidate']:18s}"
        if "stats" not in p or "error" in p:
            rows.append(f"{head} {p.get('error', '')}")
            continue
        s = p["stats"]
        spread = f"[{s['p20']:.4f}, {s['p80']:.4f}]"
        rows.append(f"{head} {s['median']:10.4f} {spread:>20s} "
                    f"{num(p.get('vs_vllm-triton'), '.2f', 7)} "
                    f"{num(p.get('vs_torch-grouped_mm'), '.2f', 7)} "
                    f"{num(p.get('floor_ms'), '.4f', 9)} "
                    f"{num(p.get('fraction_of_floor'), '.2f', 5)} "
                    f"{num(p.get('host_us'), '.1f', 8)} {p['rel_err']:8.1e}")
    return "\n".join(rows)


def tqdm_or_none():
    """tqdm's class when it is installed (a progress bar on long runs), else None."""
    try:
        from tqdm import tqdm
        return tqdm
    except ImportError:
        return None


def default_tokens(device: str) -> tuple[int, ...]:
    return CPU_TOKENS if device == "cpu" else DEFAULT_TOKENS
