"""Structured output (issue 17 item 1): grammar-masked sampling on the tiny model.

Independent references: every constrained output is parsed by Python's `json` and
validated by the `jsonschema` package, regex outputs are `re.fullmatch`ed by Python's
`re`, Lark outputs are parsed by Python's `ast`, and the sampler's bitmask is checked
against a NumPy unpacking of the same bits. The tiny model (random weights) samples
with temperature 1 across many seeds, batched with unconstrained rows, whose tokens
must equal those they give alone.

The vocabulary is a character tokenizer over printable ASCII (98 ids) under a model
vocabulary of 101: ids 98..100 exist in the model only and must never be produced
for a grammar row.
"""

from __future__ import annotations

import ast
import functools
import json
import re
import string

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from conftest import tiny_params
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured_output import (GrammarCompiler, GuidedSpec, StructuredOutputsParams,
                                        bitmask_words, check_spec)
from jaxserve.validation import ValidationError

MODEL_VOCAB = 101  # > the tokenizer's 98 ids
SCHEMAS = [
    {"type": "object",
     "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                    "ok": {"type": "boolean"},
                    "tag": {"enum": ["red", "green", "blue"]}},
     "required": ["n", "ok", "tag"], "additionalProperties": False},
    {"type": "object",
     "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                    "tags": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                        "maximum": 9},
                             "minItems": 1, "maxItems": 3}},
     "required": ["name", "tags"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 4},
]
CHOICES = ["yes", "no", "maybe so", "{x}"]
REGEX = r"[a-c]{2,4}-[0-9]{1,3}(\.[xy])?"
LARK = """
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[1-9][0-9]?/
"""
GBNF = 'root ::= "id=" [0-9] [0-9]? ";"'


@functools.lru_cache(maxsize=None)
def ascii_tokenizer():
    """Character tokenizer: 0 <pad>, 1 <s>, 2 </s> (EOS), 3..97 printable ASCII (' '..'~')."""
    from conftest import char_tokenizer

    tok = char_tokenizer([chr(i) for i in range(32, 127)], unk=None)
    assert tok.vocab_size == 98, tok.vocab_size
    return tok


_ENGINES: dict = {}


def so_engine(**kw):
    """A warmed tiny engine (strict_compiles) over the ASCII tokenizer, cached per kw."""
    from jaxserve.engine import LLMEngine, make_engine_config

    key = tuple(sorted(kw.items()))
    if key not in _ENGINES:
        cfg, params = tiny_params(vocab_size=MODEL_VOCAB)
        args = dict(max_model_len=192, block_size=4, num_kv_blocks=400, max_num_seqs=8,
                    max_num_batched_tokens=64, attention_backend="xla", strict_compiles=True,
                    min_token_bucket=8, min_seq_bucket=8)  # buckets from 8: suite time
        args.update(kw)
        _ENGINES[key] = LLMEngine(make_engine_config(cfg, **args), params, ascii_tokenizer(),
                                  model_name="tiny", progress=False)
    eng = _ENGINES[key]
    assert not eng.has_unfinished_requests()
    return eng


def run_all(engine, reqs):
    """reqs: [(request_id, prompt, SamplingParams)] -> {request_id: final CompletionOutput}."""
    for rid, prompt, p in reqs:
        engine.add_request(rid, prompt, p)
    done = {}
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    assert not engine.has_unfinished_requests(), "engine did not finish"
    return done


def guided(seed, max_tokens=96, **so):
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**so))


def plain(seed, **kw):
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=12, **kw)


# ----------------------------------------------------------------- sampler
def _unpack(bitmask, V):
    return np.unpackbits(np.asarray(bitmask).view(np.uint8), axis=1, bitorder="little")[:, :V]


def test_sampler_bitmask_against_numpy():
    """Masked greedy = NumPy argmax over allowed ids; random rows draw only allowed ids;
    raw logprobs are log_softmax of the unmasked logits, processed ones of the masked
    (disallowed ids -inf); all-ones rows are untouched; a [S, 0] mask is no mask."""
    from jaxserve.sample.sampler import SamplingRow, make_sampling_metadata, sample

    S, V = 6, 101
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(S, V)).astype(np.float32) * 3
    rows = [SamplingRow(SamplingParams(temperature=t, seed=i), seed=i, output_pos=0,
                        prompt_token_ids=[1], output_token_ids=[])
            for i, t in enumerate([0.0, 0.0, 1.0, 1.0, 0.0, 1.0])]
    md = make_sampling_metadata(rows, num_rows=S, max_model_len=8, vocab_size=V)
    assert md.allowed_bitmask.shape == (S, bitmask_words(V)) and (md.allowed_bitmask == -1).all()
    bm = rng.integers(-2**31, 2**31, size=(S, bitmask_words(V)), dtype=np.int64).astype(np.int32)
    bm[4] = -1  # an unconstrained row in a masked batch
    bm[1] = 0
    bm[1, 2] = 1 << 5  # exactly one allowed id: 2 * 32 + 5 = 69
    md = md.__class__(**{**md.__dict__, "allowed_bitmask": bm})
    fn = jax.jit(functools.partial(sample, max_logprobs=3))
    allowed = _unpack(bm, V).astype(bool)
    masked = np.where(allowed, logits, -np.inf)
    ref_lp = logits - logits.max(1, keepdims=True)
    ref_lp -= np.log(np.exp(ref_lp).sum(1, keepdims=True))
    for pos in range(20):  # random rows at 20 output positions
        md = md.__class__(**{**md.__dict__, "output_pos": np.full(S, pos, np.int32)})
        out = jax.device_get(fn(jnp.asarray(logits), md))
        ids = out.token_ids
        assert all(allowed[i, ids[i]] for i in range(S)), (pos, ids)
        for i in (0, 1, 4):  # greedy rows
            assert ids[i] == int(np.argmax(masked[i])), (i, ids[i])
        assert ids[1] == 69
        np.testing.assert_allclose(out.logprobs, ref_lp[np.arange(S), ids], rtol=1e-5, atol=1e-5)
    assert ids[4] == int(np.argmax(logits[4]))  # an all-ones row is unmasked
    proc = jax.device_get(jax.jit(functools.partial(
        sample, max_logprobs=3, logprobs_mode="processed_logprobs"))(jnp.asarray(logits), md))
    assert proc.top_ids[1, 0] == 69 and proc.top_logprobs[1, 0] == 0.0
    assert np.isneginf(proc.top_logprobs[1, 1:]).all()  # the only allowed id has all the mass
    assert proc.token_ids[1] == 69
    md0 = make_sampling_metadata(rows, num_rows=S, max_model_len=8)  # no vocab_size: [S, 0]
    assert md0.allowed_bitmask.shape == (S, 0)
    out0 = jax.device_get(fn(jnp.asarray(logits), md0))
    assert out0.token_ids[0] == int(np.argmax(logits[0]))


# ----------------------------------------------------------------- validation
@pytest.mark.parametrize("kw, field, words", [
    ({"json": {"type": "nope"}}, "structured_outputs.json", "Invalid type"),
    ({"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
    ({"json": [1, 2]}, "structured_outputs.json", "JSON schema"),
    ({"regex": "a(b"}, "structured_outputs.regex", "unclosed group"),
    ({"regex": ""}, "structured_outputs.regex", "non-empty"),
    ({"choice": []}, "structured_outputs.choice", "non-empty list"),
    ({"choice": ["a", ""]}, "structured_outputs.choice[1]", "non-empty string"),
    ({"choice": ["a"] * 300}, "structured_outputs.choice", "at most 256"),
    ({"grammar": "start: missing_rule"}, "structured_outputs.grammar", "unknown name"),
    ({"grammar": "root ::= ("}, "structured_outputs.grammar", "invalid grammar"),
    ({"json_object": "yes"}, "structured_outputs.json_object", "must be true"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs", "exactly one"),
    ({}, "structured_outputs", "exactly one"),
])
def test_bad_structured_outputs_name_the_field(kw, field, words):
    with pytest.raises(ValidationError) as ei:
        SamplingParams(structured_outputs=kw)
    assert ei.value.field == field, str(ei.value)
    assert words in str(ei.value), str(ei.value)


def test_specs_canonical_and_cached():
    a = GuidedSpec.make("json", {"b": 1, "a": {"type": "integer"}})
    b = GuidedSpec.make("json", '{"a": {"type": "integer"}, "b": 1}')
    assert a == b and hash(a) == hash(b)
    p = SamplingParams(structured_outputs={"json": {"type": "integer"}})
    assert hash(p) == hash(SamplingParams(structured_outputs={"json": '{"type":"integer"}'}))
    comp = GrammarCompiler(ascii_tokenizer(), MODEL_VOCAB, (2,))
    f1 = comp.submit(a)
    f1.result(timeout=30)
    assert comp.submit(b) is f1 and comp.num_compiled == 1  # a repeated schema is free
    check_spec(GuidedSpec.make("regex", REGEX), "x")  # valid: no raise
    comp.close()


# ----------------------------------------------------------------- engine
def test_json_schemas_many_seeds_batched_with_unconstrained_rows():
    """12 seeds x 3 schemas, each batch mixed with unconstrained and logit_bias rows: every
    grammar output parses and validates; unconstrained rows equal their solo runs."""
    eng = so_engine()
    reqs, free = [], []
    for seed in range(12):
        for k, schema in enumerate(SCHEMAS):
            reqs.append((f"s{seed}-{k}", "Give JSON:", guided(seed, json=schema)))
        free.append((f"f{seed}", "Hello", plain(100 + seed)))
        free.append((f"b{seed}", "Hello", plain(200 + seed, logit_bias={40: 5.0})))
    done = run_all(eng, reqs + free)
    for rid, _, p in reqs:
        out = done[rid]
        schema = json.loads(p.structured_outputs.json)
        assert out.finish_reason == "stop", (rid, out.text, out.finish_reason, out.error)
        jsonschema.validate(json.loads(out.text), schema)
        assert max(out.token_ids) < 98, (rid, out.token_ids)  # never a model-only id
    solo = run_all(eng, free)
    for rid, _, _ in free:
        assert done[rid].token_ids == solo[rid].token_ids, rid
    assert eng.get_stats()["num_compiles_after_warmup"] == 0


def test_choice_regex_lark_gbnf_json_object():
    eng = so_engine()
    reqs = []
    for seed in range(10):
        reqs += [(f"c{seed}", "Pick:", guided(seed, choice=CHOICES)),
                 (f"r{seed}", "Code:", guided(seed, regex=REGEX)),
                 (f"l{seed}", "Sum:", guided(seed, grammar=LARK)),
                 (f"g{seed}", "Id:", guided(seed, grammar=GBNF)),
                 (f"o{seed}", "Obj:", guided(seed, max_tokens=150, json_object=True))]
    done = run_all(eng, reqs)
    seen = set()
    for seed in range(10):
        c = done[f"c{seed}"]
        assert c.text in CHOICES and c.finish_reason == "stop", (c.text, c.finish_reason)
        seen.add(c.text)
        r = done[f"r{seed}"]
        assert re.fullmatch(REGEX, r.text), r.text
        assert r.finish_reason == "stop"
        lark = done[f"l{seed}"]
        if lark.finish_reason == "stop":
            tree = ast.parse(lark.text, mode="eval")  # the grammar is a subset of Python's
            assert all(isinstance(n, (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub))
                       for n in ast.walk(tree)), lark.text
        else:  # a long expression may run out of tokens: still a prefix of the language
            assert lark.finish_reason == "length" and re.fullmatch(r"[0-9+\-()]+", lark.text)
        g = done[f"g{seed}"]
        assert re.fullmatch(r"id=[0-9][0-9]?;", g.text) and g.finish_reason == "stop", g.text
        o = done[f"o{seed}"]
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict), o.text
        else:
            assert o.finish_reason == "length" and o.text.startswith("{"), o.text
    assert len(seen) >= 2, seen  # sampling, not one fixed answer
    assert eng.get_stats()["num_compiles_after_warmup"] == 0


def test_llm_generate_takes_structured_outputs():
    from jaxserve.llm import LLM

    llm = LLM(engine=so_engine())
    outs = llm.generate(["a", "b"], [guided(1, choice=["alpha", "beta"]),
                                     SamplingParams(temperature=0, max_tokens=5)], use_tqdm=False)
    assert outs[0].outputs[0].text in ("alpha", "beta")
    assert outs[1].outputs[0].finish_reason == "length"


def test_dead_end_finishes_with_error_never_hangs():
    """regex 'a[bc]' with 'b' and 'c' as stop_token_ids and min_tokens=5: after 'a' the
    grammar allows only b and c, which min_tokens suppresses: no token can continue, so
    the request ends with "error" naming the dead end."""
    eng = so_engine()
    tok = ascii_tokenizer()
    b, c = tok.encode("b")[0], tok.encode("c")[0]
    p = SamplingParams(temperature=0, max_tokens=20, min_tokens=5, stop_token_ids=[b, c],
                       structured_outputs={"regex": "a[bc]"})
    done = run_all(eng, [("dead", "x", p), ("ok", "x", plain(3))])
    assert done["dead"].finish_reason == "error"
    assert "dead end" in done["dead"].error, done["dead"].error
    assert done["ok"].finish_reason == "length"


def test_grammar_end_finishes_with_stop_and_keeps_text():
    """A grammar that is complete ends the request at once ("stop"), even with ignore_eos,
    and its last token's text is part of the output."""
    eng = so_engine()
    p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                       structured_outputs={"choice": ["done!"]})
    out = run_all(eng, [("end", "x", p)])["end"]
    assert (out.text, out.finish_reason, len(out.token_ids)) == ("done!", "stop", 5)


def test_request_waits_for_its_grammar_without_blocking_the_batch_and_abort_leaks_nothing():
    import concurrent.futures

    eng = so_engine()
    real_submit = eng.grammars.submit
    gate: concurrent.futures.Future = concurrent.futures.Future()
    eng.grammars.submit = lambda spec: gate  # a compile that has not finished
    try:
        eng.add_request("held", "x", guided(1, choice=["hello"]))
        eng.add_request("held2", "x", guided(2, choice=["hello"]))
        eng.add_request("free", "x", plain(5))
        assert eng.scheduler.get_request("held") is None  # not handed to the scheduler
        free_blocks = eng.scheduler.kv_cache_manager.num_free_blocks
        outs = {}
        for _ in range(40):
            for o in eng.step():
                outs[o.request_id] = o
            if "free" in outs and outs["free"].finished:
                break
        assert outs["free"].finished and "held" not in outs  # the batch went on
        assert eng.abort("held2")  # abort while waiting
        assert "held2" not in eng._awaiting_grammar
        gate.set_result(real_submit(GuidedSpec.make("choice", ["hello"])).result(timeout=30))
        done = run_all(eng, [])
        assert not eng._awaiting_grammar and eng.outputs.num_live == 0
        assert eng.scheduler.kv_cache_manager.num_free_blocks >= free_blocks
    finally:
        eng.grammars.submit = real_submit
    # "held" finished in the run_all above (its output came through step()).
    assert eng.get_stats()["num_compiles_after_warmup"] == 0


def test_compile_failure_after_holding_fails_that_request_alone():
    import concurrent.futures

    eng = so_engine()
    real_submit = eng.grammars.submit
    gate: concurrent.futures.Future = concurrent.futures.Future()
    eng.grammars.submit = lambda spec: gate
    try:
        eng.add_request("bad", "x", guided(1, choice=["q"]))
    finally:
        eng.grammars.submit = real_submit
    gate.set_exception(ValidationError("choice", "q", "no token of this vocabulary starts it"))
    eng.add_request("ok", "x", plain(1))
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0]
    assert outs["bad"].finish_reason == "error" and "no token" in outs["bad"].error
    assert outs["ok"].finish_reason == "length"


def test_preemption_and_failed_steps_keep_the_matcher_in_step():
    """FakeRunner (obeys the mask): a preempted request (recompute) and a request whose
    step failed once both end with valid JSON: the matcher advanced exactly once per kept
    token (a double advance or a lost one would be a dead end or invalid JSON)."""
    from jaxserve.config import ModelConfig
    from jaxserve.engine import LLMEngine, make_engine_config
    from jaxserve.worker.fake_runner import FakeRunner, default_token

    model = ModelConfig.tiny(vocab_size=MODEL_VOCAB, max_position_embeddings=512)
    config = make_engine_config(model, max_model_len=128, block_size=4, num_kv_blocks=200,
                                max_num_seqs=4, max_num_batched_tokens=32)
    fails = {"n": 0}

    def fail_once(req):
        if req.request_id == "f" and req.num_output_tokens == 3 and fails["n"] == 0:
            fails["n"] += 1
            return True
        return False

    runner = FakeRunner.for_config(
        config, token_fn=lambda r, pos: default_token(r.request_id, pos, vocab_size=98),
        fail_step=fail_once)
    eng = LLMEngine(config, tokenizer=ascii_tokenizer(), runner=runner)
    schema = SCHEMAS[0]
    for rid in ("p", "f", "q"):
        eng.add_request(rid, "go", SamplingParams(max_tokens=80, structured_outputs={"json": schema}))
    outs, preempted = {}, False
    for _ in range(500):
        if not eng.has_unfinished_requests():
            break
        req = eng.scheduler.get_request("p")
        if not preempted and req is not None and req.num_output_tokens == 4:
            eng.scheduler.preempt("p")
            preempted = True
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0]
    assert preempted and fails["n"] == 1 and eng.scheduler.num_preemptions >= 1
    for rid in ("p", "f", "q"):
        assert outs[rid].finish_reason == "stop", (rid, outs[rid].text, outs[rid].error)
        jsonschema.validate(json.loads(outs[rid].text), schema)
