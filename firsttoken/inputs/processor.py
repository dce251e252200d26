"""Turn a prompt (inputs/prompt.py) into an EngineRequest: chat template, images, placeholder
expansion, positions. A pipeline over its own modules: rendering (inputs/render.py), vision items
(inputs/vision_items.py), limits (inputs/limits.py) and sampling fields (inputs/sampling.py).

Steps (all CPU work; the server runs them in a thread pool, never on the event loop). ``draft`` is
steps 1-5, ``finish`` 6-7, ``process`` both; the server's intake (api/intake.py) asks the
engine's admission between them, and may ask ``lowered`` drafts at lower image budgets:

1. check the sampling fields (cheap, before any image is touched), measure the text against the
   token limit from its length and, only if that cannot decide, in pieces with an early exit
   (``inputs/text_size.py``: a huge prompt is refused without being tokenized whole), count the
   images against the limit and resolve each image's visual-token budget (``detail``,
   ``max_visual_tokens``; never above the server's cap);
2. load every image's bytes, then probe every header and plan its resize from the declared size
   alone (``inputs/budget.py``): pixel limit, aspect ratio and visual tokens are known before any
   pixel is decoded;
3. render the checkpoint's chat template and tokenize it with control tokens sanitized:
   special-token strings typed by a client (an image pad, ``<|im_start|>`` ...) are encoded as
   ordinary text, so only the template's own pad (the family's ``image_slots.pad``) can become an
   image slot;
4. expand each single pad into the image's planned ``num_tokens`` copies, between the slot's start
   and end tokens (written by the template, or here where the family says so), recording offsets;
5. check the prompt against ``max_input_tokens`` and prompt + max_tokens against max_model_len:
   every limit is checked before the first decode, and ``count`` (/tokenize) stops here;
6. decode and preprocess each image with its plan's pixel bounds (patchify), hash its pixels;
7. compute M-RoPE positions (the model family's), build SamplingParams, stamp the end of
   preprocessing.

Every refusal is an ``InputError`` (or the image layer's ``ImageInputError``); both are ValueErrors
whose message is safe to show the client. Nothing here knows any API's request schema.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from firsttoken.config import GenerationDefaults, ImageConfig, VideoConfig
from firsttoken.inputs.draft import PromptPlan, TokenCount
from firsttoken.inputs.errors import InputError
from firsttoken.inputs.limits import PromptLimits
from firsttoken.inputs.media import MediaNetwork
from firsttoken.inputs.mm_hash import ProcessedImageCache
from firsttoken.inputs.prompt import ChatPrompt, Prompt, SamplingRequest, TextPrompt, TokenPrompt
from firsttoken.inputs.render import PromptRenderer
from firsttoken.inputs.sampling import MAX_STOP_TOKEN_IDS, or_default, sampling_params
from firsttoken.inputs.text_size import longest_token_chars
from firsttoken.inputs.vision_items import VisionItems
from firsttoken.models.model_config import ModelConfig
from firsttoken.models.registry import family_named
from firsttoken.structured import CompiledGrammar, GrammarCompiler, GrammarSpec
from firsttoken.types import AdmissionVerdict, EngineRequest, PromptWork

__all__ = [
    "MAX_STOP_TOKEN_IDS",
    "Draft",
    "InputError",
    "InputProcessor",
    "TokenCount",
    "load_tokenizer",
]


@dataclass(frozen=True)
class Draft:
    """A request planned from its text and its images' headers, every limit checked, nothing
    decoded: what the engine's admission is asked about."""

    prompt: PromptPlan
    sampling: SamplingRequest
    param: str  # the prompt's request field (messages, prompt, input)
    room: int  # tokens the context leaves for output after this prompt (its limits passed)
    # (the compiled output grammar, seconds this request spent compiling it)
    grammar: tuple[CompiledGrammar, float] | None = None


def load_tokenizer(
    model_dir: str | Path, chat_template: Path | None = None
) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer; ``chat_template`` (a Jinja file) replaces the checkpoint's
    template."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if chat_template is not None:
        tokenizer.chat_template = Path(chat_template).read_text()
    return tokenizer


class InputProcessor:
    """Thread-safe after construction: tokenizers encode concurrently, and nothing here mutates
    state."""

    def __init__(
        self,
        model_dir_or_tokenizer: str | Path | PreTrainedTokenizerBase,
        model_config: ModelConfig,
        generation_defaults: GenerationDefaults,
        *,
        max_model_len: int,
        images: ImageConfig = ImageConfig(),
        videos: VideoConfig = VideoConfig(),
        media_network: MediaNetwork | None = None,
        image_cache_bytes: int = 256 * 1024**2,
    ) -> None:
        if isinstance(model_dir_or_tokenizer, (str, Path)):
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir_or_tokenizer))
        else:
            tokenizer = model_dir_or_tokenizer
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.family = family_named(model_config.family)
        self.generation_defaults = generation_defaults
        self.images = images
        self.renderer = PromptRenderer(tokenizer, model_config)
        self.vision = VisionItems(model_config, images, videos, media_network, image_cache_bytes)
        self.limits = PromptLimits(
            max_model_len,
            images.max_input_tokens,
            self.renderer.encode_text,
            longest_token_chars(list(tokenizer.get_vocab())),
        )
        self._special_ids = frozenset(tokenizer.all_special_ids) | frozenset(
            tokenizer.added_tokens_decoder
        )
        # built on first use, or by warm_grammars()
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    @property
    def max_input_tokens(self) -> int | None:
        """Prompt tokens (text + image + template) a request may bring; None: only the context
        limit applies."""
        return self.limits.max_input_tokens

    @property
    def image_cache(self) -> ProcessedImageCache:
        return self.vision.cache

    # ---- the pipeline ----------------------------------------------------------------------------
    def process(
        self, prompt: Prompt, sampling: SamplingRequest, request_id: str, arrival_s: float
    ) -> EngineRequest:
        """The EngineRequest for ``prompt``, admission not asked (the offline API, tools)."""
        return self.finish(self.draft(prompt, sampling), request_id, arrival_s)

    def draft(self, prompt: Prompt, sampling: SamplingRequest) -> Draft:
        """Steps 1-5: every limit checked before any image is decoded, and the output grammar
        compiled (or found compiled) before the request asks for a place in the queue."""
        # fail fast, before any image is loaded
        sampling_params(sampling, or_default(sampling.max_tokens, 1), self.generation_defaults,
                        self.model_config)
        self.limits.check_text(prompt.texts(), self.limits.max_prompt_tokens, prompt.param)
        grammar = self._grammar(sampling.structured)
        plan = self._plan(prompt)
        return Draft(plan, sampling, prompt.param, self._room(plan, sampling, prompt.param), grammar)

    def lowered(self, draft: Draft, budget: int) -> Draft:
        """The same draft with each degradable image's budget capped at ``budget`` (from headers:
        nothing decoded)."""
        prompt = draft.prompt
        budgets = [min(p.budget_tokens, budget) if d else p.budget_tokens
                   for p, d in zip(prompt.plans, prompt.degradable)]
        plans = self.vision.replan(prompt.blobs, budgets, prompt.params)
        lower = self.renderer.expand(prompt.template_ids, plans, prompt.blobs, prompt.videos,
                                     prompt.degradable, prompt.params)
        # a lower budget leaves more room
        return replace(draft, prompt=lower, room=self._room(lower, draft.sampling, draft.param))

    def work(self, draft: Draft) -> PromptWork:
        """What the draft costs the engine (tokens and encoder units): what admission prices."""
        return self.vision.work(draft.prompt)

    def finish(self, draft: Draft, request_id: str, arrival_s: float,
               verdict: AdmissionVerdict | None = None, note: str | None = None) -> EngineRequest:
        """Steps 6-7, once admitted (``verdict``; ``note``: why the image budget was lowered)."""
        prompt, sampling = draft.prompt, draft.sampling
        params = sampling_params(sampling, or_default(sampling.max_tokens, draft.room),
                                 self.generation_defaults, self.model_config)
        if draft.grammar is not None:
            params = replace(params, grammar=draft.grammar[0])
        # the first expensive step: every limit has passed
        items, image_grids, video_grids = self.vision.decode(prompt)
        mrope = self.family.positions(
            prompt.token_ids, image_grids, self.model_config, video_grid_thw=video_grids,
            second_per_grid_ts=[v.plan.seconds_per_grid for v in prompt.videos])
        return EngineRequest(
            request_id=request_id,
            prompt_token_ids=prompt.token_ids,
            images=tuple(items),
            mrope_positions=mrope.positions,
            mrope_delta=mrope.delta,
            sampling=params,
            arrival_s=arrival_s,
            preprocessed_s=time.monotonic(),
            predicted_ttft_s=verdict.predicted_ttft_s if verdict is not None else None,
            long_place_s=verdict.long_place_s if verdict is not None else None,
            image_budget_note=note,
            grammar_compile_s=draft.grammar[1] if draft.grammar is not None else 0.0,
        )

    # ---- the rest of the public surface ----------------------------------------------------------
    def count(self, prompt: Prompt) -> TokenCount:
        """What /tokenize reports, with what the prompt would cost the engine; text that cannot fit
        the context at all is refused before tokenizing it."""
        self.limits.check_text(prompt.texts(), self.max_model_len, prompt.param)
        plan = self._plan(prompt)
        return TokenCount.of(plan, self.vision.work(plan))

    def warm_grammars(self) -> None:
        """Build the grammar compiler's view of the vocabulary now (seconds at a 151k vocabulary),
        so the first constrained request does not wait for it."""
        self._grammars()

    def encode_prompt(self, text: str) -> tuple[int, ...]:
        """A raw prompt: chat control tokens are honoured, vision control tokens are plain text."""
        return self.renderer.raw(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        """A prompt given as token ids, as text (what echo returns for it)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def token_piece(self, token_id: int) -> tuple[str, list[int]]:
        """(text, bytes) of one token for logprobs: byte-level pieces are mapped back to their raw
        bytes."""
        token = self.tokenizer.convert_ids_to_tokens(token_id)
        if token is None:
            return "", []
        if token_id in self._special_ids:
            return token, list(token.encode())
        decoder = _byte_decoder()
        if all(ch in decoder for ch in token):
            raw = bytes(decoder[ch] for ch in token)
            return raw.decode("utf-8", errors="replace"), list(raw)
        return token, list(token.encode())

    # ---- steps -----------------------------------------------------------------------------------
    def _plan(self, prompt: Prompt) -> PromptPlan:
        """Steps 2-4: token ids with every image's and video's pads expanded to its plan."""
        if isinstance(prompt, TextPrompt):
            return PromptPlan(self.renderer.raw(prompt.text), (), (), ())
        if isinstance(prompt, TokenPrompt):
            return PromptPlan(self.renderer.token_ids(prompt), (), (), ())
        return self._chat_plan(prompt)

    def _chat_plan(self, prompt: ChatPrompt) -> PromptPlan:
        images, videos = self.vision.plan(prompt)
        template_ids = self.renderer.chat(prompt)
        return self.renderer.expand(template_ids, images.plans, images.blobs, videos,
                                    images.degradable, images.params)

    def _room(self, plan: PromptPlan, sampling: SamplingRequest, param: str) -> int:
        """Step 5: the prompt's final length against the limits; the room it leaves for output."""
        return self.limits.room(plan, sampling.name("max_tokens"), sampling.max_tokens, param)

    def _grammars(self) -> GrammarCompiler:
        with self._grammar_lock:
            if self._grammar_compiler is None:
                eos = self.generation_defaults.eos_token_ids or self.model_config.eos_token_ids
                self._grammar_compiler = GrammarCompiler.from_tokenizer_json(
                    self.tokenizer.backend_tokenizer.to_str(),
                    self.model_config.vocab_size,
                    tuple(eos),
                )
            return self._grammar_compiler

    def _grammar(self, spec: GrammarSpec | None) -> tuple[CompiledGrammar, float] | None:
        """(the compiled grammar, seconds this request spent compiling it: 0 from the cache);
        InputError naming the field for a spec that does not compile."""
        if spec is None:
            return None
        try:
            compiled, cached = self._grammars().lookup(spec)
        except ValueError as err:
            # the top-level field (response_format, structured_outputs), or the Responses API's
            # text.format
            field = (
                "text.format"
                if spec.origin.startswith("text.format")
                else spec.origin.split(".", 1)[0]
            )
            raise InputError(str(err), field or None) from None
        return compiled, 0.0 if cached else compiled.compile_s


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: printable stand-in character -> raw byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    byte_to_char = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in byte_to_char:
            byte_to_char[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in byte_to_char.items()}
