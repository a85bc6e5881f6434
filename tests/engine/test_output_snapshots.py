"""The host loop's cheap per-row objects (issue 24) are the objects their constructors make,
and every cumulative field of a step's output is a snapshot of that step.

`CompletionOutput.snapshot` and `RequestOutput.make` skip the dataclass constructors'
per-field setters; the engine hands out `text`, `token_ids`,
`token_logprobs` and `logprobs` as O(1) prefixes of live, append-only state (the text
is an immutable str), copied on first read. A caller that keeps every step's output and
reads them all at the end must see each step's own values.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import tiny_tokenizer
from jaxserve.config import ModelConfig
from jaxserve.engine import LLMEngine, make_engine_config
from jaxserve.outputs import (CompletionOutput, ListPrefix, RequestMetrics, RequestOutput,
                              VersionRuns)
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.worker.fake_runner import FakeRunner, default_token


def test_fast_constructors_equal_the_dataclass_constructors():
    fields = dict(index=1, text="ab", token_ids=[3, 4], delta_text="b", delta_token_ids=[4],
                  logprobs=[{3: -0.1}, {4: -0.2}], delta_logprobs=[{4: -0.2}],
                  token_logprobs=[-0.1, -0.2], cumulative_logprob=-0.3, finish_reason="stop",
                  stop_reason="x", error=None)
    ref = CompletionOutput(**fields)
    fast = CompletionOutput.snapshot(**fields)
    assert fast == ref and repr(fast) == repr(ref)
    assert dataclasses.asdict(fast) == dataclasses.asdict(ref)
    assert [f.name for f in dataclasses.fields(CompletionOutput)] == list(fields) + [
        "token_weight_versions"]  # a new field must be added to `snapshot` too
    lazy = CompletionOutput.snapshot(**{**fields, "text": ListPrefix("abc", 2),
                                        "token_ids": ListPrefix([3, 4, 5], 2)})
    assert lazy == ref and lazy.num_tokens == 2
    comps, metrics = [ref], RequestMetrics(1.5)
    made = RequestOutput.make("q", "hi", [1, 2], comps, False, metrics)
    built = RequestOutput("q", "hi", [1, 2], comps, False, metrics)
    assert made == built and repr(made) == repr(built)
    assert dataclasses.asdict(made) == dataclasses.asdict(built)
    assert made.prompt_logprobs is None and made.prompt_token_logprobs is None


def _fake_engine(max_num_seqs: int) -> LLMEngine:
    """The tiny config on the fake runner, its tokens inside the tiny tokenizer's vocab."""
    config = make_engine_config(ModelConfig.tiny(), max_model_len=64, block_size=4,
                                num_kv_blocks=96, max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=32)
    V = tiny_tokenizer().vocab_size
    runner = FakeRunner.for_config(config, build_batches=True, token_fn=lambda req, pos:
                                   default_token(req.request_id, pos, vocab_size=V))
    return LLMEngine(config, tokenizer=tiny_tokenizer(), runner=runner, warmup=False)


def _run_recording(direct: bool, kind: RequestOutputKind) -> tuple[list, int]:
    """Every step's outputs of a mixed workload, as plain values, read after the run; and
    how many outputs `process_tokens` made itself (`_Parent.direct`, on or forced off)."""
    eng = _fake_engine(max_num_seqs=4)
    add, made = eng.outputs.add, [0]

    def add_maybe_direct(p):
        add(p)
        parent = eng.outputs._parents[p.request_id]
        parent.direct = parent.direct and direct
    eng.outputs.add = add_maybe_direct
    process = eng.outputs.process_tokens

    def counting(*a, **kw):
        progressed, fin = process(*a, **kw)
        made[0] += sum(not isinstance(x, str) for x in progressed)
        return progressed, fin
    eng.outputs.process_tokens = counting
    base = SamplingParams(max_tokens=14, ignore_eos=True, output_kind=kind)
    eng.add_request("plain", "hello world", base)
    eng.add_request("stops", "abc", base.replace(stop=["O", "X"]))
    eng.add_request("lps", "abc", base.replace(logprobs=2))
    eng.add_request("two", "hi", base.replace(n=2))
    kept = []
    for _ in range(3):
        kept += eng.step()
    eng.add_request("late", "late one", base.replace(max_tokens=5))
    while eng.has_unfinished_requests():
        kept += eng.step()
    rows = [(o.request_id, o.finished, [dataclasses.asdict(c) for c in o.outputs])
            for o in kept]
    return rows, made[0]


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
def test_outputs_made_in_process_tokens_equal_those_made_by_collect(kind):
    """A one-sample request's output is made in `process_tokens`' pass (`_Parent.direct`)
    only while nothing later in the step can change it: every step's outputs, every field,
    equal those of the same run with that path off."""
    got, made = _run_recording(True, kind)
    want, none = _run_recording(False, kind)
    assert none == 0 and made >= 10  # the path ran, and the reference did not take it
    assert got == want


def test_each_steps_output_keeps_its_own_text_and_tokens():
    model = ModelConfig.tiny()
    config = make_engine_config(model, max_model_len=64, block_size=4, num_kv_blocks=64,
                                max_num_seqs=4, max_num_batched_tokens=32)
    V = tiny_tokenizer().vocab_size  # tokens the tokenizer can decode
    runner = FakeRunner.for_config(config, build_batches=True, token_fn=lambda req, pos:
                                   default_token(req.request_id, pos, vocab_size=V))
    eng = LLMEngine(config, tokenizer=tiny_tokenizer(), runner=runner, warmup=False)
    sp = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=1)
    eng.add_request("a", "hello world", sp)
    eng.add_request("b", "abc", sp)
    kept = []
    while eng.has_unfinished_requests():
        kept += eng.step()
    assert len(kept) >= 30
    text, ids, n = {"a": "", "b": ""}, {"a": [], "b": []}, 0
    for o in kept:  # read only now, after every step has run
        c = o.outputs[0]
        text[o.request_id] += c.delta_text
        ids[o.request_id] += c.delta_token_ids
        assert c.text == text[o.request_id] and c.token_ids == ids[o.request_id]
        assert len(c.token_logprobs) == len(c.logprobs) == len(c.token_ids)
        n += 1
    assert all(len(v) == 20 for v in ids.values()) and n == len(kept)
    assert kept[-1].outputs[0].text == tiny_tokenizer().decode(ids[kept[-1].request_id])


def test_final_only_gives_one_output_equal_to_the_cumulative_runs_last():
    """RequestOutputKind.FINAL_ONLY (vLLM): no output until finished, then one whose every
    field equals the last output of the same request run CUMULATIVE (n=2, a stop string)."""
    model = ModelConfig.tiny()
    config = make_engine_config(model, max_model_len=64, block_size=4, num_kv_blocks=64,
                                max_num_seqs=8, max_num_batched_tokens=32)
    V = tiny_tokenizer().vocab_size
    runner = FakeRunner.for_config(config, build_batches=True, token_fn=lambda req, pos:
                                   default_token(req.request_id.split("-")[-1], pos,
                                                 vocab_size=V))
    eng = LLMEngine(config, tokenizer=tiny_tokenizer(), runner=runner, warmup=False)
    base = SamplingParams(n=2, max_tokens=12, ignore_eos=True, logprobs=1)
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
        eng.add_request(f"{kind.name}-x", "hello world", base.replace(output_kind=kind))
        eng.add_request(f"{kind.name}-y", "abc", base.replace(output_kind=kind, stop=["O", "X"]))
    seen: dict[str, list] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            seen.setdefault(o.request_id, []).append(o)
    for r in ("x", "y"):
        cum, fin = seen[f"CUMULATIVE-{r}"], seen[f"FINAL_ONLY-{r}"]
        assert len(cum) > 1 and len(fin) == 1 and fin[0].finished
        for a, b in zip(cum[-1].outputs, fin[0].outputs):
            assert (a.text, a.token_ids, a.logprobs, a.finish_reason, a.stop_reason) == (
                b.text, b.token_ids, b.logprobs, b.finish_reason, b.stop_reason)
            assert b.delta_text == b.text and b.delta_token_ids == b.token_ids
            assert len(b.token_ids) > 0
    assert [c.stop_reason for c in seen["FINAL_ONLY-y"][0].outputs] == ["O", "X"]


def test_output_kind_is_validated_and_normalised():
    assert SamplingParams(output_kind=2).output_kind is RequestOutputKind.FINAL_ONLY
    for bad in (3, -1, True, "FINAL_ONLY", None):
        with pytest.raises(ValueError, match="output_kind.*RequestOutputKind"):
            SamplingParams(output_kind=bad)


def _run(stream_interval: int) -> dict[str, list]:
    return {rid: [o for _, o in outs] for rid, outs in _steps(stream_interval).items()}


def test_stream_interval_batches_tokens_into_fewer_outputs_with_the_same_result():
    """vLLM's stream_interval k: the first token at once, then an output each k tokens, the
    final one at once; the deltas add up to the same text, ids and logprobs as k = 1."""
    one, four = _run(1), _run(4)
    x1, x4 = one["x"], four["x"]
    assert [len(o.outputs[0].delta_token_ids) for o in x1] == [1] * 11
    assert [len(o.outputs[0].delta_token_ids) for o in x4] == [1, 4, 4, 2]
    assert x4[-1].finished and not any(o.finished for o in x4[:-1])
    for rid in ("x", "y"):
        a, b = one[rid][-1], four[rid][-1]
        for ca, cb in zip(a.outputs, b.outputs):
            assert (ca.text, ca.token_ids, ca.logprobs, ca.finish_reason, ca.stop_reason) == (
                cb.text, cb.token_ids, cb.logprobs, cb.finish_reason, cb.stop_reason)
        for i in range(len(b.outputs)):  # the deltas add up to the cumulative fields
            assert "".join(o.outputs[i].delta_text for o in four[rid]) == b.outputs[i].text
            assert sum((o.outputs[i].delta_token_ids for o in four[rid]), []) == \
                b.outputs[i].token_ids
    assert len(four["y"]) < len(one["y"])


def test_stream_interval_is_validated():
    with pytest.raises(ValueError, match="stream_interval=0 must be a positive int"):
        make_engine_config(ModelConfig.tiny(), stream_interval=0)


def _steps(stream_interval: int = 1, kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
           ) -> dict[str, list[tuple[int, object]]]:
    """(step number, output) of each request: one greedy request with logprobs and one with
    n = 2 and stop strings, so its samples finish at different steps."""
    model = ModelConfig.tiny()
    config = make_engine_config(model, max_model_len=64, block_size=4, num_kv_blocks=64,
                                max_num_seqs=8, max_num_batched_tokens=32,
                                stream_interval=stream_interval)
    V = tiny_tokenizer().vocab_size
    runner = FakeRunner.for_config(config, build_batches=True, token_fn=lambda req, pos:
                                   default_token(req.request_id, pos, vocab_size=V))
    eng = LLMEngine(config, tokenizer=tiny_tokenizer(), runner=runner, warmup=False)
    eng.add_request("x", "hello world", SamplingParams(max_tokens=11, ignore_eos=True,
                                                       logprobs=1, output_kind=kind))
    eng.add_request("y", "abc", SamplingParams(n=2, max_tokens=13, ignore_eos=True,
                                                stop=["u", "x"], logprobs=0, output_kind=kind))
    seen: dict[str, list] = {}
    step = 0
    while eng.has_unfinished_requests():
        step += 1
        for o in eng.step():
            seen.setdefault(o.request_id, []).append((step, o))
    return seen


def test_delta_outputs_hold_only_what_is_new_and_add_up_to_the_cumulative_run():
    """RequestOutputKind.DELTA (vLLM's): text, token_ids, logprobs, token_logprobs and
    token_weight_versions of each output are the new part only; their concatenation is
    the CUMULATIVE run's last output, and cumulative_logprob stays cumulative."""
    cum, delta = _steps(), _steps(kind=RequestOutputKind.DELTA)
    for rid in ("x", "y"):
        assert [s for s, _ in cum[rid]] == [s for s, _ in delta[rid]]  # the same steps
        last = cum[rid][-1][1]
        for i, ref in enumerate(last.outputs):
            outs = [o.outputs[i] for _, o in delta[rid]]
            for c, (_, co) in zip(outs, cum[rid]):
                assert c.text == c.delta_text and c.token_ids == c.delta_token_ids
                assert c.logprobs == c.delta_logprobs
                assert len(c.token_logprobs) == len(c.token_ids) == len(c.token_weight_versions)
                assert c.cumulative_logprob == co.outputs[i].cumulative_logprob
            assert "".join(c.text for c in outs) == ref.text and len(ref.text) > 0
            assert sum((c.token_ids for c in outs), []) == ref.token_ids
            assert sum((c.logprobs for c in outs), []) == ref.logprobs
            assert sum((c.token_logprobs for c in outs), []) == ref.token_logprobs
            assert sum((c.token_weight_versions for c in outs), []) == \
                ref.token_weight_versions == [0] * len(ref.token_ids)
            assert (outs[-1].finish_reason, outs[-1].stop_reason) == (
                ref.finish_reason, ref.stop_reason)


def test_stream_interval_never_holds_back_a_finished_sample():
    """With n = 2, a sample that finishes while its sibling runs is in that step's output
    whatever the stream_interval (it used to wait for the sibling's k tokens)."""
    def finish_steps(seen):
        first: dict[int, int] = {}
        for step, o in seen["y"]:
            for c in o.outputs:
                if c.finish_reason is not None:
                    first.setdefault(c.index, step)
        return first
    one, held = finish_steps(_steps(1)), finish_steps(_steps(100))
    assert one == held and len(one) == 2
    assert len(set(one.values())) == 2  # the two samples finish at different steps


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
def test_prompt_logprobs_come_once_with_delta_outputs(kind):
    """DELTA: the prompt's logprobs are in the first output after the prefill only (vLLM);
    CUMULATIVE: in every output from then on. The fake scores a prompt token t as
    -0.1 * (1 + t % 5) (`jaxserve.worker.scoring.fake_scores`)."""
    model = ModelConfig.tiny()
    config = make_engine_config(model, max_model_len=64, block_size=4, num_kv_blocks=64,
                                max_num_seqs=4, max_num_batched_tokens=32)
    V = tiny_tokenizer().vocab_size
    runner = FakeRunner.for_config(config, token_fn=lambda req, pos:
                                   default_token(req.request_id, pos, vocab_size=V))
    eng = LLMEngine(config, tokenizer=tiny_tokenizer(), runner=runner, warmup=False)
    eng.add_request("p", [5, 6, 7, 8], SamplingParams(max_tokens=4, ignore_eos=True,
                                                      prompt_logprobs=0, output_kind=kind))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    carried = [o.prompt_logprobs is not None for o in outs]
    assert len(outs) == 4 and carried[0]
    assert carried == ([True, False, False, False] if kind == RequestOutputKind.DELTA
                       else [True] * 4)
    first = outs[0].prompt_logprobs
    assert first[0] is None and len(first) == 4
    assert [{t: round(v, 6) for t, v in e.items()} for e in first[1:]] == [
        {6: -0.2}, {7: -0.3}, {8: -0.4}]


def test_version_runs_expand_to_each_token_and_keep_their_step():
    """`VersionRuns` (hand-computed): runs (first index, version) expand to one version a
    token, cut at n and from start; a run appended later at an index >= n changes nothing."""
    runs = [(0, 3)]
    first = VersionRuns(runs, 2)
    runs += [(2, 4), (2, 5), (4, 7)]  # two updates before token 2, one before token 4
    assert first.materialize() == [3, 3]
    assert VersionRuns(runs, 5).materialize() == [3, 3, 5, 5, 7]
    assert VersionRuns(runs, 5, 3).materialize() == [5, 7]
    assert VersionRuns([], 0).materialize() == []
    c = CompletionOutput.snapshot(0, "", [1, 2], "", [], None, None, [], 0.0, None, None,
                                  None, VersionRuns(runs, 2))
    assert c.token_weight_versions == [3, 3]
    assert isinstance(c._token_weight_versions, list)  # read once, kept


def test_each_output_keeps_the_weight_versions_of_its_step():
    """token_weight_versions through weight updates (two in a row, too) on the fake
    runner: every output, read after the whole run, holds the engine's version at the
    step that sampled each of its tokens (CUMULATIVE: all of them; DELTA: the new ones),
    on the one-pass path (`_Parent.direct`), the stop-string path and n = 2."""
    eng = _fake_engine(max_num_seqs=8)
    eng.runner.update_params = lambda params: None  # the fake has no weights to swap
    base = SamplingParams(max_tokens=12, ignore_eos=True)
    delta = base.replace(output_kind=RequestOutputKind.DELTA)
    eng.add_request("cum", "hello world", base)
    eng.add_request("delta", "hello world", delta)
    eng.add_request("stops", "abc", base.replace(stop=["\x00never"]))
    eng.add_request("two", "hi", base.replace(n=2))
    eng.add_request("two_delta", "hi", delta.replace(n=2))
    kept = []  # (output, engine version at its step, each completion's num_tokens)
    step = 0
    while eng.has_unfinished_requests():
        if step in (3, 6):
            eng.update_params(None, in_flight="keep")
        if step == 6:
            eng.update_params(None, in_flight="keep")
        v = eng.weight_version
        for o in eng.step():
            kept.append((o, v, [c.num_tokens for c in o.outputs]))
        step += 1
    assert eng.weight_version == 3
    version_of = {}  # (request, sample index) -> version of each token, in order
    for o, v, counts in kept:
        for c, n in zip(o.outputs, counts):
            seen = version_of.setdefault((o.request_id, c.index), [])
            if o.request_id.endswith("delta"):
                seen += [v] * n
            else:
                seen += [v] * (n - len(seen))
    for key, versions in version_of.items():
        assert len(versions) == 12 and set(versions) == {0, 1, 3}, key
    at = {key: 0 for key in version_of}
    for o, v, counts in kept:
        for c in o.outputs:
            key = (o.request_id, c.index)
            if o.request_id.endswith("delta"):
                assert c.token_weight_versions == [v] * len(c.token_ids)
                new = version_of[key][at[key]:at[key] + len(c.token_ids)]
                assert c.token_weight_versions == new
                at[key] += len(c.token_ids)
            else:
                assert c.token_weight_versions == version_of[key][:len(c.token_ids)]


def test_a_logprobs_request_preempted_by_a_plan_made_ahead_keeps_its_top_k():
    """The runners hand shared empty top arrays only when no request of the step asked for
    logprobs, decided at dispatch: the plan made ahead of this step's tokens may preempt
    (drop) the only logprobs request before they are made, and its token here still
    carries its top-k (the cold review's pools 10-15 reproduce the preemption)."""
    from jaxserve.engine.output_processor import OutputProcessor

    short, preempted = [], 0
    on_token = OutputProcessor._on_token

    def checked(self, c, p, tok, now, fin):
        if c.logprobs is not None and len(tok.top_ids) < c.request.sampling_params.logprobs:
            short.append((c.request.request_id, len(c.token_logprobs)))
        return on_token(self, c, p, tok, now, fin)
    OutputProcessor._on_token = checked
    try:
        for pool in range(8, 20):
            config = make_engine_config(ModelConfig.tiny(), max_model_len=32, block_size=4,
                                        num_kv_blocks=pool, max_num_seqs=4,
                                        max_num_batched_tokens=16, enable_prefix_caching=False)
            eng = LLMEngine(config, tokenizer=None, runner=FakeRunner.for_config(config),
                            warmup=False)
            eng.runner.placeholders = True
            prompt = [5, 6, 7, 8, 9, 10, 11, 12]
            try:
                for rid, lp in (("a", None), ("b", None), ("L", 2)):
                    eng.add_request(rid, prompt, SamplingParams(max_tokens=12, logprobs=lp,
                                                                ignore_eos=True))
            except ValueError:  # a pool too small for one request
                continue
            while eng.has_unfinished_requests():
                eng.step()
            preempted += eng.scheduler.num_preemptions
    finally:
        OutputProcessor._on_token = on_token
    assert preempted > 0 and short == []
