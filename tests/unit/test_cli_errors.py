"""Start-up errors a person can read: each misconfiguration is one line on stderr naming the command, the flag,
the value and what to do, exit status 2 (1 for a failure that is not the user's), and never a traceback unless
asked for. Every case runs the real `firsttoken` command in a subprocess, as a user would."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from firsttoken.models.registry import load_model_config
from firsttoken.units import format_size

QWEN25_VL_CONFIG = {  # what a Qwen2.5-VL checkpoint's config.json says about itself
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "hidden_size": 3584,
    "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
    "vocab_size": 152064, "vision_config": {"depth": 32, "hidden_size": 1280, "num_heads": 16,
                                            "out_hidden_size": 3584, "intermediate_size": 3420},
}
LLAVA_CONFIG = {  # an architecture firsttoken does not serve (llava-hf/llava-1.5-7b-hf's config.json, abridged)
    "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "image_token_index": 32000,
    "text_config": {"model_type": "llama", "vocab_size": 32064}, "vision_config": {"model_type": "clip_vision_model"},
}


def firsttoken(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "firsttoken.cli.main", *argv], capture_output=True, text=True,
                          timeout=600, env=os.environ.copy())


def error_line(result: subprocess.CompletedProcess[str], status: int = 2) -> str:
    """The one stderr line of a failed command; asserts the status, no traceback and nothing on stdout."""
    assert result.returncode == status, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def _closed_port() -> int:
    """A loopback port nothing listens on (bound once, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- serve ---------------------------------------------------------------------------------------------------
def test_serve_model_directory_missing(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    assert error_line(firsttoken("serve", "--model", str(missing))) == (
        f"firsttoken serve: --model {missing}: no such directory")


def test_serve_model_directory_without_config_json(tmp_path: Path) -> None:
    assert error_line(firsttoken("serve", "--model", str(tmp_path))) == (
        f"firsttoken serve: --model {tmp_path}: no config.json in this directory; point it at a Hugging Face "
        "checkpoint directory (config.json, *.safetensors, tokenizer files)")


def test_serve_unsupported_checkpoint_names_what_is_supported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAVA_CONFIG))
    line = error_line(firsttoken("serve", "--model", str(tmp_path)))
    assert line.startswith(f"firsttoken serve: --model {tmp_path}: unsupported model "
                           "(architectures=['LlavaForConditionalGeneration'], model_type='llava')")
    assert ("supported architectures: ['InternVLForConditionalGeneration', 'Qwen2VLForConditionalGeneration', "
            "'Qwen2_5_VLForConditionalGeneration'") in line


def test_serve_kv_pool_smaller_than_one_block_says_the_minimum(tiny_model_dir: Path) -> None:
    block_bytes = load_model_config(tiny_model_dir).kv_bytes_per_token(4) * 16
    result = firsttoken("serve", "--model", str(tiny_model_dir), "--dtype", "float32", "--kv-cache-memory", "1KiB")
    assert error_line(result) == (
        f"firsttoken serve: --kv-cache-memory 1KiB: smaller than one KV block; this model needs at least "
        f"{format_size(block_bytes)} (16 tokens x {block_bytes // 16} bytes/token in float32)")


@pytest.mark.parametrize("flags, expected", [
    (["--dtype", "fp8"], "--dtype fp8: must be one of auto, float32, bfloat16, float16"),
    (["--scheduling", "round-robin"], "--scheduling round-robin: must be 'lanes' or 'fcfs'"),
    (["--kv-admission", "eager"], "--kv-admission eager: must be 'whole-prompt' or 'optimistic'"),
    (["--image-max-tokens", "0"], "--image-max-tokens 0: must be >= 1"),
    (["--log-level", "loud"], "--log-level loud: unknown level; use one of debug, info, warning, error, critical"),
    (["--device", "tpu"], "--device tpu: must be one of auto, cpu, cuda"),
    (["--attention-backend", "flash"], "--attention-backend flash: must be 'sdpa' or 'triton'"),
], ids=["dtype", "scheduling", "kv-admission", "image-budget", "log-level", "device", "attention-backend"])
def test_serve_bad_flag_values(tiny_model_dir: Path, flags: list[str], expected: str) -> None:
    assert error_line(firsttoken("serve", "--model", str(tiny_model_dir), *flags)) == f"firsttoken serve: {expected}"


def test_serve_max_model_len_beyond_the_model_and_pool(tiny_model_dir: Path) -> None:
    result = firsttoken("serve", "--model", str(tiny_model_dir), "--dtype", "float32", "--max-model-len", "40000")
    assert error_line(result) == (
        "firsttoken serve: --max-model-len 40000: larger than this model and KV pool allow: 32768 tokens, the "
        "lesser of max_position_embeddings (32768) and the KV pool's 2097152 tokens; lower it, or raise "
        "--kv-cache-memory")


def test_serve_port_in_use_is_said_before_the_model_loads(tiny_model_dir: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = firsttoken("serve", "--model", str(tiny_model_dir), "--port", str(port))
    assert error_line(result) == (
        f"firsttoken serve: --port {port}: address 127.0.0.1:{port} is already in use; stop what holds it or "
        "pick another --port")


def test_argparse_errors_are_one_line_too(tiny_model_dir: Path) -> None:
    assert error_line(firsttoken("serve", "--port", "eighty")) == (
        "firsttoken serve: argument --port: invalid int value: 'eighty' (see firsttoken serve --help)")
    assert error_line(firsttoken("serve", "--modle", str(tiny_model_dir))) == (
        f"firsttoken serve: unrecognized arguments: --modle {tiny_model_dir} (see firsttoken serve --help)")


def test_an_unexpected_failure_is_one_line_and_the_traceback_is_opt_in(tiny_model_dir: Path, tmp_path: Path
                                                                        ) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_model_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"\xff" * 64)  # passes the cheap checks, fails to load
    args = ("serve", "--model", str(broken), "--port", "0")
    line = error_line(firsttoken(*args), status=1)
    assert line.startswith("firsttoken serve: unexpected SafetensorError: ")
    assert line.endswith("(run with --log-level debug for the traceback)")
    debug = firsttoken(*args, "--log-level", "debug")
    assert debug.returncode == 1 and "Traceback" in debug.stderr
    assert debug.stderr.strip().splitlines()[-1].endswith("(traceback above)")


# ---- the other commands ----------------------------------------------------------------------------------------
def test_plan_config_missing_a_field_names_it(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    vision = {k: v for k, v in QWEN25_VL_CONFIG["vision_config"].items() if k != "intermediate_size"}
    config.write_text(json.dumps({**QWEN25_VL_CONFIG, "vision_config": vision}))
    result = firsttoken("plan", "--config", str(config), "--memory", "80GiB", "--peak-concurrency", "8")
    assert error_line(result) == (
        f"firsttoken plan: --config {config}: config.json has no vision_config.intermediate_size, needed to size "
        "the vision tower's weights and workspace")


def test_plan_refuses_a_device_the_weights_do_not_fit(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN25_VL_CONFIG))
    result = firsttoken("plan", "--config", str(config), "--memory", "16GiB", "--peak-concurrency", "8")
    assert error_line(result) == (
        "firsttoken plan: --memory 16GiB: the weights alone need 15.45 GiB (8,292,166,656 parameters x 2 B in "
        "bfloat16) but 16.00 GiB x 0.9 utilization = 14.40 GiB usable; plan for a larger device")


def test_tokens_missing_image_file(tmp_path: Path) -> None:
    missing = tmp_path / "cat.jpg"
    assert error_line(firsttoken("tokens", str(missing))) == f"firsttoken tokens: {missing}: no such file"


def test_bench_unreachable_url_is_one_line_not_one_error_per_request() -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    line = error_line(firsttoken("bench", "--url", url, "--num-requests", "3", "--no-progress"))
    assert line.startswith(f"firsttoken bench: --url {url}: cannot connect (")
    assert line.endswith("); is the server running at this address?")


def test_make_model_refuses_a_directory_it_did_not_write(tmp_path: Path) -> None:
    target = tmp_path / "real-checkpoint"
    target.mkdir()
    (target / "config.json").write_text("{}")
    assert error_line(firsttoken("make-model", str(target))) == (
        f"firsttoken make-model: {target}: not empty and not written by make-model (no firsttoken_checkpoint.json);"
        " it would overwrite config.json and the weights there: choose a new or empty directory")
    assert (target / "config.json").read_text() == "{}" and len(list(target.iterdir())) == 1
