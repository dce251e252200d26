"""Which model class serves a checkpoint, from its config.json ``architectures`` / ``model_type``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from firsttoken.models.qwen2_vl import Qwen2VLModel

_BY_ARCHITECTURE: dict[str, type[nn.Module]] = {
    "Qwen2VLForConditionalGeneration": Qwen2VLModel,
}
_BY_MODEL_TYPE: dict[str, type[nn.Module]] = {
    "qwen2_vl": Qwen2VLModel,
}


def get_model_class(architectures: Sequence[str] | None, model_type: str | None = None) -> type[nn.Module]:
    """The first listed architecture we support, else the model_type; ValueError naming what is supported."""
    for arch in architectures or ():
        if arch in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[arch]
    if model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    raise ValueError(
        f"unsupported model (architectures={list(architectures or [])}, model_type={model_type!r}); supported "
        f"architectures: {sorted(_BY_ARCHITECTURE)}, model types: {sorted(_BY_MODEL_TYPE)}"
    )


def model_class_for_config(config_json: dict[str, Any]) -> type[nn.Module]:
    return get_model_class(config_json.get("architectures"), config_json.get("model_type"))
