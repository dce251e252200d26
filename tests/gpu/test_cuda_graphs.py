"""CUDA graphs for decode (issue 39, deliverable 3) on the device: the engine with --cuda-graphs auto (captured at
start-up, one graph per bucket) gives the same greedy tokens as with --cuda-graphs off, over batches that shrink
through every bucket size (11 rows padded to 16, then 8, 4, 2, 1 as requests finish). fp32, the Triton backend
(auto captures only with it). Not yet run on a GPU (it is only compiled here)."""

from __future__ import annotations

from pathlib import Path

from firsttoken.llm import LLM

PROMPTS = [f"Story {i}: once upon a time there was" for i in range(11)]


def greedy_batch(llm: LLM) -> list[tuple[int, ...]]:
    """Every prompt at once, each with its own length (so the decode batch shrinks step by step)."""
    results = llm.complete(PROMPTS, [{"temperature": 0, "max_tokens": 4 + 3 * i, "ignore_eos": True}
                                     for i in range(len(PROMPTS))])
    assert [r.error for r in results] == [None] * len(PROMPTS)
    return [tuple(r.token_ids) for r in results]


def engine(tiny_model_dir: Path, cuda_graphs: str) -> LLM:
    return LLM(tiny_model_dir, device="cuda", dtype="float32", attention_backend="triton", cuda_graphs=cuda_graphs,
               kv_cache_memory="16MiB", max_num_seqs=16)


def test_graphs_on_and_off_give_the_same_greedy_tokens(tiny_model_dir: Path) -> None:
    on = engine(tiny_model_dir, "auto")
    graphs = on.engine.executor.runner.graphs
    assert on.engine.resolved.cuda_graph_sizes == (1, 2, 4, 8, 16) and graphs is not None
    assert set(graphs.capture_s) == {1, 2, 4, 8, 16}  # each captured (and its time logged) at start-up
    with_graphs = greedy_batch(on)
    assert graphs.num_replays > 0
    off = engine(tiny_model_dir, "off")
    assert off.engine.executor.runner.graphs is None
    assert greedy_batch(off) == with_graphs


def test_a_request_after_a_batch_still_matches(tiny_model_dir: Path) -> None:
    """Replays leave no state behind: one request alone after a padded batch gives its tokens alone."""
    alone = engine(tiny_model_dir, "off").complete(PROMPTS[3], {"temperature": 0, "max_tokens": 12})
    on = engine(tiny_model_dir, "auto")
    greedy_batch(on)
    again = on.complete(PROMPTS[3], {"temperature": 0, "max_tokens": 12})
    assert again.error is None and again.token_ids == alone.token_ids
