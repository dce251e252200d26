"""Seeded workloads: a run is a sequence of sessions; a session is one request, or a conversation
whose follow-up turns resend the history (earlier user messages with their images + the server's
replies).

Session i depends only on (config, seed, i), so a workload can be built lazily for --duration runs
and two runs with one seed send the same requests. Classes name what a request is (``text``,
``1img``, ``3img``, ``video``: one synthetic MP4 clip in a ``video_url`` part;
``first``/``follow-up`` for multiturn; the server's classes ``0``/``1``/ ``2+``/``video`` for
workload files) and group the report.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from firsttoken.metrics.window import image_class
from firsttoken.tools.bench.config import BenchConfig, images_of_class, videos_of_class
from firsttoken.tools.bench.images import encode_data_url, synth_image

# Common English words; with a leading space each is one token in Qwen's and most BPE vocabularies,
# so N words is roughly N tokens.
_VOCAB = (
    "the of and to in is was for that with as on by at from this are be or which an not have has one their "
    "were all can more also other new some time these two may first only into would over about such after "
    "most many where what through between used under while both three well since world during part work "
    "state year city known system water people number house school power line form river music game group "
    "area family place point early light field market paper story money order court design price south "
    "north east west local model image table chart road train plant metal glass stone color green black "
    "white small large short long high low open close value level class report study"
).split()


@dataclass(frozen=True)
class BenchRequest:
    cls: str
    num_images: int
    body: dict[str, Any]  # a chat completion body; model and stream options are set when sent
    # True: body["messages"] is only the new turn; the session's history goes first
    follows: bool = False
    num_videos: int = 0


@dataclass(frozen=True)
class Session:
    index: int
    requests: tuple[BenchRequest, ...]


def words(n: int, seed: str) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_VOCAB) for _ in range(n))


class Workload:
    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self._file_bodies: list[dict[str, Any]] = []
        if config.workload == "file":
            assert config.workload_file is not None  # BenchConfig checked it
            lines = Path(config.workload_file).read_text().splitlines()
            self._file_bodies = [json.loads(line) for line in lines if line.strip()]
            if not self._file_bodies:
                raise ValueError(f"{config.workload_file}: no request bodies")

    def describe(self) -> dict[str, Any]:
        c = self.config
        d: dict[str, Any] = {"workload": c.workload, "seed": c.seed}
        if c.workload == "seed-mix":
            d |= {
                "mix": dict(c.mix),
                "text_tokens": c.text_tokens,
                "image_text_tokens": c.image_text_tokens,
                "image_size": f"{c.image_size[0]}x{c.image_size[1]}",
                "image_format": c.image_format,
            }
            if any(videos_of_class(name) for name, _ in c.mix):
                d |= {
                    "video_seconds": c.video_seconds,
                    "video_size": f"{c.video_size[0]}x{c.video_size[1]}",
                    "video_fps": c.video_fps,
                }
        elif c.workload == "text":
            d |= {"text_tokens": c.text_tokens}
        elif c.workload == "multiturn":
            d |= {"turns": 1 + c.turns, "images": c.multiturn_images, "text_tokens": c.text_tokens,
                  "image_size": f"{c.image_size[0]}x{c.image_size[1]}"}
        else:
            d |= {"file": c.workload_file, "bodies": len(self._file_bodies)}
        if c.workload != "file":
            d["output_tokens"] = c.output_tokens
        return d

    def session(self, index: int) -> Session:
        c = self.config
        if c.workload == "file":
            return Session(index, (self._file_request(index),))
        if c.workload == "text":
            return Session(index, (self._single(index, "text"),))
        if c.workload == "seed-mix":
            return Session(index, (self._single(index, self._pick_class(index)),))
        return self._conversation(index)

    # ---- builders --------------------------------------------------------------------------------
    def _pick_class(self, index: int) -> str:
        u = random.Random(f"{self.config.seed}:{index}:class").random()
        acc = 0.0
        for name, weight in self.config.mix:
            acc += weight
            if u < acc:
                return name
        return self.config.mix[-1][0]

    def _single(self, index: int, cls: str) -> BenchRequest:
        c = self.config
        n_images, n_videos = images_of_class(cls), videos_of_class(cls)
        n_words = c.text_tokens if n_images == n_videos == 0 else c.image_text_tokens
        message = self._user_message(f"{c.seed}:{index}:0", n_images, n_words, n_videos)
        return BenchRequest(cls, n_images, self._body([message]), num_videos=n_videos)

    def _conversation(self, index: int) -> Session:
        c = self.config
        first = self._user_message(f"{c.seed}:{index}:0", c.multiturn_images, c.text_tokens)
        turns = [BenchRequest("first", c.multiturn_images, self._body([first]))]
        for t in range(1, c.turns + 1):
            follow = {
                "role": "user",
                "content": "Follow-up: " + words(c.image_text_tokens, f"{c.seed}:{index}:{t}"),
            }
            turns.append(
                BenchRequest("follow-up", c.multiturn_images, self._body([follow]), follows=True)
            )
        return Session(index, tuple(turns))

    def _user_message(
        self, key: str, n_images: int, n_words: int, n_videos: int = 0
    ) -> dict[str, Any]:
        c = self.config
        text = words(n_words, f"{key}:text")
        if n_images == n_videos == 0:
            return {"role": "user", "content": text}
        w, h = c.image_size
        parts: list[dict[str, Any]] = [
            {
                "type": "image_url",
                "image_url": {
                    "url": encode_data_url(synth_image(w, h, f"{key}:img{k}"), c.image_format)
                },
            }
            for k in range(n_images)
        ]
        # PyAV only where a video is asked for: a GPU loan carries no video (docs/gpu.md)
        if n_videos:
            from firsttoken.tools.bench.videos import encode_video_data_url, synth_clip

            vw, vh = c.video_size
            parts += [
                {"type": "video_url", "video_url": {"url": encode_video_data_url(
                    synth_clip(c.video_seconds, vw, vh, c.video_fps, f"{key}:video{k}"))}}
                for k in range(n_videos)
            ]
        parts.append({"type": "text", "text": text})
        return {"role": "user", "content": parts}

    def _body(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        c = self.config
        body: dict[str, Any] = {
            "messages": messages,
            "max_tokens": c.output_tokens,
            "temperature": c.temperature,
        }
        if c.ignore_eos:
            body["ignore_eos"] = True
        return body | c.extra_body

    def _file_request(self, index: int) -> BenchRequest:
        body = dict(self._file_bodies[index % len(self._file_bodies)])
        cls = body.pop("bench_class", None)
        n_images, n_videos = count_images(body), count_videos(body)
        return BenchRequest(
            str(cls) if cls is not None else image_class(n_images, n_videos),
            n_images,
            body,
            num_videos=n_videos,
        )


def _count_parts(body: dict[str, Any], types: tuple[str, ...]) -> int:
    n = 0
    for message in body.get("messages", []):
        content = message.get("content")
        if isinstance(content, list):
            n += sum(1 for part in content if isinstance(part, dict) and part.get("type") in types)
    return n


def count_images(body: dict[str, Any]) -> int:
    return _count_parts(body, ("image_url",))


def count_videos(body: dict[str, Any]) -> int:
    """vLLM's ``video_url`` parts and Qwen's ``video`` (frame list) parts."""
    return _count_parts(body, ("video_url", "video"))
