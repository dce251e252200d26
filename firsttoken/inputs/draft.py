"""A prompt between planning and decoding: its final token ids, each image's plan from its header,
each video's plan from its container, and what /tokenize reports of it."""

from __future__ import annotations

from dataclasses import dataclass

from firsttoken.inputs.budget import ImagePlan
from firsttoken.inputs.video import VideoHeader, VideoIndex, VideoPlan
from firsttoken.types import PromptWork


@dataclass(frozen=True)
class PlannedVideo:
    """A video planned from its header and packets (or its frames' headers), not decoded yet."""

    plan: VideoPlan
    sources: tuple[bytes, ...]  # the container's bytes (one), or each frame's encoded bytes
    header: VideoHeader | None  # None: a frame list
    index: VideoIndex | None
    param: str


@dataclass(frozen=True)
class PromptPlan:
    """A prompt whose length is final but whose images are not decoded yet."""

    token_ids: tuple[int, ...]  # image pads already expanded to each plan's num_tokens
    plans: tuple[ImagePlan, ...]
    blobs: tuple[bytes, ...]  # each image's encoded bytes, header already probed
    offsets: tuple[int, ...]  # index of each image's first pad token in token_ids
    # before expansion: one pad per image (re-expanded when the budget drops)
    template_ids: tuple[int, ...] = ()
    # per image: the client left its budget to the server (no detail, no cap)
    degradable: tuple[bool, ...] = ()
    params: tuple[str, ...] = ()  # per image: its request field, messages[i].content[j].image_url
    videos: tuple[PlannedVideo, ...] = ()
    # per video, the index of each temporal grid's first pad token
    video_offsets: tuple[tuple[int, ...], ...] = ()

    @property
    def num_image_tokens(self) -> int:
        return sum(p.num_tokens for p in self.plans)

    @property
    def num_video_tokens(self) -> int:
        return sum(v.plan.num_tokens for v in self.videos)

    @property
    def degradable_budget(self) -> int:
        """The largest budget among the images whose budget the client left to the server (0:
        none): where lowering it under load starts."""
        return max((p.budget_tokens for p, d in zip(self.plans, self.degradable) if d), default=0)

    def describe(self) -> str:
        """'52 text and template tokens + 3 images of 1225, 1225, 256 visual tokens + 1 video of 32
        frames, 4096 visual tokens' (what a limit message counts)."""
        num_text = len(self.token_ids) - self.num_image_tokens - self.num_video_tokens
        out = f"{num_text} text and template tokens"
        if self.plans:
            per_image = ", ".join(str(p.num_tokens) for p in self.plans)
            noun = "image" if len(self.plans) == 1 else "images"
            out += f" + {len(self.plans)} {noun} of {per_image} visual tokens"
        if self.videos:
            per_video = ", ".join(
                f"{v.plan.num_frames} frames, {v.plan.num_tokens} visual tokens"
                for v in self.videos
            )
            noun = "video" if len(self.videos) == 1 else "videos"
            out += f" + {len(self.videos)} {noun} of {per_video}"
        return out


@dataclass(frozen=True)
class ImageTokens:
    original_size: tuple[int, int]  # (width, height) as decoded
    resized_size: tuple[int, int]  # (width, height) after smart_resize
    num_tokens: int  # visual tokens after the 2x2 merge
    budget_tokens: int  # the budget the image was planned under
    # a tiling family's cut: (rows, cols) of the crops, and tiles with the thumbnail; None: native
    tile_grid: tuple[int, int] | None = None
    num_tiles: int | None = None


@dataclass(frozen=True)
class VideoTokens:
    """A video as planned from its container's header and packets (nothing decoded)."""

    original_size: tuple[int, int]  # (width, height)
    resized_size: tuple[int, int]  # (width, height) of every sampled frame
    duration_s: float  # source frames / source fps
    source_frames: int
    num_frames: int  # frames sampled (an even count)
    sample_fps: float
    num_tokens: int  # grids x tokens per grid
    budget_tokens: int


@dataclass(frozen=True)
class TokenCount:
    """What /tokenize reports: the exact prompt the engine would see, without running the model."""

    token_ids: tuple[int, ...]
    images: tuple[ImageTokens, ...]
    # if it were sent now (None: the engine has no cost model yet)
    predicted_ttft_s: float | None = None
    videos: tuple[VideoTokens, ...] = ()
    # what it would cost the engine (tokens and encoder units): what admission prices
    work: PromptWork | None = None

    @property
    def total(self) -> int:
        return len(self.token_ids)

    @property
    def num_text_tokens(self) -> int:
        return (
            self.total
            - sum(im.num_tokens for im in self.images)
            - sum(v.num_tokens for v in self.videos)
        )

    @classmethod
    def of(cls, prompt: PromptPlan, work: PromptWork | None = None) -> TokenCount:
        images = tuple(
            ImageTokens(p.original_size, p.resized_size, p.num_tokens, p.budget_tokens,
                        p.tile_grid, p.grid_thw[0] if p.tile_grid is not None else None)
            for p in prompt.plans
        )
        videos = tuple(
            VideoTokens(
                p.original_size,
                p.resized_size,
                p.source_frames / p.source_fps,
                p.source_frames,
                p.num_frames,
                p.sample_fps,
                p.num_tokens,
                p.budget_tokens,
            )
            for p in (v.plan for v in prompt.videos)
        )
        return cls(prompt.token_ids, images, videos=videos, work=work)
