"""A family's budget ladder: the visual-token budgets one image can be planned at.

A rung is a budget in LM tokens; what it buys is the family's own unit (``unit``): pixels for Qwen's
native resolution (any budget is a rung: a continuous ladder), tiles for a tiling family, token
tiers for a tiered one. The operator's ``--image-max-tokens`` bounds the family's default rung, a
request may ask for a lower one, and under load the admission check steps down the ladder
(scheduler/admission.negotiate) to ``--image-min-tokens-under-load``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class BudgetLadder(Protocol):
    # what a rung buys, for reports: "pixels", "tiles", "tiers"
    unit: str

    def default(self, cap: int) -> int:
        """The family's own default budget, in tokens, bounded by the operator's ``cap``."""
        ...

    def below(self, budget: int, floor: int) -> int | None:
        """The next rung under ``budget`` and at or over ``floor`` (None: there is none): one step
        of lowering an image's budget under load."""
        ...


@dataclass(frozen=True)
class PixelLadder:
    """Qwen's native resolution: any budget is a rung (the image is resized to fit it); under load
    each step halves it, down to the floor."""

    unit: str = "pixels"

    def default(self, cap: int) -> int:
        return cap

    def below(self, budget: int, floor: int) -> int | None:
        return max(floor, budget // 2) if budget > floor else None


PIXEL_LADDER = PixelLadder()
