"""BenchConfig: everything one benchmark run depends on; with the seed it names the workload
exactly."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

WORKLOADS = ("seed-mix", "text", "multiturn", "file")
# video: one synthetic clip (video_seconds, _size, _fps)
_CLASS_RE = re.compile(r"^(text|video|(\d+)img)$")


def parse_mix(text: str) -> tuple[tuple[str, float], ...]:
    """'text=0.5,1img=0.3,3img=0.2' -> (('text', 0.5), ('1img', 0.3), ('3img', 0.2)); weights are
    normalized."""
    pairs = []
    for part in text.split(","):
        name, sep, weight = part.strip().partition("=")
        if not sep or _CLASS_RE.match(name) is None:
            raise ValueError(f"mix entries look like text=0.5, 3img=0.2 or video=0.1, got {part!r}")
        pairs.append((name, float(weight)))
    total = sum(w for _, w in pairs)
    if total <= 0 or any(w < 0 for _, w in pairs):
        raise ValueError("mix weights must be >= 0 and not all zero")
    return tuple((n, w / total) for n, w in pairs)


def videos_of_class(name: str) -> int:
    if _CLASS_RE.match(name) is None:
        raise ValueError(f"unknown class {name!r}")
    return int(name == "video")


def images_of_class(name: str) -> int:
    m = _CLASS_RE.match(name)
    if m is None:
        raise ValueError(f"unknown class {name!r}")
    return int(m.group(2)) if m.group(2) else 0


def parse_size(text: str) -> tuple[int, int]:
    """'1024x768' -> (1024, 768) as (width, height)."""
    w, sep, h = text.lower().partition("x")
    if not sep or not w.isdigit() or not h.isdigit() or int(w) < 1 or int(h) < 1:
        raise ValueError(f"a size looks like 1024x1024, got {text!r}")
    return int(w), int(h)


@dataclass(frozen=True)
class BenchConfig:
    url: str  # server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)
    model: str | None = None  # None: the body's own model, else the first id of GET /v1/models
    workload: str = "seed-mix"
    mix: tuple[tuple[str, float], ...] = (("text", 0.5), ("1img", 0.3), ("3img", 0.2))
    image_size: tuple[int, int] = (1024, 1024)  # (width, height)
    image_format: str = "jpeg"  # jpeg | png
    text_tokens: int = 800  # text-only prompt length, roughly (deterministic words)
    image_text_tokens: int = 32  # the question beside the images (or the video)
    # the video class's clip: duration, frame size (width, height; even) and frame rate
    video_seconds: float = 4.0
    video_size: tuple[int, int] = (640, 360)
    video_fps: int = 24
    output_tokens: int = 128  # max_tokens of generated requests
    # vendor extra understood by firsttoken, vLLM and SGLang: fixed output lengths
    ignore_eos: bool = True
    turns: int = 3  # multiturn: follow-ups after the first turn
    multiturn_images: int = 3
    workload_file: str | None = None
    # Poisson arrivals, sessions/s; None: back to back under `concurrency`
    rate: float | None = None
    # instead of rate: Poisson at U x the measured capacity (calibrate.py)
    utilization: float | None = None
    # with utilization: sessions per class sent alone to measure service time
    calibration_requests: int = 3
    # cap on sessions in flight (None with rate: unbounded; both None: 1)
    concurrency: int | None = None
    # sessions (a multiturn conversation is one session of 1 + turns requests)
    num_requests: int | None = 100
    duration_s: float | None = None  # stop starting sessions after this long
    warmup: int = 0  # first sessions, excluded from statistics
    seed: int = 0
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    timeout_s: float = 600.0
    temperature: float = 0.0
    progress: bool = True
    extra_body: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.workload!r}")
        if self.workload == "file" and not self.workload_file:
            raise ValueError("workload 'file' needs workload_file")
        if not self.video_seconds > 0 or self.video_fps < 1:
            raise ValueError("video_seconds must be > 0 and video_fps >= 1")
        if self.video_size[0] % 2 or self.video_size[1] % 2:
            raise ValueError(
                f"video_size must be even in both sides (yuv420p), got {self.video_size}"
            )
        if self.image_format not in ("jpeg", "png"):
            raise ValueError("image_format must be jpeg or png")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("rate must be > 0")
        if self.utilization is not None and self.rate is not None:
            raise ValueError("give rate or utilization, not both")
        if self.utilization is not None and self.utilization <= 0:
            raise ValueError("utilization must be > 0 (1 = sessions offered as fast as they finish one at a time)")
        if self.calibration_requests < 1:
            raise ValueError("calibration_requests must be >= 1")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("give num_requests or duration_s")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if self.warmup < 0 or self.turns < 0 or self.output_tokens < 1 or self.text_tokens < 0:
            raise ValueError("warmup, turns, text_tokens must be >= 0 and output_tokens >= 1")

    @property
    def base_url(self) -> str:
        url = self.url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url
