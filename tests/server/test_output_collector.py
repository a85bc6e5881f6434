"""The server's per-request `OutputCollector` (vLLM's RequestOutputCollector): deltas its
stream has not read yet are merged per running request, so a reader that falls behind
gets fewer events with the same tokens, text and logprobs in the same order."""

from __future__ import annotations

import asyncio

from jaxserve.server.async_engine import CompletionDelta, RequestDelta
from jaxserve.server.output_collector import OutputCollector, merge_deltas


def _d(rid: str, steps: list[tuple[int, str, tuple, str | None]], finished=False, error=None,
       prompt_logprobs=None) -> RequestDelta:
    """One delta: (index, text, token ids, finish_reason) per sample; logprobs = {id: -id}."""
    outs = tuple(CompletionDelta(index=i, text=t, token_ids=ids,
                                 logprobs=tuple({x: -float(x)} for x in ids),
                                 num_tokens=100 + len(ids), finish_reason=f,
                                 stop_reason=None, error=None) for i, t, ids, f in steps)
    return RequestDelta(request_id=rid, outputs=outs, finished=finished, error=error,
                        prompt_logprobs=prompt_logprobs)


def test_merge_concatenates_each_sample_and_keeps_the_later_state():
    a = _d("r", [(0, "ab", (1, 2), None), (1, "x", (7,), "stop")], prompt_logprobs=[None])
    b = _d("r", [(0, "c", (3,), "length"), (1, "", (), "stop")], finished=True)
    m = merge_deltas(a, b)
    assert m.finished and m.prompt_logprobs == [None]
    c0, c1 = m.outputs
    assert (c0.text, c0.token_ids, c0.finish_reason, c0.num_tokens) == ("abc", (1, 2, 3),
                                                                       "length", 101)
    assert c0.logprobs == ({1: -1.0}, {2: -2.0}, {3: -3.0})
    assert (c1.text, c1.token_ids, c1.finish_reason) == ("x", (7,), "stop")
    only_a = merge_deltas(_d("r", [(0, "a", (1,), None), (1, "b", (2,), None)]),
                          _d("r", [(1, "c", (3,), None)]))
    assert [(c.index, c.text) for c in only_a.outputs] == [(0, "a"), (1, "bc")]


def test_unread_deltas_of_a_running_request_become_one_event():
    async def run():
        col = OutputCollector()
        col.put(_d("r", [(0, "a", (1,), None)]))
        col.put(_d("r", [(0, "b", (2,), None)]))
        col.put(_d("s", [(0, "z", (9,), None)]))  # another request: its own event
        col.put(_d("r", [(0, "c", (3,), "stop")], finished=True))
        col.put(_d("r", [(0, "late", (4,), None)]))  # after a finish: never merged
        got = [await col.get() for _ in range(4)]
        assert col.empty() and col.num_merged == 1
        return got
    got = asyncio.run(run())
    assert [(g.request_id, g.outputs[0].text) for g in got] == [
        ("r", "ab"), ("s", "z"), ("r", "c"), ("r", "late")]
    assert got[0].outputs[0].token_ids == (1, 2) and got[2].finished


def test_an_error_delta_is_never_merged_and_a_reader_waits_for_a_put():
    async def run():
        col = OutputCollector()
        col.put(_d("r", [(0, "a", (1,), None)]))
        col.put(_d("r", [], finished=True, error="boom"))
        first, second = await col.get(), await col.get()
        waiter = asyncio.ensure_future(col.get())
        await asyncio.sleep(0.01)
        assert not waiter.done()
        col.put(_d("q", [(0, "x", (5,), None)]))
        return first, second, await asyncio.wait_for(waiter, 1)
    first, second, third = asyncio.run(run())
    assert first.outputs[0].text == "a" and second.error == "boom" and third.request_id == "q"
