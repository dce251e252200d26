"""What the runner must be told with the next batch, gathered between batches: plain ids and frozen
request data."""

from __future__ import annotations

from dataclasses import dataclass, field

from firsttoken.batch import NewRequest


@dataclass
class RunnerOutbox:
    # first admissions: the runner's first sight of them
    new: list[NewRequest] = field(default_factory=list)
    # preempted by recompute: their KV state goes
    preempted_ids: list[str] = field(default_factory=list)
    # finished since it got them: all of their state goes
    finished_ids: list[str] = field(default_factory=list)

    def take(self) -> RunnerOutbox:
        """Everything gathered since the last batch; gathering starts again, empty."""
        taken = RunnerOutbox(self.new, self.preempted_ids, self.finished_ids)
        self.new, self.preempted_ids, self.finished_ids = [], [], []
        return taken
