"""Per-HTTP-request buffer of engine deltas that merges what its reader has not taken yet.

vLLM V1's `RequestOutputCollector`: the engine thread hands each step's deltas to the
event loop, and a stream's coroutine reads them. When the loop falls behind (64 streams,
each SSE event a few tens of µs of Python beside the engine thread on one GIL), the
deltas of one request that pile up are merged into one: one SSE event with several
tokens instead of several events, so the loop's work per step stops growing with the
backlog. The tokens, text and logprobs a client receives are the same, in the same
order; only how they are grouped into events changes (as with `--stream_interval`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any


def _mergeable(a: Any, b: Any) -> bool:
    """b may be folded into a: the same request, a still running, neither an error."""
    return (a.request_id == b.request_id and not a.finished and a.error is None
            and b.error is None)


def _merge_completion(a: Any, b: Any) -> Any:
    """One sample's two consecutive deltas as one (b's cumulative fields win)."""
    if a.logprobs is None or b.logprobs is None:
        logprobs = b.logprobs if a.logprobs is None else a.logprobs
    else:
        logprobs = a.logprobs + b.logprobs
    return b._replace(text=a.text + b.text, token_ids=a.token_ids + b.token_ids,
                      logprobs=logprobs)


def merge_deltas(a: Any, b: Any) -> Any:
    """Two consecutive `RequestDelta`s of one request (`_mergeable`) as one: each sample's
    text, token ids and logprobs concatenated; b's counts, finish, metrics and prompt
    logprobs (a's prompt logprobs if b has none)."""
    by_index = {c.index: c for c in a.outputs}
    outputs = []
    for c in b.outputs:
        prev = by_index.pop(c.index, None)
        outputs.append(c if prev is None else _merge_completion(prev, c))
    outputs = tuple(sorted([*outputs, *by_index.values()], key=lambda c: c.index))
    return b._replace(outputs=outputs, prompt_logprobs=(
        b.prompt_logprobs if b.prompt_logprobs is not None else a.prompt_logprobs))


class OutputCollector:
    """A FIFO of `RequestDelta`s for one reader on the event loop; `put` merges a delta into
    the last unread one of the same request when that request is still running, even with
    other requests' deltas queued after it (the requests of one multi-prompt HTTP request
    interleave step by step). Each request's deltas keep their order; only where several
    requests' events fall relative to each other may change."""

    def __init__(self) -> None:
        self._items: deque = deque()  # one-element lists: a merge replaces the content
        self._last: dict[str, list] = {}  # request id -> its last unread item
        self._ready = asyncio.Event()
        self.num_merged = 0  # deltas folded into an earlier one (tests, metrics)

    def put(self, delta: Any) -> None:
        """Add a delta (event-loop thread only)."""
        cell = self._last.get(delta.request_id)
        if cell is not None and _mergeable(cell[0], delta):
            cell[0] = merge_deltas(cell[0], delta)
            self.num_merged += 1
        else:
            cell = [delta]
            self._items.append(cell)
            self._last[delta.request_id] = cell
        self._ready.set()

    async def get(self) -> Any:
        """The oldest unread delta (merged with those that came after it), waiting for one."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        cell = self._items.popleft()
        rid = cell[0].request_id
        if self._last.get(rid) is cell:
            del self._last[rid]
        return cell[0]

    def empty(self) -> bool:
        return not self._items
