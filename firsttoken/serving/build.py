"""How a firsttoken server is assembled from the config tree: the model directory and served name,
the engine (weights loaded, calibrated, its thread not yet started) and the input processor.
``firsttoken serve`` puts both in one process behind one HTTP app (cli/serve.py); on Ray Serve each
engine replica builds the engine and the ingress builds the processor (serving/replica.py,
serving/ingress.py). Nothing here imports Ray.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

# the command line imports this module; torch and the engine load only when a server is built
if TYPE_CHECKING:
    from firsttoken.config import ServeConfig
    from firsttoken.engine.async_engine import AsyncEngine
    from firsttoken.inputs.processor import InputProcessor
    from firsttoken.metrics.recorder import Recorder
    from firsttoken.models.config import ModelConfig

log = logging.getLogger("firsttoken.serve")


def model_dir_of(config: ServeConfig) -> Path:
    """--model as a local directory: itself, a Hugging Face repo id resolved (models/hub.py), or the
    demo."""
    from firsttoken.models.checkpoint import demo_model_dir
    from firsttoken.models.hub import resolve_model

    return resolve_model(config.model) if config.model else demo_model_dir()


def served_name_of(config: ServeConfig, model_dir: Path) -> str:
    """What clients send as `model`: --served-model-name, else the repo id as given, else the
    directory's name."""
    from firsttoken.models.hub import is_repo_id

    if config.served_model_name:
        return config.served_model_name
    return (
        config.model
        if config.model and is_repo_id(config.model) and not Path(config.model).exists()
        else model_dir.name
    )


def build_engine(config: ServeConfig, model_dir: Path, tokenizer: Any, recorder: Recorder,
                 fault_hook: Any = None) -> AsyncEngine:
    """The engine over ``model_dir`` (weights loaded; calibrated when steps are time-bounded or TTFT
    has an objective), wrapped in its asyncio bridge; the caller starts its thread. ``fault_hook``:
    the runner's test seam (runner.model_runner.FaultHook), None in production."""
    from firsttoken.engine.async_engine import AsyncEngine
    from firsttoken.engine.engine import LLMEngine

    if config.model is None:
        log.warning("no --model given: serving the built-in demo checkpoint (random weights, nonsense answers) "
                    "from %s", model_dir)
    engine = LLMEngine(
        model_dir,
        config.engine,
        tokenizer=_decoder(tokenizer),
        fault_hook=fault_hook,
        observer=recorder,
        profile_image_tokens=config.images.image_max_tokens,
    )
    if config.engine.scheduler.step_time_target != "off" or config.engine.scheduler.ttft_slo:
        # the step-cost model prices steps and predicts TTFT from the first request on
        engine.calibrate()
    return AsyncEngine(engine, on_abort=recorder.on_aborted)


def build_processor(
    config: ServeConfig,
    model_dir: Path,
    tokenizer: Any,
    model_config: ModelConfig,
    max_model_len: int,
    media_network: Any = None,
) -> InputProcessor:
    """The processor for prompts to an engine with these facts. ``media_network`` replaces how
    remote images reach the network (inputs.media.MediaNetwork: resolver, fetcher), None in
    production."""
    from firsttoken.config import GenerationDefaults
    from firsttoken.inputs.processor import InputProcessor

    return InputProcessor(
        tokenizer,
        model_config,
        GenerationDefaults.from_pretrained(model_dir),
        max_model_len=max_model_len,
        images=config.images,
        videos=config.videos,
        media_network=media_network,
    )


def _decoder(tokenizer: Any) -> Any:
    """The Rust tokenizer decodes without the Python wrapper's overhead; the detokenizer calls it
    per token."""
    return getattr(tokenizer, "backend_tokenizer", None) or tokenizer
