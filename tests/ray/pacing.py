"""Fault hooks for engine replicas in another process, pickled to the replicas; each acts while a flag file exists
(tests create and remove it, so one hook serves a whole session):

- ``PaceWhileFlag``: every sampled token of every request waits ``delay_s`` first, so a request asked for 30,000
  tokens is still running whatever the test does next (tests assert the order of events; this only keeps the
  machine's speed out of them).
- ``FailWhileFlag``: every request fails at its first sampled token, after the replica admitted and prefilled it;
  the runner turns the raise into that request's failure (a 500 to its client), the replica and its engine go on.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

DELAY_S = 0.05


@dataclass(frozen=True)
class PaceWhileFlag:
    path: str  # the flag file, on the one machine the test cluster runs on

    def __call__(self, stage: str, request_id: str) -> None:
        if stage == "sample" and os.path.exists(self.path):
            time.sleep(DELAY_S)


class InjectedFailure(Exception):
    """Stands for anything going wrong inside one request's work on a replica."""


@dataclass(frozen=True)
class FailWhileFlag:
    path: str  # the flag file, as PaceWhileFlag's
    pace: PaceWhileFlag  # what the hook does while this flag is absent

    def __call__(self, stage: str, request_id: str) -> None:
        if stage == "sample" and os.path.exists(self.path):
            raise InjectedFailure(f"request {request_id} failed on purpose")
        self.pace(stage, request_id)
