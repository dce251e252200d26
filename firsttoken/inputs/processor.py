"""Turn a prompt (inputs/prompt.py) into an EngineRequest: chat template, images, placeholder
expansion, positions.

Steps of ``process`` (all CPU work; the server runs it in a thread pool, never on the event loop):

1. check the sampling fields (cheap, before any image is touched), measure the text against the
   token limit from its length and, only if that cannot decide, in pieces with an early exit
   (``inputs/text_size.py``: a huge prompt is refused without being tokenized whole), count the
   images against the limit and resolve each image's visual-token budget (``detail``,
   ``max_visual_tokens``; never above the server's cap);
2. load every image's bytes, then probe every header and plan its resize from the declared size
   alone (``inputs/budget.py``): pixel limit, aspect ratio and visual tokens are known before any
   pixel is decoded;
3. render the checkpoint's chat template and tokenize it with control tokens sanitized:
   special-token strings typed by a client (``<|image_pad|>``, ``<|im_start|>`` ...) are encoded as
   ordinary text, so only the template's own ``<|vision_start|><|image_pad|><|vision_end|>`` can
   become an image slot;
4. expand each single ``<|image_pad|>`` into the image's planned ``num_tokens`` copies, recording
   offsets;
5. check the prompt against ``max_input_tokens`` and prompt + max_tokens against max_model_len:
   every limit is checked before the first decode, and ``count`` (/tokenize) stops here;
6. decode and preprocess each image with its plan's pixel bounds (patchify), hash its pixels;
7. compute M-RoPE positions (the model family's), build SamplingParams, stamp the end of
   preprocessing.

Every refusal is an ``InputError`` (or the image layer's ``ImageInputError``); both are ValueErrors
whose message is safe to show the client. Nothing here knows any API's request schema.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from firsttoken.config import GenerationDefaults, ImageConfig, VideoConfig
from firsttoken.inputs.budget import BudgetError, ImagePlan, image_budget, plan_image
from firsttoken.inputs.chat_template import ChatTemplate
from firsttoken.inputs.image import (
    ImageInputError,
    ProcessedImage,
    decode_image,
    preprocess_image,
    probe_image,
)
from firsttoken.inputs.media import MediaNetwork, load_image_bytes, load_video_bytes, remote_media
from firsttoken.inputs.mm_hash import (
    ProcessedImageCache,
    grid_content_hashes,
    pixel_content_hash,
    raw_bytes_key,
    video_bytes_key,
)
from firsttoken.inputs.video import (
    VideoAsk,
    VideoHeader,
    VideoIndex,
    VideoInputError,
    VideoPlan,
    decode_frame_list,
    decode_video,
    plan_frame_list,
    plan_video_bytes,
)
from firsttoken.inputs.video_pixels import grid_rows, video_pixel_values
from firsttoken.inputs.prompt import (
    ChatPrompt,
    ImagePart,
    Message,
    Prompt,
    SamplingRequest,
    TextPrompt,
    TokenPrompt,
    VideoPart,
)
from firsttoken.inputs.text_size import longest_token_chars, measure_text
from firsttoken.inputs.tools import function_json, hermes_messages, template_messages
from firsttoken.models.config import ModelConfig
from firsttoken.models.registry import family_named
from firsttoken.quoting import quote
from firsttoken.structured import CompiledGrammar, GrammarCompiler, GrammarSpec
from firsttoken.types import AdmissionVerdict, EngineRequest, ImageItem, PromptWork, SamplingParams

# Control tokens that mark image/video slots: a raw /v1/completions prompt may use the chat control
# tokens (<|im_start|> ...) but never these, since a slot without pixels would reach the vision
# path.
VISION_CONTROL_TOKENS = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
_SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__)
# stop_token_ids a request may add (each generated token is checked against them all)
MAX_STOP_TOKEN_IDS = 64


class AdmissionRefused(Exception):
    """The engine would not queue this request now (lane full) or ever (never fits); carries the
    verdict."""

    def __init__(self, verdict: AdmissionVerdict, param: str = "messages") -> None:
        super().__init__(verdict.message)
        self.verdict = verdict
        self.param = param  # the prompt's request field (messages, prompt, input)


class InputError(ValueError):
    """A request refused while preparing it. ``str(err)`` is client-safe; ``param`` names the
    request field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ImageTokens:
    original_size: tuple[int, int]  # (width, height) as decoded
    resized_size: tuple[int, int]  # (width, height) after smart_resize
    num_tokens: int  # visual tokens after the 2x2 merge
    budget_tokens: int  # the budget the image was planned under


@dataclass(frozen=True)
class VideoTokens:
    """A video as planned from its container's header and packets (nothing decoded)."""

    original_size: tuple[int, int]  # (width, height)
    resized_size: tuple[int, int]  # (width, height) of every sampled frame
    duration_s: float  # source frames / source fps
    source_frames: int
    num_frames: int  # frames sampled (an even count)
    sample_fps: float
    num_tokens: int  # grids x tokens per grid
    budget_tokens: int


@dataclass(frozen=True)
class TokenCount:
    """What /tokenize reports: the exact prompt the engine would see, without running the model."""

    token_ids: tuple[int, ...]
    images: tuple[ImageTokens, ...]
    # if it were sent now (None: the engine has no cost model yet)
    predicted_ttft_s: float | None = None
    videos: tuple[VideoTokens, ...] = ()

    @property
    def total(self) -> int:
        return len(self.token_ids)

    @property
    def num_text_tokens(self) -> int:
        return (
            self.total
            - sum(im.num_tokens for im in self.images)
            - sum(v.num_tokens for v in self.videos)
        )


@dataclass(frozen=True)
class _Video:
    """A video planned from its header and packets (or its frames' headers), not decoded yet."""

    plan: VideoPlan
    sources: tuple[bytes, ...]  # the container's bytes (one), or each frame's encoded bytes
    header: VideoHeader | None  # None: a frame list
    index: VideoIndex | None
    param: str


@dataclass(frozen=True)
class ProcessedVideo:
    """A video's pixel values [grids * h * w, C * T * P * P], each temporal grid's rows (views of
    them) and content hash."""

    pixel_values: torch.Tensor  # what the processed-media cache sizes it by
    grid_thw: tuple[int, int, int]
    grids: tuple[torch.Tensor, ...]
    grid_hashes: tuple[str, ...]


@dataclass(frozen=True)
class _Prompt:
    """A prompt whose length is final but whose images are not decoded yet."""

    token_ids: tuple[int, ...]  # image pads already expanded to each plan's num_tokens
    plans: tuple[ImagePlan, ...]
    blobs: tuple[bytes, ...]  # each image's encoded bytes, header already probed
    offsets: tuple[int, ...]  # index of each image's first pad token in token_ids
    # before expansion: one pad per image (re-expanded when the budget drops)
    template_ids: tuple[int, ...] = ()
    # per image: the client left its budget to the server (no detail, no cap)
    degradable: tuple[bool, ...] = ()
    params: tuple[str, ...] = ()  # per image: its request field, messages[i].content[j].image_url
    videos: tuple[_Video, ...] = ()
    # per video, the index of each temporal grid's first pad token
    video_offsets: tuple[tuple[int, ...], ...] = ()

    @property
    def num_image_tokens(self) -> int:
        return sum(p.num_tokens for p in self.plans)

    @property
    def num_video_tokens(self) -> int:
        return sum(v.plan.num_tokens for v in self.videos)


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
        admission: Callable[[PromptWork, str | None], AdmissionVerdict] | None = None,
        image_cache_bytes: int = 256 * 1024**2,
    ) -> None:
        if isinstance(model_dir_or_tokenizer, (str, Path)):
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir_or_tokenizer))
        else:
            tokenizer = model_dir_or_tokenizer
        if not tokenizer.chat_template:
            raise ValueError("the tokenizer has no chat template")
        if tokenizer.convert_tokens_to_ids("<|image_pad|>") != model_config.image_token_id:
            raise ValueError(
                "tokenizer's <|image_pad|> id differs from config.json's image_token_id"
            )
        if max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        self.tokenizer = tokenizer
        self.chat_template = ChatTemplate(tokenizer)
        self.model_config = model_config
        self.family = family_named(model_config.family)
        self.generation_defaults = generation_defaults
        self.max_model_len = max_model_len
        # Prompt tokens (text + image + template) a request may bring; None: only the context limit
        # applies.
        self.max_input_tokens = images.max_input_tokens
        # Asked with the exact prompt length once it is known from headers + tokenization, before
        # any image is decoded: a full lane (429) or a prompt that can never fit (400) costs no
        # decode work.
        self.admission = admission
        # A follow-up turn re-sends the same image bytes: skip decode + resize + patchify for them.
        self.image_cache = ProcessedImageCache(image_cache_bytes)
        self.images = images
        self.videos = videos
        # http(s) image URLs: off unless the config lists domains; ``media_network`` is the test
        # seam
        self.remote = remote_media(
            images.allowed_media_domains, images.media_fetch_timeout_s, media_network
        )
        self._vision_tokens_re = re.compile(
            "(" + "|".join(map(re.escape, VISION_CONTROL_TOKENS)) + ")"
        )
        self._special_ids = frozenset(tokenizer.all_special_ids) | frozenset(
            tokenizer.added_tokens_decoder
        )
        # The most characters one token covers: text longer than limit x this is refused
        # untokenized.
        self.max_chars_per_token = longest_token_chars(list(tokenizer.get_vocab()))
        # built on first use, or by warm_grammars()
        self._grammar_compiler: GrammarCompiler | None = None
        self._template_renders_tools = "tools" in (tokenizer.chat_template or "")
        self._grammar_lock = threading.Lock()

    # ------------------------------------------------------------------------------------ public

    def process(
        self, prompt: Prompt, sampling: SamplingRequest, request_id: str, arrival_s: float
    ) -> EngineRequest:
        """The EngineRequest for ``prompt``: every limit is checked before any image is decoded, and
        its output grammar compiled (or found compiled) before it asks for a place in the queue."""
        # fail fast, before any image is loaded
        self._sampling_params(sampling, _or(sampling.max_tokens, 1))
        self._check_text_size(prompt.texts(), self._max_prompt_tokens, prompt.param)
        grammar = self._grammar(sampling.structured)
        return self._engine_request(
            prompt, self._prompt_ids(prompt), sampling, request_id, arrival_s, grammar
        )

    def warm_grammars(self) -> None:
        """Build the grammar compiler's view of the vocabulary now (seconds at a 151k vocabulary),
        so the first constrained request does not wait for it."""
        self._grammars()

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

    def count(self, prompt: Prompt) -> TokenCount:
        """What /tokenize reports; text that cannot fit the context at all is refused before
        tokenizing it."""
        self._check_text_size(prompt.texts(), self.max_model_len, prompt.param)
        ids = self._prompt_ids(prompt)
        predicted = (
            self.admission(self._work(ids), None).predicted_ttft_s
            if self.admission is not None
            else None
        )
        return replace(_count(ids), predicted_ttft_s=predicted)

    def encode_prompt(self, text: str) -> tuple[int, ...]:
        """A raw prompt: chat control tokens are honoured, vision control tokens are plain text."""
        ids: list[int] = []
        for i, piece in enumerate(self._vision_tokens_re.split(text)):
            if piece:
                ids += self.tokenizer.encode(
                    piece, add_special_tokens=False, split_special_tokens=i % 2 == 1
                )
        return tuple(ids)

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

    # ------------------------------------------------------------------------------------ steps

    @property
    def _max_prompt_tokens(self) -> int:
        """The longest prompt a generation request may bring: its input limit, and room for one
        output token."""
        room = self.max_model_len - 1
        return room if self.max_input_tokens is None else min(self.max_input_tokens, room)

    def _check_text_size(self, texts: Sequence[str], limit: int, param: str) -> None:
        """Refuse text that certainly has more than ``limit`` tokens, tokenizing no more of it than
        that takes."""
        size = measure_text(
            texts,
            limit,
            lambda piece: self.tokenizer.encode(piece, add_special_tokens=False),
            self.max_chars_per_token,
        )
        if size.min_tokens <= limit:
            return
        if self.max_input_tokens is not None and self.max_input_tokens <= limit:
            bound = f"this server accepts at most {self.max_input_tokens} input tokens"
        else:
            bound = f"this model's maximum context length is {self.max_model_len} tokens"
        raise InputError(
            f"the prompt's text alone has at least {size.min_tokens} tokens ({size.num_chars} characters); "
            f"{bound}. Shorten the text.",
            param,
        )

    def _prompt_ids(self, prompt: Prompt) -> _Prompt:
        if isinstance(prompt, TextPrompt):
            return _Prompt(self.encode_prompt(prompt.text), (), (), ())
        if isinstance(prompt, TokenPrompt):
            return _Prompt(self._checked_ids(prompt), (), (), ())
        return self._chat_prompt(prompt)

    def _checked_ids(self, prompt: TokenPrompt) -> tuple[int, ...]:
        config = self.model_config
        vision = {
            config.image_token_id: "image placeholder",
            config.video_token_id: "video placeholder",
            config.vision_start_token_id: "vision start",
            config.vision_end_token_id: "vision end",
        }
        for i, t in enumerate(prompt.token_ids):
            if not 0 <= t < config.vocab_size:
                raise InputError(f"token id {t} at {i} is outside this model's vocabulary (0 to "
                                 f"{config.vocab_size - 1})", prompt.param)
            if t in vision:
                raise InputError(
                    f"token id {t} at {i} is the checkpoint's {vision[t]} token; a prompt of token ids "
                    "carries no images (send images as image_url parts to /v1/chat/completions)",
                    prompt.param,
                )
        return prompt.token_ids

    def _chat_prompt(self, prompt: ChatPrompt) -> _Prompt:
        image_parts = _parts_of(prompt, ImagePart, lambda part: "image_url")
        limit = self.images.max_images_per_request
        if len(image_parts) > limit:  # named: the first image over the limit
            raise InputError(
                f"too many images: {len(image_parts)} in this request, the limit is {limit} per request; "
                f"send at most {limit} images",
                image_parts[limit][0],
            )
        video_parts = _parts_of(prompt, VideoPart, _video_field)
        if len(video_parts) > self.videos.max_videos_per_request:
            limit = self.videos.max_videos_per_request
            raise InputError(f"too many videos: {len(video_parts)} in this request, the limit is {limit} per request; "
                             f"send at most {limit}", video_parts[limit][0])
        budgets = [self._budget_of(param, part) for param, part in image_parts]
        params = tuple(param for param, _ in image_parts)
        blobs = tuple(self._loaded(part, i, params) for i, (_, part) in enumerate(image_parts))
        plans = self._plan_images(blobs, budgets, params)
        videos = tuple(self._plan_video(part, param) for param, part in video_parts)
        messages, tools = self._with_tools(prompt)
        try:  # client text can't forge control tokens, image slots included
            template_ids = self.chat_template.encode(messages, tools, prompt.add_generation_prompt)
        # the template refuses this conversation (its own words)
        except (TemplateError, ValueError) as err:
            raise InputError(
                f"the chat template cannot render these messages: {quote(str(err))}", "messages"
            ) from None
        degradable = tuple(
            part.detail is None and part.max_visual_tokens is None for _, part in image_parts
        )
        return replace(
            self._expand_pads(list(template_ids), plans, blobs, videos),
            degradable=degradable,
            params=params,
        )

    def _with_tools(
        self, prompt: ChatPrompt
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """(the messages as the chat template sees them, its ``tools``): through the template where
        it renders tools itself, else written into the messages the hermes way (inputs/tools.py)."""
        if not self._template_renders_tools:
            return [
                _template_message(m) for m in hermes_messages(prompt.messages, prompt.tools)
            ], None
        messages = [_template_message(m) for m in prompt.messages]
        for message, extra in zip(messages, template_messages(prompt.messages) or ()):
            message.update(extra)
        return messages, [function_json(f) for f in prompt.tools] or None

    def _budget_of(self, param: str, part: ImagePart) -> int:
        try:
            return image_budget(self.images, part.detail, part.max_visual_tokens, param)
        except BudgetError as err:
            raise InputError(str(err), err.param) from None

    def _plan_images(
        self, blobs: Sequence[bytes], budgets: Sequence[int], params: Sequence[str]
    ) -> tuple[ImagePlan, ...]:
        """Resize plans from headers only: every size limit fails here, before any decode."""
        s = self.images
        plans = []
        for i, (data, budget) in enumerate(zip(blobs, budgets)):
            try:
                header = probe_image(data, s.max_image_pixels)
                plans.append(
                    plan_image(
                        header.width,
                        header.height,
                        budget,
                        s.image_min_tokens,
                        self.model_config.image_processor,
                    )
                )
            except ImageInputError as err:
                hint = "; downscale it before sending" if err.code == "image_too_large" else ""
                raise _image_at(err, i, params, hint) from None
        return tuple(plans)

    def _loaded(self, part: ImagePart, index: int, params: Sequence[str]) -> bytes:
        try:
            return self._image_bytes(part)
        except ImageInputError as err:
            raise _image_at(err, index, params) from None

    def _image_bytes(self, part: ImagePart) -> bytes:
        s = self.images
        if part.data is None:
            return load_image_bytes(
                part.url or "", s.allowed_media_dir, s.max_image_bytes, self.remote
            )
        if len(part.data) > s.max_image_bytes:
            raise ImageInputError(
                "image_too_large",
                f"image is {len(part.data)} bytes; the limit is {s.max_image_bytes}",
            )
        return part.data

    def _decode_images(self, prompt: _Prompt) -> tuple[ProcessedImage, ...]:
        out = []
        for i, (data, plan) in enumerate(zip(prompt.blobs, prompt.plans)):
            key = raw_bytes_key(data, plan.min_pixels, plan.max_pixels)
            try:
                out.append(self.image_cache.get_or_build(key, lambda: self._decode_one(data, plan)))
            except ImageInputError as err:
                raise _image_at(err, i, prompt.params) from None
        return tuple(out)

    def _decode_one(self, data: bytes, plan: ImagePlan) -> ProcessedImage:
        image = decode_image(data, self.images.max_image_pixels)
        processed = preprocess_image(
            image, self.model_config.image_processor, plan.min_pixels, plan.max_pixels
        )
        if processed.num_tokens != plan.num_tokens:  # the header lied about the size, or a bug
            raise ImageInputError(
                "invalid_image", "image size differs from the size its header declares"
            )
        return replace(processed, content_hash=pixel_content_hash(processed))

    def _expand_pads(self, ids: list[int], plans: Sequence[ImagePlan], blobs: tuple[bytes, ...],
                     videos: tuple[_Video, ...] = ()) -> _Prompt:
        """Each image's one pad token as its planned pads; each video's as the family's video tokens
        (its grids' pads, and for Qwen3-VL a timestamp per grid), recording where every image and
        every video grid starts."""
        config = self.model_config
        pad, video_pad = config.image_token_id, config.video_token_id
        for token, items, noun in ((pad, plans, "image"), (video_pad, videos, "video")):
            num_pads = ids.count(token)
            # the template and our media lists disagree: a bug, never the client's
            if num_pads != len(items):
                raise RuntimeError(
                    f"chat template produced {num_pads} {noun} slots for {len(items)} {noun}s"
                )
        merge = config.vision.spatial_merge_size
        out: list[int] = []
        offsets: list[int] = []
        video_offsets: list[tuple[int, ...]] = []
        next_plan, next_video = iter(plans), iter(videos)
        for token_id in ids:
            if token_id == pad:
                plan = next(next_plan)
                offsets.append(len(out))
                out.extend([pad] * plan.num_tokens)
            elif token_id == video_pad:
                vplan = next(next_video).plan
                tokens = self.family.video_prompt_tokens(
                    vplan.grid_thw, vplan.grid_timestamps(), config, self._encode_text
                )
                t, h, w = vplan.grid_thw
                video_offsets.append(
                    _grid_starts(tokens, video_pad, t, h * w // (merge * merge), len(out))
                )
                out.extend(tokens)
            else:
                out.append(token_id)
        return _Prompt(tuple(out), tuple(plans), blobs, tuple(offsets), tuple(ids), videos=videos,
                       video_offsets=tuple(video_offsets))

    def _encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _plan_video(self, part: VideoPart, param: str) -> _Video:
        """Load a video part's bytes and plan it from its header and packets (a frame list: every
        frame's header); every limit is checked here, before any frame is decoded."""
        limits, proc = self.videos, self.model_config.image_processor
        ask = VideoAsk(part.fps, part.max_frames, part.max_visual_tokens)
        try:
            if part.frames is not None:
                frames = tuple(
                    self._frame_bytes(url, k, len(part.frames)) for k, url in enumerate(part.frames)
                )
                plan = plan_frame_list(
                    frames, limits, proc, ask, self.images.max_image_pixels, param
                )
                return _Video(plan, frames, None, None, param)
            data = part.data if part.data is not None else load_video_bytes(
                part.url or "", self.images.allowed_media_dir, limits.max_video_bytes, self.remote)
            if len(data) > limits.max_video_bytes:
                raise VideoInputError(
                    "video_too_large",
                    f"video is {len(data)} bytes; the limit is {limits.max_video_bytes}",
                )
            header, index, plan = plan_video_bytes(data, limits, proc, ask, param=param)
            return _Video(plan, (data,), header, index, param)
        except BudgetError as err:
            raise InputError(str(err), err.param) from None
        except ImageInputError as err:
            # a VideoInputError stays one
            raise type(err)(err.code, str(err), err.param or param) from None

    def _frame_bytes(self, url: str, k: int, n: int) -> bytes:
        try:
            return load_image_bytes(
                url, self.images.allowed_media_dir, self.images.max_image_bytes, self.remote
            )
        except ImageInputError as err:
            raise VideoInputError(err.code, f"frame {k + 1} of {n}: {err}") from None

    def _decode_videos(self, prompt: _Prompt) -> tuple[ProcessedVideo, ...]:
        return tuple(self._decode_video(v) for v in prompt.videos)

    def _decode_video(self, video: _Video) -> ProcessedVideo:
        plan = video.plan
        key = video_bytes_key(video.sources, plan.frame_indices, plan.resized_size)

        def build() -> ProcessedVideo:
            if video.header is None:
                decoded = decode_frame_list(
                    video.sources, plan, self.videos, self.images.max_image_pixels
                )
            else:
                decoded = decode_video(
                    video.sources[0], video.header, video.index, plan, self.videos
                )
            pixels, grid = video_pixel_values(decoded.frames, self.model_config.image_processor)
            if tuple(grid) != tuple(plan.grid_thw):  # the plan and the pixels disagree: a bug
                raise RuntimeError(f"video decoded to grid {tuple(grid)}, planned {plan.grid_thw}")
            grids = tuple(grid_rows(pixels, grid))
            return ProcessedVideo(
                pixels, plan.grid_thw, grids, grid_content_hashes(grids, grid[1:])
            )

        try:
            return self.image_cache.get_or_build(key, build)  # type: ignore[arg-type,return-value]
        except ImageInputError as err:
            raise type(err)(err.code, str(err), err.param or video.param) from None

    def _check_length(
        self, prompt: _Prompt, field: str, requested: int | None, prompt_param: str
    ) -> int:
        """Room left for output; every message names what was counted, the limit, and what to do."""
        prompt_len = len(prompt.token_ids)
        if prompt_len == 0:  # nothing to condition on (the checkpoint has no BOS token to stand in)
            raise InputError(
                f"{prompt_param} is empty: it has 0 tokens; send at least one token of text",
                prompt_param,
            )
        counted = _describe_counts(prompt)
        advice = (
            "use detail=low or image_url.max_visual_tokens, send fewer images, or shorten the text"
            if prompt.plans
            else "shorten the text"
        )
        if prompt.videos:
            advice = (
                "lower video_url.max_visual_tokens, fps or max_frames, send a shorter clip, or "
                + advice
            )
        if self.max_input_tokens is not None and prompt_len > self.max_input_tokens:
            raise InputError(
                f"the prompt has {prompt_len} tokens ({counted}); this server accepts at most "
                f"{self.max_input_tokens} input tokens. To fit, {advice}.",
                prompt_param,
            )
        room = self.max_model_len - prompt_len
        if room < 1:
            raise InputError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has {prompt_len} "
                f"({counted}), which leaves no room for output. To fit, {advice}.",
                prompt_param,
            )
        if requested is not None and requested > room:
            raise InputError(
                f"this model's maximum context length is {self.max_model_len} tokens; you requested "
                f"{prompt_len + requested} ({prompt_len} in the prompt: {counted}; {requested} for the output). "
                f"Reduce {field} to at most {room}, or {advice}.",
                field,
            )
        return room

    def _engine_request(
        self,
        prompt: Prompt,
        ids: _Prompt,
        sampling: SamplingRequest,
        request_id: str,
        arrival_s: float,
        grammar: tuple[CompiledGrammar, float] | None = None,
    ) -> EngineRequest:
        field = sampling.name("max_tokens")
        self._check_length(ids, field, sampling.max_tokens, prompt.param)
        ids, verdict, note = self._admit(ids, request_id, prompt.param)
        # a lower budget leaves more
        room = self._check_length(ids, field, sampling.max_tokens, prompt.param)
        params = self._sampling_params(sampling, _or(sampling.max_tokens, room))
        if grammar is not None:
            params = replace(params, grammar=grammar[0])
        images = self._decode_images(ids)  # the first expensive step: every limit has passed
        videos = self._decode_videos(ids)
        mrope = self.family.positions(
            ids.token_ids, [im.grid_thw for im in images], self.model_config,
            video_grid_thw=[v.plan.grid_thw for v in ids.videos],
            second_per_grid_ts=[v.plan.seconds_per_grid for v in ids.videos])
        vision = self.model_config.vision
        items = [
            ImageItem(
                content_hash=im.content_hash or "",
                offset=offset,
                num_tokens=im.num_tokens,
                grid_thw=im.grid_thw,
                encoder_units=self.family.encoder_units(vision, im.grid_thw),
                pixel_values=im.pixel_values,
            )
            for im, offset in zip(images, ids.offsets)
        ]
        for v, (video, offsets) in enumerate(zip(videos, ids.video_offsets)):
            _, h, w = video.grid_thw
            units = self.family.encoder_units(vision, (1, h, w))
            items += [
                ImageItem(
                    content_hash=digest,
                    offset=offset,
                    num_tokens=h * w // vision.spatial_merge_size**2,
                    grid_thw=(1, h, w),
                    encoder_units=units,
                    pixel_values=rows,
                    kind="video",
                    video_index=v,
                )
                for rows, digest, offset in zip(video.grids, video.grid_hashes, offsets)
            ]
        items.sort(key=lambda item: item.offset)
        return EngineRequest(
            request_id=request_id,
            prompt_token_ids=ids.token_ids,
            images=tuple(items),
            mrope_positions=mrope.positions,
            mrope_delta=mrope.delta,
            sampling=params,
            arrival_s=arrival_s,
            preprocessed_s=time.monotonic(),
            predicted_ttft_s=verdict.predicted_ttft_s if verdict is not None else None,
            long_place_s=verdict.long_place_s if verdict is not None else None,
            image_budget_note=note,
            grammar_compile_s=grammar[1] if grammar is not None else 0.0,
        )

    def _admit(self, ids: _Prompt, request_id: str, param: str = "messages"
               ) -> tuple[_Prompt, AdmissionVerdict | None, str | None]:
        """Ask the engine whether the prompt may queue. Over its class's TTFT objective, the images
        whose budget the client left to the server are re-planned at half the budget, step by step
        down to --image-min-tokens-under-load, and the engine asked again; still over, or nothing
        left to lower: the 429."""
        if self.admission is None:
            return ids, None, None
        verdict = self.admission(self._work(ids), request_id)
        floor = self.images.image_min_tokens_under_load
        original = max((p.budget_tokens for p, d in zip(ids.plans, ids.degradable) if d), default=0)
        cap = original
        while verdict.asks_lower_budget and cap > floor:
            cap = max(floor, cap // 2)
            ids = self._replan(ids, cap)
            verdict = self.admission(self._work(ids), request_id)
        if not verdict.admitted:
            raise AdmissionRefused(verdict, param)
        note = None
        if cap < original:
            note = (f"visual-token budget lowered from {original} to {cap} per image: the predicted time to first "
                    "token, with its predicted wait counted with the server's margin, was over its objective")
        return ids, verdict, note

    def _replan(self, ids: _Prompt, cap: int) -> _Prompt:
        """The same prompt with each degradable image's budget capped at ``cap`` (from headers:
        nothing decoded)."""
        budgets = [
            min(p.budget_tokens, cap) if d else p.budget_tokens
            for p, d in zip(ids.plans, ids.degradable)
        ]
        plans = self._plan_images(ids.blobs, budgets, ids.params)
        return replace(self._expand_pads(list(ids.template_ids), plans, ids.blobs, ids.videos),
                       degradable=ids.degradable, params=ids.params)

    def _work(self, ids: _Prompt) -> PromptWork:
        """What the prompt costs the engine, from its plans: tokens, and the encoder units of each
        image and of each video grid (one vision item each)."""
        patch, vision = self.model_config.image_processor.patch_size, self.model_config.vision
        grids = [(1, p.resized_size[1] // patch, p.resized_size[0] // patch) for p in ids.plans]
        for v in ids.videos:
            t, h, w = v.plan.grid_thw
            grids += [(1, h, w)] * t
        units = [u for grid in grids for u in self.family.encoder_units(vision, grid)]
        return PromptWork(
            len(ids.token_ids),
            len(grids),
            sum(u.num_patches for u in units),
            float(sum(u.attention_pairs for u in units)),
            len(units),
            num_videos=len(ids.videos),
        )

    def _sampling_params(self, req: SamplingRequest, max_tokens: int) -> SamplingParams:
        """Request values over the checkpoint's generation_config defaults. ValueError ->
        InputError(param)."""
        d = self.generation_defaults
        if req.top_logprobs and not req.logprobs:
            raise InputError("top_logprobs requires logprobs to be true", req.name("top_logprobs"))
        self._check_stop_token_ids(req.stop_token_ids)
        eos = d.eos_token_ids or self.model_config.eos_token_ids
        values: dict[str, Any] = dict(
            max_tokens=max_tokens,
            temperature=_or(req.temperature, d.temperature),
            top_p=_or(req.top_p, d.top_p),
            top_k=_or(req.top_k, d.top_k),
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=tuple(dict.fromkeys(req.stop_token_ids)),
            ignore_eos=req.ignore_eos,
            eos_token_ids=tuple(eos),
            presence_penalty=_or(req.presence_penalty, 0.0),
            frequency_penalty=_or(req.frequency_penalty, 0.0),
            repetition_penalty=_or(req.repetition_penalty, d.repetition_penalty),
            logprobs=req.logprobs,
            top_logprobs=req.top_logprobs,
            logit_bias=self._checked_bias(req.logit_bias),
            prompt_logprobs=req.prompt_logprobs,
        )
        try:
            return SamplingParams(**values)
        except ValueError as err:
            message = str(err)
            name = message.split(" ", 1)[0]
            if name not in _SAMPLING_FIELDS:
                raise InputError(message) from None
            param = req.name(name)
            value = values[name]
            # numbers only, bounded
            got = f", got {quote(value)}" if isinstance(value, (int, float)) else ""
            raise InputError(f"{param}{message[len(name) :]}{got}", param) from None

    def _checked_bias(self, bias: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
        vocab = self.model_config.vocab_size
        for token_id, _ in bias:
            if not 0 <= token_id < vocab:
                raise InputError(f"logit_bias names token {token_id}, not a token id of this model (0 to {vocab - 1})",
                                 "logit_bias")
        return bias

    def _check_stop_token_ids(self, ids: Sequence[int]) -> None:
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise InputError(
                f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}",
                "stop_token_ids",
            )
        vocab = self.model_config.vocab_size
        for i, token_id in enumerate(ids):
            if not 0 <= token_id < vocab:
                raise InputError(
                    f"stop_token_ids[{i}] = {token_id} is not a token id of this model (0 to {vocab - 1})",
                    f"stop_token_ids[{i}]",
                )


def _image_at(
    err: ImageInputError, index: int, params: Sequence[str], hint: str = ""
) -> ImageInputError:
    """``err`` for the request's image ``index``, at whatever stage (load, header, decode): its
    field as the param and, when the request has several images, its position in the message."""
    where = f"image {index + 1} of {len(params)}: " if len(params) > 1 else ""
    return ImageInputError(
        err.code, f"{where}{err}{hint}", params[index] if index < len(params) else None
    )


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _parts_of(prompt: ChatPrompt, kind: type, field: Callable[[Any], str]) -> list[tuple[str, Any]]:
    """(request field, part) of every ``kind`` part in the conversation, in order; ``field(part)``:
    the part's own field, as the request named it."""
    return [
        (f"{prompt.field_of(i)}.content[{j}].{field(part)}", part)
        for i, m in enumerate(prompt.messages)
        if isinstance(m.content, tuple)
        for j, part in enumerate(m.content)
        if isinstance(part, kind)
    ]


def _video_field(part: VideoPart) -> str:
    """A frame list came as the part's ``video`` field, a container as its ``video_url``."""
    return "video" if part.frames is not None else "video_url"


def _template_message(message: Message) -> dict[str, Any]:
    """The dict the chat template sees. Image and video parts carry no URL: the template only needs
    to know one is there."""
    if message.content is None or isinstance(message.content, str):
        return {"role": message.role, "content": message.content or ""}
    parts = [
        {"type": "image"} if isinstance(p, ImagePart)
        else {"type": "video"} if isinstance(p, VideoPart)
        else {"type": "text", "text": p.text}
        for p in message.content
    ]
    return {"role": message.role, "content": parts}


def _grid_starts(
    tokens: Sequence[int], pad: int, num_grids: int, per_grid: int, base: int
) -> tuple[int, ...]:
    """Where each of a video's ``num_grids`` runs of ``per_grid`` pads starts, ``base`` + its index
    in ``tokens`` (the family's video tokens: one run of every grid's pads, or one run per grid
    between timestamps)."""
    starts: list[int] = []
    run = 0
    for i, token in enumerate(tokens):
        if token != pad:
            if run % per_grid:
                raise RuntimeError(f"a run of {run} video pads is not whole grids of {per_grid}")
            run = 0
            continue
        if run % per_grid == 0:
            starts.append(base + i)
        run += 1
    if len(starts) != num_grids or run % per_grid:
        raise RuntimeError(
            f"video tokens hold {len(starts)} grids of {per_grid} pads, planned {num_grids}"
        )
    return tuple(starts)


def _count(prompt: _Prompt) -> TokenCount:
    images = tuple(
        ImageTokens(p.original_size, p.resized_size, p.num_tokens, p.budget_tokens)
        for p in prompt.plans
    )
    videos = tuple(
        VideoTokens(
            p.original_size,
            p.resized_size,
            p.source_frames / p.source_fps,
            p.source_frames,
            p.num_frames,
            p.sample_fps,
            p.num_tokens,
            p.budget_tokens,
        )
        for p in (v.plan for v in prompt.videos)
    )
    return TokenCount(prompt.token_ids, images, videos=videos)


def _describe_counts(prompt: _Prompt) -> str:
    """'52 text and template tokens + 3 images of 1225, 1225, 256 visual tokens + 1 video of 32
    frames, 4096 visual tokens' (what a limit message counts)."""
    num_text = len(prompt.token_ids) - prompt.num_image_tokens - prompt.num_video_tokens
    out = f"{num_text} text and template tokens"
    if prompt.plans:
        per_image = ", ".join(str(p.num_tokens) for p in prompt.plans)
        noun = "image" if len(prompt.plans) == 1 else "images"
        out += f" + {len(prompt.plans)} {noun} of {per_image} visual tokens"
    if prompt.videos:
        per_video = ", ".join(
            f"{v.plan.num_frames} frames, {v.plan.num_tokens} visual tokens" for v in prompt.videos
        )
        noun = "video" if len(prompt.videos) == 1 else "videos"
        out += f" + {len(prompt.videos)} {noun} of {per_video}"
    return out


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
