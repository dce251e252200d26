"""The input side of the CUDA decode graphs (issue 39, deliverable 3), on CPU tensors: the buckets a decode batch is
padded up to, the persistent buffers filled in place (padding rows write only the scratch block), the forward a
graph holds giving the eager step's logits and KV writes (Triton's decode kernels, interpreted here), and the runner
asking the graphs only for pure-decode steps. Capture and replay themselves need a device: tests/gpu/."""

from __future__ import annotations

import json
import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():  # as tests/unit/test_triton_attention.py
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from firsttoken.attention.base import AttentionMetadata  # noqa: E402
from firsttoken.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from firsttoken.engine.resolve import resolve_engine_config  # noqa: E402
from firsttoken.loading.plan_values import CudaFacts, Machine  # noqa: E402
from firsttoken.runner.cuda_graphs import (  # noqa: E402
    PAD_TOKEN_ID,
    CudaGraphRunner,
    GraphInputs,
    bucket_for,
    capture_sizes,
)

BLOCK = 16


@pytest.mark.parametrize("max_num_seqs, sizes", [
    (1, (1,)),
    (2, (1, 2)),
    (4, (1, 2, 4)),
    (10, (1, 2, 4, 8, 10)),
    (24, (1, 2, 4, 8, 16, 24)),
    (64, (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)),
])
def test_capture_sizes_are_vllms_up_to_max_num_seqs(max_num_seqs, sizes):
    assert capture_sizes(max_num_seqs) == sizes
    with pytest.raises(ValueError):
        capture_sizes(0)


@pytest.mark.parametrize("num_seqs, bucket", [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 16), (57, 64), (64, 64),
                                              (65, None), (200, None)])
def test_a_batch_takes_the_smallest_bucket_that_holds_it_and_none_above_the_largest(num_seqs, bucket):
    assert bucket_for(num_seqs, capture_sizes(64)) == bucket


def decode_step(context_lens: list[int], tables: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor,
                                                                           AttentionMetadata]:
    """A pure-decode step's packed inputs as the runner makes them: ids, positions one row seen as three."""
    ids = torch.tensor([100 + i for i in range(len(context_lens))])
    positions = torch.tensor(context_lens).expand(3, -1)  # [3, n], stride 0 (t = h = w past the prompt)
    meta = AttentionMetadata.build([1] * len(context_lens), context_lens, tables, BLOCK)
    return ids, positions, meta


def test_filling_copies_the_step_in_place_and_pads_up_to_the_bucket_with_the_scratch_block():
    inputs = GraphInputs(max_rows=8, max_model_len=64, block_size=BLOCK, scratch_block=10, device="cpu")
    addresses = [t.data_ptr() for t in (inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.block_tables,
                                        inputs.seq_lens)]
    ids, positions, meta = decode_step([5, 17, 33], [[3], [0, 4], [1, 6, 8]])
    inputs.fill(4, ids, positions, meta)
    assert inputs.input_ids[:4].tolist() == [100, 101, 102, PAD_TOKEN_ID]
    assert inputs.positions[:, :4].tolist() == [[5, 17, 33, 0]] * 3
    assert inputs.slot_mapping[:4].tolist() == [3 * 16 + 5, 4 * 16 + 1, 8 * 16 + 1, 10 * 16]  # padding: the scratch
    assert inputs.seq_lens[:4].tolist() == [6, 18, 34, 1]  # padding attends to its own one slot
    # the step's own tables (AttentionMetadata pads them with 0 to the step's width; read only below seq_len), then
    # the scratch block; a padding row's table is all scratch
    assert inputs.block_tables[:4, :4].tolist() == [[3, 0, 0, 10], [0, 4, 0, 10], [1, 6, 8, 10], [10] * 4]
    # a smaller step later: the row it no longer has becomes padding, nothing stale is left for the graph to read
    ids, positions, meta = decode_step([6, 18], [[3], [0, 4]])
    inputs.fill(2, ids, positions, meta)
    inputs.fill(4, *decode_step([7], [[3]]))
    assert inputs.slot_mapping[:4].tolist() == [3 * 16 + 7] + [10 * 16] * 3
    assert inputs.seq_lens[:4].tolist() == [8, 1, 1, 1]
    assert inputs.block_tables[1:4].unique().tolist() == [10] and inputs.block_tables[0, 1:].unique().tolist() == [10]
    assert [t.data_ptr() for t in (inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.block_tables,
                                   inputs.seq_lens)] == addresses  # in place: a captured graph's addresses hold
    meta = inputs.metadata(4)
    assert meta.seq_lens_tensor.data_ptr() == inputs.seq_lens.data_ptr()  # the buffer, not a tensor per step
    assert meta.block_tables.data_ptr() == inputs.block_tables.data_ptr() and meta.is_pure_decode
    with pytest.raises(ValueError, match="do not fit"):
        inputs.fill(2, *decode_step([5, 6, 7], [[3], [4], [5]]))


def test_the_graphs_forward_on_padded_buffers_gives_the_eager_steps_logits_and_kv(tiny_model_dir):
    """What a graph holds, run on the CPU: three decode rows padded to the bucket of 4 through the Triton backend
    (its split count sized from the capture-time longest context, the lengths read from the buffer) give the eager
    step's logits and greedy tokens, and write the same KV slots; the padding row wrote only the scratch block."""
    pytest.importorskip("triton")
    from firsttoken.attention import triton_kernels
    from firsttoken.attention.triton_backend import TritonBackend
    from firsttoken.loading.loader import load_model
    from firsttoken.runner.kv_cache import allocate_kv_caches

    device = "cpu" if triton_kernels.INTERPRETED else "cuda"  # a GPU machine runs the compiled kernels
    model = load_model(tiny_model_dir, torch.float32, device, attn_backend=TritonBackend(block_n=16),
                       cpu_kernels="off")
    config = model.config
    scratch = 10
    caches = allocate_kv_caches(config, scratch + 1, BLOCK, torch.float32, device)
    tables = [[3], [0, 4], [1, 6, 8]]
    prompts = [5, 17, 33]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the prompts' KV, eagerly
        ids = torch.randint(0, config.vocab_size, (sum(prompts),), generator=gen).to(device)
        positions = torch.cat([torch.arange(n) for n in prompts]).expand(3, -1).contiguous().to(device)
        model(ids, positions, caches, AttentionMetadata.build(prompts, [0, 0, 0], tables, BLOCK, device))
    ids, positions, _ = decode_step(prompts, tables)
    ids, positions = ids.to(device), positions.to(device)
    meta = AttentionMetadata.build([1] * 3, prompts, tables, BLOCK, device)
    eager_caches = [c.clone() for c in caches]
    with torch.no_grad():
        eager = model.compute_logits(model(ids, positions, eager_caches, meta))
        inputs = GraphInputs(max_rows=8, max_model_len=64, block_size=BLOCK, scratch_block=scratch, device=device)
        graphs = CudaGraphRunner(model, caches, inputs, capture_sizes(8))
        inputs.fill(4, ids, positions, meta)
        padded = graphs.forward(4)
    assert padded.shape == (4, config.vocab_size)
    torch.testing.assert_close(padded[:3], eager, atol=1e-4, rtol=0)
    assert padded[:3].argmax(-1).tolist() == eager.argmax(-1).tolist()
    assert torch.isfinite(padded).all()  # the padding row too
    for ours, theirs in zip(caches, eager_caches):
        torch.testing.assert_close(ours[:, :scratch], theirs[:, :scratch], atol=1e-6, rtol=0)  # real slots: same
        assert ours[:, scratch, 0].abs().sum() > 0 and theirs[:, scratch].abs().sum() == 0  # padding: scratch only


class AskedGraphs:
    """A stand-in for CudaGraphRunner.run: records what it was asked, answers with the eager forward's logits for
    batches up to ``largest`` rows (None above: the runner must run the step eagerly)."""

    def __init__(self, model, kv_caches, largest: int) -> None:
        self.model, self.kv_caches, self.largest = model, kv_caches, largest
        self.asked: list[tuple[int, ...]] = []

    def run(self, input_ids, positions, meta):
        self.asked.append(meta.query_lens)
        if meta.num_seqs > self.largest:
            return None
        return self.model.compute_logits(self.model(input_ids, positions, self.kv_caches, meta))


@pytest.mark.parametrize("largest", [8, 1])
def test_the_runner_asks_the_graphs_only_for_pure_decode_steps_and_samples_their_logits(tiny_model_dir, largest):
    from tests.engine.test_faults import build, chat, image_question, run_all

    def prompts(proc):
        return [chat(proc, "a", "Tell me about the sea."), chat(proc, "b", image_question()),
                chat(proc, "c", "Roll a die", temperature=1.0, seed=7)]

    engine, proc = build(tiny_model_dir)
    reference = run_all(engine, prompts(proc))
    engine, proc = build(tiny_model_dir)
    runner = engine.executor.runner
    runner.graphs = AskedGraphs(runner.model, runner.kv_caches, largest)
    assert run_all(engine, prompts(proc)) == reference
    assert runner.graphs.asked and all(set(q) == {1} for q in runner.graphs.asked)  # never a prefill step
    assert any(len(q) > 1 for q in runner.graphs.asked)  # batched decode steps were asked (and, at 1, run eagerly)


def test_cuda_graphs_resolve_once_auto_on_for_cuda_with_triton_only(tiny_model_dir):
    machine = Machine.detect(build_kernels=False)
    small = CacheConfig(kv_cache_memory_bytes=4 << 20)
    gpu, cpu = machine.with_cuda(CudaFacts(True, name="NVIDIA H200 (injected)")), machine.with_cuda(CudaFacts.absent())
    on = resolve_engine_config(EngineConfig(attention_backend="triton", cache=small,
                                            scheduler=SchedulerConfig(max_num_seqs=24)), tiny_model_dir, gpu)
    assert on.cuda_graph_sizes == (1, 2, 4, 8, 16, 24) and "cuda graphs: decode batches 1, 2, 4" in on.describe()
    reported = json.loads(json.dumps(on.as_dict()))  # what GET /v1/engine/config serves
    assert reported["cuda_graph_sizes"] == [1, 2, 4, 8, 16, 24] and reported["cuda_graphs_why"].startswith("auto")
    assert reported["requested"]["cuda_graphs"] == "auto"
    sdpa = resolve_engine_config(EngineConfig(cache=small), tiny_model_dir, gpu)
    off = resolve_engine_config(EngineConfig(attention_backend="triton", cache=small, cuda_graphs="off"),
                                tiny_model_dir, gpu)
    here = resolve_engine_config(EngineConfig(cache=small), tiny_model_dir, cpu)
    assert sdpa.cuda_graph_sizes == off.cuda_graph_sizes == here.cuda_graph_sizes == ()
    assert "sdpa backend's decode" in sdpa.cuda_graphs_why and off.cuda_graphs_why == "--cuda-graphs off"
    assert "cuda graphs: off (auto: device cpu" in here.describe()
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="on")  # type: ignore[arg-type]


def test_serve_help_lists_cuda_graphs():
    from firsttoken.cli.main import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    text = " ".join(serve.format_help().split())
    assert "--cuda-graphs {auto,off}" in text and "(default: auto)" in text.split("--cuda-graphs {auto,off} ")[-1]
