"""A short request arriving while a step runs the long lane's vision-tower work stops that work at the next encoder
unit (the runner asks the serving side's signal between units): counted by units run per step, and the answer is
the same token for token as without interruptions."""

from __future__ import annotations

import base64

from firsttoken.api.protocol import ChatCompletionRequest
from firsttoken.config import SchedulerConfig
from firsttoken.inputs.video_synth import make_clip
from tests.e2e.conftest import make_image
from tests.engine.test_caches import Harness, user
from tests.helpers import process

PICTURE = make_image(224, 224, seed=5)
MESSAGES = [user("Describe the picture.", PICTURE)]
CLIP = "data:video/mp4;base64," + base64.b64encode(make_clip(2, 64, 48, fps=10, gop=5)).decode()  # 4 frames: 2 grids
VIDEO_MESSAGES = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": CLIP}},
                                               {"type": "text", "text": "Describe the clip."}]}]


def long_all(harness_dir, messages=MESSAGES, **changes) -> SchedulerConfig:
    """Every request in the long lane (threshold 1), token budgets, and a long-lane share per step of exactly the
    image's encoder units: each step's encoder work has all of them to cut between, and no chunk over the image
    (it could not start before the image is done)."""
    probe = Harness(harness_dir)
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": messages, "max_tokens": 1})
    units = [u for item in process(probe.processor, body, "probe").images for u in item.encoder_units]
    return SchedulerConfig(**{"max_batched_tokens": 4096, "long_prompt_threshold": 1, "step_time_target": "off",
                              "long_step_tokens": sum(u.cost_tokens for u in units), **changes})


def encoder_steps(harness: Harness, pending, messages=MESSAGES) -> tuple[list[int], list[tuple[int, ...]], list[int]]:
    """Run one image request with ``pending`` as the signal; returns (its tokens, units scheduled per step with
    encoder work, units run per such step)."""
    engine = harness.engine
    engine.short_arrivals.pending = pending
    scheduled, ran = [], []
    runner = engine.executor.runner
    execute, finish_step = runner.execute, runner.finish_step
    before: dict[str, int] = {}

    def spy_execute(batch):
        before.clear()
        before.update({h: j.units_done for h, j in runner._encode_jobs.items()})
        out = execute(batch)
        if batch.encoder_work:
            scheduled.append(tuple(w.num_units for w in batch.encoder_work))
            ran.append(sum(out.encoder_progress[w.content_hash] - before.get(w.content_hash, 0)
                           for w in batch.encoder_work if w.content_hash in out.encoder_progress))
        return out

    def spy_finish():
        late = finish_step()
        if late is not None:
            ran[-1] += sum(n - before.get(h, 0) for h, n in late.encoder_progress.items())
        return late

    engine.executor.execute, engine.executor.finish_step = spy_execute, spy_finish
    ids, _, _ = harness.run(messages, max_tokens=6)
    return ids, scheduled, ran


def test_a_short_arrival_stops_the_step_at_the_next_unit_and_the_answer_is_unchanged(tiny_model_dir):
    quiet = Harness(tiny_model_dir, scheduler=long_all(tiny_model_dir))
    ids, scheduled, ran = encoder_steps(quiet, lambda: False)
    num_units = sum(scheduled[0])
    assert num_units >= 2 and len(scheduled) == 1 and ran == [num_units]  # one step ran the whole encode

    busy = Harness(tiny_model_dir, scheduler=long_all(tiny_model_dir))
    asked = []
    ids_cut, scheduled_cut, ran_cut = encoder_steps(busy, lambda: asked.append(1) or True)  # always a short waiting
    assert ran_cut == [1] * num_units  # one unit per step: each step stopped right after its first unit
    assert [sum(s) for s in scheduled_cut] == list(range(num_units, 0, -1))  # each resumed where the last stopped
    assert ids_cut == ids  # the same encoder outputs, the same greedy answer
    assert busy.engine.stats().num_encoder_interrupts == num_units - 1
    assert busy.engine.executor.runner.num_vision_calls == 1  # one image encoded, in pieces, not restarted


def test_the_step_cost_is_learnt_from_the_units_that_ran(tiny_model_dir):
    h = Harness(tiny_model_dir, scheduler=long_all(tiny_model_dir))
    observed = []
    model = h.engine.scheduler.cost_model
    observe = model.observe
    model.observe = lambda features, seconds: observed.append(features) or observe(features, seconds)
    _, scheduled, ran = encoder_steps(h, lambda: True)
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, "max_tokens": 1})
    units = process(h.processor, body, "probe").images[0].encoder_units
    # scheduled: all the units left, every step; learnt: the one unit each step ran
    assert [sum(s) for s in scheduled] == list(range(len(units), 0, -1))
    assert [f.encoder_patches for f in observed if f.encoder_patches] == [u.num_patches for u in units]
    assert [f.encoder_attention for f in observed if f.encoder_patches] == [u.attention_pairs for u in units]


def test_no_interrupt_without_the_flag_or_when_a_chunk_needs_the_image_this_step(tiny_model_dir):
    off = Harness(tiny_model_dir, scheduler=long_all(tiny_model_dir, encoder_interrupt=False))
    _, scheduled, ran = encoder_steps(off, lambda: True)
    assert len(scheduled) == 1 and ran == [sum(scheduled[0])]  # --no-encoder-interrupt: the step runs whole
    assert off.engine.stats().num_encoder_interrupts == 0
    # a budget that holds the whole prompt: the image's last units and the chunk over its tokens share the step,
    # so none of them may be cut (the chunk needs the embeddings)
    whole = Harness(tiny_model_dir, scheduler=long_all(tiny_model_dir, long_step_tokens=100_000))
    batches = []
    execute = whole.engine.executor.runner.execute
    whole.engine.executor.runner.execute = lambda b: batches.append(b) or execute(b)
    _, scheduled, ran = encoder_steps(whole, lambda: True)
    with_chunk = [b for b in batches if b.encoder_work and any(not c.is_decode for c in b.chunks)]
    assert with_chunk and not any(w.interruptible for b in with_chunk for w in b.encoder_work)
    assert ran == [sum(s) for s in scheduled]


def test_the_serving_side_signals_only_short_requests_not_yet_handed_to_the_engine(tiny_model_dir):
    import asyncio

    from firsttoken.engine.async_engine import AsyncEngine

    h = Harness(tiny_model_dir, scheduler=SchedulerConfig(long_prompt_threshold=40, step_time_target="off"))
    bridge = AsyncEngine(h.engine)
    bridge.start(in_thread=False)  # no engine thread: the test applies the commands itself
    pending = h.engine.short_arrivals.pending
    short_body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [user("Hi")], "max_tokens": 1})
    short = process(h.processor, short_body, "short")
    long = process(h.processor, ChatCompletionRequest.model_validate(
        {"model": "m", "messages": MESSAGES, "max_tokens": 1}), "long")
    assert short.num_prompt_tokens < 40 <= long.num_prompt_tokens

    async def send(request):
        stream = bridge.generate(request)
        task = asyncio.ensure_future(stream.__anext__())  # runs generate() up to its first wait: the add is queued
        await asyncio.sleep(0)
        return task

    async def scenario():
        tasks = [await send(long)]
        assert not pending()  # a long request never cuts the long lane's work
        tasks.append(await send(short))
        assert pending()  # a short one is on its way: the step in flight may stop at its next unit
        bridge._drain_commands(block=False)  # the engine thread takes it in, between steps
        assert not pending() and h.engine.scheduler.has_work
        for t in tasks:
            t.cancel()

    asyncio.run(scenario())


def test_a_short_requests_first_token_leaves_before_the_long_lanes_units_in_its_step(tiny_model_dir):
    # aging every step (long_max_wait_steps 0): the long lane's units share the step that holds the short prefill
    config = long_all(tiny_model_dir, long_prompt_threshold=40, long_max_wait_steps=0)
    h = Harness(tiny_model_dir, scheduler=config)
    engine, runner = h.engine, h.engine.executor.runner
    photo = process(h.processor, ChatCompletionRequest.model_validate(
        {"model": "m", "messages": MESSAGES, "max_tokens": 1}), "photo")
    chat = process(h.processor, ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [user("Hi")], "max_tokens": 2}), "chat")
    engine.add_request(photo)
    engine.add_request(chat)
    seen = []

    def deliver(outputs):
        seen.append(([o.request_id for o in outputs], dict((h, j.units_done) for h, j in runner._encode_jobs.items()),
                     len(runner.encoder_outputs)))

    late = engine.step(deliver=deliver)
    assert seen == [(["chat"], {}, 0)]  # chat's first token went out before any of the photo's units ran
    assert late == []
    assert len(runner.encoder_outputs) == 1  # then the photo's units ran, in the same step
    while engine.has_unfinished():
        engine.step(deliver=lambda outputs: None)
    assert engine.stats().kv_blocks_used == 0


def test_a_video_encodes_grid_by_grid_and_a_short_arrival_cuts_it_at_every_unit(tiny_model_dir):
    """A video is one vision item per temporal grid: its encode splits across steps like several images', and a short
    request waiting stops each step after one unit, the answer unchanged."""
    config = long_all(tiny_model_dir, VIDEO_MESSAGES)
    quiet = Harness(tiny_model_dir, scheduler=config)
    ids, scheduled, ran = encoder_steps(quiet, lambda: False, VIDEO_MESSAGES)
    num_units = sum(scheduled[0])
    assert len(scheduled[0]) == 2 and len(scheduled) == 1 and ran == [num_units]  # both grids in one quiet step

    busy = Harness(tiny_model_dir, scheduler=config)
    ids_cut, scheduled_cut, ran_cut = encoder_steps(busy, lambda: True, VIDEO_MESSAGES)
    # the first grid unit by unit; once it is done, a prefill chunk over its tokens may reach into the second grid,
    # and the units that chunk needs run in its step (not interruptible), as for consecutive images
    assert ran_cut[:2] == [1, 1] and sum(ran_cut) == num_units and len(ran_cut) >= 3
    assert busy.engine.stats().num_encoder_interrupts >= 2
    assert ids_cut == ids
    assert busy.engine.executor.runner.num_vision_calls == 2  # each grid encoded once, in pieces
