"""``firsttoken serve``: load a checkpoint (or build the demo one), start the engine thread, serve HTTP.

Flags are declared once in FLAGS (name, type, default, help) and land in frozen config dataclasses; every flag
has a default that works on a 2-core CPU machine.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from firsttoken import units

if TYPE_CHECKING:
    from firsttoken.engine.engine import EngineConfig

log = logging.getLogger("firsttoken.serve")

def parse_bytes(text: str) -> int:
    """A size flag: '2GiB' = 2 x 2**30, '2G' / '2GB' = 2 x 10**9 (firsttoken.units, as `plan` prints them)."""
    try:
        return units.parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


@dataclass(frozen=True)
class Flag:
    name: str
    type: Callable[[str], Any] | None
    default: Any
    help: str

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


FLAGS: tuple[Flag, ...] = (
    Flag("--model", str, None, "checkpoint directory (Hugging Face layout); default: the built-in tiny demo "
         "checkpoint with random weights, which answers nonsense"),
    Flag("--host", str, "127.0.0.1", "address to bind"),
    Flag("--port", int, 8000, "port to bind"),
    Flag("--served-model-name", str, None, "model id clients must send (default: the directory name)"),
    Flag("--dtype", str, "auto", "auto (bf16 where the CPU has native bf16, else float32), float32 (exact vs "
         "transformers), bfloat16"),
    Flag("--max-model-len", int, None, "context length; default: the checkpoint's, capped by the KV pool"),
    Flag("--num-threads", int, None, "torch threads for the engine (default: all cores)"),
    Flag("--kv-cache-memory", parse_bytes, "1GiB", "bytes for the paged KV cache pool (e.g. 1GiB)"),
    Flag("--block-size", int, 16, "tokens per KV block"),
    Flag("--max-batched-tokens", int, 2048, "tokens (prefill chunks + decodes) one engine step may run"),
    Flag("--max-num-seqs", int, 64, "sequences one engine step may run"),
    Flag("--decode-reserve-tokens", int, 64, "KV tokens reserved beyond the prompt when a request is admitted"),
    Flag("--scheduling", str, "lanes", "lanes (short/long queues, long work capped per step) or fcfs (one FIFO "
         "queue, whole-prompt prefills: the seed's starting point, for comparison)"),
    Flag("--long-prompt-threshold", int, 1024, "prompt tokens (text + image) from which a request takes the long "
         "lane"),
    Flag("--long-step-tokens", int, 512, "long-lane work per step: prefill tokens + visual tokens x vision layers"),
    Flag("--long-step-tokens-idle", int, None, "long-lane work per step when no short request is waiting or "
         "prefilling (default: --long-step-tokens)"),
    Flag("--long-max-wait-steps", int, 4, "steps in a row long work may be held back for short work (aging)"),
    Flag("--kv-admission", str, "whole-prompt", "whole-prompt (start a prefill only when its whole prompt + "
         "reserve fits) or optimistic (admit when the next chunk fits; preempt by recompute when dry)"),
    Flag("--max-queued-requests", int, 256, "requests waiting per lane; beyond it HTTP 429 with Retry-After"),
    Flag("--max-concurrent-requests", int, 0, "requests in flight at once (preprocessing + generation), all lanes; "
         "beyond it HTTP 429 (0: no cap; the per-lane queue bound usually suffices)"),
    Flag("--request-timeout", float, None, "seconds a request may take from arrival to its last token; later it "
         "fails with HTTP 504 (or an error event mid-stream) and its KV blocks are freed (default: no limit)"),
    Flag("--shutdown-timeout", float, 30.0, "on SIGTERM: seconds in-flight requests get to finish (new ones get "
         "503) before the rest are aborted and the server exits 0"),
    Flag("--encoder-cache-memory", parse_bytes, "512MiB", "bytes of vision-encoder outputs kept by image hash"),
    Flag("--no-prefix-cache", None, False, "disable KV prefix caching (for side-by-side measurement)"),
    Flag("--no-encoder-cache", None, False, "disable the vision-encoder output cache"),
    Flag("--allowed-media-dir", Path, None, "serve local image paths / file:// URLs only inside this directory "
         "(off by default)"),
    Flag("--allowed-media-domains", str, None, "comma-separated hosts whose http(s) image URLs the server may fetch "
         "(off by default); never from loopback, private, link-local or metadata addresses, checked after DNS "
         "and on every redirect"),
    Flag("--media-fetch-timeout", float, 5.0, "seconds one remote image fetch may take, redirects included"),
    Flag("--max-request-bytes", parse_bytes, "64MiB", "largest request body; larger gets HTTP 413"),
    Flag("--request-body-timeout", float, 60.0, "seconds from a request's headers to the last byte of its body; "
         "later gets HTTP 408 and the connection is closed (a body that never ends cannot hold a connection)"),
    Flag("--request-header-timeout", float, 30.0, "seconds a connection may take to send a request's headers; "
         "later it is closed"),
    Flag("--max-unread-outputs", int, 256, "outputs (about one per token) a streaming request may leave unread "
         "once the connection's buffers are full; beyond it the client is not reading: the request is aborted, "
         "logged and counted (firsttoken_requests_aborted_total{reason=\"client_not_reading\"})"),
    Flag("--image-max-tokens", int, 1280, "visual tokens per image at most (the cap; images are resized to fit, "
         "aspect ratio kept; requests may ask for less, never more); 16384 = Qwen2-VL's processor default"),
    Flag("--image-min-tokens", int, 4, "visual tokens per image at least (smaller images are scaled up)"),
    Flag("--image-low-detail-tokens", int, 256, "the per-image budget of image_url.detail=low"),
    Flag("--max-images-per-request", int, 16, "images one request may carry, counted before any is decoded; "
         "more gets HTTP 400"),
    Flag("--max-image-pixels", int, 40_000_000, "declared width x height per image, checked from the header "
         "before decoding; more gets HTTP 400"),
    Flag("--max-input-tokens", int, None, "prompt tokens (text + image + chat template) a request may bring; "
         "more gets HTTP 400 (default: only the context limit applies)"),
    Flag("--seed", int, None, "seed for requests that bring no seed of their own"),
    Flag("--log-level", str, "info", "debug, info, warning, error"),
    Flag("--log-format", str, "text", "server log lines: text or json (one object per line); both carry the "
         "request id"),
    Flag("--request-log", Path, None, "append one JSON line per finished request (outcome, sizes, TTFT phases) "
         "to this file; no prompt text or image bytes"),
    Flag("--request-log-content", None, False, "also write each prompt's text and image hashes to the request log"),
    Flag("--stats-window", float, 300.0, "seconds of finished requests that GET /stats and /dashboard summarise"),
    Flag("--api-key", str, None, "require 'Authorization: Bearer KEY' on every route but /health and /dashboard "
         "(default: $FIRSTTOKEN_API_KEY; unset = open)"),
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible server",
                              description="Serve a Qwen2-VL checkpoint over an OpenAI-compatible HTTP API.")
    for f in FLAGS:
        if f.type is None:
            p.add_argument(f.name, action="store_true", help=f.help)
        else:
            default = f.type(f.default) if isinstance(f.default, str) and f.type is parse_bytes else f.default
            p.add_argument(f.name, type=f.type, default=default, help=f"{f.help} (default: {f.default})")
    p.set_defaults(handler=run)


def engine_config(args: argparse.Namespace) -> "EngineConfig":
    """The engine's frozen config from serve's flags; ValueError (naming the field) when a value is out of range."""
    from firsttoken.config import CacheConfig, SchedulerConfig
    from firsttoken.engine.engine import EngineConfig

    return EngineConfig(
        dtype=args.dtype,
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory_bytes=args.kv_cache_memory,
            enable_prefix_caching=not args.no_prefix_cache,
            encoder_cache_memory_bytes=args.encoder_cache_memory,
            enable_encoder_cache=not args.no_encoder_cache,
        ),
        scheduler=SchedulerConfig(
            max_batched_tokens=args.max_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            decode_reserve_tokens=args.decode_reserve_tokens,
            scheduling=args.scheduling,
            long_prompt_threshold=args.long_prompt_threshold,
            long_step_tokens=args.long_step_tokens,
            long_step_tokens_idle=args.long_step_tokens_idle,
            long_max_wait_steps=args.long_max_wait_steps,
            kv_admission=args.kv_admission,
            max_queued_requests=args.max_queued_requests,
            max_model_len=args.max_model_len,
        ),
        seed=args.seed,
        request_timeout_s=args.request_timeout,
    )


def build_server(args: argparse.Namespace, fault_hook: Any = None, media_network: Any = None):
    """Everything `serve` starts, minus uvicorn: (app, async_engine). Tests use it too; `fault_hook` is the
    runner's test seam (see runner.model_runner.FaultHook), None in production; `media_network` replaces
    how remote images reach the network (inputs.media.MediaNetwork: resolver, fetcher), None in production."""
    from transformers import AutoTokenizer

    from firsttoken.api.observability import observability_from_args
    from firsttoken.api.server import build_app
    from firsttoken.api.settings import ServerSettings
    from firsttoken.config import GenerationDefaults
    from firsttoken.engine.async_engine import AsyncEngine
    from firsttoken.engine.engine import LLMEngine
    from firsttoken.inputs.budget import ImageBudget
    from firsttoken.inputs.media import remote_media
    from firsttoken.inputs.processor import ImageSettings, InputProcessor
    from firsttoken.models.checkpoint import demo_model_dir

    model_dir = Path(args.model) if args.model else demo_model_dir()
    if args.model is None:
        log.warning("no --model given: serving the built-in demo checkpoint (random weights, nonsense answers) "
                    "from %s", model_dir)
    config = engine_config(args)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    observability = observability_from_args(args, tokenizer)
    engine = LLMEngine(
        model_dir, config, tokenizer=_decoder(tokenizer), fault_hook=fault_hook, observer=observability.recorder
    )
    async_engine = AsyncEngine(
        engine,
        num_threads=args.num_threads,
        max_unread_outputs=args.max_unread_outputs,
        on_abort=observability.recorder.on_aborted,
    )
    processor = InputProcessor(
        tokenizer,
        engine.model_config,
        GenerationDefaults.from_pretrained(model_dir),
        max_model_len=engine.max_model_len,
        images=ImageSettings(
            budget=ImageBudget(args.image_max_tokens, args.image_min_tokens, args.image_low_detail_tokens),
            max_image_pixels=args.max_image_pixels,
            max_images_per_prompt=args.max_images_per_request,
            allowed_media_dir=args.allowed_media_dir,
            remote=remote_media(args.allowed_media_domains, args.media_fetch_timeout, media_network),
        ),
        max_input_tokens=args.max_input_tokens,
        admission=async_engine.check_admission,
    )
    settings = ServerSettings(
        served_model_name=args.served_model_name or model_dir.name,
        max_model_len=engine.max_model_len,
        model_root=str(model_dir),
        allowed_media_dir=args.allowed_media_dir,
        max_request_body_bytes=args.max_request_bytes,
        max_concurrent_requests=args.max_concurrent_requests,
        request_body_timeout_s=args.request_body_timeout,
    )
    return build_app(async_engine, processor, settings, observability), async_engine


def _decoder(tokenizer: Any) -> Any:
    """The Rust tokenizer decodes without the Python wrapper's overhead; the detokenizer calls it per token."""
    return getattr(tokenizer, "backend_tokenizer", None) or tokenizer


def run(args: argparse.Namespace) -> int:
    """Check the flags (cheap, before any weight is read), load, serve until SIGTERM. A misconfiguration is a
    cli.usage.UsageError: one line naming the flag, exit 2 (cli.main prints it)."""
    import torch
    import uvicorn

    from firsttoken.api.http_protocol import header_timeout_protocol
    from firsttoken.api.logs import configure_logging
    from firsttoken.api.shutdown import DrainingServer
    from firsttoken.cli.serve_checks import RENAMED_FLAGS, check_serve_args
    from firsttoken.cli.usage import from_config_error
    from firsttoken.models.checkpoint import demo_model_dir

    check_serve_args(args, Path(args.model) if args.model else demo_model_dir())
    configure_logging(args.log_level, args.log_format)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    try:
        app, async_engine = build_server(args)
    except ValueError as exc:  # a flag the cheap checks could not judge (it needed the tokenizer or the model)
        raise from_config_error(exc, args, RENAMED_FLAGS) or exc
    async_engine.start()
    log.info("serving on http://%s:%d", args.host, args.port)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                            http=header_timeout_protocol(args.request_header_timeout),
                            timeout_graceful_shutdown=1,  # after our own drain: cancel (abort) what is left
                            log_config=None)  # uvicorn's loggers propagate to ours (text or json, with request ids)
    server = DrainingServer(config, async_engine, app.state.slots, args.shutdown_timeout)
    try:
        server.run()
    finally:
        async_engine.shutdown()
    return 0


def default_args(**overrides: Any) -> argparse.Namespace:
    """The serve flags' defaults as a namespace (for tests and benchmarks), with overrides by dest name."""
    values = {f.dest: (parse_bytes(f.default) if f.type is parse_bytes and isinstance(f.default, str) else f.default)
              for f in FLAGS}
    unknown = set(overrides) - set(values)
    if unknown:
        raise ValueError(f"unknown serve options: {sorted(unknown)}")
    values.update(overrides)
    return argparse.Namespace(**values)

