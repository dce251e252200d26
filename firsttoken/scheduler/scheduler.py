"""The scheduler: one loop, one budget per step (tokens and predicted seconds), lanes as policy.

Tokens, not phases: a request is ``num_computed_tokens`` chasing ``num_tokens``. Each step:
  1. every running request that is decoding gets its one token;
  2. the short lane's prefills (running first, then admissions) take what they want: the step's first short
     prefill is granted whole (a short prompt is one step), later ones what the step's time bound leaves;
  3. the long lane fills what is left of the step's time bound (``step_time_target``: the step-cost model's
     prediction, fitted online from the engine's own timings), in deadline order: each request's place in line is
     its arrival plus ``long_slack`` times its own predicted work, earliest first, so a later request goes first
     only while its place is earlier (smaller requests overtake a bigger one for a bounded time, nobody starves);
     ``long_order="least-work"`` is the previous order (least predicted remaining work, a request passed over
     ``long_max_passes`` steps first). If short work took the whole step ``long_max_wait_steps`` times in a row,
     the long lane runs anyway (aging: long is never starved).
A short request arriving mid-step therefore waits for at most one bounded step, and the long lane never leaves a
step's time unused while it has work (work-conserving); with ``encoder_interrupt`` (the default) a step that runs
the long lane's vision-tower work is cut at the next encoder unit when a short request arrives during it (the runner
checks between units; only work whose image no chunk of the same step covers), so the short request waits for one
unit rather than the whole step. The step's cost is learnt from the units that actually ran (``features_run``).
Long-lane work counts vision-tower work too: an image is encoded a few units per step (the model family's split,
each priced by the cost model), so nobody waits for someone else's whole encode. With ``step_time_target="off"``
the long lane is budgeted in tokens instead (``long_step_tokens``) and yields whole steps to short prefills (the
previous policy, for side-by-side runs).
``scheduling="fcfs"`` is the seed's starting point: one FIFO queue, whole-prompt prefills, whole-image encodes.

KV admission: with ``kv_admission="whole-prompt"`` a request starts only when blocks for its whole prompt plus
``decode_reserve_tokens`` are free, so no prefill is ever evicted halfway; "optimistic" admits when the next
chunk fits. When a decode's growth still runs the pool dry, the most recently admitted running request that holds no
promise (a decoder under whole-prompt admission; anyone under optimistic) is preempted by recompute, never swapped,
and counted with its cause; if there is none, the growing request itself. A request admitted whole-prompt is never
preempted before its prefill completes. No tensors here: everything is ints, lists and a small least-squares fit.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from firsttoken.batch import (
    EncoderWork,
    NewRequest,
    RunnerOutput,
    ScheduledBatch,
    ScheduledChunk,
    StepFeatures,
)
from firsttoken.config import CacheConfig, SchedulerConfig
from firsttoken.kv.block_manager import KVCacheManager
from firsttoken.kv.prefix_cache import ImageSpan, compute_block_hashes
from firsttoken.scheduler.budget import StepBudget
from firsttoken.scheduler.cost_model import CostModel, encoder_units, prefill_chunk
from firsttoken.scheduler.encoder_cache import EncoderCacheManager
from firsttoken.scheduler.lanes import FCFS, LONG, SHORT, LaneQueues, route_lane
from firsttoken.scheduler.request import Request, RequestStatus
from firsttoken.scheduler.ttft_bias import TtftBias
from firsttoken.types import AdmissionVerdict, FinishReason, ImageItem, PromptWork


@dataclass
class _Step:
    """What the step being built has collected so far."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    encoder_work: list[EncoderWork] = field(default_factory=list)
    worked_hashes: set[str] = field(default_factory=set)  # images advanced this step
    finishing_hashes: set[str] = field(default_factory=set)  # images whose last unit runs this step
    scheduled_ids: set[str] = field(default_factory=set)  # requests with a chunk or encoder work in this step
    has_long_work: bool = False
    has_short_prefill: bool = False  # a short request's prefill chunk is in this step
    long_held: bool = False  # the long lane had work but yielded this step to short prefills
    throughput: bool = False  # no decode and no short work: steps sized for throughput, not bounded in time
    full: bool = False  # the step's token budget or time bound was used up
    kv_blocked_ids: set[str] = field(default_factory=set)  # admissions refused for want of KV blocks
    preempted_ids: frozenset[str] = frozenset()
    decode_s: float = 0.0  # predicted seconds of this step's decodes, short prefills, long work (lane shares)
    short_s: float = 0.0
    long_s: float = 0.0
    # the interruptible encoder work's predicted seconds and its mean unit's (the runner runs it last in the step)
    cut_span: tuple[float, float] = (0.0, 0.0)
    in_flight_s: dict[str, float] = field(default_factory=dict)  # per request: predicted seconds of its work here

    @property
    def has_prefill(self) -> bool:
        return any(not c.is_decode for c in self.chunks)

    def charge(self, request_id: str, lane: str, is_decode: bool, seconds: float) -> None:
        self.in_flight_s[request_id] = self.in_flight_s.get(request_id, 0.0) + seconds
        if is_decode:
            self.decode_s += seconds
        elif lane == SHORT:
            self.short_s += seconds
        else:
            self.long_s += seconds


@dataclass(frozen=True)
class Backlog:
    """The queue as the admission check reads it, rebuilt by the engine thread after every step and swapped in
    whole (the API's threads read it without touching live scheduler state)."""

    short_s: float = 0.0  # predicted seconds of prefill + encoder work left in the short (or fcfs) lane
    long_s: tuple[float, ...] = ()  # each long request's predicted remaining work, seconds
    long_places: tuple[float, ...] = ()  # deadline order: each long request's place in line, as long_s
    decode_share: float = 0.0  # of a busy step's time: decodes (EMA)
    short_share: float = 0.0  # of a busy step's time: short prefills (EMA)
    step_s: float = 0.0  # a busy step's predicted seconds (EMA)
    busy: bool = False  # anything running or waiting
    # time-bounded steps: of a step's predicted seconds (its per-step constant included), what each lane got in the
    # steps where it ran (EMA): the rate its queue drains at while it has work
    short_frac: float = 0.0
    long_frac: float = 0.0
    step_end_s: float = 0.0  # the step in flight's predicted end, on the scheduler's clock
    # the step in flight's interruptible encoder work, run last: its start on the scheduler's clock and its mean
    # unit's seconds; a short request arriving before it waits for the step up to there, inside it for one unit
    cut_span: tuple[float, float] = (0.0, 0.0)
    # with --ttft-slo, deadline order: each long request's objective as a time on the scheduler's clock, as long_s
    long_deadlines: tuple[float, ...] = ()


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache_config: CacheConfig,
        num_kv_blocks: int,
        max_model_len: int,
        encoder_capacity_tokens: int,
        cost_model: CostModel | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock``: the engine's (monotonic seconds); the fleet simulator passes its virtual one."""
        self.config = config
        self.clock = clock
        self.cost_model = cost_model or CostModel()  # the engine feeds it each step's features and wall time
        self.max_model_len = max_model_len
        self.objectives = config.ttft_slo_s  # --ttft-slo per class, parsed once (the config is frozen)
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(num_kv_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        self.encoder_cache = EncoderCacheManager(encoder_capacity_tokens)
        self.waiting = LaneQueues(config)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every live request, waiting or running
        self.num_steps = 0
        self.num_preemptions = 0
        self.preemptions_by_reason: dict[str, int] = {}
        self.num_short_delayed_by_long = 0  # short requests that waited a whole step while long work ran
        self.num_encoder_interrupts = 0  # steps whose long-lane encoder work a short arrival cut short
        self.long_wait_steps = 0  # consecutive steps the long lane had work but was held back
        self._preempted: list[str] = []
        self._new: list[NewRequest] = []  # first admissions since the last batch: the runner's first sight
        self._finished_ids: list[str] = []  # requests the runner holds state for that finished since
        self._short_prompt_lens: deque[int] = deque(maxlen=256)  # recent short prompts: what the time bound serves
        self.calibrating = False  # engine/calibration.py: token budgets only while the cost model first learns
        self.backlog = Backlog()
        self._last_step = _Step()  # what the last schedule() built: wait_reason reads it
        self.ttft_bias = TtftBias(config.ttft_bias_step)  # the prediction's error per class (ttft_bias.py)

    # ---- requests in and out -------------------------------------------------------------------------
    def check_admission(
        self, work: PromptWork, num_pending: int = 0, pending: tuple[PromptWork, ...] = ()
    ) -> AdmissionVerdict:
        """May a prompt like ``work`` queue now? Cheap and side-effect free (the API asks before decoding images);
        the verdict carries the predicted TTFT. num_pending: requests already promised a place in this prompt's
        lane but not yet queued here (``pending``: their work, when known, counted ahead). With --ttft-slo, a
        prediction over the class's objective is refused ("over_slo", 429): the input processor may lower the image
        budget and ask again; under it, an image prompt whose wait (with --ttft-slo-wait-margin) is over is admitted
        with ``lower_budget`` (the processor may ask again at a lower budget), and a long prompt gets the place in
        line its prediction assumed (``long_place_s``)."""
        num_prompt_tokens = work.num_prompt_tokens
        lane = route_lane(num_prompt_tokens, self.config)
        need = min(num_prompt_tokens + self.config.decode_reserve_tokens, self.max_model_len)
        if self.kv.blocks_needed(need) > self.kv.num_blocks or num_prompt_tokens >= self.max_model_len:
            return AdmissionVerdict(
                False, lane, "never_fits",
                f"the prompt has {num_prompt_tokens} tokens; with the {self.config.decode_reserve_tokens}-token "
                f"decode reserve it can never fit this server's KV cache ({self.kv.num_blocks * self.block_size} "
                f"tokens) or context ({self.max_model_len}); shorten the text or send fewer/smaller images",
                400,
            )
        depth = len(self.waiting.queues[lane]) + num_pending
        if depth >= self.config.max_queued_requests:
            return AdmissionVerdict(
                False, lane, "queue_full",
                f"the {lane} lane already has {depth} requests waiting (limit {self.config.max_queued_requests}); "
                "retry later",
                429,
            )
        raw = self._predict_ttft_raw(work, pending)
        bias = self.ttft_bias.factor(work.num_images)
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
        if slo is not None and raw is not None and work.num_images and self.config.ttft_slo_wait_margin:
            # the prediction's error lies in its wait (work ahead, arrivals that will pass it, the lane's share):
            # aim the image's budget at an objective that holds with that wait counted (1 + margin) times
            wait = max(raw[0] - raw[1], 0.0) * bias
            lower = bool(predicted + self.config.ttft_slo_wait_margin * wait > slo)
        place = raw[2] if raw is not None else None  # only where protecting objectives moved it back
        return AdmissionVerdict.ok(lane, predicted, lower, place)

    def add(self, request: Request) -> None:
        request.lane = route_lane(request.num_prompt_tokens, self.config)
        request.arrival_step = self.num_steps
        request.queued_s = self.clock()
        if request.lane == SHORT:
            self._short_prompt_lens.append(request.num_prompt_tokens)
        elif request.engine_request.long_place_s is not None and self.config.long_order == "deadline":
            # the place its admission's prediction assumed, where protecting objectives moved it back (otherwise the
            # usual one, which discounts a cached prefix and encoded images)
            request.long_place_s = request.engine_request.long_place_s
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Stop a request wherever it is; frees its blocks and encoder pins at once."""
        if request.status == RequestStatus.FINISHED:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.requests.pop(request.request_id, None)
        self.kv.free(request.request_id)
        self.encoder_cache.release_all(request.request_id)
        if request.sent_to_runner:
            self._finished_ids.append(request.request_id)

    def forget_traffic(self) -> None:
        """Counters, cached prefixes and encoder outputs, lane history and the backlog back to a fresh scheduler's;
        the cost model and its TTFT bias stay. Only with no live request."""
        self.num_steps = self.num_preemptions = 0
        self.preemptions_by_reason = {}
        self.num_short_delayed_by_long = self.num_encoder_interrupts = self.long_wait_steps = 0
        self._short_prompt_lens.clear()
        self.backlog = Backlog()
        self._last_step = _Step()
        self.kv.forget_traffic()
        self.encoder_cache.forget_traffic()

    @property
    def has_work(self) -> bool:
        return bool(len(self.waiting) or self.running)

    @property
    def has_releases(self) -> bool:
        """Finished requests whose runner state one more batch must release."""
        return bool(self._finished_ids)

    # ---- one step ------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        fcfs = self.config.scheduling == "fcfs"
        target = math.inf if fcfs else self.step_time_target()
        decoding = [r for r in self.running if _is_decoding(r)]
        step = _Step()
        if math.isfinite(target) and self.config.step_time_target == "auto" and not decoding and len(self.requests) == 1:
            # alone, nobody the automatic bound protects is here: a throughput step (whole images, the fastest chunk);
            # a short request arriving during it cuts its encoder work at the next unit, and the next step is bounded
            # again (a target given in seconds bounds every step)
            step.throughput = True
            budget = StepBudget(self.throughput_chunk_tokens(), cost=self.cost_model, whole_images=True)
        else:
            if math.isfinite(target) and decoding:
                target = min(target, self._itl_step_bound(decoding))  # streaming answers' next tokens wait for it
            overhead = self.cost_model.coef[0] if math.isfinite(target) else 0.0  # the per-step constant
            budget = StepBudget(self.config.max_batched_tokens, max(target - overhead, 0.0), self.cost_model)
        for req in decoding:
            if req.status == RequestStatus.RUNNING and budget.remaining > 0:
                self._schedule_tokens(req, 1, budget, step)
                req.decode_steps += req.status == RequestStatus.RUNNING  # not when it was preempted for its block
        if fcfs:
            self._serve_lane(FCFS, budget, step, whole_prompt=True)
        else:
            short_work = self._serve_lane(SHORT, budget, step, whole_prompt=False)
            self._serve_long_lane(budget, step, held_by_short=short_work, target=target)
        step.full = budget.exhausted
        self._count_short_delays(step)
        if self.config.encoder_interrupt and not fcfs and step.encoder_work:
            self._mark_interruptible(step)
        preempted, self._preempted = tuple(self._preempted), []
        step.preempted_ids = frozenset(preempted)
        new, self._new = tuple(self._new), []
        finished, self._finished_ids = tuple(self._finished_ids), []
        self.num_steps += int(bool(step.chunks or step.encoder_work))
        self._update_backlog(step)
        self._last_step = step
        return ScheduledBatch(
            new, tuple(step.chunks), tuple(step.encoder_work), self.encoder_cache.pop_freed(), preempted, finished,
            budget.features,
        )

    def _mark_interruptible(self, step: _Step) -> None:
        """Long-lane encoder work may be cut between units, unless a chunk of this step covers its image (that
        chunk needs the embeddings the work finishes)."""
        covered: set[str] = set()
        for c in step.chunks:
            if not c.is_decode:
                req = self.requests[c.request_id]
                covered.update(im.content_hash for im in req.images if im.offset < c.end and im.end > c.context_len)
        step.encoder_work = [
            replace(w, interruptible=True)
            if self.requests[w.request_id].lane == LONG and w.content_hash not in covered else w
            for w in step.encoder_work
        ]
        units = [u for w in step.encoder_work if w.interruptible
                 for u in self.requests[w.request_id].images[w.image_index].encoder_units[
                     w.start_unit : w.start_unit + w.num_units]]
        if units and self.cost_model.is_trained:  # what they take (the runner runs them last in the step)
            span = self.cost_model.work_s(encoder_units(sum(u.num_patches for u in units),
                                                        sum(u.attention_pairs for u in units)))
            step.cut_span = (span, span / len(units))

    def features_run(self, batch: ScheduledBatch, result: RunnerOutput) -> StepFeatures:
        """The work a step actually did: what it was scheduled with, less the encoder units an interrupt cut (what
        the cost model must learn the step's time from)."""
        features = batch.features
        for w in self._cut_work(batch, result):
            units = self.requests[w.request_id].images[w.image_index].encoder_units
            cut = units[max(result.encoder_progress[w.content_hash], w.start_unit) : w.start_unit + w.num_units]
            features = features - encoder_units(sum(u.num_patches for u in cut), sum(u.attention_pairs for u in cut))
        return features

    def _cut_work(self, batch: ScheduledBatch, result: RunnerOutput) -> list[EncoderWork]:
        def cut(w: EncoderWork) -> bool:
            end = w.start_unit + w.num_units
            return result.encoder_progress.get(w.content_hash, end) < end

        return [w for w in batch.encoder_work if w.interruptible and w.request_id not in result.failed
                and w.request_id in self.requests and cut(w)]

    def step_time_target(self) -> float:
        """Seconds a step may take (inf: no time bound). auto: the predicted prefill of a typical (P90 of the recent
        ones) short prompt, so a short request's own step is about the time its prefill needs anyway."""
        if self.config.step_time_target == "off" or not self.cost_model.is_trained or self.calibrating:
            return math.inf
        fixed = self.config.step_time_target_s
        if fixed is not None:
            return fixed
        # at least twice the per-step constant: a step's work is never less than what running a step costs
        return max(self.cost_model.predict(prefill_chunk(self._typical_short_tokens(), 0, True)),
                   2 * self.cost_model.coef[0])

    def _typical_short_tokens(self) -> int:
        """The P90 of recent short prompts' lengths (half the long-prompt threshold before any)."""
        lens = sorted(self._short_prompt_lens)
        return max(lens[int(0.9 * (len(lens) - 1))] if lens else self.config.long_prompt_threshold // 2, 1)

    def throughput_chunk_tokens(self) -> int:
        """Prefill tokens a throughput step takes. Its forward cannot be cut, so a short request arriving during it
        waits for it: the chunk is the smallest size (powers of two and --max-batched-tokens) that holds a typical
        short prompt and with which the step-cost model prices a cap-sized prompt (each chunk at its context,
        per-step terms once per chunk) within THROUGHPUT_SLACK of the cheapest size; if none, the cheapest (ties to
        the larger). bench_chunk_size.py measures the sizes side by side."""
        cap = self.config.max_batched_tokens
        sizes = {cap, *(1 << k for k in range(self.block_size.bit_length() - 1, cap.bit_length()) if 1 << k < cap)}

        def seconds(n: int) -> float:
            return sum(self.cost_model.predict(prefill_chunk(min(n, cap - done), done, done + n >= cap))
                       for done in range(0, cap, n))

        priced = {n: seconds(n) for n in sizes}
        cheapest = min(priced.values())
        near = [n for n, s in priced.items() if n >= self._typical_short_tokens() and s <= cheapest * (1 + THROUGHPUT_SLACK)]
        return min(near) if near else max(n for n, s in priced.items() if s <= cheapest * (1 + 1e-9))

    def itl_bound(self) -> float:
        """Seconds a step may take while a request is decoding (inf: no bound of its own). auto: ITL_AUTO_S, never
        below ITL_MIN_STEPS x the per-step constant (the fixed cost of a step stays a small share of it)."""
        if (self.config.itl_target == "off" or not self.cost_model.is_trained or self.config.scheduling == "fcfs"
                or self.config.step_time_target == "off"):  # no time-bounded steps: nothing to bound
            return math.inf
        if self.config.itl_target != "auto":
            return float(self.config.itl_target)
        return max(ITL_AUTO_S, ITL_MIN_STEPS * float(self.cost_model.coef[0]))

    def _itl_step_bound(self, decoding: list[Request]) -> float:
        """Seconds this step may take for the decoding requests to keep their token schedules: each one's k-th
        decode token is due ``itl_bound()`` x k after its first decode step was scheduled, so a request that got
        tokens faster than that (decode-only steps) lets steps run long until it is back on schedule, and one behind
        it gets short steps (never shorter than ITL_MIN_STEPS per-step constants, 2 of them, or ITL_FLOOR_S) until
        it has caught up."""
        itl = self.itl_bound()
        if not math.isfinite(itl):
            return math.inf
        now = self.clock()
        due = math.inf
        for req in decoding:
            if req.decode_origin_s is None:
                req.decode_origin_s, req.decode_steps = now, 0
            due = min(due, req.decode_origin_s + (req.decode_steps + 1) * itl if ITL_AVERAGED else now + itl)
        step = float(self.cost_model.coef[0])
        return max(due - now, min(itl, ITL_MIN_STEPS * step), 2 * step, ITL_FLOOR_S)

    def _update_backlog(self, step: _Step, alpha: float = 0.1) -> None:
        if not self.cost_model.is_trained:
            return
        b = self.backlog
        decode_share, short_share, step_s = b.decode_share, b.short_share, b.step_s
        short_frac, long_frac = b.short_frac, b.long_frac
        total = step.decode_s + step.short_s + step.long_s
        pending = [r for r in self.requests.values() if not _is_decoding(r)]
        if total > 0:
            wall = total + self.cost_model.coef[0]
            decode_share += alpha * (step.decode_s / total - decode_share)
            short_share += alpha * (step.short_s / total - short_share)
            step_s += alpha * (wall - step_s) if step_s else wall

            def ema(old: float, new: float) -> float:
                return old + alpha * (new - old) if old else new

            # a lane's drain rate while it has work: every step in which it had work waiting counts, those where
            # the other lane took the whole step (at 0) too, not only the steps where it ran (counting only those
            # predicted three-image TTFTs at 0.72-0.77 of the measured ones at U 0.6-0.8, bench_slo)
            if step.short_s > 0 or any(r.lane != LONG for r in pending):
                short_frac = ema(short_frac, step.short_s / wall)
            if step.long_s > 0 or any(r.lane == LONG for r in pending):
                long_frac = ema(long_frac, step.long_s / wall)
        def left_s(r: Request) -> float:  # after this step: its work in flight is the residual, not the backlog
            return max(self.remaining_work_s(r) - step.in_flight_s.get(r.request_id, 0.0), 0.0)

        short = sum(left_s(r) for r in pending if r.lane != LONG)
        long_reqs = [r for r in pending if r.lane == LONG]
        long = tuple(left_s(r) for r in long_reqs)
        places = tuple(self.long_place_s(r) for r in long_reqs) if self.config.long_order == "deadline" else ()
        deadlines = tuple(self._objective_at(r) for r in long_reqs) if places and self.objectives else ()
        now = self.clock()
        step_end = now + (total + self.cost_model.coef[0] if total > 0 else 0.0)
        span, unit = step.cut_span
        self.backlog = Backlog(short, long, places, decode_share, short_share, step_s, bool(self.requests), short_frac,
                               long_frac, step_end, (step_end - span, unit) if unit else (0.0, 0.0), deadlines)

    def predict_ttft(self, work: PromptWork, pending: tuple[PromptWork, ...] = ()) -> float | None:
        """Seconds from now to this prompt's first token if it were queued now: the work ahead of it in its lane
        plus its own encode and prefill, at the share of each step its lane gets, times its class's learnt bias
        (None before the cost model is fitted). Reads only the Backlog snapshot and the bias, so any thread may
        ask."""
        raw = self._predict_ttft_raw(work, pending)
        return None if raw is None else raw[0] * self.ttft_bias.factor(work.num_images)

    def observe_ttft(self, num_images: int, predicted_s: float, measured_s: float) -> None:
        """A first token: the prediction given at admission against the TTFT measured from arrival."""
        self.ttft_bias.observe(num_images, predicted_s, measured_s)

    def _predict_ttft_raw(self, work: PromptWork,
                          pending: tuple[PromptWork, ...]) -> tuple[float, float, float | None] | None:
        """(seconds to the first token, the part of them its own work takes at its lane's rate, its place in the
        long lane's deadline order when protecting objectives moved it back, else None), from one read of the
        Backlog snapshot; None before the cost model is fitted."""
        cost = self.cost_model
        if not cost.is_trained:
            return None
        b = self.backlog
        moved = None
        overhead = float(cost.coef[0])
        own = self._work_s(work)
        queued = [self._work_s(p) for p in pending]  # admitted, still preprocessing: in the queue by the time it is
        lane = route_lane(work.num_prompt_tokens, self.config)
        if lane == LONG:
            if self.config.long_order == "deadline":
                # earliest place in line first: queued requests whose place comes before this one's, and those
                # still preprocessing that will get an earlier place (less work: they arrived first)
                now = self.clock()
                line = self._long_line(b, queued, pending, now)
                natural = now + self.config.long_slack * own
                place = natural
                if self.objectives and PROTECT_OBJECTIVES:  # not before one it would push past its objective
                    place = protected_place(natural, own, line, now, _drain_rate(b.long_frac))
                    moved = place if place > natural else None
                ahead = sum(w for w, p, _ in line if p <= place)  # slack 0: arrival order, all of those waiting
            else:
                ahead = sum(w for w in (*b.long_s, *queued) if w <= own)  # least remaining work first
            rate = max(1.0 - b.decode_share - b.short_share, LONG_MIN_SHARE)
        else:
            ahead = b.short_s + sum(queued)
            rate = max(1.0 - b.decode_share, LONG_MIN_SHARE)
        target = self.step_time_target()
        now = self.clock()
        residual = max(0.0, b.step_end_s - now) if b.busy else 0.0  # what is left of the step in flight
        start, unit = b.cut_span
        if lane == SHORT and unit and now < b.step_end_s:  # it cuts the step's last, interruptible units
            residual = start - now if now < start else unit / 2  # the step up to them, or half the unit in progress
        if math.isfinite(target):
            # time-bounded steps: a lane drains at the share of each step's time it got while it had work (its
            # first short prefill is granted whole, long units run whole); shares cover the per-step constant
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
        """The long lane in deadline order as an admission sees it: (work seconds, place, objective's deadline) of
        each waiting request and of each admitted one still preprocessing (its place: the one its admission gave it,
        else its admission (or now) + slack x its work)."""
        slack, slo = self.config.long_slack, self.objectives
        deadlines = b.long_deadlines or (math.inf,) * len(b.long_s)
        preprocessing = [(w, _or_now(p.long_place_s, _or_now(p.admitted_s, now) + slack * w),
                          _or_now(p.admitted_s, now) + slo.get(p.request_class, math.inf))
                         for w, p in zip(queued, pending)]
        return [*zip(b.long_s, b.long_places, deadlines), *preprocessing]

    def _work_s(self, work: PromptWork) -> float:
        """Predicted seconds of a whole prompt's prefill and encoder work (no per-step constant)."""
        features = prefill_chunk(work.num_prompt_tokens, 0, True) + encoder_units(work.encoder_patches,
                                                                                   work.encoder_attention_pairs)
        return self.cost_model.work_s(features)

    def remaining_work_s(self, req: Request, start: int | None = None) -> float:
        """Predicted seconds of the request's remaining prefill and encoder work (its share of steps, no per-step
        constant), from ``start`` tokens (default: those computed)."""
        cost = self.cost_model
        start = req.num_computed_tokens if start is None else start
        if not cost.is_fitted:
            return float(req.num_tokens - start)
        patches, pairs = 0, 0.0
        for im in req.images:
            if im.end > start and not self.encoder_cache.is_ready(im.content_hash):
                for u in im.encoder_units[self.encoder_cache.units_done(im.content_hash):]:
                    patches += u.num_patches
                    pairs += u.attention_pairs
        work = prefill_chunk(max(req.num_tokens - start, 1), start, True) + encoder_units(patches, pairs)
        return cost.work_s(work)

    def update(self, batch: ScheduledBatch, result: RunnerOutput) -> None:
        """Follow what the runner reports it did: encoder units actually run, images it holds nothing for, and
        the chunks it ran (a failed or skipped chunk computed nothing; it is scheduled again or its request is
        finished by the engine). Encoder work an interrupt cut resumes next step from the units reported done."""
        self.update_encoder(batch, result)
        for chunk in batch.chunks:
            rid = chunk.request_id
            if rid not in result.failed and rid not in result.skipped_request_ids and rid in self.requests:
                self._on_chunk_done(self.requests[rid], chunk)

    def update_encoder(self, batch: ScheduledBatch, result: RunnerOutput) -> None:
        """The encoder part of ``update``; alone for the work the runner ran after the step's tokens went out."""
        self.num_encoder_interrupts += int(bool(self._cut_work(batch, result)))
        for work in batch.encoder_work:
            h = work.content_hash
            if h in result.encoder_progress:
                self.encoder_cache.record_progress(h, result.encoder_progress[h])
        for h in result.discarded_encoder_hashes:
            self.encoder_cache.reset(h)

    def _on_chunk_done(self, req: Request, chunk: ScheduledChunk) -> None:
        """KV for the chunk is written: publish full blocks, release images the prefill has passed."""
        req.num_computed_tokens = chunk.end
        if req.block_hashes:
            self.kv.cache_blocks(req.request_id, req.block_hashes, min(chunk.end, req.num_prompt_tokens))
        last_end: dict[str, int] = {}  # an image sent twice is released after its last copy
        for im in req.images:
            last_end[im.content_hash] = max(last_end.get(im.content_hash, 0), im.end)
        for h, end in last_end.items():
            if end <= chunk.end:
                self.encoder_cache.release(req.request_id, h)

    # ---- lanes ---------------------------------------------------------------------------------------
    def _serve_long_lane(self, budget: StepBudget, step: _Step, held_by_short: bool, target: float) -> None:
        has_work = bool(self.waiting.queues[LONG]) or any(
            r.lane == LONG and not _is_decoding(r) for r in self.running
        )
        if not has_work:
            self.long_wait_steps = 0
            return
        if step.throughput:
            served = self._serve_lane(LONG, budget, step, False)
            self.long_wait_steps = 0 if served else self.long_wait_steps + 1
            return
        aging = self.long_wait_steps >= self.config.long_max_wait_steps
        if math.isfinite(target):  # time-bounded: fill what the step has left
            idle = not (step.chunks or step.encoder_work)
            if aging or idle:  # progress guaranteed: a minimum share, and always at least one block of tokens
                budget.grant_floor(self.block_size, target * LONG_MIN_SHARE)
            if self.config.long_chunk_share < 1:
                budget.chunk_seconds = self.config.long_chunk_share * target
            served = budget.seconds > 0 and budget.remaining > 0 and self._serve_lane(LONG, budget, step, False)
            self.long_wait_steps = 0 if served else self.long_wait_steps + 1
            return
        if held_by_short and not aging:
            self.long_wait_steps += 1
            step.long_held = True
            return
        share = self.config.long_step_tokens
        if self.config.long_step_tokens_idle is not None and self._short_lane_idle():
            share = self.config.long_step_tokens_idle  # nobody short to protect this step
        share = share if aging else min(share, budget.remaining)
        long_budget = StepBudget(share)
        if aging:  # progress guaranteed: at least one encoder unit or block of tokens, whatever they cost
            long_budget.grant_floor(self.block_size)
        if self._serve_lane(LONG, long_budget, step, whole_prompt=False):
            self.long_wait_steps = 0
            budget.remaining = max(0, budget.remaining - long_budget.used)
            budget.features = budget.features + long_budget.features
        else:
            self.long_wait_steps += 1

    def _short_lane_idle(self) -> bool:
        return not self.waiting.queues[SHORT] and not any(
            r.lane == SHORT and not _is_decoding(r) for r in self.running
        )

    def _serve_lane(self, lane: str, budget: StepBudget, step: _Step, whole_prompt: bool) -> bool:
        """Prefill work of one lane: running prefills first, then admissions, in arrival order. True if anything was
        scheduled. The long lane, when time-bounded, goes in its order (``_long_order``): in deadline order running
        and waiting requests alike (a waiting request whose turn has come is admitted before a running one's next
        chunk); in least-work order running prefills first, as before."""
        before = len(step.chunks) + len(step.encoder_work)
        ordered = lane == LONG and (budget.cost is not None or budget.whole_images)  # time-bounded or throughput
        running = [r for r in self.running if r.lane == lane and not _is_decoding(r)]
        queue = self.waiting.queues[lane]
        merged = ordered and self.config.long_order == "deadline"

        def out_of_budget() -> bool:  # a step's first short prefill is whole (a short prompt is one step), time or not
            if lane == SHORT and not step.has_short_prefill:
                return budget.remaining <= 0
            return budget.exhausted and not (whole_prompt and not step.has_prefill)

        if merged:
            self._serve_in_order(sorted(running + list(queue), key=self._long_order), budget, step, out_of_budget)
            return len(step.chunks) + len(step.encoder_work) > before
        if ordered:  # least-work: running prefills first, each in the order, then admissions in the order
            running.sort(key=self._long_order)
        for req in running:
            if req.request_id not in step.scheduled_ids and req.status == RequestStatus.RUNNING:
                if out_of_budget():
                    break
                self._prefill(req, budget, step, whole_prompt)
        while queue and len(self.running) < self.config.max_num_seqs:
            if out_of_budget():
                break
            req = min(queue, key=self._long_order) if ordered else queue[0]
            if whole_prompt and step.has_prefill and req.num_tokens > budget.remaining:
                break  # the seed's serial prefill: one whole prompt per step, more only if they fit beside it
            if not self._admit(req, budget, step, whole_prompt):
                break  # the lane's next request waits for KV; the wait shows as queue time
            self._prefill(req, budget, step, whole_prompt)
        served = len(step.chunks) + len(step.encoder_work) > before
        if ordered and served:  # the lane ran: whoever got nothing was passed over once more (least-work's aging)
            for req in [r for r in self.running if r.lane == LONG and not _is_decoding(r)] + list(queue):
                req.passed_over = 0 if req.request_id in step.scheduled_ids else req.passed_over + 1
        return served

    def _serve_in_order(self, ordered: list[Request], budget: StepBudget, step: _Step,
                        out_of_budget: Callable[[], bool]) -> None:
        """The time-bounded long lane: each in turn gets its next chunk, a waiting one admitted first. Once one
        waits for KV, nobody after it is admitted (it keeps its turn), but running ones still fill the step."""
        admitting = True
        for req in ordered:
            if out_of_budget():
                break
            if req.status == RequestStatus.RUNNING:
                if req.request_id not in step.scheduled_ids:
                    self._prefill(req, budget, step, False)
            elif admitting and len(self.running) < self.config.max_num_seqs:
                if self._admit(req, budget, step, False):
                    self._prefill(req, budget, step, False)
                else:
                    admitting = False  # the wait shows as queue time

    def _long_order(self, req: Request) -> tuple:
        """deadline: earliest place in line (arrival + slack x own predicted work, fixed once given), then arrival.
        least-work: passed over too long first, then least predicted remaining work, then arrival."""
        if self.config.long_order == "deadline":
            return (self.long_place_s(req), req.arrival_seq)
        return (req.passed_over < self.config.long_max_passes, self.remaining_work_s(req), req.arrival_seq)

    def _objective_at(self, req: Request) -> float:
        """When the request's class objective (--ttft-slo) runs out, on the scheduler's clock (inf: none)."""
        slo = self.objectives.get("image" if req.images else "text")
        return math.inf if slo is None else min(req.engine_request.arrival_s, req.queued_s) + slo

    def long_place_s(self, req: Request) -> float:
        """A long request's place in line under the deadline order: when it reached the scheduler plus
        ``long_slack`` times its predicted work (images already encoded cost nothing), fixed the first time it is
        asked for, so later arrivals can pass it only while their own place is earlier: a request waits at most for
        the work that reaches the lane before its place comes up (no starvation)."""
        if req.long_place_s is None:
            if not self.cost_model.is_fitted:  # no price yet: arrival order, decided later
                return req.queued_s
            start = req.num_computed_tokens
            if not start and self.kv.enable_prefix_caching:  # still waiting: what the prefix cache will serve
                start = self.kv.num_cached_prefix_tokens(self._block_hashes(req), req.num_prompt_tokens - 1)
            req.long_place_s = req.queued_s + self.config.long_slack * float(self.remaining_work_s(req, start))
        return req.long_place_s

    # ---- admission and prefill -----------------------------------------------------------------------
    def _block_hashes(self, req: Request) -> list | None:
        """The prompt's full blocks' hashes, computed once (None without prefix caching)."""
        if req.block_hashes is None and self.kv.enable_prefix_caching:
            spans = [ImageSpan(im.content_hash, im.offset, im.num_tokens) for im in req.images]
            req.block_hashes = compute_block_hashes(req.prompt_token_ids, self.block_size, spans)
        return req.block_hashes

    def _admit(self, req: Request, budget: StepBudget, step: _Step, whole_prompt: bool) -> bool:
        self._block_hashes(req)
        max_cached = req.num_prompt_tokens - 1  # at least one token is computed, to sample from
        if self.config.kv_admission == "whole-prompt":
            want = min(req.num_tokens + self.config.decode_reserve_tokens, self.max_model_len)
        else:
            cached = self.kv.num_cached_prefix_tokens(req.block_hashes or [], max_cached)
            first_chunk = req.num_tokens - cached if whole_prompt else max(budget.remaining, 1)
            want = min(cached + first_chunk, req.num_tokens)
        num_cached = None
        if self.kv.can_allocate(want, req.block_hashes, max_cached):
            num_cached = self.kv.allocate(req.request_id, want, req.block_hashes, max_cached)
        if num_cached is None:
            step.kv_blocked_ids.add(req.request_id)
            return False
        self.waiting.remove(req)
        if not req.sent_to_runner:
            er = req.engine_request
            self._new.append(NewRequest(req.request_id, er.prompt_token_ids, er.images, er.mrope_positions,
                                        er.mrope_delta, er.sampling))
            req.sent_to_runner = True
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_cached
        req.count("num_cached_prompt_tokens", max(0, num_cached - req.stats.num_cached_prompt_tokens))
        self.running.append(req)
        return True

    def _prefill(self, req: Request, budget: StepBudget, step: _Step, whole_prompt: bool) -> None:
        start = req.num_computed_tokens
        wanted = req.num_tokens - start
        whole_short = req.lane == SHORT and not step.has_short_prefill  # a short prompt is one step
        if whole_prompt:
            end = start + wanted
        elif whole_short:
            end = start + min(wanted, budget.remaining)
        else:
            end = start + budget.chunk_tokens(wanted, start, samples_at_end=True)
        for index, im in req.images_in(start, end):
            whole = whole_prompt or req.lane == SHORT or budget.whole_images
            if not self._encoder_ready_for(req, index, im, budget, step, all_units=whole) or (
                    budget.whole_images and im.content_hash in step.finishing_hashes):
                end = im.offset  # (in a throughput step, before an image encoded in it: that work stays interruptible)
                break
        if req.num_prompt_tokens >= self.config.long_prompt_threshold:
            step.has_long_work = True
        if not whole_prompt:
            end = min(end, start + (budget.remaining if whole_short else budget.chunk_tokens(wanted, start, True)))
        if end > start:
            self._schedule_tokens(req, end - start, budget, step)

    def _encoder_ready_for(
        self, req: Request, index: int, im: ImageItem, budget: StepBudget, step: _Step, all_units: bool
    ) -> bool:
        """Make sure the image's embeddings exist by the time this step's chunks run; schedule encoder units
        if needed. False when the image is still incomplete after this step (the chunk must stop before it)."""
        h = im.content_hash
        if not self.encoder_cache.is_pinned_by(req.request_id, h):
            if self.encoder_cache.acquire(req.request_id, h, im.num_tokens, len(im.encoder_units)):
                req.count("num_encoder_cache_hits")
        if self.encoder_cache.is_ready(h) and h not in step.worked_hashes:
            return True
        if h in step.finishing_hashes:
            return True
        if h in step.worked_hashes:
            return False  # another request advanced it this step and it is not done yet
        start = self.encoder_cache.units_done(h)
        units = im.encoder_units[start:]
        num_units = len(units) if all_units else budget.units(units)
        if num_units == 0:
            # the long lane moves by at least a unit per step it runs in (progress), except past the bound of a
            # step that holds a short prefill: that step is the short request's time to first token
            if step.has_short_prefill and not budget.floor_tokens:
                return False
            num_units = 1
        before = budget.spent_s
        budget.take_units(units[:num_units])
        step.charge(req.request_id, req.lane, False, budget.spent_s - before)
        finishes = num_units >= len(units)  # progress is recorded from the runner's report, in update()
        step.encoder_work.append(EncoderWork(req.request_id, index, h, start, num_units, finishes))
        step.worked_hashes.add(h)
        step.scheduled_ids.add(req.request_id)
        req.stamp("first_scheduled_s")
        if finishes:
            step.finishing_hashes.add(h)
        return finishes

    def _schedule_tokens(self, req: Request, num_new: int, budget: StepBudget, step: _Step) -> None:
        if not self._ensure_blocks(req, req.num_computed_tokens + num_new, step):
            return
        start = req.num_computed_tokens
        is_decode = _is_decoding(req)
        before = budget.spent_s
        budget.take_chunk(num_new, start, samples=start + num_new == req.num_tokens, is_decode=is_decode)
        step.charge(req.request_id, req.lane, is_decode, budget.spent_s - before)
        if req.lane == SHORT and not is_decode:
            step.has_short_prefill = True
        step.scheduled_ids.add(req.request_id)
        step.chunks.append(
            ScheduledChunk(
                request_id=req.request_id,
                context_len=start,
                num_new_tokens=num_new,
                block_table=tuple(self.kv.block_table(req.request_id)),
                sample=start + num_new == req.num_tokens,
                is_decode=is_decode,
            )
        )
        req.stamp("first_scheduled_s")

    def _ensure_blocks(self, req: Request, num_tokens: int, step: _Step) -> bool:
        """Grow req's block table to num_tokens; when the pool is dry, preempt a victim (see _pick_victim) until
        it fits. The preemption is labelled by its cause: the growth of a decode or of a prefill chunk (only
        optimistic admission lets a prefill grow). False when req itself was the victim."""
        cause = "decode_growth" if _is_decoding(req) else "prefill_growth"
        while self.kv.allocate(req.request_id, num_tokens) is None:
            victim = self._pick_victim(req, step)
            self._preempt(victim, cause)
            if victim is req:
                return False
        return True

    def _pick_victim(self, req: Request, step: _Step) -> Request:
        """The latest-admitted running request that has no work in this step (the runner will write its blocks)
        and whose blocks were not promised: under whole-prompt admission a prefill in progress owns its whole
        prompt's blocks and is never the victim. Else the growing request itself."""
        promised = self.config.kv_admission == "whole-prompt"
        for other in reversed(self.running):
            if other is req or other.request_id in step.scheduled_ids:
                continue
            if promised and not _is_decoding(other):
                continue
            return other
        return req

    def _preempt(self, req: Request, reason: str) -> None:
        """Recompute, never swap: drop its KV, keep its tokens, send it to the front of its lane."""
        self.running.remove(req)
        self.kv.free(req.request_id)
        self.encoder_cache.release_all(req.request_id)
        req.num_computed_tokens = 0
        req.decode_origin_s, req.decode_steps = None, 0  # its token schedule restarts after the recompute
        req.status = RequestStatus.WAITING
        req.count("num_preemptions")
        self.num_preemptions += 1
        self.preemptions_by_reason[reason] = self.preemptions_by_reason.get(reason, 0) + 1
        self._preempted.append(req.request_id)
        self.waiting.appendleft(req)

    def _count_short_delays(self, step: _Step) -> None:
        """The harmful event the seed saw: a short request that sat out a whole step while long work ran."""
        threshold = self.config.long_prompt_threshold
        for req in self.waiting:
            if req.num_prompt_tokens < threshold and req.arrival_step <= self.num_steps and step.has_long_work:
                if not req.delayed_by_long:
                    req.delayed_by_long = True
                    self.num_short_delayed_by_long += 1

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        self.encoder_cache.check_invariants()

    def wait_reason(self, req: Request) -> str:
        """Why a live request got no work in the last schedule(): one of WAIT_REASONS, or "" when it got work or
        nothing explains the wait (a request that can never make progress; the randomized tests look for it)."""
        step = self._last_step
        if req.request_id in step.scheduled_ids or req.status == RequestStatus.FINISHED:
            return ""
        if req.request_id in step.preempted_ids:
            return "preempted"  # its blocks went to a decode's growth this step
        if req.status == RequestStatus.WAITING:
            if len(self.running) >= self.config.max_num_seqs:
                return "max_num_seqs"
            if req.request_id in step.kv_blocked_ids:
                return "kv_blocks"
            if any(other.request_id in step.kv_blocked_ids for other in self.waiting.queues[req.lane]):
                return "in_line"  # its lane's admissions stopped at a request waiting for blocks
        if req.lane == LONG and step.long_held:
            return "short_lane_first"
        if step.full:
            return "step_full"
        if any(im.content_hash in step.worked_hashes for im in req.images):
            return "image_encoding"  # another request advances the image it waits for
        if any(self.requests[rid].lane == req.lane for rid in step.scheduled_ids if rid in self.requests):
            return "in_line"  # its lane served others first this step
        return ""


# with --ttft-slo, admissions keep waiting long requests' objectives (protected_place); False: for side-by-side runs
# (benchmarks/sim_overload.py), the deadline order without it
PROTECT_OBJECTIVES = True


def _or_now(t: float | None, now: float) -> float:
    return now if t is None else t


def _drain_rate(long_frac: float) -> float:
    """Seconds of long-lane work done per second of wall time: the share the lane got while it had work."""
    return max(long_frac, LONG_MIN_SHARE) if long_frac > 0 else 1.0


def protected_place(place: float, own: float, queue: Iterable[tuple[float, float, float]], now: float,
                    rate: float) -> float:
    """A newcomer's place in the deadline order when admitted requests hold objectives: ``place`` unless a queued
    request it would pass (``queue``: each one's remaining work seconds, place and objective's deadline) misses its
    deadline with the newcomer's ``own`` work ahead of it; then the place of the last such request (ties go to the
    earlier arrival, so the newcomer is behind it). A request already predicted to miss is protected too: passing it
    would only make it later, and the requests that end up in a class's tail are those (passing only the ones
    that would still make it kept the three-image P99 1.1-1.5x the objective in the simulator's overload runs)."""
    out, done = place, 0.0
    for work, at, deadline in sorted(queue, key=lambda q: q[1]):
        done += work
        if at > place and deadline < now + (done + own) / rate:
            out = max(out, at)
    return out


THROUGHPUT_SLACK = 0.05  # a throughput chunk may be priced this much over the cheapest size, to be shorter
ITL_AUTO_S = 0.2  # --itl-target auto: 5 tokens/s, about reading speed
ITL_AVERAGED = True  # --itl-target holds each answer's average from its first decode step (False: every step; what-if)
ITL_MIN_STEPS = 4  # ... but at least this many per-step constants (steps mostly work, not fixed cost)
ITL_FLOOR_S = 0.01  # a step bounded for a pace is never shorter (a model whose fitted per-step constant is 0)
LONG_MIN_SHARE = 0.25  # of the step-time target, granted to the long lane once it has waited long_max_wait_steps
# why a live request got no work in a step (Scheduler.wait_reason)
WAIT_REASONS = ("preempted", "max_num_seqs", "kv_blocks", "short_lane_first", "step_full", "image_encoding", "in_line")


def _is_decoding(req: Request) -> bool:
    return bool(req.output_token_ids) and req.num_computed_tokens == req.num_tokens - 1
