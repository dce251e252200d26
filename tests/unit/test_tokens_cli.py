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
