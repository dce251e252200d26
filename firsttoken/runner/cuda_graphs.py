"""CUDA graphs for decode steps (issue 39, deliverable 3): one graph per batch-size bucket, captured
at start-up, replayed for every pure-decode step that fits a bucket; anything else (a step with a
prefill chunk or image rows, a batch above the largest bucket) runs eagerly.

A captured graph reads fixed addresses, so its inputs live in persistent buffers (``GraphInputs``)
sized for the largest bucket, filled in place each step: rows [0, n) from the step's packed inputs,
rows [n, bucket) padding. A padding row is token 0 at position 0, writes its key/value into the
scratch block (one block past the scheduler's pool, which no request ever owns) and attends to that
one slot (seq_len 1), so it never touches a real KV slot and never produces NaN; its logits are
dropped.

The graph is captured with the context lengths of the longest request (max_model_len), so an
attention backend that sizes its launch from them (the Triton decode's split count) captures a
launch that covers every replay; the lengths themselves are read from the buffer on the device. Only
a backend whose decode reads lengths and block tables from device tensors at a fixed grid can be
captured: the Triton backend (the resolve step enables graphs only with it).
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field

import torch

from firsttoken.attention.base import AttentionMetadata

log = logging.getLogger("firsttoken.runner")

PAD_TOKEN_ID = 0
PAD_POSITION = 0


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Decode batch sizes that get a graph (vLLM's capture sizes): 1, 2, 4, then every multiple of
    8, up to and including max_num_seqs."""
    if max_num_seqs < 1:
        raise ValueError("max_num_seqs must be >= 1")
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return (*sizes, max_num_seqs)


def bucket_for(num_seqs: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest capture size >= num_seqs (``sizes`` ascending); None above the largest: the step
    runs eagerly."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True)
class GraphAttentionMetadata(AttentionMetadata):
    """AttentionMetadata over the persistent buffers: ``seq_lens_tensor`` is the buffer the graph
    reads, not a tensor made from ``seq_lens`` (the Python tuples are capture-time values: one query
    per row, the longest context)."""

    seq_lens_buffer: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int32))

    @property
    def seq_lens_tensor(self) -> torch.Tensor:  # type: ignore[override]
        return self.seq_lens_buffer


class GraphInputs:
    """The persistent inputs of the decode graphs, for up to ``max_rows`` rows (the largest bucket)
    of contexts up to ``max_model_len`` tokens. ``scratch_block``: the KV block padding rows write
    to (one past the scheduler's)."""

    def __init__(self, max_rows: int, max_model_len: int, block_size: int, scratch_block: int,
                 device: torch.device | str) -> None:
        self.max_rows = max_rows
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size  # the slot every padding row writes
        max_blocks = -(-max_model_len // block_size)
        # [max_rows]
        self.input_ids = torch.full((max_rows,), PAD_TOKEN_ID, dtype=torch.long, device=device)
        # [3, rows] t,h,w
        self.positions = torch.full((3, max_rows), PAD_POSITION, dtype=torch.long, device=device)
        self.slot_mapping = torch.full(
            (max_rows,), self.scratch_slot, dtype=torch.long, device=device
        )
        self.block_tables = torch.full(
            (max_rows, max_blocks), scratch_block, dtype=torch.int32, device=device
        )
        # [max_rows], the new token included
        self.seq_lens = torch.ones(max_rows, dtype=torch.int32, device=device)
        # one query per row
        self.query_start_loc = torch.arange(max_rows + 1, dtype=torch.int32, device=device)

    def fill(
        self, bucket: int, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        """Rows [0, n) from a pure-decode step of n = meta.num_seqs rows (its packed inputs, on the
        buffers' device), rows [n, bucket) padding. In place: the addresses a graph captured stay
        valid."""
        n = meta.num_seqs
        if not n <= bucket <= self.max_rows:
            raise ValueError(f"{n} rows do not fit bucket {bucket} of at most {self.max_rows}")
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        # [3, n]; a decode step's may be one row seen as three
        self.positions[:, :n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        # past a row's own blocks: never read (seq_lens)
        self.block_tables[:n, width:].fill_(self.scratch_block)
        self.seq_lens[:n].copy_(meta.seq_lens_tensor)
        self.pad(n, bucket)

    def pad(self, start: int, end: int) -> None:
        """Rows [start, end) become padding rows."""
        self.input_ids[start:end].fill_(PAD_TOKEN_ID)
        self.positions[:, start:end].fill_(PAD_POSITION)
        self.slot_mapping[start:end].fill_(self.scratch_slot)
        self.block_tables[start:end].fill_(self.scratch_block)
        self.seq_lens[start:end].fill_(1)

    def metadata(self, bucket: int) -> GraphAttentionMetadata:
        """The attention metadata a graph of ``bucket`` rows is captured with: views of the buffers,
        and capture-time tuples of one query per row over the longest context."""
        return GraphAttentionMetadata(
            query_lens=(1,) * bucket,
            context_lens=(self.max_model_len - 1,) * bucket,
            block_tables=self.block_tables[:bucket],
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            block_size=self.block_size,
            seq_lens_buffer=self.seq_lens[:bucket],
        )


class CudaGraphRunner:
    """Decode steps through captured graphs: ``capture`` (CUDA only, once at start-up, largest
    bucket first, one memory pool for all) and ``run`` (a step's logits from its bucket's graph, or
    None: run it eagerly). ``forward`` is what each graph holds: the model over the buffers' first
    ``bucket`` rows, every row's logits [bucket, vocab] float32; the CPU tests call it directly."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], inputs: GraphInputs,
                 sizes: tuple[int, ...]) -> None:
        if not sizes or max(sizes) > inputs.max_rows:
            raise ValueError("capture sizes must be non-empty and fit the input buffers")
        self.model = model
        self.kv_caches = kv_caches
        self.inputs = inputs
        self.sizes = tuple(sorted(sizes))
        # bucket -> (graph, its logits)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # bucket -> seconds its capture took (warm-up included)
        self.capture_s: dict[int, float] = {}
        self.num_replays = 0  # decode steps a graph ran

    def forward(self, bucket: int) -> torch.Tensor:
        b = self.inputs
        out = self.model.forward_step(b.input_ids[:bucket], b.positions[:, :bucket], self.kv_caches,
                                      b.metadata(bucket), (), all_logits=True)
        return out.logits if out.logits is not None else self.model.compute_logits(out.hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per bucket, each after one eager warm-up on a side stream (kernels compiled,
        caches filled); the capture time per bucket is logged. Every row is padding meanwhile: only
        the scratch block is written."""
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.sizes):
            start = time.perf_counter()
            self.inputs.pad(0, bucket)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.forward(bucket)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.forward(bucket)
            torch.cuda.synchronize()
            self._graphs[bucket] = (graph, logits)
            self.capture_s[bucket] = time.perf_counter() - start
            log.info(
                "cuda graph for decode batches of %d captured in %.3f s",
                bucket,
                self.capture_s[bucket],
            )
        log.info("cuda graphs: %d decode buckets (%s) captured in %.1f s", len(self.sizes),
                 ", ".join(map(str, self.sizes)), sum(self.capture_s.values()))

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """A pure-decode step's logits [n, vocab] float32 from its bucket's graph (a view of the
        graph's output, valid until the next replay), or None above the largest bucket."""
        bucket = bucket_for(meta.num_seqs, self.sizes)
        if bucket is None:
            return None
        graph, logits = self._graphs[bucket]
        self.inputs.fill(bucket, input_ids, positions, meta)
        graph.replay()
        self.num_replays += 1
        return logits[: meta.num_seqs]
