"""Tiny fakes for scheduler tests: requests made of ints, a 'runner' that only advances counters."""

from __future__ import annotations

import time

import torch

from firsttoken.batch import RunnerOutput, ScheduledBatch
from firsttoken.config import CacheConfig, SchedulerConfig
from firsttoken.scheduler.request import Request
from firsttoken.scheduler.scheduler import Scheduler
from firsttoken.types import (
    EncoderUnit,
    EngineRequest,
    ImageItem,
    SamplingParams,
)

IMAGE_TOKEN = 99


def fake_request(
    rid: str,
    prompt_len: int,
    max_tokens: int = 4,
    images: list[tuple[str, int, int]] = (),  # (content_hash, offset, num_tokens)
    arrival_seq: int = 0,
    shared_prefix: bool = False,
    encoder_depth: int = 1,  # encoder units per image, each costing its visual tokens
    units: tuple[EncoderUnit, ...] | None = None,  # every image's units instead (a model family's, e.g.)
) -> Request:
    salt = 0 if shared_prefix else sum(map(ord, rid)) * 7  # distinct prompts unless asked to share
    ids = [1 + ((i + salt) % 50) for i in range(prompt_len)]
    items = []
    for h, off, n in images:
        ids[off : off + n] = [IMAGE_TOKEN] * n
        unit = EncoderUnit(4 * n, 16 * n * n, n)
        items.append(ImageItem(h, off, n, (1, 2, 2 * n), units or (unit,) * encoder_depth, None))
    er = EngineRequest(
        request_id=rid,
        prompt_token_ids=tuple(ids),
        images=tuple(items),
        mrope_positions=torch.zeros((3, prompt_len), dtype=torch.long),
        mrope_delta=0,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        arrival_s=0.0,
        preprocessed_s=0.0,
    )
    return Request(er, arrival_seq)


class ManualClock:
    """A clock a test moves by hand (``clock.now += 61``), for whatever takes a ``clock`` callable."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 16,
    max_batched_tokens: int = 64,
    decode_reserve_tokens: int = 16,
    prefix_caching: bool = True,
    encoder_capacity_tokens: int = 1000,
    max_num_seqs: int = 64,
    cost_model=None,
    clock=None,
    **scheduler_options,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_batched_tokens=max_batched_tokens,
            decode_reserve_tokens=decode_reserve_tokens,
            max_num_seqs=max_num_seqs,
            **scheduler_options,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
        num_kv_blocks=num_blocks,
        max_model_len=num_blocks * block_size,
        encoder_capacity_tokens=encoder_capacity_tokens,
        cost_model=cost_model,
        clock=clock or time.monotonic,
    )


def run_step(sched: Scheduler, token: int = 7) -> ScheduledBatch:
    """schedule + pretend-execute + update: advance computed tokens, sample `token`, finish at max_tokens."""
    return complete_step(sched, sched.schedule(), token)


def complete_step(sched: Scheduler, batch: ScheduledBatch, token: int = 7) -> ScheduledBatch:
    """Pretend-execute a scheduled batch and update: what run_step does after schedule(); the scheduler appends
    `token` to each sampling request and ends it at its max_tokens."""
    progress = {w.content_hash: w.start_unit + w.num_units for w in batch.encoder_work}
    sampled = {c.request_id: token for c in batch.chunks if c.sample}
    sched.update(batch, RunnerOutput(sampled, {}, {}, encoder_progress=progress))
    sched.check_invariants()
    return batch
