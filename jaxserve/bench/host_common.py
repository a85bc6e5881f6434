"""What `jaxserve bench host` and its `--engine_process` variant share: the set-up's
engine, its prompt, and one result line."""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from typing import Any, Iterator

PROMPT = "Explain in detail how a hash map handles collisions, and compare open addressing " \
         "with separate chaining."


@dataclass
class HostResult:
    """One case: N running at a device step of D ms (None: the real runner)."""

    runner: str
    rows: int
    device_ms: float | None
    steps: int
    seconds: float
    tokens_per_request_per_s: float
    period_ms: float
    device_ms_per_step: float
    host_ms_per_step: float
    host_us_per_row: float
    device_idle: float
    phases_ms_per_step: dict[str, float]
    h2d_kib_per_step: float | None = None  # host arrays a step sends (the real runner)
    cpu_ms_per_step: float | None = None  # the engine thread's CPU time (time.thread_time)


def _engine(rows: int, device_ms: float, real: bool, tokenizer: Any,
            async_scheduling: bool = True, stream_interval: int = 1) -> Any:
    from jaxserve.config import ModelConfig
    from jaxserve.engine import LLMEngine, make_engine_config
    from jaxserve.worker.fake_runner import FakeRunner

    if real:  # the tiny model: its device step is sub-millisecond here
        import jax
        import numpy as np
        from flax import nnx

        from jaxserve.model.llama import Llama, canonical_params
        cfg = ModelConfig.tiny(vocab_size=tokenizer.vocab_size, max_position_embeddings=2048)
        params = jax.tree.map(np.asarray, canonical_params(Llama(cfg, rngs=nnx.Rngs(0))))
        config = make_engine_config(cfg, max_num_seqs=rows, max_num_batched_tokens=max(2048, rows),
                                    num_kv_blocks=128 * rows + 1, block_size=16,
                                    max_model_len=2048, attention_backend="xla",
                                    async_scheduling=async_scheduling,
                                    stream_interval=stream_interval)
        return LLMEngine(config, params, tokenizer, progress=False)
    config = make_engine_config(ModelConfig.smollm2_135m(), max_num_seqs=rows,
                                max_num_batched_tokens=max(2048, rows),
                                num_kv_blocks=128 * rows + 1, block_size=16, max_model_len=2048,
                                async_scheduling=async_scheduling,
                                stream_interval=stream_interval)
    runner = FakeRunner.for_config(config, build_batches=True, step_delay=device_ms / 1000)
    return LLMEngine(config, tokenizer=tokenizer, runner=runner)


def check_texts(outputs: dict[str, Any], tokenizer: Any) -> None:
    """Each request's streamed text is the decode of its tokens (the measure counts only
    tokens whose text reached the caller): all of them, or all but the last few (at most
    4: a character still incomplete, held back with the rest of its tokens' text). Where
    neither holds (an invalid byte run, emitted as U+FFFD once 4 tokens gave no text,
    which a whole decode may split otherwise), the text of a serial run of the plain
    window scheme (`IncrementalDetokenizer` without its fast paths) over the same tokens.

    Raises:
      RuntimeError: naming the first request whose text is neither.
    """
    for rid, o in outputs.items():
        c = o.outputs[0]
        ids, text = list(c.token_ids), c.text
        if any(tokenizer.decode(ids[:len(ids) - j]) == text for j in range(min(len(ids), 4) + 1)):
            continue
        if _window_text(tokenizer, o.prompt_token_ids, ids) != text:
            raise RuntimeError(f"request {rid!r}: streamed text {text[-40:]!r} is not the "
                               f"decode of its tokens ({tokenizer.decode(ids)[-40:]!r})")


def _window_text(tokenizer: Any, prompt_ids: list[int], ids: list[int]) -> str:
    """The text a window-scheme detokenizer streams for `ids` one at a time."""
    from jaxserve.engine.detokenizer import IncrementalDetokenizer
    from jaxserve.sampling_params import SamplingParams

    class _Plain:  # no `backend_tokenizer`: neither DecodeStream nor the piece table
        def decode(self, ids, skip_special_tokens=True):
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    d = IncrementalDetokenizer(_Plain(), prompt_ids, SamplingParams())
    for t in ids:
        d.update([t], finished=False)
    return d.output_text


def _row(r: HostResult) -> str:
    d = "real" if r.device_ms is None else f"{r.device_ms:g}"
    ph = " ".join(f"{k}={v:.2f}" for k, v in r.phases_ms_per_step.items())
    return (f"{r.runner:25s} N={r.rows:<5d} D={d:>4s} ms  tok/req/s={r.tokens_per_request_per_s:8.1f}"
            f"  period={r.period_ms:7.2f} ms  device={r.device_ms_per_step:6.2f} ms"
            f"  host={r.host_ms_per_step:6.2f} ms ({r.host_us_per_row:6.1f} us/row)"
            f"  cpu={r.cpu_ms_per_step:6.2f} ms"
            f"  idle={r.device_idle:5.1%}  [{ph}]"
            + ("" if r.h2d_kib_per_step is None else f"  h2d={r.h2d_kib_per_step:.0f} KiB/step"))


def freeze_heap(young: int) -> tuple[int, int, int]:
    """The heap a server process has after warm-up: everything alive now frozen
    (`freeze_gc_heap` runs once a process, so a second case here would otherwise run
    unfrozen), the cyclic GC's young threshold `young`. Returns the thresholds before."""
    gc.collect()
    gc.freeze()
    saved = gc.get_threshold()
    gc.set_threshold(young, *saved[1:])
    return saved


@contextlib.contextmanager
def server_heap(young: int) -> Iterator[None]:
    """`freeze_heap(young)`, the thresholds put back after."""
    saved = freeze_heap(young)
    try:
        yield
    finally:
        gc.set_threshold(*saved)


def add_requests(engine: Any, rows: int, tokenizer: Any) -> tuple[list[str], Any]:
    """Add the set-up's `rows` requests ("r0".."r{rows-1}": the chat prompt, greedy,
    `ignore_eos`, max_tokens 1900); returns their ids and the SamplingParams."""
    from jaxserve.sampling_params import SamplingParams

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                           add_generation_prompt=True, tokenize=True)
    sp = SamplingParams(temperature=0.0, max_tokens=1900, ignore_eos=True)
    ids = [f"r{i}" for i in range(rows)]
    for rid in ids:
        engine.add_request(rid, list(prompt), sp)
    return ids, sp
