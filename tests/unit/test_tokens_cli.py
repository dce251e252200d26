"""`firsttoken tokens`: per-image counts from headers, the same numbers the reference processor gives."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from firsttoken.cli.main import main


def test_tokens_table_and_json_with_and_without_a_budget(tmp_path: Path, capsys) -> None:
    square, photo = tmp_path / "square.png", tmp_path / "photo.jpg"
    Image.new("RGB", (1024, 1024)).save(square)
    Image.new("RGB", (2048, 1536)).save(photo)
    assert main(["tokens", str(square), str(photo), "--image-max-tokens", "16384", "--json"]) == 0
    unbudgeted = json.loads(capsys.readouterr().out)
    assert [r["num_tokens"] for r in unbudgeted["images"]] == [1369, 4015]  # Qwen2-VL processor defaults
    assert main(["tokens", str(square), str(photo)]) == 0
    table = capsys.readouterr().out
    assert "1024x1024      980x980     1225     1280" in table and "2048x1536     1148x840     1230" in table
    assert "total: 2455 visual tokens" in table


def test_tokens_reports_a_bad_file_and_exits_non_zero(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "notes.txt"
    bad.write_text("not an image")
    assert main(["tokens", str(bad)]) == 1
    assert "error: data is not a supported image" in capsys.readouterr().out


def test_tokens_counts_a_video_from_its_header_and_honours_the_video_flags(tmp_path: Path, capsys) -> None:
    from firsttoken.inputs.video_synth import write_clip

    clip = write_clip(tmp_path / "clip.mp4", seconds=3, width=320, height=240, fps=10)
    photo = tmp_path / "square.png"
    Image.new("RGB", (1024, 1024)).save(photo)
    assert main(["tokens", str(clip), str(photo)]) == 0
    table = capsys.readouterr().out
    # 30 frames at 2 fps: 6 sampled, 3 two-frame grids of 10 x 14 merged patches (frames scaled up to the 128-token
    # floor); the image keeps its own table and budget
    assert "320x240      392x280      3.00      30        6      420     4096" in table
    assert "1024x1024      980x980     1225     1280" in table and "total: 1645 visual tokens" in table
    assert main(["tokens", str(clip), "--video-fps", "1", "--video-max-tokens", "256", "--json"]) == 0
    (video,) = json.loads(capsys.readouterr().out)["videos"]
    counted = (video["source_frames"], video["num_frames"], video["num_tokens"], video["budget_tokens"])
    assert counted == (30, 4, 176, 256)
    assert video["duration_s"] == 3.0 and video["resized_size"] == [308, 224]


def test_tokens_reports_a_truncated_video_as_its_row_and_a_bad_video_flag_as_usage(tmp_path: Path, capsys) -> None:
    from firsttoken.inputs.video_synth import make_clip

    cut = tmp_path / "cut.mp4"
    data = make_clip(1, 64, 48, fps=8)
    cut.write_bytes(data[: len(data) // 4])
    assert main(["tokens", str(cut)]) == 1
    assert "cut.mp4  error: video container (MP4/MOV) is truncated or corrupt" in capsys.readouterr().out
    assert main(["tokens", str(cut), "--video-max-tokens", "5"]) == 2
    assert "--video-max-tokens 5: must be >=" in capsys.readouterr().err
