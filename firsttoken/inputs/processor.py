"""Turn an OpenAI request into an EngineRequest: chat template, images, placeholder expansion, positions.

Steps of ``process_chat`` (all CPU work; the server runs it in a thread pool, never on the event loop):

1. check the sampling fields (cheap, before any image is touched) and count the images;
2. load every image's bytes, then probe every header (a bad last image fails before any pixel is decoded);
3. decode and preprocess each image (resize within [min_pixels, max_pixels], patchify), hash its pixels;
4. render the checkpoint's chat template and tokenize it with control tokens sanitized: special-token strings
   typed by a client (``<|image_pad|>``, ``<|im_start|>`` ...) are encoded as ordinary text, so only the
   template's own ``<|vision_start|><|image_pad|><|vision_end|>`` can become an image slot;
5. expand each single ``<|image_pad|>`` into the image's ``num_tokens`` copies, in order, recording offsets;
6. check the prompt fits max_model_len, compute M-RoPE positions, build SamplingParams.

Every refusal is an ``InputError`` (or the image layer's ``ImageInputError``); both are ValueErrors whose
message is safe to show the client. This module reads the request schemas of ``api.protocol`` (a leaf module of
pydantic models) and nothing else of the api package.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from firsttoken.api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, ImagePart
from firsttoken.config import GenerationDefaults, ModelConfig
from firsttoken.engine.detokenizer import IncrementalDetokenizer
from firsttoken.engine.request import EngineRequest, ImageItem, Timeline
from firsttoken.inputs.image import (
    DEFAULT_MAX_PIXELS,
    DEFAULT_MIN_PIXELS,
    ProcessedImage,
    decode_image,
    preprocess_image,
    probe_image,
)
from firsttoken.inputs.media import load_image_bytes
from firsttoken.models.mrope import compute_mrope_positions
from firsttoken.sampling.params import SamplingParams

# Control tokens that mark image/video slots: a raw /v1/completions prompt may use the chat control tokens
# (<|im_start|> ...) but never these, since a slot without pixels would reach the vision path.
VISION_CONTROL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
_SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__)


class InputError(ValueError):
    """A request refused while preparing it. ``str(err)`` is client-safe; ``param`` names the request field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ImageSettings:
    min_pixels: int = DEFAULT_MIN_PIXELS  # resized area floor (smart_resize scales small images up)
    max_pixels: int = DEFAULT_MAX_PIXELS  # resized area ceiling: bounds visual tokens per image
    max_image_pixels: int = 40_000_000  # declared size refused before decoding (decompression bombs)
    max_image_bytes: int = 20 * 1024 * 1024  # encoded size refused before base64-decoding or reading
    max_images_per_prompt: int = 16
    allowed_media_dir: Path | None = None  # local paths / file:// URLs only inside it; None disables them

    def __post_init__(self) -> None:
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError("min_pixels must be > 0 and <= max_pixels")
        if self.max_image_pixels < 1 or self.max_image_bytes < 1:
            raise ValueError("max_image_pixels and max_image_bytes must be >= 1")
        if self.max_images_per_prompt < 0:
            raise ValueError("max_images_per_prompt must be >= 0")


@dataclass(frozen=True)
class ImageTokens:
    original_size: tuple[int, int]  # (width, height) as decoded
    resized_size: tuple[int, int]  # (width, height) after smart_resize
    num_tokens: int  # visual tokens after the 2x2 merge


@dataclass(frozen=True)
class TokenCount:
    """What /tokenize reports: the exact prompt the engine would see, without running the model."""

    token_ids: tuple[int, ...]
    images: tuple[ImageTokens, ...]

    @property
    def total(self) -> int:
        return len(self.token_ids)

    @property
    def num_text_tokens(self) -> int:
        return self.total - sum(im.num_tokens for im in self.images)


@dataclass(frozen=True)
class _Prompt:
    token_ids: tuple[int, ...]  # image pads already expanded
    images: tuple[ProcessedImage, ...]  # content_hash filled
    offsets: tuple[int, ...]  # index of each image's first pad token in token_ids


class InputProcessor:
    """Thread-safe after construction: tokenizers encode concurrently, and nothing here mutates state."""

    def __init__(
        self,
        model_dir_or_tokenizer: str | Path | PreTrainedTokenizerBase,
        model_config: ModelConfig,
        generation_defaults: GenerationDefaults,
        *,
        max_model_len: int,
        images: ImageSettings = ImageSettings(),
    ) -> None:
        if isinstance(model_dir_or_tokenizer, (str, Path)):
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir_or_tokenizer))
        else:
            tokenizer = model_dir_or_tokenizer
        if not tokenizer.chat_template:
            raise ValueError("the tokenizer has no chat template")
        if tokenizer.convert_tokens_to_ids("<|image_pad|>") != model_config.image_token_id:
            raise ValueError("tokenizer's <|image_pad|> id differs from config.json's image_token_id")
        if max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.generation_defaults = generation_defaults
        self.max_model_len = max_model_len
        self.image_settings = images
        self._vision_tokens_re = re.compile("(" + "|".join(map(re.escape, VISION_CONTROL_TOKENS)) + ")")
        self._special_ids = frozenset(tokenizer.all_special_ids) | frozenset(tokenizer.added_tokens_decoder)
        # Decoding through the Rust tokenizer skips the Python wrapper; the detokenizer calls it every token.
        self.decoder = getattr(tokenizer, "backend_tokenizer", None) or tokenizer

    # ------------------------------------------------------------------------------------ public

    def process_chat(self, req: ChatCompletionRequest, request_id: str, timeline: Timeline) -> EngineRequest:
        field, requested = req.requested_max_tokens
        self._sampling_params(req, _or(requested, 1), field)  # fail fast, before any image is loaded
        prompt = self._chat_prompt(req.messages, add_generation_prompt=True)
        return self._engine_request(req, prompt, request_id, timeline, prompt_param="messages")

    def process_completion(self, req: CompletionRequest, request_id: str, timeline: Timeline) -> EngineRequest:
        self._sampling_params(req, _or(req.max_tokens, 1), "max_tokens")
        prompt = _Prompt(self.encode_prompt(req.prompt), (), ())
        return self._engine_request(req, prompt, request_id, timeline, prompt_param="prompt")

    def count_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> TokenCount:
        return _count(self._chat_prompt(messages, add_generation_prompt))

    def count_prompt(self, prompt: str) -> TokenCount:
        return TokenCount(self.encode_prompt(prompt), ())

    def encode_prompt(self, text: str) -> tuple[int, ...]:
        """A raw prompt: chat control tokens are honoured, vision control tokens are plain text."""
        ids: list[int] = []
        for i, piece in enumerate(self._vision_tokens_re.split(text)):
            if piece:
                ids += self.tokenizer.encode(piece, add_special_tokens=False, split_special_tokens=i % 2 == 1)
        return tuple(ids)

    def new_detokenizer(self, request: EngineRequest) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.decoder, request.prompt_token_ids, request.sampling.stop)

    def token_piece(self, token_id: int) -> tuple[str, list[int]]:
        """(text, bytes) of one token for logprobs: byte-level pieces are mapped back to their raw bytes."""
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

    def _chat_prompt(self, messages: Sequence[ChatMessage], add_generation_prompt: bool) -> _Prompt:
        image_parts = [
            part for m in messages if isinstance(m.content, list) for part in m.content if isinstance(part, ImagePart)
        ]
        limit = self.image_settings.max_images_per_prompt
        if len(image_parts) > limit:
            raise InputError(f"too many images: {len(image_parts)}, the limit is {limit} per request", "messages")
        images = self._load_images([p.image_url.url for p in image_parts])
        template_ids = self.tokenizer.apply_chat_template(
            [_template_message(m) for m in messages],
            tokenize=True,
            add_generation_prompt=add_generation_prompt,
            sanitize_control_tokens=True,  # client text can't forge control tokens, image slots included
            return_dict=False,
        )
        return self._expand_image_pads(list(template_ids), images)

    def _load_images(self, urls: Sequence[str]) -> tuple[ProcessedImage, ...]:
        s = self.image_settings
        blobs = [load_image_bytes(url, s.allowed_media_dir, s.max_image_bytes) for url in urls]
        for data in blobs:
            probe_image(data, s.max_image_pixels)
        out = []
        for data in blobs:
            image = preprocess_image(
                decode_image(data, s.max_image_pixels), self.model_config.vision, s.min_pixels, s.max_pixels
            )
            out.append(replace(image, content_hash=_content_hash(image)))
        return tuple(out)

    def _expand_image_pads(self, ids: list[int], images: Sequence[ProcessedImage]) -> _Prompt:
        pad = self.model_config.image_token_id
        num_pads = ids.count(pad)
        if num_pads != len(images):  # the template and our image list disagree: a bug, never the client's
            raise RuntimeError(f"chat template produced {num_pads} image slots for {len(images)} images")
        out: list[int] = []
        offsets: list[int] = []
        next_image = iter(images)
        for token_id in ids:
            if token_id != pad:
                out.append(token_id)
                continue
            image = next(next_image)
            offsets.append(len(out))
            out.extend([pad] * image.num_tokens)
        return _Prompt(tuple(out), tuple(images), tuple(offsets))

    def _engine_request(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        prompt: _Prompt,
        request_id: str,
        timeline: Timeline,
        prompt_param: str,
    ) -> EngineRequest:
        prompt_len = len(prompt.token_ids)
        room = self.max_model_len - prompt_len
        if room < 1:
            raise InputError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has {prompt_len} "
                f"(including image tokens), which leaves no room for output",
                prompt_param,
            )
        field, requested = req.requested_max_tokens
        if requested is not None and requested > room:
            raise InputError(
                f"this model's maximum context length is {self.max_model_len} tokens; you requested "
                f"{prompt_len + requested} ({prompt_len} in the prompt, {requested} for the output). "
                f"Reduce the prompt or {field}.",
                field,
            )
        sampling = self._sampling_params(req, _or(requested, room), field)
        mrope = compute_mrope_positions(prompt.token_ids, [im.grid_thw for im in prompt.images], self.model_config)
        items = tuple(
            ImageItem(
                content_hash=im.content_hash or "",
                offset=offset,
                num_tokens=im.num_tokens,
                grid_thw=im.grid_thw,
                pixel_values=im.pixel_values,
            )
            for im, offset in zip(prompt.images, prompt.offsets)
        )
        timeline.mark("preprocessed_s")
        return EngineRequest(
            request_id=request_id,
            prompt_token_ids=prompt.token_ids,
            images=items,
            mrope_positions=mrope.positions,
            mrope_delta=mrope.delta,
            sampling=sampling,
            timeline=timeline,
        )

    def _sampling_params(
        self, req: ChatCompletionRequest | CompletionRequest, max_tokens: int, max_tokens_field: str
    ) -> SamplingParams:
        """Request values over the checkpoint's generation_config defaults. ValueError -> InputError(param)."""
        d = self.generation_defaults
        if isinstance(req, ChatCompletionRequest):
            if req.top_logprobs and not req.logprobs:
                raise InputError("top_logprobs requires logprobs to be true", "top_logprobs")
            logprobs, top_logprobs = req.logprobs, req.top_logprobs or 0
        else:
            logprobs, top_logprobs = req.logprobs is not None, req.logprobs or 0
        eos = d.eos_token_ids or self.model_config.eos_token_ids
        values: dict[str, Any] = dict(
            max_tokens=max_tokens,
            temperature=_or(req.temperature, d.temperature),
            top_p=_or(req.top_p, d.top_p),
            top_k=_or(req.top_k, d.top_k),
            seed=req.seed,
            stop=req.stop_strings,
            stop_token_ids=tuple(dict.fromkeys((*eos, *(req.stop_token_ids or ())))),
            ignore_eos=req.ignore_eos,
            presence_penalty=_or(req.presence_penalty, 0.0),
            frequency_penalty=_or(req.frequency_penalty, 0.0),
            repetition_penalty=_or(req.repetition_penalty, d.repetition_penalty),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
        )
        try:
            return SamplingParams(**values)
        except ValueError as err:
            name = str(err).split(" ", 1)[0]
            if name not in _SAMPLING_FIELDS:
                raise InputError(str(err)) from None
            param = max_tokens_field if name == "max_tokens" else name
            raise InputError(f"{param}{str(err)[len(name) :]}, got {values[name]}", param) from None


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """The dict the chat template sees. Image parts carry no URL: the template only needs to know one is there."""
    if message.content is None or isinstance(message.content, str):
        return {"role": message.role, "content": message.content or ""}
    parts = [
        {"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": p.text} for p in message.content
    ]
    return {"role": message.role, "content": parts}


def _content_hash(image: ProcessedImage) -> str:
    """Identifies the pixels the vision tower will see: resized pixel values + patch grid."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(image.grid_thw).encode())
    h.update(image.pixel_values.contiguous().numpy())
    return h.hexdigest()


def _count(prompt: _Prompt) -> TokenCount:
    images = tuple(ImageTokens(im.original_size, im.resized_size, im.num_tokens) for im in prompt.images)
    return TokenCount(prompt.token_ids, images)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: printable stand-in character -> raw byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    byte_to_char = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in byte_to_char:
            byte_to_char[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in byte_to_char.items()}
