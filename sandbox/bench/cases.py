"""What the benchmark times on: the model presets and the inputs of one point.

    E experts, K top-k, H hidden, I intermediate, T tokens

    PRESETS          Mixtral-8x7B, Qwen3-30B-A3B, DeepSeek-V3 (+ "tiny" for CPUs)
    make_weights     w13 [E, 2I, H], w2 [E, H, I] for a preset, drawn one expert at a time
    make_case        a Case: x [T, H], the weights, and routing buffers that redraw(i) rewrites
                     in place (uniform, or Zipf-skewed with routing="zipf")

Weights are drawn once per preset and moved once per backend; x and the routing are drawn
per token count.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from .roofline import expert_bytes

DEFAULT_TOKENS = (1, 16, 64, 256, 1024, 4096, 16384)
CPU_TOKENS = (1, 16, 64, 256)


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
# the presets that route in expert groups: (num_expert_group, topk_group, scoring,
# routed_scaling_factor), DeepSeek-V3's with its correction bias; the others: softmax top-k
GROUPED_ROUTING = {"deepseek-v3": (8, 4, "sigmoid", 2.5)}


def route_preset(ops, preset: ModelPreset, logits, bias):
    """(topk_weights, topk_ids) of `logits` [T, E] routed by a backend's stage module `ops`
    as `preset` routes: grouped_topk with `bias` where GROUPED_ROUTING says so, else
    fused_topk (softmax, renormalized)."""
    if preset.name in GROUPED_ROUTING:
        G, TG, scoring, scale = GROUPED_ROUTING[preset.name]
        return ops.grouped_topk(None, logits, preset.top_k, True, G, TG, scoring, scale, bias)
    return ops.fused_topk(None, logits, preset.top_k, True)[:2]


def default_tokens(device: str) -> tuple[int, ...]:
    return CPU_TOKENS if device == "cpu" else DEFAULT_TOKENS


def add_points_options(parser, models, tokens):
    """--models and --tokens, comma-separated: the (preset, T) points a benchmark script
    runs; points_of(args, models) reads them back."""
    parser.add_argument("--models", default=",".join(models))
    parser.add_argument("--tokens", default=",".join(map(str, tokens)))


def points_of(args, models) -> tuple[list[str], list[int]]:
    """(model names, token counts) of add_points_options' options, the names checked."""
    return (names_arg("--models", args.models, models),
            [int(t) for t in args.tokens.split(",") if t.strip()])


def no_gpu(availability) -> bool:
    """True, after saying so, when `availability()` -> (ok, why) finds nothing to run on: a
    benchmark script then has nothing to time and ends cleanly."""
    ok, why = availability()
    if not ok:
        print(f"no GPU here ({why}): nothing to time")
    return not ok


def names_arg(flag: str, text: str, allowed) -> list[str]:
    """The comma-separated names a benchmark option was given, each one of `allowed`
    (SystemExit naming the option and the choices otherwise)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    for n in names:
        if n not in allowed:
            raise SystemExit(f"{flag}: expected names from {tuple(allowed)}, got {n!r}")
    return names


@dataclasses.dataclass
class Case:
    """The inputs of one benchmark point, as torch tensors on `device`. `redraw(i)` writes a
    new routing into `topk_weights` / `topk_ids` in place (fixed buffers, so CUDA graphs
    and closures see it), records the experts it touches, then calls each of
    `after_redraw` (what a candidate derives from the routing outside its timed call, such
    as the vLLM peer's expert assignment; the benchmark empties it before each candidate)."""

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
    after_redraw: list = dataclasses.field(default_factory=list)
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
        for hook in self.after_redraw:
            hook()


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
