"""Multimodal rotary positions (M-RoPE) for a Qwen-VL prompt, identical to transformers'
``get_rope_index``.

Text token at prompt index i: (p, p, p) where p is the running position. An image of (t, h, w)
patches takes t * (h/m) * (w/m) pad tokens (m = spatial merge size) at positions (p + frame, p +
row, p + col) in row-major order, then the running position jumps by max(h, w) / m. A video is the
same with ``video_token_id`` pads and temporal grid g at time p + floor(g * time_step): Qwen2-VL
steps 1 per grid, Qwen2.5-VL ``tokens_per_second * second_per_grid_t`` (qwen2_5_vl.py), Qwen3-VL
splits each video into one (1, h, w) run per grid with timestamp text between (qwen3_vl.py). Images
and videos may come in any order; each kind consumes its own grids in prompt order. After a prompt
of ``L`` tokens the running position is ``L + delta`` (``delta`` <= 0 when images are present), and
generated token i >= L sits at ``i + delta`` on all three axes. Computed once per request; any chunk
``positions[:, a:b]`` is then correct on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from firsttoken.models.model_config import ModelConfig

Grid = tuple[int, int, int]


@dataclass(frozen=True)
class MRopePositions:
    positions: torch.Tensor  # [3, prompt_len] int64 (t, h, w)
    delta: int  # decode token at index i >= prompt_len has position i + delta on every axis


def compute_mrope_positions(
    input_ids: Sequence[int],
    image_grid_thw: Sequence[Grid],
    config: ModelConfig,
    video_grid_thw: Sequence[Grid] = (),
    second_per_grid_ts: Sequence[float] = (),
) -> MRopePositions:
    """Qwen2-VL's positions. ``video_grid_thw``: one (t, h, w) per video, whose t * (h/m) * (w/m)
    pads are one contiguous run; its grid g sits at time step g (``second_per_grid_ts`` is ignored,
    as transformers does)."""
    return vision_positions(
        input_ids, image_grid_thw, config, video_grid_thw, [1] * len(video_grid_thw)
    )


def vision_positions(
    input_ids: Sequence[int],
    image_grid_thw: Sequence[Grid],
    config: ModelConfig,
    video_grid_thw: Sequence[Grid],
    video_time_steps: Sequence[float | torch.Tensor],
) -> MRopePositions:
    """The walk every family shares. ``video_time_steps[k]``: video k's time positions per temporal
    grid; grid g sits at ``(g * step).long()`` as transformers computes it (a float step: a float32
    product, truncated)."""
    if len(video_time_steps) != len(video_grid_thw):
        raise ValueError(
            f"{len(video_time_steps)} video time steps for {len(video_grid_thw)} videos"
        )
    token_ids = [int(x) for x in input_ids]
    merge = config.vision.spatial_merge_size
    kinds = {config.image_token_id: "image", config.video_token_id: "video"}
    grids = {"image": list(image_grid_thw), "video": list(video_grid_thw)}
    used = {"image": 0, "video": 0}
    pieces: list[torch.Tensor] = []
    pos = 0  # running position
    i = 0
    while i < len(token_ids):
        kind = kinds.get(token_ids[i])
        if kind is None:
            j = i
            while j < len(token_ids) and token_ids[j] not in kinds:
                j += 1
            pieces.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos += j - i
            i = j
            continue
        k = used[kind]
        if k == len(grids[kind]):
            raise ValueError(f"prompt has more {kind}s than the {len(grids[kind])} grids given")
        used[kind] += 1
        t, h, w = (int(x) for x in grids[kind][k])
        gh, gw = h // merge, w // merge
        n = t * gh * gw
        pad = token_ids[i]
        if i + n > len(token_ids) or any(x != pad for x in token_ids[i : i + n]):
            raise ValueError(
                f"{kind} {k} with grid {(t, h, w)} needs {n} consecutive {kind}-pad tokens"
            )
        step = video_time_steps[k] if kind == "video" else 1
        tt, hh, ww = torch.meshgrid(
            (torch.arange(t) * step).long(), torch.arange(gh), torch.arange(gw), indexing="ij"
        )
        pieces.append(torch.stack((tt, hh, ww)).reshape(3, -1) + pos)
        pos += max(h, w) // merge
        i += n
    for kind, given in grids.items():
        if used[kind] != len(given):
            raise ValueError(f"prompt has {used[kind]} {kind}s but {len(given)} grids were given")
    positions = torch.cat(pieces, dim=1) if pieces else torch.zeros((3, 0), dtype=torch.int64)
    delta = int(positions.max()) + 1 - len(token_ids) if token_ids else 0
    return MRopePositions(positions=positions.contiguous(), delta=delta)


def decode_positions(start: int, count: int, delta: int) -> torch.Tensor:
    """[3, count] int64 positions of tokens start .. start + count - 1 past the prompt (same on
    every axis)."""
    return (
        (torch.arange(start, start + count, dtype=torch.int64) + delta).expand(3, -1).contiguous()
    )
