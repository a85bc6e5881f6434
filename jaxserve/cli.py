"""`jaxserve generate | serve | bench ...` (absl flags).

    jaxserve generate --prompts_file=examples/prompts.jsonl --max_tokens=64
    jaxserve serve --port=8000
    jaxserve bench buckets --trace=../shared/bench/ragged64.jsonl --dry_run
    jaxserve bench serve --base_url=http://127.0.0.1:8000/v1 --trace=...
    jaxserve compile --target=h200 --model_config=llama3-8b --json=h200.json
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from absl import app, flags

from jaxserve.worker.host_memory import fix_mmap_threshold, release_host_memory

FLAGS = flags.FLAGS

# ---- model and engine (shared by generate and serve)
flags.DEFINE_string("model", None, "A .gguf file or an HF directory; default: the fetched SmolLM2.")
flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Parameter and compute dtype "
                  "(default: bfloat16 on a GPU or TPU and for `compile --target`, float32 on CPU).")
flags.DEFINE_enum("quantization", "auto", ["auto", "none", "int8", "q8_0", "q4"],
                  "Weight-only quantization (vLLM's flag): auto = the checkpoint's own (a GGUF "
                  "file's Q8_0/Q4_0/Q4_1 blocks stay quantized), none = full precision, "
                  "int8 (per-channel) / q8_0 / q4 quantize a float checkpoint at load.")
flags.DEFINE_enum("kv_cache_dtype", "auto", ["auto", "float16", "bfloat16", "float32"],
                  "KV cache element type (vLLM's flag): auto = the model's dtype; float16 / "
                  "bfloat16 hold twice the tokens of an fp32 model in the same memory.")
flags.DEFINE_integer("block_size", 16, "Tokens per KV block.")
flags.DEFINE_integer("num_kv_blocks", None, "KV pool size in blocks (default: from --kv_cache_memory_mb).")
flags.DEFINE_integer("kv_cache_memory_mb", 512, "KV pool memory budget in MiB when --num_kv_blocks is unset.")
flags.DEFINE_integer("max_num_seqs", 32, "Most sequences in one step.")
flags.DEFINE_integer("max_num_batched_tokens", 256, "Token budget of one step (the largest token bucket).")
flags.DEFINE_integer("max_model_len", None, "Most positions (prompt + output) of one request "
                     "(default: min(2048, the model's max_position_embeddings)).")
flags.DEFINE_integer("long_prefill_token_threshold", 0, "Cap on one prompt's chunk per step (0: none).")
flags.DEFINE_enum("bucket_policy", "pow2", ["pow2", "pow2_linear"], "How token/seq buckets are built.")
flags.DEFINE_integer("bucket_gap", 64, "Linear step of the pow2_linear policy.")
flags.DEFINE_integer("min_token_bucket", 1, "Smallest token bucket the policy builds (8 was "
                     "the default before one-row steps got their own program).")
flags.DEFINE_integer("min_seq_bucket", 1, "Smallest sequence bucket the policy builds.")
flags.DEFINE_list("token_buckets", None, "Explicit token buckets (the last must equal max_num_batched_tokens).")
flags.DEFINE_list("seq_buckets", None, "Explicit sequence buckets (the last must equal max_num_seqs).")
flags.DEFINE_enum("attention_backend", "auto",
                  ["auto", "xla", "pallas", "pallas_mosaic", "pallas_triton"],
                  "Attention implementation: auto = Mosaic on CUDA cc 9.x, Triton on cc 8.x "
                  "and >= 10, xla otherwise; pallas = the best Pallas kernel for the GPU.")
flags.DEFINE_enum("scheduling_policy", "fcfs", ["fcfs", "priority"],
                  "Admission and preemption order: fcfs, or priority (lower request "
                  "`priority` first, then arrival; vLLM's flag).")
flags.DEFINE_bool("enable_prefix_caching", True, "Reuse KV blocks of shared prompt prefixes.")
flags.DEFINE_bool("unroll_layers", True, "Unroll the decoder layers in each step program: faster "
                  "steps on CPU, ~2.5x longer compiles (false: lax.scan over stacked weights).")
flags.DEFINE_integer("layers_per_program", None, "Decoder layers per compiled layer program (with "
                     "--unroll_layers): the stack runs as num_layers / N calls of one program. "
                     "1 compiles fastest; num_layers is one program for the whole stack. "
                     "Default: 1 on CPU, num_layers on GPU/TPU.")
flags.DEFINE_integer("compile_threads", 2, "Threads that compile the programs needed before "
                     "the server is ready (XLA:CPU compiles one program per core).")
flags.DEFINE_bool("async_scheduling", True, "Plan and dispatch step n+1 as soon as step n's "
                  "tokens are back and process step n's outputs while it runs (vLLM's "
                  "async scheduling); same outputs as without.")
flags.DEFINE_integer("stream_interval", 1, "Tokens a streaming request accumulates before "
                     "its next output / SSE event (vLLM's; its first and last token go at "
                     "once). Larger values cut the host's work per step.")
flags.DEFINE_bool("strict_compiles", False, "Refuse (fail the step) instead of compiling when a "
                  "step needs a program warm-up did not build.")
flags.DEFINE_bool("enable_prompt_logprobs", True, "Build the score programs (one per token "
                  "bucket) for prompt_logprobs and echo with logprobs; false: those are a 400.")
flags.DEFINE_integer("tensor_parallel_size", 1, "Devices to split the model over (Megatron-style "
                     "tensor parallelism; must divide the query heads, and divide or be a "
                     "multiple of the KV heads).")
flags.DEFINE_bool("static_batching", False, "Admit a batch and add nothing until all of it finishes.")
flags.DEFINE_string("compile_cache_dir", "",
                    "Persistent JAX compilation cache ('' disables; off by default: the "
                    "executable cache supersedes it, and on XLA:CPU a program JAX loaded "
                    "from its cache cannot be stored in the executable cache).")
flags.DEFINE_string("params_cache_dir", "checkpoints/params_cache",
                    "Converted-parameter cache ('' disables).")
# ---- multi-host (JAX multi-controller: one process per host; jaxserve/multihost.py)
flags.DEFINE_integer("num_processes", 1, "Processes (hosts) of a multi-host run; >1 starts "
                     "jax.distributed. Process 0 serves; the others follow its steps.")
flags.DEFINE_integer("process_id", 0, "This process's index in [0, num_processes).")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0's jax.distributed "
                    "coordinator (needed with --num_processes > 1).")
flags.DEFINE_string("executable_cache_dir", "checkpoints/executable_cache",
                    "Serialized compiled step programs: a restart skips tracing ('' disables).")
flags.DEFINE_enum("warmup", "auto", ["auto", "full", "progressive"],
                  "full: build every bucket program before ready. progressive: ready once the "
                  "smallest token bucket's programs are built, the rest compile in the "
                  "background (steps capped meanwhile). auto: progressive for serve, full for "
                  "generate.")
# ---- compile (deviceless, for a GPU that is not here: jaxserve/gpu/)
flags.DEFINE_string("target", None, "compile: the GPU to compile for (h200, h100, a100).")
flags.DEFINE_string("model_config", None, "compile: a model preset (llama3-8b, smollm2-135m, "
                    "gemma3-270m, tiny-d64) or an HF config.json, compiled from its shapes alone "
                    "(no weights); default: --model's config.")
flags.DEFINE_string("json", None, "compile: also write the report here as JSON.")
# ---- generate
flags.DEFINE_multi_string("prompt", [], "A prompt (repeatable).")
flags.DEFINE_string("prompts_file", None, "Prompts: .jsonl with 'prompt' (and optional 'max_tokens', 'id') "
                    "per line, or a text file with one prompt per line.")
flags.DEFINE_bool("chat", True, "Apply the model's chat template to each prompt.")
flags.DEFINE_integer("max_tokens", 64, "Most tokens to generate (a JSONL 'max_tokens' overrides).")
flags.DEFINE_integer("min_tokens", 0, "Suppress EOS/stop tokens until this many tokens.")
flags.DEFINE_float("temperature", 0.0, "0 is greedy.")
flags.DEFINE_integer("top_k", 0, "0 or -1 disables.")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass.")
flags.DEFINE_float("min_p", 0.0, "Min-p filter.")
flags.DEFINE_integer("seed", None, "Per-request sampling seed.")
flags.DEFINE_bool("ignore_eos", False, "Do not stop at EOS.")
flags.DEFINE_multi_string("stop", [], "Stop string (repeatable).")
flags.DEFINE_integer("n", 1, "Samples per prompt.")
flags.DEFINE_bool("print_outputs", True, "Print each completion.")
flags.DEFINE_string("output_json", None, "Write outputs and the summary here.")
# ---- serve
flags.DEFINE_string("host", "127.0.0.1", "Address to bind.")
flags.DEFINE_integer("port", 8000, "Port to bind.")
flags.DEFINE_string("served_model_name", None, "Model name in the API (default: the file's stem).")
flags.DEFINE_string("api_key", None, "Optional bearer token required on /v1 routes.")
flags.DEFINE_string("allowed_weights_dir", None, "With --api_key: the only directory "
                    "POST /admin/update_weights_from_disk may load checkpoints from.")
flags.DEFINE_enum("tool_call_parser", "auto", ["auto", "hermes", "llama3_json", "mistral"],
                  "vLLM's --tool-call-parser: how model output becomes tool_calls; auto: "
                  "read from the chat template, else hermes.")
flags.DEFINE_bool("enable_auto_tool_choice", True, "vLLM's --enable-auto-tool-choice: "
                  "tool_choice='auto' parses tool calls (off: it is a 400).")
flags.DEFINE_enum("reasoning_parser", None, ["qwen3", "deepseek_r1"], "vLLM's "
                  "--reasoning-parser: split <think>...</think> into message.reasoning.")
flags.DEFINE_integer("max_loras", 0, "LoRA adapter slots on the device (0: LoRA off; vLLM's "
                     "--max-loras). Every step program carries the slots.")
flags.DEFINE_integer("max_lora_rank", 16, "Largest LoRA rank a slot holds (vLLM's --max-lora-rank).")
flags.DEFINE_multi_string("lora_modules", [], "name=path of a PEFT adapter directory to serve "
                          "as model `name` (repeat the flag; vLLM's --lora-modules). Needs "
                          "--max_loras >= 1 (default then 1).")
flags.DEFINE_bool("engine_process", False, "serve: the engine in its own process (vLLM V1's), "
                  "apart from the HTTP loop's GIL. Worth it where a step takes a few ms (a "
                  "GPU); costs a second process's memory.")
flags.DEFINE_integer("max_queued_requests", None, "Most requests waiting to be scheduled; past "
                     "it new requests get 503 with Retry-After (default: unbounded).")


def engine_args_from_flags() -> dict[str, Any]:
    """The engine keyword arguments named by the shared flags."""
    args: dict[str, Any] = dict(
        dtype=FLAGS.dtype, quantization=FLAGS.quantization, block_size=FLAGS.block_size,
        kv_cache_dtype=FLAGS.kv_cache_dtype,
        max_num_seqs=FLAGS.max_num_seqs,
        max_num_batched_tokens=FLAGS.max_num_batched_tokens,
        long_prefill_token_threshold=FLAGS.long_prefill_token_threshold,
        bucket_policy=FLAGS.bucket_policy, bucket_gap=FLAGS.bucket_gap,
        min_token_bucket=FLAGS.min_token_bucket, min_seq_bucket=FLAGS.min_seq_bucket,
        scheduling_policy=FLAGS.scheduling_policy, attention_backend=FLAGS.attention_backend,
        enable_prefix_caching=FLAGS.enable_prefix_caching, static_batching=FLAGS.static_batching,
        unroll_layers=FLAGS.unroll_layers, layers_per_program=FLAGS.layers_per_program,
        compile_threads=FLAGS.compile_threads, async_scheduling=FLAGS.async_scheduling,
        stream_interval=FLAGS.stream_interval,
        strict_compiles=FLAGS.strict_compiles,
        # multi-host: the score programs would have to run in lock-step on every process
        enable_prompt_logprobs=FLAGS.enable_prompt_logprobs and FLAGS.num_processes == 1,
        tensor_parallel_size=FLAGS.tensor_parallel_size,
        kv_cache_memory_bytes=FLAGS.kv_cache_memory_mb * 2**20,
        max_loras=FLAGS.max_loras or (1 if FLAGS.lora_modules else 0),
        max_lora_rank=FLAGS.max_lora_rank)
    if FLAGS.max_model_len is not None:
        args["max_model_len"] = FLAGS.max_model_len
    if FLAGS.num_kv_blocks is not None:
        args["num_kv_blocks"] = FLAGS.num_kv_blocks
    if FLAGS.token_buckets:
        args["token_buckets"] = tuple(int(x) for x in FLAGS.token_buckets)
    if FLAGS.seq_buckets:
        args["seq_buckets"] = tuple(int(x) for x in FLAGS.seq_buckets)
    return args


def build_engine(auto_warmup: str = "full"):
    """Load the model named by --model and build a warmed-up LLMEngine
    (--warmup=auto means `auto_warmup`)."""
    from jaxserve.checkpoint import load_model
    from jaxserve.checkpoint.default import resolve_model_path
    from jaxserve.engine import LLMEngine, make_engine_config
    from jaxserve.engine.stats import freeze_gc_heap
    from jaxserve.worker.compile import enable_compilation_cache
    from jaxserve.distributed.tensor_parallel import OwnedHostParams, align_host_leaves

    fix_mmap_threshold()  # freed large XLA buffers go back to the OS (worker/host_memory.py)
    enable_compilation_cache(FLAGS.compile_cache_dir)
    path = resolve_model_path(FLAGS.model)
    cache_dir = FLAGS.params_cache_dir if FLAGS.num_processes == 1 else None  # see start_multihost
    cfg, params, tokenizer = load_model(path, dtype=FLAGS.dtype, cache_dir=cache_dir or None,
                                        quantization=FLAGS.quantization)
    warmup = auto_warmup if FLAGS.warmup == "auto" else FLAGS.warmup
    if FLAGS.num_processes > 1:  # followers must hold every program before the first step
        warmup = "full"
    config = make_engine_config(cfg, warmup=warmup, **engine_args_from_flags())
    name = FLAGS.served_model_name or Path(path).stem
    # The tree is the engine's alone: on one CPU device its (64-byte aligned) leaves
    # become the device buffers, with no second copy (`OwnedHostParams`). Elsewhere the
    # engine copies; the host tree is dropped before warm-up's compiles, and freed heap
    # pages go back after each phase (peak RSS per phase: scripts/measure_rss.py).
    owned = OwnedHostParams(align_host_leaves(params))
    del params
    engine = LLMEngine(config, owned, tokenizer, model_name=name, warmup=False,
                       executable_cache_dir=FLAGS.executable_cache_dir or None)
    del owned
    release_host_memory()
    engine.runner.warmup()
    release_host_memory()
    freeze_gc_heap()  # one engine a process: its start-up heap leaves the GC's scans
    add_lora_modules(engine, FLAGS.lora_modules)
    if FLAGS.num_processes > 1:  # the leader: each step is broadcast to the followers
        from jaxserve.distributed.multihost import Leader

        leader = Leader(engine.runner)  # stops the followers at exit
        engine.runner.set_step_listener(leader.send_step)
    return engine


def add_lora_modules(engine: Any, modules: Sequence[str]) -> None:
    """Register `--lora_modules name=path` adapters (ids 1, 2, ... in flag order).

    Raises:
      app.UsageError: an entry that is not name=path, or a bad adapter (the message
        names it and the limit it broke).
    """
    from jaxserve.lora import LoRARequest

    for i, entry in enumerate(modules, start=1):
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise app.UsageError(f"--lora_modules={entry!r} must be name=path")
        try:
            engine.lora.add_lora(LoRARequest(name, i, path))
        except ValueError as e:
            raise app.UsageError(f"--lora_modules={entry!r}: {e}") from e


def start_multihost() -> bool:
    """With --num_processes > 1: join jax.distributed; a follower (process_id > 0) then
    loads the same model and runner, runs the leader's steps until it stops, and this
    returns True (the command is done). False for a single process or the leader.

    Raises:
      app.UsageError: --num_processes > 1 without --coordinator_address.
    """
    if FLAGS.num_processes <= 1:
        return False
    if not FLAGS.coordinator_address:
        raise app.UsageError("--num_processes > 1 needs --coordinator_address=host:port")
    from jaxserve.distributed import multihost

    multihost.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
    if FLAGS.process_id == 0:
        return False
    from jaxserve.checkpoint import load_model
    from jaxserve.checkpoint.default import resolve_model_path
    from jaxserve.engine import make_engine_config
    from jaxserve.worker.compile import enable_compilation_cache
    from jaxserve.worker.model_runner import ModelRunner
    from jaxserve.scheduler.buckets import BucketPolicy

    fix_mmap_threshold()
    enable_compilation_cache(FLAGS.compile_cache_dir)
    # No params cache with several processes yet: the .npy cache's writes are atomic, but
    # several processes converting into one entry at once has not been tested.
    cfg, params, _ = load_model(resolve_model_path(FLAGS.model), dtype=FLAGS.dtype,
                                cache_dir=None, quantization=FLAGS.quantization)
    config = make_engine_config(cfg, **engine_args_from_flags())
    runner = ModelRunner(config, params, bucket_policy=BucketPolicy.from_config(config.scheduler))
    runner.warmup(progress=False)
    multihost.follower_loop(runner)
    return True


def read_prompts(path: str | None, inline: Sequence[str]) -> list[dict[str, Any]]:
    """Prompt records {'id', 'prompt', 'max_tokens'?} from --prompt flags and --prompts_file.

    Raises:
      ValueError: a JSONL line that is not an object with a string 'prompt'.
    """
    rows = [{"id": f"p{i}", "prompt": p} for i, p in enumerate(inline)]
    if path:
        if path.endswith(".jsonl"):
            from jaxserve.bench.traces import iter_jsonl

            for n, rec in iter_jsonl(path):
                if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
                    raise ValueError(f"{path}:{n}: each line must be an object with a string 'prompt'")
                mt = rec.get("max_tokens")
                if "max_tokens" in rec and (isinstance(mt, bool) or not isinstance(mt, int) or mt < 1):
                    raise ValueError(f"{path}:{n}: max_tokens={mt!r} must be an int >= 1")
                rec.setdefault("id", f"f{n}")
                rows.append(rec)
        else:
            text = Path(path).read_text(encoding="utf-8")
            rows += [{"id": f"f{n}", "prompt": l} for n, l in enumerate(text.splitlines(), 1) if l.strip()]
    if not rows:
        raise ValueError("no prompts: pass --prompt or --prompts_file")
    return rows


def percentile(xs: Sequence[float], q: float) -> float:
    import numpy as np
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if len(xs) else float("nan")


def summarize(outputs, engine, wall: float) -> dict[str, Any]:
    """Requests, tokens, throughput, TTFT/TPOT, steps, padding per bucket, compiles."""
    stats = engine.get_stats()
    ttft = [o.metrics.ttft for o in outputs if o.metrics.ttft is not None]
    tpot = [o.metrics.tpot for o in outputs if o.metrics.tpot is not None]
    out_tokens = sum(o.num_generated_tokens for o in outputs)
    # padded_tokens = T_pad * steps (every slot computed); padding = the slots beyond real tokens.
    buckets = dict(sorted(stats["bucket_stats"].items()))
    real = sum(s["real_tokens"] for s in buckets.values())
    slots = sum(s["padded_tokens"] for s in buckets.values())
    return {
        "requests": len(outputs), "output_tokens": out_tokens, "wall_s": wall,
        "output_tokens_per_s": out_tokens / wall if wall > 0 else float("nan"),
        "ttft_mean_s": sum(ttft) / len(ttft) if ttft else float("nan"),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "tpot_mean_s": sum(tpot) / len(tpot) if tpot else float("nan"),
        "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
        "steps": stats["num_steps"], "padding_fraction": 1 - real / slots if slots else 0.0,
        "buckets": buckets, "preemptions": stats["num_preemptions"],
        "warmup_programs": stats["warmup_programs"], "warmup_s": stats["warmup_seconds"],
        "compiles_after_warmup": stats["num_compiles_after_warmup"],
    }


def print_summary(s: dict[str, Any]) -> None:
    print("\n==== summary ====")
    print(f"requests {s['requests']}  output tokens {s['output_tokens']}  wall {s['wall_s']:.2f} s  "
          f"throughput {s['output_tokens_per_s']:.1f} tok/s")
    print(f"TTFT mean {s['ttft_mean_s']*1e3:.0f} ms  p50 {s['ttft_p50_s']*1e3:.0f} ms  "
          f"p99 {s['ttft_p99_s']*1e3:.0f} ms")
    print(f"TPOT mean {s['tpot_mean_s']*1e3:.1f} ms  p50 {s['tpot_p50_s']*1e3:.1f} ms  "
          f"p99 {s['tpot_p99_s']*1e3:.1f} ms")
    print(f"steps {s['steps']}  padding {100*s['padding_fraction']:.1f}%  preemptions "
          f"{s['preemptions']}  warm-up {s['warmup_programs']} programs in {s['warmup_s']:.1f} s  "
          f"compiles after warm-up {s['compiles_after_warmup']}")
    print("bucket   steps  real_tokens  computed_slots  padding")
    for b, st in s["buckets"].items():
        print(f"{b:>6} {st['steps']:>7} {st['real_tokens']:>12} {st['padded_tokens']:>15} "
              f"{100*st['padding_fraction']:>7.1f}%")


def cmd_generate() -> int:
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    rows = read_prompts(FLAGS.prompts_file, FLAGS.prompt)
    engine = build_engine()
    llm = LLM(engine=engine)
    base = SamplingParams(max_tokens=FLAGS.max_tokens, min_tokens=FLAGS.min_tokens,
                          temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p,
                          min_p=FLAGS.min_p, seed=FLAGS.seed, ignore_eos=FLAGS.ignore_eos,
                          stop=tuple(FLAGS.stop), n=FLAGS.n)
    params = [base.replace(max_tokens=int(r["max_tokens"])) if "max_tokens" in r else base for r in rows]
    prompts = [[{"role": "user", "content": r["prompt"]}] if FLAGS.chat else r["prompt"] for r in rows]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    if FLAGS.print_outputs:
        for r, o in zip(rows, outputs):
            for c in o.outputs:
                print(f"--- [{r['id']}#{c.index}] {r['prompt'][:60]!r} -> {len(c.token_ids)} tokens, "
                      f"finish={c.finish_reason}")
                print(c.text)
    s = summarize(outputs, engine, wall)
    print_summary(s)
    if FLAGS.output_json:
        Path(FLAGS.output_json).write_text(json.dumps({
            "summary": s, "outputs": [{"id": r["id"], "completions": [
                {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                for c in o.outputs]} for r, o in zip(rows, outputs)]}, indent=1, default=str))
    return 0


def engine_in_process(argv: Sequence[str]) -> Any:
    """`--engine_process`'s engine factory, run in the spawned engine process: parse the
    serve command's own flags there, then `build_engine` as in one process."""
    FLAGS(list(argv))  # a spawned process starts with no flags parsed
    configure_logging()
    return build_engine("progressive")


def cmd_serve() -> int:
    from jaxserve.server import serve

    if FLAGS.engine_process:
        from jaxserve.server.engine_process import factory_by_name

        factory = functools.partial(factory_by_name, "jaxserve.cli:engine_in_process",
                                    list(sys.argv))
    else:
        factory = lambda: build_engine("progressive")  # noqa: E731
    try:
        serve(factory, engine_process=FLAGS.engine_process, host=FLAGS.host, port=FLAGS.port,
              api_key=FLAGS.api_key, max_queued_requests=FLAGS.max_queued_requests,
              served_model_name=FLAGS.served_model_name,
              allowed_weights_dir=FLAGS.allowed_weights_dir,
              params_cache_dir=FLAGS.params_cache_dir or None,
              tool_call_parser=FLAGS.tool_call_parser, reasoning_parser=FLAGS.reasoning_parser,
              enable_auto_tool_choice=FLAGS.enable_auto_tool_choice)
    except KeyboardInterrupt:  # Ctrl-C: uvicorn has shut down already and re-raises SIGINT
        return 130  # the shell's status for SIGINT, without a traceback
    return 0


def cmd_bench(argv: Sequence[str]) -> int:
    if not argv or argv[0] not in ("buckets", "serve", "compare", "host"):
        raise app.UsageError("usage: jaxserve bench buckets|serve|compare|host [flags]")
    if argv[0] == "host":
        from jaxserve.bench.host import main as bench_main
    elif argv[0] == "buckets":
        from jaxserve.bench.buckets import main as bench_main
    elif argv[0] == "compare":
        from jaxserve.bench.compare import main as bench_main
    else:
        from jaxserve.bench.serving import main as bench_main
    return int(bench_main(list(argv[1:])) or 0)


def cmd_compile() -> int:
    """`jaxserve compile --target=...`: every warm-up program, compiled for that GPU on this
    machine (jaxserve.gpu.command); --dtype defaults to bfloat16 there."""
    from jaxserve.gpu import command

    if not FLAGS.target:
        raise app.UsageError("jaxserve compile needs --target (h200, h100 or a100)")
    return command.run(target=FLAGS.target, model=FLAGS.model, preset=FLAGS.model_config,
                       dtype=FLAGS.dtype,
                       engine_args=engine_args_from_flags(),
                       executable_cache_dir=FLAGS.executable_cache_dir or None,
                       json_path=FLAGS.json)


def configure_logging() -> None:
    """A quiet start: jaxserve's own phase lines (fetch, convert or cache hit, warm-up,
    ready) at INFO, every library (orbax, absl, jax) at WARNING. An explicit
    `--verbosity` / `-v` leaves absl's level for everything, library INFO logs included."""
    if FLAGS["verbosity"].present:
        level = logging.getLogger().level
        logging.getLogger("jaxserve").setLevel(min(level, logging.INFO))
        return
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("absl").setLevel(logging.WARNING)
    logging.getLogger("jaxserve").setLevel(logging.INFO)


def main(argv: Sequence[str]) -> int:
    configure_logging()
    if len(argv) < 2 or argv[1] not in ("generate", "serve", "bench", "compile"):
        raise app.UsageError("usage: jaxserve generate|serve|bench|compile [flags]")
    cmd = argv[1]
    if cmd == "compile":
        return cmd_compile()
    if cmd == "serve" and FLAGS.engine_process and FLAGS.num_processes > 1:  # before joining
        raise app.UsageError(f"--engine_process with --num_processes={FLAGS.num_processes} is "
                             "not supported (the leader steps its followers in-process)")
    if cmd in ("generate", "serve") and start_multihost():
        return 0  # a follower: its leader stopped
    try:
        if cmd == "generate":
            return cmd_generate()
        if cmd == "serve":
            return cmd_serve()
    except ValueError as e:  # bad input, named by the engine (a flag, a file): no traceback
        print(f"jaxserve {cmd}: error: {e}", file=sys.stderr)
        return 2
    return cmd_bench(argv[2:])


def run() -> None:
    """Console-script entry point.

    `jaxserve bench ...` bypasses absl: the bench tools parse their own flags
    with argparse, and absl would reject those as unknown flags.
    """
    if len(sys.argv) > 1 and sys.argv[1] == "bench":
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        try:
            sys.exit(cmd_bench(sys.argv[2:]))
        except app.UsageError as e:
            print(e, file=sys.stderr)
            sys.exit(2)
    app.run(main)


if __name__ == "__main__":
    sys.exit(run())
