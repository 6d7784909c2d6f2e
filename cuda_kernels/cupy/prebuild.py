"""Build the prebuilt cubins (cuda_kernels/cupy/prebuilt/) of every instantiation registered
with `_compile.register_prebuilt`, on any machine: NVRTC through cuda.core, no GPU.

    python -m cuda_kernels.cupy.prebuild [--check] [--sass DIR]

Each cubin is stored xz-compressed under the first 16 hex digits of its key (the hash of the
source text, name, architecture and options it was built from), beside manifest.json: the
NVRTC version, and per key the spec, the kernel's mangled name, the cubin's md5 and the md5
of the kernel's code alone (text_md5: an edit of the source that leaves it unchanged leaves
what the GPU runs unchanged, instruction for instruction). Files no spec needs any more are
removed. --check builds nothing and exits 1 when a spec has no cubin for the current source
(a .cu edited since the last build). --sass writes each cubin's SASS (cuobjdump on the PATH)
to DIR/<key>.sass.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import struct
import subprocess
import sys
import tempfile

from . import _compile as C


def _import_kernel_modules():
    """Every launcher module registers its prebuilt specs at import."""
    from . import quant_gemm_wna16  # noqa: F401


def nvrtc_version() -> str:
    """cuda.core's NVRTC: the nvidia-cuda-nvrtc wheel's version when that is what it loads."""
    from cuda.bindings import nvrtc

    _, major, minor = nvrtc.nvrtcVersion()
    try:
        import importlib.metadata as md
        wheel = md.version("nvidia-cuda-nvrtc")
        if wheel.startswith(f"{major}.{minor}."):
            return wheel
    except Exception:  # noqa: BLE001 - no wheel: the toolkit's NVRTC
        pass
    return f"{major}.{minor}"


def text_md5(cubin: bytes, mangled: str) -> str:
    """md5 (12 hex digits) of the kernel's .text section in an ELF64 cubin: what the SM
    executes (the rest of the file also holds names, parameters, options and line tables)."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    stroff = heads[shstrndx][4]
    for name_off, _type, _flags, _addr, off, size in heads:
        end = cubin.index(b"\0", stroff + name_off)
        if cubin[stroff + name_off:end].decode() == f".text.{mangled}":
            return hashlib.md5(cubin[off:off + size]).hexdigest()[:12]
    raise ValueError(f"no .text.{mangled} in the cubin")


def spec_key(spec: C.PrebuiltSpec) -> str:
    return C.prebuilt_key(C.source_text(spec.cu_name, spec.defines), spec.name, spec.arch,
                          spec.options)


def build(spec: C.PrebuiltSpec) -> tuple[bytes, str]:
    """(cubin, mangled name) of one spec, exactly as get_kernel's key describes it."""
    src = C.source_text(spec.cu_name, spec.defines)
    obj = C._nvrtc_compile(src, (spec.name,), spec.arch, C._BASE_OPTIONS + spec.options,
                           spec.cu_name)
    mangled = obj.symbol_mapping[spec.name]
    return bytes(obj.code), mangled.decode() if isinstance(mangled, bytes) else mangled


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true")
    p.add_argument("--sass", default="")
    args = p.parse_args(argv)
    _import_kernel_modules()
    old = C.prebuilt_manifest()["entries"]
    keys = {spec_key(s): s for s in C.PREBUILT_SPECS}
    if args.check:
        stale = [f"{s.cu_name} {s.name} {s.defines}" for k, s in keys.items() if k not in old]
        for line in stale:
            print(f"no prebuilt cubin for the current source: {line}")
        return 1 if stale else 0
    C.PREBUILT_DIR.mkdir(exist_ok=True)
    entries = {}
    for key, spec in keys.items():
        cubin, mangled = build(spec)
        name = key[:16] + ".cubin.xz"
        (C.PREBUILT_DIR / name).write_bytes(lzma.compress(cubin, preset=9))
        entries[key] = dict(cu_name=spec.cu_name, defines=spec.defines, name=spec.name,
                            arch=spec.arch, options=list(spec.options), mangled=mangled,
                            file=name, md5=hashlib.md5(cubin).hexdigest(), bytes=len(cubin),
                            text_md5=text_md5(cubin, mangled))
        print(f"{spec.name} {spec.defines} {spec.arch}: {name}, md5 {entries[key]['md5'][:12]}, "
              f"text {entries[key]['text_md5']}", flush=True)
        if args.sass:
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(cubin)
                f.flush()
                with open(f"{args.sass}/{key[:16]}.sass", "w") as out:
                    subprocess.run(["cuobjdump", "-sass", f.name], stdout=out, check=True)
    for f in C.PREBUILT_DIR.glob("*.cubin.xz"):       # cubins no spec needs any more
        if f.name not in {e["file"] for e in entries.values()}:
            f.unlink()
    manifest = dict(nvrtc=nvrtc_version(), entries=entries)
    (C.PREBUILT_DIR / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    C.prebuilt_manifest.cache_clear()
    print(f"{len(entries)} cubins, NVRTC {manifest['nvrtc']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
