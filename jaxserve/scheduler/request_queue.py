"""Waiting queues: FCFS (a deque) and priority (a heap on (priority, arrival)).

Both answer the same small interface so the scheduler does not branch on the
policy: `push` (a new request), `push_front` (a preempted or skipped request
that must go first), `peek`, `pop`, `remove`, `len`, iteration in order.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Iterator

from jaxserve.scheduler.request import Request


class FCFSQueue:
    """First come, first served; a preempted request goes back to the front."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def push(self, req: Request) -> None:
        self._q.append(req)

    def push_front(self, req: Request) -> None:
        self._q.appendleft(req)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """Lower `priority` first, then earlier `arrival_time`, then insertion order.

    A preempted request re-enters at its own key, which puts it ahead of
    everything that arrived after it at the same priority.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    @staticmethod
    def key(req: Request) -> tuple[int, float]:
        return (req.priority, req.arrival_time)

    def push(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._counter), req))

    push_front = push

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, req: Request) -> None:
        for i, entry in enumerate(self._heap):
            if entry[3] is req:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"{req.request_id!r} is not in the waiting queue")

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))
