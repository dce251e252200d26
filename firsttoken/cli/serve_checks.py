"""What ``firsttoken serve`` checks before it loads a model: each mistake a person can make with its flags,
said as one UsageError naming the flag, the value and what to do.

Only cheap checks live here (files, config.json, the KV arithmetic, a test bind of the port); they run in well
under a second, where loading weights can take minutes. The engine and the config dataclasses keep their own
validation: this module reads their answers and phrases them for the command line, it never restates a rule.
"""

from __future__ import annotations

import argparse
import errno
import socket
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TypeVar

from firsttoken.cli.usage import (
    UsageError,
    existing_dir,
    from_config_error,
    parse_model_config,
    read_config_json,
)
from firsttoken.units import format_size

if TYPE_CHECKING:
    from firsttoken.engine.engine import EngineConfig
    from firsttoken.models.config import ModelConfig

T = TypeVar("T")

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# config fields whose serve flag is spelled differently (from_config_error maps the rest by name)
RENAMED_FLAGS = {
    "max_images_per_prompt": "--max-images-per-request",
    "max_request_body_bytes": "--max-request-bytes",
    "allowed_domains": "--allowed-media-domains",
}


def check_serve_args(args: argparse.Namespace, model_dir: Path) -> None:
    """Raise UsageError for the first flag that cannot work; ``model_dir`` is --model or the demo checkpoint."""
    from firsttoken.api.logs import LOG_FORMATS
    from firsttoken.inputs.budget import ImageBudget

    if str(args.log_level).lower() not in LOG_LEVELS:
        raise UsageError("--log-level", args.log_level, f"unknown level; use one of {', '.join(LOG_LEVELS)}")
    if args.log_format not in LOG_FORMATS:
        raise UsageError("--log-format", args.log_format, f"unknown format; use one of {', '.join(LOG_FORMATS)}")
    if args.num_threads is not None and args.num_threads < 1:
        raise UsageError("--num-threads", args.num_threads, "must be >= 1 (or leave it out: all cores)")
    if args.allowed_media_dir is not None:
        existing_dir("--allowed-media-dir", args.allowed_media_dir)
    if args.request_log is not None and not Path(args.request_log).parent.is_dir():
        raise UsageError("--request-log", args.request_log, "its directory does not exist; create it first")
    model_config = check_checkpoint("--model" if args.model else "(demo checkpoint)", model_dir)
    config = _engine_config(args)
    _check_kv(args, model_config, config)
    _checked(args, lambda: ImageBudget(args.image_max_tokens, args.image_min_tokens, args.image_low_detail_tokens))
    check_port_free(args.host, args.port)


def check_checkpoint(flag: str, model_dir: Path) -> "ModelConfig":
    """The checkpoint's ModelConfig, after checking what loading needs: config.json describing a model we
    serve, safetensors weights and tokenizer files."""
    from firsttoken.models.registry import family_of_config

    config_json = read_config_json(flag, model_dir)
    try:
        family_of_config(config_json)
    except ValueError as exc:  # the registry's message names what is supported
        raise UsageError(flag, model_dir, f"{exc}") from None
    config = parse_model_config(flag, model_dir, config_json)
    if not any(model_dir.glob("*.safetensors")):
        raise UsageError(flag, model_dir, "no *.safetensors weights in this directory")
    if not any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise UsageError(flag, model_dir, "no tokenizer files (tokenizer.json or tokenizer_config.json) here")
    return config


def _checked(args: argparse.Namespace, build: Callable[[], T]) -> T:
    """``build()``, its ValueError naming a config field turned into the UsageError of that field's flag."""
    try:
        return build()
    except ValueError as exc:
        raise from_config_error(exc, args, RENAMED_FLAGS) or UsageError(None, None, str(exc)) from None


def _engine_config(args: argparse.Namespace) -> "EngineConfig":
    from firsttoken.cli.serve import engine_config

    config = _checked(args, lambda: engine_config(args))
    try:
        config.torch_dtype()
    except ValueError:
        from firsttoken.engine.engine import DTYPES

        raise UsageError("--dtype", args.dtype, f"unknown dtype; use one of auto, {', '.join(DTYPES)}") from None
    return config


def _check_kv(args: argparse.Namespace, model_config: "ModelConfig", config: "EngineConfig") -> None:
    """The pool must hold one block, and --max-model-len must fit the model and the pool (the engine's rule)."""
    from firsttoken.engine.engine import plan_kv_capacity

    dtype = config.torch_dtype()
    dtype_bytes = dtype.itemsize
    block_bytes = model_config.kv_bytes_per_token(dtype_bytes) * config.cache.block_size
    if config.cache.kv_cache_memory_bytes < block_bytes:
        raise UsageError(
            "--kv-cache-memory", format_size(args.kv_cache_memory),
            f"smaller than one KV block; this model needs at least {format_size(block_bytes)} "
            f"({config.cache.block_size} tokens x {model_config.kv_bytes_per_token(dtype_bytes)} bytes/token in "
            f"{str(dtype).removeprefix('torch.')})",
        )
    unbounded = replace(config, scheduler=replace(config.scheduler, max_model_len=None))
    capacity = plan_kv_capacity(model_config, unbounded)
    if args.max_model_len is not None and args.max_model_len > capacity.max_model_len:
        raise UsageError(
            "--max-model-len", args.max_model_len,
            f"larger than this model and KV pool allow: {capacity.max_model_len} tokens, the lesser of "
            f"max_position_embeddings ({model_config.max_position_embeddings}) and the KV pool's "
            f"{capacity.num_tokens} tokens; lower it, or raise --kv-cache-memory",
        )


def check_port_free(host: str, port: int) -> None:
    """Bind (host, port) once, as uvicorn will, so a taken port is said before the model loads, not after."""
    if not 0 <= port <= 65535:
        raise UsageError("--port", port, "not a TCP port (0-65535)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UsageError("--host", host, f"cannot resolve this address ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is not "in use"
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UsageError("--port", port, f"address {host}:{port} is already in use; stop what holds it "
                                 "or pick another --port") from None
            if exc.errno == errno.EACCES:
                raise UsageError("--port", port, "permission denied (ports below 1024 need privileges); "
                                 "pick a port >= 1024") from None
            raise UsageError("--host", host, f"cannot bind this address ({exc.strerror})") from None
