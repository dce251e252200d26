"""Unloaded TTFT, side by side on the same device and inputs: transformers' ``generate`` (SDPA attention, one new
token) against our engine with the SDPA and with the Triton backend, for each class of the seed mix (~800 tokens
of text; one or three 1024x1024 images beside ~800 tokens) on the Qwen2-VL-7B and Qwen2.5-VL-7B shapes in bf16.

Each side's clock runs from the request's raw inputs (the chat messages with JPEG data URLs) to its first token:
ours is ``LLM.chat`` (preprocessing, vision tower, prefill, sampling), transformers' is decoding the data URLs, its
image processor and ``generate(max_new_tokens=1)`` over the prompt ids our processor made (the same ids: the chat
template is not what is compared). Every repetition sends new images and text (the bench's seeded workload), so no
cache of ours (prefix, encoder, processed images) holds them; the sides alternate within a repetition; the first
repetition of each class is a warm-up and is not counted. Medians of ``repeats``; each value is seconds.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoImageProcessor

from firsttoken.llm import LLM
from firsttoken.tools.bench import BenchConfig
from firsttoken.tools.bench.images import decode_data_url
from firsttoken.tools.bench.workload import Workload
from manifest import BACKENDS, CLASSES, MODELS
from reference import model_inputs, transformers_over
from setting import DTYPES, Setting, gate_verdict, median, model_of
from step import Recorder


def class_messages(setting: Setting, cls: str, index: int) -> list[dict]:
    """Request ``index`` of ``cls`` as the bench's seed mix makes it (its own seed: new text and images)."""
    side = setting.image_side_px
    config = BenchConfig(url="http://offline", mix=((cls, 1.0),), text_tokens=setting.text_words,
                         image_text_tokens=setting.text_words, image_size=(side, side), output_tokens=1,
                         seed=1000 + index)  # fmt: skip
    return Workload(config).session(index).requests[0].body["messages"]


def image_urls(messages: list[dict]) -> list[str]:
    return [part["image_url"]["url"] for m in messages if isinstance(m["content"], list)
            for part in m["content"] if part.get("type") == "image_url"]  # fmt: skip


class Transformers:
    """transformers' side: decode the images, its image processor, generate one token over our prompt ids."""

    def __init__(self, model_dir: Path, reference: torch.nn.Module, dtype: torch.dtype, device: str) -> None:
        self.reference, self.dtype, self.device = reference, dtype, device
        self.processor = AutoImageProcessor.from_pretrained(model_dir)

    def first_token(self, ids: tuple[int, ...], urls: list[str], pad: int, grids: list[tuple[int, int, int]]) -> int:
        inputs = {"input_ids": torch.tensor([ids], device=self.device)}
        if urls:
            pixels = self.processor(images=[decode_data_url(u) for u in urls], return_tensors="pt")
            if [tuple(g) for g in pixels["image_grid_thw"].tolist()] != grids:
                raise ValueError(f"transformers' image grids {pixels['image_grid_thw'].tolist()} != ours {grids}")
            inputs |= {"pixel_values": pixels["pixel_values"].to(self.device, self.dtype),
                       "image_grid_thw": pixels["image_grid_thw"].to(self.device),
                       "mm_token_type_ids": (inputs["input_ids"] == pad).long()}  # fmt: skip
        with torch.inference_mode():
            out = self.reference.generate(**inputs, max_new_tokens=1, do_sample=False)
        return int(out[0, -1])


def measure_class(setting: Setting, llms: dict[str, LLM], first: LLM, theirs: Transformers, cls: str
                  ) -> tuple[dict[str, list[float]], dict]:  # fmt: skip
    """Seconds per side over the counted repetitions, and what the prompt was; ``first`` makes the prompt ids."""
    times: dict[str, list[float]] = {name: [] for name in (*llms, "transformers")}
    server_ttft: dict[str, list[float]] = {name: [] for name in llms}
    shape: dict = {}
    for index in range(setting.repeats + 1):  # index 0: the warm-up
        messages = class_messages(setting, cls, index)
        for name, llm in llms.items():
            out, seconds = setting.seconds(lambda: llm.chat(messages, {"max_tokens": 1, "temperature": 0}))
            if out.error is not None:
                raise RuntimeError(f"{name}: {out.error}")
            if index:
                times[name].append(seconds)
                server_ttft[name].append(out.timings["ttft_s"])
        request = first.preprocess_chat(messages)  # after ours ran: its processed images are cached, untimed
        grids = [im.grid_thw for im in request.images]
        pad = request.prompt_token_ids[request.images[0].offset] if request.images else -1
        _, seconds = setting.seconds(lambda: theirs.first_token(request.prompt_token_ids, image_urls(messages), pad,
                                                                grids))  # fmt: skip
        if index:
            times["transformers"].append(seconds)
        shape = {"prompt_tokens": request.num_prompt_tokens, "visual_tokens": request.num_image_tokens}
    return times, shape | {"server_ttft_s": {k: median(v) for k, v in server_ttft.items()}}


def run(setting: Setting, rec: Recorder, results: Path) -> None:
    dtype = setting.timing_dtype
    rec.put("n", setting.repeats)
    rec.put("dtype", dtype)
    rec.put("shapes", {m: setting.shape_name(m) for m in MODELS})
    allowed = {b: gate_verdict(results, b) for b in BACKENDS}
    for model in MODELS:
        model_dir = setting.model_dir(model)
        used = {b: setting.backend(b) for b in BACKENDS if allowed[b][0]}
        # no decode graphs: a first token is a prefill, and capturing them costs the loan seconds per engine
        llms = {name: setting.llm(model_dir, dtype, name, cuda_graphs="off") for name in dict.fromkeys(used.values())}
        # transformers' weights and the prompt ids: an engine of ours, measured or not (no backend passed the gate)
        base = next(iter(llms.values()), None) or setting.llm(model_dir, dtype, "sdpa")
        theirs = Transformers(model_dir, transformers_over(model_dir, model_of(base), DTYPES[dtype][1],
                                                           setting.device), DTYPES[dtype][1], setting.device)
        for cls in CLASSES:
            times, shape = measure_class(setting, llms, base, theirs, cls)
            rec.put(f"{model}.{cls}.transformers_s", median(times["transformers"]))
            for b in BACKENDS:
                if b in used:
                    rec.put(f"{model}.{cls}.{b}_s", median(times[used[b]]))
                else:
                    rec.skip(f"{model}.{cls}.{b}_s", allowed[b][1])
            rec.put(f"{model}.{cls}.prompt_tokens", shape["prompt_tokens"])
            rec.note(**{f"{model}.{cls}": shape | {"runs_s": times}})
        rec.note(**{f"{model}.backends_used": used, f"{model}.image_processor": type(theirs.processor).__name__})
        del llms, base, theirs
        rec.note(**{f"{model}.memory_after": setting.free()})
