"""Quantized MoE layers: vLLM's `FusedMoEQuantConfig`, the quantized parameters a layer holds,
and the checks that refuse a bad combination by name.

    E_local experts on this rank, H hidden, I_p intermediate (per rank), N a GEMM's output
    width (2I_p for w13, H for w2), Kdim its reduction width (H, then I_p), G = Kdim / group

A layer built with `quant_config=` (FusedMoE / MoEWeights) holds its experts quantized,
with vLLM's parameter names (the math and the formats are reference/quant.py's):

    w13_weight, w2_weight      the codes: fp8 e4m3 [E_local, N, Kdim] (ml_dtypes), int8
                               [E_local, N, Kdim], int4 uint8 [E_local, N, Kdim/2] (two codes a
                               byte, low nibble first), w8a16 uint8 [E_local, N, Kdim]
    w13_weight_scale, w2_...   f32: per-tensor [E_local], per-channel [E_local, N], per-block
                               [E_local, N/bn, Kdim/bk] (DeepSeek-V3's weight_scale_inv),
                               per-group [E_local, N, G] (weight-only)
    w13_weight_zero_point, w2_ uint8 [E_local, N, G], one unpacked code a group (has_zp),
                               else None (the default zero point: 8 for int4, 128 for uint8)
    w13_input_scale, w2_input_scale  f32 [E_local] static activation scales (vLLM keeps one
                               per expert and runs with their max), else None (dynamic)

The shared experts (DeepSeek) and the biases stay in params_dtype: a quantized checkpoint's
shared experts are dequantized when loaded. Scales start NaN: an expert never loaded makes
the forward NaN, as the float parameters do.

Schemes (`quant_config` takes a FusedMoEQuantConfig or one of these names):

    fp8_tensor     fp8 weights, one scale per expert; activations per-tensor, dynamic
    fp8_static     as fp8_tensor, with static activation scales (w13/w2_input_scale)
    fp8_token      fp8 weights per output channel, activations dynamic per-token
    fp8_block      DeepSeek-V3: fp8 weights in 128x128 blocks, activations in 1x128 groups
    int8_channel   int8 weights per output channel, activations dynamic per-token (w8a8)
    w4a16          int4 weights, groups of 128 along Kdim, symmetric (zero point 8)
    w4a16_zp       int4 weights with zero points per group (AWQ / GPTQ asymmetric)
    w8a16          weight-only uint8 codes, groups of 128, zero point 128

Errors (each a ValueError naming the tensor or the argument): QuantShapeError (a scale or
code tensor of the wrong shape or dtype), QuantBlockError (a block or group size that does
not divide the dimension it tiles), QuantFormatMismatch (w13 and w2 in different formats),
MissingActivationScale (a static scheme without its input scale).
"""
from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
WEIGHT_DTYPES = ("fp8", "int8", "int4", "uint8")


class QuantConfigError(ValueError):
    """A quant_config that the layer cannot hold (the base of the named errors below)."""


class QuantShapeError(QuantConfigError):
    """A code, scale or zero-point tensor of the wrong shape or dtype."""


class QuantBlockError(QuantConfigError):
    """A block or group size that does not divide the dimension it tiles."""


class QuantFormatMismatch(QuantConfigError):
    """w13 and w2 (or a checkpoint's tensors) in different formats."""


class MissingActivationScale(QuantConfigError):
    """A static activation scheme without the activation scale it needs."""


@dataclasses.dataclass(frozen=True)
class FusedMoEQuantConfig:
    """The quantization of one MoE layer, by vLLM's names (fused_moe/config.py).

    quant_dtype          the activations' codes: "fp8", "int8", or None (weight-only)
    weight_dtype         the weights' codes: "fp8", "int8" (w8a8), "int4" or "uint8" (w8a16);
                         None (and quant_dtype None): unquantized experts
    per_act_token_quant  dynamic per-token activation scales ([M, 1])
    per_out_ch_quant     per-output-channel weight scales ([E, N])
    block_shape          w8a8: [bn, bk] weight blocks with 1 x bk activation groups;
                         weight-only: [0, group_size] (vLLM's convention)
    static_input_scale   w8a8 per-tensor: activation scales loaded with the weights
    has_zp               weight-only: zero points per (row, group)
    w1_bias, w2_bias     the experts' biases ([E, N] each, or None), as vLLM's config carries
                         them to the modular kernel's experts (sandbox/modular/)
    a1_scale, a2_scale   static activation scales handed to the modular experts (None)

One class serves the layer (the format of its quantized weights: their tensors live in
MoEWeights) and the modular kernel (FUSED_MOE_UNQUANTIZED_CONFIG and `make`, with biases).
    """

    quant_dtype: str | None = None
    weight_dtype: str | None = None
    per_act_token_quant: bool = False
    per_out_ch_quant: bool = False
    block_shape: tuple | None = None
    static_input_scale: bool = False
    has_zp: bool = False
    # tensors ride along but are no part of the format: not compared, not printed
    w1_bias: object = dataclasses.field(default=None, compare=False, repr=False)
    w2_bias: object = dataclasses.field(default=None, compare=False, repr=False)
    a1_scale: object = dataclasses.field(default=None, compare=False, repr=False)
    a2_scale: object = dataclasses.field(default=None, compare=False, repr=False)

    @staticmethod
    def make(*, w1_bias=None, w2_bias=None) -> FusedMoEQuantConfig:
        """Unquantized experts with biases (vLLM's FusedMoEQuantConfig.make without a
        quant_dtype); the quantized formats come from the *_moe_quant_config builders."""
        return FusedMoEQuantConfig(w1_bias=w1_bias, w2_bias=w2_bias)

    @property
    def is_quantized(self) -> bool:
        return self.weight_dtype is not None

    def __post_init__(self):
        if self.weight_dtype is None:
            flags = (self.quant_dtype, self.block_shape, self.static_input_scale, self.has_zp,
                     self.per_act_token_quant, self.per_out_ch_quant)
            if any(f not in (None, False) for f in flags):
                raise QuantFormatMismatch(
                    f"weight_dtype: expected one of {list(WEIGHT_DTYPES)} for a quantized "
                    f"format (quant_dtype={self.quant_dtype!r}, block_shape="
                    f"{self.block_shape!r}), got None (unquantized)")
            return
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise QuantConfigError(f"weight_dtype: expected one of {list(WEIGHT_DTYPES)}, got "
                                   f"{self.weight_dtype!r}")
        w8a8 = self.weight_dtype in ("fp8", "int8")
        if w8a8 != (self.quant_dtype is not None) or (
                w8a8 and self.quant_dtype != self.weight_dtype):
            raise QuantFormatMismatch(
                f"quant_dtype: expected {self.weight_dtype!r} activations for "
                f"{self.weight_dtype} weights" if w8a8 else
                f"quant_dtype: weight-only {self.weight_dtype} keeps activations unquantized "
                f"(None), got {self.quant_dtype!r}")
        bs = self.block_shape
        if bs is not None:
            try:
                bs = tuple(int(v) for v in bs)
            except (TypeError, ValueError):
                raise QuantConfigError(f"block_shape: expected two ints, got {bs!r}") from None
            if len(bs) != 2 or bs[1] < 1 or bs[0] < (1 if w8a8 else 0) or (
                    not w8a8 and bs[0] != 0):
                raise QuantConfigError(
                    f"block_shape: expected [bn >= 1, bk >= 1] for {self.weight_dtype} w8a8"
                    if w8a8 else f"block_shape: expected [0, group_size] for weight-only "
                    f"{self.weight_dtype}" + f", got {list(bs)}")
            object.__setattr__(self, "block_shape", bs)
        elif not w8a8:
            raise QuantConfigError("block_shape: weight-only formats need [0, group_size]")
        if w8a8 and bs is not None and (self.per_act_token_quant or self.per_out_ch_quant):
            raise QuantConfigError("block_shape: block scales exclude per_act_token_quant / "
                                   "per_out_ch_quant (the blocks are the granularity)")
        if self.static_input_scale and (not w8a8 or bs is not None
                                        or self.per_act_token_quant):
            raise QuantConfigError("static_input_scale: static activation scales are "
                                   "per-tensor w8a8 only")
        if self.has_zp and w8a8:
            raise QuantConfigError("has_zp: w8a8 formats are symmetric (no zero points)")

    # vLLM's flags ------------------------------------------------------------------------
    use_fp8_w8a8 = property(lambda self: self.weight_dtype == "fp8")
    use_int8_w8a8 = property(lambda self: self.weight_dtype == "int8")
    use_int8_w8a16 = property(lambda self: self.weight_dtype == "uint8")
    use_int4_w4a16 = property(lambda self: self.weight_dtype == "int4")
    is_block_quantized = property(lambda self: self.weight_dtype in ("fp8", "int8")
                                  and self.block_shape is not None)

    @property
    def weight_only(self) -> bool:
        return self.quant_dtype is None

    @property
    def group_size(self) -> int | None:
        return self.block_shape[1] if self.weight_only else None

    @property
    def weight_granularity(self) -> str:
        if self.weight_only:
            return "group"
        return "block" if self.block_shape else ("channel" if self.per_out_ch_quant
                                                 else "tensor")

    def kernel_flags(self) -> dict:
        """The format flags of grouped_gemm_quant / fused_experts_quant (reference/quant.py)."""
        return dict(use_fp8_w8a8=self.use_fp8_w8a8, use_int8_w8a8=self.use_int8_w8a8,
                    use_int8_w8a16=self.use_int8_w8a16, use_int4_w4a16=self.use_int4_w4a16,
                    per_act_token_quant=self.per_act_token_quant,
                    per_channel_quant=self.per_out_ch_quant,
                    block_shape=None if self.block_shape is None else list(self.block_shape))

    def describe(self) -> str:
        if self.weight_only:
            return (f"{self.weight_dtype} weight-only, groups of {self.group_size}"
                    + (", zero points" if self.has_zp else ""))
        act = ("1x%d groups" % self.block_shape[1] if self.block_shape else
               "per-token" if self.per_act_token_quant else
               "per-tensor static" if self.static_input_scale else "per-tensor dynamic")
        w = (f"{list(self.block_shape)} blocks" if self.block_shape else
             "per-channel" if self.per_out_ch_quant else "per-tensor")
        return f"{self.weight_dtype} w8a8: weights {w}, activations {act}"

    # shapes --------------------------------------------------------------------------------
    def code_dtype(self) -> np.dtype:
        return {"fp8": FP8, "int8": np.dtype(np.int8)}.get(self.weight_dtype, np.dtype(np.uint8))

    def code_shape(self, n: int, k: int) -> tuple[int, int]:
        """One expert's codes for a logical [N, Kdim] weight."""
        return (n, k // 2) if self.weight_dtype == "int4" else (n, k)

    def scale_shape(self, n: int, k: int) -> tuple[int, ...]:
        """One expert's weight scales for a logical [N, Kdim] weight."""
        g = self.weight_granularity
        if g == "tensor":
            return ()
        if g == "channel":
            return (n,)
        if g == "block":
            return (n // self.block_shape[0], k // self.block_shape[1])
        return (n, k // self.group_size)

    def check_dims(self, hidden_size: int, intermediate_size: int, gated: bool = True,
                   interleaved: bool = False) -> None:
        """QuantBlockError unless every block / group divides what it tiles: bn the rows of
        w13's gate and up halves (I) and of w2 (H), bk the columns of both (H, I); a group
        size both Kdims; int4 needs even Kdims (two codes a byte)."""
        dims = {"hidden_size": hidden_size, "intermediate_size": intermediate_size}
        if self.block_shape is None:
            return
        bn, bk = self.block_shape
        if self.weight_only:
            for name, d in dims.items():
                if d % bk:
                    raise QuantBlockError(f"group_size: expected a divisor of {name} = {d} "
                                          f"(the Kdim of {'w13' if name == 'hidden_size' else 'w2'}), "
                                          f"got {bk}")
            return
        if interleaved:
            raise QuantBlockError("block_shape: swigluoai interleaves gate and up rows, so a "
                                  "weight block would mix them; block scales need them apart")
        for name, d in dims.items():
            for what, b in (("bn", bn), ("bk", bk)):
                if d % b:
                    raise QuantBlockError(
                        f"block_shape: expected {what} = {b} to divide {name} = {d} (the "
                        f"{'rows' if what == 'bn' else 'columns'} a [{bn}, {bk}] block tiles)")


def fp8_w8a8_moe_quant_config(per_act_token_quant=False, per_out_ch_quant=False,
                              block_shape=None, static_input_scale=False) -> FusedMoEQuantConfig:
    """fp8 e4m3 weights and activations (vLLM's fp8_w8a8_moe_quant_config, scales apart)."""
    return FusedMoEQuantConfig("fp8", "fp8", per_act_token_quant, per_out_ch_quant,
                               block_shape, static_input_scale)


def int8_w8a8_moe_quant_config(per_act_token_quant=False, per_out_ch_quant=False,
                               block_shape=None, static_input_scale=False) -> FusedMoEQuantConfig:
    """int8 weights and activations (vLLM's int8_w8a8_moe_quant_config, scales apart)."""
    return FusedMoEQuantConfig("int8", "int8", per_act_token_quant, per_out_ch_quant,
                               block_shape, static_input_scale)


def int4_w4a16_moe_quant_config(group_size=128, has_zp=False) -> FusedMoEQuantConfig:
    """int4 weights, bf16 activations, per-group scales (vLLM: block_shape=[0, group_size])."""
    return FusedMoEQuantConfig(None, "int4", block_shape=(0, group_size), has_zp=has_zp)


def int8_w8a16_moe_quant_config(group_size=128, has_zp=False) -> FusedMoEQuantConfig:
    """uint8 weight codes (zero point 128 or given), bf16 activations, per-group scales."""
    return FusedMoEQuantConfig(None, "uint8", block_shape=(0, group_size), has_zp=has_zp)


SCHEMES = {
    "fp8_tensor": lambda: fp8_w8a8_moe_quant_config(),
    "fp8_static": lambda: fp8_w8a8_moe_quant_config(static_input_scale=True),
    "fp8_token": lambda: fp8_w8a8_moe_quant_config(True, True),
    "fp8_block": lambda: fp8_w8a8_moe_quant_config(block_shape=(128, 128)),
    "int8_channel": lambda: int8_w8a8_moe_quant_config(True, True),
    "w4a16": lambda: int4_w4a16_moe_quant_config(128),
    "w4a16_zp": lambda: int4_w4a16_moe_quant_config(128, has_zp=True),
    "w8a16": lambda: int8_w8a16_moe_quant_config(128),
}

# vLLM's tests' tolerances on a quantized layer's output (relative), by weight granularity
TOLERANCES = {"block": 0.035, "int8": 0.065, "weight_only": 2e-2, "fp8": 0.035}


def tolerance(cfg: FusedMoEQuantConfig) -> float:
    """The relative tolerance vLLM's tests give this format: block fp8 0.035, int8 w8a8 0.065,
    weight-only 2e-2 (fp8 per-tensor / per-token: 0.035 as block fp8)."""
    if cfg.weight_only:
        return TOLERANCES["weight_only"]
    return TOLERANCES["int8"] if cfg.weight_dtype == "int8" else TOLERANCES["fp8"]


FUSED_MOE_UNQUANTIZED_CONFIG = FusedMoEQuantConfig()


def as_quant_config(value) -> FusedMoEQuantConfig | None:
    """None, a FusedMoEQuantConfig, or a scheme name of SCHEMES (an unquantized config is
    None: the layer holds float weights)."""
    if value is None or isinstance(value, FusedMoEQuantConfig):
        return value if value is not None and value.is_quantized else None
    if isinstance(value, str) and value in SCHEMES:
        return SCHEMES[value]()
    raise QuantConfigError(f"quant_config: expected a FusedMoEQuantConfig or one of "
                           f"{list(SCHEMES)}, got {value!r}")


# ----------------------------------------------------------------------------- quantizing floats
def quantize_experts(cfg: FusedMoEQuantConfig, w):
    """Float experts w [E, N, Kdim] -> (codes, scale, zero_point or None) in cfg's format,
    through reference/quant.py's quantizers (scale shapes as the module docstring's)."""
    from reference import quant as RQ

    wf = np.asarray(w, dtype=np.float32)
    if cfg.weight_only:
        return RQ.quantize_weight_wna16(wf, 4 if cfg.weight_dtype == "int4" else 8,
                                        cfg.group_size, cfg.has_zp)
    q, s = (RQ.quantize_weight_fp8 if cfg.weight_dtype == "fp8" else RQ.quantize_weight_int8)(
        wf, cfg.weight_granularity,
        cfg.block_shape if cfg.block_shape is not None else RQ.DEFAULT_BLOCK_SHAPE)
    return q, s, None


def dequantize_experts(cfg: FusedMoEQuantConfig, codes, scale, zero_point=None):
    """Codes and scales -> fp32 experts [E, N, Kdim] (reference.quant.dequantize_weight)."""
    from reference import quant as RQ

    flags = cfg.kernel_flags()
    flags.pop("per_act_token_quant")
    return RQ.dequantize_weight(codes, scale, zero_point, **flags)


def check_tensor(name, arr, shape, dtype) -> np.ndarray:
    """QuantShapeError naming `name` unless arr has exactly this shape and dtype."""
    a = np.asarray(arr)
    if a.dtype != np.dtype(dtype):
        raise QuantShapeError(f"{name}: expected dtype {np.dtype(dtype)}, got {a.dtype}")
    if a.shape != tuple(shape):
        raise QuantShapeError(f"{name}: expected shape {tuple(shape)}, got {a.shape}")
    return a
