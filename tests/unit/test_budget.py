"""The visual-token budget: plans from the declared size alone, never over budget, refused above the cap."""

from __future__ import annotations

import pytest

from firsttoken.config import ImageConfig
from firsttoken.inputs.budget import BudgetError, image_budget, plan_image
from firsttoken.inputs.image import ImageInputError, smart_resize
from firsttoken.models.model_config import ImageProcessorConfig

VISION = ImageProcessorConfig()  # Qwen2-VL: 14-px patches, 2x2 merge, CLIP mean and std
SIZES = [(1, 1), (10, 10), (27, 29), (56, 56), (64, 48), (300, 200), (1024, 1024), (2048, 1536), (4000, 3000),
         (1000, 30), (30, 1000), (5600, 28), (28, 5600), (3000, 15), (7, 1400), (999, 1001), (1920, 1080)]


@pytest.mark.parametrize("budget", [1, 4, 16, 64, 256, 1280, 16384])
def test_no_image_ever_exceeds_its_budget_and_sides_stay_on_the_grid(budget: int) -> None:
    for width, height in SIZES:
        try:
            plan = plan_image(width, height, budget, 4, VISION)
        except ImageInputError as err:  # only a thin strip whose one-cell minimum is over a tiny budget
            assert err.code == "image_too_large" and budget < 64 and "needs" in str(err), (width, height)
            continue
        w, h = plan.resized_size
        assert plan.num_tokens <= budget, (width, height, plan)
        assert w % 28 == 0 and h % 28 == 0 and plan.num_tokens == (w // 28) * (h // 28)
        assert smart_resize(height, width, 28, plan.min_pixels, plan.max_pixels) == (h, w)  # reproducible
        if budget >= 64 and max(width, height) <= 4 * min(width, height):  # room for the shape: the aspect ratio is kept
            assert w / h == pytest.approx(width / height, rel=0.5)


def test_large_images_use_most_of_the_budget_and_small_ones_are_not_inflated() -> None:
    assert plan_image(1024, 1024, 1280, 4, VISION).num_tokens == 1225  # 980x980
    assert plan_image(2048, 1536, 1280, 4, VISION).num_tokens == 1230  # 1148x840
    assert plan_image(2048, 1536, 16384, 4, VISION).num_tokens == 4015  # the reference processor's default
    assert plan_image(300, 200, 1280, 4, VISION).resized_size == (308, 196)


@pytest.mark.parametrize("size", [(1, 1), (10, 10), (27, 20), (20, 55)])
def test_images_below_one_cell_are_scaled_up_to_the_minimum(size: tuple[int, int]) -> None:
    plan = plan_image(*size, 1280, 4, VISION)
    assert plan.num_tokens >= 4 and plan.resized_size[0] >= 28 and plan.resized_size[1] >= 28


def test_strips_up_to_200_to_1_are_served_and_beyond_refused_with_the_ratio() -> None:
    assert plan_image(5600, 28, 1280, 4, VISION).resized_size == (5600, 28)
    assert plan_image(28, 5600, 64, 4, VISION).num_tokens <= 64
    with pytest.raises(ImageInputError, match=r"5628x28, aspect ratio 201\.0:1.*at most 200:1") as err:
        plan_image(5628, 28, 1280, 4, VISION)
    assert err.value.code == "image_aspect_ratio"


def test_a_strip_that_cannot_fit_a_tiny_budget_is_refused_with_what_it_needs() -> None:
    with pytest.raises(ImageInputError, match="7x1400: .* needs 29 visual tokens, over its budget of 16") as err:
        plan_image(7, 1400, 16, 4, VISION)
    assert err.value.code == "image_too_large"


def test_request_budget_is_within_the_cap() -> None:
    images = ImageConfig(image_max_tokens=1280, image_min_tokens=4, image_low_detail_tokens=256)

    def budget(detail, max_visual_tokens, param="p"):
        return image_budget(images, detail, max_visual_tokens, param)

    assert budget(None, None) == budget("auto", None) == 1280
    assert budget("high", None) == 1280
    assert budget("low", None) == 256
    assert budget("high", 100) == 100 and budget("low", 1000) == 256
    assert budget(None, 1280) == 1280
    with pytest.raises(BudgetError, match="1281 is above this server's cap of 1280") as err:
        budget("high", 1281, "messages[0].content[0].image_url")
    assert err.value.param == "messages[0].content[0].image_url.max_visual_tokens"
    small = ImageConfig(image_max_tokens=100, image_low_detail_tokens=256)
    assert image_budget(small, "low", None, "p") == 100


def test_budget_settings_are_validated_by_name() -> None:
    with pytest.raises(ValueError, match="image_min_tokens"):
        ImageConfig(image_max_tokens=16, image_min_tokens=32)
    with pytest.raises(ValueError, match="image_max_tokens"):
        ImageConfig(image_max_tokens=0)
