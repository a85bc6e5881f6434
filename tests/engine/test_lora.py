"""Multi-LoRA serving on the tiny model (issue 27): each request's tokens and logprobs
equal those of a model whose weights were merged by hand (W + scale * A @ B, float64),
any mix of adapters in one batch, adapter churn with 0 compiles, LRU slots, update_lora
and the prefix cache keyed on the adapter's version."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from conftest import drain, tiny_engine, tiny_params
from lora.helpers import merged_params, random_adapter, to_peft_state_dict

from jaxserve import LoRARequest
from jaxserve.model.llama import reference_logits
from jaxserve.sampling_params import SamplingParams

PROMPT = [1, 5, 6, 7, 8, 9, 10, 11, 12, 13]  # 2 full blocks of 4: prefix-cache candidates
N_OUT = 8
GREEDY = SamplingParams(max_tokens=N_OUT, temperature=0.0, ignore_eos=True)


def _engine():
    return tiny_engine(max_loras=2, max_lora_rank=16)


def _reference(params, prompt, tokens) -> np.ndarray:
    """Logprob of each of `tokens` after `prompt` under `params` (teacher forced, f32)."""
    ids = np.array(list(prompt) + list(tokens))
    logits = reference_logits(tiny_params()[0], params, ids).astype(np.float64)
    lp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    rows = lp[len(prompt) - 1:-1]
    assert list(rows.argmax(-1)) == list(tokens), "greedy tokens differ from the merged model's"
    return rows[np.arange(len(tokens)), tokens]


def _run(eng, reqs) -> dict:
    """reqs: {request_id: (prompt, LoRARequest | None)} -> {id: (tokens, logprobs)}."""
    for rid, (prompt, lr) in reqs.items():
        eng.add_request(rid, prompt, GREEDY, lora_request=lr)
    outs = drain(eng)
    return {rid: (list(outs[rid].outputs[0].token_ids),
                  np.array(outs[rid].outputs[0].token_logprobs)) for rid in reqs}


def _cleanup(eng):
    for lr in eng.lora.list_loras():
        eng.lora.remove_lora(lr.lora_int_id)


@pytest.mark.parametrize("rank", [1, 8, 16])
def test_lora_equals_hand_merged_weights(rank):
    eng = _engine()
    cfg, params = tiny_params()
    tree = random_adapter(cfg, rank, seed=rank)
    try:
        got = _run(eng, {"a": (PROMPT, LoRARequest("r", 7, tree)), "b": (PROMPT, None)})
        toks, lps = got["a"]
        np.testing.assert_allclose(lps, _reference(merged_params(params, tree), PROMPT, toks),
                                   atol=1e-4)
        base_toks, base_lps = got["b"]  # the base row of the same batch: the base model
        np.testing.assert_allclose(base_lps, _reference(params, PROMPT, base_toks), atol=1e-4)
        assert toks != base_toks  # the adapter changes the output
    finally:
        _cleanup(eng)


def test_mixed_batch_rows_equal_their_solo_runs():
    eng = _engine()
    cfg, _ = tiny_params()
    x = LoRARequest("x", 1, random_adapter(cfg, 4, seed=11))
    y = LoRARequest("y", 2, random_adapter(cfg, 16, seed=12, targets=["wq", "w_down"]))
    p2 = [1, 20, 21, 22, 23, 24, 25]
    try:
        solo = {}
        for rid, (p, lr) in {"x": (PROMPT, x), "y": (p2, y), "b": (p2, None)}.items():
            solo.update(_run(eng, {rid: (p, lr)}))
        mixed = _run(eng, {"x": (PROMPT, x), "y": (p2, y), "b": (p2, None),
                           "x2": (p2, x)})
        for rid in ("x", "y", "b"):
            assert mixed[rid][0] == solo[rid][0], rid
            np.testing.assert_allclose(mixed[rid][1], solo[rid][1], atol=1e-5)
        assert len({tuple(mixed[r][0]) for r in ("y", "b", "x2")}) == 3  # same prompt, 3 models
    finally:
        _cleanup(eng)


def _compiles(eng) -> tuple:
    st = eng.runner.stats()
    return st.programs_built, st.programs_loaded, st.programs_restored, st.late_compiles


class _JaxCompiles:
    """Counts XLA backend compiles in the process (jax.monitoring) while active."""

    def __init__(self):
        self.n = 0
        self._on = False
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event, duration, **kw):
        if self._on and event == "/jax/core/compile/backend_compile_duration":
            self.n += 1


def test_adapter_churn_while_requests_run_compiles_nothing():
    eng = _engine()
    cfg, params = tiny_params()
    trees = [random_adapter(cfg, r, seed=30 + r) for r in (2, 16, 5)]
    reqs = [LoRARequest(f"c{i}", 10 + i, t) for i, t in enumerate(trees)]
    try:
        _run(eng, {"warm": (PROMPT, reqs[0])})  # the first LoRA step's host paths
        counter = _JaxCompiles()
        before = _compiles(eng)
        counter._on = True
        long = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
        eng.add_request("run0", PROMPT, long, lora_request=reqs[0])
        eng.add_request("base", PROMPT, long)
        for _ in range(3):
            eng.step()
        eng.lora.add_lora(reqs[1])  # add while running
        eng.add_request("run1", PROMPT, GREEDY, lora_request=reqs[1])
        for _ in range(2):  # run1 has run (async scheduling admits it one step() later)
            eng.step()
        assert eng.scheduler.get_request("run1").num_output_tokens >= 1
        eng.lora.update_lora("c1", to_peft_state_dict(trees[2] | {"scaling": 1.0}),
                             in_flight="abort")  # replace: run1 fails, the others go on
        eng.lora.add_lora(reqs[2])
        outs = drain(eng)
        eng.lora.remove_lora(reqs[2].lora_int_id)  # remove (not in use)
        counter._on = False
        assert counter.n == 0 and _compiles(eng) == before
        assert outs["run1"].outputs[0].finish_reason == "error"
        assert "version 0 to 1" in outs["run1"].outputs[0].error
        # the rows beside the churn: exactly the merged / base models
        toks = outs["run0"].outputs[0].token_ids
        np.testing.assert_allclose(outs["run0"].outputs[0].token_logprobs,
                                   _reference(merged_params(params, trees[0]), PROMPT, toks),
                                   atol=1e-4)
        bt = outs["base"].outputs[0].token_ids
        np.testing.assert_allclose(outs["base"].outputs[0].token_logprobs,
                                   _reference(params, PROMPT, bt), atol=1e-4)
    finally:
        _cleanup(eng)


def test_update_lora_serves_the_new_weights_and_never_the_old_cache():
    """After update_lora (a PEFT flat state dict), the same prompt, whose blocks the prefix
    cache holds from version 0, gives exactly the model merged with the new weights."""
    eng = _engine()
    cfg, params = tiny_params()
    t0, t1 = random_adapter(cfg, 8, seed=41), random_adapter(cfg, 8, seed=42)
    lr = LoRARequest("rl", 3, t0)
    try:
        v0 = _run(eng, {"v0": (PROMPT, lr)})["v0"]
        np.testing.assert_allclose(v0[1], _reference(merged_params(params, t0), PROMPT, v0[0]),
                                   atol=1e-4)
        assert eng.lora.update_lora("rl", to_peft_state_dict(t1)) == 1
        v1 = _run(eng, {"v1": (PROMPT, lr)})["v1"]
        # the state dict carries no scale: the adapter's own (2.0) applies
        np.testing.assert_allclose(v1[1], _reference(merged_params(params, t1), PROMPT, v1[0]),
                                   atol=1e-4)
        assert v1[0] != v0[0]
    finally:
        _cleanup(eng)


def test_lru_never_evicts_an_adapter_in_use():
    eng = _engine()  # 2 slots
    cfg, params = tiny_params()
    trees = {i: random_adapter(cfg, 4, seed=50 + i) for i in range(3)}
    lrs = {i: LoRARequest(f"l{i}", 20 + i, trees[i]) for i in range(3)}
    long = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    try:
        eng.add_request("a", PROMPT, long, lora_request=lrs[0])
        eng.add_request("b", PROMPT, GREEDY, lora_request=lrs[1])
        slot_a = eng.lora.slots.slot_of(20)
        eng.add_request("c", PROMPT, GREEDY, lora_request=lrs[2])  # every slot pinned: waits
        assert eng.lora.num_waiting() == 1 and eng.lora.slots.slot_of(22) == 0
        with pytest.raises(ValueError, match="in use by a live request"):
            eng.lora.remove_lora(22)  # a waiting request uses it too
        while eng.scheduler.get_request("c") is None:
            assert eng.lora.slots.slot_of(21) or eng.scheduler.get_request("b") is None
            eng.step()
        assert eng.scheduler.get_request("b") is None  # c took b's slot once b ended
        assert eng.lora.slots.slot_of(20) == slot_a and eng.lora.slots.slot_of(21) == 0
        with pytest.raises(ValueError, match="in use by a live request"):
            eng.lora.remove_lora(20)
        outs = drain(eng)
        for rid, i in (("a", 0), ("c", 2)):
            o = outs[rid].outputs[0]
            np.testing.assert_allclose(
                o.token_logprobs, _reference(merged_params(params, trees[i]), PROMPT,
                                             o.token_ids), atol=1e-4)
    finally:
        _cleanup(eng)


def _one_slot_engine():
    return tiny_engine(max_loras=1, max_lora_rank=16)


def test_requests_over_max_loras_wait_and_equal_their_solo_runs():
    """max_loras=1, two adapters, all added at once: the second adapter's requests wait
    (first come first served) until the first's end, then run; every row equals its solo
    run, with 0 compiles."""
    eng = _one_slot_engine()
    cfg, _ = tiny_params()
    x = LoRARequest("wx", 31, random_adapter(cfg, 4, seed=71))
    y = LoRARequest("wy", 32, random_adapter(cfg, 16, seed=72, targets=["wv", "w_up"]))
    p2 = [1, 30, 31, 32, 33, 34]
    reqs = {"x1": (PROMPT, x), "y1": (p2, y), "b": (p2, None), "x2": (p2, x), "y2": (PROMPT, y)}
    try:
        solo = {}
        for rid, r in reqs.items():
            solo.update(_run(eng, {rid: r}))
        counter, before = _JaxCompiles(), _compiles(eng)
        counter._on = True
        for rid, (p, lr) in reqs.items():
            eng.add_request(rid, p, GREEDY, lora_request=lr)
        assert eng.lora.num_waiting() == 3  # y1, x2 (behind y1), y2
        outs = drain(eng)
        counter._on = False
        assert counter.n == 0 and _compiles(eng) == before
        for rid in reqs:
            assert outs[rid].outputs[0].finish_reason == "length", rid
            assert list(outs[rid].outputs[0].token_ids) == solo[rid][0], rid
            np.testing.assert_allclose(outs[rid].outputs[0].token_logprobs, solo[rid][1],
                                       atol=1e-5)
        assert not eng._awaiting_grammar
    finally:
        _cleanup(eng)


def test_abort_of_a_waiting_request_leaks_nothing():
    eng = _one_slot_engine()
    cfg, params = tiny_params()
    x = LoRARequest("ax", 41, random_adapter(cfg, 4, seed=81))
    y = LoRARequest("ay", 42, random_adapter(cfg, 4, seed=82))
    kv = eng.scheduler.kv_cache_manager
    free = kv.num_free_blocks
    try:
        eng.add_request("run", PROMPT, GREEDY, lora_request=x)
        eng.add_request("wait", PROMPT, GREEDY, lora_request=y)
        eng.step()
        assert eng.lora.num_waiting() == 1 and eng.scheduler.get_request("wait") is None
        assert eng.abort("wait") and not eng._awaiting_grammar
        outs = drain(eng)
        assert "wait" not in outs and outs["run"].outputs[0].finish_reason == "length"
        assert eng.lora.slots.slot_of(42) == 0 and eng.outputs.num_live == 0
        assert kv.num_free_blocks == free and not eng.scheduler.requests
        eng.lora.remove_lora(42)  # no live request uses it any more
        o = _run(eng, {"after": (PROMPT, x)})["after"]  # the engine goes on
        np.testing.assert_allclose(o[1], _reference(merged_params(params, x.lora_path),
                                                    PROMPT, o[0]), atol=1e-4)
    finally:
        _cleanup(eng)


def test_a_request_held_for_its_grammar_keeps_its_adapter_slot():
    import concurrent.futures

    from jaxserve.structured_output import GuidedSpec, StructuredOutputsParams

    eng = _one_slot_engine()
    cfg, _ = tiny_params()
    x = LoRARequest("gx", 51, random_adapter(cfg, 4, seed=91))
    y = LoRARequest("gy", 52, random_adapter(cfg, 4, seed=92))
    guided = SamplingParams(max_tokens=N_OUT, temperature=0.0,
                            structured_outputs=StructuredOutputsParams(choice=["ab", "ba"]))
    real_submit = eng.grammars.submit
    gate: concurrent.futures.Future = concurrent.futures.Future()
    eng.grammars.submit = lambda spec: gate  # a compile that has not finished
    try:
        eng.add_request("g", PROMPT, guided, lora_request=x)  # held, with x's slot
        eng.add_request("r", PROMPT, GREEDY, lora_request=y)
        for _ in range(3):
            assert eng.step() == []
            assert eng.lora.slots.slot_of(51) == 1 and eng.lora.slots.slot_of(52) == 0
            assert eng.lora.num_waiting() == 1 and not eng.scheduler.requests
        gate.set_result(real_submit(GuidedSpec.make("choice", ["ab", "ba"])).result(timeout=30))
        outs = drain(eng)
        eng.grammars.submit = real_submit
        solo = _run(eng, {"r": (PROMPT, y)})["r"]
        eng.add_request("g", PROMPT, guided, lora_request=x)
        g_solo = drain(eng)["g"].outputs[0]
        assert list(outs["r"].outputs[0].token_ids) == solo[0]
        assert outs["g"].outputs[0].token_ids == g_solo.token_ids
        assert g_solo.finish_reason == "stop" and g_solo.text in ("ab", "ba")
    finally:
        eng.grammars.submit = real_submit
        _cleanup(eng)


def _pool(eng):
    return [np.asarray(v) for v in jax.tree.leaves(eng.runner.lora.split(eng.runner.params))]


@pytest.mark.parametrize("bad, match", [
    ("rank", "LoRA rank 17 exceeds max_lora_rank=16"),
    ("shape", r"do not fit the model's wk: expected A \(48, 4\)"),
    ("target", "LoRA target module 'lm_head' is not supported"),
    ("layer", "layer 2 >= num_hidden_layers=2"),
])
def test_bad_adapter_is_a_clear_error_and_the_pool_is_unchanged(bad, match):
    eng = _engine()
    cfg, _ = tiny_params()
    good = LoRARequest("ok", 5, random_adapter(cfg, 4, seed=60))
    try:
        _run(eng, {"g": (PROMPT, good)})
        before, names = _pool(eng), [r.lora_name for r in eng.lora.list_loras()]
        tree = random_adapter(cfg, 17 if bad == "rank" else 4, seed=61)
        if bad == "shape":
            tree["wk"]["lora_a"] = tree["wk"]["lora_a"][:, :40]
        if bad == "target":
            tree["lm_head"] = tree.pop("wq")
        if bad == "layer":
            tree = to_peft_state_dict(tree)
            tree = {k.replace("layers.1.", "layers.2."): v for k, v in tree.items()}
        with pytest.raises(ValueError, match=match):
            eng.lora.add_lora(LoRARequest("bad", 6, tree))
        with pytest.raises(ValueError, match=match):  # and as an update of a live adapter
            eng.lora.update_lora("ok", tree)
        after = _pool(eng)
        assert all(np.array_equal(a, b) for a, b in zip(before, after))
        assert [r.lora_name for r in eng.lora.list_loras()] == names
    finally:
        _cleanup(eng)


def test_lora_off_is_a_clear_error():
    eng = tiny_engine()
    with pytest.raises(ValueError, match="LoRA is off"):
        eng.add_request("x", PROMPT, GREEDY, lora_request=LoRARequest("a", 1, {}))
    assert not eng.has_unfinished_requests()


def test_llm_generate_takes_one_lora_request_per_prompt():
    from jaxserve import LLM
    from jaxserve.engine import make_engine_config

    eng = _engine()
    cfg, params = tiny_params()
    tree = random_adapter(cfg, 2, seed=90)
    lr = LoRARequest("p", 4, tree)
    llm = LLM(engine=eng)
    try:
        outs = llm.generate([PROMPT, PROMPT], GREEDY, lora_request=[lr, None], use_tqdm=False)
        for o, p in zip(outs, (merged_params(params, tree), params)):
            c = o.outputs[0]
            np.testing.assert_allclose(c.token_logprobs, _reference(p, PROMPT, c.token_ids),
                                       atol=1e-4)
        assert [r.lora_name for r in llm.list_loras()] == ["p"]
        with pytest.raises(ValueError, match="got 1 lora_requests for 2 prompts"):
            llm.generate([PROMPT, PROMPT], GREEDY, lora_request=[lr])
    finally:
        _cleanup(eng)
    assert make_engine_config(cfg, enable_lora=True).max_loras == 1  # vLLM's switch
