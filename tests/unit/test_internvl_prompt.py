"""An InternVL3.5 prompt as the tiny checkpoint's processor renders it: its tokenizer spells the -HF releases' control
tokens (<img>, </img>, <IMG_CONTEXT>), its chat template writes one <IMG_CONTEXT> per image, and the prompt holds
<img> + the planned pads + </img> there, token for token what transformers' own InternVLProcessor makes of the same
conversation. A client typing those tokens gets plain text, in chat and in raw prompts; token-id prompts may not hold
them."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from firsttoken.api.protocol import ChatCompletionRequest, CompletionRequest
from firsttoken.inputs.processor import InputError, InputProcessor
from firsttoken.models.checkpoint import make_model
from tests.e2e.conftest import image_data_url, internvl_prompt_ids, make_image
from tests.helpers import make_processor, process

TOKENS_PER_TILE = 256
MAX_PATCHES = 4  # the tiles the processor's default cap (1,280 tokens) allows, its thumbnail among them


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("internvl-prompt"), size="tiny", seed=0, family="internvl3.5")


@pytest.fixture(scope="module")
def processor(model_dir: Path) -> InputProcessor:
    return make_processor(model_dir)


def ids_of(processor: InputProcessor, token: str) -> int:
    return processor.tokenizer.convert_tokens_to_ids(token)


def chat(*content: dict) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": list(content)}])


def image(img: Image.Image) -> dict:
    return {"type": "image_url", "image_url": {"url": image_data_url(img)}}


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def test_one_image_is_img_then_its_planned_pads_then_close_img(processor: InputProcessor) -> None:
    er = process(processor, chat(image(make_image(1024, 448, seed=1)), text("What is this?")))
    (item,) = er.images
    start, end, pad = (ids_of(processor, t) for t in ("<img>", "</img>", "<IMG_CONTEXT>"))
    ids = er.prompt_token_ids
    assert item.num_tokens == 3 * TOKENS_PER_TILE  # 2 x 1 tiles and the thumbnail
    assert ids[item.offset - 1] == start and ids[item.end] == end
    assert ids[item.offset : item.end] == (pad,) * item.num_tokens
    assert (ids.count(start), ids.count(pad), ids.count(end)) == (1, item.num_tokens, 1)
    rendered = processor.tokenizer.decode(ids)
    assert "<img>" + "<IMG_CONTEXT>" * item.num_tokens + "</img>\nWhat is this?" in rendered


def test_the_prompt_is_transformers_internvl_processor_s_token_for_token(processor: InputProcessor,
                                                                          model_dir: Path) -> None:
    images = [make_image(1024, 448, seed=1), make_image(448, 448, seed=2)]
    parts = [image(images[0]), text("and"), image(images[1]), text("Compare them.")]
    er = process(processor, chat(*parts))
    assert [im.num_tokens for im in er.images] == [3 * TOKENS_PER_TILE, TOKENS_PER_TILE]
    messages = [{"role": "user", "content": parts}]
    assert list(er.prompt_token_ids) == internvl_prompt_ids(model_dir, messages, images, MAX_PATCHES)


@pytest.mark.parametrize("typed", ["<img>", "<IMG_CONTEXT>", "</img>", "<img><IMG_CONTEXT></img>", "<video>"])
def test_slot_tokens_typed_in_chat_text_stay_text(processor: InputProcessor, typed: str) -> None:
    slot_ids = {ids_of(processor, t) for t in ("<img>", "</img>", "<IMG_CONTEXT>", "<video>")}
    for req in (chat(text(f"say {typed} now")), chat(text(f"say {typed} now"), image(make_image(448, 448)))):
        er = process(processor, req)
        ids = er.prompt_token_ids
        assert sum(ids.count(t) for t in slot_ids) == sum(im.num_tokens + 2 for im in er.images)
        assert f"say {typed} now" in processor.tokenizer.decode(ids)


def test_a_raw_prompt_honours_chat_tokens_but_not_slot_tokens(processor: InputProcessor) -> None:
    req = CompletionRequest(model="m", prompt="<|im_start|>user\nhi <img><IMG_CONTEXT></img><|im_end|>")
    er = process(processor, req)
    assert er.prompt_token_ids[0] == ids_of(processor, "<|im_start|>") and er.images == ()
    assert not {ids_of(processor, t) for t in ("<img>", "</img>", "<IMG_CONTEXT>")} & set(er.prompt_token_ids)
    assert processor.tokenizer.decode(er.prompt_token_ids) == req.prompt


@pytest.mark.parametrize("token", ["<img>", "</img>", "<IMG_CONTEXT>"])
def test_a_token_id_prompt_may_not_hold_a_slot_token(processor: InputProcessor, token: str) -> None:
    req = CompletionRequest(model="m", prompt=[5, ids_of(processor, token), 6])
    with pytest.raises(InputError, match="carries no images"):
        process(processor, req)
