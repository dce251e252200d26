"""A scripted EngineClient for API tests: no model, no scheduler, only what the HTTP layer can observe."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace

from firsttoken.types import (
    AdmissionVerdict,
    EngineRequest,
    EngineStats,
    FinishReason,
    PromptWork,
    RequestOutput,
    RequestStats,
    TokenLogprob,
)


@dataclass
class Script:
    """What the fake engine does with every request."""

    pieces: Sequence[str] = ("ax",) * 6  # one output (one token) per piece
    finish_reason: FinishReason = FinishReason.LENGTH
    delay_s: float = 0.0  # before each output
    hang_after: int | None = None  # block forever after this many outputs (0: before the first)
    error: str | None = None  # finish with FinishReason.ERROR and this message instead
    raise_error: Exception | None = None  # raise from generate instead
    logprobs: bool = False
    token_id: int = 100  # the id every output token has


@dataclass
class FakeEngine:
    script: Script = field(default_factory=Script)
    alive: bool = True
    requests: list[EngineRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    submitted: threading.Event = field(default_factory=threading.Event)
    abort_called: threading.Event = field(default_factory=threading.Event)
    # (work, request id) -> verdict, as the engine's admission check; None: everything is admitted
    admission: Callable[[PromptWork, str | None], AdmissionVerdict] | None = None

    @property
    def is_alive(self) -> bool:
        return self.alive

    def check_admission(self, work: PromptWork, request_id: str | None = None) -> AdmissionVerdict:
        if self.admission is not None:
            return self.admission(work, request_id)
        return AdmissionVerdict.ok("short")

    is_draining: bool = False

    def release(self, request_id: str) -> None:
        pass

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        self.requests.append(request)
        self.submitted.set()
        s = self.script
        if s.raise_error is not None:
            raise s.raise_error
        stats = RequestStats(first_scheduled_s=time.monotonic())
        for i, piece in enumerate(s.pieces):
            if s.hang_after is not None and i >= s.hang_after:
                await asyncio.Event().wait()
            if s.delay_s:
                await asyncio.sleep(s.delay_s)
            if stats.first_token_s is None:
                stats = replace(stats, prefill_done_s=time.monotonic(), first_token_s=time.monotonic())
            last = i == len(s.pieces) - 1
            if last:
                stats = replace(stats, finished_s=time.monotonic())
            logprobs = (
                (TokenLogprob(s.token_id, -0.5, ((s.token_id, -0.5), (s.token_id + 1, -1.5))),) if s.logprobs else ()
            )
            yield RequestOutput(
                request_id=request.request_id,
                new_token_ids=(s.token_id,),
                new_text=piece,
                finished=last,
                finish_reason=(FinishReason.ERROR if s.error else s.finish_reason) if last else None,
                num_prompt_tokens=request.num_prompt_tokens,
                num_output_tokens=i + 1,
                logprobs=logprobs,
                stats=stats,
                error=s.error if last else None,
            )

    async def abort(self, request_id: str) -> None:
        await asyncio.sleep(0)  # a real engine hops to its loop; the abort must survive that await
        self.aborted.append(request_id)
        self.abort_called.set()

    def stats(self) -> EngineStats:
        return EngineStats(
            kv_blocks_total=64,
            kv_blocks_used=0,
            kv_blocks_cached=3,
            kv_blocks_free=64,
            block_size=16,
            num_running=0,
            num_waiting=0,
            num_steps=len(self.requests),
            num_preemptions=0,
            max_model_len=4096,
        )
