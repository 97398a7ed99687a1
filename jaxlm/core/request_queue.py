"""The scheduler's waiting queue, one class per scheduling policy (vLLM's names).

fcfs: a deque in arrival order; a preempted request goes back to the front.
priority: a binary heap keyed by (priority, arrival time): lower values run first, ties by
arrival. Adding, peeking and popping cost O(log n) (peek O(1)) in the number of waiting
requests, so admission never sorts the queue; a preempted request is pushed back with its own
key. Removing a given request (an abort while it waits) is O(n), as in vLLM.

Each queue also says which running request its policy preempts when KV blocks run out
(``preemption_victim``): the newest under fcfs, the worst (priority, arrival) under priority.
"""

from __future__ import annotations

import abc
import collections
import enum
import heapq
import itertools
from collections.abc import Iterable, Iterator

from jaxlm.core.request import Request


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class RequestQueue(abc.ABC):
    """What the scheduler asks of its waiting queue."""

    @abc.abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a new request where the policy puts it."""

    @abc.abstractmethod
    def pop_request(self) -> Request:
        """Remove and return the request to admit next."""

    @abc.abstractmethod
    def peek_request(self) -> Request:
        """The request to admit next, left in the queue."""

    @abc.abstractmethod
    def prepend_request(self, request: Request) -> None:
        """Put back a preempted request (ahead of the requests that came after it)."""

    @abc.abstractmethod
    def remove_request(self, request: Request) -> None: ...

    @abc.abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None: ...

    @abc.abstractmethod
    def preemption_victim(self, running: list[Request]) -> int:
        """The index in ``running`` of the request to preempt when KV blocks run out."""

    @abc.abstractmethod
    def __len__(self) -> int: ...

    def __bool__(self) -> bool:
        return len(self) > 0

    @abc.abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """The waiting requests in the order they would be admitted."""

    @abc.abstractmethod
    def __contains__(self, request: object) -> bool: ...


class FCFSRequestQueue(collections.deque, RequestQueue):
    """First come, first served: a deque (so deque operations keep working)."""

    def add_request(self, request: Request) -> None:
        self.append(request)

    def pop_request(self) -> Request:
        return self.popleft()

    def peek_request(self) -> Request:
        if not self:
            raise IndexError("peek from an empty queue")
        return self[0]

    def prepend_request(self, request: Request) -> None:
        # Victims are taken newest first, so prepending each keeps arrival order at the front.
        self.appendleft(request)

    def remove_request(self, request: Request) -> None:
        self.remove(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = set(requests)
        if len(drop) < 16:  # a few C-level scans beat one Python-level rebuild
            for request in drop:
                self.remove(request)
            return
        kept = [r for r in self if r not in drop]
        self.clear()
        self.extend(kept)

    def preemption_victim(self, running: list[Request]) -> int:
        return len(running) - 1  # the newest: running is in admission order


class PriorityRequestQueue(RequestQueue):
    """Lowest (priority, arrival_time) first, in a heap. A serial number breaks exact ties
    (the n > 1 siblings of one request share its arrival time), so Requests are never compared."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._serial = itertools.count()
        self._members: set[Request] = set()  # O(1) `in` (asked for every finished request)

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._serial), request))
        self._members.add(request)

    def pop_request(self) -> Request:
        request = heapq.heappop(self._heap)[3]
        self._members.discard(request)
        return request

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0][3]

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)  # its key, not the queue's front, decides where it goes

    def remove_request(self, request: Request) -> None:
        self.remove_requests((request,))

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = set(requests)
        self._heap = [entry for entry in self._heap if entry[3] not in drop]
        heapq.heapify(self._heap)
        self._members -= drop

    def preemption_victim(self, running: list[Request]) -> int:
        # The worst (priority, arrival); among exact ties the latest admitted.
        worst = 0
        for i, r in enumerate(running):
            if (r.priority, r.arrival_time) >= (running[worst].priority, running[worst].arrival_time):
                worst = i
        return worst

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))

    def __contains__(self, request: object) -> bool:
        return request in self._members


def create_request_queue(policy: SchedulingPolicy | str) -> RequestQueue:
    policy = SchedulingPolicy(policy)
    if policy == SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue()
    return FCFSRequestQueue()
