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


def test_redraw_hooks_belong_to_the_candidate_that_made_them(monkeypatch):
    """A candidate's `after_redraw` hooks (the vLLM peer remakes its expert assignment there)
    run after every redraw of its own timing, and the next candidate starts with none."""
    pytest.importorskip("torch")
    from sandbox.bench import candidates

    log = []

    def with_hook(case):
        case.after_redraw.append(lambda: log.append(("a", len(case.touched))))
        return candidates.CANDIDATES["torch-loop"](case)

    def plain(case):
        log.append(("b starts",))
        return candidates.CANDIDATES["torch-loop"](case)

    monkeypatch.setitem(candidates.CANDIDATES, "hooked", with_hook)
    monkeypatch.setitem(candidates.CANDIDATES, "plain", plain)
    rec = bench.run_bench(["tiny"], (9,), ["hooked", "plain"], device="cpu", warmup=1, reps=2)
    assert all("stats" in p for p in rec["points"]), rec["points"]
    b = log.index(("b starts",))
    hooked = log[:b]
    # one call per redraw, each after the routing it follows was recorded
    assert len(hooked) >= 3 and [n for _, n in hooked] == list(range(1, len(hooked) + 1))
    assert all(entry[0] != "a" for entry in log[b:])


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


def test_untuned_note_names_the_points_that_ran_the_default_rung():
    """A `cupy` point whose plan took a GEMM's rung from the table's default (this card never
    tuned there) is named with its rungs and the tune command; all measured: no note."""
    def pt(T, tuned, cand="cupy"):
        return {"model": "qwen3-30b-a3b", "T": T, "candidate": cand, "rungs": ["v4", "v4"],
                "rungs_tuned": tuned}
    rec = {"device": "NVIDIA H200", "points": [pt(1, False), pt(64, True),
                                              pt(1, False, cand="vllm-triton"),
                                              {"model": "m", "T": 2, "candidate": "cupy",
                                               "error": "setup: boom"}]}
    note = bench.untuned_note(rec)
    assert note.startswith("note: NVIDIA H200 has no tuned rung")
    assert "qwen3-30b-a3b T=1 (v4/v4)" in note and "T=64" not in note
    assert "python -m cuda_kernels.cupy.tune" in note
    rec["points"] = rec["points"][1:]
    assert bench.untuned_note(rec) is None


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
def test_vllm_peer_follows_the_redrawn_routing():
    """The peer's expert assignment is made outside its timed call; after a redraw it is
    made again, so the peer computes the new routing (T = 64 on the tiny preset takes vLLM's
    sorted assignment, not the naive one that reads topk_ids directly)."""
    torch = pytest.importorskip("torch")
    from sandbox.bench import candidates

    try:
        bench.load_vllm_triton()
    except bench.Unavailable as exc:
        pytest.skip(str(exc))
    case = bench.make_case(bench.PRESETS["tiny"], 64, device="cuda", dtype=torch.bfloat16,
                           seed=3)
    run = candidates.CANDIDATES["vllm-triton"](case)
    before = run().float().clone()
    case.redraw(7)
    after = run().float()
    want = bench.torch_per_expert_loop(case.x, case.w13, case.w2, case.topk_weights,
                                       case.topk_ids).float()
    rel = float(torch.linalg.vector_norm(after - want) / torch.linalg.vector_norm(want))
    assert rel <= 2e-2, rel
    assert not torch.allclose(after, before)


@pytest.mark.gpu
def test_run_bench_gpu_tiny():
    rec = bench.run_bench(["tiny"], (1, 64), device="cuda", warmup=1, reps=3)
    ok = [p for p in rec["points"] if "stats" in p]
    assert {"torch-loop", "torch-grouped_mm"} <= {p["candidate"] for p in ok}
    for p in ok:
        assert p["rel_err"] <= 2e-2, p          # bf16 against the bf16 torch loop
    for p in (p for p in ok if p["candidate"] == "cupy"):   # the rungs its plan ran
        assert isinstance(p["rungs_tuned"], bool)
        # T = 1: the one-launch decode path; else the two GEMMs' rungs
        assert (p["rungs"] == ["decode"]) if p["T"] == 1 else (len(p["rungs"]) == 2), p


def test_bench_wna16_config_overrides():
    """bench_wna16.py --configs "name+KEY=VALUE": a known config with integer overrides."""
    import importlib.util
    import pathlib

    from cuda_kernels.cupy.quant.configs import CONFIGS

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_wna16.py"
    spec = importlib.util.spec_from_file_location("bench_wna16", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    table = CONFIGS["wna16"]
    name, cfg = mod._config_override(table, "q8+RED=114688+D=2")
    assert name == "q8+RED=114688+D=2"
    assert cfg == dict(table["q8"], RED=114688, D=2)
    assert table["q8"]["D"] == 4                                 # the table is untouched
    with pytest.raises(SystemExit, match="config names"):
        mod._config_override(table, "q99")
    with pytest.raises(SystemExit, match="KEY=integer"):
        mod._config_override(table, "q8+RED=big")


def test_device_call_scripts_parse():
    """The device-call scripts (benchmarks/*.sh) parse as bash: a syntax error would only
    show on the GPU machine, and cost that call."""
    import pathlib
    import subprocess

    scripts = sorted((pathlib.Path(__file__).resolve().parents[2] / "benchmarks").glob("*.sh"))
    assert any(p.name == "gpu_session.sh" for p in scripts)
    for path in scripts:
        r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert r.returncode == 0, f"{path.name}: {r.stderr}"


def test_card_hbm_is_the_card_that_ran():
    """A script's floors use the bandwidth of the card that ran; an unknown card is refused
    by name, never given another card's number."""
    assert bench.card_hbm("NVIDIA H100 80GB HBM3") == 3.35e12
    assert bench.card_hbm("NVIDIA H200") == 4.8e12
    with pytest.raises(ValueError, match="no datasheet HBM bandwidth for 'Mystery GPU'"):
        bench.card_hbm("Mystery GPU")
