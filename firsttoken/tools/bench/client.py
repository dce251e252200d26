"""One streamed chat completion, timed from the client's side -> RequestRecord.

TTFT is the time from sending the request to the first chunk whose delta carries non-empty content
(the role-only first chunk vLLM and firsttoken send does not count: the user sees nothing yet). ITL
are the gaps between consecutive content chunks; TPOT = (e2e - ttft) / (completion_tokens - 1).
completion_tokens come from the usage chunk when the server sends one, else from the number of
content chunks (tokens_from_usage False).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from firsttoken.tools.bench.sse import SSEEvent, SSEParser


@dataclass
class RequestRecord:
    index: int  # order of sending within the run
    session: int
    turn: int
    cls: str
    num_images: int
    warmup: bool
    start_s: float  # send time, seconds since the run began
    status: int | None = None  # HTTP status; None when no response came
    # None: succeeded; else "http_400", "stream_error", "timeout", "connect_error", ...
    error: str | None = None
    error_message: str | None = None
    retry_after_s: float | None = None  # a refusal's Retry-After header (seconds), when it sent one
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    num_content_chunks: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    tokens_from_usage: bool = False
    server_timings: dict[str, Any] | None = None  # usage.firsttoken when the server sends it
    saw_done: bool = False
    finish_reason: str | None = None
    output_text: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        if (
            self.ttft_s is None
            or self.e2e_s is None
            or not self.completion_tokens
            or self.completion_tokens < 2
        ):
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "output_text"}
        d["tpot_s"] = self.tpot_s
        d["output_chars"] = len(self.output_text)
        return d


async def send_chat(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], record: RequestRecord, t0: float
) -> RequestRecord:
    """POST a streaming chat completion and fill `record`; never raises for server or network
    trouble."""
    start = time.perf_counter()
    record.start_s = start - t0
    last_content: float | None = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            record.status = resp.status_code
            if resp.status_code != 200:
                raw = await resp.aread()
                record.error = f"http_{resp.status_code}"
                record.error_message = _error_message(raw)
                record.retry_after_s = _seconds(resp.headers.get("retry-after"))
                record.e2e_s = time.perf_counter() - start
                return record
            parser = SSEParser()
            async for line in resp.aiter_lines():
                event = parser.feed_line(line)
                if event is not None:
                    now = time.perf_counter()
                    last_content = _on_event(event, record, start, now, last_content)
            tail = parser.flush()
            if tail is not None:
                last_content = _on_event(tail, record, start, time.perf_counter(), last_content)
    except httpx.TimeoutException as exc:
        record.error, record.error_message = "timeout", str(exc) or type(exc).__name__
    except httpx.HTTPError as exc:
        record.error, record.error_message = "connect_error", str(exc) or type(exc).__name__
    record.e2e_s = time.perf_counter() - start
    if record.error is None and not record.saw_done:
        record.error, record.error_message = (
            "incomplete_stream",
            "the stream ended without data: [DONE]",
        )
    if record.completion_tokens is None and record.error is None:
        record.completion_tokens = record.num_content_chunks
    return record


def _seconds(header: str | None) -> float | None:
    try:
        return float(header) if header is not None else None
    except ValueError:
        return None  # an HTTP-date: not what OpenAI-compatible servers send


def _on_event(event: SSEEvent, record: RequestRecord, start: float, now: float,
              last_content: float | None) -> float | None:
    if event.is_done:
        record.saw_done = True
        return last_content
    try:
        chunk = json.loads(event.data)
    except json.JSONDecodeError:
        chunk = None
    if not isinstance(chunk, dict):
        record.error, record.error_message = "bad_chunk", event.data[:200]
        return last_content
    if event.event == "error" or "error" in chunk:
        err = chunk.get("error", chunk)
        record.error = "stream_error"
        record.error_message = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        return last_content
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        content = delta.get("content")
        if content:
            record.output_text += content
            record.num_content_chunks += 1
            if record.ttft_s is None:
                record.ttft_s = now - start
            elif last_content is not None:
                record.itl_s.append(now - last_content)
            last_content = now
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        record.prompt_tokens = usage.get("prompt_tokens")
        if usage.get("completion_tokens") is not None:
            record.completion_tokens = int(usage["completion_tokens"])
            record.tokens_from_usage = True
        timings = usage.get("firsttoken")
        if isinstance(timings, dict):
            record.server_timings = timings
    return last_content


def _error_message(raw: bytes) -> str:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return raw[:200].decode("utf-8", "replace")
    err = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(err, dict):
        return str(err.get("message", err))
    return str(err)
