"""Grammar-engine costs on this CPU: compile ms per spec, mask-fill µs per step.

Usage (from the repo root):
  PYTHONPATH=$PWD python scripts/bench_structured_output.py [--outlines]

Uses the real SmolLM2 tokenizer (V=49152, `jaxserve.checkpoint.loader.load_tokenizer`).
Compile = spec -> grammar -> matcher -> first mask (llguidance builds its lexer lazily,
so the first mask is part of what a request waits for). Mask = one step's fill of R
rows (R = 8, 32), each row a matcher part-way through its own output, sequential
(`fill_next_token_bitmask`) and with llguidance's thread pool (`LLExecutor`).
--outlines also times outlines-core (JSON schema / regex only; it has no CFG).
--sampler: the "no cost when unused" A/B in one process: the jitted sampler at V=49152
with no bitmask input ([S, 0], the branch point's program), with an all-ones bitmask
(every engine step now), and with one grammar row; plus the host cost of building the
sampling metadata with and without the bitmask.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

SPECS = {
    "json: flat object (3 props)": ("json", {
        "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                         "admin": {"type": "boolean"}},
        "required": ["name", "age", "admin"], "additionalProperties": False}),
    "json: nested + enum + array": ("json", {
        "type": "object", "properties": {
            "id": {"type": "integer", "minimum": 0},
            "status": {"enum": ["open", "closed", "pending"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
            "owner": {"type": "object", "properties": {"login": {"type": "string"},
                                                       "score": {"type": "number"}},
                      "required": ["login"]}},
        "required": ["id", "status", "tags", "owner"]}),
    "json: $defs + anyOf (person/org list)": ("json", {
        "$defs": {"person": {"type": "object", "properties": {"kind": {"const": "person"},
                                                              "first": {"type": "string"},
                                                              "last": {"type": "string"}},
                             "required": ["kind", "first", "last"]},
                  "org": {"type": "object", "properties": {"kind": {"const": "org"},
                                                           "name": {"type": "string"},
                                                           "employees": {"type": "integer"}},
                          "required": ["kind", "name"]}},
        "type": "object", "properties": {"parties": {"type": "array", "items": {
            "anyOf": [{"$ref": "#/$defs/person"}, {"$ref": "#/$defs/org"}]}}},
        "required": ["parties"]}),
    "json_object (any JSON object)": ("json_object", True),
    "regex: ISO date-time": ("regex", r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])T([01]\d|2[0-3]):[0-5]\d:[0-5]\dZ"),
    "choice: 4 strings": ("choice", ["positive", "negative", "neutral", "mixed feelings"]),
    "lark: arithmetic expressions": ("grammar", """
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""),
}


def _walk(matcher, rng, steps: int, V: int):
    """Advance a matcher `steps` tokens by random allowed non-EOS tokens (a stand-in decode);
    a matcher that reached its end is reset to the start (the row's next request)."""
    import llguidance.numpy as lnp

    bm = lnp.allocate_token_bitmask(1, V)
    for _ in range(steps):
        lnp.fill_next_token_bitmask(matcher, bm, 0)
        allowed = np.nonzero(np.unpackbits(bm.view(np.uint8), bitorder="little")[:V])[0]
        allowed = allowed[allowed != matcher_eos[0]]
        if len(allowed) == 0 or matcher.is_stopped():
            matcher.reset()
            continue
        matcher.consume_token(int(rng.choice(allowed)))


matcher_eos = [0]


def bench_sampler() -> None:
    import functools

    import jax
    import jax.numpy as jnp

    from jaxserve.sample.sampler import SamplingRow, make_sampling_metadata, sample
    from jaxserve.sampling_params import SamplingParams

    V = 49152
    for S in (8, 32):
        rng = np.random.default_rng(0)
        logits = jnp.asarray(rng.normal(size=(S, V)).astype(np.float32))
        rows = [SamplingRow(SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i), seed=i,
                            output_pos=0, prompt_token_ids=[1, 2, 3], output_token_ids=[])
                for i in range(S)]
        fn = jax.jit(functools.partial(sample, max_logprobs=0))
        md_none = make_sampling_metadata(rows, num_rows=S, max_model_len=512)
        md_ones = make_sampling_metadata(rows, num_rows=S, max_model_len=512, vocab_size=V)
        bm = md_ones.allowed_bitmask.copy()
        bm[0, 100:] = 0
        md_one = md_ones.__class__(**{**md_ones.__dict__, "allowed_bitmask": bm})
        variants = {"no bitmask input ([S,0], branch point)": md_none,
                    "all-ones bitmask (no grammar row)": md_ones,
                    "one grammar row": md_one}
        dev = {k: jax.device_put(v) for k, v in variants.items()}
        for v in dev.values():
            fn(logits, v).token_ids.block_until_ready()
        times = {k: [] for k in dev}
        for _ in range(30):  # interleaved: same load for every variant
            for k, v in dev.items():
                t0 = time.perf_counter()
                fn(logits, v).token_ids.block_until_ready()
                times[k].append(1e6 * (time.perf_counter() - t0))
        for k, t in times.items():
            print(f"sampler S={S:2d} V={V}: {k:40s} median {statistics.median(t):8.0f} us")
        for label, kw in (("host metadata without bitmask", {}),
                          ("host metadata with all-ones bitmask", {"vocab_size": V})):
            t = []
            for _ in range(200):
                t0 = time.perf_counter()
                make_sampling_metadata(rows, num_rows=S, max_model_len=512, **kw)
                t.append(1e6 * (time.perf_counter() - t0))
            print(f"host S={S:2d}: {label:40s} median {statistics.median(t):8.1f} us")
        for label, md in (("device_put of the metadata without bitmask", md_none),
                          ("device_put of the metadata with bitmask", md_ones)):
            t = []
            for _ in range(100):  # the step moves the whole StepBatch in one device_put
                t0 = time.perf_counter()
                jax.block_until_ready(jax.device_put(md))
                t.append(1e6 * (time.perf_counter() - t0))
            print(f"host S={S:2d}: {label:40s} median {statistics.median(t):8.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--outlines", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sampler", action="store_true")
    args = ap.parse_args()
    print("load:", os.getloadavg())
    if args.sampler:
        bench_sampler()
        print("load:", os.getloadavg())
        return
    from jaxserve.checkpoint.loader import load_tokenizer
    from jaxserve import structured_output as so

    tok = load_tokenizer()
    V = tok.vocab_size
    t0 = time.perf_counter()
    lt = so.ll_tokenizer(tok, V, [tok.eos_token_id])
    print(f"LLTokenizer for SmolLM2 (V={V}): {1e3 * (time.perf_counter() - t0):.0f} ms, once per engine")
    matcher_eos[0] = tok.eos_token_id
    import llguidance as llg
    import llguidance.numpy as lnp

    rows = []
    for name, (kind, spec) in SPECS.items():
        gs = so.GuidedSpec.make(kind, spec)
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            m = llg.LLMatcher(lt, so.to_llguidance(gs), log_level=0)
            assert not m.is_error(), m.get_error()
            bm = lnp.allocate_token_bitmask(1, V)
            lnp.fill_next_token_bitmask(m, bm, 0)
            times.append(1e3 * (time.perf_counter() - t0))
        rows.append((name, statistics.median(times), min(times)))
        print(f"compile {name:40s} median {statistics.median(times):7.2f} ms  min {min(times):7.2f} ms")
    rng = np.random.default_rng(0)
    ex = llg.LLExecutor()
    for kind_name in ("json: nested + enum + array", "json_object (any JSON object)",
                      "lark: arithmetic expressions"):
        kind, spec = SPECS[kind_name]
        base = llg.LLMatcher(lt, so.to_llguidance(so.GuidedSpec.make(kind, spec)), log_level=0)
        for R in (8, 32):
            ms = []
            for r in range(R):
                m = base.deep_copy()
                _walk(m, rng, int(rng.integers(1, 12)), V)
                ms.append(m)
            bm = lnp.allocate_token_bitmask(R, V)
            seq, par = [], []
            for rep in range(40):  # every timed fill is of a fresh state (one decode step)
                for m in ms:
                    _walk(m, rng, 1, V)
                t0 = time.perf_counter()
                if rep % 2 == 0:
                    for i, m in enumerate(ms):
                        lnp.fill_next_token_bitmask(m, bm, i)
                    seq.append(1e6 * (time.perf_counter() - t0))
                else:
                    lnp.fill_next_token_bitmask_par(ex, [(m, i) for i, m in enumerate(ms)], bm)
                    par.append(1e6 * (time.perf_counter() - t0))
            print(f"mask {kind_name:32s} R={R:2d}: sequential median {statistics.median(seq):8.0f} us"
                  f" ({statistics.median(seq) / R:6.0f} us/row, max {max(seq):6.0f}), LLExecutor "
                  f"median {statistics.median(par):8.0f} us")
    if args.outlines:
        import outlines_core as oc

        vocab: dict[str, list[int]] = {}
        for i in range(V):
            if i == tok.eos_token_id:
                continue
            vocab.setdefault(tok.decode([i], skip_special_tokens=False), []).append(i)
        t0 = time.perf_counter()
        voc = oc.Vocabulary(tok.eos_token_id, vocab)
        print(f"outlines-core Vocabulary: {1e3 * (time.perf_counter() - t0):.0f} ms")
        for name in ("json: flat object (3 props)", "json: nested + enum + array",
                     "regex: ISO date-time"):
            kind, spec = SPECS[name]
            regex = spec if kind == "regex" else oc.json_schema.build_regex_from_schema(json.dumps(spec))
            t0 = time.perf_counter()
            idx = oc.Index(regex, voc)
            print(f"outlines-core compile {name:34s} {1e3 * (time.perf_counter() - t0):9.1f} ms")
            g = oc.Guide(idx)
            bm = np.zeros((32, (V + 31) // 32), np.int32)
            t0 = time.perf_counter()
            for i in range(32):
                g.write_mask_into(bm[i].ctypes.data, bm.shape[1], 4)
            print(f"outlines-core mask R=32 (one state) {1e6 * (time.perf_counter() - t0):8.0f} us")
    print("load:", os.getloadavg())


if __name__ == "__main__":
    main()
