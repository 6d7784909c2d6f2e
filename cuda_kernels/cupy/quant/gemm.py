"""The quantized grouped GEMM of the fused MoE layer on the GPU: the stage, which hands each
format to its ladder.

    c[s] = (deq(a)[s // top_k] @ deq(w[e]).T + bias[e]) * r[s]
    (r = topk_weights.flat when mul_routed_weight, else 1)

Same name, arguments and returns as reference/quant.py's grouped_gemm_quant (vLLM's flags);
keyword-only extras: version, config, out, programmatic.

    use_fp8_w8a8 / use_int8_w8a8      quant/w8a8.py    rungs v1-v4 (w8a8_v*.cu)
    use_int4_w4a16 / use_int8_w8a16   quant/wna16.py   rungs v1-v6 (wna16_v*.cu)

version and config name a rung / a config of that format's ladder (configs.CONFIGS); without
them the format's route (configs.ROUTES) picks by rows per expert, and configs.block_size_for
gives the alignment block size that lets it take its best entry.
"""
from __future__ import annotations

from reference.quant import quant_format

from . import w8a8 as W8
from . import wna16 as W16


def grouped_gemm_quant(a, w, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k,
                       block_size, topk_weights=None, mul_routed_weight=False, bias=None,
                       a_scale=None, w_scale=None, w_zp=None, use_fp8_w8a8=False,
                       use_int8_w8a8=False, use_int8_w8a16=False, use_int4_w4a16=False,
                       per_act_token_quant=False, per_channel_quant=False, block_shape=None,
                       out_dtype=None, *, version=None, config=None, out=None,
                       programmatic=False):
    """c [a.shape[0] * top_k, N] on the GPU (see the module doc and reference/quant.py).

    version: a rung of the format's ladder ("v1".."v4" w8a8, "v1".."v6" weight-only) or None
    (the route). config: a name of configs.CONFIGS[ladder] or a dict of tunables with its
    "rung". out: a [P, N] array to write (tests poison it first); else one is allocated.
    programmatic: the weight-only v5 starts under the previous kernel's tail (see
    quant/wna16.py grouped_gemm_wna16); every other rung launches as usual.
    """
    fmt = quant_format(use_fp8_w8a8, use_int8_w8a8, use_int8_w8a16, use_int4_w4a16)
    if fmt is None:
        raise ValueError("use_*: the CuPy quantized GEMM needs one of use_fp8_w8a8, "
                         "use_int8_w8a8, use_int8_w8a16, use_int4_w4a16 (the bf16 GEMM is "
                         "cuda_kernels.cupy.grouped_gemm)")
    if fmt in ("fp8", "int8"):
        return W8.grouped_gemm_w8a8(
            a, w, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k, block_size,
            topk_weights, mul_routed_weight, bias, a_scale, w_scale, fmt, per_act_token_quant,
            per_channel_quant, block_shape, out_dtype, version=version, config=config, out=out)
    return W16.grouped_gemm_wna16(
        a, w, sorted_token_ids, expert_ids, num_tokens_post_padded, top_k, block_size,
        topk_weights, mul_routed_weight, bias, w_scale, w_zp, fmt, block_shape, out_dtype,
        version=version, config=config, out=out, programmatic=programmatic)
