"""Helpers several test directories share."""

from __future__ import annotations

import time

from firsttoken.inputs.processor import InputProcessor
from firsttoken.types import EngineRequest


def process(processor: InputProcessor, req, request_id: str = "r1") -> EngineRequest:
    """An OpenAI request body (ChatCompletionRequest / CompletionRequest) through the processor, as the server does."""
    return processor.process(req.to_prompt(), req.to_sampling(), request_id, time.monotonic())


def make_processor(model_dir, max_model_len: int = 4096, **image_options) -> InputProcessor:
    """The tiny checkpoint's processor with the checkpoint's generation defaults; ``image_options`` are
    ImageConfig fields (budget, limits)."""
    from firsttoken.config import GenerationDefaults, ImageConfig
    from firsttoken.models.registry import load_model_config

    return InputProcessor(model_dir, load_model_config(model_dir), GenerationDefaults.from_pretrained(model_dir),
                          max_model_len=max_model_len, images=ImageConfig(**image_options))
