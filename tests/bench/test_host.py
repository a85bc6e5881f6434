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
    assert r.period_ms >= D * 0.99
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
    check_texts(out("ab\ufffd"), tok)  # past an invalid byte run: the text before it
    with pytest.raises(RuntimeError, match="not the decode"):
        check_texts(out("ax\ufffd"), tok)
