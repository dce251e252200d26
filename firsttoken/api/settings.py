"""What the HTTP layer is told about the model it serves (facts known once the engine is up; the server's options
are config.ServerConfig)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServedModel:
    name: str  # the only accepted `model`; anything else is 404 as in vLLM
    max_model_len: int  # context length in tokens, reported by /v1/models and /tokenize
    root: str | None = None  # shown as `root` in /v1/models (e.g. the checkpoint directory)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("served_model_name must not be empty")
        if self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
