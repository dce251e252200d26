"""A prompt's size against the server's limits: its text before it is tokenized whole, its final
length (text, template and visual tokens) and the room it leaves for output. Every message names
what was counted, the limit, and what to do."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from firsttoken.inputs.draft import PromptPlan
from firsttoken.inputs.errors import InputError
from firsttoken.inputs.text_size import measure_text


class PromptLimits:
    def __init__(self, max_model_len: int, max_input_tokens: int | None,
                 encode: Callable[[str], list[int]], max_chars_per_token: int) -> None:
        if max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        self.max_model_len = max_model_len
        # prompt tokens (text + image + template) a request may bring; None: only the context
        self.max_input_tokens = max_input_tokens
        self._encode = encode
        # the most characters one token covers: text longer than limit x this is refused
        # untokenized
        self._max_chars_per_token = max_chars_per_token

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt a generation request may bring: its input limit, and room for one
        output token."""
        room = self.max_model_len - 1
        return room if self.max_input_tokens is None else min(self.max_input_tokens, room)

    def check_text(self, texts: Sequence[str], limit: int, param: str) -> None:
        """Refuse text that certainly has more than ``limit`` tokens, tokenizing no more of it than
        that takes (inputs/text_size.py)."""
        size = measure_text(texts, limit, self._encode, self._max_chars_per_token)
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

    def room(self, prompt: PromptPlan, field: str, requested: int | None, prompt_param: str) -> int:
        """Room left for output (``requested`` of it, the ``field`` max_tokens, must fit)."""
        prompt_len = len(prompt.token_ids)
        if prompt_len == 0:  # nothing to condition on (the checkpoint has no BOS token to stand in)
            raise InputError(
                f"{prompt_param} is empty: it has 0 tokens; send at least one token of text",
                prompt_param,
            )
        room = self.max_model_len - prompt_len
        over_input = self.max_input_tokens is not None and prompt_len > self.max_input_tokens
        if not over_input and room >= 1 and (requested is None or requested <= room):
            return room
        # refused: the message counts what the prompt holds and says what to do
        counted = prompt.describe()
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
        if over_input:
            raise InputError(
                f"the prompt has {prompt_len} tokens ({counted}); this server accepts at most "
                f"{self.max_input_tokens} input tokens. To fit, {advice}.",
                prompt_param,
            )
        if room < 1:
            raise InputError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has {prompt_len} "
                f"({counted}), which leaves no room for output. To fit, {advice}.",
                prompt_param,
            )
        raise InputError(
            f"this model's maximum context length is {self.max_model_len} tokens; you requested "
            f"{prompt_len + requested} ({prompt_len} in the prompt: {counted}; {requested} for the output). "
            f"Reduce {field} to at most {room}, or {advice}.",
            field,
        )
