"""The quantized stages of the CuPy backend: activation quantization and the quantized grouped
GEMMs, each GEMM a ladder of kernels with one .cu per rung (docs/stages.md, "Quantized
experts"; the NumPy twins are reference/quant.py's).

    act.py            moe_kernel_quantize_input, per_token_group_quant_fp8, ...    (act.cu)
    gemm.py           grouped_gemm_quant: the stage, which hands each format to its ladder
    w8a8.py           fp8 / int8 activations and weights                  (w8a8_v1..v4_*.cu)
    wna16.py          int4 / int8 weights, bf16 / fp16 activations        (wna16_v1..v6_*.cu)
    wna16_packed.py   v4's prepacked int4 layout and launch plan (v5 and v6 read it too)
    wna16_staged.py   v5's stage layout and launch plan
    wna16_wgmma.py    v6's launch plan
    configs.py        ONE config table for both ladders, the routes that pick from it by rows
                      per expert, the block size they want, the napkin math
    epilogue.py       what both ladders share: the epilogue's operands, argument checks, the
                      compiled-kernel cache, the split-K workspace

    rung  w8a8 (fp8 / int8)                        wna16 (int4 / int8 weights)
    v1    one thread per output                    dequantize, then multiply, per output
    v2    mma.sync m16n8k32, per-block scales      mma.sync m16n8k16 on registers dequantized
    v3    fp8 decode: weights streamed as A        int4 decode: weights streamed as A
    v4    fp8 wgmma e4m3, per-block promotion      int4 prepacked: warp loads = mma fragments
    v5                                             int4 staged pipeline, stream-K runs, WS
    v6                                             int4 wgmma with register A (opt-in)

Shared .cuh: common.cuh (w8a8 v1-v2, wna16 v1-v3), wna16_common.cuh (wna16 v4-v6). Each
ladder module runs as a script: validate every rung, then time the route
(`python -m cuda_kernels.cupy.quant.wna16 [--quick]`). Importing this package needs neither
CuPy nor a GPU.
"""
