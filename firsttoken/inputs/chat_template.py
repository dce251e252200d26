"""The checkpoint's chat template, rendered and tokenized with control tokens sanitized, on any
transformers 5.x.

Contract: ``ChatTemplate(tokenizer).encode(messages, tools, add_generation_prompt)`` is the token
ids of the rendered conversation in which a control token typed inside any message or tool string
(``<|image_pad|>``, ``<|im_start|>``...) is encoded as ordinary text, so only the control tokens the
template writes itself become control-token ids: a client cannot forge an image slot or a turn.
Control tokens are the tokenizer's special added tokens and the added tokens the template's own text
contains (whitespace excepted). Private-use markers U+F0000 / U+F0001 typed by a client are dropped
first, so they cannot forge a marked token either.

transformers does this itself where ``apply_chat_template`` takes ``sanitize_control_tokens`` (5.24
does); older releases (5.17, the GPU machine's) take that keyword as a template variable and ignore
it. There the same marking is done here, as transformers does it: each control token in the client's
strings is wrapped in the two markers, the template is rendered to text, and the text is encoded
piece by piece, marked tokens as plain text. Which of the two runs is decided once, at construction
(``native``); both give the same ids (tests/unit/test_chat_template.py).
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from transformers import PreTrainedTokenizerBase

# transformers' own markers: one client string cannot hold both
MARK_START, MARK_END = "\U000f0000", "\U000f0001"


class ChatTemplate:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, native: bool | None = None) -> None:
        """``native``: use transformers' own sanitization; None (the default) where this
        transformers has it."""
        self.tokenizer = tokenizer
        self.native = sanitizes_natively(tokenizer) if native is None else native
        template = tokenizer.chat_template or ""
        literals = _template_literals(template)
        control = [t.content for t in tokenizer.added_tokens_decoder.values()
                   if t.special or (t.content in literals and not t.content.isspace())]
        self._control_re = _alternation(control)
        # a marked token, or a lone marker (template string methods can split a pair): pieces
        # alternate text, token
        self._markers_re = re.compile(
            f"{MARK_START}({_alternation(tokenizer.added_tokens_encoder).pattern}){MARK_END}|[{MARK_START}{MARK_END}]")

    def encode(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool) -> list[int]:
        """The conversation's token ids; the template's own ValueError / TemplateError propagate."""
        if self.native:
            return list(self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=True, add_generation_prompt=add_generation_prompt,
                sanitize_control_tokens=True, return_dict=False))
        rendered = self.tokenizer.apply_chat_template(
            self._marked(messages), tools=self._marked(tools), tokenize=False,
            add_generation_prompt=add_generation_prompt)
        return self._encode_marked(rendered)

    def _marked(self, value: Any) -> Any:
        """``value`` with every control token in its strings (dict values, list items; not keys)
        wrapped in markers."""
        if isinstance(value, str):
            value = value.replace(MARK_START, "").replace(MARK_END, "")
            return self._control_re.sub(lambda m: MARK_START + m.group(0) + MARK_END, value)
        if isinstance(value, dict):
            return {key: self._marked(v) for key, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._marked(v) for v in value]
        return value

    def _encode_marked(self, rendered: str) -> list[int]:
        """Text pieces as usual, marked tokens as plain text; a lone marker only breaks the text
        around it."""
        # [text, token or None, text, token or None, ..., text]
        pieces = self._markers_re.split(rendered)
        newline = self._ids("\n", as_text=False)
        ids = self._ids(pieces[0], as_text=False)
        for i, piece in enumerate(pieces[1:], start=1):
            if not piece:
                continue
            as_text = i % 2 == 1
            # after a newline, so no tokenizer treats the piece as the start of a string (a prefix
            # space)
            piece_ids = self._ids("\n" + piece, as_text)
            piece_ids = (
                piece_ids[len(newline) :]
                if piece_ids[: len(newline)] == newline
                else self._ids(piece, as_text)
            )
            if as_text and self.tokenizer.convert_tokens_to_ids(piece) in piece_ids:
                raise ValueError(
                    f"cannot sanitize {piece!r}: the tokenizer produces it from plain text"
                )
            ids += piece_ids
        return ids

    def _ids(self, text: str, as_text: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=as_text)


def sanitizes_natively(tokenizer: PreTrainedTokenizerBase | type[PreTrainedTokenizerBase]) -> bool:
    return "sanitize_control_tokens" in inspect.signature(tokenizer.apply_chat_template).parameters


def _alternation(tokens: Any) -> re.Pattern[str]:
    """Any of ``tokens``, longest first (a token wins over the tokens it contains); nothing for
    none."""
    longest_first = sorted(tokens, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, longest_first)) or "(?!)")


def _template_literals(template: str) -> str:
    """The template's text and string constants, NUL-joined (no match spans two); the whole source
    if it does not parse here (transformers' own tags): a superset, so no control token is
    missed."""
    try:
        tree = ImmutableSandboxedEnvironment(extensions=[loopcontrols]).parse(template)
    except jinja2.TemplateSyntaxError:
        return template
    literals = {node.data for node in tree.find_all(nodes.TemplateData)}
    literals |= {node.value for node in tree.find_all(nodes.Const) if isinstance(node.value, str)}
    return "\0".join(literals)
