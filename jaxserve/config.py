"""Frozen, validated configuration dataclasses.

`ModelConfig` describes a Llama-family architecture (Llama 2 / Llama 3 /
SmolLM, Mistral, Qwen2/Qwen2.5, Qwen3, Gemma 3 text: `HF_FAMILIES`); `CacheConfig` the paged KV pool; `SchedulerConfig` the token budget
and bucket choice; `EngineConfig` bundles them. Every field is validated on
construction and a bad value raises `ValueError` naming the field and the
limit it broke. No module here imports jax, so the scheduler can use them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

_DTYPES = ("float32", "bfloat16")
# --quantization values (vLLM's flag); jaxserve.model.quant.SCHEMES is this tuple.
QUANTIZATION_SCHEMES = ("auto", "none", "int8", "q8_0", "q4")
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "float32")  # vLLM's kv_cache_dtype names


def max_blocks_per_seq(max_model_len: int, block_size: int) -> int:
    """Blocks one sequence of `max_model_len` tokens can hold: the block table's width P
    (ceil(max_model_len / block_size); the null block not counted)."""
    return -(-max_model_len // block_size)


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def platform_dtype() -> str:
    """The default compute dtype on the platform jax runs on: "bfloat16" on a GPU or TPU
    (what their matrix units and HBM budgets are built for), "float32" on CPU (the golden
    outputs, and XLA:CPU has no fast bf16 matmul). Imports jax only when called: the
    modules of this file stay jax-free."""
    import jax

    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


@dataclass(frozen=True)
class RopeScaling:
    """`rope_scaling` of HF `config.json` (Llama 3.1 "llama3" type only).

    Frequencies are rescaled band-wise as in Meta's Llama 3.1 reference code:
    wavelengths longer than `original_max_position_embeddings / low_freq_factor`
    are divided by `factor`, shorter than `... / high_freq_factor` are kept,
    and the band between is interpolated smoothly.
    """

    rope_type: Literal["llama3"] = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        _require(self.rope_type == "llama3",
                 f"rope_scaling.rope_type={self.rope_type!r} is not supported (only 'llama3')")
        _require(self.factor >= 1.0, f"rope_scaling.factor={self.factor} must be >= 1")
        _require(self.high_freq_factor > self.low_freq_factor,
                 f"rope_scaling.high_freq_factor={self.high_freq_factor} must exceed "
                 f"low_freq_factor={self.low_freq_factor}")
        _require(self.original_max_position_embeddings > 0,
                 f"rope_scaling.original_max_position_embeddings="
                 f"{self.original_max_position_embeddings} must be > 0")


from jaxserve.config_hf import (  # noqa: E402,F401 - the HF config parsing, re-exported
    ACTIVATIONS, GEMMA3_SLIDING_WINDOW_PATTERN, HF_FAMILIES, LAYER_TYPES, hf_family_switches,
    hf_layer_types)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (HF `LlamaConfig` field names).

    One decoder serves Llama 2/3, SmolLM, Mistral, Qwen2/Qwen2.5, Qwen3 (and Gemma 3's
    block, below); the families differ only in these switches:
      attention_bias: q/k/v projections carry biases (Qwen2; the o projection never does).
      qk_norm: per-head RMSNorm over head_dim on q and k, before RoPE (Qwen3).
      head_dim: explicit, may differ from hidden_size / num_attention_heads (Qwen3, Mistral).
      sliding_window / layer_types: a "sliding_attention" layer's query sees its last
        `sliding_window` keys, itself included (transformers' `kv_idx > q_idx - window`);
        layer_types None with a window: every layer (Mistral).
    Gemma 3 (`jaxserve.model.gemma3`, Team Gemma 2025) adds the fields after
    layer_types; its (1 + w) RMSNorm weights are stored as 1 + w (llama.cpp's GGUF
    holds them so), so the forward's RMSNorm is the Llama one.

    Shape letters used across the code: V=vocab_size, E=hidden_size,
    F=intermediate_size, L=num_hidden_layers, H=num_attention_heads,
    K=num_key_value_heads, D=head_dim.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    qk_norm: bool = False  # per-head q/k RMSNorm before RoPE (Qwen3)
    # compute and parameter dtype: "float32" | "bfloat16"; None: `platform_dtype()`
    dtype: str | None = None
    sliding_window: int | None = None  # keys a local layer's query sees (itself included)
    layer_types: tuple[str, ...] | None = None  # per layer, LAYER_TYPES; None: all sliding
    sandwich_norms: bool = False  # Gemma 2/3: post-attention and pre-/post-MLP norms
    scale_embeddings: bool = False  # Gemma: embeddings x sqrt(hidden_size)
    hidden_act: str = "silu"  # ACTIVATIONS: the gate's activation
    rope_local_base_freq: float | None = None  # Gemma 3: RoPE base of the sliding layers
    query_pre_attn_scalar: float | None = None  # scores x its ** -0.5 (None: head_dim)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)

    def __post_init__(self):
        if self.dtype is None:
            object.__setattr__(self, "dtype", platform_dtype())
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            v = getattr(self, name)
            _require(isinstance(v, int) and v > 0, f"ModelConfig.{name}={v!r} must be a positive int")
        _require(self.num_attention_heads % self.num_key_value_heads == 0,
                 f"ModelConfig.num_attention_heads={self.num_attention_heads} must be a multiple "
                 f"of num_key_value_heads={self.num_key_value_heads}")
        _require(self.rms_norm_eps > 0, f"ModelConfig.rms_norm_eps={self.rms_norm_eps} must be > 0")
        _require(self.rope_theta > 0, f"ModelConfig.rope_theta={self.rope_theta} must be > 0")
        _require(self.dtype in _DTYPES, f"ModelConfig.dtype={self.dtype!r} must be one of {_DTYPES}")
        _require(all(0 <= t < self.vocab_size for t in self.eos_token_ids),
                 f"ModelConfig.eos_token_ids={self.eos_token_ids} must lie in [0, {self.vocab_size})")
        w, types = self.sliding_window, self.layer_types
        _require(w is None or (isinstance(w, int) and w >= 1),
                 f"ModelConfig.sliding_window={w!r} must be None or an int >= 1")
        if types is not None:
            object.__setattr__(self, "layer_types", types := tuple(types))
            _require(len(types) == self.num_hidden_layers and set(types) <= set(LAYER_TYPES)
                     and (w is not None or "sliding_attention" not in types),
                     f"ModelConfig.layer_types={types!r} must hold one of {LAYER_TYPES} per "
                     f"layer ({self.num_hidden_layers}), sliding ones only with a sliding_window")
        _require(self.hidden_act in ACTIVATIONS,
                 f"ModelConfig.hidden_act={self.hidden_act!r} must be one of {ACTIVATIONS}")
        for name in ("rope_local_base_freq", "query_pre_attn_scalar", "final_logit_softcapping"):
            _require(getattr(self, name) is None or getattr(self, name) > 0,
                     f"ModelConfig.{name}={getattr(self, name)!r} must be None or > 0")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer: the sliding window (keys a query sees), or None for a global layer."""
        if self.sliding_window is None:
            return (None,) * self.num_hidden_layers
        types = self.layer_types or ("sliding_attention",) * self.num_hidden_layers
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in types)

    @property
    def has_sliding_layers(self) -> bool:
        """Whether any layer attends through a sliding window."""
        return any(w is not None for w in self.layer_windows)

    @property
    def attn_scale(self) -> float:
        """Softmax scale: query_pre_attn_scalar ** -0.5 (Gemma), else head_dim ** -0.5."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def replace(self, **kw: Any) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], *, dtype: str | None = None) -> "ModelConfig":
        """Build from a parsed HF `config.json` (the families of `HF_FAMILIES`).

        Raises:
          ValueError: an unsupported architecture, a sliding window in use, a
            feature the family's switches cannot express, or an unsupported
            rope_scaling type.
        """
        if d.get("model_type") == "gemma3" and isinstance(d.get("text_config"), dict):
            # Gemma3ForConditionalGeneration: the text model's config is nested
            d = {**d["text_config"], "model_type": "gemma3_text",
                 "architectures": ["Gemma3ForCausalLM"]}
        switches = hf_family_switches(d)
        window, layer_types = hf_layer_types(d)
        h = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // h
        # transformers 5 moved rope settings to `rope_parameters`.
        rp = d.get("rope_parameters") or {}
        rp, local_rp = ((rp["full_attention"], rp.get("sliding_attention") or {})  # per type
                        if "full_attention" in rp else (rp, {}))  # (transformers 5 Gemma 3)
        rs = d.get("rope_scaling") or (rp if rp.get("rope_type") not in (None, "default") else None)
        theta = d.get("rope_theta", rp.get("rope_theta", 10000.0))
        gemma = {}
        if d.get("model_type") == "gemma3_text":
            gemma = dict(rope_local_base_freq=float(d.get("rope_local_base_freq", local_rp.get(
                "rope_theta", 1e4))), query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)),
                hidden_act=d.get("hidden_activation") or d.get("hidden_act", "gelu_pytorch_tanh"),
                final_logit_softcapping=d.get("final_logit_softcapping"))
        elif d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={d.get('hidden_act')!r} is not supported for "
                             f"model_type={d.get('model_type')!r} (only 'silu')")
        scaling = None
        if rs:
            rtype = rs.get("rope_type", rs.get("type"))
            if rtype not in (None, "default"):
                scaling = RopeScaling(
                    rope_type=rtype, factor=float(rs["factor"]),
                    low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
                    high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
                    original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)))
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=h, num_key_value_heads=d.get("num_key_value_heads", h),
            head_dim=head_dim, max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
            rope_scaling=scaling, tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"), eos_token_ids=eos_ids, dtype=dtype,
            sliding_window=window, layer_types=layer_types, **gemma, **switches)

    @classmethod
    def tiny(cls, **kw: Any) -> "ModelConfig":
        """A tiny config with mutually distinct sizes, so a transposed axis fails loudly."""
        base = dict(vocab_size=67, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                    num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                    max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                    tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,))
        base.update(kw)
        return cls(**base)

    @classmethod
    def smollm2_135m(cls, **kw: Any) -> "ModelConfig":
        """SmolLM2-135M-Instruct (HuggingFaceTB), the default real model."""
        base = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
                    rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
                    eos_token_ids=(2,))
        base.update(kw)
        return cls(**base)

    @classmethod
    def gemma3_270m(cls, **kw: Any) -> "ModelConfig":
        """Gemma 3 270M (google/gemma-3-270m's config.json): 18 layers, 5 local (window 512)
        to 1 global, head_dim 256, a 262,144-token vocabulary; the Gemma test model."""
        base = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048,
                    num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                    head_dim=256, max_position_embeddings=32768, rms_norm_eps=1e-6,
                    rope_theta=1e6, tie_word_embeddings=True, bos_token_id=2,
                    eos_token_ids=(1, 106), qk_norm=True, sliding_window=512,
                    layer_types=tuple(LAYER_TYPES[(i + 1) % 6 > 0] for i in range(18)),
                    sandwich_norms=True, scale_embeddings=True, hidden_act="gelu_pytorch_tanh",
                    rope_local_base_freq=1e4, query_pre_attn_scalar=256.0)
        return cls(**{**base, **kw})

    @classmethod
    def llama3_8b(cls, **kw: Any) -> "ModelConfig":
        """Meta-Llama-3-8B's shapes (its HF config.json): head_dim 128, 8 KV heads; for
        deviceless compiles of an 8B-sized program (`jaxserve compile --model_config`)."""
        base = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5,
                    rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=128000,
                    eos_token_ids=(128001,))
        base.update(kw)
        return cls(**base)

@dataclass(frozen=True)
class CacheConfig:
    """Paged KV pool (vLLM's PagedAttention, Kwon et al. SOSP'23).

    Either `num_kv_blocks` is given, or it is derived from
    `kv_cache_memory_bytes` by the model runner. Block 0 is the reserved null
    block, so `num_kv_blocks - 1` blocks hold real tokens.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 512 * 1024 * 1024
    enable_prefix_caching: bool = True

    def __post_init__(self):
        _require(isinstance(self.block_size, int) and self.block_size > 0,
                 f"CacheConfig.block_size={self.block_size!r} must be a positive int")
        _require(self.num_kv_blocks is None or (isinstance(self.num_kv_blocks, int)
                                                and self.num_kv_blocks >= 2),
                 f"CacheConfig.num_kv_blocks={self.num_kv_blocks!r} must be >= 2 "
                 "(block 0 is the reserved null block)")
        _require(self.kv_cache_memory_bytes > 0,
                 f"CacheConfig.kv_cache_memory_bytes={self.kv_cache_memory_bytes} must be > 0")


@dataclass(frozen=True)
class SchedulerConfig:
    """Iteration-level scheduling limits (Orca OSDI'22; vLLM V1 scheduler).

    `token_buckets` / `seq_buckets`: explicit padded sizes; when None the
    `bucket_policy` builder ("pow2" or "pow2_linear") makes them.
    `max_num_batched_tokens` is always the largest token bucket and
    `max_num_seqs` the largest sequence bucket.
    """

    max_num_batched_tokens: int = 256
    max_num_seqs: int = 32
    max_model_len: int = 2048
    long_prefill_token_threshold: int = 0  # 0 = no cap beyond the budget
    policy: Literal["fcfs", "priority"] = "fcfs"
    bucket_policy: Literal["pow2", "pow2_linear"] = "pow2"
    bucket_gap: int = 64  # linear step for "pow2_linear"
    # Buckets down to one token / one row: XLA:CPU runs a one-row step's matmuls as a
    # GEMV at ~19 GB/s against ~4-5 GB/s for its 2-64-row GEMMs, so a decode step of
    # SmolLM2 with one row left costs ~75 ms at T_pad 1 against ~150 ms at T_pad 8, and
    # seed8 at 8 seqs runs 1.57x faster (notes/perf.md, fifth wave). The extra 3 stack
    # and 3 head programs (and 3 score programs with prompt logprobs) add ~9 s to a cold
    # full warm-up; `--min_token_bucket=8 --min_seq_bucket=8` restores the old set.
    min_token_bucket: int = 1
    min_seq_bucket: int = 1
    token_buckets: tuple[int, ...] | None = None
    seq_buckets: tuple[int, ...] | None = None
    static_batching: bool = False  # admit a batch, add nothing until all of it finishes

    def __post_init__(self):
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "bucket_gap",
                     "min_token_bucket", "min_seq_bucket"):
            v = getattr(self, name)
            _require(isinstance(v, int) and v > 0, f"SchedulerConfig.{name}={v!r} must be a positive int")
        _require(self.long_prefill_token_threshold >= 0,
                 f"SchedulerConfig.long_prefill_token_threshold={self.long_prefill_token_threshold} must be >= 0")
        _require(self.policy in ("fcfs", "priority"),
                 f"SchedulerConfig.policy={self.policy!r} must be 'fcfs' or 'priority'")
        _require(self.bucket_policy in ("pow2", "pow2_linear"),
                 f"SchedulerConfig.bucket_policy={self.bucket_policy!r} must be 'pow2' or 'pow2_linear'")
        _require(self.max_num_seqs <= self.max_num_batched_tokens,
                 f"SchedulerConfig.max_num_seqs={self.max_num_seqs} must be <= "
                 f"max_num_batched_tokens={self.max_num_batched_tokens}")
        for name, top in (("token_buckets", self.max_num_batched_tokens),
                          ("seq_buckets", self.max_num_seqs)):
            b = getattr(self, name)
            if b is None:
                continue
            _require(len(b) > 0 and all(isinstance(x, int) and x > 0 for x in b)
                     and list(b) == sorted(set(b)),
                     f"SchedulerConfig.{name}={b} must be strictly increasing positive ints")
            _require(b[-1] == top, f"SchedulerConfig.{name}={b}: the largest bucket must equal {top}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything `LLMEngine` needs besides the weights."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    attention_backend: Literal["auto", "xla", "pallas", "pallas_mosaic", "pallas_triton"] = "auto"
    # Run Pallas attention kernels in the Pallas interpreter (CPU tests of the GPU path).
    attention_interpret: bool = False
    max_logprobs: int = 20
    # vLLM's logprobs_mode: "raw_logprobs" (the model's distribution) or
    # "processed_logprobs" (the sampled one, after penalties/temperature/filters).
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    # Unroll the decoder layers in the jitted step (per-layer weight buffers) instead of a
    # lax.scan over stacked weights: XLA:CPU copies each layer's weight slice out of the
    # stack under the scan. Faster steps, longer compiles (notes/perf.md).
    unroll_layers: bool = True
    # With unroll_layers: the layer stack of a token bucket runs as L / G calls of ONE
    # compiled program over G consecutive layers (per-layer weight and KV cache buffers,
    # the cache donated call by call), plus an embed and a final-norm program. G = 1
    # compiles ~7x faster than the one-program stack (G = L) at the same step time
    # (notes/startup.md, scripts/profile_layer_groups.py; measured on CPU only, where the
    # L + 2 calls per step cost nothing measurable). Must divide num_hidden_layers;
    # unused by the scan (unroll_layers=False), which keeps its one program. None: 1 on
    # CPU; on an accelerator L (one program per bucket, as a CUDA graph: a step there is
    # short enough that L + 2 launches would show, and that was never measured).
    layers_per_program: int | None = None
    # Refuse (RuntimeError) a step whose program warm-up did not build, instead of
    # compiling it late with an ERROR log (on in the test suite).
    strict_compiles: bool = False
    # Build the "score" programs (one per token bucket: LM head + log_softmax over every
    # token row) for prompt_logprobs, echo with logprobs and LLM.score; off: those are a 400.
    enable_prompt_logprobs: bool = True
    # Devices the model is split over (Megatron-style tensor parallelism, jaxserve/parallel.py);
    # checked against the heads and the devices by the runner, before any compile.
    tensor_parallel_size: int = 1
    # "full": every program is built before the engine is ready. "progressive": ready once
    # the programs of the token buckets up to 8 tokens (worker.warmup.READY_TOKENS) and the
    # heads their steps can need are built; the rest compile in a background thread while
    # steps are capped at the largest ready bucket (`BucketPolicy.program_stages`).
    warmup: Literal["full", "progressive"] = "full"
    # Threads that build the programs needed before ready (stage 0 of a progressive warm-up,
    # every program of a full one) at once; XLA:CPU compiles one program on one core.
    compile_threads: int = 2
    # Weight-only quantization (vLLM's `quantization`): "auto" keeps the checkpoint's own
    # (a GGUF file's Q8_0 / Q4_0 / Q4_1 blocks stay blocks; float files stay float),
    # "none" full precision, "int8" (per-channel), "q8_0" (blocks of 32) and "q4" (Q4_1-style
    # blocks of 32) quantize float matrices at load (`jaxserve.model.quant`).
    quantization: Literal["auto", "none", "int8", "q8_0", "q4"] = "auto"
    # Fused projections (`jaxserve.model.fused`): wq|wk|wv and w_gate|w_up as one matrix
    # each, four matmuls a layer instead of seven. None (auto): on CPU where the layer
    # matrices are block-quantized in one format (fewer native kernel calls: notes/issue26.md)
    # and neither LoRA nor tensor parallelism is on; off elsewhere. True with LoRA, tensor
    # parallelism or Gemma 3 is an error (the runner's, before any compile).
    fuse_projections: bool | None = None
    max_loras: int = 0  # LoRA (issue 27, vLLM's name): adapter slots on the device; 0: off
    max_lora_rank: int = 16  # the largest adapter rank a slot holds (checked by the runner)
    # vLLM's async_scheduling (issue 24): plan and dispatch step n+1 as soon as step n's
    # tokens are back, then process step n's outputs (detokenizer, stop strings,
    # RequestOutputs) while the device runs n+1. Outputs are the same as with it off; a
    # request that a stop string ends wastes one row of the step already dispatched.
    # A step with structured-output rows is followed without overlap.
    async_scheduling: bool = True
    # Output placeholders (issue 24; vLLM V1's async scheduling plans this way): with
    # async_scheduling, plan and dispatch step n+1 before step n's tokens are back, its
    # decode rows reading them on the device. None: on where the device is not the host's
    # own cores (GPU, TPU); off on CPU, where the planning then competes with the step for
    # the same cores (measured there: 0.93-1.01x the throughput, BUILD_NOTES "sixth session").
    async_placeholders: bool | None = None
    # vLLM's stream_interval: a live request gets a RequestOutput once it has this many
    # new tokens (its first token and its last always at once); 1 is every token. Larger
    # values batch several tokens into one output (one SSE event) and cut host work.
    stream_interval: int = 1
    # vLLM's kv_cache_dtype (issue 26): the KV cache's element type. "auto" is the model's
    # dtype; "float16" / "bfloat16" halve an fp32 model's KV bytes (twice the tokens in
    # kv_cache_memory_bytes, half the bytes a decode step reads). K and V are cast to it
    # when written and read back as f32 for the attention math.
    kv_cache_dtype: Literal["auto", "float16", "bfloat16", "float32"] = "auto"

    def __post_init__(self):
        _require(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
                 f"EngineConfig.tensor_parallel_size={self.tensor_parallel_size!r} must be a "
                 f"positive int")
        L = self.model.num_hidden_layers
        _require(self.layers_per_program is None or (
                     isinstance(self.layers_per_program, int) and 1 <= self.layers_per_program
                     <= L and L % self.layers_per_program == 0),
                 f"EngineConfig.layers_per_program={self.layers_per_program!r} must be a "
                 f"divisor of num_hidden_layers={L}")
        _require(isinstance(self.stream_interval, int) and self.stream_interval >= 1,
                 f"EngineConfig.stream_interval={self.stream_interval!r} must be a positive int")
        _require(self.async_placeholders in (None, True, False),
                 f"EngineConfig.async_placeholders={self.async_placeholders!r} must be None "
                 f"(auto: off on CPU), True or False")
        _require(self.fuse_projections in (None, True, False),
                 f"EngineConfig.fuse_projections={self.fuse_projections!r} must be None (auto), "
                 f"True or False")
        _require(isinstance(self.compile_threads, int) and self.compile_threads >= 1,
                 f"EngineConfig.compile_threads={self.compile_threads!r} must be a positive int")
        _require(self.quantization in QUANTIZATION_SCHEMES,
                 f"EngineConfig.quantization={self.quantization!r} must be one of "
                 f"{'|'.join(QUANTIZATION_SCHEMES)}")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES,
                 f"EngineConfig.kv_cache_dtype={self.kv_cache_dtype!r} must be one of "
                 f"{'|'.join(KV_CACHE_DTYPES)}")
        _require(self.warmup in ("full", "progressive"),
                 f"EngineConfig.warmup={self.warmup!r} must be 'full' or 'progressive'")
        _require(self.attention_backend in ("auto", "xla", "pallas", "pallas_mosaic",
                                            "pallas_triton"),
                 f"EngineConfig.attention_backend={self.attention_backend!r} must be "
                 f"auto|xla|pallas|pallas_mosaic|pallas_triton")
        _require(self.scheduler.max_model_len <= self.model.max_position_embeddings,
                 f"SchedulerConfig.max_model_len={self.scheduler.max_model_len} exceeds the model's "
                 f"max_position_embeddings={self.model.max_position_embeddings}")
        _require(0 <= self.max_logprobs <= self.model.vocab_size,
                 f"EngineConfig.max_logprobs={self.max_logprobs} must be in [0, vocab_size]")
        _require(self.logprobs_mode in ("raw_logprobs", "processed_logprobs"),
                 f"EngineConfig.logprobs_mode={self.logprobs_mode!r} must be "
                 f"raw_logprobs|processed_logprobs")

    @property
    def kv_dtype(self) -> str:
        """The KV cache's dtype name ("float32" | "float16" | "bfloat16"): `kv_cache_dtype`,
        or the model's dtype for "auto"."""
        return self.model.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
