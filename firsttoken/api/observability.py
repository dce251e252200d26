"""What an operator sees of a running server: /metrics, /stats, /dashboard, the request log, API-key
auth.

    GET /metrics    Prometheus text (firsttoken_* families, one registry per app; metrics/prometheus.py)
    GET /stats      P50/P95/P99 of TTFT and each phase over the sliding window, per request class (0, 1, 2+
                    images, or video: metrics/window.py IMAGE_CLASSES), plus live
                    engine gauges and cache hit rates (metrics/window.py), as JSON
    GET /dashboard  one self-contained HTML page (inline JS/CSS, canvas charts) that polls /stats

``Observability.install(app, engine)`` adds the routes and two middlewares and returns the engine
client the routes should use: a thin wrapper that timestamps every output token (inter-token
latency, measured where the tokens reach the event loop). ``request_done(request_id, timeline)`` is
called by the routes once a response has been handed to the transport; it completes the request's
record in the Recorder (see recorder.py for why records are completed here and not in the engine
thread).

Auth (``api_key``): every route except /health and /dashboard needs ``Authorization: Bearer <key>``,
compared with hmac.compare_digest; otherwise 401 in OpenAI's error shape. /dashboard is open because
a browser cannot attach a header to a navigation; the page holds no data, asks for the key, keeps it
in sessionStorage and sends it on its /stats fetches, which are checked like any other route.

Middleware order (outermost first): RejectionCounter (sees every 4xx, the 413s
RequestContextMiddleware answers itself included, and the stage of every client that left, once its
request is done) -> RequestContextMiddleware (request id) -> ApiKeyMiddleware (needs the request id
for its log context and its 401) -> routes.
"""

from __future__ import annotations

import hmac
import json
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from importlib import resources
from pathlib import Path
from typing import IO, Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from firsttoken.api.errors import REJECT_REASON_KEY, error_response
from firsttoken.api.logs import current_request_id
from firsttoken.api.middleware import CLIENT_LEFT_KEY, REQUEST_ID_KEY
from firsttoken.api.openapi import answer
from firsttoken.config import ServerConfig
from firsttoken.engine.client import EngineClient
from firsttoken.metrics.prometheus import make_registry
from firsttoken.metrics.recorder import DEFAULT_LANE, Recorder, RequestRecord, ratio_summary
from firsttoken.metrics.stats import EngineSnapshot
from firsttoken.metrics.timeline import Timeline
from firsttoken.types import EngineRequest, EngineStats, RequestOutput

OPEN_PATHS = frozenset({"/health", "/dashboard"})
REJECTION_REASONS = {
    400: "bad_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    408: "body_timeout",
    413: "body_too_large",
    415: "unsupported_encoding",
    429: "too_many_requests",
}
# not a rejection: the client left (a client disconnect, stage "answer")
CLIENT_CLOSED_REQUEST = 499
_MAX_TRACKED = 10_000  # per-request side data kept for requests whose response never completes


def engine_snapshot(stats: EngineStats) -> EngineSnapshot:
    """EngineStats -> the exporter's plain data (no lanes reported: everything waits in
    "default")."""
    return EngineSnapshot(
        kv_blocks_used=stats.kv_blocks_used,
        kv_blocks_total=stats.kv_blocks_total,
        num_running=stats.num_running,
        num_queued_by_lane=dict(stats.num_waiting_by_lane) or {DEFAULT_LANE: stats.num_waiting},
        encoder_cache_bytes=stats.encoder_cache_bytes,
        preemptions_by_reason=dict(stats.preemptions_by_reason),
        num_short_delayed_by_long=stats.num_short_delayed_by_long,
        num_encoder_interrupts=stats.num_encoder_interrupts,
        encoder_cache_hits=stats.encoder_cache_hits,
        encoder_cache_misses=stats.encoder_cache_misses,
        prefix_cache_hit_tokens=stats.prefix_cache_hit_tokens,
        prefix_cache_query_tokens=stats.prefix_cache_query_tokens,
        cost_model=dict(stats.cost_model),
        cost_model_coverage=dict(stats.cost_model_coverage),
        step_time_target_s=stats.step_time_target_s,
        itl_target_s=stats.itl_target_s,
        ttft_bias=dict(stats.ttft_bias),
        block_size=stats.block_size,
        long_lane_only={k: dict(v) for k, v in stats.long_lane_only.items()},
    )


class RequestLog:
    """``--request-log FILE``: one JSON object per finished request, appended, flushed per line."""

    def __init__(self, path: Path, content_of: Callable[[str], dict | None] | None = None) -> None:
        self.path = path
        self._file: IO[str] = open(path, "a", buffering=1, encoding="utf-8")
        self._content_of = content_of

    def __call__(self, record: RequestRecord) -> None:
        line = record.log_line()
        if self._content_of is not None:
            line["content"] = self._content_of(record.request_id)
        self._file.write(json.dumps(line, ensure_ascii=False) + "\n")

    def close(self) -> None:
        self._file.close()


class _Bounded(OrderedDict):
    """Side data per request id, oldest dropped past a cap (requests whose response never
    completed)."""

    def put(self, key: str, value: Any) -> None:
        self[key] = value
        while len(self) > _MAX_TRACKED:
            self.popitem(last=False)


class Observability:
    def __init__(
        self,
        recorder: Recorder,
        api_key: str | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
        merge_metrics: Callable[[bytes], Awaitable[bytes]] | None = None,
    ) -> None:
        """``detokenize`` given: the request log carries each prompt's text
        (``--request-log-content``). ``merge_metrics`` given: /metrics answers what it makes of this
        app's own exposition (a fleet's ingress merges its replicas' in: serving/ingress.py)."""
        if api_key is not None and not api_key:
            raise ValueError("api_key must not be empty")
        self.recorder = recorder
        self.api_key = api_key
        self.detokenize = detokenize
        self.merge_metrics = merge_metrics
        self._lock = threading.Lock()
        # request id -> inter-token gaps, once its last token arrived
        self._gaps: _Bounded = _Bounded()
        self._content: _Bounded = _Bounded()  # request id -> logged content (only with detokenize)
        self._engine: EngineClient | None = None

    # ---- wiring ----------------------------------------------------------------------------------
    def install(
        self, app: FastAPI, engine: EngineClient, model_name: str = "firsttoken"
    ) -> EngineClient:
        """``model_name``: the served model name, the ``model_name`` label of the vLLM-compatible
        gauges."""
        self._engine = engine
        registry = make_registry(self.recorder, self.engine_snapshot, model_name)
        app.add_middleware(RejectionCounter, recorder=self.recorder)  # outermost
        app.user_middleware.append(Middleware(ApiKeyMiddleware, api_key=self.api_key))  # innermost
        page = (
            resources.files("firsttoken.api").joinpath("dashboard.html").read_text(encoding="utf-8")
        )

        @app.get(
            "/metrics",
            response_class=Response,
            responses=answer(
                CONTENT_TYPE_LATEST, {"type": "string"}, "Prometheus' text exposition format"
            ),
        )
        async def metrics() -> Response:
            body = generate_latest(registry)
            if self.merge_metrics is not None:
                body = await self.merge_metrics(body)
            return Response(body, media_type=CONTENT_TYPE_LATEST)

        @app.get("/stats")
        async def stats() -> JSONResponse:
            return JSONResponse(self.stats())

        @app.get("/dashboard", response_class=HTMLResponse)
        async def dashboard() -> HTMLResponse:
            return HTMLResponse(page, headers={"Cache-Control": "no-store"})

        return _TokenTimedEngine(engine, self)

    def guards(self, path: str) -> bool:
        """Whether a request to ``path`` needs the API key (its 401 is documented there:
        api/openapi.py)."""
        return self.api_key is not None and path not in OPEN_PATHS

    def engine_snapshot(self) -> EngineSnapshot:
        assert self._engine is not None, "install() first"
        return engine_snapshot(self._engine.stats())

    def content_of(self, request_id: str) -> dict | None:
        with self._lock:
            return self._content.pop(request_id, None)

    # ---- per request -----------------------------------------------------------------------------
    def request_started(self, request: EngineRequest) -> None:
        if self.detokenize is None:
            return
        content = {
            "prompt": self.detokenize(list(request.prompt_token_ids)),
            "images": [
                {"content_hash": im.content_hash, "visual_tokens": im.num_tokens}
                for im in request.images
            ],
        }
        with self._lock:
            self._content.put(request.request_id, content)

    def tokens_done(self, request_id: str, gaps_s: tuple[float, ...]) -> None:
        with self._lock:
            self._gaps.put(request_id, gaps_s)

    def request_done(self, request_id: str, timeline: Timeline) -> None:
        """The response is with the transport (its first byte marked): complete the request's
        record."""
        with self._lock:
            gaps = self._gaps.pop(request_id, ())
        http_id = current_request_id.get()
        self.recorder.complete(
            request_id,
            timeline.to_dict(),
            token_gaps_s=gaps,
            http_request_id=None if http_id == "-" else http_id,
        )

    def stats(self) -> dict:
        """The /stats body: the window's percentiles + live gauges + totals since start."""
        body = self.recorder.window_snapshot()
        g = self.engine_snapshot()
        s = self.recorder.snapshot()
        c = s.counters
        body["now_unix_s"] = time.time()
        body["engine"] = {
            "kv_blocks_used": g.kv_blocks_used,
            "kv_blocks_total": g.kv_blocks_total,
            "kv_usage_ratio": g.kv_usage_ratio,
            "running": g.num_running,
            "queued_by_lane": g.num_queued_by_lane,
            "encoder_cache_bytes": g.encoder_cache_bytes,
        }
        body["totals"] = {
            "requests": sum(s.requests.values()),
            "rejections": sum(s.rejections.values()),
            "preemptions": sum(g.preemptions_by_reason.values()),
            "short_requests_delayed_by_long": g.num_short_delayed_by_long,
            "encoder_interrupts": g.num_encoder_interrupts,
            "long_lane_only": g.long_lane_only,
            "prompt_tokens": int(c["prompt_tokens"]),
            "generation_tokens": int(c["generation_tokens"]),
            "prefix_cache_hit_tokens": g.prefix_cache_hit_tokens,
            "prefix_cache_query_tokens": g.prefix_cache_query_tokens,
            "encoder_cache_hits": g.encoder_cache_hits,
            "encoder_cache_misses": g.encoder_cache_misses,
            "image_budget_lowered": int(c["image_budget_lowered"]),
            "refused_over_slo": s.rejections.get("over_slo", 0),
        }
        body["cost_model"] = {
            "coefficients": g.cost_model,
            # per term: steps in the fit's window with it, its largest value
            "coverage": g.cost_model_coverage,
            "step_time_target_s": g.step_time_target_s,
            "itl_target_s": g.itl_target_s,
            "step_prediction": ratio_summary(s.step_prediction_ratio),
            "ttft_prediction": {
                cls: ratio_summary(h) for cls, h in s.ttft_prediction_ratio.items()
            },
            # by number of images: the factor learnt predictions are multiplied by
            "ttft_bias": g.ttft_bias,
        }
        return body


class _TokenTimedEngine:
    """The app's EngineClient: the real one, plus a timestamp per output token for inter-token
    latency."""

    def __init__(self, inner: EngineClient, obs: Observability) -> None:
        self.inner = inner
        self.obs = obs

    @property
    def is_alive(self) -> bool:
        return self.inner.is_alive

    @property
    def is_draining(self) -> bool:
        return self.inner.is_draining

    # (PromptWork, ...) -> AdmissionVerdict
    def check_admission(self, work, request_id: str | None = None):
        return self.inner.check_admission(work, request_id)

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        self.obs.request_started(request)
        gaps: list[float] = []
        last_s: float | None = None
        # closing us closes (aborts) the inner
        async with aclosing(self.inner.generate(request)) as outputs:
            async for out in outputs:
                if out.new_token_ids:
                    now = time.monotonic()
                    if last_s is not None:
                        gaps.append(now - last_s)
                    last_s = now
                if out.finished:
                    self.obs.tokens_done(request.request_id, tuple(gaps))
                yield out

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    def stats(self) -> EngineStats:
        return self.inner.stats()


class ApiKeyMiddleware:
    """Bearer-token check (constant time) on every route but OPEN_PATHS; also puts the request id in
    the logging context for everything below it."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.expected = api_key.encode() if api_key is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token = current_request_id.set(scope.get(REQUEST_ID_KEY) or "-")
        try:
            if (
                self.expected is not None
                and scope["path"] not in OPEN_PATHS
                and not self._authorized(scope)
            ):
                scope[REJECT_REASON_KEY] = "unauthorized"
                response = error_response(
                    401, "missing or invalid API key: send 'Authorization: Bearer <key>'"
                )
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
            await self.app(scope, receive, send)
        finally:
            current_request_id.reset(token)

    def _authorized(self, scope: Scope) -> bool:
        assert self.expected is not None
        header = dict(scope.get("headers") or ()).get(b"authorization", b"")
        scheme, _, credentials = header.partition(b" ")
        ok_scheme = scheme.lower() == b"bearer"
        return hmac.compare_digest(credentials.strip(), self.expected) and ok_scheme


class RejectionCounter:
    """Counts every 4xx answer by reason (the tag an error handler left in the scope, else the
    status), and every client that left before its answer was complete by the stage left in the
    scope (middleware.client_left)."""

    def __init__(self, app: ASGIApp, recorder: Recorder) -> None:
        self.app = app
        self.recorder = recorder

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = int(message["status"])
                if 400 <= status < 500 and status != CLIENT_CLOSED_REQUEST:
                    reason = scope.get(REJECT_REASON_KEY) or REJECTION_REASONS.get(
                        status, f"http_{status}"
                    )
                    self.recorder.on_rejected(reason)
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            stage = scope.get(CLIENT_LEFT_KEY)
            if stage is not None:
                self.recorder.on_client_disconnect(stage)


def observability_from_config(
    server: ServerConfig,
    tokenizer: Any,
    merge_metrics: Callable[[bytes], Awaitable[bytes]] | None = None,
) -> Observability:
    """The server config's observability part: --stats-window, --request-log[-content],
    --api-key."""
    import os

    recorder = Recorder(window_s=server.stats_window_s)
    api_key = server.api_key or os.environ.get("FIRSTTOKEN_API_KEY") or None
    detokenize = (
        (lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        if server.request_log_content
        else None
    )
    obs = Observability(
        recorder, api_key=api_key, detokenize=detokenize, merge_metrics=merge_metrics
    )
    if server.request_log is not None:
        recorder.sink = RequestLog(Path(server.request_log), obs.content_of if detokenize else None)
    return obs
