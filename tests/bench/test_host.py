"""`jaxserve bench host` (issue 24): one short case over the fake runner's FIFO device.

No timing is asserted beyond what the simulated device makes impossible to beat: every
request gains at most one token per step, and a step takes at least D on the device, so
tokens per request per second can exceed 1000 / D only by the step in flight at the
window's edges. The engine thread's CPU time cannot exceed the wall time.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxserve.bench import host

GGUF = Path(__file__).resolve().parents[2] / "checkpoints" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.skipif(not GGUF.exists(), reason="needs the default SmolLM2 GGUF (make model)")
def test_one_case_respects_the_device_bound_and_its_own_accounting():
    from jaxserve.checkpoint.loader import load_tokenizer

    lines = []
    D = 5.0
    r = host.run_case(4, D, seconds=0.5, real=False, tokenizer=load_tokenizer(GGUF),
                      log=lines.append)
    assert r.rows == 4 and r.steps >= 2 and len(lines) == 1 and "cpu=" in lines[0]
    assert 0 < r.tokens_per_request_per_s <= (r.seconds * 1000 / D + 2) / r.seconds
    assert r.period_ms >= D * 0.99  # FIFO: one step per D at best (sleep may wake late)
    assert r.device_ms_per_step == pytest.approx(D, rel=0.05)
    assert 0 <= r.cpu_ms_per_step <= r.period_ms * 1.05
    assert set(r.phases_ms_per_step) == set(host.PHASES)


@pytest.mark.skipif(not GGUF.exists(), reason="needs the default SmolLM2 GGUF (make model)")
def test_a_window_longer_than_the_requests_ends_before_them():
    """At D = 0.2 ms the 1900-token requests last well under 60 s: the window ends one
    step before the tokens they have left run out (said in the log), so none finishes
    inside it (run_case raises if one does)."""
    from jaxserve.checkpoint.loader import load_tokenizer

    lines = []
    r = host.run_case(2, 0.2, seconds=60.0, real=False, tokenizer=load_tokenizer(GGUF),
                      log=lines.append)
    assert len(lines) == 2 and lines[0].startswith("  window ") and "not 60 s" in lines[0]
    left = int(lines[0].split(" than the ")[1].split()[0])
    assert 1800 < left < 1900 and r.steps == left - 1


@pytest.mark.skipif(not GGUF.exists(), reason="needs the default SmolLM2 GGUF (make model)")
def test_the_engine_process_case_respects_the_device_bound():
    """`--engine_process` (MPEngine): the same bounds, counted from the outputs here, and
    the core's device busy D a step; each request's text grew with its tokens."""
    from jaxserve.bench.host_split import run_case_split
    from jaxserve.checkpoint.loader import load_tokenizer

    lines = []
    D = 5.0
    r = run_case_split(4, D, seconds=0.5, tokenizer=load_tokenizer(GGUF), log=lines.append)
    assert r.rows == 4 and r.steps >= 2 and len(lines) == 1 and "text=" in lines[0]
    assert int(lines[0].rsplit("text=", 1)[1].split()[0]) > 0
    assert 0 < r.tokens_per_request_per_s <= (r.seconds * 1000 / D + 3) / r.seconds
    # The core runs up to `MPEngine.steps_ahead` (2) steps ahead: the window may begin
    # with two steps it made before, so D a step holds for all but two of them.
    assert r.seconds * 1000 >= D * 0.99 * (r.steps - 2)
    assert r.device_ms_per_step == pytest.approx(D, rel=0.1)
    assert set(r.phases_ms_per_step) == {"frontend", "core"}


def test_check_texts_wants_each_text_to_be_its_tokens_decode():
    from conftest import tiny_tokenizer
    from jaxserve.bench.host_common import check_texts
    from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput

    tok = tiny_tokenizer()
    ids = tok.encode("ab cd", add_special_tokens=False)

    def out(text):
        return {"r": RequestOutput("r", None, [1], [CompletionOutput(0, text, ids)], False,
                                   RequestMetrics(0.0))}
    check_texts(out("ab cd"), tok)
    check_texts(out("ab c"), tok)  # the last token held back (an incomplete character)
    check_texts(out("a"), tok)  # four held back: the most a split character takes
    with pytest.raises(RuntimeError, match="'r'.*not the decode"):
        check_texts(out("ab cx"), tok)
    with pytest.raises(RuntimeError, match="not the decode"):
        check_texts(out(""), tok)  # five
    with pytest.raises(RuntimeError, match="not the decode"):
        check_texts(out("\ufffd wrong"), tok)  # a U+FFFD excuses nothing by itself


@pytest.mark.skipif(not GGUF.exists(), reason="needs the default SmolLM2 GGUF (make model)")
def test_check_texts_past_an_invalid_byte_run():
    """Tokens of split characters in an order no character completes (found by a review's
    fuzz): 4 tokens with no text are emitted as U+FFFD, which no decode of the tokens
    matches; the window scheme's own serial text is asked then, and must be equal."""
    from jaxserve.bench.host_common import PROMPT, check_texts
    from jaxserve.checkpoint.loader import load_tokenizer
    from jaxserve.engine.detokenizer import IncrementalDetokenizer
    from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from jaxserve.sampling_params import SamplingParams

    tok = load_tokenizer(GGUF)
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}],
                                     add_generation_prompt=True, tokenize=True)
    ids = [42659, 41467, 46673, 38466, 155, 2, 3, 38207, 25996, 321, 179, 184, 36717, 38115,
           6385, 1, 34846, 38375, 16280, 15997, 16736, 47804, 4797, 29767, 21784, 37145, 5086,
           20561, 32550, 6133, 43525, 17815, 29205, 26217, 30257, 32354, 15076, 10003, 32539,
           32947]
    d = IncrementalDetokenizer(tok, prompt, SamplingParams())
    for t in ids:
        d.update_one(t) if d.plain else d.update([t], finished=False)
    text = d.output_text
    assert not any(tok.decode(ids[:len(ids) - j]) == text for j in range(5))

    def out(text):
        return {"r": RequestOutput("r", None, prompt, [CompletionOutput(0, text, ids)], False,
                                   RequestMetrics(0.0))}
    check_texts(out(text), tok)
    with pytest.raises(RuntimeError, match="not the decode"):
        check_texts(out(text + "x"), tok)
