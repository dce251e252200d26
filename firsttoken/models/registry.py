"""Which model family serves a checkpoint, from its config.json ``architectures`` (or
``model_type``).

The families are the built-in ones (``BUILT_IN``) and any registered for a while with
``register(family)``, a context manager: a test, or a program embedding firsttoken, serves a family
of its own without editing this file, and the family is gone again when the block ends. Everything
that asks for a family (the loader, the engine, the input processor, make-model) asks here, so a
registered family is served like a built-in one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from firsttoken.models.family import ModelFamily
from firsttoken.models.internvl import INTERNVL
from firsttoken.models.model_config import (
    ConfigError,
    ImageProcessorConfig,
    ModelConfig,
)
from firsttoken.models.qwen2_5_vl import QWEN2_5_VL
from firsttoken.models.qwen2_vl import QWEN2_VL
from firsttoken.models.qwen3_vl import QWEN3_VL

BUILT_IN: tuple[ModelFamily, ...] = (QWEN2_VL, QWEN2_5_VL, QWEN3_VL, INTERNVL)
_registered: list[ModelFamily] = []  # register()'s families, while their blocks run


def families() -> tuple[ModelFamily, ...]:
    """Every family served now: the built-in ones, then the registered ones in registration
    order."""
    return (*BUILT_IN, *_registered)


@contextmanager
def register(family: ModelFamily) -> Iterator[ModelFamily]:
    """Serve ``family`` inside the block; ValueError when its name, an architecture or a model_type
    is a served family's already (a checkpoint would otherwise have two families)."""
    for other in families():
        clash = (
            {family.name} & {other.name}
            or set(family.architectures) & set(other.architectures)
            or set(family.model_types) & set(other.model_types)
        )
        if clash:
            raise ValueError(f"family {family.name!r} clashes with the served family {other.name!r} on {sorted(clash)}")
    _registered.append(family)
    try:
        yield family
    finally:
        _registered.remove(family)


def family_for(architectures: Sequence[str] | None, model_type: str | None = None) -> ModelFamily:
    """The family of the first listed architecture we support, else of the model_type; ValueError
    naming what is supported otherwise."""
    served = families()
    for arch in architectures or ():
        for family in served:
            if arch in family.architectures:
                return family
    for family in served:
        if model_type in family.model_types:
            return family
    supported = sorted(a for f in served for a in f.architectures)
    raise ConfigError(
        f"unsupported model (architectures={list(architectures or [])}, model_type={model_type!r}); "
        f"supported architectures: {supported}"
    )


def family_named(name: str) -> ModelFamily:
    served = families()
    for family in served:
        if family.name == name:
            return family
    raise ConfigError(f"unknown model family {name!r}; known: {[f.name for f in served]}")


def family_of_config(config_json: dict[str, Any]) -> ModelFamily:
    return family_for(config_json.get("architectures"), config_json.get("model_type"))


def read_json(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    with open(path) as f:
        return json.load(f)


def model_config_from_dict(
    config_json: dict[str, Any], preprocessor: dict[str, Any] | None = None
) -> ModelConfig:
    return family_of_config(config_json).parse_config(config_json, preprocessor)


def served_image_processor(config_json: dict[str, Any],
                           model_path: str | Path | None = None) -> ImageProcessorConfig | None:
    """How firsttoken would process this config's images (with the preprocessor_config.json beside
    it when ``model_path`` is a directory); None when no family serves the config or its files do
    not parse (a planning tool then reads the shapes alone)."""
    path = Path(model_path) if model_path is not None else None
    try:
        preprocessor = read_json(path / "preprocessor_config.json") if path and path.is_dir() else None
        return model_config_from_dict(config_json, preprocessor).image_processor
    except (ValueError, KeyError, TypeError):
        return None


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """The checkpoint's architecture: config.json (+ preprocessor_config.json) parsed by its
    family."""
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
