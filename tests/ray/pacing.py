"""A fault hook for engine replicas in another process: while a flag file exists, every sampled token of every
request waits ``delay_s`` first, so a request asked for 30,000 tokens is still running whatever the test does next
(tests assert the order of events; this only keeps the machine's speed out of them). Pickled to the replicas."""

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
