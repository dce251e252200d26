"""Decode through the engine: tokens/s at batch 1, 16 and 64, with CUDA graphs on (the Triton backend, graphs
captured at start-up for every decode bucket) and off (the same backend eager), and the default SDPA backend, on
the Qwen2-VL-7B shape in bf16; and the roofline a batch-1 step cannot beat: the language model's weight bytes (each
read once per step) over the device-to-device copy bandwidth measured in the run (bytes read plus written).

Each batch is that many distinct ~20-token prompts, greedy with ``ignore_eos``, ``decode_new_tokens`` each, after
one warm-up batch of the same size. tokens/s = batch x (new tokens - 1) / (last finish - last first token): the
decode steps only (at batch 1, its inverse is the time per token). Requests run through ``LLM.complete``, so the
figure includes what the engine does per step besides the forward (scheduling, sampling, detokenizing).
"""

from __future__ import annotations

from pathlib import Path

import torch

from firsttoken.llm import LLM
from manifest import DECODE_BATCHES, DECODE_CONFIGS
from setting import DTYPES, Setting, gate_verdict, median, model_of
from step import Recorder

FAMILY = "qwen2-vl"
PROMPT = "Tell me a long story about a lighthouse keeper and a storm at sea, please."


def copy_gbps(setting: Setting) -> float:
    """Median GB/s of a device-to-device copy, counting the bytes read and the bytes written."""
    src = torch.randn(setting.copy_bytes // 4, device=setting.device)
    dst = torch.empty_like(src)
    times = [setting.seconds(lambda: dst.copy_(src))[1] for _ in range(3 + 5 * setting.repeats)][3:]
    return 2 * setting.copy_bytes / median(times) / 1e9


def weight_bytes(model: torch.nn.Module, tied: bool) -> int:
    """Bytes a decode step reads of the language model's weights: every layer, the final norm and the head (the
    embedding table only where the head is tied to it: a step reads one row of it otherwise)."""
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters()
               if not name.startswith("visual.") and (tied or not name.startswith("embed_tokens.")))  # fmt: skip


def tokens_per_s(llm: LLM, batch: int, new_tokens: int, tag: str) -> float:
    prompts = [f"{tag} {i}: {PROMPT}" for i in range(batch)]
    results = llm.complete(prompts, {"max_tokens": new_tokens, "temperature": 0, "ignore_eos": True})
    for r in results:
        if r.error is not None or len(r.token_ids) != new_tokens:
            raise RuntimeError(f"decode batch {batch}: {r.error or f'{len(r.token_ids)} tokens'}")
    span_s = max(r.timings["e2e_s"] for r in results) - max(r.timings["ttft_s"] for r in results)
    return batch * (new_tokens - 1) / span_s


def run(setting: Setting, rec: Recorder, results: Path) -> None:
    dtype = setting.timing_dtype
    rec.put("dtype", dtype)
    rec.put("shape", setting.shape_name(FAMILY))
    rec.put("new_tokens", setting.decode_new_tokens)
    rec.put("copy_gbps", copy_gbps(setting))
    measured: dict[tuple[str, str], dict[int, float]] = {}  # (backend, graphs) as run -> batch -> tokens/s
    for name, backend, graphs in DECODE_CONFIGS:
        ok, why = gate_verdict(results, backend)
        as_run = (setting.backend(backend), setting.cuda_graphs(graphs))
        if not ok:
            for batch in DECODE_BATCHES:
                rec.skip(f"batch{batch}.{name}.tokens_per_s", why)
            continue
        if as_run not in measured:  # a stand-in already measured (the CPU runs sdpa eager for all three)
            llm = setting.llm(setting.model_dir(FAMILY), dtype, backend, cuda_graphs=graphs,
                              max_num_seqs=max(DECODE_BATCHES))
            if not rec.has("weight_bytes"):
                rec.put("weight_bytes", weight_bytes(model_of(llm), llm.engine.model_config.tie_word_embeddings))
            if name == "graphs_on":
                rec.put("graph_sizes", list(llm.engine.resolved.cuda_graph_sizes) or "none (no CUDA here)")
            measured[as_run] = {}
            for batch in DECODE_BATCHES:
                tokens_per_s(llm, batch, 4, f"warm-up {name}")
                measured[as_run][batch] = tokens_per_s(llm, batch, setting.decode_new_tokens, name)
            del llm
            setting.free()
        for batch in DECODE_BATCHES:
            rec.put(f"batch{batch}.{name}.tokens_per_s", measured[as_run][batch])
        rec.note(**{f"{name}.run_as": {"attention_backend": as_run[0], "cuda_graphs": as_run[1]}})
    if not rec.has("weight_bytes"):  # no configuration ran: the weights are counted all the same
        llm = setting.llm(setting.model_dir(FAMILY), dtype, "sdpa")
        rec.put("weight_bytes", weight_bytes(model_of(llm), llm.engine.model_config.tie_word_embeddings))
    if not rec.has("graph_sizes"):
        rec.skip("graph_sizes", "graphs_on did not run")
    rec.note(roofline_s_per_token=rec.value("weight_bytes") / (rec.value("copy_gbps") * 1e9),
             torch_dtype=str(DTYPES[dtype][1]))
