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
from pathlib import Path

from firsttoken.batch import RunnerOutput, ScheduledBatch, ScheduledChunk
from firsttoken.config import EngineConfig, ImageConfig
from firsttoken.device_memory import MeasureDeviceMemory, measure_device_memory
from firsttoken.engine.detokenizer import IncrementalDetokenizer, TokenDecoder
from firsttoken.engine.resolve import ResolvedEngineConfig, resolve_engine_config
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
from firsttoken.runner.model_runner import FaultHook, ThreadPlan
from firsttoken.runner.profile import ProfileStep
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
    TokenLogprob,
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
        threads = ThreadPlan(config.num_threads, config.decode_threads)

        def load() -> InProcessExecutor:
            return executor_factory(
                model_dir,
                self.model_config,
                config.model,
                machine,
                config.kv.block_size,
                config.requested.seed,
                fault_hook,
                threads=threads,
                interrupt=self._interrupt,
                grammar=config.requested.grammar,
            )

        image_tokens = (
            ImageConfig().image_max_tokens if profile_image_tokens is None else profile_image_tokens
        )
        config, executor = self._start(
            config, model_dir, machine, load, measure_memory, image_tokens
        )
        self.executor: Executor = executor
        self.resolved: ResolvedEngineConfig = config  # what it runs with: GET /v1/engine/config
        self.config: EngineConfig = config.requested
        self.observer: StatsObserver = observer or NullObserver()
        self.tokenizer = tokenizer
        # asked by the runner between interruptible encoder units: is a short request on its way to
        # add_request? (set by the serving side, AsyncEngine; None: never)
        self.short_request_pending: Callable[[], bool] | None = None
        self.capacity = config.kv
        log.info(config.describe())  # the one start-up block: every choice the engine runs with
        # prices every step (fitted at calibrate, learning from each step after)
        self.cost_model = CostModel()
        self.scheduler = self._new_scheduler()
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        # scored so far, until the first token's output
        self._prompt_logprobs: dict[str, list[TokenLogprob]] = {}
        self._arrivals = 0
        # images the vision tower ran for (cache misses that were computed)
        self.num_images_encoded = 0
        self._busy_s = 0.0  # seconds spent inside step(), since start
        self._num_steps = 0  # steps with work, since start (or calibration)
        # while a step runs: what it ended
        self._ending: list[tuple[Request, FinishReason]] | None = None

    def _start(self, config: ResolvedEngineConfig, model_dir: str | Path, machine: Machine,
               load: Callable[[], InProcessExecutor], measure: MeasureDeviceMemory | None,
               image_tokens: int) -> tuple[ResolvedEngineConfig, InProcessExecutor]:
        """Start-up's order (vLLM's): load the weights; where the device sizes the KV pool (cuda
        without --kv-cache-memory), one profiling forward at the largest step the budgets allow
        (runner/profile.py), the device's memory measured around both, and the configuration
        resolved again with those facts (a one-line DeviceMemoryTooSmall when they leave no pool);
        then the KV pool of the resolved blocks, and the decode graphs captured over it
        (--cuda-graphs). On the CPU: load, allocate, nothing else."""
        if not config.needs_device_memory:
            executor = load()
        else:
            loaded: list[InProcessExecutor] = []
            step = ProfileStep.of(config.requested, self.model_config, image_tokens)
            facts = (measure or measure_device_memory)(lambda: loaded.append(load()),
                                                       lambda: loaded[0].profile_step(step))
            executor = loaded[0]
            config = resolve_engine_config(config.requested, model_dir, machine, self.model_config,
                                           device_memory=facts)
        executor.allocate_kv_cache(
            config.kv.num_blocks, config.cuda_graph_sizes, config.kv.max_model_len
        )
        return config, executor

    def calibrate(self) -> None:
        """Fit the step-cost model on a few synthetic requests before serving
        (engine/calibration.py). They run on a scheduler of their own, sharing the cost model,
        dropped after: the serving one, the engine's counts and every cache an operator sees are a
        fresh engine's. Only before the first request."""
        from firsttoken.engine.calibration import calibrate

        if self.requests:
            raise RuntimeError("calibrate with requests in flight")
        serving, self.scheduler = self.scheduler, self._new_scheduler(calibrating=True)
        try:
            calibrate(self)
        finally:
            self.scheduler = serving
            self.num_images_encoded = self._num_steps = 0

    def _new_scheduler(self, calibrating: bool = False) -> Scheduler:
        """``calibrating``: a scratch one for calibrate: token budgets only, and no image output
        kept once its request's prefill has passed it (its runner state is all released before
        serving starts)."""
        return Scheduler(
            self.config.scheduler,
            self.config.cache,
            self.capacity.num_blocks,
            self.capacity.max_model_len,
            0 if calibrating else self.resolved.encoder_cache_tokens,
            self.cost_model,
            calibrating=calibrating,
        )

    def _interrupt(self) -> bool:
        pending = self.short_request_pending
        return pending is not None and pending()

    @property
    def max_model_len(self) -> int:
        return self.capacity.max_model_len

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
        detok = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, request.sampling.stop
        )
        # everything that can fail is built before anything is registered
        req = Request(request, self._arrivals)
        req.busy_mark_s, req.steps_mark = self._busy_s, self._num_steps
        self._arrivals += 1
        self.requests[request.request_id] = req
        self._detok[request.request_id] = detok
        self.scheduler.add(req)

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._finish(req, FinishReason.ABORT)
        return True

    def has_unfinished(self) -> bool:
        """Work to run, or runner state (finished requests, encoder outputs) the next step
        releases."""
        return self.scheduler.needs_step

    # ---- the loop --------------------------------------------------------------------------------
    def step(
        self, deliver: Callable[[list[RequestOutput]], None] | None = None
    ) -> list[RequestOutput]:
        """schedule -> execute -> update. The step's wall time (all three) and the work it held
        train the scheduler's cost model, which prices the next steps. With ``deliver``, the step's
        outputs go to it as soon as its tokens are sampled, before the encoder work the runner left
        for after them (interruptible long-lane units: no chunk of this step needs them); what comes
        after (failures of that work) is returned."""
        step_start = time.monotonic()
        try:
            return self._step(step_start, deliver)
        finally:
            self._busy_s += time.monotonic() - step_start

    def _step(
        self, step_start: float, deliver: Callable[[list[RequestOutput]], None] | None
    ) -> list[RequestOutput]:
        expired = self._expire()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return expired
        self._num_steps += batch.has_work  # this step counts for a first token sampled in it
        self._ending = []
        try:
            return expired + self._run(batch, step_start, deliver)
        finally:
            if self._ending:  # (an engine bug raised before the step closed)
                self.scheduler.update(None, None, self._ending)
            self._ending = None

    def _run(self, batch: ScheduledBatch, step_start: float,
             deliver: Callable[[list[RequestOutput]], None] | None) -> list[RequestOutput]:
        try:
            # reports per-request failures; raises only on an engine bug
            result = self.executor.execute(batch)
        except Exception:
            return self._fail_batch(batch)
        outputs = self._update(batch, result, step_start)
        if any(w.interruptible for w in batch.encoder_work):
            if deliver is not None:
                deliver(outputs)
                outputs = []
            try:
                late = self.executor.finish_step()
            except Exception:
                return outputs + self._fail_batch(batch, result)
            if late is not None:
                outputs += self._update(batch, late, step_start, chunks=False)
                result = result.merged(late)
        report = self._close_step(batch, result, step_start if batch.has_work else None)
        if report is not None:  # the cost model learnt the step (in update)
            self._observe_step(batch, result, step_start, report)
            self._account(batch, result, report.duration_s)
        return outputs

    def _close_step(
        self, batch: ScheduledBatch, result: RunnerOutput, started_s: float | None
    ) -> StepReport | None:
        """The scheduler follows the step's whole output and finishes what the step ended
        (``_finish`` defers the scheduler's part to here while a step runs, so the chunks those
        requests ran are followed first)."""
        ending, self._ending = self._ending, None
        return self.scheduler.update(batch, result, ending or (), started_s)

    def _account(self, batch: ScheduledBatch, result: RunnerOutput, duration_s: float) -> None:
        """The step's time for each request that had work in it and has no first token yet."""
        with_chunk = {c.request_id for c in batch.chunks}
        for rid in with_chunk | {w.request_id for w in batch.encoder_work}:
            req = self.requests.get(rid)
            if req is not None and req.stats.first_token_s is None:
                req.own_steps_s += duration_s
                req.own_forward_s += result.forward_s if rid in with_chunk else 0.0

    def _fail_batch(
        self, batch: ScheduledBatch, done: RunnerOutput | None = None
    ) -> list[RequestOutput]:
        """Last resort when the runner itself broke: fail the batch's requests (``done``: what it
        reported before breaking, whose tokens went out), forget the step's encoder work (the runner
        restarts an image from its pixels when asked for layer 0 again), keep serving."""
        involved = {rid: self.requests[rid] for rid in [c.request_id for c in batch.chunks] +
                    [w.request_id for w in batch.encoder_work] if rid in self.requests}
        message = "internal error while running this request"
        log.exception("engine step failed; failing the %d requests in it", len(involved))
        outputs = [self._fail(r, message) for r in involved.values()]
        failed = RunnerOutput(
            {},
            {},
            dict.fromkeys(involved, message),
            discarded_encoder_hashes=frozenset(w.content_hash for w in batch.encoder_work),
        )
        self._close_step(batch, done.merged(failed) if done is not None else failed, None)
        return outputs

    def _expire(self) -> list[RequestOutput]:
        timeout = self.config.request_timeout_s
        if timeout is None:
            return []
        now = time.monotonic()
        late = [r for r in self.requests.values() if now - r.engine_request.arrival_s > timeout]
        return [
            self._fail(
                r,
                f"the request did not finish within the server's {timeout:g} s request timeout",
                status=504,
            )
            for r in late
        ]

    def _observe_step(
        self, batch: ScheduledBatch, result: RunnerOutput, step_start: float, report: StepReport
    ) -> None:
        self.observer.on_step(
            StepStats(
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
        )

    def _update(self, batch: ScheduledBatch, result: RunnerOutput, step_start: float,
                chunks: bool = True) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for rid, message in result.failed.items():
            if rid in self.requests:
                outputs.append(self._fail(self.requests[rid], message))
        # its own grammar's doing: the request was bad
        for rid, message in result.constraint_failed.items():
            if rid in self.requests:
                outputs.append(self._fail(self.requests[rid], message, status=400))
        for rid, seconds in result.encoder_s.items():
            if rid in self.requests:
                self.requests[rid].count("encoder_s", seconds)
                self.requests[rid].count(
                    "num_images_encoded", result.num_images_encoded.get(rid, 0)
                )
        shared = (
            len({c.request_id for c in batch.chunks} | {w.request_id for w in batch.encoder_work})
            > 1
        )
        self.num_images_encoded += sum(result.num_images_encoded.values())
        for chunk in batch.chunks if chunks else ():
            req = self.requests.get(chunk.request_id)
            if (
                req is None
                or req.request_id in result.failed
                or req.request_id in result.skipped_request_ids
            ):
                continue
            self._note_timing(req, chunk, result, step_start, shared)
            scored = result.prompt_logprobs.get(req.request_id)
            # (after the first token, a recompute is not news)
            if scored is not None and not req.output_token_ids:
                kept = self._prompt_logprobs.setdefault(req.request_id, [])
                del kept[chunk.context_len :]  # a recompute from the start (preempted) scores again
                kept.extend(scored)
            if req.request_id in result.sampled:
                outputs.append(
                    self._append_token(req, result.sampled[req.request_id], result, step_start)
                )
        return outputs

    def _note_timing(
        self,
        req: Request,
        chunk: ScheduledChunk,
        result: RunnerOutput,
        step_start: float,
        shared: bool,
    ) -> None:
        if not chunk.is_decode:
            req.count("num_prefill_steps")
            req.count("num_shared_prefill_steps", int(shared))
        last_image_end = max((im.end for im in req.images), default=0)
        if chunk.end >= last_image_end:
            req.stamp("encoder_done_s", result.encoder_done_s.get(req.request_id, step_start))
        if chunk.end >= req.num_prompt_tokens:
            req.stamp("prefill_done_s", result.forward_done_s)

    def _append_token(
        self, req: Request, token_id: int, result: RunnerOutput, step_start: float
    ) -> RequestOutput:
        req.output_token_ids.append(token_id)
        scored = (
            self._prompt_logprobs.pop(req.request_id, None)
            if len(req.output_token_ids) == 1
            else None
        )
        if req.stats.first_token_s is None:
            self._account_first_token(req, result, step_start)
        req.stamp("first_token_s", result.sample_done_s)
        params = req.engine_request.sampling
        reason = params.finish_after(token_id, len(req.output_token_ids))
        detok = self._detok[req.request_id]
        text = ""
        if reason != FinishReason.STOP:  # (a stop token is not part of the text)
            delta = detok.add([token_id])
            text = delta.text
            if delta.stopped:
                reason = FinishReason.STOP
        if reason is None and req.num_tokens >= self.capacity.max_model_len:
            reason = FinishReason.LENGTH
        if reason is not None and not detok.stopped:
            text += detok.flush()
        if reason is not None:
            self._finish(req, reason)
        logprob = result.logprobs.get(req.request_id)
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=(token_id,),
            new_text=text,
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=len(req.output_token_ids),
            logprobs=(logprob,) if logprob is not None else (),
            prompt_logprobs=tuple(scored or ()),
            stats=req.stats,
        )

    def _account_first_token(self, req: Request, result: RunnerOutput, step_start: float) -> None:
        """Where the engine's time went from the request's arrival here to this first token (the
        step in flight counts up to its sampling): its encoder work, its forwards, the rest of its
        steps, others' steps, idle."""
        own_s = req.own_steps_s + (result.sample_done_s - step_start)
        forward_s = req.own_forward_s + result.forward_s
        busy_before_s = self._busy_s - req.busy_mark_s  # steps completed since it arrived
        req.stats = replace(
            req.stats,
            num_steps_to_first_token=self._num_steps - req.steps_mark,
            handoff_s=max(req.queued_s - req.engine_request.preprocessed_s, 0.0),
            forward_s=forward_s,
            step_overhead_s=max(own_s - req.stats.encoder_s - forward_s, 0.0),
            other_steps_s=max(busy_before_s - req.own_steps_s, 0.0),
            engine_idle_s=max(step_start - req.queued_s - busy_before_s, 0.0),
        )

    def _fail(self, req: Request, message: str, status: int = 500) -> RequestOutput:
        self._finish(req, FinishReason.ERROR)
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=(),
            new_text="",
            finished=True,
            finish_reason=FinishReason.ERROR,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=len(req.output_token_ids),
            stats=req.stats,
            error=message,
            error_status=status,
        )

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if self._ending is not None:
            self._ending.append((req, reason))
        else:  # between steps: the scheduler frees its blocks and encoder pins at once
            self.scheduler.update(None, None, [(req, reason)])
        req.stamp("finished_s")
        self.requests.pop(req.request_id, None)
        self._detok.pop(req.request_id, None)
        self._prompt_logprobs.pop(req.request_id, None)
        er = req.engine_request
        self.observer.on_finished(
            FinishedRequest(
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
        )

    # ---- observability ---------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return replace(
            self.scheduler.stats(),
            encoder_cache_bytes=self.executor.encoder_cache_bytes,
            num_images_encoded=self.num_images_encoded,
        )
