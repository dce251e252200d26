"""Soak: minutes of mixed load on a server this script starts, then checks that nothing was lost or leaked.

Load (seeded): workers send good requests of every kind in ``soak_kinds.py`` (text, images, JSON schemas, regexes,
a lark grammar, choices, tool calls named and required, a video, ``n`` = 2, logprobs, the Responses API; greedy, some
streamed, in turn so that every kind is sent) with ~10% random client disconnects (right after sending: queued or
mid-prefill; or after a few SSE chunks: mid-decode) and ~5% bad inputs of every kind; every ``--burst-every-s`` a
burst of ``--burst-size`` requests lands at once, above what the small ``--max-queued-requests`` lets wait, so
overload answers (429) happen. Adversarial inputs (an ambiguous grammar with n = 2, a regex no string matches) are
sent each at least once under load and ~3% of the time after (``--no-adversarial``: none); the server runs with
``--grammar-mask-budget`` ``--grammar-mask-budget-s`` (2 s), so the grammar ends within the run.

Checks (exit status 1 if any fails):
  * every good request got 429 (with Retry-After), or a complete answer equal to the same request's answer sent
    alone beforehand (temperature 0, float32: batching must not change a token; n copies of it for n > 1, the chat
    twin's for the Responses route), that also keeps its kind's rule (a schema's answer validates, a regex's
    fullmatches, a grammar's parses, tool arguments validate, one logprob entry per token, ...);
  * every bad input got a 4xx in OpenAI's error shape; every adversarial input a 4xx or an error finish, never a 5xx;
  * after the load the KV pool is all free and nothing runs or waits (GET /v1/engine/stats);
  * the server's RSS after the load is within ``--rss-growth-mib`` of its RSS after warm-up;
  * the server still answers a good request correctly and /health is 200.

    python benchmarks/soak.py [--model DIR] [--duration-s 300] [--seed 0] [--no-adversarial] [--json out.json]

Without --model it builds the tiny random checkpoint in a temporary directory. tests/soak/test_soak_short.py
runs a short version in CI.
"""

from __future__ import annotations

import argparse
import asyncio
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
from typing import NamedTuple

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak_answers import Answer, send  # noqa: E402
from soak_kinds import Case, adversarial_cases, bad_cases, good_cases  # noqa: E402

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
    adversarial_fraction: float = 0.03  # of a worker's requests, with --adversarial only
    adversarial: bool = True
    overtime_factor: float = 2.0  # the load may run this many durations past its own while a kind is unanswered
    grammar_mask_budget_s: float = 2.0  # the server's --grammar-mask-budget: how long an adversarial grammar may take
    max_queued_requests: int = 2  # per lane; small, so bursts overflow
    max_tokens: int = 12  # of the free kinds; the constrained kinds carry their own (soak_kinds)
    warmup_s: float = 3.0  # RSS baseline is taken this long into the load
    rss_growth_mib: float = 150.0
    seed: int = 0


@dataclass
class SoakResult:
    duration_s: float = 0.0
    # totals: "good_ok", "good_429", "good_wrong", "good_transport_error", "disconnect_early",
    # "disconnect_mid_decode", "bad_4xx", "bad_wrong", "bad_429", "adversarial_ok", "adversarial_wrong",
    # "adversarial_429", "bursts"
    outcomes: Counter = field(default_factory=Counter)
    by_kind: dict[str, Counter] = field(default_factory=dict)  # kind -> the same outcomes, that kind's only
    failures: list[str] = field(default_factory=list)  # each a one-line description of a failed check
    rss_warm_mib: float = 0.0
    rss_end_mib: float = 0.0
    final_stats: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures

    def count(self, kind: str, outcome: str) -> None:
        self.outcomes[outcome] += 1
        self.by_kind.setdefault(kind, Counter())[outcome] += 1


# ------------------------------------------------------------------------------------------- load


class Outcomes(NamedTuple):
    """The outcome names a refusable case counts under: it kept its rule, broke it, or was not tried (a 429: the
    queue was full, which says nothing about the input)."""

    ok: str
    wrong: str
    overloaded: str


BAD = Outcomes("bad_4xx", "bad_wrong", "bad_429")
ADVERSARIAL = Outcomes("adversarial_ok", "adversarial_wrong", "adversarial_429")


class Rotation:
    """Cases in a seeded order, handed out in turn (every case once per len(cases) picks, whichever worker asks),
    so that a short run still sends every kind."""

    def __init__(self, cases: list[Case], seed: int) -> None:
        self.cases = list(cases)  # in the order they are handed out
        random.Random(seed).shuffle(self.cases)
        self.at = 0

    def next(self) -> Case:
        case = self.cases[self.at % len(self.cases)]
        self.at += 1
        return case


def _full(case_body: dict, stream: bool = False) -> dict:
    return {"model": MODEL, "temperature": 0.0, "stream": stream, **case_body}


async def disconnect(client: httpx.AsyncClient, case: Case, rng: random.Random) -> str:
    """Send streamed, then walk away: after a random delay (queued or mid-prefill) or after a few chunks
    (mid-decode)."""
    if rng.random() < 0.5:
        task = asyncio.ensure_future(send(client, case.route, _full(case.body), stream=True))
        await asyncio.sleep(rng.uniform(0.0, 0.3))
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, httpx.HTTPError):
            pass
        return "disconnect_early"
    chunks = rng.randint(1, 4)
    body = {**_full(case.body), **case.route.stream_fields}
    async with client.stream("POST", case.route.path, json=body) as r:
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
        self.cases = good_cases(cfg.max_tokens)
        self.expected: dict[Case, Answer] = {}  # the answer every copy of a case must equal
        self.good = Rotation(self.cases, cfg.seed)
        self.bad = Rotation(bad_cases(), cfg.seed + 1)
        self.adversarial = Rotation(adversarial_cases(), cfg.seed + 2)
        self.result = SoakResult()

    def fail(self, what: str) -> None:
        if len(self.result.failures) < 50:
            self.result.failures.append(what)

    async def alone(self, client: httpx.AsyncClient, case: Case) -> Answer:
        """The case's expected answer: its alone request, sent now with nothing else in flight."""
        route, body = case.alone
        answer = (await send(client, route, _full(body), stream=False)).times(case.copies)
        problem = case.rule(answer)
        if problem is not None:
            self.fail(f"{case.kind} alone breaks its rule: {problem}")
        return answer

    async def send_good(self, client: httpx.AsyncClient, case: Case, rng: random.Random) -> None:
        stream = rng.random() < 0.5
        try:
            got = await send(client, case.route, _full(case.body), stream)
        except httpx.HTTPError as err:
            self.result.count(case.kind, "good_transport_error")
            self.fail(f"good {case.kind}: {type(err).__name__}")
            return
        if got.status == 429:
            self.result.count(case.kind, "good_429")
            if not (got.retry_after or "").isdigit():
                self.fail(f"a 429 without a Retry-After of whole seconds: {got.retry_after!r}")
            return
        expected = self.expected[case]
        problem = case.rule(got) or (None if got == expected else f"{got} != alone {expected}")
        self.result.count(case.kind, "good_wrong" if problem else "good_ok")
        if problem:
            self.fail(f"good {case.kind} (stream={stream}): {problem}")

    async def send_refusable(self, client: httpx.AsyncClient, case: Case, outcomes: Outcomes) -> None:
        """A bad or adversarial case, sent whole: its rule says how it must end."""
        try:
            got = await send(client, case.route, _full(case.body), stream=False)
        except httpx.HTTPError as err:
            got, problem = None, type(err).__name__
        else:
            problem = case.rule(got)
        if got is not None and got.status == 429:
            self.result.count(case.kind, outcomes.overloaded)
            return
        self.result.count(case.kind, outcomes.wrong if problem else outcomes.ok)
        if problem:
            self.fail(f"{case.kind}: {problem}")

    async def one(self, client: httpx.AsyncClient, rng: random.Random) -> None:
        roll = rng.random()
        bad_below = self.cfg.disconnect_fraction + self.cfg.bad_fraction
        if roll < self.cfg.disconnect_fraction:
            case = self.cases[rng.randrange(len(self.cases))]
            try:
                self.result.count(case.kind, await disconnect(client, case, rng))
            except httpx.HTTPError:
                self.result.count(case.kind, "disconnect_early")
        elif roll < bad_below:
            await self.send_refusable(client, self.bad.next(), BAD)
        elif self.cfg.adversarial and roll < bad_below + self.cfg.adversarial_fraction:
            await self.send_refusable(client, self.adversarial.next(), ADVERSARIAL)
        else:
            await self.send_good(client, self.good.next(), rng)

    def unanswered(self) -> list[str]:
        """The good and adversarial kinds no request of which has had its answer yet (a 429 is no answer)."""
        kinds = [c.kind for c in self.cases] + ([c.kind for c in self.adversarial.cases] if self.cfg.adversarial
                                                 else [])
        answered = ("good_ok", "good_wrong", ADVERSARIAL.ok, ADVERSARIAL.wrong)
        return [kind for kind in dict.fromkeys(kinds)
                if not any(self.result.by_kind.get(kind, Counter())[outcome] for outcome in answered)]

    def loading(self, deadline: float) -> bool:
        """The load goes on until the deadline, and past it (up to ``overtime_factor`` x the duration more) while
        some kind has not been answered once: how many requests fit in the window is the machine's business, that
        every kind was answered under load is not."""
        now = time.monotonic()
        return now < deadline or (now < deadline + self.cfg.overtime_factor * self.cfg.duration_s
                                  and bool(self.unanswered()))

    async def worker(self, client: httpx.AsyncClient, seed: int, deadline: float) -> None:
        rng = random.Random(seed)
        while self.loading(deadline):
            await self.one(client, rng)

    async def bursts(self, client: httpx.AsyncClient, t0: float, deadline: float) -> None:
        """A burst lands at t0 + k * burst_every_s while that is before the deadline, whether or not the one before
        has been answered; the bursts draw from their own rotation (most of a burst gets 429, and the workers'
        rotation is what sends every kind to completion)."""
        rng = random.Random(self.cfg.seed + 999)
        rotation = Rotation(self.cases, self.cfg.seed + 3)
        landed: list[asyncio.Future] = []
        at = t0 + self.cfg.burst_every_s
        while at < deadline:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            landed.append(asyncio.gather(*(self.send_good(client, rotation.next(), rng)
                                           for _ in range(self.cfg.burst_size))))
            self.result.outcomes["bursts"] += 1
            at += self.cfg.burst_every_s
        await asyncio.gather(*landed)

    async def adversarial_under_load(self, client: httpx.AsyncClient, deadline: float) -> None:
        """Every adversarial input once while the load runs (a short run draws only some), each tried again after
        a 429 until one is answered or the load ends: the good answers sent meanwhile must still equal their
        alone-answers."""
        if not self.cfg.adversarial:
            return
        for case in self.adversarial.cases:
            while self.loading(deadline):
                before = self.result.by_kind.get(case.kind, Counter())[ADVERSARIAL.overloaded]
                await self.send_refusable(client, case, ADVERSARIAL)
                if self.result.by_kind[case.kind][ADVERSARIAL.overloaded] == before:
                    break
                await asyncio.sleep(0.2)

    async def sample_rss_after_warmup(self) -> None:
        await asyncio.sleep(self.cfg.warmup_s)
        self.result.rss_warm_mib = rss_mib(self.pid)

    async def run(self) -> SoakResult:
        limits = httpx.Limits(max_connections=self.cfg.concurrency + self.cfg.burst_size + 4)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=120, limits=limits) as client:
            for case in self.cases:  # each good request alone: the answer every later copy must equal
                self.expected[case] = await self.alone(client, case)
            if self.result.failures:
                return self.result
            for case in self.bad.cases:  # every bad input once (a short run draws only some under load)
                await self.send_refusable(client, case, BAD)
            t0 = time.monotonic()
            deadline = t0 + self.cfg.duration_s
            workers = [self.worker(client, self.cfg.seed * 1000 + w, deadline) for w in range(self.cfg.concurrency)]
            await asyncio.gather(self.sample_rss_after_warmup(), self.bursts(client, t0, deadline),
                                 self.adversarial_under_load(client, deadline), *workers)
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
        last = self.cases[-1]
        final = await send(client, last.route, _full(last.body), stream=False)
        if final != self.expected[last]:
            self.fail(f"final request: {final} != {self.expected[last]}")
        if (await client.get("/health")).status_code != 200:
            self.fail("/health is not 200 after the load")
        silent = [kind for kind in dict.fromkeys(c.kind for c in self.cases)
                  if not self.result.by_kind.get(kind, Counter())["good_ok"]]
        if silent:
            self.fail(f"no good request of {silent} completed")


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
           "--grammar-mask-budget", str(cfg.grammar_mask_budget_s), "--log-level", "warning", *extra]
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
        f"  bad inputs: {o['bad_4xx']} got 4xx, {o['bad_wrong']} did not, {o['bad_429']} not tried (429)",
        f"  adversarial inputs: {o['adversarial_ok']} refused or ended with an error, {o['adversarial_wrong']} did "
        f"not, {o['adversarial_429']} not tried (429)",
        "  by kind:",
        *(f"    {kind}: " + " ".join(f"{k}={v}" for k, v in sorted(c.items()))
          for kind, c in sorted(result.by_kind.items())),
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
    p.add_argument("--adversarial", action=argparse.BooleanOptionalAction, default=True,
                   help="also send adversarial inputs (an ambiguous grammar, n 2; a regex no string matches), each "
                        "at least once under load")
    p.add_argument("--grammar-mask-budget-s", type=float, default=2.0,
                   help="the server's --grammar-mask-budget (an adversarial grammar's end)")
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
                         seed=args.seed, adversarial=args.adversarial,
                         grammar_mask_budget_s=args.grammar_mask_budget_s)
        result = run_soak(cfg)
    print(report(result))
    if args.json:
        out = {**asdict(result), "outcomes": dict(result.outcomes), "ok": result.ok,
               "by_kind": {kind: dict(c) for kind, c in sorted(result.by_kind.items())},
               "config": {k: str(v) for k, v in asdict(cfg).items()}}
        args.json.write_text(json.dumps(out, indent=2))
    return 0 if result.ok else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
