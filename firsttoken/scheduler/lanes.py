"""Lanes: where a request waits, decided once at admission by a pure function of its prompt length;
how one step serves the lanes; and the order the long lane is served in.

The lane layout is a ``LanePolicy`` chosen once from ``--scheduling`` (``lane_policy``):
- ``ShortLongLanes`` (``lanes``): a prompt (text + image tokens) shorter than
  ``long_prompt_threshold`` goes to the short lane, others to the long lane. Each step serves the
  short lane first, then bounds long-lane work (pacing.py), with aging so that long work runs at
  least every ``long_max_wait_steps + 1`` steps; unless ``--no-encoder-interrupt``, the long lane's
  vision-tower work in a step may be cut by a short arrival. Steps may be time-bounded.
- ``FcfsLanes`` (``fcfs``, the seed's starting point): one FIFO queue, whole-prompt prefills and
  whole-image encodes, no time bound (a step is as long as the prompts it takes).
Each lane has its own queue (arrival order). When steps are time-bounded (or a throughput step) the
long lane is served in the order of its ``LongOrder``, chosen once from ``--long-order``:
``DeadlineOrder`` or ``LeastWorkOrder``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

from firsttoken.config import SchedulerConfig
from firsttoken.scheduler.budget import StepBudget
# (lane names: with Request.lane, used here)
from firsttoken.scheduler.request import FCFS, LONG, SHORT, Request
from firsttoken.scheduler.step import StepDraft

# of the step-time target, granted to the long lane once it has waited long_max_wait_steps
LONG_MIN_SHARE = 0.25


class LaneServer(Protocol):
    """The scheduler's one loop, as a lane policy drives it through one step (scheduler.py)."""

    def serve_lane(
        self, lane: str, budget: StepBudget, step: StepDraft, whole_prompt: bool
    ) -> bool:
        """The lane's prefill work (running first, then admissions) within ``budget``; True if any
        was scheduled."""
        ...

    def has_prefill_work(self, lane: str) -> bool:
        """Requests of the lane wait or are prefilling."""
        ...

    def long_lane_budget(self, budget: StepBudget, step: StepDraft, aging: bool,
                         held_by_short: bool) -> StepBudget | None:
        """What the long lane is served from in this step (None: it waits; pacing.py)."""
        ...

    def mark_interruptible(self, step: StepDraft) -> None:
        """The step's long-lane encoder work a short arrival may cut (encoder_plan.py)."""
        ...


class LanePolicy(Protocol):
    """The lane layout, chosen once from the config: ``route`` is a pure function of a prompt's
    length, ``names`` the lanes in service order, ``time_bounded`` whether steps may be bounded in
    time at all (pacing.py), and ``serve`` how one step serves the lanes after the decodes took
    their tokens."""

    names: tuple[str, ...]
    time_bounded: bool

    def route(self, num_prompt_tokens: int) -> str: ...

    def serve(self, lanes: LaneServer, budget: StepBudget, step: StepDraft) -> None: ...


class FcfsLanes:
    """One FIFO queue; each step admits whole prompts (their images encoded whole) in arrival order:
    the first whatever its size, more only if they fit beside it."""

    names = (FCFS,)
    time_bounded = False  # a whole prompt takes the step it needs

    def __init__(self, config: SchedulerConfig) -> None:
        """(Nothing to configure: one queue.)"""

    def route(self, num_prompt_tokens: int) -> str:
        return FCFS

    def serve(self, lanes: LaneServer, budget: StepBudget, step: StepDraft) -> None:
        lanes.serve_lane(FCFS, budget, step, whole_prompt=True)


class ShortLongLanes:
    """Short prompts first, each granted whole; the long lane fills what is left, or waits while
    short work took the step (token budgets), at most ``long_max_wait_steps`` steps in a row
    (aging)."""

    names = (SHORT, LONG)
    time_bounded = True

    def __init__(self, config: SchedulerConfig) -> None:
        self.long_prompt_threshold = config.long_prompt_threshold
        self.long_max_wait_steps = config.long_max_wait_steps
        self.encoder_interrupt = config.encoder_interrupt
        self.long_wait_steps = 0  # consecutive steps the long lane had work but was held back

    def route(self, num_prompt_tokens: int) -> str:
        return LONG if num_prompt_tokens >= self.long_prompt_threshold else SHORT

    def serve(self, lanes: LaneServer, budget: StepBudget, step: StepDraft) -> None:
        short_work = lanes.serve_lane(SHORT, budget, step, whole_prompt=False)
        self._serve_long(lanes, budget, step, held_by_short=short_work)
        if self.encoder_interrupt and step.encoder_work:
            lanes.mark_interruptible(step)

    def _serve_long(
        self, lanes: LaneServer, budget: StepBudget, step: StepDraft, held_by_short: bool
    ) -> None:
        if not lanes.has_prefill_work(LONG):
            self.long_wait_steps = 0
            return
        aging = self.long_wait_steps >= self.long_max_wait_steps
        lane_budget = lanes.long_lane_budget(budget, step, aging, held_by_short)
        served = lane_budget is not None and lanes.serve_lane(
            LONG, lane_budget, step, whole_prompt=False
        )
        if served and lane_budget is not budget:
            budget.absorb(lane_budget)
        self.long_wait_steps = 0 if served else self.long_wait_steps + 1


LANE_POLICIES: dict[str, type[FcfsLanes] | type[ShortLongLanes]] = {
    "lanes": ShortLongLanes,
    "fcfs": FcfsLanes,
}


def lane_policy(config: SchedulerConfig) -> LanePolicy:
    """The lane layout ``--scheduling`` chooses (a fresh one: ``ShortLongLanes`` counts its long
    lane's wait)."""
    return LANE_POLICIES[config.scheduling](config)


def route_lane(num_prompt_tokens: int, config: SchedulerConfig) -> str:
    """The lane the config's policy puts a prompt of this length in."""
    return lane_policy(config).route(num_prompt_tokens)


def lane_names(config: SchedulerConfig) -> tuple[str, ...]:
    """Lanes in service order."""
    return lane_policy(config).names


class LaneQueues:
    """The waiting requests, one queue per lane of the config's policy, each in arrival order (a
    preempted request goes back to the front of its own)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.queues: dict[str, deque[Request]] = {name: deque() for name in lane_names(config)}
        # short requests that waited a whole step while long work ran
        self.num_short_delayed_by_long = 0

    def count_short_delays(self, step_had_long_work: bool, num_steps: int) -> None:
        """The harmful event the seed saw: a short request that sat out a whole step while long work
        ran (counted once per request; ``num_steps``: steps with work before this one)."""
        threshold = self.config.long_prompt_threshold
        for req in self:
            if (
                req.num_prompt_tokens < threshold
                and req.arrival_step <= num_steps
                and step_had_long_work
            ):
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

    def depths(self) -> dict[str, int]:
        return {name: len(q) for name, q in self.queues.items()}

    def append(self, req: Request) -> None:
        self.queues[req.lane].append(req)

    def appendleft(self, req: Request) -> None:
        self.queues[req.lane].appendleft(req)

    def remove(self, req: Request) -> None:
        self.queues[req.lane].remove(req)


class DeadlineOrder:
    """Earliest place in line first, then arrival: a request's place is when it reached the
    scheduler plus ``--long-slack`` times its predicted work (images already encoded and a cached
    prefix cost nothing), fixed the first time it is asked for, so a later arrival passes it only
    while its own place is earlier: a request waits at most for the work that reaches the lane
    before its place comes up (no starvation). Waiting and running requests share one order (a
    waiting one whose turn has come is admitted before a running one's next chunk)."""

    merged = True

    def __init__(self, config: SchedulerConfig, is_priced: Callable[[], bool],
                 work_s: Callable[[Request], float]) -> None:
        """``work_s(req)``: the request's predicted remaining work in seconds from where it would
        start now."""
        self.slack = config.long_slack
        self.is_priced = is_priced
        self.work_s = work_s
        self._places: dict[str, float] = {}  # request id -> its place, on the scheduler's clock

    def admit(self, req: Request) -> None:
        """A new long request: the place its admission's prediction assumed, where protecting
        objectives moved it back (otherwise the usual one, given when first asked)."""
        if req.engine_request.long_place_s is not None:
            self._places[req.request_id] = req.engine_request.long_place_s

    def place_s(self, req: Request) -> float:
        place = self._places.get(req.request_id)
        if place is None:
            if not self.is_priced():  # no price yet: arrival order, decided later
                return req.queued_s
            place = self._places[req.request_id] = req.queued_s + self.slack * float(
                self.work_s(req)
            )
        return place

    def key(self, req: Request) -> tuple:
        return (self.place_s(req), req.arrival_seq)

    def after_serve(self, served_ids: set[str], candidates: Iterable[Request]) -> None:
        """(The deadline order keeps no per-step state.)"""

    def forget(self, request_id: str) -> None:
        self._places.pop(request_id, None)


class LeastWorkOrder:
    """Least predicted remaining work first, then arrival; a request the lane passed over
    ``--long-max-passes`` steps in a row goes first (aging: nobody is passed over for ever). Running
    prefills are served before admissions."""

    merged = False
    # no place in line: admission predicts a long request's wait from the lane's backlog
    place_s = None

    def __init__(self, config: SchedulerConfig, work_s: Callable[[Request], float]) -> None:
        self.max_passes = config.long_max_passes
        self.work_s = work_s
        self._passed: dict[str, int] = {}  # request id -> steps in a row the lane ran without it

    def admit(self, req: Request) -> None:
        """(Its place is its remaining work, asked each step.)"""

    def key(self, req: Request) -> tuple:
        return (
            self._passed.get(req.request_id, 0) < self.max_passes,
            self.work_s(req),
            req.arrival_seq,
        )

    def after_serve(self, served_ids: set[str], candidates: Iterable[Request]) -> None:
        """The lane ran: whoever of ``candidates`` got nothing was passed over once more."""
        for req in candidates:
            rid = req.request_id
            self._passed[rid] = 0 if rid in served_ids else self._passed.get(rid, 0) + 1

    def forget(self, request_id: str) -> None:
        self._passed.pop(request_id, None)


LongOrder = DeadlineOrder | LeastWorkOrder


def long_order(
    config: SchedulerConfig,
    is_priced: Callable[[], bool],
    place_work_s: Callable[[Request], float],
    remaining_work_s: Callable[[Request], float],
) -> LongOrder:
    """The long lane's order, chosen once from ``--long-order``. ``place_work_s``: a request's
    predicted work from where it would start now (its place in the deadline order);
    ``remaining_work_s``: from where it is."""
    if config.long_order == "deadline":
        return DeadlineOrder(config, is_priced, place_work_s)
    return LeastWorkOrder(config, remaining_work_s)
