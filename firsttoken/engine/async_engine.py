"""The asyncio bridge: the engine runs in one dedicated thread; the event loop never waits on a
step.

Commands (add, abort) go to the engine thread through a queue; outputs come back to each request's
asyncio queue through ``loop.call_soon_threadsafe``. The engine thread is the only thread that runs
model code and owns torch's intra-op threads (``num_threads``). If the loop dies, every open stream
gets an error and ``is_alive`` turns False, so /health answers 503.

Unread outputs are bounded: a client that stops reading a stream (its socket full, the SSE writer
stuck in ``send``) stops taking outputs from its queue while the engine goes on generating for it at
full speed, holding a batch slot and KV blocks. When a request has ``max_unread_outputs`` outputs
delivered and not taken, the engine thread aborts it (finish reason ``abort``, its blocks freed
within the step), puts one final ``abort`` output in its queue (the queue never grows past the bound
+ 1), logs it once and reports it through ``on_abort(request_id, ABORT_CLIENT_NOT_READING)`` (a
metric). A client that reads as fast as tokens come never has more than a few outputs in its queue;
one reading slowly is cut off only once the transport's buffers and then this many outputs are
waiting.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import AsyncIterator

import torch

from firsttoken.engine.engine import LLMEngine
from firsttoken.scheduler.admission import Reservations
from firsttoken.scheduler.lanes import SHORT, route_lane
from firsttoken.types import (
    AdmissionVerdict,
    EngineRequest,
    EngineStats,
    FinishReason,
    PromptWork,
    RequestOutput,
)

log = logging.getLogger("firsttoken.engine")


# an admission place not claimed by generate() within this long is dropped
RESERVATION_TTL_S = 120.0
ABORT_CLIENT_NOT_READING = "client_not_reading"  # the abort reason, a metric label


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


@dataclass(frozen=True)
class _Add:
    request: EngineRequest
    loop: asyncio.AbstractEventLoop
    outputs: "asyncio.Queue[RequestOutput | BaseException]"
    backlog: "_Backlog"


class _Backlog:
    """Outputs delivered to one request's queue and taken from it. One writer each: ``delivered``
    only by the engine thread, ``taken`` only by the event loop; the engine thread reads both (int
    reads are atomic)."""

    def __init__(self) -> None:
        self.delivered = 0
        self.taken = 0

    @property
    def unread(self) -> int:
        return self.delivered - self.taken


@dataclass(frozen=True)
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(
        self, engine: LLMEngine, on_abort: Callable[[str, str], None] | None = None
    ) -> None:
        """``engine.config`` says the torch threads and how many outputs a request may leave
        unread."""
        self.engine = engine
        self.num_threads = engine.config.num_threads
        self.max_unread_outputs = engine.config.max_unread_outputs
        # (request id, reason): for a metric
        self._on_abort = on_abort or (lambda request_id, reason: None)
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._streams: dict[str, _Add] = {}
        self._alive = False
        self._in_thread = True
        self._stopping = False
        self._draining = False
        # admitted but not yet handed to the engine: one lock over each check and its hold
        self._reservations = Reservations(RESERVATION_TTL_S)
        self._reservations_lock = threading.Lock()
        self._stats = engine.stats()
        # short requests sent by generate() (event loop) and handed to the engine (engine thread):
        # while more were sent than handed over, a short request is waiting for the step in flight,
        # and the runner may cut the long lane's encoder work at its next unit
        # (--no-encoder-interrupt turns that off in the scheduler)
        self._short_arrivals = engine.short_arrivals
        self._thread = threading.Thread(target=self._run, name="firsttoken-engine", daemon=True)

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self, in_thread: bool = True) -> None:
        """Run the engine loop in its thread. ``in_thread`` False: alive without it; the caller
        applies the queued commands and steps the engine itself (a test that drives both sides in
        one thread)."""
        self._alive = True
        self._in_thread = in_thread
        if in_thread:
            self._thread.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stopping = True
        self._commands.put(None)
        # started without its thread (start(in_thread=False)): nothing to join
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def is_alive(self) -> bool:
        return self._alive and (not self._in_thread or self._thread.is_alive())

    @property
    def is_draining(self) -> bool:
        return self._draining

    def begin_drain(self) -> None:
        """Stop taking new requests; those in flight go on."""
        self._draining = True

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- EngineClient ----------------------------------------------------------------------------
    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        backlog = _Backlog()
        if self._is_short(request):
            self._short_arrivals.sent()
        self._commands.put(_Add(request, asyncio.get_running_loop(), outputs, backlog))
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                backlog.taken += 1
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # client went away (task cancelled) or the consumer stopped early
                self._commands.put(_Abort(request.request_id))

    async def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def stats(self) -> EngineStats:
        return self._stats

    def check_admission(self, work: PromptWork, request_id: str | None = None) -> AdmissionVerdict:
        """Would this prompt be queued now, and how long until its first token? Counts the lane's
        queue plus requests already admitted here but still preprocessing (a burst of large images
        all asks before any is queued: their work is ahead of this one too). With a request_id an
        admitted request holds its place until generate() hands it to the engine or release() gives
        it back."""
        with self._reservations_lock:
            now = time.monotonic()
            lane = route_lane(work.num_prompt_tokens, self.engine.config.scheduler)
            verdict = self.engine.check_admission(
                work, self._reservations.pending(lane, request_id, now)
            )
            if verdict.admitted and request_id is not None:
                held = replace(work, admitted_s=now, long_place_s=verdict.long_place_s)
                self._reservations.hold(request_id, lane, held)
            return verdict

    def release(self, request_id: str) -> None:
        """Give back an admission place that will not be used (preprocessing failed after the
        check)."""
        with self._reservations_lock:
            self._reservations.release(request_id)

    # ---- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        try:
            while not self._stopping:
                block = not self.engine.has_unfinished()
                if not self._drain_commands(block):
                    break
                # tokens leave before deferred work
                for out in self.engine.step(deliver=self._deliver_all):
                    self._deliver(out)
                self._stats = self.engine.stats()
        # the loop itself broke: tell everyone, report dead (/health 503); the thread ends
        except BaseException:
            log.exception("engine loop died")
            self._alive = False
            for add in list(self._streams.values()):
                add.loop.call_soon_threadsafe(
                    add.outputs.put_nowait, EngineDeadError("the engine stopped")
                )
            self._streams.clear()
        finally:
            self._alive = False

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands; wait for one when idle. Returns False on shutdown."""
        while True:
            try:
                cmd = self._commands.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return True
            if cmd is None:
                return False
            self._apply(cmd)
            block = False

    def _apply(self, cmd: _Add | _Abort) -> None:
        if isinstance(cmd, _Abort):
            self._streams.pop(cmd.request_id, None)
            self.engine.abort(cmd.request_id)
            return
        rid = cmd.request.request_id
        if self._is_short(cmd.request):
            self._short_arrivals.added()
        self.release(rid)  # from here on the lane queue itself counts it
        try:
            self.engine.add_request(cmd.request)
        except ValueError as e:  # refused at admission: the message is written for the client (400)
            cmd.loop.call_soon_threadsafe(cmd.outputs.put_nowait, e)
            return
        # anything else fails this request alone (500), never the loop everyone shares
        except Exception as e:
            log.exception("could not add request %s", rid)
            cmd.loop.call_soon_threadsafe(cmd.outputs.put_nowait, e)
            return
        self._streams[rid] = cmd

    def _is_short(self, request: EngineRequest) -> bool:
        return route_lane(request.num_prompt_tokens, self.engine.config.scheduler) == SHORT

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if not out.finished and stream.backlog.unread >= self.max_unread_outputs:
            self._abort_unread(stream, out)
            return
        if out.finished:
            del self._streams[out.request_id]
        stream.backlog.delivered += 1
        stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, out)

    def _abort_unread(self, stream: _Add, out: RequestOutput) -> None:
        """The client has not taken its last ``max_unread_outputs`` outputs: abort the request, say
        so once."""
        rid = out.request_id
        del self._streams[rid]
        self.engine.abort(rid)
        log.warning(
            "request %s aborted: its client left %d outputs unread (--max-unread-outputs); it is not reading",
            rid,
            stream.backlog.unread,
        )
        self._on_abort(rid, ABORT_CLIENT_NOT_READING)
        final = RequestOutput(
            request_id=rid,
            new_token_ids=(),
            new_text="",
            finished=True,
            finish_reason=FinishReason.ABORT,
            num_prompt_tokens=out.num_prompt_tokens,
            num_output_tokens=out.num_output_tokens,
        )
        stream.backlog.delivered += 1
        stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, final)
