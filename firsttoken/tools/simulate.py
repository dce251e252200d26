"""Fleet planning by simulation: R replicas x lanes x a routing policy, driven by a workload and a
step-cost profile measured on the deployment's machine.

Each simulated replica is firsttoken's own ``Scheduler`` (ints only: the same lanes, time bound, KV
admission and caches as the server), run on a virtual clock. A step takes what the step-cost model
predicts for the work the scheduler put in it; the coefficients come from a real server
(``GET /stats``'s ``cost_model``, fitted online from its own step timings) or from a start-up
calibration of the engine on this machine. Nothing is simulated that the server decides: only the
model's forward pass is replaced by its measured price. Anchor: Vidur (MLSys 2024) simulates serving
from profiled operator costs; here the profile is the engine's own cost model, and the simulator is
validated against measured runs (benchmarks/validate_simulator.py, docs/scaling.md).

    profile   = Profile.from_stats(stats_json, model_config)   # or Profile.from_engine(engine)
    workload  = seed_mix(profile, rate=2.0, num_requests=500, seed=0)
    result    = simulate(workload, [profile] * 4, Router("least-loaded"))
    result.summary()   # TTFT P50/P95/P99 per class, n, refusals

What is not modelled: image decoding and the HTTP hop (a per-class preprocess delay from the profile
stands in), contention between preprocessing threads and the engine, and noise in step times
(``step_noise`` adds lognormal noise of a given sigma).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from firsttoken.batch import RunnerOutput, ScheduledBatch
from firsttoken.config import CacheConfig, ImageConfig, SchedulerConfig
from firsttoken.inputs.budget import plan_image
from firsttoken.metrics.window import IMAGE_CLASSES, image_class
from firsttoken.models.ladder import PIXEL_LADDER
from firsttoken.models.model_config import ModelConfig
from firsttoken.models.registry import family_named
from firsttoken.scheduler.admission import Reservations, negotiate
from firsttoken.scheduler.cost_model import FEATURE_NAMES, CostModel, encoder_units
from firsttoken.scheduler.lanes import SHORT, route_lane
from firsttoken.scheduler.request import Request
from firsttoken.scheduler.scheduler import Scheduler
from firsttoken.types import (
    AdmissionVerdict,
    EncoderUnit,
    EngineRequest,
    ImageItem,
    PromptWork,
    SamplingParams,
)

# a term priced beyond this x the largest the profile's fit saw: a warning
EXTRAPOLATION_FACTOR = 4.0
DEFAULT_IMAGE_BUDGET = ImageConfig().image_max_tokens  # serve's default visual tokens per image
# the chat template around one user turn (Qwen2-VL's), as tools/plan.py counts it
TEMPLATE_TOKENS = 21
IMAGE_WRAPPER_TOKENS = 2  # <|vision_start|> ... <|vision_end|>


# ---- the replica's measured price list -----------------------------------------------------------
@dataclass(frozen=True)
class Profile:
    """What one replica is: its step-cost coefficients (seconds per unit of each cost-model term),
    its scheduler and cache configuration, its KV pool, and the per-class delay before a request
    reaches the engine."""

    coefficients: dict[str, float]
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    num_kv_blocks: int = 4096
    max_model_len: int = 32768
    encoder_capacity_tokens: int = 65536
    # image class -> seconds before the engine sees it
    preprocess_s: dict[str, float] = field(default_factory=dict)
    # what the profiled server's fit had seen per term ({"steps": n, "max": largest value}); empty:
    # not known
    coverage: dict[str, dict[str, float]] = field(default_factory=dict)
    # the checkpoint's config, where known: admission over a TTFT objective re-plans images at lower
    # budgets down to image_min_tokens_under_load, as the server does (None: it refuses them at
    # once)
    model: ModelConfig | None = None
    image_min_tokens_under_load: int = ImageConfig().image_min_tokens_under_load

    def __post_init__(self) -> None:
        unknown = set(self.coefficients) - set(FEATURE_NAMES)
        if unknown:
            raise ValueError(
                f"unknown cost-model terms {sorted(unknown)}; expected {list(FEATURE_NAMES)}"
            )
        if not any(self.coefficients.values()):
            raise ValueError(
                "the profile's step-cost coefficients are all zero: the server had not fitted its "
                "cost model yet (send it a few requests first)"
            )

    @property
    def prior(self) -> tuple[float, ...]:
        return tuple(float(self.coefficients.get(n, 0.0)) for n in FEATURE_NAMES)

    def to_dict(self) -> dict[str, Any]:
        return {"coefficients": self.coefficients, "num_kv_blocks": self.num_kv_blocks,
                "max_model_len": self.max_model_len, "encoder_capacity_tokens": self.encoder_capacity_tokens,
                "preprocess_s": self.preprocess_s, "block_size": self.cache.block_size, "coverage": self.coverage,
                "scheduler": {k: getattr(self.scheduler, k) for k in self.scheduler.__dataclass_fields__
                              if k != "ttft_slo"}}  # fmt: skip

    @staticmethod
    def from_stats(stats: dict[str, Any], scheduler: SchedulerConfig | None = None) -> Profile:
        """From a live server's ``GET /stats``: its fitted coefficients, its KV pool, and each
        class's mean preprocess time over the stats window (a server that served no image requests
        has 0 for them)."""
        coefficients = dict(stats.get("cost_model", {}).get("coefficients") or {})
        engine = stats.get("engine", {})
        preprocess = {
            c: float(
                (stats.get("classes", {}).get(c, {}).get("preprocess_s") or {}).get("mean") or 0.0
            )
            for c in IMAGE_CLASSES
        }
        coverage = dict(stats.get("cost_model", {}).get("coverage") or {})
        return Profile(
            coefficients,
            scheduler or SchedulerConfig(),
            num_kv_blocks=int(engine.get("kv_blocks_total") or 4096),
            preprocess_s=preprocess,
            coverage=coverage,
        )

    def extrapolations(
        self, priced: dict[str, float], factor: float = EXTRAPOLATION_FACTOR
    ) -> list[str]:
        """Terms a simulation priced beyond what this profile's fit had seen: never seen (its price
        is the prior or zero), or more than ``factor`` x the largest value seen in a step.
        ``priced``: the largest value of each term in one simulated step (``SimResult.max_terms``).
        Empty when the profile does not say (an older file)."""
        out = []
        for name, need in priced.items():
            seen = self.coverage.get(name)
            if not self.coverage or need <= 0 or seen is None:
                continue
            if seen["steps"] == 0:
                out.append(f"{name}: the profile's fit saw no step with it (its price is the start-up prior's, "
                           f"or 0), the workload needs up to {need:.3g} per step")
            elif need > factor * seen["max"]:
                out.append(
                    f"{name}: the workload needs up to {need:.3g} per step, {need / seen['max']:.0f}x the "
                    f"largest the profile's fit saw ({seen['max']:.3g}): its price is extrapolated"
                )
        return out


# ---- the workload --------------------------------------------------------------------------------
@dataclass(frozen=True)
class SimImage:
    num_tokens: int
    grid_thw: tuple[int, int, int]
    encoder_units: tuple[EncoderUnit, ...]
    # the image's width and height, where known: it can be re-planned
    size: tuple[int, int] | None = None
    budget_tokens: int | None = None  # the visual-token budget it was planned at


@dataclass(frozen=True)
class SimRequest:
    request_id: str
    arrival_s: float
    cls: str  # a label for reporting (text, 1img, 3img, ...)
    text_tokens: int  # prompt tokens that are not image pads (template included)
    images: tuple[SimImage, ...]
    output_tokens: int
    conversation: str | None = None  # follow-up turns of one conversation share their prefix

    @property
    def num_prompt_tokens(self) -> int:
        return self.text_tokens + sum(im.num_tokens + IMAGE_WRAPPER_TOKENS for im in self.images)


def image_for(
    model: ModelConfig, width: int, height: int, budget_tokens: int, min_tokens: int = 4
) -> SimImage:
    """The visual tokens and the vision-tower units of one image of this size, planned as the server
    plans it."""
    family = family_named(model.family)
    plan = plan_image(width, height, budget_tokens, min_tokens, model.image_processor)
    return SimImage(
        plan.num_tokens,
        plan.grid_thw,
        tuple(family.encoder_units(model.vision, plan.grid_thw)),
        (width, height),
        budget_tokens,
    )


def seed_mix(
    model: ModelConfig,
    rate: float,
    num_requests: int,
    seed: int = 0,
    mix: Sequence[tuple[str, int, float]] = (("text", 0, 0.5), ("1img", 1, 0.3), ("3img", 3, 0.2)),
    text_tokens: int = 800,
    image_size: tuple[int, int] = (1024, 1024),
    image_budget_tokens: int = DEFAULT_IMAGE_BUDGET,
    output_tokens: int = 32,
) -> list[SimRequest]:
    """The seed's mix (class, images, share) with Poisson arrivals at ``rate`` requests/s; distinct
    images."""
    rng = np.random.default_rng(seed)
    image = image_for(model, *image_size, image_budget_tokens)
    names, counts, shares = zip(*mix)
    p = np.array(shares, dtype=float) / sum(shares)
    t = 0.0
    out = []
    for i in range(num_requests):
        t += float(rng.exponential(1.0 / rate))
        k = int(rng.choice(len(names), p=p))
        out.append(
            SimRequest(
                f"r{i}",
                t,
                names[k],
                text_tokens + TEMPLATE_TOKENS,
                (image,) * counts[k],
                output_tokens,
            )
        )
    return out


def class_work_s(profile: Profile, workload: Sequence[SimRequest]) -> dict[str, float]:
    """Each class's share of the workload's work in seconds per request: share x its first request's
    end-to-end seconds simulated alone (as `firsttoken bench --utilization` measures a server's
    service times)."""
    first: dict[str, SimRequest] = {}
    counts: dict[str, int] = {}
    for r in workload:
        first.setdefault(r.cls, r)
        counts[r.cls] = counts.get(r.cls, 0) + 1
    out = {}
    for cls, r in first.items():
        alone = simulate([replace(r, arrival_s=0.0)], [profile], Router("round-robin")).outcomes[0]
        out[cls] = counts[cls] / len(workload) * (alone.e2e_s or 0.0)
    return out


def capacity_rps(profile: Profile, workload: Sequence[SimRequest]) -> float:
    """Requests/s one replica finishes one at a time for this workload's class mix: 1 / sum(share x
    unloaded end-to-end seconds)."""
    return 1.0 / sum(class_work_s(profile, workload).values())


def from_trace(
    records: Sequence[dict[str, Any]],
    model: ModelConfig,
    image_size: tuple[int, int] = (1024, 1024),
    image_budget_tokens: int = DEFAULT_IMAGE_BUDGET,
) -> list[SimRequest]:
    """A measured run's requests (``firsttoken bench`` records: start_s, cls, num_images,
    prompt_tokens, completion_tokens), replayed with the same arrivals, classes and token counts.
    Records without usage fall back to an 800-token text."""
    image = image_for(model, *image_size, image_budget_tokens)
    out = []
    for r in records:
        if r.get("warmup"):
            continue
        n = int(r.get("num_images") or 0)
        prompt = r.get("prompt_tokens")
        text = (
            (int(prompt) - n * (image.num_tokens + IMAGE_WRAPPER_TOKENS))
            if prompt
            else 800 + TEMPLATE_TOKENS
        )
        out.append(
            SimRequest(
                f"t{r['index']}",
                float(r["start_s"]),
                str(r.get("cls") or image_class(n)),
                max(1, text),
                (image,) * n,
                int(r.get("completion_tokens") or 32),
            )
        )
    return sorted(out, key=lambda s: s.arrival_s)


# ---- one replica ---------------------------------------------------------------------------------
@dataclass
class Outcome:
    request: SimRequest
    replica: int
    ttft_s: float | None = None
    e2e_s: float | None = None
    refused: str | None = None  # "queue_full" | "over_slo" | "never_fits"
    # the admission check's prediction, from arrival (preprocess included)
    predicted_ttft_s: float | None = None
    # the visual-token budget per image admission lowered it to (None: not lowered)
    image_budget: int | None = None
    token_s: list[float] = field(default_factory=list)  # each output token's time from arrival

    @property
    def itl_s(self) -> list[float]:
        """Gaps between consecutive output tokens (the reading speed a streaming client sees)."""
        return [b - a for a, b in zip(self.token_s, self.token_s[1:])]


class SimReplica:
    """A firsttoken scheduler on a virtual clock; steps cost what the profile's cost model says."""

    def __init__(
        self, index: int, profile: Profile, step_noise: float = 0.0, seed: int = 0
    ) -> None:
        self.index = index
        self.profile = profile
        self.now = 0.0  # the virtual clock, as this replica last saw it
        self.scheduler = Scheduler(
            profile.scheduler,
            profile.cache,
            profile.num_kv_blocks,
            profile.max_model_len,
            profile.encoder_capacity_tokens,
            cost_model=CostModel(prior=profile.prior),
            clock=lambda: self.now,
        )
        # the price list; the scheduler's copy is its own
        self.cost = CostModel(prior=profile.prior)
        self.step_noise = step_noise
        self.rng = random.Random(seed * 7919 + index)
        self.busy_until: float | None = None  # end of the step in flight
        self._step: ScheduledBatch | None = None
        self._step_start = 0.0
        self._scale = 1.0  # the step in flight's noise factor
        # the step in flight's encoder units done at its end, per image hash
        self._progress: dict[str, int] = {}
        # bumped when the step in flight's end moves (an interrupt): older end events are stale
        self.generation = 0
        self.num_interrupts = 0
        self._outcomes: dict[str, Outcome] = {}
        self._seq = 0
        self.num_steps = 0
        self.busy_s = 0.0
        self.num_inflight = 0  # routed here, not yet in the scheduler (preprocessing)
        # the largest of each cost-model term in one step priced
        self.max_terms = np.zeros(len(FEATURE_NAMES))
        # admitted since the last schedule built the backlog the admission check reads: their work
        # passed as pending, as the server's admission counts requests admitted and not yet in its
        # scheduler's snapshot (not in the queue depth: they are in the scheduler's queue already)
        self._unscheduled = Reservations()

    # load signals a router reads (what a replica could report cheaply, plus what the router itself
    # sent)
    @property
    def num_queued(self) -> int:
        """Waiting in the scheduler, plus routed here and still being preprocessed (the router knows
        those)."""
        return len(self.scheduler.waiting) + self.num_inflight

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def kv_free_ratio(self) -> float:
        kv = self.scheduler.kv
        return 1.0 - kv.num_used_blocks / kv.num_blocks

    def pending_work_s(self) -> float:
        """Predicted seconds of prompt work queued or prefilling here (the scheduler's own
        estimate)."""
        return sum(self.scheduler.remaining_work_s(r) for r in self.scheduler.requests.values()
                   if r.num_computed_tokens < r.num_prompt_tokens)

    def add(self, request: SimRequest, outcome: Outcome, now: float) -> None:
        self.now = now
        self.num_inflight -= 1
        er = _engine_request(request)
        lane = route_lane(er.num_prompt_tokens, self.scheduler.config)
        pending = self._unscheduled.pending(lane, None, now)

        def ask(er: EngineRequest) -> AdmissionVerdict:
            return self.scheduler.check_admission(
                PromptWork.of(er.num_prompt_tokens, er.images), 0, pending
            )

        model = self.profile.model
        # as the server's intake: over the objective, the images' budget steps down the family's
        # ladder (only where the checkpoint's config plans the images again)
        degradable = model is not None and bool(request.images) and all(
            im.size and im.budget_tokens for im in request.images)
        original = max(im.budget_tokens or 0 for im in request.images) if degradable else 0

        def plan_at(cap: int) -> EngineRequest:
            assert model is not None
            images = tuple(image_for(model, *im.size, min(im.budget_tokens or cap, cap))  # type: ignore[misc]
                           for im in request.images)
            return _engine_request(replace(request, images=images))

        ladder = family_named(model.family).budget_ladder if model is not None else PIXEL_LADDER
        deal = negotiate(ask, plan_at, er, original, ladder, self.profile.image_min_tokens_under_load)
        er, verdict = deal.plan, deal.verdict
        if degradable:
            outcome.image_budget = deal.budget
        if verdict.predicted_ttft_s is not None:
            outcome.predicted_ttft_s = now - request.arrival_s + verdict.predicted_ttft_s
        if not verdict.admitted:
            outcome.refused = verdict.reason
            return
        self._outcomes[request.request_id] = outcome
        er = replace(er, long_place_s=verdict.long_place_s)
        work = replace(PromptWork.of(er.num_prompt_tokens, er.images), admitted_s=request.arrival_s,
                       long_place_s=verdict.long_place_s)
        lane = route_lane(er.num_prompt_tokens, self.scheduler.config)  # its final plan's lane
        self._unscheduled.hold(request.request_id, lane, work)
        self.scheduler.add(Request(er, self._seq))
        self._seq += 1

    def start_step(self, now: float) -> float | None:
        """Schedule the next step at ``now``; returns when it ends (None: nothing to do)."""
        self.now = now
        batch = self.scheduler.schedule()
        self._unscheduled.clear()  # in the backlog the schedule built
        if batch.is_empty:
            return None
        # a step that only releases finished requests' runner state does no model work: (almost)
        # free
        seconds = max(self.cost.predict(batch.features), 1e-6) if batch.has_work else 1e-6
        if batch.has_work:
            np.maximum(self.max_terms, batch.features.vector(), out=self.max_terms)
        if self.step_noise and batch.has_work:
            seconds *= math.exp(self.rng.gauss(0.0, self.step_noise))
        self._step = batch
        self._step_start, self._scale = now, seconds / max(self.cost.predict(batch.features), 1e-9)
        self._progress = {w.content_hash: w.start_unit + w.num_units for w in batch.encoder_work}
        deferred = 0.0
        # the runner runs them after the forward and sampling
        if any(w.interruptible for w in batch.encoder_work):
            deferred = sum(s for w, _, s in self._timeline() if w is not None and w.interruptible)
        # sampled tokens leave here; deferred units run after
        self._forward_end = now + seconds - deferred
        self.busy_until = now + seconds
        self.busy_s += seconds
        self.num_steps += 1
        return self.busy_until

    def interrupt(self, now: float) -> float | None:
        """A short request reached the scheduler at ``now`` while a step runs: as the runner does,
        stop the step's interruptible encoder work at the next unit (the runner's order: the encoder
        work a chunk needs, the forward with the per-step constant, then the interruptible units; a
        unit is cut when it would start after the arrival, unless nothing ran before it). Returns
        the step's new end, or None when nothing was cut."""
        batch = self._step
        if batch is None or not any(w.interruptible for w in batch.encoder_work):
            return None
        items = self._timeline()
        t, cut = self._step_start, 0.0
        progress = dict(self._progress)
        for w, k, seconds in items:
            # starts after the arrival
            if w is not None and w.interruptible and t >= now and t > self._step_start:
                progress[w.content_hash] = min(progress[w.content_hash], k)
                cut += seconds
            else:
                t += seconds
        if cut <= 0:
            return None
        self._progress = progress
        self.busy_until = max(now, self.busy_until - cut)
        self.busy_s -= cut
        self.generation += 1
        self.num_interrupts += 1
        return self.busy_until

    def _timeline(self) -> list:
        """The step in flight as the runner runs it: (work or None for the forward, unit index,
        seconds)."""
        batch = self._step
        items = []
        for w in batch.encoder_work:
            units = self.scheduler.requests[w.request_id].images[w.image_index].encoder_units
            for k in range(w.start_unit, w.start_unit + w.num_units):
                u = units[k]
                items.append(
                    (
                        w,
                        k,
                        self._scale
                        * self.cost.work_s(encoder_units(u.num_patches, u.attention_pairs)),
                    )
                )
        forward = self._scale * self.cost.predict(batch.features) - sum(s for _, _, s in items)
        return ([i for i in items if not i[0].interruptible] + [(None, 0, forward)]
                + [i for i in items if i[0].interruptible])

    def finish_step(self, now: float) -> None:
        self.now = now
        batch, self._step, self.busy_until = self._step, None, None
        assert batch is not None
        sampling = {c.request_id: self.scheduler.requests[c.request_id] for c in batch.chunks
                    if c.sample and c.request_id in self.scheduler.requests}
        if batch.has_work:
            self.scheduler.note_step_time(batch.features, now - self._step_start)
        ended = self.scheduler.update(
            batch, RunnerOutput(dict.fromkeys(sampling, 0), {}, {}, encoder_progress=self._progress,
                                sample_done_s=self._forward_end)
        )
        done = {req.request_id for req, _ in ended}
        for rid, req in sampling.items():
            outcome = self._outcomes[rid]
            outcome.token_s.append(self._forward_end - outcome.request.arrival_s)
            if outcome.ttft_s is None:
                outcome.ttft_s = outcome.token_s[0]
                # the prediction learns its error, as on a server
                if outcome.predicted_ttft_s is not None:
                    self.scheduler.admission.observe_ttft(
                        len(req.images), outcome.predicted_ttft_s, outcome.ttft_s
                    )
            if rid in done:
                outcome.e2e_s = now - outcome.request.arrival_s
                del self._outcomes[rid]


def _engine_request(r: SimRequest) -> EngineRequest:
    """Token ids and positions the scheduler can hash: distinct per request (no accidental prefix
    hits), shared within a conversation; image pads where the images are."""
    if r.text_tokens < 1:
        raise ValueError(f"request {r.request_id} has no text tokens")
    key = r.conversation or r.request_id
    base = 1000 + (zlib.crc32(key.encode()) % 10_000_000) * 8
    head = min(8, r.text_tokens)
    ids = [base + i for i in range(head)]
    items = []
    for k, im in enumerate(r.images):
        ids.append(1)
        items.append(
            ImageItem(f"{key}/img{k}", len(ids), im.num_tokens, im.grid_thw, im.encoder_units, None)
        )
        ids += [2] * im.num_tokens
        ids.append(3)
    ids += [base + head + i for i in range(r.text_tokens - head)]
    # [3, num_tokens]: keyed as text (one conversation, one layout)
    positions = torch.arange(len(ids)).expand(3, -1)
    return EngineRequest(
        r.request_id,
        tuple(ids),
        tuple(items),
        positions,
        0,
        SamplingParams(max_tokens=r.output_tokens, temperature=0.0, ignore_eos=True),
        r.arrival_s,
        r.arrival_s,
    )


# ---- routing -------------------------------------------------------------------------------------
ROUTING_POLICIES = ("round-robin", "least-loaded", "p2c", "least-work")


@dataclass
class Router:
    """Which replica a request goes to. ``pools``: {"short": [replica indexes], "long": [...]}
    routes by prompt length against the scheduler's long-prompt threshold first (lane pools); within
    a pool, ``policy``: round-robin; least-loaded (fewest queued + running, then most free KV); p2c
    (power of two choices on the same load); least-work (least predicted prompt work pending, the
    scheduler's own estimate)."""

    policy: str = "least-loaded"
    pools: dict[str, list[int]] | None = None
    long_prompt_threshold: int = SchedulerConfig().long_prompt_threshold
    seed: int = 0
    _rr: dict[str, itertools.count] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(
                f"routing policy {self.policy!r}: expected one of {', '.join(ROUTING_POLICIES)}"
            )
        self._rng = random.Random(self.seed)

    def pick(self, request: SimRequest, replicas: Sequence[SimReplica]) -> SimReplica:
        pool = "all"
        candidates = list(range(len(replicas)))
        if self.pools:
            pool = "long" if request.num_prompt_tokens >= self.long_prompt_threshold else "short"
            candidates = self.pools[pool] or candidates
        if self.policy == "round-robin":
            counter = self._rr.setdefault(pool, itertools.count())
            return replicas[candidates[next(counter) % len(candidates)]]
        if self.policy == "p2c" and len(candidates) > 2:
            candidates = self._rng.sample(candidates, 2)
        if self.policy == "least-work":
            return min(
                (replicas[i] for i in candidates), key=lambda r: (r.pending_work_s(), r.num_running)
            )
        return min((replicas[i] for i in candidates),
                   key=lambda r: (r.num_queued + r.num_running, -r.kv_free_ratio))


# ---- the event loop ------------------------------------------------------------------------------
@dataclass
class SimResult:
    outcomes: list[Outcome]
    duration_s: float  # virtual seconds from the first arrival to the last completion
    replica_busy_s: list[float]
    replica_steps: list[int]
    # the largest of each cost-model term in one step
    max_terms: dict[str, float] = field(default_factory=dict)

    def by_class(self) -> dict[str, list[Outcome]]:
        out: dict[str, list[Outcome]] = {}
        for o in self.outcomes:
            out.setdefault(o.request.cls, []).append(o)
        return out

    def summary(self) -> dict[str, Any]:
        classes = {}
        for cls, outs in self.by_class().items():
            ttft = sorted(o.ttft_s for o in outs if o.ttft_s is not None)
            errors = sorted(abs(o.predicted_ttft_s - o.ttft_s) / o.ttft_s for o in outs
                            if o.ttft_s and o.predicted_ttft_s is not None)
            classes[cls] = {
                "sent": len(outs),
                "n": len(ttft),
                "refused": sum(o.refused is not None for o in outs),
                "p50": nearest_rank(ttft, 50),
                "p95": nearest_rank(ttft, 95),
                "p99": nearest_rank(ttft, 99),
                "mean": sum(ttft) / len(ttft) if ttft else None,
                "prediction_error_p50": nearest_rank(errors, 50),
                "prediction_error_p90": nearest_rank(errors, 90),
            }
            itl = sorted(g for o in outs for g in o.itl_s)
            classes[cls].update(
                {
                    "itl_n": len(itl),
                    "itl_p50": nearest_rank(itl, 50),
                    "itl_p90": nearest_rank(itl, 90),
                    "itl_p99": nearest_rank(itl, 99),
                    "itl_mean": sum(itl) / len(itl) if itl else None,
                }
            )
        span = self.duration_s or 1.0
        return {"classes": classes, "duration_s": self.duration_s,
                "utilization": [b / span for b in self.replica_busy_s], "steps": self.replica_steps}


def nearest_rank(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile of sorted values (q in 0..100), as /stats and the benchmarks report
    them."""
    if not values:
        return None
    return values[max(1, math.ceil(q / 100 * len(values))) - 1]


def simulate(workload: Sequence[SimRequest], profiles: Sequence[Profile], router: Router,
             step_noise: float = 0.0, seed: int = 0) -> SimResult:
    """Run the workload through len(profiles) replicas on one virtual clock; every request ends
    answered or refused.

    Events, in time order: a request arrives at the router (routed at once, on the load the replicas
    report then); it reaches its replica's scheduler after its class's preprocess delay; an idle
    replica with work starts a step; a step ends (its prefill chunks and encoder units done, one
    token for each chunk that samples)."""
    replicas = [SimReplica(i, p, step_noise, seed) for i, p in enumerate(profiles)]
    outcomes = []
    events: list[tuple[float, int, str, Any]] = []
    seq = itertools.count()
    for r in workload:
        heapq.heappush(events, (r.arrival_s, next(seq), "arrive", r))
    start = workload[0].arrival_s if workload else 0.0
    now = start
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            replica = router.pick(payload, replicas)
            replica.num_inflight += 1
            outcome = Outcome(payload, replica.index)
            outcomes.append(outcome)
            delay = replica.profile.preprocess_s.get(image_class(len(payload.images)), 0.0)
            heapq.heappush(events, (now + delay, next(seq), "ready", (replica, payload, outcome)))
            continue
        if kind == "ready":
            replica, request, outcome = payload
            replica.add(request, outcome, now)
            if (replica.busy_until is not None and replica.profile.scheduler.encoder_interrupt
                    and route_lane(request.num_prompt_tokens, replica.profile.scheduler) == SHORT):
                end = replica.interrupt(now)  # as the serving side signals the runner
                if end is not None:
                    heapq.heappush(
                        events, (end, next(seq), "step_done", (replica, replica.generation))
                    )
        else:  # "step_done"
            replica, generation = payload
            if generation != replica.generation:
                continue  # the step's end moved (interrupted): a later event ends it
            replica.finish_step(now)
        if replica.busy_until is None:
            end = replica.start_step(now)
            if end is not None:
                heapq.heappush(events, (end, next(seq), "step_done", (replica, replica.generation)))
    for r in replicas:  # nothing may be left behind: the loop drains every replica
        assert not r.scheduler.has_work, f"replica {r.index} still has work"
    most = np.max([r.max_terms for r in replicas], axis=0)
    return SimResult(
        outcomes,
        now - start,
        [r.busy_s for r in replicas],
        [r.num_steps for r in replicas],
        {name: float(v) for name, v in zip(FEATURE_NAMES[1:], most[1:])},
    )


def replace_scheduler(profile: Profile, **changes: Any) -> Profile:
    """The same profile with scheduler options changed (e.g. scheduling="fcfs" for a what-if)."""
    return replace(profile, scheduler=replace(profile.scheduler, **changes))
