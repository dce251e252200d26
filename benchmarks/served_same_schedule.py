"""Does a refactor change what the served path decides? The same seeded requests go through this checkout's served
path and another's (``--before DIR``): the input processor and the admission check as the server's preprocessing
threads run them (the budget lowered under load, refusals), ``AsyncEngine``'s admission places, and ``LLMEngine``'s
steps on a fake runner whose steps take virtual seconds (a fixed price per token, per encoder patch and per step), on
a virtual clock. ``sim_same_schedule.py`` drives the simulator's own copy of admission; this drives the server's.

    python benchmarks/served_same_schedule.py --before /path/to/other/checkout [--json OUT]

Compares every step's batch (each chunk's tokens, each encoder work's units, preemptions) and every request's
outcome (refusal and its status, prompt length, the image budget note, predicted TTFT, output tokens, finish reason,
first-token and end times); prints how many differ (0: the same schedule). The mix: text chats, raw completions,
one and three images at several sizes and budgets (detail low, max_visual_tokens), a frame-list video and an MP4,
a JSON-schema grammar, tools, requests refused for their input, under a TTFT objective that lowers image budgets,
at about 0.9 of the fake runner's capacity.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# runs inside the checkout under test (its firsttoken first on sys.path); argv: model dir, number of requests
CHILD = r'''
import inspect, json, sys, time, zlib

class Clock:
    now = 1000.0
    def __call__(self):
        return self.now

CLOCK = Clock()
time.monotonic = CLOCK  # before firsttoken binds it (the scheduler's clock default, the engine's stamps)
time.perf_counter = CLOCK

import base64, io, random
from dataclasses import replace
from types import SimpleNamespace
from PIL import Image
from firsttoken.api.protocol import ChatCompletionRequest, CompletionRequest
from firsttoken.batch import RunnerOutput
from firsttoken.config import EngineConfig, GenerationDefaults, ImageConfig, SchedulerConfig
from firsttoken.engine.async_engine import AsyncEngine
from firsttoken.engine.engine import LLMEngine
from firsttoken.inputs.processor import InputProcessor, load_tokenizer
from firsttoken.inputs.video_synth import make_clip
try:
    from firsttoken.api.intake import AdmissionRefused, Intake
except ImportError:  # a checkout from before the intake: the processor asked admission itself
    from firsttoken.inputs.processor import AdmissionRefused
    Intake = None

PRICE_TOKEN_S, PRICE_PATCH_S, PRICE_STEP_S, PRICE_DECODE_S = 2e-4, 2e-5, 5e-3, 1e-3
STEPS = []


class FakeExecutor:
    """Every step costs virtual seconds by a fixed price list; sampled tokens are a function of the request and
    its position (never EOS); interruptible encoder work runs after the tokens (finish_step), never cut."""

    def __init__(self, *args, **kwargs):
        self.units = {}

    def profile_step(self, step):
        pass

    def allocate_kv_cache(self, *args, **kwargs):
        pass

    @property
    def encoder_cache_bytes(self):
        return 0

    deferred = ()

    def finish_step(self):
        work, self.deferred = self.deferred, ()
        if not work:
            return None
        encoder_s, encoded, progress, done = self.encode(work)
        return RunnerOutput({}, {}, {}, encoder_progress=progress, encoder_s=encoder_s,
                            num_images_encoded=encoded, encoder_done_s=done)

    def encode(self, work):
        encoder_s, encoded, progress, done = {}, {}, {}, {}
        for w in work:
            req = ENGINE.requests[w.request_id]
            units = req.images[w.image_index].encoder_units[w.start_unit:w.start_unit + w.num_units]
            seconds = sum(u.num_patches for u in units) * PRICE_PATCH_S
            CLOCK.now += seconds
            encoder_s[w.request_id] = encoder_s.get(w.request_id, 0.0) + seconds
            encoded[w.request_id] = encoded.get(w.request_id, 0) + int(w.finishes)
            progress[w.content_hash] = w.start_unit + w.num_units
            done[w.request_id] = CLOCK.now
        return encoder_s, encoded, progress, done

    def execute(self, batch):
        start = CLOCK.now
        self.deferred = [w for w in batch.encoder_work if w.interruptible]
        encoder_s, encoded, progress, done = self.encode([w for w in batch.encoder_work if not w.interruptible])
        forward = PRICE_STEP_S + sum(PRICE_DECODE_S if c.is_decode else c.num_new_tokens * PRICE_TOKEN_S
                                     for c in batch.chunks)
        CLOCK.now += forward
        sampled = {}
        for c in batch.chunks:
            if c.sample:
                req = ENGINE.requests[c.request_id]
                sampled[c.request_id] = 300 + (zlib.crc32(c.request_id.encode()) + len(req.output_token_ids)) % 500
        STEPS.append([round(start, 6), [[c.request_id, c.context_len, c.num_new_tokens, c.sample] for c in batch.chunks],
                      [[w.request_id, w.image_index, w.start_unit, w.num_units, w.interruptible]
                       for w in batch.encoder_work], sorted(batch.preempted_request_ids)])
        return RunnerOutput(sampled, {}, {}, encoder_progress=progress, encoder_s=encoder_s,
                            num_images_encoded=encoded, encoder_done_s=done, forward_done_s=CLOCK.now,
                            sample_done_s=CLOCK.now, forward_s=forward)


def png_url(w, h, seed):
    rng = random.Random(seed)
    img = Image.new("RGB", (w, h), (rng.randrange(256), rng.randrange(256), rng.randrange(256)))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def bodies(n, seed):
    rng = random.Random(seed)
    mp4 = "data:video/mp4;base64," + base64.b64encode(make_clip(2, 64, 48, fps=10, gop=5)).decode()
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing".split()
    out = []
    for i in range(n):
        kind = rng.choice(["text", "text", "raw", "long", "img", "img", "img3", "low", "cap", "frames", "mp4",
                           "grammar", "tools", "bad"])
        say = " ".join(rng.choice(words) for _ in range(rng.randrange(5, 40)))
        img = lambda k: {"type": "image_url", "image_url": {"url": png_url(*rng.choice(
            [(64, 48), (448, 448), (896, 896), (1024, 768), (300, 1200)]), seed * 1000 + i * 10 + k)}}
        content = [{"type": "text", "text": say}]
        extra = {"max_tokens": rng.randrange(2, 12)}
        if kind == "raw":
            out.append((kind, CompletionRequest(model="m", prompt=say, **extra)))
            continue
        if kind == "long":
            content = [{"type": "text", "text": " ".join(rng.choice(words) for _ in range(900))}]
        elif kind == "img":
            content = [img(0)] + content
        elif kind == "img3":
            content = [img(0), img(1), img(2)] + content
        elif kind == "low":
            part = img(0)
            part["image_url"]["detail"] = "low"
            content = [part] + content
        elif kind == "cap":
            part = img(0)
            part["image_url"]["max_visual_tokens"] = rng.choice([64, 256, 700])
            content = [part] + content
        elif kind == "frames":
            content = [{"type": "video", "video": [png_url(112, 84, i * 10 + k) for k in range(4)]}] + content
        elif kind == "mp4":
            content = [{"type": "video_url", "video_url": {"url": mp4}}] + content
        elif kind == "grammar":
            extra["response_format"] = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
                "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
        elif kind == "tools":
            extra["tools"] = [{"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string"}}}}}]
        elif kind == "bad":
            content = [img(k) for k in range(9)] + content  # over the limit of images per request
        out.append((kind, ChatCompletionRequest(model="m", messages=[{"role": "user", "content": content}], **extra)))
    return out


model_dir, n = sys.argv[1], int(sys.argv[2])
images = ImageConfig(image_max_tokens=1024, image_min_tokens_under_load=64, max_images_per_request=8)
config = EngineConfig(num_threads=1, scheduler=SchedulerConfig(ttft_slo="text=0.5,image=1.5"))
tokenizer = load_tokenizer(model_dir)
ENGINE = LLMEngine(model_dir, config, tokenizer.backend_tokenizer, executor_factory=FakeExecutor,
                   profile_image_tokens=images.image_max_tokens)
ENGINE.calibrate()
STEPS.clear()
bridge = AsyncEngine(ENGINE)  # its thread is not started: this loop is the engine thread
processor = InputProcessor(tokenizer, ENGINE.model_config, GenerationDefaults.from_pretrained(model_dir),
                           max_model_len=ENGINE.max_model_len, images=images)
if Intake is None:
    processor.admission = bridge.check_admission
    admit = processor.process
else:
    admit = Intake(processor, bridge).request
rng = random.Random(7)
arrivals, t = [], CLOCK.now
for i, (kind, body) in enumerate(bodies(n, 11)):
    t += rng.expovariate(1 / 0.25)
    arrivals.append((t, f"r{i}", kind, body))
outcomes = {}


def record(outputs):
    for out in outputs:
        o = outcomes[out.request_id]
        o["tokens"] += list(out.new_token_ids)
        o.setdefault("first", round(CLOCK.now, 6))
        if out.finished:
            o.update(end=round(CLOCK.now, 6), finish=out.finish_reason.value, error=out.error)


pending = list(arrivals)
while pending or ENGINE.has_unfinished():
    if pending and (pending[0][0] <= CLOCK.now or not ENGINE.has_unfinished()):
        at, rid, kind, body = pending.pop(0)
        CLOCK.now = max(CLOCK.now, at)
        o = outcomes[rid] = {"kind": kind, "arrival": round(at, 6)}
        try:
            er = admit(body.prompts()[0], body.to_sampling(), rid, at)
        except AdmissionRefused as err:
            o.update(refused=err.verdict.reason, status=err.verdict.status, param=err.param)
            continue
        except ValueError as err:
            o.update(invalid=str(err), param=getattr(err, "param", None))
            continue
        bridge.release(rid)
        ENGINE.add_request(er)
        o.update(prompt=er.num_prompt_tokens, images=[[im.num_tokens, im.grid_thw, im.content_hash] for im in er.images],
                 note=er.image_budget_note, predicted=None if er.predicted_ttft_s is None else round(er.predicted_ttft_s, 6),
                 tokens=[])
        continue
    # outputs are timed when the engine hands them over (``deliver``: before a step's deferred units, where the
    # engine has it)
    record(ENGINE.step(deliver=record) if "deliver" in inspect.signature(ENGINE.step).parameters else ENGINE.step())
json.dump({"steps": STEPS, "outcomes": outcomes}, sys.stdout)
'''


def run(checkout: Path, model_dir: Path, n: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    # cwd = the checkout: python puts the cwd first on sys.path, ahead of PYTHONPATH
    out = subprocess.run([sys.executable, "-c", CHILD, str(model_dir), str(n)], cwd=checkout, env=env,
                         capture_output=True, text=True, check=False)
    if out.returncode:
        sys.exit(f"{checkout}: the child failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="the other checkout (its repository root)")
    ap.add_argument("--num-requests", type=int, default=120)
    ap.add_argument("--json", type=Path, help="write both runs' steps and outcomes here")
    args = ap.parse_args()
    here = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        make = f"from firsttoken.models.checkpoint import make_model; make_model({tmp!r}, size='tiny', seed=0)"
        subprocess.run([sys.executable, "-c", make], cwd=here, env={**os.environ, "PYTHONPATH": str(here)},
                       check=True, capture_output=True)
        before, after = run(args.before.resolve(), Path(tmp), args.num_requests), run(here, Path(tmp),
                                                                                      args.num_requests)
    steps_differ = sum(a != b for a, b in zip(before["steps"], after["steps"])) + abs(
        len(before["steps"]) - len(after["steps"]))
    ids = sorted(set(before["outcomes"]) | set(after["outcomes"]), key=lambda r: int(r[1:]))
    differ = [r for r in ids if before["outcomes"].get(r) != after["outcomes"].get(r)]
    kinds: dict[str, int] = {}
    for o in after["outcomes"].values():
        key = o["kind"] + (" refused" if "refused" in o else " invalid" if "invalid" in o else
                           " lowered" if o.get("note") else "")
        kinds[key] = kinds.get(key, 0) + 1
    print(f"requests {len(ids)}: {', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}")
    print(f"steps: before {len(before['steps'])}, after {len(after['steps'])}, differing {steps_differ}")
    print(f"outcomes differing: {len(differ)} of {len(ids)}")
    for r in differ[:5]:
        print(f"  {r}: before {before['outcomes'].get(r)}\n  {' ' * len(r)}  after  {after['outcomes'].get(r)}")
    if args.json:
        args.json.write_text(json.dumps({"before": str(args.before), "before_run": before, "after_run": after},
                                        indent=None))
    sys.exit(1 if differ or steps_differ else 0)


if __name__ == "__main__":
    main()
