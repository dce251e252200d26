"""What a step's runner output means to each request's client, after ``Scheduler.update`` appended
its new token and ended what the token rules end (EOS and stop tokens, ``max_tokens``, the
context): its text detokenized incrementally, stop strings, the prompt's logprobs kept until its
first token, errors, and the first token's accounting (where the engine's time went from its
arrival). vLLM's ``OutputProcessor`` is the anchor.

``step`` returns the step's ``RequestOutput``s and every request the report ended, with its final
reason (a stop string ends a request, and names why one ended on the same token); the engine ends
those the scheduler has not (``Scheduler.finish``) and forgets them all.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from firsttoken.batch import RunnerOutput, ScheduledBatch, ScheduledChunk
from firsttoken.engine.detokenizer import IncrementalDetokenizer, TokenDecoder
from firsttoken.scheduler.request import Ended, Request
from firsttoken.types import FinishReason, RequestOutput, TokenLogprob


@dataclass(frozen=True)
class StepClock:
    """The engine's counters as the step in flight began: its start (monotonic seconds), the
    seconds of every earlier step, and how many steps had work (this one included)."""

    start_s: float
    busy_s: float
    num_steps: int


class OutputProcessor:
    def __init__(self, tokenizer: TokenDecoder, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._detok: dict[str, IncrementalDetokenizer] = {}
        # scored so far, until the first token's output
        self._prompt_logprobs: dict[str, list[TokenLogprob]] = {}

    def add(self, req: Request) -> None:
        er = req.engine_request
        self._detok[req.request_id] = IncrementalDetokenizer(
            self.tokenizer, er.prompt_token_ids, er.sampling.stop
        )

    def drop(self, request_id: str) -> None:
        self._detok.pop(request_id, None)
        self._prompt_logprobs.pop(request_id, None)

    def step(self, batch: ScheduledBatch, result: RunnerOutput, requests: dict[str, Request],
             clock: StepClock, finished: Ended,
             chunks: bool = True) -> tuple[list[RequestOutput], Ended]:
        """The outputs of ``result`` for the live ``requests``, and every request it ended with its
        final reason; ``finished``: what ``Scheduler.update`` ended on the same report. ``chunks``
        False: a deferred encoder report (failures and encoder time only)."""
        outputs: list[RequestOutput] = []
        ended: Ended = []
        # ended in this call (the engine forgets what an earlier call ended before the next)
        gone: set[str] = set()
        for failures, status in ((result.failed, 500), (result.constraint_failed, 400)):
            # constraint_failed: its own grammar's doing, the request was bad
            for rid, message in failures.items():
                if rid in requests and rid not in gone:
                    outputs.append(self.failed(requests[rid], message, ended, status))
                    gone.add(rid)
        for rid, seconds in result.encoder_s.items():
            req = requests.get(rid)
            if req is not None and rid not in gone:
                req.count("encoder_s", seconds)
                req.count("num_images_encoded", result.num_images_encoded.get(rid, 0))
        shared = (
            len({c.request_id for c in batch.chunks} | {w.request_id for w in batch.encoder_work})
            > 1
        )
        reasons = {req.request_id: reason for req, reason in finished}
        for chunk in batch.chunks if chunks else ():
            req = requests.get(chunk.request_id)
            if req is None or req.request_id in gone or req.request_id in result.skipped_request_ids:
                continue
            _note_timing(req, chunk, result, clock.start_s, shared)
            scored = result.prompt_logprobs.get(req.request_id)
            # (after the first token, a recompute is not news; the first is already appended)
            if scored is not None and len(req.output_token_ids) <= int(
                req.request_id in result.sampled
            ):
                kept = self._prompt_logprobs.setdefault(req.request_id, [])
                del kept[chunk.context_len :]  # a recompute from the start (preempted) scores again
                kept.extend(scored)
            if req.request_id in result.sampled:
                outputs.append(self._token_output(
                    req, result.sampled[req.request_id], result, clock,
                    reasons.get(req.request_id), ended,
                ))
        return outputs, ended

    def failed(self, req: Request, message: str, ended: Ended, status: int = 500) -> RequestOutput:
        """The request's last output, an error (this request only); it joins ``ended``."""
        _end(req, FinishReason.ERROR, ended)
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

    def _token_output(self, req: Request, token_id: int, result: RunnerOutput, clock: StepClock,
                      reason: FinishReason | None, ended: Ended) -> RequestOutput:
        """The output of ``token_id``, already appended; ``reason``: why update ended the request on
        it (None: it did not)."""
        scored = (
            self._prompt_logprobs.pop(req.request_id, None)
            if len(req.output_token_ids) == 1
            else None
        )
        if req.stats.first_token_s is None:
            _account_first_token(req, result, clock)
        req.stamp("first_token_s", result.sample_done_s)
        detok = self._detok[req.request_id]
        text = ""
        if reason != FinishReason.STOP:  # (a stop token is not part of the text)
            delta = detok.add([token_id])
            text = delta.text
            if delta.stopped:
                reason = FinishReason.STOP
        if reason is not None and not detok.stopped:
            text += detok.flush()
        if reason is not None:
            _end(req, reason, ended)
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


def _end(req: Request, reason: FinishReason, ended: Ended) -> None:
    req.stamp("finished_s")
    ended.append((req, reason))


def runner_broke(batch: ScheduledBatch, requests: dict[str, Request]) -> RunnerOutput:
    """The report of a step the runner itself broke in: every live request of the batch fails (this
    step only; what the runner reported before breaking stands), and the step's encoder work is
    forgotten (the runner restarts an image from its pixels when asked for layer 0 again)."""
    involved = [rid for rid in [c.request_id for c in batch.chunks] +
                [w.request_id for w in batch.encoder_work] if rid in requests]
    return RunnerOutput(
        {},
        {},
        dict.fromkeys(involved, "internal error while running this request"),
        discarded_encoder_hashes=frozenset(w.content_hash for w in batch.encoder_work),
    )


def account_step(batch: ScheduledBatch, result: RunnerOutput, requests: dict[str, Request],
                 duration_s: float) -> None:
    """The step's time for each request that had work in it and has no first token yet."""
    with_chunk = {c.request_id for c in batch.chunks}
    for rid in with_chunk | {w.request_id for w in batch.encoder_work}:
        req = requests.get(rid)
        if req is not None and req.stats.first_token_s is None:
            req.own_steps_s += duration_s
            req.own_forward_s += result.forward_s if rid in with_chunk else 0.0


def _note_timing(req: Request, chunk: ScheduledChunk, result: RunnerOutput, step_start: float,
                 shared: bool) -> None:
    if not chunk.is_decode:
        req.count("num_prefill_steps")
        req.count("num_shared_prefill_steps", int(shared))
    last_image_end = max((im.end for im in req.images), default=0)
    if chunk.end >= last_image_end:
        req.stamp("encoder_done_s", result.encoder_done_s.get(req.request_id, step_start))
    if chunk.end >= req.num_prompt_tokens:
        req.stamp("prefill_done_s", result.forward_done_s)


def _account_first_token(req: Request, result: RunnerOutput, clock: StepClock) -> None:
    """Where the engine's time went from the request's arrival here to this first token (the step in
    flight counts up to its sampling): its encoder work, its forwards, the rest of its steps, others'
    steps, idle."""
    own_s = req.own_steps_s + (result.sample_done_s - clock.start_s)
    forward_s = req.own_forward_s + result.forward_s
    busy_before_s = clock.busy_s - req.busy_mark_s  # steps completed since it arrived
    req.stats = replace(
        req.stats,
        num_steps_to_first_token=clock.num_steps - req.steps_mark,
        handoff_s=max(req.queued_s - req.engine_request.preprocessed_s, 0.0),
        forward_s=forward_s,
        step_overhead_s=max(own_s - req.stats.encoder_s - forward_s, 0.0),
        other_steps_s=max(busy_before_s - req.own_steps_s, 0.0),
        engine_idle_s=max(clock.start_s - req.queued_s - busy_before_s, 0.0),
    )
