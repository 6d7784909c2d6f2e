"""The least time a point can take, and how close a measurement comes to it.

    T tokens, E experts, K top-k, H hidden, I intermediate, P = T*K routed slots

    touched_experts(topk_ids)    how many distinct experts a routing touches
    touched_expert_bytes(...)    their weight bytes: n_touched * (2I*H + H*I) * bytes/weight
    moe_flops(T, K, H, I)        2 * P * (2I*H + I*H) (gated activation; 2 * P * 2*I*H without)
    roofline_floor(bytes, flops, bandwidth, peak_flops)  max(bytes / bandwidth, flops / peak):
                                 the card's datasheet limits (card_limits: H100, H200, A100;
                                 no floor on other cards or a CPU); fraction = floor / time
    measure_card()               the card's measured copy bandwidth and bf16 matmul peak
    quant_expert_bytes(cfg, H, I)  one quantized expert's bytes: codes + scales (+ zero points)
    floor_format(cfg)            the tensor cores a format's flops run on (fp8, int8, bf16)

The floor counts the bytes of the experts that a rep's routing touches (every rep draws a
new routing) and the flops of the P slots; activations (x in, out) are left out. The limits
are the card's datasheet's (H200 4.8 TB/s, H100 SXM 3.35 TB/s, 989 dense bf16 TFLOP/s);
`measure_card` measures the copy bandwidth and the bf16 matmul rate of the card each run (an
H100 read 3.0 TB/s and 790-810 TFLOP/s). A quantized point's floor reads its format's bytes
(fp8 codes half of bf16's, int4 a quarter, plus scales and zero points) at the same bandwidth
and its flops at the format's peak (fp8 and int8 twice bf16's on Hopper; weight-only formats
multiply in bf16). A time under the floor is reported as an error, never as a result.
"""
from __future__ import annotations

import numpy as np

from cuda_kernels.timing import CudaApi, cuda_api, time_cuda

PEAK_BANDWIDTH = 4.8e12   # bytes/s, H200 HBM3e datasheet
PEAK_FLOPS = 989e12       # flop/s, H200 dense bf16 datasheet

# Datasheet limits of the cards whose limits are known: (name fragment, HBM bytes/s, dense
# flop/s by the format the tensor cores multiply: bf16, fp8 e4m3, int8 (op/s)). The first
# fragment found in the device name wins, so the PCIe / NVL parts come before the SXM ones. A
# card not listed gets no floor (its points carry none); None: no tensor cores for the format
# (A100 has no fp8), so a point of that format gets no floor either.
KNOWN_CARDS = (
    ("H100 PCIe", 2.0e12, {"bf16": 756e12, "fp8": 1513e12, "int8": 1513e12}),
    ("H100 NVL", 3.9e12, {"bf16": 835e12, "fp8": 1671e12, "int8": 1671e12}),
    ("H100", 3.35e12, {"bf16": 989e12, "fp8": 1979e12, "int8": 1979e12}),   # SXM5 80GB HBM3
    ("H200", 4.8e12, {"bf16": 989e12, "fp8": 1979e12, "int8": 1979e12}),    # SXM 141GB HBM3e
    ("A100-SXM4-80GB", 2.039e12, {"bf16": 312e12, "fp8": None, "int8": 624e12}),
    ("A100", 1.555e12, {"bf16": 312e12, "fp8": None, "int8": 624e12}),
)
FLOOR_FORMATS = ("bf16", "fp8", "int8")


def card_limits(device_name: str | None, fmt: str = "bf16") -> tuple[float, float] | None:
    """(HBM bytes/s, dense flop/s of the `fmt` tensor cores) of a card from its datasheet, or
    None when the card is not one whose limits this project knows, or has no such tensor
    cores (then no floor is printed). fmt: "bf16" (also fp16, and the weight-only formats,
    whose codes are dequantized to bf16 before the multiply), "fp8", "int8"."""
    if fmt not in FLOOR_FORMATS:
        raise ValueError(f"fmt: expected one of {list(FLOOR_FORMATS)}, got {fmt!r}")
    if not device_name:
        return None
    for fragment, bandwidth, flops in KNOWN_CARDS:
        if fragment.lower() in device_name.lower():
            return None if flops[fmt] is None else (bandwidth, flops[fmt])
    return None


def card_hbm(device_name: str) -> float:
    """The datasheet HBM bandwidth (bytes/s) of the card that ran, for scripts whose every
    figure is a fraction of its floor: an unknown card is a ValueError naming it, never
    another card's number."""
    limits = card_limits(device_name)
    if limits is None:
        raise ValueError(f"device: no datasheet HBM bandwidth for {device_name!r} "
                         f"(sandbox/bench/roofline.py KNOWN_CARDS): its floors would be "
                         f"another card's")
    return limits[0]


def expert_bytes(hidden_size: int, intermediate_size: int, weight_bytes: int = 2,
                 gated: bool = True) -> int:
    """Weight bytes of one expert: w13 [2I, H] (or [I, H] without a gate) plus w2 [H, I]."""
    n1 = 2 * intermediate_size if gated else intermediate_size
    return (n1 + intermediate_size) * hidden_size * weight_bytes


def quant_expert_bytes(cfg, hidden_size: int, intermediate_size: int) -> int:
    """Bytes of one quantized expert as the layer holds it (sandbox/quant.py): w13 [2I, H]
    and w2 [H, I] codes (fp8 / int8 / uint8 one byte a weight, half of bf16's; int4 two a
    byte, a quarter), fp32 scales (a tensor's one, a row's, a 128x128 block's or a group's)
    and uint8 zero points (one a group, with has_zp). `cfg` is a FusedMoEQuantConfig."""
    total = 0
    for n, k in ((2 * intermediate_size, hidden_size), (hidden_size, intermediate_size)):
        codes = int(np.prod(cfg.code_shape(n, k))) * np.dtype(cfg.code_dtype()).itemsize
        scales = int(np.prod(cfg.scale_shape(n, k), dtype=np.int64))   # () -> 1
        total += codes + 4 * scales + (scales if cfg.has_zp else 0)
    return total


def floor_format(cfg) -> str:
    """The tensor cores a quantized format multiplies on: fp8 and int8 w8a8 on their own,
    weight-only codes dequantized to the activations' bf16 / fp16."""
    return cfg.weight_dtype if cfg.quant_dtype is not None else "bf16"


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


def measure_card(api: CudaApi | None = None, copy_mib: int = 1024, matmul_n: int = 8192,
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
