"""Where the resident memory of `jaxserve serve` goes: VmRSS / VmHWM per start-up phase.

    .venv/bin/python scripts/measure_rss.py [--max_num_seqs=16] [--num_kv_blocks=737] \
        [--requests=16 --max_tokens=64] [--executable_cache_dir=DIR] \
        [--quantization=auto] [--kv_cache_dtype=float16]

Runs the same start-up as `jaxserve serve` (`cli.build_engine`'s calls: compile
cache, `load_model` from the params cache, `LLMEngine` with its warm-up) in
this process, phase by phase, then serves a small burst of requests through
`engine.step()`. Before each phase the peak counter is reset (`echo 5 >
/proc/self/clear_refs`), so each line shows that phase's own peak (VmHWM)
next to the resident set after it (VmRSS, split into anonymous and
file-backed pages). tracemalloc would not see XLA's or the jax CPU client's
allocations; /proc does.

--steps_env prints the environment knobs in effect (MALLOC_ARENA_MAX,
XLA_FLAGS) so that runs can be compared.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

T0 = time.perf_counter()
SMAPS = False  # --smaps: the largest mappings after each phase


def status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process in MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) // 1024
    return out


def top_mappings(n: int = 12) -> str:
    """The n largest resident mappings of this process (smaps), grouped by path:
    'path rss MiB (anon MiB)'; anonymous heap and unnamed maps are '[anon]'."""
    rss: dict[str, list[int]] = {}
    name = "[anon]"
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):  # a mapping's header line
                name = head[5] if len(head) > 5 else "[anon]"
            elif head[0] in ("Rss:", "Anonymous:"):
                rss.setdefault(name, [0, 0])[head[0] == "Anonymous:"] += int(head[1])
    top = sorted(rss.items(), key=lambda kv: -kv[1][0])[:n]
    return "\n".join(f"    {v[0] // 1024:6d} MiB (anon {v[1] // 1024:5d})  {k}" for k, v in top)


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def phase(name: str, fn=None):
    """Run fn (if any) with the peak counter reset; print the phase's peak and the RSS after."""
    reset_peak()
    t = time.perf_counter()
    res = fn() if fn else None
    st = status()
    print(f"{name:34s} peak {st['VmHWM']:6d} MiB  after {st['VmRSS']:6d} MiB "
          f"(anon {st['RssAnon']:6d}, file {st['RssFile']:5d})  {time.perf_counter() - t:6.1f} s",
          flush=True)
    if SMAPS:
        print(top_mappings(), flush=True)
    return res


def release_host_memory() -> None:
    """What `jaxserve.cli.release_host_memory` does (repeated here so the script also
    measures a tree without it): gc, then glibc malloc_trim(0)."""
    import ctypes

    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max_num_seqs", type=int, default=16)
    ap.add_argument("--num_kv_blocks", type=int, default=737)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max_tokens", type=int, default=64)
    ap.add_argument("--quantization", default=None,
                    help="as `jaxserve serve --quantization` (default: full precision)")
    ap.add_argument("--kv_cache_dtype", default="auto",
                    help="as `jaxserve serve --kv_cache_dtype`: auto|float16|bfloat16|float32")
    ap.add_argument("--touch_kv", action="store_true",
                    help="after warm-up, write every page of the KV pool (zeros over zeros) "
                         "so the whole pool is resident, as llama.cpp's cleared KV buffer is; "
                         "without it only the pages requests wrote count")
    ap.add_argument("--compile_cache_dir", default="checkpoints/jax_compile_cache")
    ap.add_argument("--executable_cache_dir", default="checkpoints/executable_cache",
                    help="as `jaxserve serve` ('' off): a second run restores every program")
    ap.add_argument("--copy_params", action="store_true",
                    help="pass the params bare (the engine copies them) instead of as "
                         "OwnedHostParams (used in place on CPU), for an A/B")
    ap.add_argument("--per_program", action="store_true",
                    help="warm up one program at a time: each program's own peak and RSS")
    ap.add_argument("--keep_host_params", action="store_true",
                    help="the flow before the fix: the host tree stays alive through warm-up "
                         "and no malloc_trim between phases")
    ap.add_argument("--dynamic_mmap_threshold", action="store_true",
                    help="keep glibc's dynamic mmap threshold (the flow before "
                         "`jaxserve.worker.host_memory.fix_mmap_threshold`), for an A/B")
    ap.add_argument("--smaps", action="store_true",
                    help="after each phase, the largest resident mappings (smaps, by path)")
    args = ap.parse_args()
    global SMAPS
    SMAPS = args.smaps
    print(f"MALLOC_ARENA_MAX={os.environ.get('MALLOC_ARENA_MAX')} "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS')} load {os.getloadavg()[0]:.1f}", flush=True)
    phase("python + argparse")
    if not args.dynamic_mmap_threshold:  # as cli.build_engine
        from jaxserve.worker.host_memory import MMAP_THRESHOLD_BYTES, fix_mmap_threshold

        print(f"mmap threshold fixed at {MMAP_THRESHOLD_BYTES} bytes: {fix_mmap_threshold()}")

    def imports():
        import jax  # noqa: F401

        import jaxserve.engine.core  # noqa: F401
        import jaxserve.server  # noqa: F401
        jax.devices()
    phase("import jax/jaxserve + CPU client", imports)

    from jaxserve.checkpoint import load_model
    from jaxserve.checkpoint.default import resolve_model_path
    from jaxserve.engine import LLMEngine, make_engine_config
    from jaxserve.worker.compile import enable_compilation_cache
    from jaxserve.sampling_params import SamplingParams

    enable_compilation_cache(args.compile_cache_dir)
    loaded = phase("load_model (params cache)",
                   lambda: load_model(resolve_model_path(None), dtype="float32",
                                      quantization=args.quantization))
    cfg, params, tok = loaded
    del loaded
    config = make_engine_config(cfg, max_num_seqs=args.max_num_seqs,
                                num_kv_blocks=args.num_kv_blocks, block_size=16,
                                quantization=args.quantization or "auto",
                                kv_cache_dtype=args.kv_cache_dtype)
    holder = {"params": params}
    keep = params if args.keep_host_params else None
    del params
    def owned():  # as cli.build_engine: the engine may use the host leaves in place
        from jaxserve.distributed.tensor_parallel import OwnedHostParams, align_host_leaves

        return OwnedHostParams(align_host_leaves(holder.pop("params")))
    engine = phase("LLMEngine(warmup=False): params+KV",
                   lambda: LLMEngine(config, holder.pop("params") if args.copy_params else owned(),
                                     tok, model_name="m", warmup=False, progress=False,
                                     executable_cache_dir=args.executable_cache_dir or None))
    if not args.keep_host_params:
        phase("release_host_memory", release_host_memory)
    if args.per_program:  # the same programs warm-up builds, one phase each
        for key in engine.runner.warmup_keys():
            phase(f"  program {key}", lambda key=key: engine.runner.programs.build(key))
            release_host_memory()
    phase("warm-up (programs)", lambda: engine.runner.warmup(progress=False))
    if not args.keep_host_params:
        phase("release_host_memory", release_host_memory)
    del keep
    stats = engine.runner.stats()
    print(f"  programs built {stats.programs_built}, loaded {stats.programs_loaded}, restored "
          f"{stats.programs_restored}", flush=True)

    def touch_kv():  # the pool is zero pages the kernel maps lazily until written
        import ctypes

        import jax
        for a in jax.tree.leaves(engine.runner.kv_cache):
            ctypes.memset(a.unsafe_buffer_pointer(), 0, a.nbytes)
    if args.touch_kv:
        phase("touch every KV page", touch_kv)

    def serve():
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        for i in range(args.requests):
            engine.add_request(f"r{i}", "Tell me about the history of the number " + str(i),
                               sp)
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        return steps
    steps = phase(f"{args.requests} requests x {args.max_tokens} tok", serve)
    print(f"  {steps} steps", flush=True)

    phase("release_host_memory", release_host_memory)
    print(f"total {time.perf_counter() - T0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
