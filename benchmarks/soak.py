"""Soak: minutes of mixed load on a server this script starts, then checks that nothing was lost or leaked.

Load (seeded): workers send good requests (text or one image, greedy, some streamed) with ~10% random client
disconnects (right after sending: queued or mid-prefill; or after a few SSE chunks: mid-decode) and ~5% bad inputs;
every ``--burst-every-s`` a burst of ``--burst-size`` requests lands at once, above what the small
``--max-queued-requests`` lets wait, so overload answers (429) happen.

Checks (exit status 1 if any fails):
  * every good request got 429 (with Retry-After), or a complete answer equal to the same request's answer sent alone beforehand
    (temperature 0, float32: batching must not change a token);
  * every bad input got a 4xx;
  * after the load the KV pool is all free and nothing runs or waits (GET /v1/engine/stats);
  * the server's RSS after the load is within ``--rss-growth-mib`` of its RSS after warm-up;
  * the server still answers a good request correctly and /health is 200.

    python benchmarks/soak.py [--model DIR] [--duration-s 300] [--seed 0] [--json out.json]

Without --model it builds the tiny random checkpoint in a temporary directory. tests/soak/test_soak_short.py
runs a ~20 s version in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

MODEL = "soak"


@dataclass(frozen=True)
class SoakConfig:
    model_dir: Path
    duration_s: float = 300.0
    concurrency: int = 6  # workers sending back to back
    burst_every_s: float = 6.0
    burst_size: int = 12
    disconnect_fraction: float = 0.10
    bad_fraction: float = 0.05
    max_queued_requests: int = 2  # per lane; small, so bursts overflow
    max_tokens: int = 12
    warmup_s: float = 3.0  # RSS baseline is taken this long into the load
    rss_growth_mib: float = 150.0
    seed: int = 0


@dataclass
class SoakResult:
    duration_s: float = 0.0
    outcomes: Counter = field(default_factory=Counter)  # "good_ok", "good_429", "disconnect", "bad_4xx", ...
    failures: list[str] = field(default_factory=list)  # each a one-line description of a failed check
    rss_warm_mib: float = 0.0
    rss_end_mib: float = 0.0
    final_stats: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures


# ------------------------------------------------------------------------------------------- workload


def _png_data_url(width: int, height: int, seed: int) -> str:
    from PIL import Image

    img = Image.new("RGB", (width, height), (seed * 53 % 256, 120, 200 - seed * 31 % 200))
    for x in range(0, width, 7):  # a little structure, so images differ beyond their colour
        for y in range(0, height, 5):
            img.putpixel((x, y), ((x * 13 + seed) % 256, (y * 7) % 256, (x + y) % 256))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def good_prompts() -> list[dict]:
    """Distinct good request bodies (text and one-image), each answered greedily."""
    texts = ["Tell me about the sea.", "def fibonacci(n):", "List three colours and a number: " * 3,
             "Why is the sky blue? Answer briefly."]
    bodies = [{"messages": [{"role": "user", "content": t}]} for t in texts]
    for i, (w, h) in enumerate([(56, 56), (112, 84), (64, 160), (200, 120)]):
        bodies.append({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": _png_data_url(w, h, i)}},
            {"type": "text", "text": f"What is in picture {i}?"}]}]})
    return bodies


BAD_BODIES = [
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}},
                                               {"type": "text", "text": "x"}]}]},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1},
    {"messages": [{"role": "user", "content": "hi"}], "model": "not-the-model"},
    {"messages": []},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://169.254.169.254/"}},
                                               {"type": "text", "text": "x"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "/etc/passwd"}},
                                               {"type": "text", "text": "x"}]}]},
]


def _full(body: dict, cfg: SoakConfig, stream: bool = False) -> dict:
    return {"model": MODEL, "max_tokens": cfg.max_tokens, "temperature": 0.0, "stream": stream, **body}


@dataclass(frozen=True)
class Answer:
    status: int
    text: str = ""
    finish_reason: str | None = None
    retry_after: str | None = None  # a 429's Retry-After header


async def ask(client: httpx.AsyncClient, body: dict, stream: bool) -> Answer:
    """One request; a streamed answer is reassembled from its SSE deltas."""
    if not stream:
        r = await client.post("/v1/chat/completions", json=body)
        if r.status_code != 200:
            return Answer(r.status_code, retry_after=r.headers.get("retry-after"))
        choice = r.json()["choices"][0]
        return Answer(200, choice["message"]["content"], choice["finish_reason"])
    parts: list[str] = []
    finish = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return Answer(r.status_code, retry_after=r.headers.get("retry-after"))
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                parts.append(choice.get("delta", {}).get("content") or "")
                finish = choice.get("finish_reason") or finish
    return Answer(200, "".join(parts), finish)


async def disconnect(client: httpx.AsyncClient, body: dict, rng: random.Random) -> str:
    """Send, then walk away: after a random delay (queued or mid-prefill) or after a few chunks (mid-decode)."""
    if rng.random() < 0.5:
        task = asyncio.ensure_future(ask(client, body, stream=True))
        await asyncio.sleep(rng.uniform(0.0, 0.3))
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, httpx.HTTPError):
            pass
        return "disconnect_early"
    chunks = rng.randint(1, 4)
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        async for _ in r.aiter_lines():
            chunks -= 1
            if chunks <= 0:
                break  # leaving the block closes the connection mid-stream
    return "disconnect_mid_decode"


class Soak:
    def __init__(self, cfg: SoakConfig, base_url: str, pid: int) -> None:
        self.cfg = cfg
        self.base_url = base_url
        self.pid = pid
        self.prompts = good_prompts()
        self.reference: list[Answer] = []
        self.result = SoakResult()

    def fail(self, what: str) -> None:
        if len(self.result.failures) < 50:
            self.result.failures.append(what)

    async def good(self, client: httpx.AsyncClient, rng: random.Random) -> None:
        i = rng.randrange(len(self.prompts))
        stream = rng.random() < 0.5
        try:
            got = await ask(client, _full(self.prompts[i], self.cfg, stream), stream)
        except httpx.HTTPError as err:
            self.result.outcomes["good_transport_error"] += 1
            self.fail(f"good request {i}: {type(err).__name__}")
            return
        if got.status == 429:
            self.result.outcomes["good_429"] += 1
            if not (got.retry_after or "").isdigit():
                self.fail(f"a 429 without a Retry-After of whole seconds: {got.retry_after!r}")
        elif got == self.reference[i]:
            self.result.outcomes["good_ok"] += 1
        else:
            self.result.outcomes["good_wrong"] += 1
            self.fail(f"good request {i} (stream={stream}): {got} != alone {self.reference[i]}")

    async def bad(self, client: httpx.AsyncClient, rng: random.Random) -> None:
        body = rng.choice(BAD_BODIES)
        r = await client.post("/v1/chat/completions", json={**_full({}, self.cfg), **body})
        ok = 400 <= r.status_code < 500 and "error" in r.json()
        self.result.outcomes["bad_4xx" if ok else "bad_wrong"] += 1
        if not ok:
            self.fail(f"bad input got {r.status_code}")

    async def one(self, client: httpx.AsyncClient, rng: random.Random) -> None:
        roll = rng.random()
        if roll < self.cfg.disconnect_fraction:
            body = _full(self.prompts[rng.randrange(len(self.prompts))], self.cfg, stream=True)
            try:
                self.result.outcomes[await disconnect(client, body, rng)] += 1
            except httpx.HTTPError:
                self.result.outcomes["disconnect_early"] += 1
        elif roll < self.cfg.disconnect_fraction + self.cfg.bad_fraction:
            await self.bad(client, rng)
        else:
            await self.good(client, rng)

    async def worker(self, client: httpx.AsyncClient, seed: int, deadline: float) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            await self.one(client, rng)

    async def bursts(self, client: httpx.AsyncClient, deadline: float) -> None:
        rng = random.Random(self.cfg.seed + 999)
        while time.monotonic() + self.cfg.burst_every_s < deadline:
            await asyncio.sleep(self.cfg.burst_every_s)
            await asyncio.gather(*(self.good(client, rng) for _ in range(self.cfg.burst_size)))
            self.result.outcomes["bursts"] += 1

    async def sample_rss_after_warmup(self) -> None:
        await asyncio.sleep(self.cfg.warmup_s)
        self.result.rss_warm_mib = rss_mib(self.pid)

    async def run(self) -> SoakResult:
        limits = httpx.Limits(max_connections=self.cfg.concurrency + self.cfg.burst_size + 4)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=120, limits=limits) as client:
            for body in self.prompts:  # each good request alone: the answer every later copy must equal
                self.reference.append(await ask(client, _full(body, self.cfg), stream=False))
            if any(a.status != 200 for a in self.reference):
                self.fail(f"reference requests failed: {[a.status for a in self.reference]}")
                return self.result
            t0 = time.monotonic()
            deadline = t0 + self.cfg.duration_s
            workers = [self.worker(client, self.cfg.seed * 1000 + w, deadline) for w in range(self.cfg.concurrency)]
            await asyncio.gather(self.sample_rss_after_warmup(), self.bursts(client, deadline), *workers)
            self.result.duration_s = time.monotonic() - t0
            await self.check_after(client)
        return self.result

    async def check_after(self, client: httpx.AsyncClient) -> None:
        stats: dict = {}
        for _ in range(200):  # disconnected requests are freed within a step; give the loop time to drain
            stats = (await client.get("/v1/engine/stats")).json()
            if stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0:
                break
            await asyncio.sleep(0.05)
        self.result.final_stats = stats
        if stats["kv_blocks_used"] or stats["num_running"] or stats["num_waiting"]:
            self.fail(f"engine not idle after the load: used={stats['kv_blocks_used']} "
                      f"running={stats['num_running']} waiting={stats['num_waiting']}")
        self.result.rss_end_mib = rss_mib(self.pid)
        growth = self.result.rss_end_mib - self.result.rss_warm_mib
        if growth > self.cfg.rss_growth_mib:
            self.fail(f"RSS grew {growth:.0f} MiB after warm-up (bound {self.cfg.rss_growth_mib:.0f})")
        final = await ask(client, _full(self.prompts[-1], self.cfg), stream=False)
        if final != self.reference[-1]:
            self.fail(f"final request: {final} != {self.reference[-1]}")
        if (await client.get("/health")).status_code != 200:
            self.fail("/health is not 200 after the load")
        if self.result.outcomes["good_ok"] == 0:
            self.fail("no good request completed")


# ------------------------------------------------------------------------------------------- server


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def start_server(cfg: SoakConfig, extra: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "firsttoken.cli.main", "serve", "--model", str(cfg.model_dir), "--port", str(port),
           "--served-model-name", MODEL, "--dtype", "float32", "--kv-cache-memory", "16MiB",
           "--max-batched-tokens", "256", "--max-queued-requests", str(cfg.max_queued_requests),
           "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{base}/health").status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server did not start")


def run_soak(cfg: SoakConfig, extra_server_args: list[str] = ()) -> SoakResult:
    proc, base = start_server(cfg, list(extra_server_args))
    try:
        return asyncio.run(Soak(cfg, base, proc.pid).run())
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def report(result: SoakResult) -> str:
    o = result.outcomes
    good = o["good_ok"] + o["good_429"] + o["good_wrong"] + o["good_transport_error"]
    lines = [
        f"soak: {result.duration_s:.0f} s, {sum(v for k, v in o.items() if k != 'bursts')} requests, "
        f"{o['bursts']} bursts",
        f"  good {good}: {o['good_ok']} correct, {o['good_429']} 429, {o['good_wrong']} wrong, "
        f"{o['good_transport_error']} transport errors",
        f"  disconnects: {o['disconnect_early']} early (queued/prefill), {o['disconnect_mid_decode']} mid-decode",
        f"  bad inputs: {o['bad_4xx']} got 4xx, {o['bad_wrong']} did not",
        f"  RSS: {result.rss_warm_mib:.0f} MiB after warm-up -> {result.rss_end_mib:.0f} MiB at the end",
        f"  engine after: kv_blocks_used={result.final_stats.get('kv_blocks_used')} "
        f"running={result.final_stats.get('num_running')} waiting={result.final_stats.get('num_waiting')}",
        "  PASS" if result.ok else "  FAIL:\n    " + "\n    ".join(result.failures),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: build the tiny one)")
    p.add_argument("--duration-s", type=float, default=300.0)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--burst-size", type=int, default=12)
    p.add_argument("--burst-every-s", type=float, default=6.0)
    p.add_argument("--max-queued-requests", type=int, default=2)
    p.add_argument("--rss-growth-mib", type=float, default=150.0)
    p.add_argument("--warmup-s", type=float, default=None, help="default: 10%% of the duration, at least 3 s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the result here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from firsttoken.models.checkpoint import make_model

            model_dir = make_model(Path(tmp) / "tiny", size="tiny", seed=0, layout="transformers")
        cfg = SoakConfig(model_dir=model_dir, duration_s=args.duration_s, concurrency=args.concurrency,
                         burst_size=args.burst_size, burst_every_s=args.burst_every_s,
                         max_queued_requests=args.max_queued_requests, rss_growth_mib=args.rss_growth_mib,
                         warmup_s=args.warmup_s if args.warmup_s is not None else max(3.0, args.duration_s / 10),
                         seed=args.seed)
        result = run_soak(cfg)
    print(report(result))
    if args.json:
        out = {**asdict(result), "outcomes": dict(result.outcomes), "ok": result.ok,
               "config": {k: str(v) for k, v in asdict(cfg).items()}}
        args.json.write_text(json.dumps(out, indent=2))
    return 0 if result.ok else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
