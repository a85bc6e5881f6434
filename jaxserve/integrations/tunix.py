"""A Tunix rollout worker on top of `jaxserve.LLM` (google-tunix, `tunix.rl.rollout`).

Tunix's RL learners (GRPO, PPO) talk to a rollout engine through
`tunix.rl.rollout.base_rollout.BaseRollout`: `generate(prompts, rollout_config)`
-> `RolloutOutput`, `get_per_token_logps`, `update_params`, `pad_id`, `eos_id`,
`model`. `JaxserveRollout` implements that shape in the trainer's own process:
weights are swapped with `LLM.update_params` (no recompilation, no disk).

Tunix is optional (`pip install jaxserve[tunix]`): nothing here imports it at
module level. When `tunix.rl.rollout.base_rollout` imports, `generate` returns
its `RolloutOutput`; otherwise the local `RolloutOutput` below, which has the
same fields (google-tunix 0.1.7). `get_per_token_logps` runs teacher-forced
scoring through the same paged engine (`LLM.score`). Not supported:
`RolloutOutput.logits` (per-step full logits) is always an empty list.

LoRA (issue 27): with `lora_request` the rollouts and the scoring run on that adapter,
and `update_params(lora_params, filter_types=...)` (Tunix's LoRA-only sync) swaps only
its A/B with `LLM.update_lora` (no recompile). The tree is read as
`jaxserve.lora.adapter.from_tree` reads it (our {target: {lora_a, lora_b}} or PEFT's
flat state dict); `lora_tree` maps another layout (e.g. qwix's LoRA params of a Tunix
model) into it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from jaxserve.llm import LLM
from jaxserve.sampling_params import SamplingParams


@dataclasses.dataclass
class RolloutOutput:
    """Tunix's `RolloutOutput` fields (used when Tunix is not installed).

    text: B completions; logits: unsupported, []; tokens: B i32[L_i] completion ids
    (a stopping EOS included, as vLLM reports it); left_padded_prompt_tokens:
    i32[B, max_prompt_length] with pad_id on the left; logprobs: B f32[L_i]
    sampled-token logprobs (engine's logprobs_mode), or None.
    """

    text: list[str]
    logits: list[Any]
    tokens: list[np.ndarray]
    left_padded_prompt_tokens: np.ndarray
    logprobs: list[np.ndarray] | None


def _output_type() -> type:
    try:
        from tunix.rl.rollout.base_rollout import RolloutOutput as TunixOutput
    except ImportError:  # Tunix is optional
        return RolloutOutput
    return TunixOutput


def sampling_params_for(rollout_config: Any, index: int) -> SamplingParams:
    """SamplingParams of prompt `index` from a Tunix `RolloutConfig` (read by field name).

    max_tokens_to_generate, temperature, top_p (None: off), top_k (None: off),
    eos_tokens (extra stop token ids), return_logprobs; a scalar `seed` (int or
    jax/NumPy scalar) gives prompt i the seed seed + i, so a batch is reproducible.
    """
    seed = getattr(rollout_config, "seed", None)
    top_p, top_k = getattr(rollout_config, "top_p", None), getattr(rollout_config, "top_k", None)
    return SamplingParams(
        max_tokens=int(rollout_config.max_tokens_to_generate),
        temperature=float(rollout_config.temperature),
        top_p=1.0 if top_p is None else float(top_p), top_k=0 if top_k is None else int(top_k),
        seed=None if seed is None else int(np.asarray(seed)) + index,
        stop_token_ids=tuple(int(t) for t in (getattr(rollout_config, "eos_tokens", None) or ())),
        logprobs=0 if getattr(rollout_config, "return_logprobs", False) else None)


class JaxserveRollout:
    """Tunix's rollout interface over an in-process `LLM`.

    Args:
      llm: the engine, e.g. `LLM.from_module(policy, tokenizer, ...)`.
      module: what `model()` returns (the policy module the engine was built from).
      pad_id: the id left-padding the prompts (default: the tokenizer's pad id, else 0).
      lora_request: the `jaxserve.LoRARequest` the policy's adapter is served as (the
        engine needs max_loras >= 1); None: the base model, full-weight updates only.
      lora_tree: maps the trainer's LoRA state to the tree `LLM.update_lora` takes
        (None: passed as is).
    """

    def __init__(self, llm: LLM, *, module: Any = None, pad_id: int | None = None,
                 lora_request: Any = None, lora_tree: Any = None):
        self.llm = llm
        self._module = module
        self.lora_request, self._lora_tree = lora_request, lora_tree
        if lora_request is not None:
            llm.add_lora(lora_request)
        tok = llm.engine.tokenizer
        self._pad_id = pad_id if pad_id is not None else int(getattr(tok, "pad_token_id", None) or 0)

    def generate(self, prompts: Sequence[str], rollout_config: Any, **kwargs: Any) -> Any:
        """One completion per prompt (Tunix repeats prompts for its group size).

        Raises:
          ValueError: an unknown keyword argument, or a bad prompt/parameter.
        """
        if kwargs:
            raise ValueError(f"JaxserveRollout.generate: unsupported arguments {sorted(kwargs)}")
        sps = [sampling_params_for(rollout_config, i) for i in range(len(prompts))]
        width = int(rollout_config.max_prompt_length)
        tok = self.llm.engine.tokenizer
        # Tunix keeps a prompt's last max_prompt_length tokens; generate from exactly those,
        # so the prompt the trainer is handed is the one the model saw.
        ids = [tok.encode(p, add_special_tokens=True)[-width:] for p in prompts]
        outs = self.llm.generate(ids, sps, use_tqdm=False, lora_request=self.lora_request)
        padded = np.full((len(outs), width), self._pad_id, np.int32)
        for i, o in enumerate(outs):
            padded[i, width - len(o.prompt_token_ids):] = o.prompt_token_ids
        comps = [o.outputs[0] for o in outs]
        lps = None
        if getattr(rollout_config, "return_logprobs", False):
            lps = [np.asarray(c.token_logprobs, np.float32) for c in comps]
        return _output_type()(text=[c.text for c in comps], logits=[],
                              tokens=[np.asarray(c.token_ids, np.int32) for c in comps],
                              left_padded_prompt_tokens=padded, logprobs=lps)

    def get_per_token_logps(self, prompt_tokens: Any, completion_tokens: Any) -> Any:
        """Teacher-forced logprobs of the completions under the engine's current weights.

        Args:
          prompt_tokens: i32[B, P] left-padded with `pad_id()` (Tunix's layout; as
            `generate` returns them).
          completion_tokens: i32[B, C]; each row's completion runs up to and including
            its first `eos_id()` (Tunix's completion mask), else all C tokens.

        Returns: jax f32[B, C]: log p(completion[t] | prompt, completion[:t]) (the raw
        distribution, `LLM.score`), 0.0 after each row's completion.

        Raises:
          ValueError: mismatched batch sizes, a row whose prompt is all padding, or a
            bad token id (from `LLM.score`).
        """
        import jax.numpy as jnp

        p, c = np.asarray(prompt_tokens), np.asarray(completion_tokens)
        if p.ndim != 2 or c.ndim != 2 or p.shape[0] != c.shape[0]:
            raise ValueError(f"prompt_tokens {p.shape} and completion_tokens {c.shape} must be "
                             "[B, P] and [B, C] with the same B")
        pad, eos = self.pad_id(), self.eos_id()
        real = p != pad
        # Left padding: a row's prompt starts at its first non-pad token.
        starts = np.where(real.any(axis=1), real.argmax(axis=1), p.shape[1])
        is_eos = c == eos
        lengths = np.where(is_eos.any(axis=1), is_eos.argmax(axis=1) + 1, c.shape[1])
        prompts = [p[i, starts[i]:].tolist() for i in range(len(p))]
        comps = [c[i, :lengths[i]].tolist() for i in range(len(c))]
        sb = self.llm.score(prompts, comps, lora_request=self.lora_request)
        out = np.zeros(c.shape, np.float32)
        out[:, :sb.logprobs.shape[1]] = sb.logprobs
        return jnp.asarray(out)

    def update_params(self, params: Any, filter_types: Any = None) -> None:
        """Swap in the trainer's weights (a Llama module, nnx.State or tree); with
        `filter_types` (Tunix's LoRA-only sync) `params` is the adapter's state and only
        its A/B are swapped (`LLM.update_lora`, requests on it in flight fail).

        Raises:
          ValueError: filter_types without a `lora_request`, or a bad tree.
        """
        if filter_types is not None:
            if self.lora_request is None:
                raise ValueError(f"filter_types={filter_types!r}: a LoRA-only update needs "
                                 "JaxserveRollout(..., lora_request=LoRARequest(...))")
            tree = params if self._lora_tree is None else self._lora_tree(params)
            self.llm.update_lora(self.lora_request.lora_name, tree)
            return
        self.llm.update_params(params)
        if self._module is not None and hasattr(params, "cfg"):
            self._module = params

    def pad_id(self) -> int:
        return self._pad_id

    def eos_id(self) -> int:
        return int(self.llm.engine.eos_token_ids[0])

    def model(self) -> Any:
        return self._module
