"""Lanes: where a request waits, decided once at admission by a pure function of its prompt length, and the order
the long lane is served in.

With ``scheduling="lanes"`` a prompt (text + image tokens) shorter than ``long_prompt_threshold`` goes to the
short lane, others to the long lane. Each lane has its own queue (arrival order); the scheduler's one loop serves the
short lane first each step and bounds long-lane work per step, with aging so that long work runs at least every
``long_max_wait_steps + 1`` steps. When steps are time-bounded (or a throughput step) the long lane is served in the
order of its ``LongOrder``, chosen once from ``--long-order``: ``DeadlineOrder`` or ``LeastWorkOrder``.
``scheduling="fcfs"`` puts everyone in one queue.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from firsttoken.config import SchedulerConfig
from firsttoken.scheduler.request import Request

SHORT = "short"
LONG = "long"
FCFS = "fcfs"
LONG_MIN_SHARE = 0.25  # of the step-time target, granted to the long lane once it has waited long_max_wait_steps


def route_lane(num_prompt_tokens: int, config: SchedulerConfig) -> str:
    if config.scheduling == "fcfs":
        return FCFS
    return LONG if num_prompt_tokens >= config.long_prompt_threshold else SHORT


def lane_names(config: SchedulerConfig) -> tuple[str, ...]:
    """Lanes in service order."""
    return (FCFS,) if config.scheduling == "fcfs" else (SHORT, LONG)


class LaneQueues:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.queues: dict[str, deque[Request]] = {name: deque() for name in lane_names(config)}
        self.num_short_delayed_by_long = 0  # short requests that waited a whole step while long work ran

    def count_short_delays(self, step_had_long_work: bool, num_steps: int) -> None:
        """The harmful event the seed saw: a short request that sat out a whole step while long work ran (counted
        once per request; ``num_steps``: steps with work before this one)."""
        threshold = self.config.long_prompt_threshold
        for req in self:
            if req.num_prompt_tokens < threshold and req.arrival_step <= num_steps and step_had_long_work:
                if not req.delayed_by_long:
                    req.delayed_by_long = True
                    self.num_short_delayed_by_long += 1

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def __iter__(self):
        for q in self.queues.values():
            yield from q

    def __contains__(self, req: Request) -> bool:
        return req in self.queues[req.lane]

    def route(self, num_prompt_tokens: int) -> str:
        return route_lane(num_prompt_tokens, self.config)

    def depths(self) -> dict[str, int]:
        return {name: len(q) for name, q in self.queues.items()}

    def append(self, req: Request) -> None:
        self.queues[req.lane].append(req)

    def appendleft(self, req: Request) -> None:
        self.queues[req.lane].appendleft(req)

    def remove(self, req: Request) -> None:
        self.queues[req.lane].remove(req)


class DeadlineOrder:
    """Earliest place in line first, then arrival: a request's place is when it reached the scheduler plus
    ``--long-slack`` times its predicted work (images already encoded and a cached prefix cost nothing), fixed the
    first time it is asked for, so a later arrival passes it only while its own place is earlier: a request waits at
    most for the work that reaches the lane before its place comes up (no starvation). Waiting and running requests
    share one order (a waiting one whose turn has come is admitted before a running one's next chunk)."""

    merged = True

    def __init__(self, config: SchedulerConfig, is_priced: Callable[[], bool],
                 work_s: Callable[[Request], float]) -> None:
        """``work_s(req)``: the request's predicted remaining work in seconds from where it would start now."""
        self.slack = config.long_slack
        self.is_priced = is_priced
        self.work_s = work_s
        self._places: dict[str, float] = {}  # request id -> its place, on the scheduler's clock

    def admit(self, req: Request) -> None:
        """A new long request: the place its admission's prediction assumed, where protecting objectives moved it
        back (otherwise the usual one, given when first asked)."""
        if req.engine_request.long_place_s is not None:
            self._places[req.request_id] = req.engine_request.long_place_s

    def place_s(self, req: Request) -> float:
        place = self._places.get(req.request_id)
        if place is None:
            if not self.is_priced():  # no price yet: arrival order, decided later
                return req.queued_s
            place = self._places[req.request_id] = req.queued_s + self.slack * float(self.work_s(req))
        return place

    def key(self, req: Request) -> tuple:
        return (self.place_s(req), req.arrival_seq)

    def after_serve(self, served_ids: set[str], candidates: Iterable[Request]) -> None:
        """(The deadline order keeps no per-step state.)"""

    def forget(self, request_id: str) -> None:
        self._places.pop(request_id, None)


class LeastWorkOrder:
    """Least predicted remaining work first, then arrival; a request the lane passed over ``--long-max-passes``
    steps in a row goes first (aging: nobody is passed over for ever). Running prefills are served before
    admissions."""

    merged = False
    place_s = None  # no place in line: admission predicts a long request's wait from the lane's backlog

    def __init__(self, config: SchedulerConfig, work_s: Callable[[Request], float]) -> None:
        self.max_passes = config.long_max_passes
        self.work_s = work_s
        self._passed: dict[str, int] = {}  # request id -> steps in a row the lane ran without it

    def admit(self, req: Request) -> None:
        """(Its place is its remaining work, asked each step.)"""

    def key(self, req: Request) -> tuple:
        return (self._passed.get(req.request_id, 0) < self.max_passes, self.work_s(req), req.arrival_seq)

    def after_serve(self, served_ids: set[str], candidates: Iterable[Request]) -> None:
        """The lane ran: whoever of ``candidates`` got nothing was passed over once more."""
        for req in candidates:
            rid = req.request_id
            self._passed[rid] = 0 if rid in served_ids else self._passed.get(rid, 0) + 1

    def forget(self, request_id: str) -> None:
        self._passed.pop(request_id, None)


LongOrder = DeadlineOrder | LeastWorkOrder


def long_order(config: SchedulerConfig, is_priced: Callable[[], bool], place_work_s: Callable[[Request], float],
               remaining_work_s: Callable[[Request], float]) -> LongOrder:
    """The long lane's order, chosen once from ``--long-order``. ``place_work_s``: a request's predicted work from
    where it would start now (its place in the deadline order); ``remaining_work_s``: from where it is."""
    if config.long_order == "deadline":
        return DeadlineOrder(config, is_priced, place_work_s)
    return LeastWorkOrder(config, remaining_work_s)
