"""Helpers several test directories share."""

from __future__ import annotations

import time

from firsttoken.inputs.processor import InputProcessor
from firsttoken.types import EngineRequest


def process(processor: InputProcessor, req, request_id: str = "r1") -> EngineRequest:
    """An OpenAI request body (ChatCompletionRequest / CompletionRequest) through the processor, as the server does."""
    return processor.process(req.to_prompt(), req.to_sampling(), request_id, time.monotonic())
