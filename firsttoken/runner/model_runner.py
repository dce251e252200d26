"""The only engine code that touches tensors: vision tower for uncached images, forward, sample.

The runner receives plain data (``ScheduledBatch``: request ids, token ranges, block tables, encoder
work as (request, image, units)) and owns everything per request it needs across steps, keyed by
request id: the token history (prompt + what it sampled), images and their pixels, M-RoPE positions,
sampling parameters and seeded generator. A request's state is created from its ``NewRequest`` on
first sight and dropped when the batch lists it as finished. It never sees a scheduler object, so
the same batch could cross a thread, a process or a device.

Per step: apply new and finished requests; drop encoder outputs the scheduler freed; run the
scheduled vision-tower units through the model's encode protocol (models/interfaces.py: an image may
be encoded over several steps, its EncodeState kept in between; a chunk may end inside an image,
later chunks slice the stored ImageEmbeddings); pack every chunk's tokens into one batch (image rows
placed over their pad tokens, M-RoPE positions sliced from the request's precomputed table, a
generated token's made from its index: no per-token Python, no per-request tensors for a decode);
one forward over the paged KV cache; logits only at the last token of chunks that sample; the
sampler picks tokens (a constrained row's under its grammar's mask, worked on off this thread:
structured/masks.py). Everything it did is reported back as RunnerOutput, and the scheduler's
bookkeeping follows that report, not the plan it scheduled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from firsttoken.attention.base import AttentionMetadata
from firsttoken.batch import (
    EncoderWork,
    NewRequest,
    RunnerOutput,
    ScheduledBatch,
    ScheduledChunk,
)
from firsttoken.config import GrammarConfig
from firsttoken.kernels.cpu_linear import set_kernel_spin, set_kernel_threads
from firsttoken.models.interfaces import EncodeState, ImageEmbeddings, ImageRows
from firsttoken.runner.cuda_graphs import CudaGraphRunner
from firsttoken.sampling.penalties import TokenHistory
from firsttoken.sampling.sampler import Sampler, SampleRow, make_generator
from firsttoken.structured import apply_bitmask
from firsttoken.structured.masks import ConstrainedRow, MaskWorker, StepMasks, stack_masks
from firsttoken.types import ImageItem, SamplingParams, TokenLogprob, images_in

log = logging.getLogger("firsttoken.runner")


class FaultHook(Protocol):
    """A test seam: called before a request's work in a step; raising fails that request only."""

    def __call__(self, stage: str, request_id: str) -> None: ...


class RequestFailure(Exception):
    """One request's work failed; the step goes on without it."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.message = message


@dataclass
class RequestState:
    """What the runner keeps of one request between steps."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    images: tuple[ImageItem, ...]
    mrope_positions: torch.Tensor  # [3, num_prompt_tokens] int64
    mrope_delta: int
    sampling: SamplingParams
    generator: torch.Generator | None  # per-request RNG when sampling.seed is set
    history: TokenHistory | None  # what penalties read, when the request has any
    # its matcher and next mask, when its output has a grammar
    grammar: ConstrainedRow | None = None
    output_token_ids: list[int] = field(default_factory=list)  # what this runner sampled for it

    @staticmethod
    def of(new: NewRequest, vocab_size: int) -> "RequestState":
        """``vocab_size``: the logits' width (the masks')."""
        history = TokenHistory(new.prompt_token_ids) if new.sampling.has_penalties else None
        grammar = new.sampling.grammar
        return RequestState(
            new.request_id,
            new.prompt_token_ids,
            new.images,
            new.mrope_positions,
            new.mrope_delta,
            new.sampling,
            make_generator(new.sampling.seed),
            history,
            ConstrainedRow(grammar.matcher(), vocab_size) if grammar is not None else None,
        )

    def append(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        if self.history is not None:
            self.history.append(token_id)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids at indices [start, end) of prompt + output."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return list(self.prompt_token_ids[start:end])
        head = list(self.prompt_token_ids[start:n_prompt]) if start < n_prompt else []
        return head + self.output_token_ids[max(start - n_prompt, 0) : end - n_prompt]


# torch's intra-op threads when this module was first imported (its default: the cores, or
# $OMP_NUM_THREADS): what "all threads" means for an engine given no --num-threads. Read once,
# because a decode step changes the running thread's count, and an engine built later in the same
# thread must not take that for the default.
DEFAULT_THREADS = torch.get_num_threads()


class ThreadPlan:
    """Threads per step. torch's intra-op threads: a step that only decodes reads every weight once
    for a few rows: it is bound by memory bandwidth, which one thread fewer barely lowers, while the
    server's own threads (HTTP, streaming, detokenizing what that step produced) need a core at
    exactly that time; an OpenMP team spread over every core then waits at each op's barrier for
    whichever thread they preempted. So torch's ops in decode-only steps run on ``decode_threads``
    (default: all but one, at least one), every other step (prefill, vision) on all ``threads``
    (default: DEFAULT_THREADS). A decode step that the fused decode layers take is different: its
    work is firsttoken's own kernels (kernels/cpu_linear.py) but for a few small torch ops, so torch
    gets one thread and the kernels all ``threads`` as workers of their own, which are optional (the
    calling thread takes the work a pre-empted one has not started: a step streams weights on every
    core without waiting for the event loop's) and spin between such steps (``set_kernel_spin``). In
    every other step the kernels run on torch's OpenMP team at torch's count (another pool spinning
    beside that team would take its cores). Applied in the thread that runs the model, torch's count
    only when it changes. A runner without a plan never touches either."""

    def __init__(self, threads: int | None = None, decode_threads: int | None = None) -> None:
        self.threads = threads or DEFAULT_THREADS
        self.decode_threads = max(
            1, min(self.threads - 1 if decode_threads is None else decode_threads, self.threads)
        )
        self.switches = 0  # tests read it: how often the count changed

    def apply(self, decode_only: bool, fused: bool = False) -> None:
        """``fused``: a decode-only step that the fused decode layers take."""
        want = 1 if fused else self.decode_threads if decode_only else self.threads
        # cheap enough per step; the running thread's own count, whoever set it
        if want != torch.get_num_threads():
            torch.set_num_threads(want)
            self.switches += 1
        set_kernel_threads(self.threads if fused else None)
        set_kernel_spin("decode" if fused else "other")

    @staticmethod
    @contextmanager
    def kept() -> Iterator[None]:
        """The calling thread's torch and kernel thread counts, given back after: for a caller that
        steps the engine in its own thread (the offline LLM), whose counts each step changes."""
        threads, kernel_threads = torch.get_num_threads(), set_kernel_threads(None)
        try:
            yield
        finally:
            torch.set_num_threads(threads)
            set_kernel_threads(kernel_threads)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        sampler: Sampler,
        fault_hook: FaultHook | None = None,
        threads: ThreadPlan | None = None,
        interrupt: Callable[[], bool] | None = None,
        device: torch.device | str = "cpu",
        graphs: CudaGraphRunner | None = None,
        grammar: GrammarConfig | None = None,
    ) -> None:
        """``interrupt``: asked between the units of encoder work the scheduler marked
        interruptible; True (a short request arrived) stops that work once the step has done any
        work (an encoder unit or its forward). ``device``: where the model and the KV caches live
        (the resolved --device); each step's inputs are built on the CPU and copied there once,
        images' pixels through pinned memory; the sampler runs on the CPU (a CUDA step copies its
        sampled rows' logits back). ``graphs``: captured decode graphs (runner/cuda_graphs.py) that
        a pure-decode step within their buckets replays instead of the eager forward; None: every
        step eager. ``grammar``: how constrained requests' grammar work runs and is bounded
        (structured/masks.py; default: GrammarConfig's defaults)."""
        self.device = torch.device(device)
        self.graphs = graphs
        # host -> device copies from pinned memory, not waited for
        self._copy_async = self.device.type == "cuda"
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sampler = sampler
        self.fault_hook = fault_hook
        self.requests: dict[str, RequestState] = {}
        # content hash -> the image's embeddings
        self.encoder_outputs: dict[str, ImageEmbeddings] = {}
        self._encode_jobs: dict[str, EncodeState] = {}  # images part-way through the vision tower
        # images fully encoded by the vision tower; tests read it to prove reuse
        self.num_vision_calls = 0
        self.threads = threads
        self.interrupt = interrupt
        # model work run so far in this step: encoder units, and the forward as one
        self._step_units = 0
        # this step's interruptible encoder work, run by finish_step()
        self._deferred: list[EncoderWork] = []
        # [rows, ceil(vocab / 32)] int32, reused: a step's sampled rows' masks
        self._bitmask: np.ndarray | None = None
        # this step's prompt logprobs, by request
        self._prompt_scores: dict[str, tuple[TokenLogprob, ...]] = {}
        # constrained requests' grammar work, off this thread
        self.masks = MaskWorker(grammar or GrammarConfig())
        self._step_masks = StepMasks()  # what this step found of its constrained rows' masks

    @property
    def encoder_cache_bytes(self) -> int:
        return sum(e.num_bytes for e in self.encoder_outputs.values())

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        """The step's encoder work that its chunks need, then the forward and sampling. Its
        interruptible encoder work (no chunk of the step needs it) is kept for ``finish_step``, so
        the sampled tokens can go out first. Never raises for one request's sake: encode, forward
        and sampling failures are reported per request in ``failed``; chunks whose image embeddings
        are missing are reported in ``skipped_request_ids``; constrained rows whose mask was not
        ready in ``mask_pending_request_ids``, those their grammar ended in
        ``constraint_failed``."""
        self._follow(batch)
        self._step_units = 0
        self._deferred = [w for w in batch.encoder_work if w.interruptible]
        enc = self._run_encoder_work([w for w in batch.encoder_work if not w.interruptible])
        failed = enc.failed
        chunks, skipped = self._runnable(batch, enc)
        timing: dict[str, float] = {}
        self._prompt_scores = {}
        self._step_masks = StepMasks()
        sampled: dict[str, int] = {}
        logprobs: dict[str, TokenLogprob] = {}
        forward_start = time.monotonic()
        if chunks:
            # the forward is work done: the deferred units may all be cut after it
            self._step_units += 1
            try:
                sampled, logprobs = self._forward_and_sample(chunks, failed, timing)
            # the batched forward itself broke: it cannot be pinned on one request
            except Exception:
                log.exception("forward pass failed for %d chunks", len(chunks))
                for c in chunks:
                    failed[c.request_id] = "internal error while running this request"
        for rid, token in sampled.items():
            self.requests[rid].append(token)
        now = time.monotonic()
        return RunnerOutput(
            sampled,
            logprobs,
            failed,
            skipped_request_ids=frozenset(skipped),
            encoder_progress=enc.progress,
            discarded_encoder_hashes=frozenset(enc.discarded),
            encoder_s=enc.seconds,
            num_images_encoded=enc.num_encoded,
            encoder_done_s=enc.done_s,
            forward_done_s=timing.get("forward_done", now),
            sample_done_s=now,
            forward_s=now - forward_start if chunks else 0.0,
            prompt_logprobs={r: lp for r, lp in self._prompt_scores.items() if r not in failed},
            mask_pending_request_ids=self._step_masks.pending - failed.keys(),
            constraint_failed={
                r: why for r, why in self._step_masks.refused.items() if r not in failed
            },
            mask_wait_s=self._step_masks.wait_s,
        )

    def _follow(self, batch: ScheduledBatch) -> None:
        """The batch's bookkeeping: finished requests dropped, new ones started, freed encoder
        outputs released, the step's thread count set."""
        for rid in batch.finished_request_ids:
            gone = self.requests.pop(rid, None)
            if gone is not None and gone.grammar is not None:
                gone.grammar.cancel()
        for new in batch.new_requests:
            state = self.requests[new.request_id] = RequestState.of(
                new, self.model.config.vocab_size
            )
            if state.grammar is not None:
                self.masks.start(state.grammar)  # its first mask, while its prefill runs
        for h in batch.freed_encoder_hashes:
            self.encoder_outputs.pop(h, None)
            self._encode_jobs.pop(h, None)
        # a bookkeeping-only batch leaves the count alone
        if self.threads is not None and batch.has_work:
            decode_only = not batch.encoder_work and all(c.is_decode for c in batch.chunks)
            self.threads.apply(
                decode_only, fused=decode_only and self.model.decode.takes(len(batch.chunks))
            )

    def _runnable(self, batch: ScheduledBatch,
                  enc: "_EncodeReport") -> tuple[list[ScheduledChunk], set[str]]:
        """The batch's chunks that can run (their request did not fail, their images' embeddings
        are here), and the requests skipped for a missing embedding (the scheduler runs them
        again)."""
        failed = enc.failed
        chunks: list[ScheduledChunk] = []
        skipped: set[str] = set()
        for chunk in batch.chunks:
            rid = chunk.request_id
            if rid in failed:
                continue
            state = self.requests[rid]
            missing = [
                im.content_hash
                for _, im in images_in(state.images, chunk.context_len, chunk.end)
                if im.content_hash not in self.encoder_outputs
            ]
            # e.g. its image's encode failed this step for another request: run it next step
            if missing:
                skipped.add(rid)
                for h in missing:
                    self._encode_jobs.pop(h, None)
                    enc.discarded.add(h)
                continue
            chunks.append(chunk)
        return chunks, skipped

    @torch.inference_mode()
    def finish_step(self) -> RunnerOutput | None:
        """The step's interruptible encoder work, after its tokens went out: unit by unit, stopping
        at the next unit once a short request is waiting (``interrupt``) and the step has done any
        work. None when there is none."""
        work, self._deferred = self._deferred, []
        if not work:
            return None
        enc = self._run_encoder_work(work)
        return RunnerOutput(
            {},
            {},
            enc.failed,
            encoder_progress=enc.progress,
            discarded_encoder_hashes=frozenset(enc.discarded),
            encoder_s=enc.seconds,
            num_images_encoded=enc.num_encoded,
            encoder_done_s=enc.done_s,
        )

    def _run_encoder_work(self, work_items: Sequence[EncoderWork]) -> "_EncodeReport":
        report = _EncodeReport()
        for work in work_items:
            rid = work.request_id
            h = work.content_hash
            if rid in report.failed:
                continue  # its earlier image failed; this one is not attempted and keeps its state
            try:
                self._hook("encode", rid)
                t0 = time.perf_counter()
                report.progress[h] = self._run_encoder(work)
                report.seconds[rid] = report.seconds.get(rid, 0.0) + time.perf_counter() - t0
                # not cut short
                if work.finishes and report.progress[h] >= work.start_unit + work.num_units:
                    report.num_encoded[rid] = report.num_encoded.get(rid, 0) + 1
                    report.done_s[rid] = time.monotonic()
            except RequestFailure as e:
                report.failed[rid] = e.message
            except Exception:  # one request's images failed to encode; the others go on
                log.exception("vision encoder failed for request %s", rid)
                report.failed[rid] = "internal error while encoding this request's images"
            if rid in report.failed:
                self._encode_jobs.pop(h, None)
                report.progress.pop(h, None)
                report.discarded.add(h)
        return report

    def _should_stop(self, work: EncoderWork) -> bool:
        return (work.interruptible and self.interrupt is not None and self._step_units > 0
                and self.interrupt())

    def _hook(self, stage: str, request_id: str) -> None:
        if self.fault_hook is None:
            return
        try:
            self.fault_hook(stage, request_id)
        # an injected fault stands for any failure inside this request's work
        except Exception as e:
            raise RequestFailure(request_id, f"internal error while {stage} this request") from e

    def _run_encoder(self, work: EncoderWork) -> int:
        """Run encoder units [start_unit, start_unit + num_units) of one image; keep partial state.
        Returns the image's units done afterwards (all of them once its embeddings exist)."""
        image = self.requests[work.request_id].images[work.image_index]
        visual = self.model.visual
        if image.content_hash in self.encoder_outputs:
            return len(image.encoder_units)
        # interrupted before this work began: its state (if any) stays as it was
        if self._should_stop(work):
            return work.start_unit
        job = self._encode_jobs.get(image.content_hash)
        if job is not None and job.units_done != work.start_unit:
            if work.start_unit != 0:
                raise RequestFailure(
                    work.request_id, "image encoding state was lost; retry the request"
                )
            job = None  # the scheduler restarted this image from its pixels
        if job is None:
            if work.start_unit != 0:
                raise RequestFailure(
                    work.request_id, "image encoding state was lost; retry the request"
                )
            if image.pixel_values is None:
                raise RequestFailure(
                    work.request_id, "image pixels are missing and its encoding is not cached"
                )
            job = visual.start_encode(
                self._to_device(image.pixel_values).to(self.model.dtype), image.grid_thw
            )
            self._encode_jobs[image.content_hash] = job
        for _ in range(work.num_units):  # unit by unit: interruptible work asks between them
            visual.run_units(job, 1)
            self._step_units += 1
            if self._should_stop(work):
                break
        if job.done:
            self.encoder_outputs[image.content_hash] = visual.finish_encode(job)
            del self._encode_jobs[image.content_hash]
            self.num_vision_calls += 1
        return job.units_done

    def _forward_and_sample(
        self, chunks: list[ScheduledChunk], failed: dict[str, str], timing: dict[str, float]
    ) -> tuple[dict[str, int], dict[str, TokenLogprob]]:
        inputs = self._pack(chunks)
        sampling = [(row, c) for row, c in zip(inputs.last_rows, chunks) if c.sample]
        # a decode-only batch samples all
        every_row = bool(sampling) and len(sampling) == len(inputs.input_ids)
        logits: torch.Tensor | None = None
        # a pure-decode step
        if self.graphs is not None and every_row and all(c.is_decode for c in chunks):
            # None: above the buckets
            logits = self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        if logits is None:
            out = self.model.forward_step(
                inputs.input_ids,
                inputs.positions,
                self.kv_caches,
                inputs.meta,
                inputs.images,
                all_logits=every_row,
            )
        timing["forward_done"] = time.monotonic()
        if logits is not None:  # decode rows only: no prompt position to score
            return self._sample(logits, [c for _, c in sampling], failed)
        self._score_prompts(chunks, inputs.last_rows, out.hidden)
        if not sampling:
            return {}, {}
        logits = out.logits  # where the decode method computed them in the same call
        if logits is None:
            hidden = out.hidden
            if not every_row:
                hidden = hidden[torch.tensor([row for row, _ in sampling])]
            logits = self.model.compute_logits(hidden)  # [num_sampling, vocab] float32
        return self._sample(logits, [c for _, c in sampling], failed)

    def _score_prompts(
        self, chunks: list[ScheduledChunk], last_rows: list[int], hidden: torch.Tensor | None
    ) -> None:
        """For requests that asked for prompt logprobs: each of the chunk's positions scores the
        prompt token after it (the last prompt position predicts the answer instead, as sampling
        does)."""
        for chunk, last in zip(chunks, last_rows):
            state = self.requests[chunk.request_id]
            top = state.sampling.prompt_logprobs
            if top is None or chunk.is_decode:
                continue
            stop = min(chunk.end, len(state.prompt_token_ids) - 1)
            count = stop - chunk.context_len
            scored: tuple[TokenLogprob, ...] = ()
            if count > 0:
                assert hidden is not None, "a prefill chunk's hidden states are kept"
                first = last - chunk.num_new_tokens + 1
                logp = torch.log_softmax(
                    self.model.compute_logits(hidden[first : first + count]).float(), dim=-1
                )
                targets = state.prompt_token_ids[chunk.context_len + 1 : stop + 1]
                chosen = logp.gather(1, torch.tensor(targets, device=logp.device)[:, None])[
                    :, 0
                ].tolist()
                alternatives: list[tuple[tuple[int, float], ...]] = [()] * count
                if top:
                    vals, idx = torch.topk(logp, top, dim=-1)
                    alternatives = [tuple(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
                scored = tuple(
                    TokenLogprob(t, lp, alt) for t, lp, alt in zip(targets, chosen, alternatives)
                )
            self._prompt_scores[chunk.request_id] = scored

    def _pack(self, chunks: list[ScheduledChunk]) -> _PackedInputs:
        """Every chunk's tokens back to back: ids, M-RoPE positions, image rows, attention metadata.
        A token past its prompt sits at index + mrope_delta on all three axes, so decode positions
        are plain ints, made into one tensor per step; only chunks inside a prompt slice the
        request's precomputed table."""
        ids: list[int] = []
        last_rows: list[int] = []
        generated_rows: list[int] = []  # packed rows of tokens past their prompt
        generated_pos: list[int] = []  # ... and their position (same on t, h, w)
        prompt_parts: list[tuple[int, torch.Tensor]] = []  # (first packed row, [3, n] positions)
        images: list[ImageRows] = []
        for chunk in chunks:
            state = self.requests[chunk.request_id]
            base = len(ids)
            start, end = chunk.context_len, chunk.end
            n_prompt = len(state.prompt_token_ids)
            ids.extend(state.token_ids(start, end))
            if start < n_prompt:
                prompt_parts.append((base, state.mrope_positions[:, start : min(end, n_prompt)]))
                for _, im in images_in(state.images, start, end):
                    lo, hi = max(im.offset, start), min(im.end, end)
                    rows = self.encoder_outputs[im.content_hash].rows(
                        lo - im.offset, hi - im.offset
                    )
                    images.append(ImageRows(base + lo - start, rows))
            first_generated = max(start, n_prompt)
            generated_rows.extend(range(base + first_generated - start, base + end - start))
            generated_pos.extend(
                range(first_generated + state.mrope_delta, end + state.mrope_delta)
            )
            last_rows.append(len(ids) - 1)
        meta = AttentionMetadata.build(
            [c.num_new_tokens for c in chunks],
            [c.context_len for c in chunks],
            [c.block_table for c in chunks],
            self.block_size,
            self.device,
        )
        return _PackedInputs(
            self._to_device(torch.tensor(ids, dtype=torch.long)),
            self._to_device(_positions(len(ids), prompt_parts, generated_rows, generated_pos)),
            meta, images, last_rows,
        )

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A CPU tensor on the runner's device: itself on the CPU; else copied from pinned memory
        without waiting (the stream orders it before the kernels that read it)."""
        if not self._copy_async:
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _sample(
        self, logits: torch.Tensor, chunks: list[ScheduledChunk], failed: dict[str, str],
    ) -> tuple[dict[str, int], dict[str, TokenLogprob]]:
        """Sample row i of ``logits`` for chunks[i]. A constrained row samples only under its mask:
        where the mask is not ready in time the row is left out (pending), where its grammar ended
        it, it is left out too (``_step_masks``). Each sampled constrained row's grammar work for
        its next token starts at once."""
        keep: list[int] = []
        for i, c in enumerate(chunks):
            try:
                self._hook("sample", c.request_id)
                keep.append(i)
            except RequestFailure as e:
                failed[e.request_id] = e.message
        grammars = {
            chunks[i].request_id: g
            for i in keep
            if (g := self.requests[chunks[i].request_id].grammar)
        }
        if grammars:
            self._step_masks = self.masks.collect(grammars)
            failed.update(self._step_masks.crashed)
            keep = [i for i in keep if chunks[i].request_id not in grammars or
                    chunks[i].request_id in self._step_masks.ready]
        if not keep:
            return {}, {}
        logits = logits if len(keep) == logits.shape[0] else logits[keep]
        chunks = [chunks[i] for i in keep]
        # the sampler (its per-request generators, penalties, masks) is the CPU's
        if logits.device.type != "cpu":
            logits = logits.cpu()
        states = [self.requests[c.request_id] for c in chunks]
        rows = [
            SampleRow(s.sampling, s.generator, s.prompt_token_ids, s.output_token_ids, s.history)
            for s in states
        ]
        masked = [s.grammar for s in states]
        # rows without a grammar are neither read nor written
        if any(g is not None for g in masked):
            self._bitmask, constrained = stack_masks(masked, self._bitmask)
            apply_bitmask(logits, self._bitmask, constrained)
        result = self.sampler.sample(logits, rows)
        for i, message in result.failed.items():
            failed[chunks[i].request_id] = message
        sampled = {
            c.request_id: t
            for i, (c, t) in enumerate(zip(chunks, result.token_ids))
            if i not in result.failed
        }
        for c, state in zip(chunks, states):
            token = sampled.get(c.request_id)
            if (
                state.grammar is not None
                and token is not None  # (the token is not appended yet)
                and state.sampling.finish_after(token, len(state.output_token_ids) + 1) is None
            ):
                # the token goes out now; the grammar takes it meanwhile
                self.masks.start(state.grammar, token)
        logprobs = {c.request_id: lp for c, lp in zip(chunks, result.logprobs) if lp is not None}
        return sampled, logprobs


@dataclass(frozen=True)
class _PackedInputs:
    """One forward's inputs; row r of every [num_tokens, ...] tensor is the r-th token of the packed
    chunks."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [3, num_tokens] int64 (t, h, w)
    meta: AttentionMetadata
    images: list[ImageRows]
    last_rows: list[int]  # per chunk, the packed row of its last token


def _positions(
    num_tokens: int,
    prompt_parts: list[tuple[int, torch.Tensor]],
    generated_rows: list[int],
    generated_pos: list[int],
) -> torch.Tensor:
    """[3, num_tokens] int64 positions from slices of prompt tables (at their first packed row) and
    per-row positions of generated tokens (the same on all three axes)."""
    generated = torch.tensor(generated_pos, dtype=torch.int64)
    if not prompt_parts:  # decode-only: rows are 0 .. num_tokens - 1 in order
        return generated.expand(3, -1)  # stride 0: mrope_cos_sin reads it as one row
    if len(prompt_parts) == 1 and not generated_rows:
        return prompt_parts[0][1]
    out = torch.empty((3, num_tokens), dtype=torch.int64)
    for row, part in prompt_parts:
        out[:, row : row + part.shape[1]] = part
    if generated_rows:
        out[:, torch.tensor(generated_rows, dtype=torch.int64)] = generated
    return out


@dataclass
class _EncodeReport:
    """What one step's encoder work did, per image hash and per request."""

    failed: dict[str, str] = field(default_factory=dict)  # request_id -> user-safe message
    progress: dict[str, int] = field(default_factory=dict)  # image hash -> units done
    discarded: set[str] = field(default_factory=set)  # image hashes whose partial state was dropped
    seconds: dict[str, float] = field(default_factory=dict)
    num_encoded: dict[str, int] = field(default_factory=dict)
    done_s: dict[str, float] = field(default_factory=dict)
