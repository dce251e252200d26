"""What the HTTP layer may ask of the engine. The API depends on this protocol only."""

from __future__ import annotations

from typing import AsyncIterator, Protocol

from firsttoken.types import (
    AdmissionVerdict,
    EngineRequest,
    EngineStats,
    PromptWork,
    RequestOutput,
)


class EngineClient(Protocol):
    @property
    def is_alive(self) -> bool: ...

    @property
    def is_draining(self) -> bool:
        """Shutting down: in-flight requests finish, new ones are refused (503) and /health says
        503."""
        ...

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Submit a request and iterate over its outputs; the last one has finished=True. Cancelling
        the iterating task (client disconnect) aborts the request and frees its blocks."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def check_admission(self, work: PromptWork, request_id: str | None = None) -> AdmissionVerdict:
        """May a prompt of this size queue now? Asked before any image is decoded; refusals carry a
        reason (a metric label), a client message and an HTTP status (400 never fits, 429 lane queue
        full). With a request_id an admitted request holds its place until generate() or
        release()."""
        ...

    def release(self, request_id: str) -> None: ...
