"""What ``firsttoken serve`` checks before it loads a model: each mistake a person can make with its
flags, said as one UsageError naming the flag, the value and what to do.

Only cheap checks live here (files, config.json, the KV arithmetic, a test bind of the port); they
run in well under a second, where loading weights can take minutes. The engine and the config
dataclasses keep their own validation: this module reads their answers and phrases them for the
command line, it never restates a rule.
"""

from __future__ import annotations

import argparse
import errno
import socket
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from firsttoken.cli.usage import (
    UsageError,
    existing_dir,
    parse_model_config,
    read_config_json,
)
from firsttoken.units import format_size

if TYPE_CHECKING:
    from firsttoken.config import EngineConfig, ServeConfig
    from firsttoken.models.model_config import ModelConfig

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def flag_error(exc: ValueError, args: argparse.Namespace | None = None) -> UsageError:
    """A config ValueError ("<field> must ...") as the UsageError of the flag that sets that
    field."""
    from firsttoken.config import flag_for_field

    message = str(exc)
    field, _, rest = message.partition(" ")
    flag = flag_for_field(field)
    if flag is None or not rest:
        return UsageError(None, None, message)
    dest = flag.removeprefix("--").replace("-", "_")
    return UsageError(flag, getattr(args, dest, None) if args is not None else None, rest)


def check_serve_config(config: "ServeConfig", model_dir: Path) -> None:
    """Raise UsageError for the first option that cannot work; ``model_dir`` is --model or the demo
    checkpoint. Range checks already ran when the config tree was built; these need the file system,
    the checkpoint or the network."""
    from firsttoken.api.logs import LOG_FORMATS

    server = config.server
    if str(server.log_level).lower() not in LOG_LEVELS:
        raise UsageError(
            "--log-level", server.log_level, f"unknown level; use one of {', '.join(LOG_LEVELS)}"
        )
    if server.log_format not in LOG_FORMATS:
        raise UsageError(
            "--log-format",
            server.log_format,
            f"unknown format; use one of {', '.join(LOG_FORMATS)}",
        )
    if config.images.allowed_media_dir is not None:
        existing_dir("--allowed-media-dir", config.images.allowed_media_dir)
    if config.chat_template is not None and not Path(config.chat_template).is_file():
        raise UsageError("--chat-template", config.chat_template, "no such file")
    if server.request_log is not None and not Path(server.request_log).parent.is_dir():
        raise UsageError(
            "--request-log", server.request_log, "its directory does not exist; create it first"
        )
    _check_device(config.engine)
    model_config = check_checkpoint("--model" if config.model else "(demo checkpoint)", model_dir,
                                    weights=config.engine.load_format != "dummy")
    _check_kv(config.engine, model_config)
    proc = model_config.image_processor
    if proc.tiles is not None and config.images.image_max_tokens < proc.tokens_per_tile:
        raise UsageError("--image-max-tokens", config.images.image_max_tokens,
                         f"under one tile: this model's images cost at least {proc.tokens_per_tile} tokens")
    # int8 runs everywhere (exact products: loading/quant.py)
    if config.engine.quantization == "fp16":
        from firsttoken.loading.quant import fp16_supported

        reason = fp16_supported()
        if reason is not None:
            raise UsageError("--quantization", "fp16", reason)
    check_port_free(server.host, server.port)


def _check_device(config: "EngineConfig") -> None:
    """--device cuda needs a CUDA device torch can use (the resolve step's rule, asked of this
    machine)."""
    from firsttoken.loading.load_plan import resolve_device
    from firsttoken.loading.plan_values import CudaFacts

    try:
        resolve_device(config.device, CudaFacts.detect())
    except ValueError as exc:
        raise UsageError(
            "--device", config.device, str(exc).removeprefix(f"device {config.device}: ")
        ) from None


def check_checkpoint(flag: str, model_dir: Path, weights: bool = True) -> "ModelConfig":
    """The checkpoint's ModelConfig, after checking what loading needs: config.json describing a
    model we serve, safetensors weights (unless ``weights`` is False: --load-format dummy) and
    tokenizer files."""
    from firsttoken.models.registry import family_of_config

    config_json = read_config_json(flag, model_dir)
    try:
        family_of_config(config_json)
    except ValueError as exc:  # the registry's message names what is supported
        raise UsageError(flag, model_dir, f"{exc}") from None
    config = parse_model_config(flag, model_dir, config_json)
    if weights and not any(model_dir.glob("*.safetensors")):
        raise UsageError(flag, model_dir, "no *.safetensors weights in this directory")
    if not any(
        (model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")
    ):
        raise UsageError(
            flag, model_dir, "no tokenizer files (tokenizer.json or tokenizer_config.json) here"
        )
    return config


def _check_kv(config: "EngineConfig", model_config: "ModelConfig") -> None:
    """The pool must hold one block, and --max-model-len must fit the model and the pool (the
    engine's rule); on cuda without --kv-cache-memory the pool is not known before start-up measures
    the device."""
    from firsttoken.engine.resolve import activation_device, activation_dtype, plan_kv_capacity
    from firsttoken.loading.plan_values import TORCH_DTYPES

    if config.cache.kv_cache_memory_bytes is None and activation_device(config) == "cuda":
        # the pool is what the device leaves, measured at start-up (engine.py checks it there)
        return
    # the resolve step's answer for these flags (the model is not loaded yet)
    dtype = activation_dtype(config)
    dtype_bytes = TORCH_DTYPES[dtype].itemsize
    block_bytes = model_config.kv_bytes_per_token(dtype_bytes) * config.cache.block_size
    if config.cache.kv_pool_bytes < block_bytes:
        raise UsageError(
            "--kv-cache-memory",
            format_size(config.cache.kv_pool_bytes),
            f"smaller than one KV block; this model needs at least {format_size(block_bytes)} "
            f"({config.cache.block_size} tokens x {model_config.kv_bytes_per_token(dtype_bytes)} bytes/token in "
            f"{dtype})",
        )
    unbounded = replace(config, scheduler=replace(config.scheduler, max_model_len=None))
    capacity = plan_kv_capacity(model_config, unbounded, dtype_bytes)
    max_model_len = config.scheduler.max_model_len
    if max_model_len is not None and max_model_len > capacity.max_model_len:
        raise UsageError(
            "--max-model-len",
            max_model_len,
            f"larger than this model and KV pool allow: {capacity.max_model_len} tokens, the lesser of "
            f"max_position_embeddings ({model_config.max_position_embeddings}) and the KV pool's "
            f"{capacity.num_tokens} tokens; lower it, or raise --kv-cache-memory",
        )


def check_port_free(host: str, port: int) -> None:
    """Bind (host, port) once, as uvicorn will, so a taken port is said before the model loads, not
    after."""
    if not 0 <= port <= 65535:
        raise UsageError("--port", port, "not a TCP port (0-65535)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UsageError("--host", host, f"cannot resolve this address ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        # as uvicorn: TIME_WAIT is not "in use"
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UsageError(
                    "--port",
                    port,
                    f"address {host}:{port} is already in use; stop what holds it "
                    "or pick another --port",
                ) from None
            if exc.errno == errno.EACCES:
                raise UsageError(
                    "--port",
                    port,
                    "permission denied (ports below 1024 need privileges); pick a port >= 1024",
                ) from None
            raise UsageError("--host", host, f"cannot bind this address ({exc.strerror})") from None
