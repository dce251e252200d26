"""Vision items: every image and video of a prompt loaded, counted against the limits and planned
from its header alone (the visual-token budget, the resize, the frames sampled), then decoded and
preprocessed into the engine's ``ImageItem``s once every limit has passed."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from firsttoken.config import ImageConfig, VideoConfig
from firsttoken.inputs.budget import (
    BudgetError,
    ImagePlan,
    image_budget,
    image_pixels,
    plan_image,
)
from firsttoken.inputs.draft import PlannedVideo, PromptPlan
from firsttoken.inputs.errors import InputError
from firsttoken.inputs.image import (
    ImageInputError,
    ProcessedImage,
    decode_image,
    probe_image,
)
from firsttoken.inputs.media import (
    MediaNetwork,
    load_image_bytes,
    load_video_bytes,
    remote_media,
)
from firsttoken.inputs.mm_hash import (
    ProcessedImageCache,
    grid_content_hashes,
    pixel_content_hash,
    raw_bytes_key,
    video_bytes_key,
)
from firsttoken.inputs.prompt import ChatPrompt, ImagePart, VideoPart
from firsttoken.inputs.video import (
    VideoAsk,
    VideoInputError,
    decode_frame_list,
    decode_video,
    plan_frame_list,
    plan_video_bytes,
)
from firsttoken.inputs.video_pixels import grid_rows, video_pixel_values
from firsttoken.models.model_config import ModelConfig
from firsttoken.models.registry import family_named
from firsttoken.types import ImageItem, PromptWork


@dataclass(frozen=True)
class ProcessedVideo:
    """A video's pixel values [grids * h * w, C * T * P * P], each temporal grid's rows (views of
    them) and content hash."""

    pixel_values: torch.Tensor  # what the processed-media cache sizes it by
    grid_thw: tuple[int, int, int]
    grids: tuple[torch.Tensor, ...]
    grid_hashes: tuple[str, ...]


@dataclass(frozen=True)
class PlannedImages:
    """A conversation's images, loaded and planned from their headers."""

    plans: tuple[ImagePlan, ...]
    blobs: tuple[bytes, ...]
    params: tuple[str, ...]  # each image's request field
    degradable: tuple[bool, ...]  # the client left its budget to the server (no detail, no cap)


class VisionItems:
    """Thread-safe after construction (the processed-media cache locks itself)."""

    def __init__(self, model_config: ModelConfig, images: ImageConfig, videos: VideoConfig,
                 media_network: MediaNetwork | None, image_cache_bytes: int) -> None:
        self.model_config = model_config
        self.family = family_named(model_config.family)
        self.ladder = self.family.budget_ladder
        self.images = images
        self.videos = videos
        # http(s) image URLs: off unless the config lists domains; ``media_network`` is the test
        # seam
        self.remote = remote_media(
            images.allowed_media_domains, images.media_fetch_timeout_s, media_network
        )
        # a follow-up turn re-sends the same image bytes: skip decode + resize + patchify for them
        self.cache = ProcessedImageCache(image_cache_bytes)

    # ---- planning, from headers -----------------------------------------------------------------
    def plan(self, prompt: ChatPrompt) -> tuple[PlannedImages, tuple[PlannedVideo, ...]]:
        """Every image and video of the conversation counted, loaded and planned: every limit fails
        here, before any decode."""
        image_parts = _parts_of(prompt, ImagePart, lambda part: "image_url")
        limit = self.images.max_images_per_request
        if len(image_parts) > limit:  # named: the first image over the limit
            raise InputError(
                f"too many images: {len(image_parts)} in this request, the limit is {limit} per request; "
                f"send at most {limit} images",
                image_parts[limit][0],
            )
        video_parts = _parts_of(prompt, VideoPart, _video_field)
        if video_parts and not self.family.video:
            raise InputError(f"this model ({self.family.name}) does not accept video input; send images "
                             "instead", video_parts[0][0])
        if len(video_parts) > self.videos.max_videos_per_request:
            limit = self.videos.max_videos_per_request
            raise InputError(f"too many videos: {len(video_parts)} in this request, the limit is {limit} per request; "
                             f"send at most {limit}", video_parts[limit][0])
        budgets = [self._budget_of(param, part) for param, part in image_parts]
        params = tuple(param for param, _ in image_parts)
        blobs = tuple(self._loaded(part, i, params) for i, (_, part) in enumerate(image_parts))
        degradable = tuple(
            part.detail is None and part.max_visual_tokens is None for _, part in image_parts
        )
        images = PlannedImages(self.replan(blobs, budgets, params), blobs, params, degradable)
        return images, tuple(self._plan_video(part, param) for param, part in video_parts)

    def replan(self, blobs: Sequence[bytes], budgets: Sequence[int], params: Sequence[str]
               ) -> tuple[ImagePlan, ...]:
        """Resize plans at these budgets, from the headers alone."""
        s = self.images
        plans = []
        for i, (data, budget) in enumerate(zip(blobs, budgets)):
            try:
                header = probe_image(data, s.max_image_pixels)
            except ImageInputError as err:  # (more pixels than the limit: fewer would pass)
                hint = "; downscale it before sending" if err.code == "image_too_large" else ""
                raise _image_at(err, i, params, hint) from None
            try:
                plans.append(plan_image(header.width, header.height, budget, s.image_min_tokens,
                                        self.model_config.image_processor))
            except ImageInputError as err:  # its budget's refusal says what to ask for
                raise _image_at(err, i, params) from None
        return tuple(plans)

    def work(self, prompt: PromptPlan) -> PromptWork:
        """What the prompt costs the engine, from its plans: tokens, and the encoder units of each
        image and of each video grid (one vision item each)."""
        vision = self.model_config.vision
        grids = [p.grid_thw for p in prompt.plans]
        for v in prompt.videos:
            t, h, w = v.plan.grid_thw
            grids += [(1, h, w)] * t
        units = [u for grid in grids for u in self.family.encoder_units(vision, grid)]
        return PromptWork(
            len(prompt.token_ids),
            len(grids),
            sum(u.num_patches for u in units),
            float(sum(u.attention_pairs for u in units)),
            len(units),
            num_videos=len(prompt.videos),
        )

    # ---- decoding, once every limit has passed --------------------------------------------------
    def decode(self, prompt: PromptPlan) -> tuple[list[ImageItem], list[Any], list[Any]]:
        """(the engine's vision items in prompt order, each image's and each video's grid (t, h,
        w)): every image and video decoded and preprocessed (or found in the cache)."""
        images = tuple(self._decode_image(data, plan, i, prompt.params)
                       for i, (data, plan) in enumerate(zip(prompt.blobs, prompt.plans)))
        videos = tuple(self._decode_video(v) for v in prompt.videos)
        vision = self.model_config.vision
        items = [
            ImageItem(
                content_hash=im.content_hash or "",
                offset=offset,
                num_tokens=im.num_tokens,
                grid_thw=im.grid_thw,
                encoder_units=self.family.encoder_units(vision, im.grid_thw),
                pixel_values=im.pixel_values,
            )
            for im, offset in zip(images, prompt.offsets)
        ]
        for v, (video, offsets) in enumerate(zip(videos, prompt.video_offsets)):
            _, h, w = video.grid_thw
            units = self.family.encoder_units(vision, (1, h, w))
            items += [
                ImageItem(
                    content_hash=digest,
                    offset=offset,
                    num_tokens=h * w // vision.spatial_merge_size**2,
                    grid_thw=(1, h, w),
                    encoder_units=units,
                    pixel_values=rows,
                    kind="video",
                    video_index=v,
                )
                for rows, digest, offset in zip(video.grids, video.grid_hashes, offsets)
            ]
        items.sort(key=lambda item: item.offset)
        return items, [im.grid_thw for im in images], [v.plan.grid_thw for v in prompt.videos]

    # ---- steps -----------------------------------------------------------------------------------
    def _budget_of(self, param: str, part: ImagePart) -> int:
        try:
            return image_budget(self.images, part.detail, part.max_visual_tokens, param,
                                self.ladder.default(self.images.image_max_tokens))
        except BudgetError as err:
            raise InputError(str(err), err.param) from None

    def _loaded(self, part: ImagePart, index: int, params: Sequence[str]) -> bytes:
        s = self.images
        try:
            if part.data is None:
                return load_image_bytes(
                    part.url or "", s.allowed_media_dir, s.max_image_bytes, self.remote
                )
            if len(part.data) > s.max_image_bytes:
                raise ImageInputError(
                    "image_too_large",
                    f"image is {len(part.data)} bytes; the limit is {s.max_image_bytes}",
                )
            return part.data
        except ImageInputError as err:
            raise _image_at(err, index, params) from None

    def _decode_image(self, data: bytes, plan: ImagePlan, index: int, params: Sequence[str]
                      ) -> ProcessedImage:
        key = raw_bytes_key(data, plan.pixel_key)

        def build() -> ProcessedImage:
            image = decode_image(data, self.images.max_image_pixels)
            processed = image_pixels(image, plan, self.model_config.image_processor)
            if processed.num_tokens != plan.num_tokens:  # the header lied about the size, or a bug
                raise ImageInputError(
                    "invalid_image", "image size differs from the size its header declares"
                )
            return replace(processed, content_hash=pixel_content_hash(processed))

        try:
            return self.cache.get_or_build(key, build)
        except ImageInputError as err:
            raise _image_at(err, index, params) from None

    def _plan_video(self, part: VideoPart, param: str) -> PlannedVideo:
        """Load a video part's bytes and plan it from its header and packets (a frame list: every
        frame's header); every limit is checked here, before any frame is decoded."""
        limits, proc = self.videos, self.model_config.image_processor
        ask = VideoAsk(part.fps, part.max_frames, part.max_visual_tokens)
        try:
            if part.frames is not None:
                frames = tuple(
                    self._frame_bytes(url, k, len(part.frames)) for k, url in enumerate(part.frames)
                )
                plan = plan_frame_list(
                    frames, limits, proc, ask, self.images.max_image_pixels, param
                )
                return PlannedVideo(plan, frames, None, None, param)
            data = part.data if part.data is not None else load_video_bytes(
                part.url or "", self.images.allowed_media_dir, limits.max_video_bytes, self.remote)
            if len(data) > limits.max_video_bytes:
                raise VideoInputError(
                    "video_too_large",
                    f"video is {len(data)} bytes; the limit is {limits.max_video_bytes}",
                )
            header, index, plan = plan_video_bytes(data, limits, proc, ask, param=param)
            return PlannedVideo(plan, (data,), header, index, param)
        except BudgetError as err:
            raise InputError(str(err), err.param) from None
        except ImageInputError as err:
            # a VideoInputError stays one
            raise type(err)(err.code, str(err), err.param or param) from None

    def _frame_bytes(self, url: str, k: int, n: int) -> bytes:
        try:
            return load_image_bytes(
                url, self.images.allowed_media_dir, self.images.max_image_bytes, self.remote
            )
        except ImageInputError as err:
            raise VideoInputError(err.code, f"frame {k + 1} of {n}: {err}") from None

    def _decode_video(self, video: PlannedVideo) -> ProcessedVideo:
        plan = video.plan
        key = video_bytes_key(video.sources, plan.frame_indices, plan.resized_size)

        def build() -> ProcessedVideo:
            if video.header is None:
                decoded = decode_frame_list(
                    video.sources, plan, self.videos, self.images.max_image_pixels
                )
            else:
                decoded = decode_video(
                    video.sources[0], video.header, video.index, plan, self.videos
                )
            pixels, grid = video_pixel_values(decoded.frames, self.model_config.image_processor)
            if tuple(grid) != tuple(plan.grid_thw):  # the plan and the pixels disagree: a bug
                raise RuntimeError(f"video decoded to grid {tuple(grid)}, planned {plan.grid_thw}")
            grids = tuple(grid_rows(pixels, grid))
            return ProcessedVideo(
                pixels, plan.grid_thw, grids, grid_content_hashes(grids, grid[1:])
            )

        try:
            return self.cache.get_or_build(key, build)  # type: ignore[arg-type,return-value]
        except ImageInputError as err:
            raise type(err)(err.code, str(err), err.param or video.param) from None


def _image_at(
    err: ImageInputError, index: int, params: Sequence[str], hint: str = ""
) -> ImageInputError:
    """``err`` for the request's image ``index``, at whatever stage (load, header, decode): its
    field as the param and, when the request has several images, its position in the message."""
    where = f"image {index + 1} of {len(params)}: " if len(params) > 1 else ""
    return ImageInputError(
        err.code, f"{where}{err}{hint}", params[index] if index < len(params) else None
    )


def _parts_of(prompt: ChatPrompt, kind: type, field: Callable[[Any], str]) -> list[tuple[str, Any]]:
    """(request field, part) of every ``kind`` part in the conversation, in order; ``field(part)``:
    the part's own field, as the request named it."""
    return [
        (f"{prompt.field_of(i)}.content[{j}].{field(part)}", part)
        for i, m in enumerate(prompt.messages)
        if isinstance(m.content, tuple)
        for j, part in enumerate(m.content)
        if isinstance(part, kind)
    ]


def _video_field(part: VideoPart) -> str:
    """A frame list came as the part's ``video`` field, a container as its ``video_url``."""
    return "video" if part.frames is not None else "video_url"
