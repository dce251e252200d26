"""The engine: add_request / abort / step. One step is schedule -> execute -> update.

Synchronous and single-threaded on purpose: the async bridge (async_engine.py) runs it in one
dedicated thread, which owns torch's intra-op threads. Everything a request needs was prepared
before add_request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

from firsttoken.batch import RunnerOutput, ScheduledBatch
from firsttoken.config import EngineConfig, ImageConfig
from firsttoken.device_memory import MeasureDeviceMemory
from firsttoken.engine.calibration import calibrate
from firsttoken.engine.detokenizer import TokenDecoder
from firsttoken.engine.interrupt import ShortArrivals
from firsttoken.engine.output_processor import (
    Ended,
    OutputProcessor,
    StepClock,
    account_step,
    runner_broke,
)
from firsttoken.engine.resolve import ResolvedEngineConfig, resolve_engine_config
from firsttoken.engine.startup import start_executor
from firsttoken.loading.plan_values import Machine
from firsttoken.metrics.stats import (
    FinishedRequest,
    NullObserver,
    StatsObserver,
    StepStats,
)
from firsttoken.metrics.timeline import Timeline
from firsttoken.models.registry import load_model_config
from firsttoken.runner.executor import Executor, InProcessExecutor
from firsttoken.runner.model_runner import FaultHook
from firsttoken.scheduler.cost_model import CostModel
from firsttoken.scheduler.request import Request
from firsttoken.scheduler.scheduler import Scheduler
from firsttoken.scheduler.step import StepReport
from firsttoken.types import (
    AdmissionVerdict,
    EngineRequest,
    EngineStats,
    FinishReason,
    PromptWork,
    RequestOutput,
    count_videos,
)

log = logging.getLogger("firsttoken.engine")


class LLMEngine:
    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig | ResolvedEngineConfig,
        tokenizer: TokenDecoder,
        fault_hook: FaultHook | None = None,
        observer: StatsObserver | None = None,
        machine: Machine | None = None,
        measure_memory: MeasureDeviceMemory | None = None,
        profile_image_tokens: int | None = None,
        executor_factory: Callable[..., InProcessExecutor] = InProcessExecutor,
    ) -> None:
        """``config``: the flags, resolved here for this checkpoint on ``machine`` (default: this
        one), or already resolved (engine/resolve.py). Where the device sizes the KV pool
        (``_start``): ``measure_memory`` measures it around loading and the profiling forward
        (default: device_memory.measure_device_memory; tests inject facts), whose image has
        ``profile_image_tokens`` visual tokens (--image-max-tokens; default its default).
        ``executor_factory``: InProcessExecutor's constructor (tests put a cuda-resolved model on
        the CPU)."""
        self.model_config = load_model_config(model_dir)
        if isinstance(config, EngineConfig):
            config = resolve_engine_config(config, model_dir, machine, self.model_config)
        # as resolved
        machine = machine or Machine.for_flags(
            config.requested.cpu_kernels, config.requested.device
        )
        # the async layer counts short requests on their way; the runner asks between units
        self.short_arrivals = ShortArrivals()
        image_tokens = (
            ImageConfig().image_max_tokens if profile_image_tokens is None else profile_image_tokens
        )
        config, executor = start_executor(
            model_dir, self.model_config, config, machine, self.short_arrivals,
            image_tokens, fault_hook, measure_memory, executor_factory,
        )
        self.executor: Executor = executor
        self.resolved: ResolvedEngineConfig = config  # what it runs with: GET /v1/engine/config
        self.config: EngineConfig = config.requested
        self.observer: StatsObserver = observer or NullObserver()
        self.tokenizer = tokenizer
        self.capacity = config.kv
        self.max_model_len = config.kv.max_model_len  # context length, tokens
        log.info(config.describe())  # the one start-up block: every choice the engine runs with
        # prices every step (fitted at calibrate, learning from each step after)
        self.cost_model = CostModel()
        self.scheduler = _new_scheduler(self.resolved, self.cost_model)
        self.requests: dict[str, Request] = {}
        self.outputs = OutputProcessor(tokenizer, self.capacity.max_model_len)
        self._arrivals = 0
        # images the vision tower ran for (cache misses that were computed)
        self.num_images_encoded = 0
        self._busy_s = 0.0  # seconds spent inside step(), since start
        self._num_steps = 0  # steps with work, since start (or calibration)

    def calibrate(self) -> None:
        """Fit the step-cost model on a few synthetic requests before serving
        (engine/calibration.py). They run on a scheduler of their own, sharing the cost model,
        dropped after: the serving one, the engine's counts and every cache an operator sees are a
        fresh engine's. Only before the first request."""
        if self.requests:
            raise RuntimeError("calibrate with requests in flight")
        serving, self.scheduler = self.scheduler, _new_scheduler(self.resolved, self.cost_model, True)
        observer, self.observer = self.observer, NullObserver()

        def run(requests: list[EngineRequest]) -> None:
            for r in requests:
                self.add_request(r)
            while self.has_unfinished():
                self.step()

        try:
            calibrate(run, self.cost_model, self.model_config, self.max_model_len)
        finally:
            self.scheduler, self.observer = serving, observer
            self.num_images_encoded = self._num_steps = 0

    # ---- requests --------------------------------------------------------------------------------
    def check_admission(
        self, work: PromptWork, pending: tuple[PromptWork, ...] = ()
    ) -> AdmissionVerdict:
        """May a prompt like ``work`` queue now, behind ``pending`` (admitted, still preprocessing),
        and when is its first token due (scheduler/admission.py)? Any thread may ask."""
        return self.scheduler.check_admission(work, len(pending), pending)

    def add_request(self, request: EngineRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id}")
        verdict = self.check_admission(PromptWork.of(request.num_prompt_tokens, request.images))
        if not verdict.admitted and verdict.reason == "never_fits":
            raise ValueError(verdict.message)
        req = Request(request, self._arrivals)
        req.busy_mark_s, req.steps_mark = self._busy_s, self._num_steps
        # everything that can fail is built before anything is registered
        self.outputs.add(req)
        self._arrivals += 1
        self.requests[request.request_id] = req
        self.scheduler.add(req)

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        req.stamp("finished_s")
        self._end(req, FinishReason.ABORT)
        return True

    def has_unfinished(self) -> bool:
        """Work to run, or runner state (finished requests, encoder outputs) the next step
        releases."""
        return self.scheduler.needs_step

    # ---- the loop --------------------------------------------------------------------------------
    def step(
        self, deliver: Callable[[list[RequestOutput]], None] | None = None
    ) -> list[RequestOutput]:
        """schedule -> execute -> update -> outputs. The step's wall time and the work it held train
        the scheduler's cost model, which prices the next steps. With ``deliver``, the step's
        outputs go to it as soon as its tokens are sampled, before the encoder work the runner left
        for after them (interruptible long-lane units: no chunk of this step needs them); what comes
        after (failures of that work) is returned."""
        step_start = time.monotonic()
        try:
            outputs = self._expire()
            batch = self.scheduler.schedule()
            if batch.is_empty:
                return outputs
            self._num_steps += batch.has_work  # this step counts for a first token sampled in it
            clock = StepClock(step_start, self._busy_s, self._num_steps)
            result, broke = self._execute(batch, partial(self.executor.execute, batch))
            outputs += self._apply(batch, result, clock)
            if not broke and any(w.interruptible for w in batch.encoder_work):
                if deliver is not None:
                    deliver(outputs)
                    outputs = []
                late, broke = self._execute(batch, self.executor.finish_step)
                if late is not None:
                    outputs += self._apply(batch, late, clock, tokens=False)
                    result = result.merged(late)
            if batch.has_work and not broke:  # a step the runner broke in teaches nothing
                report = self.scheduler.learn_step(batch, result, step_start)
                self.observer.on_step(_step_stats(batch, result, step_start, report))
                account_step(batch, result, self.requests, report.duration_s)
            return outputs
        finally:
            self._busy_s += time.monotonic() - step_start

    def _execute(self, batch: ScheduledBatch, run: Callable[[], RunnerOutput | None]
                 ) -> tuple[RunnerOutput | None, bool]:
        """The runner's report of (part of) the step, and whether the runner broke: then every live
        request of the batch fails (this step only) and the engine keeps serving. The runner
        reports per-request failures itself; it raises only on an engine bug."""
        try:
            return run(), False
        except Exception:
            log.exception("engine step failed; failing the requests in it")
            return runner_broke(batch, self.requests), True

    def _apply(self, batch: ScheduledBatch, result: RunnerOutput, clock: StepClock,
               tokens: bool = True) -> list[RequestOutput]:
        """The scheduler follows the report and ends what its token rules end; the outputs follow
        (stop strings end more); every request that ended is ended on the scheduler and forgotten
        here at once."""
        finished = self.scheduler.update(batch, result, tokens)
        try:
            outputs, ended = self.outputs.step(
                batch, result, self.requests, clock, finished, chunks=tokens
            )
        except BaseException:  # an engine bug: what update ended still leaves the engine
            for req, reason in finished:
                self._end(req, reason)
            raise
        self.num_images_encoded += sum(result.num_images_encoded.values())
        for req, reason in ended:
            self._end(req, reason)
        return outputs

    def _expire(self) -> list[RequestOutput]:
        timeout = self.config.request_timeout_s
        if timeout is None:
            return []
        now = time.monotonic()
        ended: Ended = []
        late = [r for r in self.requests.values() if now - r.engine_request.arrival_s > timeout]
        outputs = [
            self.outputs.failed(
                r, f"the request did not finish within the server's {timeout:g} s request timeout",
                ended, status=504,
            )
            for r in late
        ]
        for req, reason in ended:
            self._end(req, reason)
        return outputs

    def _end(self, req: Request, reason: FinishReason) -> None:
        """A request ended (in a step or between steps): the scheduler frees its blocks and encoder
        pins at once (a no-op where its update already ended it), the engine drops its state and
        sends its record."""
        self.scheduler.finish(req, reason)
        self.requests.pop(req.request_id, None)
        self.outputs.drop(req.request_id)
        self.observer.on_finished(_finished_record(req, reason))

    # ---- observability ---------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return replace(
            self.scheduler.stats(),
            encoder_cache_bytes=self.executor.encoder_cache_bytes,
            num_images_encoded=self.num_images_encoded,
        )


def _step_stats(batch: ScheduledBatch, result: RunnerOutput, step_start: float,
                report: StepReport) -> StepStats:
    return StepStats(
        step=report.step,
        start_s=step_start,
        duration_s=report.duration_s,
        predicted_s=report.predicted_s,
        num_seqs=len(batch.chunks),
        num_prefill_tokens=batch.num_prefill_tokens,
        num_decode_tokens=batch.num_decode_tokens,
        num_images_encoded=sum(result.num_images_encoded.values()),
        encoder_s=sum(result.encoder_s.values()),
        num_preempted=len(batch.preempted_request_ids),
        kv_blocks_used=report.kv_blocks_used,
        kv_blocks_total=report.kv_blocks_total,
        num_running=report.num_running,
        num_waiting=report.num_waiting,
    )


def _finished_record(req: Request, reason: FinishReason) -> FinishedRequest:
    er = req.engine_request
    return FinishedRequest(
        request_id=req.request_id,
        outcome=reason.value,
        num_prompt_tokens=er.num_prompt_tokens,
        num_image_tokens=er.num_image_tokens,
        num_images=len(er.images),
        num_videos=count_videos(er.images),
        num_output_tokens=len(req.output_token_ids),
        lane=req.lane,
        timings=Timeline(
            er.arrival_s,
            er.preprocessed_s,
            engine=req.stats,
            predicted_ttft_s=er.predicted_ttft_s,
            image_budget_note=er.image_budget_note,
        ).to_dict(),
    )


def _new_scheduler(resolved: ResolvedEngineConfig, cost_model: CostModel,
                   calibrating: bool = False) -> Scheduler:
    """``calibrating``: a scratch one for calibrate: token budgets only, and no image output kept
    once its request's prefill has passed it (its runner state is all released before serving
    starts)."""
    return Scheduler(
        resolved.requested.scheduler,
        resolved.requested.cache,
        resolved.kv.num_blocks,
        resolved.kv.max_model_len,
        0 if calibrating else resolved.encoder_cache_tokens,
        cost_model,
        calibrating=calibrating,
    )
