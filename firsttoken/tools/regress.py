"""Quality regression across visual-token budgets: does lowering the budget change the answers?

Every prompt runs on every image under each budget, greedily (temperature 0), with the budget sent
per image as ``image_url.max_visual_tokens``. Answers under each budget are compared with the
largest budget's answers:

    exact     fraction of (image, prompt) pairs whose answer text is identical
    overlap   mean token F1 between the two answers' tokens (the server's token strings from logprobs;
              whitespace words if a server returns none), 1.0 for identical answers

Per budget it also reports the mean visual tokens per image (from /tokenize) and the mean TTFT (the
server's ``usage.firsttoken.ttft_s`` when present, else the client's wall time of the whole
non-streamed request). The verdict fails when any budget's exact agreement is below
``min_agreement``.

Videos run the same way, each alone with each prompt, under their own budgets (per video, sent as
``video_url.max_visual_tokens``; visual tokens per video from /tokenize's ``videos``): a separate
report, since an image's and a video's budgets mean different things.

It talks HTTP to any server that honours ``max_visual_tokens`` (ours, by URL); without a URL the
caller starts our server in-process (``cli/regress.py``), so both paths measure the same thing.
Random-weight checkpoints agree with themselves only when the model sees the same pixels, so on them
the report answers "did the budget change what the model saw", which is the regression this guards
against.
"""

from __future__ import annotations

import base64
import mimetypes
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff")
VIDEO_SUFFIXES = (".mp4", ".m4v", ".mov", ".webm", ".mkv", ".avi")
_VIDEO_MIME = {
    ".mp4": "video/mp4",
    ".m4v": "video/mp4",
    ".mov": "video/quicktime",
    ".webm": "video/webm",
    ".mkv": "video/x-matroska",
    ".avi": "video/x-msvideo",
}
# kind -> the content part (and /tokenize's list: kind + s)
MEDIA_PART = {"image": "image_url", "video": "video_url"}


@dataclass(frozen=True)
class Answer:
    text: str
    tokens: tuple[str, ...]
    visual_tokens: int  # of the one image (or video) in the prompt
    ttft_s: float
    tiles: int | None = None  # a tiling family's tiles for the image (/tokenize's num_tiles)


@dataclass(frozen=True)
class BudgetReport:
    budget: int
    num_answers: int
    mean_visual_tokens: float
    mean_ttft_s: float
    exact_agreement: float  # vs the largest budget's answers
    token_overlap: float  # mean token F1 vs the largest budget's answers
    mean_tiles: float | None = None  # a tiling family's tiles per image; None: native resolution


@dataclass(frozen=True)
class RegressReport:
    reference_budget: int
    budgets: tuple[BudgetReport, ...]
    min_agreement: float | None
    kind: str = "image"  # image | video: what the budgets are per

    @property
    def passed(self) -> bool:
        return self.min_agreement is None or all(
            b.exact_agreement >= self.min_agreement for b in self.budgets
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "reference_budget": self.reference_budget,
            "min_agreement": self.min_agreement,
            "passed": self.passed,
            "budgets": [asdict(b) for b in self.budgets],
        }


def list_images(directory: Path) -> list[Path]:
    images = sorted(p for p in directory.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not images:
        raise ValueError(f"no images ({', '.join(IMAGE_SUFFIXES)}) in {directory}")
    return images


def list_videos(directory: Path) -> list[Path]:
    videos = sorted(p for p in directory.iterdir() if p.suffix.lower() in VIDEO_SUFFIXES)
    if not videos:
        raise ValueError(f"no videos ({', '.join(VIDEO_SUFFIXES)}) in {directory}")
    return videos


def read_prompts(path: Path) -> list[str]:
    prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"no prompts in {path} (one per line)")
    return prompts


def data_url(path: Path) -> str:
    mime = _VIDEO_MIME.get(path.suffix.lower()) or mimetypes.guess_type(path.name)[0] or "image/png"
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()


class ChatServer:
    """The two calls regress needs from a server: count (/tokenize) and answer
    (/v1/chat/completions)."""

    def __init__(
        self,
        url: str,
        model: str | None = None,
        max_tokens: int = 16,
        timeout_s: float = 600.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.http = httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s, transport=transport)
        self.model = model or self.http.get("/v1/models").raise_for_status().json()["data"][0]["id"]
        self.max_tokens = max_tokens

    def ask(self, media_url: str, prompt: str, budget: int, kind: str = "image") -> Answer:
        part = MEDIA_PART[kind]
        messages = [
            {
                "role": "user",
                "content": [
                    {"type": part, part: {"url": media_url, "max_visual_tokens": budget}},
                    {"type": "text", "text": prompt},
                ],
            }
        ]
        counted = self._post("/tokenize", {"model": self.model, "messages": messages})
        started = time.perf_counter()
        body = self._post(
            "/v1/chat/completions",
            {
                "model": self.model,
                "messages": messages,
                "max_tokens": self.max_tokens,
                "temperature": 0.0,
                "logprobs": True,
                "seed": 0,
            },
        )
        wall_s = time.perf_counter() - started
        choice = body["choices"][0]
        text = choice["message"]["content"] or ""
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        tokens = tuple(e["token"] for e in logprobs) if logprobs else tuple(text.split())
        ttft_s = ((body.get("usage") or {}).get("firsttoken") or {}).get("ttft_s") or wall_s
        item = counted[f"{kind}s"][0]
        return Answer(text, tokens, item["num_tokens"], ttft_s, item.get("num_tiles"))

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.http.post(path, json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{path} answered {r.status_code}: {r.text[:300]}")
        return r.json()

    def close(self) -> None:
        self.http.close()


def token_f1(a: Sequence[str], b: Sequence[str]) -> float:
    if not a and not b:
        return 1.0
    common = sum((Counter(a) & Counter(b)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(a), common / len(b)
    return 2 * precision * recall / (precision + recall)


def run_regress(
    server: ChatServer,
    images: Sequence[Path],
    prompts: Sequence[str],
    budgets: Sequence[int],
    min_agreement: float | None = None,
    kind: str = "image",
) -> RegressReport:
    """Every prompt on every item (images, or videos with ``kind="video"``) under each budget."""
    if not budgets:
        raise ValueError("give at least one budget")
    ordered = sorted(set(budgets), reverse=True)
    urls = [data_url(p) for p in images]
    answers = {b: [server.ask(u, q, b, kind) for u in urls for q in prompts] for b in ordered}
    reference = answers[ordered[0]]
    reports = []
    for b in ordered:
        got = answers[b]
        reports.append(
            BudgetReport(
                budget=b,
                num_answers=len(got),
                mean_visual_tokens=statistics.fmean(a.visual_tokens for a in got),
                mean_ttft_s=statistics.fmean(a.ttft_s for a in got),
                exact_agreement=statistics.fmean(
                    float(a.text == r.text) for a, r in zip(got, reference)
                ),
                token_overlap=statistics.fmean(
                    token_f1(a.tokens, r.tokens) for a, r in zip(got, reference)
                ),
                mean_tiles=(None if any(a.tiles is None for a in got)
                            else statistics.fmean(a.tiles or 0 for a in got)),
            )
        )
    return RegressReport(ordered[0], tuple(reports), min_agreement, kind)


def format_report(report: RegressReport) -> str:
    tiled = any(b.mean_tiles is not None for b in report.budgets)
    lines = [
        f"{'budget':>7}  {'answers':>7}  {'visual tok/' + ('img' if report.kind == 'image' else 'video'):>14}  "
        + (f"{'tiles/img':>9}  " if tiled else "")
        + f"{'mean TTFT s':>11}  {'exact':>6}  {'overlap':>7}"
    ]
    for b in report.budgets:
        tiles = f"{b.mean_tiles:>9.1f}  " if b.mean_tiles is not None else (f"{'-':>9}  " if tiled else "")
        lines.append(
            f"{b.budget:>7}  {b.num_answers:>7}  {b.mean_visual_tokens:>14.1f}  {tiles}{b.mean_ttft_s:>11.3f}  "
            f"{b.exact_agreement:>6.2f}  {b.token_overlap:>7.2f}"
        )
    verdict = (
        ""
        if report.min_agreement is None
        else (f"; {'PASS' if report.passed else 'FAIL'}: min exact agreement {report.min_agreement:.2f}")
    )
    lines.append(f"agreement is against budget {report.reference_budget}{verdict}")
    return "\n".join(lines)
