"""Doctor over HTTP: GET /metrics and /stats (absent on other servers: a 404 is fine), and
``--probe``: a short bench run (seed-mix, then a two-turn conversation) so the report covers fresh
requests and the follow-up reuse is measured rather than assumed. The bearer key reaches the bench
through a transport, its designed seam."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import httpx

from firsttoken.tools.doctor.report import Report, doctor_from_texts
from firsttoken.tools.doctor.rules import KVSizing, Thresholds


@dataclass(frozen=True)
class Scrape:
    metrics_text: str
    stats: dict[str, Any] | None  # None: the server has no firsttoken /stats


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def scrape(url: str, api_key: str | None = None, timeout_s: float = 30.0) -> Scrape:
    base = url.rstrip("/").removesuffix("/v1")
    with httpx.Client(base_url=base, headers=_headers(api_key), timeout=timeout_s) as client:
        metrics = client.get("/metrics")
        metrics.raise_for_status()
        stats = None
        resp = client.get("/stats")
        if resp.status_code == 200 and resp.headers.get("content-type", "").startswith(
            "application/json"
        ):
            body = resp.json()
            stats = body if isinstance(body, dict) and "classes" in body else None
    return Scrape(metrics.text, stats)


class _BearerTransport(httpx.AsyncBaseTransport):
    def __init__(self, api_key: str) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.api_key = api_key

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        request.headers["Authorization"] = f"Bearer {self.api_key}"
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def probe(
    url: str,
    api_key: str | None = None,
    model: str | None = None,
    num_requests: int = 8,
) -> dict[str, Any]:
    """A short seed-mix run at concurrency 2 plus two 2-turn conversations; returns TTFT per class
    and the follow-ups' reusable vs cached share of prompt tokens."""
    from firsttoken.tools.bench import BenchConfig, run_bench

    def transport() -> httpx.AsyncBaseTransport | None:
        return _BearerTransport(api_key) if api_key else None

    mix = run_bench(BenchConfig(url=url, model=model, num_requests=num_requests, concurrency=2, output_tokens=16,
                                text_tokens=512, progress=False), transport())  # fmt: skip
    turns = run_bench(BenchConfig(url=url, model=model, workload="multiturn", turns=1, multiturn_images=1,
                                  num_requests=2, concurrency=1, output_tokens=16, progress=False, seed=1),
                      transport())  # fmt: skip
    reusable = cached = total = 0
    by_session: dict[int, list] = {}
    for rec in turns.records:
        by_session.setdefault(rec.session, []).append(rec)
    for recs in by_session.values():
        recs.sort(key=lambda r: r.turn)
        for prev, cur in itertools.pairwise(recs):
            if cur.prompt_tokens and prev.prompt_tokens:
                reusable += prev.prompt_tokens
                total += cur.prompt_tokens
                cached += int((cur.server_timings or {}).get("cached_prompt_tokens", 0))
    ttft = {k: c.ttft.p50 for k, c in mix.summary.classes.items()}
    errors = sum(mix.summary.errors.values()) + sum(turns.summary.errors.values())
    summary = ", ".join(
        f"{k} P50 {v:.3f}s" for k, v in ttft.items() if v is not None and not math.isnan(v)
    )
    return {
        "summary": f"{num_requests} seed-mix requests ({summary}), 2 follow-ups, {errors} errors",
        "ttft_p50_s": ttft,
        "errors": errors,
        "follow_up_reusable_share": reusable / total if total else None,
        "follow_up_cached_share": cached / total if total else None,
    }


def run_doctor(url: str, *, api_key: str | None = None, do_probe: bool = False, model: str | None = None,
               thresholds: Thresholds | None = None, kv: KVSizing | None = None) -> Report:  # fmt: skip
    probed = probe(url, api_key, model) if do_probe else None
    s = scrape(url, api_key)
    return doctor_from_texts(
        s.metrics_text, s.stats, url=url, thresholds=thresholds, kv=kv, probe=probed,
        measured_reuse=probed["follow_up_reusable_share"] if probed else None,
        measured_hit_rate=probed["follow_up_cached_share"] if probed else None,
    )  # fmt: skip
