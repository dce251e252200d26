"""The offline Python API: the engine without HTTP, as users of vLLM's ``LLM`` expect.

    from firsttoken import LLM
    llm = LLM(model="/path/to/Qwen2-VL-2B-Instruct", dtype="float32")
    out = llm.chat([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}},   # or a path in allowed_media_dir
        {"type": "image_pil", "image_pil": pil_image},                               # or a PIL image
        {"type": "text", "text": "What is in these pictures?"}]}],
        {"temperature": 0, "max_tokens": 32})
    print(out.text, out.usage, out.timings["ttft_s"])

``chat`` takes one conversation or a list of them; a list runs as one batch through the same scheduler the server
uses (continuous batching, chunked prefill, lanes, prefix and encoder caches), with one sampling for all or a list
of them, one per conversation (as vLLM's ``LLM.generate`` takes a list of ``SamplingParams``). ``complete`` does the
same for raw prompts. Options are the ``firsttoken serve`` flags by name (``kv_cache_memory="2GiB"``,
``image_max_tokens=1280``, ``no_prefix_cache=True``), so every default is the server's (but ``decode_threads``:
with no server threads to leave a core to, decoding uses all of them). Inputs are validated exactly
as the server validates an HTTP body: a bad request raises ``ValueError`` with the server's 400 message before
anything runs.
"""

from __future__ import annotations

import io
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from firsttoken.api.protocol import ChatMessage
from firsttoken.config import GenerationDefaults, ServeConfig, config_from_options
from firsttoken.engine.engine import LLMEngine
from firsttoken.inputs.processor import InputProcessor, load_tokenizer
from firsttoken.inputs.prompt import (
    ChatPrompt,
    ImagePart,
    Message,
    Prompt,
    SamplingRequest,
    TextPrompt,
)
from firsttoken.kernels.cpu_linear import set_kernel_threads
from firsttoken.metrics.timeline import Timeline
from firsttoken.runner.model_runner import DEFAULT_THREADS
from firsttoken.structured.spec import from_response_format, from_structured_outputs
from firsttoken.types import EngineRequest, FinishReason, TokenLogprob


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
    timings: Mapping[str, float | int | None]  # the server's usage.firsttoken: ttft_s, phases, cache counts
    logprobs: tuple[TokenLogprob, ...] = ()
    error: str | None = None  # with finish_reason "error": what failed (this request only)


Conversation = Sequence[Mapping[str, Any]]
Sampling = SamplingRequest | Mapping[str, Any] | None


class LLM:
    """An engine in this process. Not thread-safe: call it from one thread (it runs the engine loop itself)."""

    def __init__(self, model: str | Path | None = None, **options: Any) -> None:
        from firsttoken.models.checkpoint import demo_model_dir
        from firsttoken.models.hub import resolve_model

        self.config: ServeConfig = config_from_options(model=None if model is None else str(model), **options)
        self.model_dir = resolve_model(model) if model is not None else demo_model_dir()
        self.tokenizer = load_tokenizer(self.model_dir, self.config.chat_template)
        decoder = getattr(self.tokenizer, "backend_tokenizer", None) or self.tokenizer
        engine_config = self.config.engine
        if engine_config.decode_threads is None:  # no server threads to leave a core to: decode on all of them
            engine_config = replace(engine_config, decode_threads=engine_config.num_threads or DEFAULT_THREADS)
        self.engine = LLMEngine(self.model_dir, engine_config, decoder,
                                profile_image_tokens=self.config.images.image_max_tokens)
        self.processor = InputProcessor(
            self.tokenizer,
            self.engine.model_config,
            GenerationDefaults.from_pretrained(self.model_dir),
            max_model_len=self.engine.max_model_len,
            images=self.config.images,
            videos=self.config.videos,
        )
        self._next_id = 0

    # ---- public ------------------------------------------------------------------------------------------
    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling: Sampling | Sequence[Sampling] = None,
    ) -> RequestResult | list[RequestResult]:
        """One conversation -> one result; a list of conversations -> a list of results, run as one batch.
        ``sampling``: one for every conversation, or a list with one per conversation."""
        batch = _is_batch(messages)
        conversations = list(messages) if batch else [messages]
        prompts = [ChatPrompt(tuple(_message(m) for m in c)) for c in conversations]
        results = self.run(prompts, sampling)
        return results if batch else results[0]

    def complete(
        self, prompts: str | Sequence[str], sampling: Sampling | Sequence[Sampling] = None
    ) -> RequestResult | list[RequestResult]:
        """Raw text prompts (chat control tokens honoured, as /v1/completions); ``sampling`` as for ``chat``."""
        batch = not isinstance(prompts, str)
        texts = list(prompts) if batch else [prompts]
        results = self.run([TextPrompt(t) for t in texts], sampling)
        return results if batch else results[0]

    def run(self, prompts: Sequence[Prompt], sampling: Sampling | Sequence[Sampling]) -> list[RequestResult]:
        """Preprocess every prompt (any refusal raises before anything runs), then step the engine until all
        finish."""
        per_prompt = _per_prompt(sampling, len(prompts))
        arrival = time.monotonic()
        requests: list[EngineRequest] = []
        for prompt, request in zip(prompts, per_prompt):
            self._next_id += 1
            requests.append(self.processor.process(prompt, request, f"offline-{self._next_id}", arrival))
        collected = {r.request_id: _Collected(Timeline(arrival)) for r in requests}
        for r in requests:
            collected[r.request_id].timeline.take_request(r)
        for r in requests:
            self.engine.add_request(r)
        pending = set(collected)
        threads, kernel_threads = torch.get_num_threads(), set_kernel_threads(None)
        try:
            while pending:
                self._step(collected, pending)
        finally:  # the engine changes this thread's torch and kernel threads (--decode-threads): give them back
            torch.set_num_threads(threads)
            set_kernel_threads(kernel_threads)
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
        self.timeline, self.text, self.token_ids, self.logprobs, self.final = timeline, [], [], [], None

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
            usage=Usage(final.num_prompt_tokens, final.num_output_tokens, final.stats.num_cached_prompt_tokens),
            timings=self.timeline.to_dict(),
            logprobs=tuple(self.logprobs),
            error=final.error,
        )


def _is_batch(messages: Any) -> bool:
    """A list of conversations (each a list of messages) vs one conversation (a list of message mappings)."""
    return bool(messages) and not isinstance(messages[0], Mapping)


def _message(m: Mapping[str, Any]) -> Message:
    """An OpenAI-style message, validated by the server's schema; ``{"type": "image_pil", "image_pil": img}`` parts
    (PIL images, as vLLM's offline API accepts) are encoded to PNG bytes."""
    content = m.get("content")
    if not isinstance(content, list) or not any(_is_pil_part(p) for p in content):
        return ChatMessage.model_validate(m).to_message()
    stand_ins = [{"type": "text", "text": ""} if _is_pil_part(p) else p for p in content]
    validated = ChatMessage.model_validate({**m, "content": stand_ins}).to_message()
    parts = [ImagePart(data=_png(p["image_pil"])) if _is_pil_part(p) else q
             for p, q in zip(content, validated.content or ())]
    return Message(validated.role, tuple(parts))


def _png(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _is_pil_part(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") == "image_pil"


def _per_prompt(sampling: Sampling | Sequence[Sampling], num_prompts: int) -> list[SamplingRequest]:
    """One SamplingRequest per prompt: the same one for all, or a list (or tuple) with one per prompt."""
    if isinstance(sampling, (list, tuple)):
        if len(sampling) != num_prompts:
            raise ValueError(f"got {len(sampling)} sampling settings for {num_prompts} prompts: give one for all, "
                             "or one per prompt")
        return [_sampling(s) for s in sampling]
    return [_sampling(sampling)] * num_prompts


def _sampling(sampling: Sampling) -> SamplingRequest:
    """A SamplingRequest as given, or from OpenAI-style fields (``temperature``, ``max_tokens``, ``stop``, ...,
    ``response_format`` or vLLM's ``structured_outputs``: docs/structured_outputs.md)."""
    if sampling is None:
        return SamplingRequest()
    if isinstance(sampling, SamplingRequest):
        return sampling
    fields = dict(sampling)
    response_format, structured = fields.pop("response_format", None), fields.pop("structured_outputs", None)
    if response_format is not None and structured is not None:
        raise ValueError("give at most one of response_format and structured_outputs")
    spec = from_response_format(response_format) if response_format is not None else from_structured_outputs(structured)
    if spec is not None:
        fields["structured"] = spec
    if isinstance(fields.get("stop"), str):
        fields["stop"] = (fields["stop"],)
    for key in ("stop", "stop_token_ids"):
        if key in fields:
            fields[key] = tuple(fields[key])
    return SamplingRequest(**fields)
