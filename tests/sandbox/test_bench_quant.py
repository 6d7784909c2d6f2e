"""`moe-sandbox bench` on the quantized layer (sandbox/bench/quantized.py): the torch
quantizers against the NumPy ones bit for bit, the check's dequantizer, the format's floor,
the candidates on a CPU (the reference's run end to end, CuPy's refusal), the --quant option.
GPU (`gpu`): the CuPy candidates on the tiny preset, checked and floored."""
from __future__ import annotations

import numpy as np
import pytest

from sandbox import bench
from sandbox import quant as Q

torch = pytest.importorskip("torch")


def weights(e=3, n=256, k=384, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((e, n, k), generator=g) * k ** -0.5


@pytest.mark.parametrize("scheme", list(Q.SCHEMES))
def test_torch_quantize_is_the_reference_bit_for_bit(scheme):
    cfg = Q.SCHEMES[scheme]()
    w = weights()
    w[0, 0, :128] = 0.0                     # an all-zero block / group: the eps floor
    q, s, z = bench.torch_quantize(cfg, w)
    rq, rs, rz = Q.quantize_experts(cfg, w.numpy())
    np.testing.assert_array_equal(q.numpy(), rq.view(np.uint8) if cfg.weight_dtype == "fp8"
                                  else rq)
    np.testing.assert_array_equal(s.numpy(), rs)
    assert (z is None) == (rz is None)
    if z is not None:
        np.testing.assert_array_equal(z.numpy(), rz)
    for e in range(w.shape[0]):
        want = Q.dequantize_experts(cfg, rq, rs, rz)[e]
        got = bench.torch_dequantize(cfg, q[e], s[e], None if z is None else z[e])
        np.testing.assert_array_equal(got.numpy(), want)


def test_quant_floor_bytes_are_the_formats():
    h, i = 7168, 2048                                       # DeepSeek-V3
    bf16 = bench.expert_bytes(h, i, 2)
    fp8 = bench.quant_expert_bytes(Q.SCHEMES["fp8_block"](), h, i)
    assert fp8 == bf16 // 2 + 4 * (2 * i // 128 * h // 128 + h // 128 * i // 128)
    w4 = bench.quant_expert_bytes(Q.SCHEMES["w4a16"](), 4096, 14336)   # Mixtral
    groups = 2 * 14336 * 4096 // 128 + 4096 * 14336 // 128
    assert w4 == bench.expert_bytes(4096, 14336, 2) // 4 + 4 * groups
    zp = bench.quant_expert_bytes(Q.SCHEMES["w4a16_zp"](), 4096, 14336)
    assert zp == w4 + groups                                # one uint8 zero point a group
    assert bench.quant_expert_bytes(Q.SCHEMES["fp8_tensor"](), h, i) == bf16 // 2 + 8
    assert [bench.floor_format(Q.SCHEMES[s]()) for s in ("fp8_block", "int8_channel",
                                                         "w4a16", "w8a16")] == \
        ["fp8", "int8", "bf16", "bf16"]


def test_card_limits_by_format():
    assert bench.card_limits("NVIDIA H100 80GB HBM3", "fp8") == (3.35e12, 1979e12)
    assert bench.card_limits("NVIDIA H200", "int8") == (4.8e12, 1979e12)
    assert bench.card_limits("NVIDIA H200", "bf16") == bench.card_limits("NVIDIA H200")
    assert bench.card_limits("NVIDIA A100-SXM4-80GB", "fp8") is None    # no fp8 tensor cores
    with pytest.raises(ValueError, match="fmt"):
        bench.card_limits("NVIDIA H200", "int4")
    # DeepSeek-V3 at T=1 in block fp8 on an H200: 8 experts' codes and scales at 4.8 TB/s
    nbytes = 8 * bench.quant_expert_bytes(Q.SCHEMES["fp8_block"](), 7168, 2048)
    floor = bench.roofline_floor(nbytes, bench.moe_flops(1, 8, 7168, 2048),
                                 *bench.card_limits("NVIDIA H200", "fp8"))
    assert floor == pytest.approx(nbytes / 4.8e12) and 0.07e-3 < floor < 0.08e-3


def test_candidates_and_names():
    for s in Q.SCHEMES:
        assert f"cupy-{s}" in bench.CANDIDATES and f"reference-{s}" in bench.QUANT_CANDIDATES
    assert bench.quant_candidate_names(["fp8_block", "w4a16"]) == ["cupy-fp8_block",
                                                                   "cupy-w4a16"]
    assert bench.quant_candidate_names(["w4a16"], "cpu") == ["reference-w4a16"]
    with pytest.raises(ValueError, match="fp4"):
        bench.quant_candidate_names(["fp4"])


def test_cupy_candidates_refuse_a_cpu_case():
    case = bench.make_case(bench.PRESETS["tiny"], 4, device="cpu")
    for s in Q.SCHEMES:
        with pytest.raises(bench.Unavailable, match="CUDA only"):
            bench.CANDIDATES[f"cupy-{s}"](case)


def test_run_bench_cpu_quantized_points():
    names = ["reference", "reference-fp8_block", "reference-w4a16_zp", "reference-fp8_static",
             "cupy-w4a16"]
    rec = bench.run_bench(["tiny"], (5,), names, device="cpu", warmup=0, reps=2)
    pts = {p["candidate"]: p for p in rec["points"]}
    assert pts["cupy-w4a16"]["error"].startswith(bench.UNAVAILABLE)
    for name in names[1:4]:
        p = pts[name]
        assert "stats" in p and "error" not in p, p
        cfg = Q.SCHEMES[p["quant"]]()
        assert p["rel_err"] <= 2 * Q.tolerance(cfg)
        assert p["bytes"] == p["touched_experts"] * bench.quant_expert_bytes(cfg, 256, 512)
        assert p["vs_reference"] == pytest.approx(
            p["stats"]["median"] / pts["reference"]["stats"]["median"])
        assert "floor_ms" not in p                         # a CPU has no floor
    assert pts["reference-fp8_block"]["floor_format"] == "fp8"
    assert pts["reference-w4a16_zp"]["rel_err"] < 1e-5     # weight-only: exact in fp32
    assert "vs bf16" in bench.format_table(rec)


def test_static_scales_are_calibrated_on_each_points_batch():
    """fp8_static at T = 1 then T = 64 on one quantized layer: scales calibrated on the one
    token would clip the 64 (relative error ~0.1, over the 0.07 bound)."""
    rec = bench.run_bench(["tiny"], (1, 64), ["reference-fp8_static"], device="cpu", warmup=0,
                          reps=1)
    for p in rec["points"]:
        assert "error" not in p and p["rel_err"] <= 2 * Q.tolerance(Q.SCHEMES["fp8_static"]()), p


def test_run_bench_times_no_quantized_candidate_unless_asked():
    default = bench.default_candidates()
    assert {"cupy", "vllm-triton", "reference", "torch-loop"} <= set(default)
    assert not set(default) & set(bench.QUANT_CANDIDATES)


def test_cli_bench_quant_option(capsys):
    from sandbox import cli

    code = cli.main(["bench", "--cpu", "--no-save", "--tokens", "2", "--no-progress",
                     "--candidates", "reference", "--quant", "w4a16,fp8_block"])
    out = capsys.readouterr().out
    assert code == 0 and "reference-w4a16" in out and "reference-fp8_block" in out
    code = cli.main(["bench", "--cpu", "--no-save", "--quant", "fp4"])
    assert code == 2 and "fp8_block" in capsys.readouterr().err


@pytest.mark.gpu
def test_run_bench_gpu_tiny_quantized():
    names = ["cupy"] + bench.quant_candidate_names(list(Q.SCHEMES))
    rec = bench.run_bench(["tiny"], (1, 64), names, device="cuda", warmup=1, reps=3)
    for p in rec["points"]:
        # checked, and not under its floor (the message names the point and its error)
        assert "stats" in p and "error" not in p, (p["candidate"], p["T"], p.get("error"))
        if "quant" in p:
            assert p["rel_err"] <= 2 * Q.tolerance(Q.SCHEMES[p["quant"]]())
            assert "vs_cupy" in p
            if rec["peak_bandwidth"]:
                assert p["fraction_of_floor"] <= 1.0
