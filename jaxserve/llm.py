"""`LLM`: offline batched generation for research code (vLLM's `LLM` API).

    from jaxserve import LLM, SamplingParams
    llm = LLM()                                   # the default SmolLM2 model
    outs = llm.generate(["Hello", "Why is the sky blue?"], SamplingParams(max_tokens=32))
    print(outs[0].outputs[0].text)

All prompts go into one engine at once, so they share steps through
continuous batching; outputs come back in input order.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator, Sequence

from tqdm.auto import tqdm

from jaxserve.engine import LLMEngine, make_engine_config
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams

Prompt = str | Sequence[int] | Sequence[dict[str, Any]]


def _is_single_prompt(p: Any) -> bool:
    if isinstance(p, str):
        return True
    if isinstance(p, Sequence) and len(p) > 0:
        # A token-id list or a chat conversation (list of message dicts) is one prompt.
        return all(isinstance(x, int) for x in p) or all(isinstance(x, dict) for x in p)
    return False


class LLM:
    """Load a model and generate from Python, no server needed.

    Args:
      model: a .gguf file or an HF directory; None for the default SmolLM2
        model fetched by `make model`.
      dtype: "float32" or "bfloat16".
      compile_cache_dir: JAX's persistent compilation cache (None: off), so a
        second process skips compiling the bucket programs.
      engine: an already-built `LLMEngine` (then `model` is ignored).
      **engine_args: CacheConfig / SchedulerConfig / EngineConfig fields,
        e.g. block_size=16, num_kv_blocks=512, max_num_seqs=32,
        max_num_batched_tokens=256, attention_backend="xla".

    Raises:
      FileNotFoundError: the model is missing (the message names `make model`).
      ValueError: a bad engine argument.
    """

    def __init__(self, model: str | None = None, *, dtype: str = "float32",
                 compile_cache_dir: str | None = "checkpoints/jax_compile_cache",
                 engine: LLMEngine | None = None, **engine_args: Any):
        if engine is not None and (model is not None or engine_args):
            raise ValueError(f"LLM(engine=...) takes no model or engine arguments, got "
                             f"model={model!r}, {sorted(engine_args)}")
        if engine is None:
            from jaxserve.checkpoint import load_model
            from jaxserve.checkpoint.default import resolve_model_path
            from jaxserve.model_runner import enable_compilation_cache

            enable_compilation_cache(compile_cache_dir)
            path = resolve_model_path(model)
            cfg, params, tokenizer = load_model(path, dtype=dtype)
            config = make_engine_config(cfg, **engine_args)
            engine = LLMEngine(config, params, tokenizer, model_name=str(path))
        self.engine = engine
        self._ids = itertools.count()

    def _submit(self, prompts: Prompt | Sequence[Prompt],
                sampling_params: SamplingParams | Sequence[SamplingParams] | None) -> list[str]:
        plist = [prompts] if _is_single_prompt(prompts) else list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            splist = [sampling_params or SamplingParams()] * len(plist)
        else:
            splist = list(sampling_params)
            if len(splist) != len(plist):
                raise ValueError(f"got {len(splist)} SamplingParams for {len(plist)} prompts")
        ids = []
        try:
            for p, sp in zip(plist, splist):
                rid = f"gen-{next(self._ids)}"
                if not isinstance(p, str) and len(p) > 0 and all(isinstance(m, dict) for m in p):
                    self.engine.add_request(rid, params=sp, messages=p)
                else:
                    self.engine.add_request(rid, p, sp)
                ids.append(rid)
        except Exception:
            for rid in ids:  # all-or-nothing: a bad prompt leaves no half-submitted batch
                self.engine.abort(rid)
            raise
        return ids

    def generate_stream(self, prompts: Prompt | Sequence[Prompt],
                        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                        ) -> Iterator[RequestOutput]:
        """Yield each step's `RequestOutput`s (with deltas) until all prompts finish."""
        pending = set(self._submit(prompts, sampling_params))
        try:
            while pending:
                for out in self.engine.step():
                    if out.request_id in pending:
                        if out.finished:
                            pending.discard(out.request_id)
                        yield out
        finally:
            for rid in pending:  # a consumer that stops early leaks nothing
                self.engine.abort(rid)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; return final outputs in input order.

        Each prompt is a string, a token-id list, or a chat conversation
        (list of {"role", "content"} dicts, chat template applied).

        Raises:
          ValueError: a bad prompt or sampling parameter, or a SamplingParams
            list whose length differs from the prompts'; nothing is queued then.
        """
        ids = self._submit(prompts, sampling_params)
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        with tqdm(total=len(ids), desc="generate", disable=not use_tqdm) as bar:
            try:
                while any(r is None for r in results):
                    for out in self.engine.step():
                        if out.finished and out.request_id in order:
                            results[order[out.request_id]] = out
                            bar.update(1)
            finally:
                for rid, r in zip(ids, results):
                    if r is None:
                        self.engine.abort(rid)
        return results  # type: ignore[return-value]
