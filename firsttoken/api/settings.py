"""What the HTTP layer is told about the model it serves (facts known once the engine is up; the
server's options are config.ServerConfig)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ServedModel:
    name: str  # the only accepted `model`; anything else is 404 as in vLLM
    max_model_len: int  # context length in tokens, reported by /v1/models and /tokenize
    root: str | None = None  # shown as `root` in /v1/models (e.g. the checkpoint directory)
    # GET /v1/engine/config: what the engine runs with (engine/resolve.py's
    # ResolvedEngineConfig.as_dict), plain JSON; None where the app fronts no single engine (the
    # fleet's ingress): that route answers 404
    engine_config: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("served_model_name must not be empty")
        if self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
