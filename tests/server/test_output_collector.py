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
        col.put(_d("r", [(0, "c", (3,), "stop")], finished=True))  # past s's: still r's
        col.put(_d("r", [(0, "late", (4,), None)]))  # after a finish: never merged
        got = [await col.get() for _ in range(3)]
        assert col.empty() and col.num_merged == 2
        return got
    got = asyncio.run(run())
    assert [(g.request_id, g.outputs[0].text) for g in got] == [
        ("r", "abc"), ("s", "z"), ("r", "late")]
    assert got[0].outputs[0].token_ids == (1, 2, 3) and got[0].finished


def test_interleaved_requests_of_one_group_each_merge():
    """A multi-prompt request's engine requests arrive r0, r1, r0, r1, ...: each merges
    into its own unread delta; once read, a request's next delta starts a new one."""
    async def run():
        col = OutputCollector()
        for step in range(3):
            for rid in ("r0", "r1"):
                col.put(_d(rid, [(0, f"{rid}.{step} ", (step,), None)]))
        first = [await col.get() for _ in range(2)]
        col.put(_d("r1", [(0, "r1.3", (3,), None)]))
        col.put(_d("r0", [(0, "r0.3", (3,), None)]))
        rest = [await col.get() for _ in range(2)]
        assert col.empty() and col.num_merged == 4
        return first + rest
    got = asyncio.run(run())
    assert [(g.request_id, g.outputs[0].text) for g in got] == [
        ("r0", "r0.0 r0.1 r0.2 "), ("r1", "r1.0 r1.1 r1.2 "), ("r1", "r1.3"), ("r0", "r0.3")]
    assert got[0].outputs[0].token_ids == (0, 1, 2)


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


def test_a_finished_sample_is_reported_once_while_its_siblings_run():
    """n = 2: the engine's output keeps a finished sample (empty delta, its finish_reason)
    in every later step; the stream says it once."""
    from types import SimpleNamespace

    from jaxserve.server.serving import _Acc

    acc = _Acc(SimpleNamespace(request_ids=["r"], prompt_token_ids=[[1, 2]]), n=2)
    steps = [_d("r", [(0, "a", (1,), None), (1, "x", (7,), None)]),
             _d("r", [(0, "b", (2,), "length"), (1, "y", (8,), None)]),
             _d("r", [(0, "", (), "length"), (1, "z", (9,), None)]),
             _d("r", [(0, "", (), "length"), (1, "w", (5,), "stop")], finished=True)]
    said = [[(i, c.text, c.finish_reason) for i, c in acc.apply(d)] for d in steps]
    assert said == [[(0, "a", None), (1, "x", None)], [(0, "b", "length"), (1, "y", None)],
                    [(1, "z", None)], [(1, "w", "stop")]]
    assert ["".join(c.text) for c in acc.choices] == ["ab", "xyzw"]
    assert [c.finish_reason for c in acc.choices] == ["length", "stop"]
