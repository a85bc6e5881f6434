"""What a deviceless compile reports per program: custom calls, memory, and ptxas's
registers / spills / shared memory per GPU kernel.

Sources (../shared/gpu/NOTES.md 1.2): XLA compiles its kernels (its fusions and the
Pallas Triton kernels, custom call `__gpu$xla.gpu.triton`) with ptxas in a subprocess;
with `--xla_gpu_ptx_compiler_extra_flags=-v` and `TF_CPP_VMODULE=subprocess_compilation=2`
it logs ptxas's `-v` report to stderr, which the worker sends to a log file. Mosaic
GPU kernels (`mosaic_gpu_v2`) run their own ptxas, which the flag does not reach:
`MOSAIC_GPU_DUMP_PTXAS=1` writes its report to `<MOSAIC_GPU_DUMP_TO>/<kernel>*.ptxas`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

PALLAS_CALLS = ("__gpu$xla.gpu.triton", "mosaic_gpu_v2")

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used \d+ barriers)?(?:, (\d+) bytes smem)?")


def parse_ptxas(text: str) -> list[dict]:
    """ptxas `-v` reports -> [{"kernel", "arch", "registers", "spill_bytes",
    "spill_load_bytes", "stack_bytes", "smem_bytes"}], one per entry function.

    `spill_bytes` is ptxas's "bytes spill stores" (what a kernel writes to local
    memory for lack of registers); `smem_bytes` is the static shared memory ptxas
    sees (a kernel's dynamic shared memory is sized at launch, not here).
    """
    out: list[dict] = []
    cur: dict | None = None
    for line in text.splitlines():
        m = _ENTRY.search(line)
        if m:
            cur = {"kernel": m.group(1), "arch": m.group(2), "registers": None,
                   "spill_bytes": 0, "spill_load_bytes": 0, "stack_bytes": 0, "smem_bytes": 0}
            out.append(cur)
            continue
        if cur is None:
            continue
        m = _PROPS.search(line)
        if m:
            cur["stack_bytes"], cur["spill_bytes"], cur["spill_load_bytes"] = map(int, m.groups())
            continue
        m = _USED.search(line)
        if m and cur["registers"] is None:
            cur["registers"] = int(m.group(1))
            cur["smem_bytes"] = int(m.group(2) or 0)
    return out


def custom_calls(hlo_text: str) -> list[str]:
    """The distinct custom-call targets of a compiled module's HLO text."""
    return sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo_text)))


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def collectives(hlo_text: str) -> list[str]:
    """The cross-device collectives a compiled module runs (tensor parallelism)."""
    return [c for c in COLLECTIVES if re.search(rf"= [^=]*\b{c}(-start)?\(", hlo_text)]


def pallas_lines(hlo_text: str) -> list[str]:
    """The compiled module's lines that call a Pallas kernel (their metadata names it)."""
    return [ln for ln in hlo_text.splitlines()
            if any(f'custom_call_target="{t}"' in ln for t in PALLAS_CALLS)]


def is_pallas(kernel: str, lines: list[str]) -> bool:
    """Whether an XLA-compiled kernel is a Pallas kernel: its name is the pallas_call's
    name in one of `pallas_lines` (in the op_name path or the backend config, not as an
    operand such as `%input_concatenate_fusion`)."""
    pat = re.compile(rf'[/"]{re.escape(kernel)}[/"\\]')
    return any(pat.search(ln) for ln in lines)


def _memory(compiled: Any) -> dict:
    m = compiled.memory_analysis()
    if m is None:
        return {}
    return {k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0)
            for k in ("argument", "output", "temp", "alias", "generated_code")}


def _parts(program: Any) -> dict[str, Any]:
    """The compiled programs of one warm-up program: a layer-group stack is three."""
    if all(hasattr(program, a) for a in ("embed", "layers", "final")):
        return {"embed": program.embed, "layers": program.layers, "final": program.final}
    return {"": program}


def program_report(key: tuple[str, int], program: Any, *, seconds: float, log: Path,
                   log_offset: int, mosaic_dump: Path, mosaic_before: set[str]) -> dict:
    """One program's record: {"key", "seconds", "parts": [{"part", "custom_calls", "collectives",
    "memory": {argument, output, temp, ...} bytes}], "kernels": [parse_ptxas rows with
    "pallas": bool and "source": "xla" | "mosaic"], "max_spill_bytes" over Pallas kernels}."""
    parts: list[dict] = []
    pallas: list[str] = []
    for name, compiled in _parts(program).items():
        text = compiled.as_text() or ""
        parts.append({"part": name, "custom_calls": custom_calls(text),
                      "collectives": collectives(text), "memory": _memory(compiled)})
        pallas += pallas_lines(text)
    kernels, seen = [], set()
    if log.exists():
        with open(log, "rb") as f:
            f.seek(log_offset)
            text = f.read().decode(errors="replace")
        for k in parse_ptxas(text):
            sig = tuple(sorted(k.items()))
            if sig not in seen:  # XLA logs some kernels twice
                seen.add(sig)
                kernels.append({**k, "pallas": is_pallas(k["kernel"], pallas), "source": "xla"})
    if mosaic_dump.is_dir():
        for p in sorted(mosaic_dump.glob("*.ptxas")):
            if p.name not in mosaic_before:
                for k in parse_ptxas(p.read_text(errors="replace")):
                    kernels.append({**k, "pallas": True, "source": "mosaic", "file": p.name})
    spills = [k["spill_bytes"] for k in kernels if k["pallas"]]
    return {"key": list(key), "seconds": round(seconds, 3), "parts": parts, "kernels": kernels,
            "max_spill_bytes": max(spills, default=0),
            "any_spill_bytes": max((k["spill_bytes"] for k in kernels), default=0)}


def pallas_kernels(rep: dict) -> list[dict]:
    """Every Pallas kernel of a `compile_for_target` report, one row per (program, kernel)."""
    return [{"program": "/".join(map(str, p["key"])), **k}
            for p in rep["programs"] for k in p["kernels"] if k["pallas"]]


def format_report(rep: dict) -> str:
    """The report as text: a line per program (seconds, custom calls, argument / output /
    temp MiB), its Pallas kernels (registers, spill bytes, static SMEM), then a verdict."""
    mib = lambda b: f"{b / 2**20:9.2f}"  # noqa: E731
    lines = [f"deviceless compile for {rep['target']} ({rep['device_kind']}, {rep['sm']}), "
             f"backend {rep['backend']}, layers per program {rep['layers_per_program']}: "
             f"{len(rep['programs'])} programs in {rep['seconds']} s",
             f"{'program':<12} {'part':<7} {'compile s':>9} {'arg MiB':>9} {'out MiB':>9} "
             f"{'temp MiB':>9}  custom calls"]
    for p in rep["programs"]:
        name = "/".join(map(str, p["key"]))
        for i, part in enumerate(p["parts"]):
            m = part["memory"]
            secs = f"{p['seconds']:9.2f}" if i == 0 else " " * 9
            lines.append(f"{name if i == 0 else '':<12} {part['part'] or '-':<7} {secs} "
                         f"{mib(m.get('argument', 0))} {mib(m.get('output', 0))} "
                         f"{mib(m.get('temp', 0))}  {', '.join(part['custom_calls']) or '-'}")
        for k in p["kernels"]:
            if k["pallas"]:
                lines.append(f"{'':<12}   kernel {k['kernel']} ({k['source']}, {k['arch']}): "
                             f"{k['registers']} registers, {k['spill_bytes']} B spill stores, "
                             f"{k['spill_load_bytes']} B spill loads, {k['smem_bytes']} B "
                             f"static smem")
    for f in rep["failed"]:
        lines.append(f"FAILED {'/'.join(map(str, f['key']))}: {f['error']}")
    spills = [k for k in pallas_kernels(rep) if k["spill_bytes"]]
    lines.append("no Pallas kernel spills registers" if not spills else
                 f"REGISTER SPILLS in {len(spills)} Pallas kernel(s): " + "; ".join(
                     f"{k['kernel']} in {k['program']}: {k['spill_bytes']} B"
                     for k in spills))
    return "\n".join(lines)
