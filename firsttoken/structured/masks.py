"""Constrained requests' grammar work, off the step's thread and bounded: ``MaskWorker`` and
``ConstrainedRow``.

Per token a constrained request asks its grammar library two things: advance the matcher by the
sampled token, then fill the next token's mask. Either can take long: an ambiguous grammar's Earley
rows grow with the output (each token's work ~cubic in its length), and no call into the library can
be interrupted. So neither runs on the step's thread. Each request's next mask is one job on a pool
of ``mask_threads`` threads (llguidance works without the GIL, so requests' jobs run at once, and
beside the forward), started as soon as its token is sampled (its first mask: as soon as the runner
meets the request), so it runs while the engine updates, schedules and runs the next forward.

Contract with the step (runner/model_runner.py), which reads ``MaskWorker.collect`` once its forward
is done:
- a row whose mask is ready samples under it; a constrained row never samples without its mask, and
  never twice under one mask (a mask read once is never ready again until a new job filled it);
- a step waits for a job's mask at most once, at most ``mask_wait_s`` from its forward's end: the
  first step to ask for it (the step after the token it takes was sampled: the usual case, where the
  job is done or nearly). A row whose mask is not ready then is **pending**: it samples nothing in
  this step and its last token runs again in the next (its job goes on meanwhile); later steps ask
  without waiting, so its batch-mates wait for it at most once and lose no step. The seconds a step
  waited are reported (``StepMasks.wait_s``);
- a row whose grammar has failed it (a dead end: no token can continue the output; a parser limit),
  whose jobs have used more than ``request_mask_s`` seconds of CPU in all (each job's own thread
  time, counted when it ends), or whose mask has been pending for more than ``pending_mask_s``
  seconds of wall time (its job queued behind other requests' jobs or still running) is **refused**:
  the request ends with that reason, the client's grammar's fault;
- a row whose library raised, or that is asked for a mask it was already given, is **crashed**: the
  request ends with an internal error.

One job at a time per request: a new one starts only after the step read the last one's mask (the
matcher is one thread's at a time: the job's, else the runner's, which only reads it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from firsttoken.config import GrammarConfig
from firsttoken.structured.bitmask import allocate_bitmask

log = logging.getLogger("firsttoken.structured")

CRASHED = "the output constraint failed: the grammar library could not say what may follow"
STALE = "internal error: the output constraint's next mask was asked for before its grammar took the last token"


class ConstrainedRow:
    """One constrained request's matcher, its next mask and the CPU seconds its jobs used.
    ``matcher``: the request's own (``GrammarMatcher`` or anything with its
    ``fill_bitmask(bitmask, row)``, ``accept(token) -> bool`` and ``error``)."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        # [1, ceil(vocab / 32)] int32: the next token's, once ready
        self.mask = allocate_bitmask(1, vocab_size)
        self.refused: str | None = None  # why the grammar failed the request (the client's fault)
        self.crashed = False  # the library raised
        # CPU seconds the done jobs used (each job adds its own before it is done)
        self.spent_s = 0.0
        self._job: Future | None = None
        # when a step first asked for the job's mask (None: no step yet)
        self._asked_s: float | None = None
        self._read = False  # a step sampled under the job's mask: the next needs a new job

    def start(self, pool: Executor, token_id: int | None, cpu_clock: Callable[[], float]) -> None:
        """Its next job on ``pool`` (``MaskWorker.start``)."""
        self._job = pool.submit(self._run, token_id, cpu_clock)
        self._asked_s = None
        self._read = False

    def cancel(self) -> None:
        """The request is gone: its job, if it has not begun, never will (a running one finishes,
        unread)."""
        if self._job is not None:
            self._job.cancel()

    @property
    def done(self) -> bool:
        """Its job ended (whatever it recorded is there to read)."""
        return self._job is not None and self._job.done()

    @property
    def read(self) -> bool:
        """A step sampled under the job's mask (``take``): it is used up."""
        return self._read

    def ask(self, now: float) -> bool:
        """A step asks for the job's mask at ``now``: whether it is the first to (and so may wait
        for it)."""
        first = self._asked_s is None
        if first:
            self._asked_s = now
        return first

    def pending_s(self, now: float) -> float:
        """Seconds since a step first asked for the job's mask (0 before any did)."""
        return 0.0 if self._asked_s is None else now - self._asked_s

    def take(self) -> None:
        """The step samples under the mask: it is not to be read again before a new job (``start``)
        fills it."""
        self._read = True

    def wait(self, timeout_s: float) -> None:
        """Until the job is done, at most ``timeout_s``."""
        if self._job is not None and timeout_s > 0:
            try:
                self._job.exception(timeout=timeout_s)  # the job itself never raises (``_run``)
            except TimeoutError:
                pass

    def _run(self, token_id: int | None, cpu_clock: Callable[[], float]) -> None:
        """The job: take ``token_id`` (None: none), then fill the next mask; whatever happens is
        recorded here. ``cpu_clock``: this thread's CPU seconds (``time.thread_time``), so time the
        thread waited for a core is not charged to the grammar."""
        start = cpu_clock()
        try:
            if token_id is not None and not self.matcher.accept(token_id):
                self.refused = (
                    self.matcher.error or "the grammar refused a token its own mask allowed"
                )
            else:
                self.matcher.fill_bitmask(self.mask, 0)
                # a dead end, a parser limit: the mask says nothing usable
                self.refused = self.matcher.error
        except Exception as e:  # the library failed this request's grammar: its own failure only
            log.warning("the output grammar's library failed: %s", e)
            self.crashed = True
        finally:
            self.spent_s += cpu_clock() - start


@dataclass(frozen=True)
class StepMasks:
    """What ``MaskWorker.collect`` found for a step's constrained rows, by request id (each in one
    place), and how long it waited for them."""

    ready: frozenset[str] = frozenset()  # sample under their row's ``mask``
    # no mask in time: nothing sampled, the last token runs again
    pending: frozenset[str] = frozenset()
    # the grammar ended the request: why (client-safe)
    refused: dict[str, str] = field(default_factory=dict)
    # the library raised, or a mask was reused: internal
    crashed: dict[str, str] = field(default_factory=dict)
    wait_s: float = 0.0  # seconds the step waited for masks (on MaskWorker's clock)
    num_waits: int = 0  # rows it waited for (each job's mask is waited for at most once)


class MaskWorker:
    """The pool that runs constrained rows' jobs, and the bounds a step reads them under
    (``GrammarConfig``). ``clock``: monotonic wall seconds, for the step's wait and a mask's pending
    time; ``cpu_clock``: the calling thread's CPU seconds, which each job charges to its request's
    budget (a test may pass its own of either)."""

    def __init__(self, config: GrammarConfig, clock: Callable[[], float] = time.monotonic,
                 cpu_clock: Callable[[], float] = time.thread_time) -> None:
        self.config = config
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._pool: ThreadPoolExecutor | None = None  # started with the first job

    def start(self, row: ConstrainedRow, token_id: int | None = None) -> None:
        """Advance ``row`` by ``token_id`` (None: its first mask) and fill its next mask, on the
        pool. Only once the row's last job is done and its mask was read (or before its first)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                self.config.mask_threads, thread_name_prefix="firsttoken-masks"
            )
        row.start(self._pool, token_id, self._cpu_clock)

    def collect(self, rows: Mapping[str, ConstrainedRow]) -> StepMasks:
        """Each row's verdict for this step (module docstring). Waits at most ``mask_wait_s`` from
        now, for all the rows whose job no step has asked for before together (their jobs run at
        once); none for the others."""
        now = self._clock()
        deadline = now + self.config.mask_wait_s
        ready: set[str] = set()
        pending: set[str] = set()
        refused: dict[str, str] = {}
        crashed: dict[str, str] = {}
        wait_s = 0.0
        num_waits = 0
        for rid, row in rows.items():
            if row.read:
                log.error(
                    "request %s: a constrained row's mask was asked for again without a new job",
                    rid,
                )
                crashed[rid] = STALE
                continue
            # only the first ask waits
            if row.ask(now) and not row.done and self.config.mask_wait_s > 0:
                began = self._clock()
                row.wait(deadline - began)
                wait_s += self._clock() - began
                num_waits += 1
            done = row.done  # once: a job ending during these checks is read next step
            if done and row.crashed:
                crashed[rid] = CRASHED
            elif done and row.refused is not None:
                refused[rid] = f"the output constraint failed: {row.refused}"
            elif done and row.spent_s > self.config.request_mask_s:
                refused[rid] = (
                    f"the output constraint failed: its grammar needed more than "
                    f"{self.config.request_mask_s:g} s of work (--grammar-mask-budget); an ambiguous "
                    f"grammar's work grows with every token: make it unambiguous or shorter"
                )
            elif done:
                row.take()
                ready.add(rid)
            elif row.pending_s(self._clock()) > self.config.pending_mask_s:
                refused[rid] = (
                    f"the output constraint failed: its grammar's next token waited more than "
                    f"{self.config.pending_mask_s:g} s for its work (twice --grammar-mask-budget); an "
                    f"ambiguous grammar's work grows with every token: make it unambiguous or shorter"
                )
            else:
                pending.add(rid)
        return StepMasks(frozenset(ready), frozenset(pending), refused, crashed, wait_s, num_waits)


def stack_masks(
    rows: list[ConstrainedRow | None], out: np.ndarray | None
) -> tuple[np.ndarray, list[int]]:
    """The rows' masks as one bitmask (row i: rows[i]'s; None rows are left as they were) and the
    indices of the rows that have one (at least one must); ``out`` is reused when it is [>=
    len(rows), words] int32."""
    constrained = [i for i, r in enumerate(rows) if r is not None]
    words = rows[constrained[0]].mask.shape[1]  # type: ignore[union-attr]
    if out is None or out.shape[0] < len(rows) or out.shape[1] != words:
        out = allocate_bitmask(max(len(rows), 8), 32 * words)
    for i in constrained:
        out[i] = rows[i].mask[0]  # type: ignore[union-attr]
    return out, constrained
