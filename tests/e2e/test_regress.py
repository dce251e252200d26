"""`firsttoken regress` catches a budget that changes what the model sees, and only that.

Greedy float32 answers of one checkpoint are a deterministic function of the pixels the vision tower gets, so on
random weights "agreement" measures exactly whether a budget altered the picture: 448x448 images with small
rendered text cost 256 tokens, so a 400-token budget leaves them untouched (agreement must be 1.0, exit 0) while a
64-token budget shrinks them to 224x224, where the text is unreadable (agreement must fall, exit 1)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import ImageDraw

from firsttoken.cli.main import main
from tests.e2e.conftest import LiveServer, make_image, start_server, stop_server


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[LiveServer]:
    live, srv, thread = start_server(tiny_model_dir, image_max_tokens=1280)
    yield live
    stop_server(srv, thread, live.engine)


@pytest.fixture(scope="module")
def workload(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("regress")
    (root / "images").mkdir()
    for seed in range(2):
        img = make_image(448, 448, seed=seed)
        draw = ImageDraw.Draw(img)
        for y in range(30, 440, 14):
            draw.text((10, y), f"line {y}: total {(y * 37 + seed) % 997}", fill=(0, 0, 0))
        img.save(root / "images" / f"receipt{seed}.png")
    (root / "prompts.txt").write_text("What is the total on the third line?\n\nRead the text.\n")
    return root / "images", root / "prompts.txt"


def regress(capsys, workload, *extra: str) -> tuple[int, dict]:
    images, prompts = workload
    code = main(["regress", "--images", str(images), "--prompts", str(prompts), "--max-tokens", "8",
                 "--min-agreement", "1.0", "--json", *extra])
    return code, json.loads(capsys.readouterr().out)


def test_a_budget_that_leaves_the_pixels_alone_agrees_exactly(server: LiveServer, workload, capsys) -> None:
    code, report = regress(capsys, workload, "--url", server.base_url, "--budgets", "1280,400,256")
    assert code == 0 and report["passed"]
    assert [b["mean_visual_tokens"] for b in report["budgets"]] == [256, 256, 256]
    assert all(b["exact_agreement"] == b["token_overlap"] == 1.0 and b["num_answers"] == 4 for b in report["budgets"])


def test_a_budget_that_makes_the_text_unreadable_fails_the_run(server: LiveServer, workload, capsys) -> None:
    code, report = regress(capsys, workload, "--url", server.base_url, "--budgets", "1280,64")
    reference, low = report["budgets"]
    assert code == 1 and not report["passed"]
    assert reference["mean_visual_tokens"] == 256 and low["mean_visual_tokens"] <= 64
    assert low["exact_agreement"] < 1.0 and low["token_overlap"] < 1.0


def test_in_process_run_prints_a_table_and_exits_non_zero(tiny_model_dir: Path, workload, capsys) -> None:
    images, prompts = workload
    code = main(["regress", "--images", str(images), "--prompts", str(prompts), "--budgets", "256,64",
                 "--max-tokens", "8", "--model", str(tiny_model_dir), "--min-agreement", "0.9"])
    table = capsys.readouterr().out
    assert code == 1 and "FAIL: min exact agreement 0.90" in table
    assert table.splitlines()[1].split()[:3] == ["256", "4", "256.0"]


def test_videos_are_asked_in_video_url_parts_under_their_own_budgets(tmp_path: Path, capsys) -> None:
    # no server needed: a fake /tokenize and /v1/chat/completions record what regress sends for each video
    import httpx

    from firsttoken.inputs.video_synth import write_clip
    from firsttoken.tools.regress import ChatServer, format_report, list_videos, run_regress

    (tmp_path / "clips").mkdir()
    for seed in range(2):
        write_clip(tmp_path / "clips" / f"clip{seed}.mp4", seconds=1 + seed, width=64, height=48, fps=8)
    (tmp_path / "clips" / "notes.txt").write_text("not a video")
    sent: list[dict] = []

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        body = json.loads(request.content)
        (video,) = [p for p in body["messages"][0]["content"] if p["type"] == "video_url"]
        budget = video["video_url"]["max_visual_tokens"]
        if request.url.path == "/tokenize":
            sent.append(video["video_url"])
            return httpx.Response(200, json={"images": [], "videos": [{"num_tokens": min(budget, 280)}]})
        text = "same" if budget >= 1024 else "different"
        return httpx.Response(200, json={"choices": [{"message": {"content": text}}], "usage": {}})

    server = ChatServer("http://fake", transport=httpx.MockTransport(answer))
    videos = list_videos(tmp_path / "clips")
    report = run_regress(server, videos, ["What moves?"], [256, 4096, 1024], min_agreement=1.0, kind="video")
    assert [v.name for v in videos] == ["clip0.mp4", "clip1.mp4"]
    assert all(v["url"].startswith("data:video/mp4;base64,") for v in sent)
    assert sorted({v["max_visual_tokens"] for v in sent}) == [256, 1024, 4096]
    assert report.kind == "video" and report.reference_budget == 4096 and not report.passed
    assert [(b.budget, b.mean_visual_tokens, b.exact_agreement) for b in report.budgets] == [
        (4096, 280.0, 1.0), (1024, 280.0, 1.0), (256, 256.0, 0.0)]
    assert "visual tok/video" in format_report(report) and report.to_dict()["kind"] == "video"


def test_regress_needs_images_or_videos_and_video_budgets_of_a_grid_at_least(tmp_path: Path, capsys) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What moves?\n")
    (tmp_path / "clips").mkdir()
    assert main(["regress", "--prompts", str(prompts)]) == 2
    assert "give --images DIR, --videos DIR or both" in capsys.readouterr().err
    assert main(["regress", "--videos", str(tmp_path / "clips"), "--prompts", str(prompts)]) == 2
    assert "no videos (.mp4" in capsys.readouterr().err
    (tmp_path / "clips" / "a.mp4").write_bytes(b"")
    assert main(["regress", "--videos", str(tmp_path / "clips"), "--prompts", str(prompts),
                 "--video-budgets", "4096,64"]) == 2
    assert "--video-budgets 4096,64: each must be at least 128" in capsys.readouterr().err
