"""The offline Python API: the engine without HTTP, as users of vLLM's ``LLM`` expect.

    from firsttoken import LLM
    llm = LLM(model="/path/to/Qwen2-VL-2B-Instruct", dtype="float32")
    out = llm.chat([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}},   # or a path in allowed_media_dir
        {"type": "image_pil", "image_pil": pil_image},                               # or a PIL image
        {"type": "text", "text": "What is in these pictures?"}]}],
        {"temperature": 0, "max_tokens": 32})
    print(out.text, out.usage, out.timings["ttft_s"])

``chat`` takes one conversation or a list of them; a list runs as one batch through the same
scheduler the server uses (continuous batching, chunked prefill, lanes, prefix and encoder caches),
with one sampling for all or a list of them, one per conversation (as vLLM's ``LLM.generate`` takes
a list of ``SamplingParams``). ``complete`` does the same for raw prompts. Options are the
``firsttoken serve`` flags by name (``kv_cache_memory="2GiB"``, ``image_max_tokens=1280``,
``no_prefix_cache=True``), so every default is the server's (but ``decode_threads``: with no server
threads to leave a core to, decoding uses all of them).

Inputs are validated by the HTTP routes' own schemas: ``chat`` makes /v1/chat/completions' body of
the conversation and the sampling fields, ``complete`` /v1/completions' (its ``logprobs`` is the
number of alternatives), so every field means, converts and is refused as it is over HTTP: a bad one
raises ``InputError`` (a ``ValueError``) with the message and ``param`` of the route's 400, before
anything runs. Two differences: a key that is no field of the body is refused (HTTP ignores it, for
clients that send extras), and so are the fields that frame an answer rather than sample it
(``NOT_SAMPLING``: ``n``, ``stream``, ``tools``, ...). A ``SamplingRequest`` is taken as it is.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from firsttoken.api.offline import Conversation, Sampling, chat_request, completion_request
from firsttoken.config import ServeConfig, config_from_options
from firsttoken.inputs.errors import InputError  # noqa: F401  (what LLM.chat raises, importable here)
from firsttoken.inputs.processor import load_tokenizer
from firsttoken.inputs.prompt import Prompt, SamplingRequest
from firsttoken.metrics.timeline import Timeline
from firsttoken.runner.model_runner import ThreadPlan
from firsttoken.assembly import assemble
from firsttoken.types import EngineRequest, FinishReason, TokenLogprob

T = TypeVar("T")


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache


@dataclass(frozen=True)
class RequestResult:
    """One finished request."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # stop | length | error
    usage: Usage
    # the server's usage.firsttoken: ttft_s, phases, cache counts
    timings: Mapping[str, float | int | None]
    logprobs: tuple[TokenLogprob, ...] = ()
    error: str | None = None  # with finish_reason "error": what failed (this request only)


class LLM:
    """An engine in this process. Not thread-safe: call it from one thread (it runs the engine loop
    itself)."""

    def __init__(self, model: str | Path | None = None, **options: Any) -> None:
        from firsttoken.models.checkpoint import demo_model_dir
        from firsttoken.models.hub import resolve_model

        self.config: ServeConfig = config_from_options(
            model=None if model is None else str(model), **options
        )
        self.model_dir = resolve_model(model) if model is not None else demo_model_dir()
        self.tokenizer = load_tokenizer(self.model_dir, self.config.chat_template)
        # the server's assembly: calibrated as the server is, so steps are sized as the server's
        # (calibrating runs steps, which change this thread's counts)
        with ThreadPlan.kept():
            self.engine, self.processor = assemble(self.config, self.model_dir, self.tokenizer,
                                                   offline=True)
        self._next_id = 0

    # ---- public ----------------------------------------------------------------------------------
    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling: Sampling | Sequence[Sampling] = None,
    ) -> RequestResult | list[RequestResult]:
        """One conversation -> one result; a list of conversations -> a list of results, run as one
        batch. ``sampling``: one for every conversation, or a list with one per conversation."""
        batch = _is_batch(messages)
        conversations = list(messages) if batch else [messages]
        per_prompt = _per_prompt(sampling, len(conversations))
        made = [chat_request(c, s) for c, s in zip(conversations, per_prompt)]
        results = self.run([prompt for prompt, _ in made], [request for _, request in made])
        return results if batch else results[0]

    def complete(
        self, prompts: str | Sequence[str], sampling: Sampling | Sequence[Sampling] = None
    ) -> RequestResult | list[RequestResult]:
        """Raw text prompts (chat control tokens honoured, as /v1/completions, whose fields
        ``sampling`` takes: ``logprobs`` is the number of alternatives); ``sampling`` as for
        ``chat``."""
        batch = not isinstance(prompts, str)
        texts = list(prompts) if batch else [prompts]
        made = [completion_request(t, s) for t, s in zip(texts, _per_prompt(sampling, len(texts)))]
        results = self.run([prompt for prompt, _ in made], [request for _, request in made])
        return results if batch else results[0]

    def preprocess_chat(self, messages: Conversation, sampling: Sampling = None) -> EngineRequest:
        """What ``chat`` hands the engine for one conversation (prompt token ids with the image pads
        expanded, M-RoPE positions, each image's patches), without running it: for comparing with
        another implementation on the very same inputs. Nothing runs or is queued (the
        processed-image cache keeps the pixels, as for ``chat``)."""
        prompt, request = chat_request(messages, sampling)
        return self.processor.process(prompt, request, "preprocess-only", time.monotonic())

    def run(
        self,
        prompts: Sequence[Prompt],
        sampling: SamplingRequest | Sequence[SamplingRequest] = SamplingRequest(),
    ) -> list[RequestResult]:
        """The input processor's own values (``chat`` and ``complete`` make them from OpenAI-style
        ones): preprocess every prompt (any refusal raises before anything runs), then step the
        engine until all finish."""
        per_prompt = _per_prompt(sampling, len(prompts))
        arrival = time.monotonic()
        requests: list[EngineRequest] = []
        for prompt, request in zip(prompts, per_prompt):
            self._next_id += 1
            requests.append(
                self.processor.process(prompt, request, f"offline-{self._next_id}", arrival)
            )
        collected = {r.request_id: _Collected(Timeline(arrival)) for r in requests}
        for r in requests:
            collected[r.request_id].timeline.take_request(r)
        for r in requests:
            self.engine.add_request(r)
        pending = set(collected)
        with ThreadPlan.kept():  # the engine's steps change this thread's counts
            while pending:
                self._step(collected, pending)
        return [collected[r.request_id].result(r.request_id) for r in requests]

    def _step(self, collected: dict[str, "_Collected"], pending: set[str]) -> None:
        for out in self.engine.step():
            c = collected.get(out.request_id)
            if c is None:
                continue
            c.timeline.observe(out)
            c.text.append(out.new_text)
            c.token_ids.extend(out.new_token_ids)
            c.logprobs.extend(out.logprobs)
            if out.finished:
                c.final = out
                pending.discard(out.request_id)


@dataclass
class _Collected:
    timeline: Timeline
    text: list[str]
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    final: Any = None

    def __init__(self, timeline: Timeline) -> None:
        self.timeline, self.text, self.token_ids, self.logprobs, self.final = (
            timeline,
            [],
            [],
            [],
            None,
        )

    def result(self, request_id: str) -> RequestResult:
        final = self.final
        # offline there is no transport: the "first byte" is the first token handed back
        self.timeline.first_byte_s = self.timeline.engine.first_token_s
        reason = final.finish_reason or FinishReason.STOP
        return RequestResult(
            request_id=request_id,
            text="".join(self.text),
            token_ids=tuple(self.token_ids),
            finish_reason=reason.value,
            usage=Usage(
                final.num_prompt_tokens,
                final.num_output_tokens,
                final.stats.num_cached_prompt_tokens,
            ),
            timings=self.timeline.to_dict(),
            logprobs=tuple(self.logprobs),
            error=final.error,
        )


def _is_batch(messages: Any) -> bool:
    """A list of conversations (each a list of messages) vs one conversation (a list of message
    mappings)."""
    return (
        isinstance(messages, Sequence) and bool(messages) and not isinstance(messages[0], Mapping)
    )


def _per_prompt(sampling: T | Sequence[T], num_prompts: int) -> list[T]:
    """One sampling per prompt: the same one for all, or a list (or tuple) with one per prompt."""
    if isinstance(sampling, (list, tuple)):
        if len(sampling) != num_prompts:
            raise ValueError(f"got {len(sampling)} sampling settings for {num_prompts} prompts: give one for all, "
                             "or one per prompt")
        return list(sampling)
    return [sampling] * num_prompts  # type: ignore[list-item]
