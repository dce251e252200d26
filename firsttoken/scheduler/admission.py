"""Admission and prediction: may a prompt queue now, and when would its first token come?

``Admission.check`` is asked by the API's threads before any image is decoded; it reads only the
``Backlog``, a snapshot the engine thread rebuilds after every step (``observe_step``) and swaps in
whole, so no live scheduler state is shared across threads. The prediction prices the work ahead of
a prompt in its lane and its own encode and prefill with the step-cost model, at the share of each
step its lane gets, times its class's learnt bias (ttft_bias.py). With ``--ttft-slo``: a prediction
over the class's objective is refused (429, ``over_slo``); an image prompt whose wait (times the
margin) is over is admitted with ``lower_budget``; and a newcomer is placed behind any queued long
request it would push past its objective (``protected_place``). ``negotiate`` is the one rule that
lowers an image budget down the family's ladder while the verdict asks for less; ``Reservations``
holds the admitted requests not yet in the backlog.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from firsttoken.config import SchedulerConfig
from firsttoken.kv.block_manager import KVCacheManager
from firsttoken.scheduler.cost_model import CostModel, encoder_units, prefill_chunk
from firsttoken.scheduler.encoder_cache import EncoderCacheManager
from firsttoken.scheduler.lanes import LONG, LONG_MIN_SHARE, SHORT, route_lane
from firsttoken.scheduler.request import Request
from firsttoken.scheduler.step import StepDraft
from firsttoken.scheduler.ttft_bias import TtftBias
from firsttoken.types import AdmissionVerdict, PromptWork, count_videos

if TYPE_CHECKING:
    from firsttoken.models.ladder import BudgetLadder

Plan = TypeVar("Plan")


@dataclass(frozen=True)
class Backlog:
    """The queue as the admission check reads it, rebuilt by the engine thread after every step and
    swapped in whole (the API's threads read it without touching live scheduler state)."""

    # predicted seconds of prefill + encoder work left in the short (or fcfs) lane
    short_s: float = 0.0
    long_s: tuple[float, ...] = ()  # each long request's predicted remaining work, seconds
    # deadline order: each long request's place in line, as long_s
    long_places: tuple[float, ...] = ()
    decode_share: float = 0.0  # of a busy step's time: decodes (EMA)
    short_share: float = 0.0  # of a busy step's time: short prefills (EMA)
    step_s: float = 0.0  # a busy step's predicted seconds (EMA)
    busy: bool = False  # anything running or waiting
    # time-bounded steps: of a step's predicted seconds (its per-step constant included), what each
    # lane got in the steps where it ran (EMA): the rate its queue drains at while it has work
    short_frac: float = 0.0
    long_frac: float = 0.0
    step_end_s: float = 0.0  # the step in flight's predicted end, on the scheduler's clock
    # the step in flight's interruptible encoder work, run last: its start on the scheduler's clock
    # and its mean unit's seconds; a short request arriving before it waits for the step up to
    # there, inside it for one unit
    cut_span: tuple[float, float] = (0.0, 0.0)
    # with --ttft-slo, deadline order: each long request's objective as a time on the scheduler's
    # clock, as long_s
    long_deadlines: tuple[float, ...] = ()


def remaining_work_s(cost: CostModel, encoder_cache: EncoderCacheManager, req: Request,
                     start: int | None = None) -> float:
    """Predicted seconds of the request's remaining prefill and encoder work (its share of steps, no
    per-step constant), from ``start`` tokens (default: those computed); images already encoded cost
    nothing."""
    start = req.num_computed_tokens if start is None else start
    if not cost.is_fitted:
        return float(req.num_tokens - start)
    patches, pairs = 0, 0.0
    for im in req.images:
        if im.end > start and not encoder_cache.is_ready(im.content_hash):
            for u in im.encoder_units[encoder_cache.units_done(im.content_hash):]:
                patches += u.num_patches
                pairs += u.attention_pairs
    return cost.work_s(
        prefill_chunk(max(req.num_tokens - start, 1), start, True) + encoder_units(patches, pairs)
    )


def place_work_s(
    cost: CostModel,
    encoder_cache: EncoderCacheManager,
    kv: KVCacheManager,
    block_size: int,
    req: Request,
) -> float:
    """A long request's work from where it would start now: what it computed, or, still waiting,
    what the prefix cache will serve (the deadline order's place)."""
    start = req.num_computed_tokens
    if not start and kv.enable_prefix_caching:
        start = kv.num_cached_prefix_tokens(
            req.ensure_block_hashes(block_size), req.num_prompt_tokens - 1
        )
    return remaining_work_s(cost, encoder_cache, req, start)


def prompt_work_s(cost: CostModel, work: PromptWork) -> float:
    """Predicted seconds of a whole prompt's prefill and encoder work (no per-step constant)."""
    return cost.work_s(prefill_chunk(work.num_prompt_tokens, 0, True)
                       + encoder_units(work.encoder_patches, work.encoder_attention_pairs))


class Admission:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        cost_model: CostModel,
        queue_depth: Callable[[str], int],
        step_time_target: Callable[[], float],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``queue_depth(lane)``: requests waiting in a lane; ``step_time_target()``: the pacing's
        bound."""
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.cost_model = cost_model
        self.queue_depth = queue_depth
        self.step_time_target = step_time_target
        self.clock = clock
        # --ttft-slo per class, parsed once (the config is frozen)
        self.objectives = config.ttft_slo_s
        self.backlog = Backlog()
        # the prediction's error per class (ttft_bias.py)
        self.ttft_bias = TtftBias(config.ttft_bias_step)

    def check(
        self, work: PromptWork, num_pending: int = 0, pending: tuple[PromptWork, ...] = ()
    ) -> AdmissionVerdict:
        """May a prompt like ``work`` queue now? Cheap and side-effect free; the verdict carries the
        predicted TTFT. num_pending: requests already promised a place in this prompt's lane but not
        yet queued here (``pending``: their work, when known, counted ahead). With --ttft-slo, a
        prediction over the class's objective is refused ("over_slo", 429): the input processor may
        lower the image budget and ask again; under it, an image prompt whose wait (with
        --ttft-slo-wait-margin) is over is admitted with ``lower_budget``, and a long prompt gets
        the place in line its prediction assumed (``long_place_s``)."""
        config = self.config
        num_prompt_tokens = work.num_prompt_tokens
        lane = route_lane(num_prompt_tokens, config)
        need = min(num_prompt_tokens + config.decode_reserve_tokens, self.max_model_len)
        if (
            self.kv.blocks_needed(need) > self.kv.num_blocks
            or num_prompt_tokens >= self.max_model_len
        ):
            return AdmissionVerdict(
                False,
                lane,
                "never_fits",
                f"the prompt has {num_prompt_tokens} tokens; with the {config.decode_reserve_tokens}-token "
                f"decode reserve it can never fit this server's KV cache ({self.kv.num_blocks * self.kv.block_size} "
                f"tokens) or context ({self.max_model_len}); shorten the text or send fewer/smaller images",
                400,
            )
        depth = self.queue_depth(lane) + num_pending
        if depth >= config.max_queued_requests:
            return AdmissionVerdict(
                False,
                lane,
                "queue_full",
                f"the {lane} lane already has {depth} requests waiting (limit {config.max_queued_requests}); "
                "retry later",
                429,
            )
        raw = self._predict(work, pending)
        bias = self.ttft_bias.factor(work.num_images, work.num_videos)
        predicted = None if raw is None else raw[0] * bias
        slo = self.objectives.get(work.request_class)
        if slo is not None and predicted is not None and predicted > slo:
            wait = predicted - slo
            return AdmissionVerdict(
                False, lane, "over_slo",
                f"the server is busy: this request's predicted time to first token is {predicted:.1f} s, over this "
                f"server's {slo:g} s objective for {work.request_class} requests; retry in about {math.ceil(wait)} s",
                429, predicted, wait,
            )
        lower = False
        if slo is not None and raw is not None and work.num_images and config.ttft_slo_wait_margin:
            # the prediction's error lies in its wait (work ahead, arrivals that will pass it, the
            # lane's share): aim the image's budget at an objective that holds with that wait
            # counted (1 + margin) times
            wait = max(raw[0] - raw[1], 0.0) * bias
            lower = bool(predicted + config.ttft_slo_wait_margin * wait > slo)
        # only where protecting objectives moved it back
        place = raw[2] if raw is not None else None
        return AdmissionVerdict.ok(lane, predicted, lower, place)

    def predict_ttft(self, work: PromptWork, pending: tuple[PromptWork, ...] = ()) -> float | None:
        """Seconds from now to this prompt's first token if it were queued now (None before the cost
        model is fitted). Reads only the Backlog snapshot and the bias, so any thread may ask."""
        raw = self._predict(work, pending)
        return (
            None
            if raw is None
            else raw[0] * self.ttft_bias.factor(work.num_images, work.num_videos)
        )

    def observe_ttft(
        self, num_images: int, predicted_s: float, measured_s: float, num_videos: int = 0
    ) -> None:
        """A first token: the prediction given at admission against the TTFT measured from
        arrival."""
        self.ttft_bias.observe(num_images, predicted_s, measured_s, num_videos)

    def observe_first_token(self, req: Request, sample_done_s: float) -> None:
        """The request's first token was sampled at ``sample_done_s``: the prediction its admission
        gave (if any) learns its error."""
        er = req.engine_request
        if er.predicted_ttft_s is not None:
            self.observe_ttft(len(er.images), er.predicted_ttft_s, sample_done_s - er.arrival_s,
                              count_videos(er.images))

    def objective_at(self, req: Request) -> float:
        """When the request's class objective (--ttft-slo) runs out, on the scheduler's clock (inf:
        none)."""
        slo = self.objectives.get(
            "video" if count_videos(req.images) else "image" if req.images else "text"
        )
        return math.inf if slo is None else min(req.engine_request.arrival_s, req.queued_s) + slo

    # ---- the snapshot, after every step ----------------------------------------------------------
    def observe_step(self, step: StepDraft, pending: Sequence[Request], num_live: int,
                     work_s: Callable[[Request], float], place_s: Callable[[Request], float] | None,
                     alpha: float = 0.1) -> None:
        """Rebuild the Backlog from the step just scheduled and the requests still prefilling
        (``pending``): ``work_s`` prices one's remaining work, ``place_s`` gives a long one's place
        in line (deadline order)."""
        cost = self.cost_model
        if not cost.is_trained:
            return
        b = self.backlog
        decode_share, short_share, step_s = b.decode_share, b.short_share, b.step_s
        short_frac, long_frac = b.short_frac, b.long_frac
        total = step.predicted_s
        if total > 0:
            wall = total + cost.coef[0]
            decode_share += alpha * (step.decode_s / total - decode_share)
            short_share += alpha * (step.short_s / total - short_share)
            step_s += alpha * (wall - step_s) if step_s else wall

            def ema(old: float, new: float) -> float:
                return old + alpha * (new - old) if old else new

            # a lane's drain rate while it has work: every step in which it had work waiting counts,
            # those where the other lane took the whole step (at 0) too, not only the steps where it
            # ran (counting only those overstates the rate: a waiting request's TTFT is predicted
            # low)
            if step.short_s > 0 or any(r.lane != LONG for r in pending):
                short_frac = ema(short_frac, step.short_s / wall)
            if step.long_s > 0 or any(r.lane == LONG for r in pending):
                long_frac = ema(long_frac, step.long_s / wall)
        # after this step: its work in flight is the residual, not the backlog
        def left_s(r: Request) -> float:
            return max(work_s(r) - step.in_flight_s.get(r.request_id, 0.0), 0.0)

        short = sum(left_s(r) for r in pending if r.lane != LONG)
        long_reqs = [r for r in pending if r.lane == LONG]
        long = tuple(left_s(r) for r in long_reqs)
        places = tuple(place_s(r) for r in long_reqs) if place_s is not None else ()
        deadlines = (
            tuple(self.objective_at(r) for r in long_reqs) if places and self.objectives else ()
        )
        step_end = self.clock() + (total + cost.coef[0] if total > 0 else 0.0)
        span, unit = step.cut_span
        self.backlog = Backlog(
            short,
            long,
            places,
            decode_share,
            short_share,
            step_s,
            num_live > 0,
            short_frac,
            long_frac,
            step_end,
            (step_end - span, unit) if unit else (0.0, 0.0),
            deadlines,
        )

    # ---- the prediction --------------------------------------------------------------------------
    def _predict(self, work: PromptWork,
                 pending: tuple[PromptWork, ...]) -> tuple[float, float, float | None] | None:
        """(seconds to the first token, the part of them its own work takes at its lane's rate, its
        place in the long lane's deadline order when protecting objectives moved it back, else
        None), from one read of the Backlog snapshot; None before the cost model is fitted."""
        cost = self.cost_model
        if not cost.is_trained:
            return None
        b = self.backlog
        moved = None
        overhead = float(cost.coef[0])
        own = prompt_work_s(cost, work)
        # admitted, still preprocessing: queued by then
        queued = [prompt_work_s(cost, p) for p in pending]
        lane = route_lane(work.num_prompt_tokens, self.config)
        now = self.clock()
        if lane == LONG:
            if self.config.long_order == "deadline":
                # earliest place in line first: queued requests whose place comes before this one's,
                # and those still preprocessing that will get an earlier place (less work: they
                # arrived first)
                line = self._long_line(b, queued, pending, now)
                natural = now + self.config.long_slack * own
                place = natural
                if self.objectives:  # not before one it would push past its objective
                    place = protected_place(natural, own, line, now, _drain_rate(b.long_frac))
                    moved = place if place > natural else None
                # slack 0: arrival order, all of those waiting
                ahead = sum(w for w, p, _ in line if p <= place)
            else:
                # least remaining work first
                ahead = sum(w for w in (*b.long_s, *queued) if w <= own)
            rate = max(1.0 - b.decode_share - b.short_share, LONG_MIN_SHARE)
        else:
            ahead = b.short_s + sum(queued)
            rate = max(1.0 - b.decode_share, LONG_MIN_SHARE)
        # what is left of the step in flight
        residual = max(0.0, b.step_end_s - now) if b.busy else 0.0
        start, unit = b.cut_span
        # it cuts the step's last, interruptible units
        if lane == SHORT and unit and now < b.step_end_s:
            # the step up to them, or half the unit in progress
            residual = start - now if now < start else unit / 2
        if math.isfinite(self.step_time_target()):
            # time-bounded steps: a lane drains at the share of each step's time it got while it had
            # work (its first short prefill is granted whole, long units run whole); shares cover
            # the per-step constant
            frac = b.long_frac if lane == LONG else b.short_frac
            if frac <= 0:  # no step of this lane seen yet: its prefill alone, one step at a time
                frac = own / (own + overhead) if own > 0 else 1.0
            frac = max(frac, LONG_MIN_SHARE)
            return residual + (ahead + own) / frac, own / frac, moved
        step_s = max(b.step_s, own + overhead)
        work_s = (ahead + own) / rate
        num_steps = max(1, math.ceil(work_s / max(step_s - overhead, 1e-3)))
        own_steps = max(1, math.ceil(own / rate / max(step_s - overhead, 1e-3)))
        return residual + work_s + num_steps * overhead, own / rate + own_steps * overhead, moved

    def _long_line(self, b: Backlog, queued: list[float], pending: tuple[PromptWork, ...],
                   now: float) -> list[tuple[float, ...]]:
        """The long lane in deadline order as an admission sees it: (work seconds, place,
        objective's deadline) of each waiting request and of each admitted one still preprocessing
        (its place: the one its admission gave it, else its admission (or now) + slack x its
        work)."""
        slack, slo = self.config.long_slack, self.objectives
        deadlines = b.long_deadlines or (math.inf,) * len(b.long_s)
        preprocessing = [(w, _or_now(p.long_place_s, _or_now(p.admitted_s, now) + slack * w),
                          _or_now(p.admitted_s, now) + slo.get(p.request_class, math.inf))
                         for w, p in zip(queued, pending)]
        return [*zip(b.long_s, b.long_places, deadlines), *preprocessing]


def _or_now(t: float | None, now: float) -> float:
    return now if t is None else t


def _drain_rate(long_frac: float) -> float:
    """Seconds of long-lane work done per second of wall time: the share the lane got while it had
    work."""
    return max(long_frac, LONG_MIN_SHARE) if long_frac > 0 else 1.0


def protected_place(
    place: float, own: float, queue: Iterable[tuple[float, float, float]], now: float, rate: float
) -> float:
    """A newcomer's place in the deadline order when admitted requests hold objectives: ``place``
    unless a queued request it would pass (``queue``: each one's remaining work seconds, place and
    objective's deadline) misses its deadline with the newcomer's ``own`` work ahead of it; then the
    place of the last such request (ties go to the earlier arrival, so the newcomer is behind it). A
    request already predicted to miss is protected too: passing it would only make it later, and the
    requests that end up in a class's tail are those (docs/scheduling.md)."""
    out, done = place, 0.0
    for work, at, deadline in sorted(queue, key=lambda q: q[1]):
        done += work
        if at > place and deadline < now + (done + own) / rate:
            out = max(out, at)
    return out


@dataclass(frozen=True)
class Negotiated(Generic[Plan]):
    plan: Plan  # the last plan asked about
    verdict: AdmissionVerdict  # its verdict: admitted or not, the caller refuses
    budget: int | None  # the image budget it was lowered to (None: as asked)


def negotiate(ask: Callable[[Plan], AdmissionVerdict], plan_at: Callable[[int], Plan], plan: Plan,
              budget: int, ladder: BudgetLadder, floor: int) -> Negotiated[Plan]:
    """The one rule for lowering an image budget under load: ask about ``plan`` (planned at
    ``budget``, the largest of its images' budgets the client left to the server; 0: none); while
    the verdict asks for a lower budget, step down the family's ``ladder``, not under ``floor``,
    and ask about ``plan_at(rung)``. The server's intake (from image headers, nothing decoded) and
    the simulator both call this."""
    verdict, start = ask(plan), budget
    while verdict.asks_lower_budget:
        lower = ladder.below(budget, floor)
        if lower is None:
            break
        budget = lower
        plan = plan_at(budget)
        verdict = ask(plan)
    return Negotiated(plan, verdict, budget if budget < start else None)


class Reservations:
    """Admitted requests not yet in the scheduler's backlog (still preprocessing, or added since the
    last step): their work is ahead of a newcomer in their lane. A request asked about again at a
    lower budget is not ahead of itself. Not thread-safe: the caller serializes the check and the
    hold (engine/async_engine.py holds one lock over both)."""

    def __init__(self, ttl_s: float = math.inf) -> None:
        self.ttl_s = ttl_s  # a place never handed over (the client left) expires
        self._held: dict[str, tuple[str, PromptWork]] = {}

    def pending(self, lane: str, asking: str | None, now: float) -> tuple[PromptWork, ...]:
        """The work held in ``lane`` ahead of the request ``asking`` (expired places dropped)."""
        for rid in [r for r, (_, w) in self._held.items()
                    if now - _or_now(w.admitted_s, now) > self.ttl_s]:
            del self._held[rid]
        return tuple(w for rid, (v, w) in self._held.items() if v == lane and rid != asking)

    def hold(self, request_id: str, lane: str, work: PromptWork) -> None:
        self._held[request_id] = (lane, work)

    def release(self, request_id: str) -> None:
        self._held.pop(request_id, None)

    def clear(self) -> None:
        self._held.clear()

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._held))
