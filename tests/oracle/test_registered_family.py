"""A family registered by a test, touching nothing outside models/: Qwen2-VL's modules under a new architecture
name (``CopyVLForConditionalGeneration``, family "copy-vl"), served for this module's duration by
``registry.register``. Its checkpoints name the new architecture, so the registry, the loader, the engine, the
input processor and make-model find the copy, not Qwen2-VL; its transformers reference is Qwen2-VL's class.

It gets every test of test_family_parity.py, test_engine_oracle.py and test_vision_row_slices.py (imported below,
``family`` overridden), and the server answers an image question with it as transformers' generate does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest

from firsttoken.models.family import ModelFamily
from firsttoken.models.qwen2_vl import QWEN2_VL
from firsttoken.models.registry import family_named, family_of, register
from tests.e2e.conftest import image_message, make_image, start_server, stop_server, transformers_answer
from tests.oracle.test_engine_oracle import *  # noqa: F403  (its tests and fixtures, run on the copy)
from tests.oracle.test_family_parity import *  # noqa: F403
from tests.oracle.test_vision_row_slices import *  # noqa: F403

ARCHITECTURE = "CopyVLForConditionalGeneration"


def _hf_config(shape: Any) -> Any:
    config = QWEN2_VL.checkpoint.hf_config(shape)
    config.architectures = [ARCHITECTURE]
    return config


def _original_config(config: Any, shape: Any) -> dict[str, Any]:
    return {**QWEN2_VL.checkpoint.original_config(config, shape), "architectures": [ARCHITECTURE]}


COPY_VL = replace(
    QWEN2_VL,
    name="copy-vl",
    architectures=(ARCHITECTURE,),
    model_types=(),  # config.json's model_type stays "qwen2_vl" (transformers' config class reads it)
    parse_config=lambda d, preprocessor: replace(QWEN2_VL.parse_config(d, preprocessor), family="copy-vl"),
    checkpoint=replace(QWEN2_VL.checkpoint, hf_config=_hf_config, original_config=_original_config),
)


@pytest.fixture(scope="module")
def family() -> Iterator[ModelFamily]:
    with register(COPY_VL) as registered:
        yield registered


def test_the_copy_is_served_as_itself_and_a_registration_ends_with_its_block(model_dir) -> None:
    from firsttoken.models.model_config import ConfigError

    assert family_of(model_dir) is COPY_VL and family_named("copy-vl") is COPY_VL
    with pytest.raises(ValueError, match="clashes"):  # a checkpoint naming its architecture would have two families
        with register(replace(COPY_VL, name="other")):
            pass
    second = replace(COPY_VL, name="copy-vl-2", architectures=("CopyVL2ForConditionalGeneration",))
    with register(second):
        assert family_named("copy-vl-2") is second
    with pytest.raises(ConfigError, match="copy-vl-2"):
        family_named("copy-vl-2")


def test_the_server_answers_an_image_question_as_transformers_generates(model_dir) -> None:
    image = make_image(224, 224, seed=1)  # 64 visual tokens: under any visual-token budget
    messages = image_message("What is in this picture?", image)
    live, server, thread = start_server(model_dir)
    try:
        counted = httpx.post(f"{live.base_url}/tokenize", json={"model": live.model, "messages": messages}).json()
        out = live.client().chat.completions.create(model=live.model, messages=messages, max_tokens=16,
                                                    temperature=0.0)
        served_family = live.engine.engine.model_config.family
    finally:
        stop_server(server, thread, live.engine)
    assert served_family == "copy-vl"
    assert out.usage.prompt_tokens == counted["count"] and out.choices[0].finish_reason in ("stop", "length")
    expected, num_tokens = transformers_answer(model_dir, counted["tokens"], [image], 16)
    assert (out.choices[0].message.content, out.usage.completion_tokens) == (expected, num_tokens)
