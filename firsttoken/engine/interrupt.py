"""Whether a short request is on its way to the engine while a step runs: the runner asks between
the long lane's interruptible encoder units, and stops at the next one if so (the short request's
prefill runs next step; the image resumes after it)."""

from __future__ import annotations


class ShortArrivals:
    """Short requests sent to the engine and not yet added to it. The engine builds it and gives it
    to the runner, which calls it; the async layer counts: ``sent`` on the event loop, ``added`` on the engine
    thread. Each count has one writer; a reader may see one of them a moment late, which costs at
    most one unit's wait or one needless cut."""

    def __init__(self) -> None:
        self.num_sent = 0
        self.num_added = 0

    def sent(self) -> None:
        self.num_sent += 1

    def added(self) -> None:
        self.num_added += 1

    def pending(self) -> bool:
        return self.num_sent > self.num_added

    def __call__(self) -> bool:
        """What the runner asks between units (a test may replace ``pending`` on the instance)."""
        return self.pending()
