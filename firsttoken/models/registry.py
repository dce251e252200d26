"""Which model family serves a checkpoint, from its config.json ``architectures`` (or ``model_type``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from firsttoken.models.config import ConfigError, ModelConfig
from firsttoken.models.family import ModelFamily
from firsttoken.models.qwen2_5_vl import QWEN2_5_VL
from firsttoken.models.qwen2_vl import QWEN2_VL
from firsttoken.models.qwen3_vl import QWEN3_VL

FAMILIES: tuple[ModelFamily, ...] = (QWEN2_VL, QWEN2_5_VL, QWEN3_VL)


def family_for(architectures: Sequence[str] | None, model_type: str | None = None) -> ModelFamily:
    """The family of the first listed architecture we support, else of the model_type; ValueError naming what is
    supported otherwise."""
    for arch in architectures or ():
        for family in FAMILIES:
            if arch in family.architectures:
                return family
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    supported = sorted(a for f in FAMILIES for a in f.architectures)
    raise ConfigError(
        f"unsupported model (architectures={list(architectures or [])}, model_type={model_type!r}); "
        f"supported architectures: {supported}"
    )


def family_named(name: str) -> ModelFamily:
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ConfigError(f"unknown model family {name!r}; known: {[f.name for f in FAMILIES]}")


def family_of_config(config_json: dict[str, Any]) -> ModelFamily:
    return family_for(config_json.get("architectures"), config_json.get("model_type"))


def read_json(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    with open(path) as f:
        return json.load(f)


def model_config_from_dict(config_json: dict[str, Any], preprocessor: dict[str, Any] | None = None) -> ModelConfig:
    return family_of_config(config_json).parse_config(config_json, preprocessor)


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """The checkpoint's architecture: config.json (+ preprocessor_config.json) parsed by its family."""
    model_dir = Path(model_dir)
    config_json = read_json(model_dir / "config.json")
    if config_json is None:
        raise ConfigError(f"{model_dir} has no config.json")
    family = family_of_config(config_json)
    return family.parse_config(config_json, read_json(model_dir / "preprocessor_config.json"))


def family_of(model_dir: str | Path) -> ModelFamily:
    config_json = read_json(Path(model_dir) / "config.json")
    if config_json is None:
        raise ConfigError(f"{model_dir} has no config.json")
    return family_of_config(config_json)
