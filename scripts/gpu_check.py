"""GPU readiness check of the ragged paged attention kernels (run by scripts/gpu_check.sh).

On a GPU (H200 in mind; the lent machine's own python3 with jax 0.11.2, the project
source on PYTHONPATH, no project venv):
  1. checks the Pallas Mosaic GPU kernel, the Pallas Triton kernel and the xla path
     against the float64 reference on the case mix (decode-only, prefill-only, mixed,
     chunked prefill, 8k context; SmolLM2 heads 9/3 d64, GQA 4 and 8 at d128; bf16,
     and fp32 on the mixed batch) with NaN-poisoned unused KV slots and padding rows;
  2. runs the engine end to end (`LLM.generate`, two sequences batched, a chunked
     prefill, a preemption) on each backend, greedy tokens against CPU golden tokens
     (scripts/gpu_check.golden.json, `--make-golden`) of a tiny seeded random model;
  3. benchmarks each on 64 decodes at 2k context (+ one 512-token chunk): median over
     repeats of (N back-to-back calls) / N after warm-up, printed as achieved GB/s of
     the KV + Q bytes the step must read at least once, next to a measured device copy;
  4. writes one JSON (`--json`, default $OUT/gpu_check.json or ./gpu_check.json) and
     exits 1 on any mismatch (2 without a GPU).
`--dry-run` runs the same flow at tiny shapes in the Pallas interpreters on CPU (tested
by tests/attention/test_gpu_check.py). `--cpu-bench` prints the CPU numbers of
notes/attention.md: xla-path time per call, interpret-mode time, Triton lowering
time, and a 30-layer scan with the stacked cache as the carry vs as xs/ys.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxserve.attention import CommonAttentionMetadata  # noqa: E402
from jaxserve.attention.pallas_mosaic import PallasMosaicBackend  # noqa: E402
from jaxserve.attention.pallas_triton import PallasTritonBackend  # noqa: E402
from jaxserve.attention.reference import reference_ragged_paged_attention  # noqa: E402
from jaxserve.attention.xla import XlaBackend  # noqa: E402
from tests.attention.cases import random_batch  # noqa: E402

TOL = {"float32": 2e-5, "bfloat16": 2e-2}
# The Mosaic kernel's fp32 path is bf16x3 (~2^-16 relative), see its module doc.
MOSAIC_TOL = {"float32": 5e-5, "bfloat16": 2e-2}
BACKENDS = ("pallas_mosaic", "pallas_triton", "xla")
HEADS = {"smollm2": (9, 3, 64), "gqa4_d128": (32, 8, 128), "gqa8_d128": (32, 4, 128)}


def compare(name: str, got: np.ndarray, ref: np.ndarray, num_tokens: int, tol: float) -> bool:
    """Print and return whether got[:num_tokens] is finite and within tol of ref."""
    return _compare(name, got, ref, num_tokens, tol)["ok"]


def _compare(name, got, ref, num_tokens, tol) -> dict:
    got, ref = got[:num_tokens].astype(np.float64), ref[:num_tokens]
    finite = bool(np.isfinite(got).all())
    err = float(np.max(np.abs(got - ref) / (1.0 + np.abs(ref)))) if finite else float("nan")
    ok = finite and err <= tol
    print(f"  {name:44s} max_rel_err={err:.2e} tol={tol:.0e} {'OK' if ok else 'MISMATCH'}")
    return dict(max_rel_err=err, tol=tol, ok=ok)


def _error(label: str, e: Exception) -> str:
    msg = f"{type(e).__name__}: {e}"[:2000]
    print(f"  {label:44s} ERROR {msg[:300]}")
    return msg


def _backend(name, batch, interpret):
    """The backend object `name` (one of BACKENDS) for the batch's heads."""
    if name == "xla":
        return XlaBackend(block_size=batch.block_size)
    h, k = batch.q.shape[1], batch.k_cache.shape[2]
    kw = dict(block_size=batch.block_size, num_queries_per_kv=h // k, head_dim=batch.q.shape[2],
              interpret=interpret)
    if name == "pallas_mosaic":  # tiles per bucket: decode when T <= 2 S, else prefill
        return PallasMosaicBackend(dtype=batch.q.dtype.name, **kw)
    return PallasTritonBackend(**kw)


def _run(backend, batch, interpret):
    be = _backend(backend, batch, interpret)
    md = jax.device_put(be.prepare(CommonAttentionMetadata(**batch.common_kwargs())))
    fn = jax.jit(lambda q, kc, vc, md: be.attention(q, kc, vc, md, layer=None,
                                                    sm_scale=q.shape[-1] ** -0.5))
    args = (jnp.asarray(batch.q), jnp.asarray(batch.k_cache), jnp.asarray(batch.v_cache), md)
    return fn, args


def _shapes(mix, heads, *, block_size=16):
    """random_batch kwargs of a named (q_lens, seq_lens, T_pad, S_pad) mix and head config."""
    q_lens, seq_lens, t, s = mix
    h, k, d = HEADS[heads] if isinstance(heads, str) else heads
    pages = -(-max(seq_lens) // block_size)
    return dict(q_lens=q_lens, seq_lens=seq_lens, num_tokens=t, num_seqs=s,
                max_blocks_per_seq=pages, num_kv_blocks=s * pages + 1, block_size=block_size,
                num_heads=h, num_kv_heads=k, head_dim=d)


def check_correctness(checks, interpret: bool) -> list[dict]:
    """Each (name, random_batch kwargs, dtypes) against the float64 reference, every backend."""
    results = []
    for name, shapes, dtypes in checks:
        for dtype in dtypes:
            batch = random_batch(np.random.default_rng(0), dtype=jnp.dtype(dtype), **shapes)
            ref = reference_ragged_paged_attention(
                batch.q.astype(np.float32), batch.k_cache.astype(np.float32),
                batch.v_cache.astype(np.float32), batch.query_start_loc, batch.seq_lens,
                batch.block_table, batch.num_seqs, sm_scale=batch.q.shape[-1] ** -0.5)
            for backend in BACKENDS:
                tol = (MOSAIC_TOL if backend == "pallas_mosaic" else TOL)[dtype]
                label = f"{name} {dtype} {backend}"
                try:
                    fn, args = _run(backend, batch, interpret)
                    out = np.asarray(fn(*args).astype(jnp.float32))
                except Exception as e:  # noqa: BLE001 - one failing kernel must not hide the rest
                    results.append(dict(case=name, dtype=dtype, backend=backend, ok=False,
                                        error=_error(label, e)))
                    continue
                r = _compare(label, out, ref, batch.num_tokens, tol)
                results.append(dict(case=name, dtype=dtype, backend=backend, **r))
    return results


# The engine check's model: tiny random fp32 weights drawn from a NumPy seed (the same
# bits on every machine, nothing to carry: cheaper than a cut-down SmolLM2 file), with
# head_dim 64 so that both Pallas kernels tile it; the engine settings batch two
# sequences, chunk the 19-token prompt (16-token budget) and preempt (5 usable pages
# for two sequences needing 7), as tests/attention/test_engine_pallas.py does in interpret mode.
ENGINE_MODEL = dict(head_dim=64, num_attention_heads=3, num_key_value_heads=1)
ENGINE_ARGS = dict(max_model_len=64, block_size=8, num_kv_blocks=6, max_num_seqs=2,
                   max_num_batched_tokens=16, token_buckets=(16,), seq_buckets=(2,),
                   enable_prefix_caching=False)
ENGINE_PROMPT_LENS, ENGINE_MAX_TOKENS = (13, 19, 6), 10
GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_check.golden.json")


def engine_model(seed: int = 7, std: float = 0.3):
    """(ModelConfig, canonical fp32 params) of the engine check; norms 1, the rest N(0, std).

    Seed and std chosen (of 16 tried) for a wide greedy margin: the smallest top-1 -
    top-2 logit gap along the golden tokens is `min_logit_margin` in the golden file
    (0.057), far above fp32 rounding differences between machines. std 0.3, not
    larger: at 0.5 the Mosaic kernel's bf16x3 fp32 products move logits by 3e-4,
    past tests/attention/test_engine_pallas.py's 1e-4.
    """
    from jaxserve.config import ModelConfig
    from jaxserve.model.llama import param_shapes

    cfg, rng = ModelConfig.tiny(**ENGINE_MODEL), np.random.default_rng(seed)

    def leaf(name, shape):
        if name.endswith("norm"):
            return np.ones(shape, np.float32)
        return (std * rng.standard_normal(shape)).astype(np.float32)

    return cfg, {k: {n: leaf(n, s) for n, s in v.items()} if isinstance(v, dict) else leaf(k, v)
                 for k, v in param_shapes(cfg).items()}


def engine_prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [[int(x) for x in rng.integers(3, 66, size=n)] for n in ENGINE_PROMPT_LENS]


def engine_greedy(backend: str, interpret: bool) -> tuple[list[list[int]], object]:
    """(greedy ids per prompt, the `LLMEngine`) of `LLM.generate` on `backend` (fp32)."""
    from jaxserve.engine import LLMEngine, make_engine_config
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    cfg, params = engine_model()
    config = make_engine_config(cfg, attention_backend=backend,
                                attention_interpret=interpret and backend != "xla", **ENGINE_ARGS)
    engine = LLMEngine(config, params, None, model_name="gpu_check", progress=False)
    sp = SamplingParams(temperature=0.0, max_tokens=ENGINE_MAX_TOKENS, ignore_eos=True)
    outs = LLM(engine=engine).generate(engine_prompts(), sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], engine


def make_golden(path: str = GOLDEN) -> dict:
    """CPU golden tokens of the engine check (xla backend), checked against the unpaged
    reference forward; also the smallest top-1 - top-2 logit gap along them."""
    from jaxserve.model.llama import reference_logits

    tokens, engine = engine_greedy("xla", interpret=False)
    cfg, params = engine_model()
    margins = []
    for prompt, out in zip(engine_prompts(), tokens):
        logits = reference_logits(cfg, params, np.array(prompt + out))[len(prompt) - 1:-1]
        if list(logits.argmax(-1)) != out:
            raise AssertionError(f"engine tokens {out} differ from the reference's")
        top2 = np.sort(logits, axis=-1)[:, -2:]
        margins.append(float((top2[:, 1] - top2[:, 0]).min()))
    golden = dict(tokens=tokens, preemptions=engine.get_stats()["num_preemptions"],
                  min_logit_margin=min(margins),
                  made_with=f"jax {jax.__version__} {jax.default_backend()}, xla backend")
    with open(path, "w") as f:
        json.dump(golden, f, indent=1)
    return golden


def check_engine(backends, interpret: bool) -> list[dict]:
    """The engine end to end on each backend, greedy tokens against the CPU goldens."""
    with open(GOLDEN) as f:
        want = json.load(f)["tokens"]
    rows = []
    for backend in backends:
        label = f"engine {backend} greedy == CPU golden"
        try:  # fp32 matmuls in full fp32 (no TF32) on the GPU, as on the CPU
            with jax.default_matmul_precision("highest"):
                got, engine = engine_greedy(backend, interpret)
        except Exception as e:  # noqa: BLE001
            rows.append(dict(backend=backend, ok=False, error=_error(label, e)))
            continue
        preempted = engine.get_stats()["num_preemptions"]
        ok = got == want and preempted > 0 and engine.runner.backend.name == backend
        print(f"  {label:44s} preemptions={preempted} {'OK' if ok else 'MISMATCH'}")
        rows.append(dict(backend=backend, ok=ok, tokens=got, preemptions=preempted))
    return rows


def time_ms(fn, args, iters: int, repeats: int = 5) -> float:
    """Median over `repeats` of the mean time of `iters` back-to-back calls (ms).

    Back-to-back async dispatch keeps the device busy, so this is the kernel time,
    not the host's launch latency.
    """
    jax.block_until_ready(fn(*args))  # compile + warm-up
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / iters)
    return float(np.median(ts)) * 1e3


def median_ms(fn, args, iters: int) -> float:
    """Median of `iters` blocking calls after warm-up (ms); used by --cpu-bench."""
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e3


def copy_bandwidth(nbytes: int, iters: int, repeats: int) -> float:
    """Bytes/s of a device copy (read + write) of an nbytes buffer."""
    x = jnp.zeros(nbytes // 4, jnp.float32)
    ms = time_ms(jax.jit(lambda x: x + 1.0), (x,), iters, repeats)
    return 2 * nbytes / (ms * 1e-3)


def bench(cases: dict, interpret: bool, iters: int, repeats: int, copy_bytes: int) -> dict:
    """Time every backend on each case (bf16); GB/s of the KV + Q bytes read at least once."""
    bw = copy_bandwidth(copy_bytes, iters, repeats)
    print(f"  device copy bandwidth: {bw / 1e9:.1f} GB/s")
    rows = []
    for name, shapes in cases.items():
        batch = random_batch(np.random.default_rng(1), dtype=jnp.bfloat16, poison=False, **shapes)
        kv_row = batch.k_cache[0, 0].size * 2  # K * D elements of K and V per key, bf16
        nbytes = 2 * int(batch.seq_lens.sum()) * kv_row + batch.q[:batch.num_tokens].size * 2
        for backend in BACKENDS:
            try:
                fn, args = _run(backend, batch, interpret)
                ms = time_ms(fn, args, iters, repeats)
            except Exception as e:  # noqa: BLE001
                rows.append(dict(case=name, backend=backend, error=_error(name, e)))
                continue
            gbps = nbytes / (ms * 1e-3) / 1e9
            print(f"  {name:28s} {backend:14s} {ms:9.3f} ms  KV+Q {nbytes / 1e6:8.1f} MB"
                  f"  {gbps:8.1f} GB/s = {gbps * 1e9 / bw:6.1%} of copy")
            rows.append(dict(case=name, backend=backend, ms=ms, bytes=nbytes, GBps=gbps,
                             frac_of_copy=gbps * 1e9 / bw))
    return dict(copy_GBps=bw / 1e9, results=rows)


def lower_plan(checks) -> bool:
    """CPU pre-flight: lower both Pallas backends for CUDA at every GPU-plan shape and dtype.

    The Triton lowering reads the compute capability off an abstract H200 device
    (see tests/attention/test_lowering.py); Mosaic's lowering needs no device.
    """
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType
    dev = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=dev)
    ok = True
    for name, shapes, dtypes in checks:
        for dtype in dtypes:
            batch = random_batch(np.random.default_rng(0), dtype=jnp.dtype(dtype), poison=False,
                                 **shapes)
            for backend in ("pallas_mosaic", "pallas_triton"):
                t0 = time.perf_counter()
                try:
                    fn, args = _run(backend, batch, False)
                    specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
                    with jax.sharding.use_abstract_mesh(mesh):
                        text = fn.trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
                    good = ("mosaic_gpu_v2" if backend == "pallas_mosaic" else "triton") in text
                except Exception as e:  # noqa: BLE001
                    good = False
                    _error(f"lower {name} {dtype} {backend}", e)
                ok &= good
                print(f"  lower {name} {dtype} {backend:14s} {time.perf_counter() - t0:5.1f} s "
                      f"{'OK' if good else 'FAILED'}")
    return ok


def _scan_steps(be, n_layers, k):
    """Two jitted 30-layer steps: cache as the scan carry (in place) vs as xs -> ys."""
    from jax import lax

    def carry_step(kc, vc, x, md):
        def body(c, li):
            kc, vc = be.write_kv(*c, x[:, :k], x[:, k:2 * k], md, layer=li)
            return (kc, vc), be.attention(x, kc, vc, md, layer=li, sm_scale=0.125)[0, 0, 0]
        (kc, vc), o = lax.scan(body, (kc, vc), jnp.arange(n_layers, dtype=jnp.int32))
        return o, kc, vc

    def naive_step(kc, vc, x, md):
        def body(_, kv):
            kl, vl = be.write_kv(*kv, x[:, :k], x[:, k:2 * k], md, layer=None)
            return None, (be.attention(x, kl, vl, md, layer=None, sm_scale=0.125)[0, 0, 0], kl, vl)
        _, (o, kc, vc) = lax.scan(body, None, (kc, vc))
        return o, kc, vc

    return {name: jax.jit(f, donate_argnums=(0, 1))
            for name, f in (("carry", carry_step), ("xs/ys", naive_step))}


def cpu_bench(iters: int = 20) -> None:
    h, k, d, bs = 9, 3, 64, 16
    common = dict(max_blocks_per_seq=128, block_size=bs, num_heads=h, num_kv_heads=k,
                  head_dim=d, poison=False)
    cases = {"decode 32x512": dict(q_lens=[1] * 32, seq_lens=[512] * 32, num_tokens=32,
                                   num_seqs=32, num_kv_blocks=1100),
             "mixed 31x512+225@1024": dict(q_lens=[1] * 31 + [225], seq_lens=[512] * 31 + [1024],
                                           num_tokens=256, num_seqs=32, num_kv_blocks=1100)}
    for name, c in cases.items():
        batch = random_batch(np.random.default_rng(0), **c, **common)
        fn, args = _run("xla", batch, False)
        print(f"  xla {name:24s} {median_ms(fn, args, iters):8.2f} ms/call (median)")
    small = random_batch(np.random.default_rng(0), q_lens=[1] * 4 + [24], seq_lens=[100] * 4 + [24],
                         num_tokens=32, num_seqs=8, max_blocks_per_seq=8, num_kv_blocks=40,
                         block_size=16, num_heads=6, num_kv_heads=2, head_dim=16)
    fn, args = _run("pallas_triton", small, True)
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    print(f"  pallas interpret T=32 S=8: first call {time.perf_counter() - t0:.2f} s, "
          f"then {median_ms(fn, args, iters):.2f} ms/call")
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "tests" / "pallas" / "test_lowering.py"
    spec = importlib.util.spec_from_file_location("lowering", path)
    low = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(low)
    t0 = time.perf_counter()
    low._lower_step(t=256, s=256, h=h, k=k, d=d, dtype=jnp.bfloat16)
    print(f"  Triton lowering, 2-layer scan of write_kv+attention: "
          f"{time.perf_counter() - t0:.2f} s")
    n_layers = 30
    batch = random_batch(np.random.default_rng(0), **cases["decode 32x512"], **common)
    be = XlaBackend(block_size=bs)
    md = jax.device_put(be.prepare(CommonAttentionMetadata(**batch.common_kwargs())))
    x = jnp.asarray(batch.q)
    pool = np.random.default_rng(1).standard_normal((n_layers, 1100, bs, k, d)).astype(np.float32)
    print(f"  30-layer scan, decode 32x512, KV pool {2 * pool.nbytes / 1e6:.0f} MB:")
    for name, step in _scan_steps(be, n_layers, k).items():
        kc, vc = jnp.asarray(pool), jnp.asarray(pool)
        o, kc, vc = step(kc, vc, x, md)
        ts = []
        for _ in range(max(3, iters // 4)):
            t0 = time.perf_counter()
            o, kc, vc = step(kc, vc, x, md)
            jax.block_until_ready(o)
            ts.append(time.perf_counter() - t0)
        print(f"    cache as {name:6s}: {np.median(ts) * 1e3:8.1f} ms/step (median), "
              f"{np.min(ts) * 1e3:8.1f} min")


def _plan(dry_run: bool) -> dict:
    """Correctness checks, bench cases and timing sizes for a dry run or the GPU run."""
    if dry_run:
        small = (4, 1, 64)  # d >= 64 and M = 64 rows for the Mosaic kernel
        mixed = ([1, 20, 1, 5], [50, 20, 16, 37], 32, 8)
        return dict(checks=[("mixed", _shapes(mixed, small), ("bfloat16", "float32"))],
                    bench={"decode+chunk": _shapes(([1] * 4 + [24], [100] * 4 + [24], 32, 8),
                                                   small)},
                    interpret=True, iters=1, repeats=1, copy_bytes=1 << 20,
                    # the Pallas engines in interpret mode: tests/attention/test_engine_pallas.py (2 min)
                    engine_backends=("xla",))
    b = 16
    mixes = {
        "decode_only": ([1] * 32, [1 + 64 * i for i in range(32)], 32, 32),
        "prefill_only": ([300, 77, 128], [300, 77, 128], 512, 4),
        "mixed": ([1] * 60 + [300, 77], [1 + 33 * i for i in range(60)] + [300, 900], 512, 64),
        "chunked": ([512, 7, 1], [2048, 1007, 3 * b], 528, 4),
        "long_8k": ([1, 1, 32], [8192, 8000 + 3, 8192], 48, 4),
    }
    checks = [(f"{mix} {heads}", _shapes(m, heads, block_size=b),
               ("bfloat16", "float32") if mix == "mixed" else ("bfloat16",))
              for heads in HEADS for mix, m in mixes.items()]
    decode = ([1] * 64, [2048] * 64, 64, 64)
    chunk = ([1] * 64 + [512], [2048] * 65, 576, 65)
    bench_cases = {"64x2k decode gqa4_d128": _shapes(decode, "gqa4_d128"),
                   "64x2k+512 chunk gqa4_d128": _shapes(chunk, "gqa4_d128"),
                   "64x2k+512 chunk smollm2": _shapes(chunk, "smollm2")}
    return dict(checks=checks, bench=bench_cases, interpret=False, iters=20, repeats=5,
                copy_bytes=1 << 30, engine_backends=BACKENDS)


def _write(path: str, report: dict, t0: float) -> None:
    report["seconds"] = time.perf_counter() - t0
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def _json_path(arg: str | None) -> str:
    return arg or os.path.join(os.environ.get("OUT", "."), "gpu_check.json")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes, Pallas interpreters, runs on CPU")
    ap.add_argument("--cpu-bench", action="store_true",
                    help="print the CPU numbers of notes/attention.md and exit")
    ap.add_argument("--lower-only", action="store_true",
                    help="CPU pre-flight: lower the GPU plan's kernels for cuda and exit")
    ap.add_argument("--make-golden", action="store_true",
                    help=f"CPU: write the engine check's golden tokens to {GOLDEN} and exit")
    ap.add_argument("--json", help="where to write the results (default $OUT/gpu_check.json)")
    args = ap.parse_args(argv)
    print(f"jax {jax.__version__}, devices: {jax.devices()}")
    if args.cpu_bench:
        cpu_bench()
        return 0
    if args.lower_only:
        return 0 if lower_plan(_plan(dry_run=False)["checks"]) else 1
    if args.make_golden:
        print(json.dumps(make_golden()))
        return 0
    if not args.dry_run and jax.default_backend() != "gpu":
        print("no GPU found; use --dry-run on CPU", file=sys.stderr)
        return 2
    plan = _plan(args.dry_run)
    t0 = time.perf_counter()
    print("1. correctness vs float64 reference (NaN-poisoned padding):")
    checks = check_correctness(plan["checks"], plan["interpret"])
    ok = all(c["ok"] for c in checks)
    report = dict(jax=jax.__version__, devices=[str(d) for d in jax.devices()],
                  dry_run=args.dry_run, checks=checks, bench=None, ok=ok)
    path = _json_path(args.json)
    _write(path, report, t0)  # kept if a later part runs past the time limit
    print("2. the engine end to end (LLM.generate, batching + chunked prefill + preemption):")
    report["engine"] = check_engine(plan["engine_backends"], plan["interpret"])
    ok &= all(r["ok"] for r in report["engine"])
    report["ok"] = ok
    _write(path, report, t0)
    print("3. kernel benchmark (bf16; KV+Q bytes read at least once):")
    report["bench"] = bench(plan["bench"], plan["interpret"], plan["iters"], plan["repeats"],
                            plan["copy_bytes"])
    _write(path, report, t0)
    print(f"wrote {path}")
    print("PASS" if ok else "FAIL: mismatch")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
