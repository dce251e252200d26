"""Lanes: where a request waits, decided once at admission by a pure function of its prompt length.

With ``scheduling="lanes"`` a prompt (text + image tokens) shorter than ``long_prompt_threshold`` goes to the
short lane, others to the long lane. Each lane has its own queue (arrival order; the scheduler serves the long lane
in its own order when steps are time-bounded); the scheduler's one loop serves the short lane first each step and
bounds long-lane work per step, with aging so that long work runs at least every ``long_max_wait_steps + 1`` steps.
``scheduling="fcfs"`` puts everyone in one queue.
"""

from __future__ import annotations

from collections import deque

from firsttoken.config import SchedulerConfig
from firsttoken.scheduler.request import Request

SHORT = "short"
LONG = "long"
FCFS = "fcfs"


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
