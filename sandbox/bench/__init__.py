"""The benchmark harness (`moe-sandbox bench`): our kernels against vLLM's Triton kernel and
torch._grouped_mm, one module per job.

    T tokens, E experts, K top-k, H hidden, I intermediate, P = T*K routed slots

    (the timer)     cuda_kernels/timing.py, which the kernel scripts share: time_cuda (CUDA
                    events or a CUDA graph per rep, the L2 flushed and the routing redrawn
                    before every rep), time_host, time_cpu, summarize -> Stats (median, p20,
                    p80, ...)
    roofline.py     the floor: moe_flops, touched_expert_bytes, roofline_floor,
                    fraction_of_floor, card_limits (datasheets), measure_card (measured)
    cases.py        PRESETS (Mixtral-8x7B, Qwen3-30B-A3B, DeepSeek-V3, "tiny"), make_case
    torch_peers.py  torch_per_expert_loop (the check's reference), torch_grouped_mm_moe
    candidates.py   CANDIDATES by name: cupy, numba, torch-stages, vllm-triton (loaded from
                    --peers), torch-loop, torch-grouped_mm, reference; register_candidate
    quantized.py    the quantized layer's candidates: cupy-<scheme> (reference-<scheme> with
                    --cpu) for every scheme of sandbox.quant.SCHEMES, torch_quantize /
                    torch_dequantize (the NumPy quantizers' twins), dequantized_loop (the check)
    run.py          run_bench: every (preset, T, candidate) checked once, then timed
    results.py      write_results / plot_results / format_table, untuned_note, git_commit

Every name below is one of theirs (the timer's included), handed on: `from sandbox import
bench; bench.time_cuda`.
"""
from cuda_kernels.timing import (CudaApi, EmptyGraph, Stats, cuda_api, summarize, time_cpu,
                                 time_cuda, time_host)

from .candidates import (CANDIDATES, GPU_CANDIDATES, PEERS_DIR, UNAVAILABLE, Unavailable,
                         backend_candidate, default_peers_dir, load_vllm_triton,
                         register_candidate)
from .cases import (CPU_TOKENS, DEFAULT_TOKENS, GPU_PRESETS, GROUPED_ROUTING, PRESETS, Case,
                    ModelPreset, add_points_options, default_tokens, make_case, make_weights,
                    names_arg, no_gpu, points_of, route_preset)
from .quantized import (QUANT_CANDIDATES, dequantized_loop, quant_candidate,
                        quant_candidate_names, torch_dequantize, torch_quantize)
from .results import (DEFAULT_OUT_DIR, RESULTS_DIR, add_out_dir, format_table, git_commit,
                      plot_results, results_stem, slug, untuned_note, write_results)
from .roofline import (FLOOR_FORMATS, KNOWN_CARDS, PEAK_BANDWIDTH, PEAK_FLOPS, card_hbm,
                       card_limits,
                       expert_bytes, floor_format, fraction_of_floor, measure_card, moe_flops,
                       quant_expert_bytes, roofline_floor, touched_expert_bytes,
                       touched_experts)
from .run import RATIO_PEERS, add_ratios, default_candidates, run_bench, tqdm_or_none
from .torch_peers import has_grouped_mm, torch_grouped_mm_moe, torch_per_expert_loop

__all__ = [
    "CANDIDATES", "CPU_TOKENS", "Case", "CudaApi", "DEFAULT_OUT_DIR", "DEFAULT_TOKENS",
    "GROUPED_ROUTING", "add_out_dir", "add_points_options", "names_arg", "no_gpu", "points_of",
    "route_preset",
    "EmptyGraph", "FLOOR_FORMATS", "GPU_CANDIDATES", "GPU_PRESETS", "KNOWN_CARDS",
    "ModelPreset", "PEAK_BANDWIDTH", "PEAK_FLOPS", "PEERS_DIR", "PRESETS", "QUANT_CANDIDATES",
    "RATIO_PEERS", "RESULTS_DIR", "Stats", "UNAVAILABLE", "Unavailable", "add_ratios",
    "backend_candidate", "card_hbm", "card_limits", "cuda_api", "default_candidates",
    "default_peers_dir",
    "default_tokens", "dequantized_loop", "expert_bytes", "floor_format", "format_table",
    "fraction_of_floor",
    "git_commit", "has_grouped_mm", "load_vllm_triton", "make_case", "make_weights",
    "measure_card", "moe_flops", "plot_results", "quant_candidate", "quant_candidate_names",
    "quant_expert_bytes", "register_candidate", "results_stem", "roofline_floor",
    "run_bench", "slug", "summarize", "untuned_note", "time_cpu", "time_cuda", "time_host",
    "torch_dequantize", "torch_grouped_mm_moe", "torch_per_expert_loop", "torch_quantize",
    "touched_expert_bytes", "touched_experts", "tqdm_or_none", "write_results",
]
