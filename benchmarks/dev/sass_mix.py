"""The instruction mix of a kernel's mma loops, read from its SASS (`cuobjdump -sass`), on the CPU.

A main loop shows in SASS as a run of HMMA instructions (mma.sync) with the dequantization,
scaling and loads between them. This finds those runs (HMMA no more than --gap instructions
apart), and for each prints its length, the count of each opcode, and how far apart the mma of
one accumulator chain are: for each HMMA whose C operand an earlier HMMA of the run wrote, the
HMMA issued in between (a chain whose links have few other mma between them waits on the
mma's latency). wna16_staged's runs come in its with_count order, LT = MT first; each holds a
stage's one-group body (KC chunks scaled once) and the per-chunk bodies.
    python benchmarks/dev/staged_cubins.py --configs t24 --sass /tmp/sass
    python benchmarks/dev/sass_mix.py /tmp/sass/t24.sass [--gap 60] [--top 14]
(cuobjdump and nvdisasm: the device image has both; on the CPU, the nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm wheels' bin/ on the PATH.)
"""
from __future__ import annotations

import argparse
import re
from collections import Counter

_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")


def parse(text: str) -> list[str]:
    """The instructions of a SASS listing in order, without addresses, encodings or ';'."""
    return [m.group(1) for m in map(_INSTRUCTION.match, text.splitlines()) if m]


def opcode(instruction: str) -> str:
    """The base opcode: 'HMMA' of 'HMMA.16816.F32.BF16 R56, ...', 'LDS' of '@!P4 LDS.128 ...'."""
    words = instruction.split()
    if words[0].startswith("@"):                       # a predicate guard
        words = words[1:]
    return words[0].split(".")[0]


def hmma_runs(ins: list[str], gap: int = 60) -> list[tuple[int, int]]:
    """[first, last] instruction indices of each run of HMMA no more than gap apart."""
    at = [k for k, s in enumerate(ins) if opcode(s) == "HMMA"]
    runs: list[list[int]] = []
    for k in at:
        if runs and k - runs[-1][1] <= gap:
            runs[-1][1] = k
        else:
            runs.append([k, k])
    return [(a, b) for a, b in runs]


def _register(operand: str):
    m = re.match(r"R(\d+)", operand.strip())
    return int(m.group(1)) if m else None


def chain_gaps(ins: list[str], first: int, last: int) -> list[int]:
    """For each HMMA of ins[first..last] that accumulates onto an earlier one's D (its C operand,
    the fourth, names a register an HMMA of the run wrote), the HMMA issued in between."""
    wrote: dict[int, int] = {}                         # D register -> the HMMA's ordinal
    gaps, n = [], 0
    for s in ins[first:last + 1]:
        if opcode(s) != "HMMA":
            continue
        operands = s.split(None, 1)[1].split(",")
        d, c = _register(operands[0]), _register(operands[3])
        if c is not None and c in wrote:
            gaps.append(n - wrote[c] - 1)
        wrote[d] = n
        n += 1
    return gaps


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("sass")
    p.add_argument("--gap", type=int, default=60)
    p.add_argument("--top", type=int, default=14)
    args = p.parse_args(argv)
    ins = parse(open(args.sass).read())
    print(f"{args.sass}: {len(ins)} instructions")
    for first, last in hmma_runs(ins, args.gap):
        mix = Counter(opcode(s) for s in ins[first:last + 1])
        gaps = chain_gaps(ins, first, last)
        hist = " ".join(f"{g}:{n}" for g, n in sorted(Counter(gaps).items()))
        print(f"run {first}-{last}: {last - first + 1} instructions, {mix['HMMA']} HMMA; "
              + ", ".join(f"{op} {n}" for op, n in mix.most_common(args.top)))
        print(f"    chained HMMA {len(gaps)}, HMMA between links (gap:count) {hist}")


if __name__ == "__main__":
    main()
