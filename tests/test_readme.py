"""The README runs as written: every ```python block executes on a CPU, and its set-up block
is exactly what CI runs (.ci/run), so a fresh clone gets what the README promises."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


@pytest.mark.parametrize("i", range(len(_blocks("python"))))
def test_python_block_runs_on_a_cpu(i, tmp_path):
    """Run in a fresh interpreter in an empty folder (nothing is written into the checkout),
    with no GPU visible."""
    pytest.importorskip("torch")
    code = _blocks("python")[i]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "",
           "HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"README python block {i} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert not any(tmp_path.iterdir()) or all(p.name.startswith(".") for p in tmp_path.iterdir())


def test_setup_block_is_what_ci_runs():
    setup = _blocks("bash")[0].strip().splitlines()
    assert len(setup) == 2, "the README promises two set-up commands"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for command in setup:
        assert any(line.strip().endswith(command.strip()) for line in ci), \
            f"CI does not run the README's command {command!r}"


def test_results_files_named_by_the_readme_exist():
    for name in re.findall(r"benchmarks/results/([\w.\-]+\.json)", README):
        assert (ROOT / "benchmarks" / "results" / name).is_file(), name
