"""How long a step may be, and the budget it gets: the step-time bound, streaming answers' pace,
throughput steps.

One policy, chosen once from the config:
- a lane policy whose steps are not time-bounded (``--scheduling fcfs``: whole prompts) or
  ``--step-time-target off``: no time bound (token budgets only);
- otherwise steps are bounded by ``step_time_target()`` (auto: the predicted prefill of a typical
  short prompt, the P90 of the recent ones, at least twice the per-step constant; or the seconds
  given), lowered while requests decode so that each one's next token keeps ``--itl-target``'s pace.
  Under ``auto`` a step gets sized for *throughput* instead whenever the long lane has prefill work
  and the short lane has none (nobody waits for a first token that the bound protects; decodes ride
  along, unless ``--itl-target`` paces them): the long lane's images encoded whole (a short arrival
  cuts that work between units; while answers decode, only the bound's worth of it per step, so a
  reader waits for no whole image) and its prefill chunk sized by ``throughput_chunk_tokens`` (fewer
  tokens deeper into a prompt: no longer in predicted seconds than that chunk at context 0). So the
  long lane runs at the speed it has alone, and a short arrival waits at most one throughput chunk's
  forward: the next step serves it, bounded again.

Until the cost model is trained, and while the engine calibrates it, steps are budgeted in tokens
only.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence

from firsttoken.config import SchedulerConfig
from firsttoken.scheduler.budget import StepBudget
from firsttoken.scheduler.cost_model import CostModel, prefill_chunk
from firsttoken.scheduler.lanes import LONG_MIN_SHARE
from firsttoken.scheduler.request import Request
from firsttoken.scheduler.step import StepDraft

# a throughput chunk may be priced this much over the cheapest size, to be shorter
THROUGHPUT_SLACK = 0.05
ITL_AUTO_S = 0.2  # --itl-target auto: 5 tokens/s, about reading speed
# ... but at least this many per-step constants (steps mostly work, not fixed cost)
ITL_MIN_STEPS = 4
# a step bounded for a pace is never shorter (a model whose fitted per-step constant is 0)
ITL_FLOOR_S = 0.01


class Pacing:
    def __init__(
        self,
        config: SchedulerConfig,
        time_bounded: bool,
        block_size: int,
        cost_model: CostModel,
        clock: Callable[[], float] = time.monotonic,
        calibrating: bool = False,
    ) -> None:
        """``time_bounded``: whether the lane policy lets steps be bounded in time (lanes.py);
        ``calibrating``: the engine's scratch scheduler while the cost model first learns (token
        budgets only)."""
        self.config = config
        self.block_size = block_size
        self.cost_model = cost_model
        self.clock = clock
        # chosen once: time-bounded steps at all, throughput steps for a lone request, a pace for
        # streaming answers
        self.bounded = time_bounded and not config.step_time_target.is_off
        self.throughput_steps = self.bounded and config.step_time_target.is_auto
        self.paced = self.bounded and not config.itl_target.is_off
        self.itl_target_s = config.itl_target.seconds
        self.calibrating = calibrating
        # recent short prompts: what the bound serves
        self._short_prompt_lens: deque[int] = deque(maxlen=256)
        # request id -> (first decode step's time, decode steps)
        self._pace: dict[str, tuple[float, int]] = {}
        # ((cost model version, typical short), tokens)
        self._chunk: tuple[tuple[int, int], int] | None = None

    def note_short_prompt(self, num_tokens: int) -> None:
        self._short_prompt_lens.append(num_tokens)

    def forget(self, request_id: str) -> None:
        """Its token schedule restarts (preempted by recompute) or ends (finished)."""
        self._pace.pop(request_id, None)

    def step_budget(self, decoding: Sequence[Request], long_only: bool) -> tuple[StepBudget, bool]:
        """(this step's budget, whether it is a throughput step). ``decoding``: the requests that
        will get their token in it; ``long_only``: the long lane has prefill work and the short lane
        none."""
        target = self.step_time_target()
        # streaming answers keep --itl-target's pace: bounded steps
        paced = self.paced and bool(decoding)
        if math.isfinite(target) and long_only and not paced and self.throughput_steps:
            # the chunk's forward is priced no longer than the throughput chunk's at a prompt's
            # start: a short request arriving during it waits that long at most, however long the
            # context (attention) has grown
            size = self.throughput_chunk_tokens()
            chunk_s = self.cost_model.work_s(prefill_chunk(size, 0, True))
            # an answer being read waits for the step's vision work too: with decodes in it, that
            # work stays within the bound (the long lane still moves by a unit a step); without,
            # images are encoded whole
            encoder_s = max(target - float(self.cost_model.coef[0]), 0.0) if decoding else math.inf
            budget = StepBudget(
                size, cost=self.cost_model, whole_images=True, chunk_s=chunk_s, encoder_s=encoder_s
            )
            budget.grant_floor(min(self.block_size, size))  # progress at any context
            return budget, True
        if math.isfinite(target) and decoding:
            # streaming answers' next tokens wait for it
            target = min(target, self._itl_step_bound(decoding))
        # the per-step constant
        overhead = float(self.cost_model.coef[0]) if math.isfinite(target) else 0.0
        return StepBudget(
            self.config.max_batched_tokens,
            max(target - overhead, 0.0),
            self.cost_model,
            target_s=target,
        ), False

    def long_lane_budget(
        self,
        budget: StepBudget,
        step: StepDraft,
        aging: bool,
        held_by_short: bool,
        short_lane_idle: Callable[[], bool],
    ) -> StepBudget | None:
        """What the long lane is served from in this step (None: it waits). A throughput step: the
        step's. A time-bounded one: what the step has left; aged, or with the step still empty, a
        share of the target and at least one block of tokens (progress), its chunks capped to
        ``--long-chunk-share`` of the target. Token budgets: nothing while short work took the step
        (``long_held``) unless aged; else the lane's own share, ``--long-step-tokens``
        (``--long-step-tokens-idle`` while nobody short waits) within what the step has left; aged,
        the whole share and at least one encoder unit or block of tokens, whatever they cost."""
        if step.throughput:
            return budget
        if budget.bounded:
            if aging or not (step.chunks or step.encoder_work):
                budget.grant_floor(self.block_size, LONG_MIN_SHARE)
            if self.config.long_chunk_share < 1:
                budget.cap_chunks(self.config.long_chunk_share)
            return None if budget.exhausted else budget
        if held_by_short and not aging:
            step.long_held = True
            return None
        share = self.config.long_step_tokens
        if self.config.long_step_tokens_idle is not None and short_lane_idle():
            share = self.config.long_step_tokens_idle
        long_budget = StepBudget(share if aging else min(share, budget.remaining))
        if aging:
            long_budget.grant_floor(self.block_size)
        return long_budget

    def count_decode(self, req: Request) -> None:
        """One decode step was scheduled for ``req`` (its pace counts it)."""
        origin, steps = self._pace.get(req.request_id, (self.clock(), 0))
        self._pace[req.request_id] = (origin, steps + 1)

    def step_time_target(self) -> float:
        """Seconds a step may take (inf: no time bound)."""
        if not self.bounded or not self.cost_model.is_trained or self.calibrating:
            return math.inf
        fixed = self.config.step_time_target_s
        if fixed is not None:
            return fixed
        # at least twice the per-step constant: a step's work is never less than what running a step
        # costs
        return max(self.cost_model.predict(prefill_chunk(self._typical_short_tokens(), 0, True)),
                   2 * self.cost_model.coef[0])

    def _typical_short_tokens(self) -> int:
        """The P90 of recent short prompts' lengths (half the long-prompt threshold before any)."""
        lens = sorted(self._short_prompt_lens)
        return max(
            lens[int(0.9 * (len(lens) - 1))] if lens else self.config.long_prompt_threshold // 2, 1
        )

    def throughput_chunk_tokens(self) -> int:
        """Prefill tokens a throughput step takes. Its forward cannot be cut, so a short request
        arriving during it waits for it: the chunk is the smallest size (powers of two and
        --max-batched-tokens) that holds a typical short prompt and with which the step-cost model
        prices a cap-sized prompt (each chunk at its context, per-step terms once per chunk) within
        THROUGHPUT_SLACK of the cheapest size; if none, the cheapest (ties to the larger).
        bench_chunk_size.py measures the sizes side by side."""
        typical = self._typical_short_tokens()
        key = (self.cost_model.version, typical)
        # (pricing every size takes ~2 ms: once per refit)
        if self._chunk is None or self._chunk[0] != key:
            self._chunk = key, self._throughput_chunk_tokens(typical)
        return self._chunk[1]

    def _throughput_chunk_tokens(self, typical: int) -> int:
        cap = self.config.max_batched_tokens
        sizes = {
            cap,
            *(
                1 << k
                for k in range(self.block_size.bit_length() - 1, cap.bit_length())
                if 1 << k < cap
            ),
        }

        def seconds(n: int) -> float:
            return sum(
                self.cost_model.predict(prefill_chunk(min(n, cap - done), done, done + n >= cap))
                for done in range(0, cap, n)
            )

        priced = {n: seconds(n) for n in sizes}
        cheapest = min(priced.values())
        near = [
            n for n, s in priced.items() if n >= typical and s <= cheapest * (1 + THROUGHPUT_SLACK)
        ]
        return (
            min(near) if near else max(n for n, s in priced.items() if s <= cheapest * (1 + 1e-9))
        )

    def itl_bound(self) -> float:
        """Seconds a step may take while a request is decoding (inf: no bound of its own). auto:
        ITL_AUTO_S, never below ITL_MIN_STEPS x the per-step constant (the fixed cost of a step
        stays a small share of it)."""
        if not self.paced or not self.cost_model.is_trained:
            return math.inf  # (off, or no time-bounded steps: nothing to bound)
        if self.itl_target_s is not None:
            return self.itl_target_s
        return max(ITL_AUTO_S, ITL_MIN_STEPS * float(self.cost_model.coef[0]))

    def _itl_step_bound(self, decoding: Sequence[Request]) -> float:
        """Seconds this step may take for the decoding requests to keep their token schedules: each
        one's k-th decode token is due ``itl_bound()`` x k after its first decode step was
        scheduled, so a request that got tokens faster than that (decode-only steps) lets steps run
        long until it is back on schedule, and one behind it gets short steps (never shorter than
        ITL_MIN_STEPS per-step constants, 2 of them, or ITL_FLOOR_S) until it has caught up."""
        itl = self.itl_bound()
        if not math.isfinite(itl):
            return math.inf
        now = self.clock()
        due = math.inf
        for req in decoding:
            origin, steps = self._pace.setdefault(req.request_id, (now, 0))
            due = min(due, origin + (steps + 1) * itl)
        step = float(self.cost_model.coef[0])
        return max(due - now, min(itl, ITL_MIN_STEPS * step), 2 * step, ITL_FLOOR_S)
