"""Layer-group programs (jaxserve/layer_stack.py): every group size G gives the tokens of
the dense reference forward, and the same tokens and logprobs as the one-program stack
and the lax.scan form, through the engine (chunked prefill and decode in one batch)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from conftest import tiny_params
from jaxserve.worker.layer_stack import LayerStackProgram
from jaxserve.sampling_params import SamplingParams

L = 4  # a 4-layer tiny model: G = 1, 2 and 4 are all divisors
MAX_LEN = 64
PROMPTS = {"long": [int(x) for x in np.random.default_rng(3).integers(3, 66, 37)],  # 3 chunks
           "a": [5, 9, 13, 21, 34], "b": [60, 2, 7]}
N_TOKENS = 6


def _engine(**kw):
    from jaxserve.engine import LLMEngine, make_engine_config

    cfg, params = tiny_params(num_hidden_layers=L)
    args = dict(max_model_len=MAX_LEN, block_size=4, num_kv_blocks=64, max_num_seqs=4,
                max_num_batched_tokens=16, token_buckets=(4, 16), seq_buckets=(4,),
                attention_backend="xla", strict_compiles=True, enable_prompt_logprobs=False)
    args.update(kw)
    return LLMEngine(make_engine_config(cfg, **args), params, progress=False)


def _run(engine) -> dict[str, tuple[list[int], list[float]]]:
    for rid, p in PROMPTS.items():
        engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=N_TOKENS,
                                                  ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                o = out.outputs[0]
                done[out.request_id] = (list(o.token_ids), list(o.token_logprobs))
    return done


def _reference_greedy(prompt: list[int]) -> list[int]:
    from jaxserve.model.llama import reference_logits

    cfg, params = tiny_params(num_hidden_layers=L)
    ids = list(prompt)
    for _ in range(N_TOKENS):
        arr = np.zeros(MAX_LEN, np.int32)
        arr[: len(ids)] = ids
        ids.append(int(np.argmax(reference_logits(cfg, params, arr)[len(ids) - 1])))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def layouts():
    out = {}
    for name, kw in {"G1": dict(layers_per_program=1), "G2": dict(layers_per_program=2),
                     "G4": dict(layers_per_program=L), "scan": dict(unroll_layers=False)}.items():
        engine = _engine(**kw)
        out[name] = (_run(engine), engine)
    return out


def test_every_group_size_gives_the_reference_tokens(layouts):
    for rid, prompt in PROMPTS.items():
        want = _reference_greedy(prompt)
        for name, (res, _) in layouts.items():
            assert res[rid][0] == want, (name, rid, res[rid][0], want)


def test_group_sizes_agree_with_the_one_program_stack_and_the_scan(layouts):
    ref = layouts["G4"][0]
    for name, (res, engine) in layouts.items():
        for rid in PROMPTS:
            assert res[rid][0] == ref[rid][0], (name, rid)
            np.testing.assert_allclose(res[rid][1], ref[rid][1], atol=1e-5, err_msg=name)
        assert engine.runner.stats().late_compiles == 0


def test_programs_and_cache_layout(layouts):
    for name, g in (("G1", 1), ("G2", 2), ("G4", 4)):
        runner = layouts[name][1].runner
        stacks = {k: p for k, p in runner.programs.programs.items() if k[0] == "stack"}
        assert sorted(stacks) == [("stack", 4), ("stack", 16)]
        assert all(isinstance(p, LayerStackProgram) and p.group == g for p in stacks.values())
        ks, vs = runner.kv_cache
        assert len(ks) == len(vs) == L  # one buffer per layer, donated call by call
        cfg = runner.model_cfg
        assert {a.shape for a in ks + vs} == {(64, 4, cfg.num_key_value_heads, cfg.head_dim)}
    scan = layouts["scan"][1].runner
    assert not any(isinstance(p, LayerStackProgram) for p in scan.programs.programs.values())
    assert [a.shape[0] for a in scan.kv_cache] == [L, L]  # the stacked [L, N, B, K, D] cache
    assert not any(a.is_deleted() for a in jax.tree.leaves(layouts["G1"][1].runner.kv_cache))


def test_a_group_size_that_does_not_divide_the_layers_is_refused():
    with pytest.raises(ValueError, match=r"layers_per_program=3 must be a divisor of "
                                         r"num_hidden_layers=4"):
        _engine(layers_per_program=3)
    with pytest.raises(ValueError, match=r"layers_per_program=0"):
        _engine(layers_per_program=0)
    with pytest.raises(ValueError, match=r"compile_threads=0 must be a positive int"):
        _engine(compile_threads=0)


def test_a_failure_mid_stack_is_retried_on_a_rebuilt_cache(layouts):
    import dataclasses

    engine = _engine(layers_per_program=1)
    runner = engine.runner
    calls = {"n": 0}
    fail_at = 3 * L + 2  # the 4th step, its 2nd layer call: layer 0's cache already replaced

    for key, prog in list(runner.programs.programs.items()):
        if key[0] == "stack":
            def layers(*args, _real=prog.layers):
                calls["n"] += 1
                if calls["n"] == fail_at:
                    args[1][0].delete()  # the donated cache of the failing call is lost
                    raise RuntimeError("injected failure in layer 1")
                return _real(*args)
            runner.programs.programs[key] = dataclasses.replace(prog, layers=layers)
    res = _run(engine)
    assert calls["n"] > fail_at
    assert engine.get_stats()["num_failed_steps"] == 1
    assert not any(a.is_deleted() for a in jax.tree.leaves(runner.kv_cache))  # rebuilt
    ref = layouts["G1"][0]
    for rid in PROMPTS:  # every request recomputed on the fresh cache, same tokens
        assert res[rid][0] == ref[rid][0], rid
