"""The prebuilt cubins (cuda_kernels/cupy/prebuilt/): every registered instantiation has one for
the current source, each is the build of that source (byte for byte, where this machine's NVRTC
is the manifest's), and get_kernel's key misses as soon as anything it was built from differs.

CPU: the manifest against the registered specs, the files against their md5, a rebuild. GPU
(`gpu` marker): the launcher takes the staged rung's t24 from its cubin, and the cubin's outputs
match the reference (the staged tests run it at every shape).
"""
from __future__ import annotations

import hashlib
import json

import pytest

from cuda_kernels.cupy import _compile as C
from cuda_kernels.cupy import prebuild
from cuda_kernels.cupy import quant_gemm_wna16 as W

REBUILD = "python -m cuda_kernels.cupy.prebuild"
SPECS = list(C.PREBUILT_SPECS)          # quant_gemm_wna16 registered its specs at import
MANIFEST = C.prebuilt_manifest()


def test_specs_registered():
    names = {s.name for s in SPECS}
    for zp in (False, True):
        for cfg in ("t24", "t24ws"):
            assert W.staged_kernel_name(W.STAGED_CONFIGS[cfg], zp) in names
    ws = [s for s in SPECS if s.name in W.STAGED_WS_NAMES]
    assert ws and all(s.arch == "sm_90a" and s.options == W.STAGED_WS_OPTIONS for s in ws)
    assert {s.defines["ELEM_BF16"] for s in SPECS} == {0, 1}, "bf16 and fp16 builds"


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.name}-{s.defines}")
def test_every_spec_has_a_fresh_cubin(spec):
    """A .cu edited since the last prebuild has no entry for its new text (the launcher then
    compiles at run time, with whatever NVRTC the machine has): rebuild and commit."""
    key = prebuild.spec_key(spec)
    entry = MANIFEST["entries"].get(key)
    assert entry is not None, f"no prebuilt cubin for the current {spec.cu_name} ({REBUILD})"
    assert (entry["name"], entry["defines"], entry["arch"]) == (spec.name, spec.defines,
                                                                spec.arch)
    assert entry["file"] == key[:16] + ".cubin.xz"


def test_check_mode_agrees():
    assert prebuild.main(["--check"]) == 0


def test_no_orphan_files():
    keys = {prebuild.spec_key(s) for s in SPECS}
    assert set(MANIFEST["entries"]) == keys, f"entries no spec names ({REBUILD})"
    files = {p.name for p in C.PREBUILT_DIR.glob("*.cubin.xz")}
    assert files == {e["file"] for e in MANIFEST["entries"].values()}


@pytest.mark.parametrize("key", sorted(MANIFEST["entries"]))
def test_cubin_matches_its_md5(key):
    entry = MANIFEST["entries"][key]
    cubin = C.prebuilt_cubin(entry)
    assert len(cubin) == entry["bytes"] and cubin[:4] == b"\x7fELF"
    assert prebuild.text_md5(cubin, entry["mangled"]) == entry["text_md5"]


def test_text_md5_is_the_kernel_code():
    """prebuild.text_md5 reads one kernel's code section out of a cubin: the bf16 and fp16
    builds of t24 (one kernel, other code) differ, and a name the cubin lacks is an error."""
    name = W.staged_kernel_name(W.STAGED_CONFIGS["t24"], False)
    md5 = {}
    for entry in MANIFEST["entries"].values():
        if entry["name"] == name:
            cubin = C.prebuilt_cubin(entry)
            md5[entry["defines"]["ELEM_BF16"]] = prebuild.text_md5(cubin, entry["mangled"])
            with pytest.raises(ValueError, match="no .text"):
                prebuild.text_md5(cubin, entry["mangled"] + "x")
    assert set(md5) == {0, 1} and md5[0] != md5[1]
    assert all(len(v) == 12 and int(v, 16) >= 0 for v in md5.values())


def test_corrupted_cubin_is_refused():
    entry = dict(next(iter(MANIFEST["entries"].values())))
    entry["md5"] = "0" * 32
    with pytest.raises(RuntimeError, match="does not match its manifest md5"):
        C.prebuilt_cubin(entry)


def test_key_misses_on_any_change():
    spec = SPECS[0]
    src = C.source_text(spec.cu_name, spec.defines)
    key = C.prebuilt_key(src, spec.name, spec.arch, spec.options)
    assert key in MANIFEST["entries"]
    changed = [C.prebuilt_key(src + "\n", spec.name, spec.arch, spec.options),
               C.prebuilt_key(src, spec.name.replace("3, 4, 4", "3, 4, 3"), spec.arch,
                              spec.options),
               C.prebuilt_key(src, spec.name, "sm_80", spec.options),
               C.prebuilt_key(src, spec.name, spec.arch, ("-lineinfo",)),
               C.prebuilt_key(C.source_text(spec.cu_name, dict(spec.defines, NDEBUG=1)),
                              spec.name, spec.arch, spec.options)]
    assert not any(k in MANIFEST["entries"] for k in changed)


@pytest.mark.slow
def test_rebuild_is_byte_for_byte():
    """The cubins are what the committed source gives with the manifest's NVRTC (so the GPU
    runs the kernel CI compiles); with another NVRTC the bytes may differ, and that is skipped."""
    ok, why = C.nvrtc_available()
    if not ok:
        pytest.skip(f"cuda.core/NVRTC unavailable: {why}")
    if prebuild.nvrtc_version() != MANIFEST["nvrtc"]:
        pytest.skip(f"NVRTC {prebuild.nvrtc_version()} here, the cubins are "
                    f"{MANIFEST['nvrtc']}'s")
    spec = next(s for s in SPECS if s.defines["ELEM_BF16"] == 1)
    cubin, mangled = prebuild.build(spec)
    entry = MANIFEST["entries"][prebuild.spec_key(spec)]
    assert hashlib.md5(cubin).hexdigest() == entry["md5"]
    assert mangled == entry["mangled"]


def test_manifest_is_json_with_a_version():
    text = (C.PREBUILT_DIR / "manifest.json").read_text()
    assert json.loads(text)["nvrtc"].startswith("13.")


@pytest.mark.gpu
def test_launcher_takes_the_prebuilt_t24():
    ok, why = C.availability()
    if not ok:
        pytest.skip(why)
    import cupy
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("the cubins are sm_90's")
    for cfg in ("t24ws", "t24"):                  # (the warp-specialized one for sm_90a)
        name = W.staged_kernel_name(W.STAGED_CONFIGS[cfg], False)
        W._READY.clear()
        C._KERNELS.clear()
        C.PREBUILT_LOADED.discard((W.CU_STAGED, name))
        W._kernel(name, W.ELEMS["bf16"], 0, W.CU_STAGED, W.staged_options(W.STAGED_CONFIGS[cfg]))
        assert (W.CU_STAGED, name) in C.PREBUILT_LOADED
    # get_kernel keeps it like any kernel: a second call does not load the cubin again
    C._KERNELS.clear()
    C.PREBUILT_LOADED.clear()
    first = C.get_kernel(W.CU_STAGED, name, {"ELEM_BF16": 1}, (name,))
    assert (W.CU_STAGED, name) in C.PREBUILT_LOADED
    C.PREBUILT_LOADED.clear()
    assert C.get_kernel(W.CU_STAGED, name, {"ELEM_BF16": 1}, (name,)) is first
    assert not C.PREBUILT_LOADED
