"""data/: the generated checkpoints and traces are reproducible, committed up to date, small,
and the traces have the routing patterns their names promise."""
from __future__ import annotations

import hashlib
import json
import os
import pathlib

import numpy as np
import pytest

import reference
from sandbox import datagen
from sandbox.checkpoint import data_dir

DATA = data_dir()


def _digests(root: pathlib.Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "README.md"}


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("data")
    datagen.make_all(out, seed=0)
    return out


def test_same_seed_same_bytes(made, tmp_path):
    again = tmp_path / "again"
    datagen.make_all(again, seed=0)
    assert _digests(made) == _digests(again)


def test_committed_data_is_what_make_writes(made):
    """data/ must be regenerated (and committed) whenever datagen changes."""
    assert DATA.is_dir(), "data/ is missing: run `moe-sandbox data make --out data`"
    assert _digests(DATA) == _digests(made)


def test_make_all_writes_everything_or_nothing(tmp_path, monkeypatch):
    """make_all writes into a temporary folder and moves the files into place at the end:
    a failure half-way leaves `out` as it was (and no temporary folder behind); success
    replaces the generated files and keeps the others (data/README.md)."""
    out = tmp_path / "d"
    (out / "traces").mkdir(parents=True)
    (out / "README.md").write_text("mine")
    (out / "traces" / "mixtral_zipf.npz").write_bytes(b"old")
    before = _digests_all(tmp_path)
    real, calls = datagen.save_npz, []

    def flaky(path, arrays):
        if len(calls) == 5:
            raise OSError("disk full")
        calls.append(path)
        real(path, arrays)

    monkeypatch.setattr(datagen, "save_npz", flaky)
    with pytest.raises(OSError, match="disk full"):
        datagen.make_all(out, seed=0)
    assert _digests_all(tmp_path) == before
    calls.clear()
    with pytest.raises(OSError, match="disk full"):
        datagen.make_all(tmp_path / "fresh", seed=0)
    assert _digests_all(tmp_path) == before and not (tmp_path / "fresh").exists()
    # a move that fails while the files go into place: the moves before it are undone
    monkeypatch.undo()
    real_replace, moves = os.replace, []

    def flaky_replace(src, dst):
        moves.append(dst)
        if len(moves) == 7:
            raise OSError("rename failed")
        real_replace(src, dst)

    monkeypatch.setattr(datagen.os, "replace", flaky_replace)
    with pytest.raises(OSError, match="rename failed"):
        datagen.make_all(out, seed=0)
    assert len(moves) > 7 and _digests_all(tmp_path) == before      # rolled back
    monkeypatch.undo()
    written = datagen.make_all(out, seed=0)
    assert (out / "README.md").read_text() == "mine"
    assert all(p.is_file() and out in p.parents for p in written) and len(written) == 24 + 2 * len(datagen.QUANT_CHECKPOINTS)
    assert (out / "traces" / "mixtral_zipf.npz").read_bytes() != b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_make_all_checks_its_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"^seed: expected an int >= 0, got -1"):
        datagen.make_all(tmp_path / "d", seed=-1)
    with pytest.raises(TypeError, match=r"^seed: expected an int, got float"):
        datagen.make_all(tmp_path / "d", seed=1.5)
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match=r"^out: expected a folder"):
        datagen.make_all(tmp_path / "f", seed=0)
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


def _digests_all(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            if p.is_file() else "dir" for p in sorted(root.rglob("*"))}


def test_other_seed_other_weights(tmp_path):
    spec = datagen.FAMILIES["mixtral"]
    a, b = datagen.make_tensors(spec, seed=0), datagen.make_tensors(spec, seed=1)
    name = "model.layers.1.block_sparse_moe.experts.0.w1.weight"
    assert not np.array_equal(a[name].astype(np.float32), b[name].astype(np.float32))


def test_total_size_is_a_few_mb():
    total = sum(p.stat().st_size for p in DATA.rglob("*") if p.is_file())
    assert total < 5e6, f"data/ holds {total / 1e6:.1f} MB; keep it to a few MB"


@pytest.mark.parametrize("family", list(datagen.FAMILIES))
def test_config_matches_tensors(family):
    spec = datagen.FAMILIES[family]
    cfg = json.loads((DATA / family / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16"
    assert cfg["num_experts_per_tok"] == spec.top_k
    assert cfg["hidden_size"] == spec.hidden_size
    tensors = datagen.make_tensors(spec)
    import ml_dtypes
    weights = [t for n, t in tensors.items() if "correction_bias" not in n]
    assert all(t.dtype == ml_dtypes.bfloat16 for t in weights)
    assert all(np.isfinite(t.astype(np.float32)).all() for t in tensors.values())


def _trace(family, dist):
    return datagen.load_trace(DATA / "traces" / f"{family}_{dist}.npz")


@pytest.mark.parametrize("family", list(datagen.FAMILIES))
def test_trace_shapes(family):
    spec = datagen.FAMILIES[family]
    for dist in datagen.DISTRIBUTIONS:
        x, logits = _trace(family, dist)
        T = datagen.TRACE_TOKENS[dist]
        assert x.shape == (T, spec.hidden_size) and x.dtype == np.float32
        assert logits.shape == (T, spec.num_experts) and logits.dtype == np.float32
        assert np.isfinite(x).all()


def _counts(logits, k, num_experts):
    _, ids, _ = reference.fused_topk(None, logits, k, True)
    return np.bincount(ids.ravel(), minlength=num_experts)


@pytest.mark.parametrize("family", list(datagen.FAMILIES))
def test_balanced_gives_every_expert_the_same_load(family):
    spec = datagen.FAMILIES[family]
    _, logits = _trace(family, "balanced")
    counts = _counts(logits, spec.top_k, spec.num_experts)
    assert counts.min() == counts.max() == logits.shape[0] * spec.top_k // spec.num_experts


@pytest.mark.parametrize("family", list(datagen.FAMILIES))
def test_zipf_is_skewed(family):
    spec = datagen.FAMILIES[family]
    _, logits = _trace(family, "zipf")
    counts = _counts(logits, spec.top_k, spec.num_experts)
    assert counts.max() > 2.5 * counts.mean()          # hot experts
    assert counts.min() < 0.5 * counts.mean()          # a thin tail


@pytest.mark.parametrize("family", list(datagen.FAMILIES))
def test_one_expert_puts_every_token_on_one_expert(family):
    spec = datagen.FAMILIES[family]
    _, logits = _trace(family, "one_expert")
    _, ids, _ = reference.fused_topk(None, logits, spec.top_k, True)
    assert (ids[:, 0] == spec.num_experts // 2).all()
    counts = np.bincount(ids.ravel(), minlength=spec.num_experts)
    assert (counts == 0).sum() == spec.num_experts - spec.top_k


@pytest.mark.parametrize("family", list(datagen.FAMILIES))
def test_nan_rows(family):
    _, logits = _trace(family, "nan_rows")
    T = logits.shape[0]
    nan_rows = np.flatnonzero(np.isnan(logits).any(axis=1))
    whole = np.flatnonzero(np.isnan(logits).all(axis=1))
    assert set(nan_rows) == set(range(0, T, 8)) | set(range(4, T, 16))
    assert set(whole) == set(range(4, T, 16))


def test_make_trace_checks_its_arguments():
    with pytest.raises(ValueError, match="distribution"):
        datagen.make_trace("uniform", 4, 8, 4, 2)
    with pytest.raises(ValueError, match="top_k"):
        datagen.make_trace("balanced", 4, 8, 4, 5)


def test_make_trace_empty_batch():
    t = datagen.make_trace("zipf", 0, 8, 4, 2)
    assert t["hidden_states"].shape == (0, 8) and t["router_logits"].shape == (0, 4)


def test_save_npz_round_trip(tmp_path):
    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "s": np.array("zipf")}
    datagen.save_npz(tmp_path / "t.npz", arrays)
    with np.load(tmp_path / "t.npz", allow_pickle=False) as z:
        assert np.array_equal(z["a"], arrays["a"]) and str(z["s"]) == "zipf"


def test_load_trace_names_missing_arrays(tmp_path):
    datagen.save_npz(tmp_path / "bad.npz", {"hidden_states": np.zeros((2, 2), np.float32)})
    with pytest.raises(ValueError, match="router_logits"):
        datagen.load_trace(tmp_path / "bad.npz")
