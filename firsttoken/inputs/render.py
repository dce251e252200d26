"""Rendering: a prompt as token ids. The chat template with its tools, the template's one pad per
image and video expanded to the planned visual tokens, and control tokens sanitized: special-token
strings typed by a client (an image pad, ``<|im_start|>`` ...) are encoded as ordinary text, so only
the template's own pad can become an image slot. Which strings mark a slot, and whether the template
or the renderer writes the start and end tokens around its pads, is the family's declaration
(``ModelFamily.image_slots``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from firsttoken.inputs.budget import ImagePlan
from firsttoken.inputs.chat_template import ChatTemplate
from firsttoken.inputs.draft import PlannedVideo, PromptPlan
from firsttoken.inputs.errors import InputError
from firsttoken.inputs.prompt import (
    ChatPrompt,
    ImagePart,
    Message,
    TokenPrompt,
    VideoPart,
)
from firsttoken.inputs.tool_prompts import (
    function_json,
    hermes_messages,
    template_messages,
)
from firsttoken.models.family import ImageSlots
from firsttoken.models.model_config import ModelConfig
from firsttoken.models.registry import family_named
from firsttoken.quoting import quote


class PromptRenderer:
    """Thread-safe: tokenizers encode concurrently, and nothing here mutates state."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, model_config: ModelConfig) -> None:
        if not tokenizer.chat_template:
            raise ValueError("the tokenizer has no chat template")
        self.family = family_named(model_config.family)
        slots = self.family.image_slots
        for token, token_id, noun in _slot_ids(slots, model_config):
            if tokenizer.convert_tokens_to_ids(token) != token_id:
                raise ValueError(f"tokenizer's {token} id differs from config.json's {noun} "
                                 f"({token_id})")
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.chat_template = ChatTemplate(tokenizer)
        # a raw /v1/completions prompt may use the chat control tokens (<|im_start|> ...) but never
        # these: a slot without pixels would reach the vision path
        self._vision_tokens_re = re.compile("(" + "|".join(map(re.escape, slots.control)) + ")")
        # the tokens the renderer writes before and after an image's pads: none where the template
        # writes them
        wraps = slots.renderer_wraps
        self._slot_start = [model_config.vision_start_token_id] if wraps else []
        self._slot_end = [model_config.vision_end_token_id] if wraps else []
        self._template_renders_tools = "tools" in (tokenizer.chat_template or "")
        # token id -> what it is, for the ids a prompt of token ids may not carry
        self._vision_ids = {
            model_config.image_token_id: "image placeholder",
            model_config.video_token_id: "video placeholder",
            model_config.vision_start_token_id: "vision start",
            model_config.vision_end_token_id: "vision end",
        }
        for token in slots.control:  # the family's other vision control tokens (InternVL's <video>)
            token_id = tokenizer.convert_tokens_to_ids(token)
            if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
                self._vision_ids.setdefault(token_id, f"{token} control")

    def raw(self, text: str) -> tuple[int, ...]:
        """A raw prompt: chat control tokens are honoured, vision control tokens are plain text."""
        ids: list[int] = []
        for i, piece in enumerate(self._vision_tokens_re.split(text)):
            if piece:
                ids += self.tokenizer.encode(
                    piece, add_special_tokens=False, split_special_tokens=i % 2 == 1
                )
        return tuple(ids)

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def token_ids(self, prompt: TokenPrompt) -> tuple[int, ...]:
        """A prompt of token ids, each inside the vocabulary and none a vision control token."""
        config, vision = self.model_config, self._vision_ids
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

    def chat(self, prompt: ChatPrompt) -> tuple[int, ...]:
        """The conversation through the chat template, one pad per image and per video; client
        text cannot forge control tokens, image slots included."""
        messages, tools = self._with_tools(prompt)
        try:
            return tuple(self.chat_template.encode(messages, tools, prompt.add_generation_prompt))
        # the template refuses this conversation (its own words)
        except (TemplateError, ValueError) as err:
            raise InputError(
                f"the chat template cannot render these messages: {quote(str(err))}", "messages"
            ) from None

    def expand(self, ids: Sequence[int], plans: Sequence[ImagePlan], blobs: tuple[bytes, ...],
               videos: tuple[PlannedVideo, ...] = (), degradable: tuple[bool, ...] = (),
               params: tuple[str, ...] = ()) -> PromptPlan:
        """Each image's one pad token as its planned pads (between the slot's start and end tokens
        where the family's renderer writes them); each video's as the family's video tokens
        (its grids' pads, and for Qwen3-VL a timestamp per grid), recording where every image and
        every video grid starts. ``degradable`` and ``params``: per image, as PromptPlan keeps
        them."""
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
                out.extend(self._slot_start)
                offsets.append(len(out))
                out.extend([pad] * plan.num_tokens)
                out.extend(self._slot_end)
            elif token_id == video_pad:
                vplan = next(next_video).plan
                tokens = self.family.video_prompt_tokens(
                    vplan.grid_thw, vplan.grid_timestamps(), config, self.encode_text
                )
                t, h, w = vplan.grid_thw
                video_offsets.append(
                    _grid_starts(tokens, video_pad, t, h * w // (merge * merge), len(out))
                )
                out.extend(tokens)
            else:
                out.append(token_id)
        return PromptPlan(tuple(out), tuple(plans), blobs, tuple(offsets), tuple(ids), degradable,
                          params, videos, tuple(video_offsets))

    def _with_tools(
        self, prompt: ChatPrompt
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """(the messages as the chat template sees them, its ``tools``): through the template where
        it renders tools itself, else written into the messages the hermes way (inputs/tool_prompts.py)."""
        if not self._template_renders_tools:
            return [
                _template_message(m) for m in hermes_messages(prompt.messages, prompt.tools)
            ], None
        messages = [_template_message(m) for m in prompt.messages]
        for message, extra in zip(messages, template_messages(prompt.messages) or ()):
            message.update(extra)
        return messages, [function_json(f) for f in prompt.tools] or None


def _slot_ids(slots: ImageSlots, config: ModelConfig) -> tuple[tuple[str, int, str], ...]:
    """(slot token, its id in the config, what the config calls it) for each token the renderer
    writes: the pad, and the start and end where it wraps the pads itself."""
    pad = ((slots.pad, config.image_token_id, "image_token_id"),)
    if not slots.renderer_wraps:
        return pad
    return (*pad, (slots.start, config.vision_start_token_id, "image start token id"),
            (slots.end, config.vision_end_token_id, "image end token id"))


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
