"""The benchmark harness: its arithmetic on known numbers, the torch peers against the
reference, the CPU timer and the results files. GPU tests (marked) check the CUDA timer,
the card measurement and a tiny run end to end; nothing here asserts a time."""
from __future__ import annotations

import json

import numpy as np
import pytest

import reference
from sandbox import bench


# ----------------------------------------------------------------------------- arithmetic

def test_summarize_known_numbers():
    s = bench.summarize(range(1, 11))
    assert (s.median, s.mean, s.min, s.max, s.n) == (5.5, 5.5, 1.0, 10.0, 10)
    assert s.p20 == pytest.approx(2.8) and s.p80 == pytest.approx(8.2)   # linear interpolation
    one = bench.summarize([3.0])
    assert one.median == one.p20 == one.p80 == 3.0
    with pytest.raises(ValueError, match="samples"):
        bench.summarize([])


def test_expert_bytes_and_touched():
    assert bench.expert_bytes(4096, 14336, 2) == 3 * 4096 * 14336 * 2         # Mixtral expert
    assert bench.expert_bytes(64, 32, 4, gated=False) == 2 * 64 * 32 * 4
    ids = np.array([[0, 1], [1, 2], [2, 0]])
    assert bench.touched_experts(ids) == 3
    assert bench.touched_experts(np.array([[5, -1], [5, 7]]), num_experts=8) == 2
    assert bench.touched_experts(np.zeros((0, 2), np.int32)) == 0
    assert bench.touched_expert_bytes(ids, 8, 4, 2) == 3 * 3 * 8 * 4 * 2


def test_deepseek_t1_floor_is_the_weights_of_8_experts():
    """Issue 8 quotes ~0.147 ms for DeepSeek-V3 at T=1 in bf16 at 4.8 TB/s."""
    p = bench.PRESETS["deepseek-v3"]
    ids = np.arange(8)[None, :]                                   # T=1, top-8
    nbytes = bench.touched_expert_bytes(ids, p.hidden_size, p.intermediate_size, 2)
    assert nbytes == 8 * 3 * 7168 * 2048 * 2
    flops = bench.moe_flops(1, 8, 7168, 2048)
    assert flops == 2 * 8 * 3 * 7168 * 2048
    floor = bench.roofline_floor(nbytes, flops)
    assert floor == nbytes / 4.8e12                               # memory bound
    assert floor * 1e3 == pytest.approx(0.1468, abs=1e-4)


def test_mixtral_large_t_floor_is_compute_bound():
    p = bench.PRESETS["mixtral-8x7b"]
    flops = bench.moe_flops(16384, p.top_k, p.hidden_size, p.intermediate_size)
    assert flops == 2 * 16384 * 2 * 3 * 4096 * 14336
    nbytes = 8 * p.expert_bytes(2)
    assert bench.roofline_floor(nbytes, flops) == flops / 989e12
    assert bench.roofline_floor(1.0, 1.0, bandwidth=1.0, peak_flops=0.5) == 2.0


def test_fraction_of_floor():
    assert bench.fraction_of_floor(2e-3, 1e-3) == 0.5
    assert np.isnan(bench.fraction_of_floor(0.0, 1e-3))


def test_presets():
    assert [(p.num_experts, p.top_k, p.hidden_size, p.intermediate_size)
            for p in (bench.PRESETS[n] for n in bench.GPU_PRESETS)] == [
        (8, 2, 4096, 14336), (128, 8, 2048, 768), (256, 8, 7168, 2048)]


# ----------------------------------------------------------------------------- peers

@pytest.mark.parametrize("peer", [bench.torch_per_expert_loop, bench.torch_grouped_mm_moe])
@pytest.mark.parametrize("T", [1, 7, 40])
def test_torch_peers_match_the_reference(peer, T):
    torch = pytest.importorskip("torch")
    if peer is bench.torch_grouped_mm_moe and not bench.has_grouped_mm():
        pytest.skip("torch has no _grouped_mm")
    rng = np.random.default_rng(T)
    E, K, H, I = 6, 2, 32, 48  # noqa: E741
    x = rng.standard_normal((T, H), dtype=np.float32)
    w13 = rng.standard_normal((E, 2 * I, H), dtype=np.float32) / np.float32(np.sqrt(H))
    w2 = rng.standard_normal((E, H, I), dtype=np.float32) / np.float32(np.sqrt(I))
    logits = rng.standard_normal((T, E), dtype=np.float32)
    tw, ti, _ = reference.fused_topk(x, logits, K, True)
    want = reference.fused_experts(x, w13, w2, tw, ti, precision="exact")
    got = peer(*(torch.from_numpy(a) for a in (x, w13, w2, tw, ti.astype(np.int64)))).numpy()
    assert got.dtype == np.float32
    err = np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want)
    assert err <= 1e-5


def test_torch_peers_empty_batch():
    torch = pytest.importorskip("torch")
    x = torch.zeros((0, 8))
    out = bench.torch_per_expert_loop(x, torch.ones(2, 6, 8), torch.ones(2, 8, 3),
                                      torch.zeros((0, 1)), torch.zeros((0, 1), dtype=torch.long))
    assert out.shape == (0, 8)


# ----------------------------------------------------------------------------- timers, runs

def test_time_cpu_calls_rotate_before_every_run():
    calls, seen = [], []
    stats = bench.time_cpu(lambda: seen.append(len(calls)), warmup=2, reps=3,
                           rotate=calls.append)
    assert calls == [0, 1, 2, 3, 4] and seen == [1, 2, 3, 4, 5]
    assert stats.n == 3 and stats.p20 <= stats.median <= stats.p80


def test_make_case_redraw_rewrites_routing_in_place():
    pytest.importorskip("torch")
    case = bench.make_case(bench.PRESETS["tiny"], 64, device="cpu", seed=1)
    buf_w, buf_ids = case.topk_weights, case.topk_ids
    before = buf_ids.clone()
    case.redraw(1)
    assert case.topk_weights is buf_w and case.topk_ids is buf_ids
    assert not bool((before == buf_ids).all())
    assert bool((case.topk_ids32 == case.topk_ids).all())
    assert np.allclose(buf_w.sum(-1).numpy(), 1.0, atol=1e-6)
    assert case.touched and 1 <= case.touched[-1] <= 8
    zipf = bench.make_case(bench.PRESETS["tiny"], 256, device="cpu", routing="zipf")
    counts = np.bincount(zipf.topk_ids.numpy().ravel(), minlength=8)
    assert counts.max() > 1.5 * counts.mean()


def test_run_bench_cpu_record_and_files(tmp_path):
    pytest.importorskip("torch")
    # (not "numba": importing it here would fix its simulator mode for the whole session)
    rec = bench.run_bench(["tiny"], (1, 9), ["reference", "torch-loop", "cupy"],
                          device="cpu", warmup=0, reps=2)
    pts = rec["points"]
    assert len(pts) == 6
    for p in pts:
        if p["candidate"] in ("reference", "torch-loop"):
            assert p["rel_err"] <= 1e-5
            assert p["bytes"] == p["touched_experts"] * bench.expert_bytes(256, 512, 4)
            # a CPU point gets no GPU floor, and no ratio to a peer that did not run
            assert "floor_ms" not in p and "fraction_of_floor" not in p
            assert "vs_vllm-triton" not in p
        elif "stats" not in p:
            assert p["error"].startswith(bench.UNAVAILABLE)
    assert rec["device"] == "cpu" and rec["peak_bandwidth"] is None
    path = bench.write_results(rec, tmp_path, command="moe-sandbox bench --cpu")
    assert path.name == "bench_cpu_eager.json"
    data = json.loads(path.read_text())
    assert {"date", "commit", "command", "points", "peak_bandwidth", "graph",
            "device"} <= set(data)
    assert all({"model", "T", "candidate"} <= set(p) for p in data["points"])
    png = bench.plot_results(rec, path.with_suffix(".png"))
    assert png is None or png.stat().st_size > 0
    assert "tiny" in bench.format_table(rec)


def test_card_limits_only_for_known_cards():
    assert bench.card_limits("NVIDIA H100 80GB HBM3") == (3.35e12, 989e12)
    assert bench.card_limits("NVIDIA H200") == (4.8e12, 989e12)
    assert bench.card_limits("NVIDIA H100 PCIe")[0] == 2.0e12      # not the SXM part's
    assert bench.card_limits("NVIDIA GeForce RTX 4090") is None
    assert bench.card_limits("cpu") is None and bench.card_limits(None) is None


def test_add_ratios_to_both_peers():
    def pt(cand, med, T=64):
        return {"model": "m", "T": T, "candidate": cand,
                "stats": {"median": med, "p20": med, "p80": med}, "rel_err": 0.0}
    pts = [pt("cupy", 1.0), pt("vllm-triton", 2.0), pt("torch-grouped_mm", 4.0),
           pt("cupy", 3.0, T=1), {"model": "m", "T": 1, "candidate": "vllm-triton",
                                   "error": "run: boom"}]
    bench.add_ratios(pts)
    assert pts[0]["vs_vllm-triton"] == 0.5 and pts[0]["vs_torch-grouped_mm"] == 0.25
    assert pts[1]["vs_vllm-triton"] == 1.0
    assert "vs_vllm-triton" not in pts[3]        # the peer failed at T=1: no ratio
    table = bench.format_table({"points": pts})
    assert "vs vLLM" in table and " 0.50 " in table


def test_vllm_triton_peer_is_found_or_unavailable(tmp_path):
    """The peer is loaded from a folder at run time; a folder without it says so."""
    with pytest.raises(bench.Unavailable, match="no vLLM Triton peer"):
        bench.load_vllm_triton(tmp_path)
    found = bench.default_peers_dir()
    if found is not None:
        assert (found / "vllm_triton" / "peer.py").is_file()


def test_cli_bench_refuses_a_peers_folder_without_the_peer(tmp_path, capsys):
    pytest.importorskip("torch")
    from sandbox import cli

    code = cli.main(["bench", "--cpu", "--peers", str(tmp_path), "--no-save", "--tokens", "1",
                     "--no-progress"])
    assert code == 2 and "--peers" in capsys.readouterr().err


def test_bench_writes_outside_the_source_tree_by_default():
    from sandbox import cli

    assert not bench.DEFAULT_OUT_DIR.is_absolute()
    assert cli.bench_out_default() == bench.DEFAULT_OUT_DIR
    assert bench.RESULTS_DIR != bench.DEFAULT_OUT_DIR.resolve()


def test_run_bench_rejects_unknown_candidates():
    with pytest.raises(ValueError, match="candidates"):
        bench.run_bench(["tiny"], (1,), ["warp-drive"], device="cpu")


def test_time_cuda_without_a_device_says_so():
    if bench.cuda_api() is not None:
        pytest.skip("a GPU is visible")
    with pytest.raises(RuntimeError, match="CUDA device"):
        bench.time_cuda(lambda: None)


# ----------------------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_time_cuda_events_and_graph():
    torch = pytest.importorskip("torch")
    a = torch.randn(512, 512, device="cuda")
    calls = []
    s = bench.time_cuda(lambda: a @ a, warmup=2, reps=5, rotate=calls.append)
    assert calls == list(range(7)) and s.n == 5 and 0 < s.p20 <= s.median <= s.p80
    out = torch.empty(512, 512, device="cuda")
    g = bench.time_cuda(lambda: torch.matmul(a, a, out=out), warmup=1, reps=3, graph=True)
    assert g.n == 3 and g.median > 0


@pytest.mark.gpu
def test_measure_card_is_plausible():
    card = bench.measure_card(copy_mib=256, matmul_n=2048, reps=3)
    assert card["copy_TBps"] > 0.1 and card["matmul_TFLOPs"] > 1 and card["l2_bytes"] > 0


@pytest.mark.gpu
def test_run_bench_gpu_tiny():
    rec = bench.run_bench(["tiny"], (1, 64), device="cuda", warmup=1, reps=3)
    ok = [p for p in rec["points"] if "stats" in p]
    assert {"torch-loop", "torch-grouped_mm"} <= {p["candidate"] for p in ok}
    for p in ok:
        assert p["rel_err"] <= 2e-2, p          # bf16 against the bf16 torch loop


def test_bench_wna16_config_overrides():
    """bench_wna16.py --configs "name+KEY=VALUE": a known config with integer overrides."""
    import importlib.util
    import pathlib

    from cuda_kernels.cupy import quant_gemm_wna16 as W

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_wna16.py"
    spec = importlib.util.spec_from_file_location("bench_wna16", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    name, cfg = mod._config_override(W.PACKED_CONFIGS, "q16+RED=114688+D=4")
    assert name == "q16+RED=114688+D=4"
    assert cfg == dict(W.PACKED_CONFIGS["q16"], RED=114688, D=4)
    assert W.PACKED_CONFIGS["q16"]["D"] == 2                     # the table is untouched
    with pytest.raises(SystemExit, match="config names"):
        mod._config_override(W.PACKED_CONFIGS, "q99")
    with pytest.raises(SystemExit, match="KEY=integer"):
        mod._config_override(W.PACKED_CONFIGS, "q16+RED=big")


def _dev_module(name):
    """benchmarks/dev/<name>.py, imported from its file (the folder is no package)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "dev" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_times_regression_recovers_a_known_model(tmp_path, capsys):
    """benchmarks/dev/times_regression.py on synthetic TIMES launches: CTAs whose durations are
    a known function of their runs (and noise that follows the SM they land on, drawn afresh
    per launch) give a pace that correlates by run and not by SM, and a fit with R2 ~1 that
    returns the coefficients."""
    mod = _dev_module("times_regression")
    rng = np.random.default_rng(3)
    Q = 256
    units = rng.integers(40, 60, Q)
    lt_units = units * rng.integers(1, 4, Q)
    parts = rng.integers(1, 3, Q)
    young = np.arange(Q) >= Q // 2
    cost = lt_units + 5 * units
    want = dict(c0=10.0, units=0.5, lt=0.25, parts=6.0, young=0.02)
    files = []
    for k in range(3):
        sm = rng.permutation(np.repeat(np.arange(Q // 2), 2))     # two CTAs an SM, anywhere
        start = np.where(young, 0.2, 0.0)                         # the second half starts later
        per_sm = rng.normal(0, 1e-3, Q // 2)[sm]                  # an SM's noise, this launch's
        d = (want["c0"] + want["units"] * units + want["lt"] * lt_units +
             want["parts"] * parts + want["young"] * young * cost) * (1 + per_sm)
        rows = [dict(T=64, config="t24", variant="TIMES=1", gemm="g1", sm=sm.tolist(),
                     start_us=start.tolist(), end_us=(start + d).tolist(),
                     units=units.tolist(), lt_units=lt_units.tolist(), parts=parts.tolist())]
        f = tmp_path / f"probe_{k}.json"
        f.write_text(json.dumps(rows))
        files.append(f"{f}:TIMES=1")
    mod.main(files)
    out = capsys.readouterr().out
    by_run = float(out.split("pace by run (CTA q), mean correlation between launches: ")[1][:4])
    by_sm = float(out.split("pace by SM, older CTA: ")[1].split(",")[0])
    assert by_run > 0.95 and abs(by_sm) < 0.4
    last = [line for line in out.splitlines() if line.strip().startswith("R2")][-1]
    assert float(last.split()[1].rstrip(",")) > 0.99
    got = dict(zip(["c0", "units", "lt", "parts", "young"],
                   (float(t.split()[-1]) for t in last.split(": ", 1)[1].split(", "))))
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=0.02, abs=1e-3), (k, got)


def test_balance_bound_spans_last_end_to_mean():
    """times_regression.balance_bound: with no sharing (k = 1) a launch ends at its last SM's
    end, with all SMs sharing at their mean, and in between the bound falls as k grows; SMs
    that all end together give that end at every k."""
    mod = _dev_module("times_regression")
    rng = np.random.default_rng(5)
    ends = rng.normal(170.0, 3.0, 132)
    sm = np.repeat(np.arange(132), 2)
    end = np.repeat(ends, 2) - np.tile([12.0, 0.0], 132)       # the SM ends with its later CTA
    b = mod.balance_bound(dict(sm=sm, end=end))
    assert b[1] == pytest.approx(ends.max()) and b[132] == pytest.approx(ends.mean())
    vals = [b[k] for k in (1, 2, 4, 8, 16, 132)]
    assert all(x >= y - 1e-9 for x, y in zip(vals, vals[1:])) and vals[0] > vals[-1] + 3
    flat = mod.balance_bound(dict(sm=sm, end=np.full(264, 150.0)))
    assert all(v == pytest.approx(150.0) for v in flat.values())


def test_probe_staged_specs_and_bench_routings():
    """probe_staged's own-variant configs ("CFG@VARIANT") and --bench-routing spec, and
    bench_quant.routings_of, the routings they rebuild: a run's draws at its last point."""
    mod = _dev_module("probe_staged")
    assert mod._own_variants("t24+TEAMS=2+MINB=1@TEAMS=2+TIMES=1", "base,X=1") == (
        "t24+TEAMS=2+MINB=1", ["TEAMS=2+TIMES=1"])
    assert mod._own_variants("t24", "base,X=1") == ("t24", ["base", "X=1"])
    assert mod._bench_routing_spec("1,16,64:2") == ([1, 16, 64], 2)
    with pytest.raises(Exception, match="T0,T1"):
        mod._bench_routing_spec("64")
    from benchmarks import bench_quant as BQ
    rng = np.random.default_rng(0)
    for T in (1, 16, 64):
        want = [BQ.draw_routing(rng, T, 8, 2) for _ in range(BQ.ROUTINGS)]
    got = BQ.routings_of([1, 16, 64], 8, 2)
    assert len(got) == BQ.ROUTINGS and got[2][0].shape == (64, 2)
    for (ids, tw), (ids0, tw0) in zip(got, want):
        assert np.array_equal(ids, ids0) and np.array_equal(tw, tw0)


def test_sass_mix_runs_opcodes_and_chains(tmp_path, capsys):
    """sass_mix on a hand-written listing: two runs of HMMA (split where they are more than the
    gap apart), predicated and dotted opcodes counted by their base, and each chain link's HMMA
    in between (R8 accumulates onto itself with one other mma between; a C of RZ starts a
    chain)."""
    mod = _dev_module("sass_mix")
    lines = ["HMMA.16816.F32.BF16 R8, R20, R30, RZ", "LOP3.LUT R20, R1, 0xf, R2, 0xf8, !PT",
             "HMMA.16816.F32.BF16 R12, R22, R30, RZ", "@!P4 SHF.R.U32.HI R21, RZ, 0x4, R1",
             "HMMA.16816.F32.BF16 R8, R20, R31, R8", "HMMA.16816.F32.BF16 R12, R22, R31, R12"]
    lines += ["NOP"] * 5 + ["HMMA.16816.F32.BF16 R8, R24, R32, R8", "BAR.SYNC.DEFER_BLOCKING 0x0"]
    text = "\n".join(f"        /*{16 * k:04x}*/                   {s} ;  /* 0x0 */"
                     for k, s in enumerate(lines))
    ins = mod.parse(text)
    assert len(ins) == len(lines) and ins[3].startswith("@!P4 SHF")
    assert [mod.opcode(s) for s in ins[:4]] == ["HMMA", "LOP3", "HMMA", "SHF"]
    assert mod.hmma_runs(ins, gap=60) == [(0, 11)]
    assert mod.hmma_runs(ins, gap=4) == [(0, 5), (11, 11)]
    assert mod.chain_gaps(ins, 0, 11) == [1, 1, 1]     # R8 <- R8, R12 <- R12, R8 <- R8
    assert mod.chain_gaps(ins, 11, 11) == []           # its C was written outside the run
    path = tmp_path / "k.sass"
    path.write_text(text)
    mod.main([str(path), "--gap", "4"])
    out = capsys.readouterr().out
    assert "run 0-5: 6 instructions, 4 HMMA" in out and "1:2" in out


def test_nvrtc_sweep_builds_and_text_md5():
    """benchmarks/dev/nvrtc_sweep.py: every build names a config the probe can launch, and
    prebuild.text_md5 reads the kernel's code section out of a cubin: the prebuilt bf16 / fp16
    builds of t24 (one kernel, other code) differ, and a name the cubin lacks is an error."""
    import lzma

    from benchmarks.bench_wna16 import _config_override
    from cuda_kernels.cupy import _compile as C
    from cuda_kernels.cupy import prebuild
    from cuda_kernels.cupy import quant_gemm_wna16 as W

    mod = _dev_module("nvrtc_sweep")
    for build, (spec, extra) in mod.BUILDS.items():
        _, cfg = _config_override(dict(W.STAGED_CONFIGS), spec)
        assert cfg["KERNEL"] == "staged", build
        assert set(extra) <= {"ptxas_options", "max_register_count", "extra_device_vectorization",
                              "restrict", "defines", "arch", "act", "awaits"}, build
        # a warp-specialized config (setmaxnreg) builds for sm_90a, every other for sm_90
        assert extra.get("arch", "sm_90") == ("sm_90a" if cfg.get("WS") else "sm_90"), build
        W.staged_kernel_name(cfg, False, act=extra.get("act", False),    # a role it can take
                             awaits=extra.get("awaits", False))
    entries = C.prebuilt_manifest()["entries"]
    md5 = {}
    for key, e in entries.items():
        if e["name"] == W.staged_kernel_name(W.STAGED_CONFIGS["t24"], False):
            cubin = lzma.decompress((C.PREBUILT_DIR / f"{key[:16]}.cubin.xz").read_bytes())
            md5[e["defines"]["ELEM_BF16"]] = prebuild.text_md5(cubin, e["mangled"])
            assert md5[e["defines"]["ELEM_BF16"]] == e["text_md5"]
            with pytest.raises(ValueError, match="no .text"):
                prebuild.text_md5(cubin, e["mangled"] + "x")
    assert set(md5) == {0, 1} and md5[0] != md5[1]
    assert all(len(v) == 12 and int(v, 16) >= 0 for v in md5.values())


def test_device_call_scripts_parse():
    """The device-call scripts (benchmarks/**/*.sh) parse as bash: a syntax error would only
    show on the GPU machine, and cost that call."""
    import pathlib
    import subprocess

    scripts = sorted((pathlib.Path(__file__).resolve().parents[1] / "benchmarks").rglob("*.sh"))
    assert any(p.name == "dataflow_call.sh" for p in scripts)
    for path in scripts:
        r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert r.returncode == 0, f"{path.name}: {r.stderr}"
