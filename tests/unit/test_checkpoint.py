"""make_model writes checkpoints that transformers loads unchanged, in both layouts, reproducibly."""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)

from firsttoken.cli.main import main as cli_main
from firsttoken.config import GenerationDefaults
from firsttoken.models.checkpoint import demo_model_dir, make_model, shard_names
from firsttoken.models.recipe import TOKEN_IDS, VOCAB_SIZE
from firsttoken.models.model_config import ModelConfig
from firsttoken.models.registry import load_model_config
from firsttoken.models.train_tokenizer import SPECIAL_TOKENS


@pytest.fixture(scope="module")
def original_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny-orig"), size="tiny", seed=0, layout="original", shards=2)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _load(model_dir: Path) -> Qwen2VLForConditionalGeneration:
    model, info = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.dtype == torch.float32
    return model.eval()


def _image_inputs(model_dir: Path, tokenizer) -> dict[str, torch.Tensor]:
    processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    image = Image.fromarray((torch.rand(56, 84, 3, generator=torch.Generator().manual_seed(0)) * 255).byte().numpy())
    pixels = processor(image, return_tensors="pt")
    num_image_tokens = int(pixels["image_grid_thw"].prod()) // 4  # 2x2 merge
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    text = text.replace("<|image_pad|>", "<|image_pad|>" * num_image_tokens)
    input_ids = torch.tensor([tokenizer.encode(text)])
    return {
        "input_ids": input_ids,
        "pixel_values": pixels["pixel_values"],
        "image_grid_thw": pixels["image_grid_thw"],
        "mm_token_type_ids": (input_ids == TOKEN_IDS["<|image_pad|>"]).long(),
    }


def test_files_and_weight_names(tiny_model_dir: Path, original_dir: Path) -> None:
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "preprocessor_config.json", "model.safetensors"):
        assert (tiny_model_dir / name).exists(), name
    index = json.loads((original_dir / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    names = set(index["weight_map"])
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
            "visual.patch_embed.proj.weight", "visual.merger.mlp.2.weight"} <= names
    assert not any(n.startswith(("model.language_model.", "model.visual.")) for n in names)
    config = json.loads((original_dir / "config.json").read_text())
    assert config["rope_scaling"] == {"type": "mrope", "mrope_section": [2, 3, 3]}
    assert config["vision_config"]["in_chans"] == 3 and "text_config" not in config


def test_special_token_ids(tokenizer) -> None:
    assert len(tokenizer) == 16_014 <= VOCAB_SIZE
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.convert_tokens_to_ids(token) == 16_000 + i == TOKEN_IDS[token]
        assert tokenizer.encode(token) == [16_000 + i]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"


def test_chat_template_renders_images(tokenizer) -> None:
    messages = [{"role": "user", "content": [
        {"type": "image"},
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
        {"type": "text", "text": "Compare."},
    ]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        + "<|vision_start|><|image_pad|><|vision_end|>" * 2
        + "Compare.<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.encode(text)
    assert ids.count(TOKEN_IDS["<|image_pad|>"]) == 2 and ids.count(TOKEN_IDS["<|vision_start|>"]) == 2


def test_round_trips_unicode(tokenizer) -> None:
    rng = random.Random(0)
    ranges = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x4E00, 0x9FFF), (0x1F300, 0x1F64F)]
    for _ in range(20):
        chars = [chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randint(1, 60))]
        text = unicodedata.normalize("NFC", "".join(chars) + " \n\t  x")  # the tokenizer normalizes to NFC
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_image_processor_defaults(tiny_model_dir: Path) -> None:
    processor = Qwen2VLImageProcessorPil.from_pretrained(tiny_model_dir)
    assert (processor.size["shortest_edge"], processor.size["longest_edge"]) == (3136, 12845056)
    assert (processor.patch_size, processor.merge_size, processor.temporal_patch_size) == (14, 2, 2)
    grid = processor(Image.new("RGB", (448, 448)), return_tensors="pt")["image_grid_thw"]
    assert grid.tolist() == [[1, 32, 32]]  # 256 LM tokens after the 2x2 merge


def test_both_layouts_load_and_give_identical_logits(tiny_model_dir: Path, original_dir: Path, tokenizer) -> None:
    inputs = _image_inputs(tiny_model_dir, tokenizer)
    with torch.no_grad():
        logits = [_load(d)(**inputs).logits for d in (tiny_model_dir, original_dir)]
    assert logits[0].shape == (1, inputs["input_ids"].shape[1], VOCAB_SIZE)
    assert torch.equal(logits[0], logits[1])


def test_logits_are_peaked(tiny_model_dir: Path) -> None:
    input_ids = torch.randint(0, 16_000, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = _load(tiny_model_dir)(input_ids=input_ids).logits[0]
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 0.5
    assert logits.argmax(-1).max() < len(SPECIAL_TOKENS) + 16_000  # never a padding row


def test_same_seed_same_bytes(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = make_model(tmp_path / "again", size="tiny", seed=0)
    other = make_model(tmp_path / "other", size="tiny", seed=1)
    weights = (tiny_model_dir / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == weights
    assert (other / "model.safetensors").read_bytes() != weights


def test_firsttoken_config_parses_both_layouts(tiny_model_dir: Path, original_dir: Path) -> None:
    new, old = load_model_config(tiny_model_dir), load_model_config(original_dir)
    assert (new.layout, old.layout) == ("transformers", "original")
    assert new == ModelConfig(**{**old.__dict__, "layout": "transformers"})
    assert new.mrope_section == (2, 3, 3) and new.vocab_size == VOCAB_SIZE and not new.tie_word_embeddings
    assert new.image_token_id == TOKEN_IDS["<|image_pad|>"] and new.vision.out_hidden_size == 64
    gen = GenerationDefaults.from_pretrained(tiny_model_dir)
    assert gen.eos_token_ids == (TOKEN_IDS["<|im_end|>"], TOKEN_IDS["<|endoftext|>"])
    assert (gen.temperature, gen.top_p, gen.top_k, gen.repetition_penalty) == (0.01, 0.001, 1, 1.05)


def test_shard_names_are_contiguous_and_non_empty() -> None:
    groups = shard_names(["a", "b", "c", "d"], [100, 1, 1, 1], 3)
    assert groups == [["a"], ["b"], ["c", "d"]]
    with pytest.raises(ValueError):
        shard_names(["a"], [1], 2)


def test_cli_make_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["make-model", str(tmp_path / "m"), "--size", "tiny", "--shards", "2"]) == 0
    assert (tmp_path / "m" / "model.safetensors.index.json").exists()
    assert "2,228,480 parameters" in capsys.readouterr().out


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
def test_cli_make_model_in_bf16_stores_every_tensor_in_bf16(family: str, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Published Qwen-VL checkpoints are bf16: --dtype bfloat16 writes one like them, and transformers reads its
    config's dtype as bfloat16."""
    from safetensors import safe_open
    from transformers import AutoConfig

    out = tmp_path / family
    assert cli_main(["make-model", str(out), "--family", family, "--dtype", "bfloat16"]) == 0
    assert ", bfloat16)" in capsys.readouterr().out
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert AutoConfig.from_pretrained(out).dtype == torch.bfloat16


def test_demo_model_dir_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FIRSTTOKEN_CACHE", str(tmp_path))
    first = demo_model_dir()
    assert first == tmp_path / "demo-tiny-seed0" and (first / "model.safetensors").exists()
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert demo_model_dir() == first and (first / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == ["demo-tiny-seed0"]  # no temp dirs left behind
