"""Paired A/B of the native quantized matmul against another revision's, in one process.

Builds `native/qmatmul.cc` and its headers as they are at --ref (`git show`) into a
temporary folder, registers that library's handlers under other custom-call targets
(`jaxserve_qmatmul_{q8,q4}_ref`), and builds two engines over --model: one traced with the
--ref targets ("before"), one with this tree's ("after"). Each round decodes one request of
--max_tokens greedy tokens on each engine (order alternating), so the load hits both alike;
prints each round's tokens/s with the load, the after/before ratios and greedy agreement
(notes/issue26_decode1.md).

  PYTHONPATH=. .venv/bin/python scripts/ab_qmatmul_decode.py --ref=main --rounds=16
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxserve import LLM
from jaxserve.attention.native_cpu import NativeKernels
from jaxserve.model import native_qmatmul

sys.path.insert(0, str(Path(__file__).parent))
from profile_decode_alone import _decode  # noqa: E402

REF_TARGETS = {"q8": "jaxserve_qmatmul_q8_ref", "q4": "jaxserve_qmatmul_q4_ref"}


def register_ref(ref: str, folder: Path) -> None:
    """Build the kernel at git revision `ref` in `folder`; register it under REF_TARGETS."""
    for name in ("qmatmul.cc", "qmatmul_int.h"):
        text = subprocess.run(["git", "show", f"{ref}:jaxserve/model/native/{name}"],
                              check=True, capture_output=True, text=True).stdout
        (folder / name).write_text(text)
    kernels = NativeKernels(folder / "qmatmul.cc", "qmatmul",
                            {REF_TARGETS["q8"]: "JaxserveQMatmulQ8",
                             REF_TARGETS["q4"]: "JaxserveQMatmulQ4"}, f"qmatmul at {ref}")
    if not kernels.available():
        raise RuntimeError(f"the kernel at {ref} did not build: {kernels.unavailable_reason()}")


def build(a, targets: dict) -> LLM:
    """An engine whose programs are traced with the custom-call `targets`."""
    saved = dict(native_qmatmul.TARGETS)
    native_qmatmul.TARGETS.update(targets)
    try:
        return LLM(a.model, quantization="auto", max_num_seqs=1, max_num_batched_tokens=64,
                   max_model_len=1024, executable_cache_dir=None)
    finally:
        native_qmatmul.TARGETS.update(saved)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="checkpoints/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--ref", default="main")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--max_tokens", type=int, default=64)
    ap.add_argument("--prompt", default="Write a long story about a lighthouse keeper.")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        register_ref(a.ref, Path(tmp))
        llms = {"before": build(a, REF_TARGETS), "after": build(a, {})}
    rates: dict = {k: [] for k in llms}
    toks: dict = {}
    for r in range(a.rounds):
        for k in (list(llms) if r % 2 == 0 else list(llms)[::-1]):
            rate, _, toks[k] = _decode(llms[k], a.prompt, a.max_tokens, None)
            rates[k].append(rate)
        print(f"round {r:2d}: before {rates['before'][-1]:5.1f} after {rates['after'][-1]:5.1f} "
              f"tok/s, load {os.getloadavg()[0]:.2f}", flush=True)
    ratios = [x / y for x, y in zip(rates["after"], rates["before"])]
    print(f"median tok/s before {statistics.median(rates['before']):.1f}, after "
          f"{statistics.median(rates['after']):.1f}; after/before geometric mean "
          f"{statistics.geometric_mean(ratios):.3f}, after faster in "
          f"{sum(x > 1 for x in ratios)}/{a.rounds}; greedy the same: "
          f"{toks['before'] == toks['after']}")


if __name__ == "__main__":
    main()
