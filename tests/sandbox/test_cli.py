"""`moe-sandbox`: exit codes and one-line errors.

The main job (`validate`) runs in a subprocess, as a user runs it: it chooses the Numba
CUDA simulator before Numba is imported, which must not leak into this test process.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from sandbox import cli, datagen

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run(*args, code=None, timeout=300):
    """`python -m sandbox.cli ARGS` (or `python -c CODE ARGS`) from the repository root."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable] + (["-c", code] if code else ["-m", "sandbox.cli"]) + list(args)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def one_line_error(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got:\n{stderr}"
    assert "Traceback" not in stderr
    assert lines[0].startswith("error: ")
    return lines[0]


@pytest.fixture
def keep_env(monkeypatch):
    """Whatever a command sets in os.environ is undone after the test."""
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", os.environ.get("NUMBA_ENABLE_CUDASIM", ""))


# ----------------------------------------------------------------------------- validate

@pytest.mark.slow
@pytest.mark.simulator
def test_validate_default_passes(tmp_path):
    """The main job exactly as a user runs it (Numba in the simulator on a CPU machine)."""
    out = tmp_path / "report.json"
    r = run("validate", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS" in r.stdout and "reference" in r.stdout
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["family"] == "qwen3_moe"
    ran = {row["backend"] for run_ in report["runs"] for row in run_["report"]["rows"]
           if row["status"] == "ok"}
    assert {"reference", "torch"} <= ran
    if "numba under the CUDA simulator" in r.stdout.lower():
        assert "numba" in ran


def test_validate_reference_and_torch_passes():
    r = run("validate", "--backend", "torch", "--trace", "one_expert")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "torch: all stages within tolerance" in r.stdout
    assert "validate: " not in r.stderr                  # fast: no progress lines


def test_validate_progress_lines_and_quiet():
    """A backend past the mark prints a line per stage on stderr; --quiet none."""
    code = textwrap.dedent("""
        import sys
        import importlib
        v = importlib.import_module("sandbox.validate")
        v.PROGRESS_AFTER_S = 0.0
        from sandbox.cli import main
        sys.exit(main(sys.argv[1:]))
    """)
    r = run("validate", "--backend", "torch", "--tokens", "8", code=code)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "validate: torch: gemm1 (" in r.stderr and "validate: torch: done in" in r.stderr
    assert "validate: " not in r.stdout                  # the table stays clean
    r = run("validate", "--backend", "torch", "--tokens", "8", "--quiet", code=code)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "validate: " not in r.stderr


def test_validate_forced_divergence_exits_nonzero():
    # the torch backend's combine stage adds 1 to every output: validate must catch it
    code = textwrap.dedent("""
        import sys
        import cuda_kernels.torch as tb
        real = tb.moe_sum
        tb.moe_sum = lambda x, *a, **kw: real(x, *a, **kw) + 1
        from sandbox.cli import main
        sys.exit(main(sys.argv[1:]))
    """)
    r = run("validate", "--backend", "torch", "--tokens", "16", code=code)
    assert r.returncode == cli.EXIT_DIVERGENCE, r.stdout + r.stderr
    assert "first divergence at combine" in r.stdout and "FAIL" in r.stdout


def test_validate_with_nothing_to_compare_fails():
    """No backend but the reference available: every other one is listed as skipped with
    the reason, and the job fails (it used to PASS having compared nothing)."""
    code = textwrap.dedent("""
        import sys
        from sandbox import registry
        for name in ("torch", "cupy", "numba"):
            registry._MODULE[name] = "no_such_backend_module"
        from sandbox.cli import main
        sys.exit(main(sys.argv[1:]))
    """)
    r = run("validate", "--tokens", "4", code=code)
    assert r.returncode == cli.EXIT_DIVERGENCE, r.stdout + r.stderr
    assert "torch: skipped (no_such_backend_module is not importable" in r.stdout
    assert "FAIL: no backend but the reference ran" in r.stdout and "PASS" not in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_validate_other_families_and_traces(family):
    r = run("validate", "--checkpoint", str(ROOT / "data" / family), "--trace", "nan_rows",
            "--backend", "torch", "--tokens", "24")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("args, needle", [
    (["validate", "--dtype", "float8"], "--dtype"),
    (["validate", "--backend", "tpu"], "--backend"),
    (["validate", "--checkpoint", "/no/such/checkpoint"], "does not exist"),
    (["validate", "--tokens", "-3"], "--tokens"),
    (["frobnicate"], "invalid choice"),
    (["data"], "subcommand"),
    (["bench", "--tokens", "1,x"], "--tokens"),
])
def test_bad_arguments_give_one_line(args, needle, capsys, keep_env):
    assert cli.main(args) == cli.EXIT_ERROR
    line = one_line_error(capsys.readouterr().err)
    assert needle in line


def test_bad_trace_and_broken_checkpoint(tmp_path, capsys, keep_env):
    assert cli.main(["validate", "--trace", "sideways", "--backend", "reference"]) == 2
    assert "--trace" in one_line_error(capsys.readouterr().err)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    assert cli.main(["validate", "--checkpoint", str(bad), "--backend", "reference"]) == 2
    assert "safetensors" in one_line_error(capsys.readouterr().err)


def test_trace_of_the_wrong_shape(tmp_path, capsys, keep_env):
    path = tmp_path / "t.npz"
    datagen.save_npz(path, datagen.make_trace("zipf", 8, 32, 16, 4))   # H=32, layer has 64
    assert cli.main(["validate", "--trace", str(path), "--backend", "reference"]) == 2
    assert "expected hidden_states [T, 64]" in one_line_error(capsys.readouterr().err)


# ----------------------------------------------------------------------------- the others

def test_info_lists_every_backend():
    r = run("info")
    assert r.returncode == 0, r.stderr
    for name in ("reference", "torch", "cupy", "numba"):
        assert name in r.stdout


def test_data_make(tmp_path, capsys):
    assert cli.main(["data", "make", "--out", str(tmp_path / "d"), "--seed", "3"]) == 0
    assert (tmp_path / "d" / "gpt_oss" / "model.safetensors").exists()
    assert len(list((tmp_path / "d" / "traces").glob("*.npz"))) == 16


@pytest.mark.parametrize("args, needle", [
    (["--seed", "-1"], "--seed: expected an int >= 0, got -1"),
    (["--seed", "x"], "--seed"),
    (["--seed", str(2 ** 63)], "--seed: expected an int < 2**63"),
])
def test_data_make_bad_arguments_are_named_and_nothing_is_written(tmp_path, capsys, args,
                                                                    needle):
    out = tmp_path / "d"
    assert cli.main(["data", "make", "--out", str(out), *args]) == cli.EXIT_ERROR
    assert needle in one_line_error(capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []           # no folder, not even a temporary one


def test_data_make_out_must_be_a_folder(tmp_path, capsys):
    out = tmp_path / "file"
    out.write_text("mine")
    assert cli.main(["data", "make", "--out", str(out)]) == cli.EXIT_ERROR
    assert "--out: expected a folder" in one_line_error(capsys.readouterr().err)
    assert [p.name for p in tmp_path.iterdir()] == ["file"] and out.read_text() == "mine"


@pytest.mark.skipif(bool(cli.cuda_devices()), reason="this machine has a GPU")
def test_bench_without_gpu_says_so(capsys):
    assert cli.main(["bench"]) == cli.EXIT_ERROR
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no CUDA GPU" in err and "--cpu" in err


def test_bench_cpu_writes_json_and_plot(tmp_path, capsys):
    code = cli.main(["bench", "--cpu", "--tokens", "1,8", "--reps", "2", "--warmup", "0",
                     "--out", str(tmp_path), "--no-progress"])
    assert code == 0
    files = sorted(p.suffix for p in tmp_path.iterdir())
    assert ".json" in files
    record = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert record["command"].startswith("moe-sandbox bench --cpu")
    names = {p["candidate"] for p in record["points"] if "stats" in p}
    assert {"reference", "torch-loop"} <= names
    for p in record["points"]:
        if "stats" in p:
            assert p["rel_err"] <= 1e-5 and p["stats"]["p20"] <= p["stats"]["median"] \
                <= p["stats"]["p80"]


def test_ep_subcommand_reaches_the_ep_runtime(capsys):
    # `moe-sandbox ep ...` hands everything after "ep" to sandbox.ep.cli_main
    from sandbox.cli import main
    assert main(["ep", "eplb", "--experts", "16", "--gpus", "4", "--redundant", "4"]) == 0
    assert "EPLB" in capsys.readouterr().out
    assert main(["ep", "no-such-command"]) != 0


# ----------------------------------------------------------------------------- pipes

def test_a_reader_that_leaves_early_is_not_an_error():
    """`moe-sandbox info | head -1`: the reader closes the pipe before the output ends."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        proc = subprocess.run([sys.executable, "-m", "sandbox.cli", "info"], cwd=ROOT, env=env,
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write_end)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == "", proc.stderr
