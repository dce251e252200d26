"""What the input processor takes: a prompt and the sampling a client asked for, in no particular
API's terms.

The HTTP layer converts OpenAI bodies into these (api/protocol.py), the offline ``LLM`` builds them
from Python values, and anything else (a replica behind another router, a test) can too, without an
HTTP body. Error messages name request fields by the paths these values imply
(``messages[0].content[1].image_url``) and, for sampling, by the name the client used
(``SamplingRequest.names``).
"""

from __future__ import annotations

from dataclasses import dataclass

from firsttoken.structured.spec import GrammarSpec


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class ImagePart:
    """An image by reference (``url``: a data: URL, a local path or file:// URL inside the allowed
    directory, or an http(s) URL of an allowed domain) or by value (``data``: its encoded bytes, for
    in-process callers)."""

    url: str | None = None
    data: bytes | None = None
    # "low" = the server's low-detail budget; "high"/"auto"/None = its cap
    detail: str | None = None
    # at most this many visual tokens (never above the server's cap)
    max_visual_tokens: int | None = None

    def __post_init__(self) -> None:
        if (self.url is None) == (self.data is None):
            raise ValueError("an image part needs exactly one of url or data")


@dataclass(frozen=True)
class VideoPart:
    """A video (vLLM's ``video_url`` part) by reference (``url``: as an image's), by value
    (``data``: its encoded container bytes), or as a list of encoded frames (``frames``, one image
    each, in order). The request may ask for less than the server's budget (``fps``, ``max_frames``,
    ``max_visual_tokens``), never more."""

    url: str | None = None
    data: bytes | None = None
    # each frame's URL (data: or an allowed path/host), as image_url's
    frames: tuple[str, ...] | None = None
    fps: float | None = None
    max_frames: int | None = None
    max_visual_tokens: int | None = None

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.url, self.data, self.frames)) != 1:
            raise ValueError("a video part needs exactly one of url, data or frames")


@dataclass(frozen=True)
class ToolCall:
    """A function call an assistant turn made (``arguments``: the JSON object as the model wrote
    it)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Function:
    """A tool the model may call: its name, what it does, and a JSON schema of its arguments."""

    name: str
    description: str | None = None
    parameters: dict | None = None


@dataclass(frozen=True)
class Message:
    # system | user | assistant | tool (the chat template prints it verbatim: the API layer
    # restricts it)
    role: str
    content: str | tuple[TextPart | ImagePart | VideoPart, ...] | None
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call whose result it is

    def texts(self) -> list[str]:
        """Every piece of text in this message (what the tokenizer will see)."""
        if self.content is None:
            return []
        if isinstance(self.content, str):
            return [self.content]
        return [p.text for p in self.content if isinstance(p, TextPart)]


@dataclass(frozen=True)
class ChatPrompt:
    messages: tuple[Message, ...]
    add_generation_prompt: bool = True
    # rendered for the model as the chat template (or inputs/tool_prompts.py) writes them
    tools: tuple[Function, ...] = ()
    param: str = "messages"  # the request field the conversation came from, named in errors
    # each message's request field (errors name an image as ``<field>.content[j].image_url``);
    # empty: messages[i]
    fields: tuple[str, ...] = ()

    def field_of(self, index: int) -> str:
        return self.fields[index] if index < len(self.fields) else f"messages[{index}]"

    def texts(self) -> list[str]:
        return [t for m in self.messages for t in m.texts()]


@dataclass(frozen=True)
class TextPrompt:
    """A raw completion prompt: chat control tokens are honoured, image slots never."""

    text: str
    param: str = "prompt"  # the field it came from (``prompt[2]`` in a list of prompts)

    def texts(self) -> list[str]:
        return [self.text]


@dataclass(frozen=True)
class TokenPrompt:
    """A completion prompt given as token ids, used as they are (no vision placeholders: images come
    in chat)."""

    token_ids: tuple[int, ...]
    param: str = "prompt"

    def texts(self) -> list[str]:
        return []


Prompt = ChatPrompt | TextPrompt | TokenPrompt


@dataclass(frozen=True)
class SamplingRequest:
    """Sampling as asked for: None means the checkpoint's default (generation_config.json);
    ``max_tokens`` None means all the room the context leaves. ``names`` maps a SamplingParams field
    to the name the client used for it (``max_tokens`` -> ``max_completion_tokens``), so a refusal
    names what the client sent."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    # what the answer must match (response_format, structured_outputs)
    structured: GrammarSpec | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    # score the prompt's tokens, with this many alternatives (echo + logprobs)
    prompt_logprobs: int | None = None
    names: tuple[tuple[str, str], ...] = ()  # (SamplingParams field, client's field)

    def name(self, field: str) -> str:
        return dict(self.names).get(field, field)
