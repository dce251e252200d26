"""How firsttoken is assembled from the config tree, in one place for every way it runs: the model
directory and served name, the engine (weights loaded, calibrated where its steps are time-bounded)
and the input processor. ``firsttoken serve`` puts both in one process behind one HTTP app
(cli/serve.py), the offline ``LLM`` steps the engine itself (llm.py), and on Ray Serve each engine
replica builds the engine and the ingress builds the processor (serving/replica.py,
serving/ingress.py). Nothing here imports Ray.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

# the command line imports this module; torch and the engine load only when a server is built
if TYPE_CHECKING:
    from firsttoken.config import ServeConfig
    from firsttoken.engine.engine import LLMEngine
    from firsttoken.inputs.processor import InputProcessor
    from firsttoken.metrics.recorder import Recorder
    from firsttoken.models.model_config import ModelConfig

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


def needs_calibration(config: ServeConfig) -> bool:
    """The step-cost model prices steps and predicts TTFT from the first request on: fitted before
    serving where steps are time-bounded or TTFT has an objective."""
    sched = config.engine.scheduler
    return not sched.step_time_target.is_off or bool(sched.ttft_slo_s)


def build_engine(config: ServeConfig, model_dir: Path, tokenizer: Any,
                 recorder: Recorder | None = None, fault_hook: Any = None,
                 offline: bool = False) -> LLMEngine:
    """The engine over ``model_dir``: weights loaded, calibrated where ``needs_calibration``; the
    caller wraps it (AsyncEngine) or steps it itself (the offline LLM). ``offline``: no server
    threads share the cores, so decode-only steps default to all of the engine's threads (a server
    leaves one to its own threads). ``fault_hook``: the runner's test seam
    (runner.model_runner.FaultHook), None in production."""
    from firsttoken.engine.engine import LLMEngine
    from firsttoken.runner.model_runner import DEFAULT_THREADS

    if config.model is None:
        log.warning("no --model given: serving the built-in demo checkpoint (random weights, nonsense answers) "
                    "from %s", model_dir)
    engine_config = config.engine
    if offline and engine_config.decode_threads is None:
        engine_config = replace(
            engine_config, decode_threads=engine_config.num_threads or DEFAULT_THREADS
        )
    engine = LLMEngine(
        model_dir,
        engine_config,
        tokenizer=_decoder(tokenizer),
        fault_hook=fault_hook,
        observer=recorder,
        profile_image_tokens=config.images.image_max_tokens,
    )
    if needs_calibration(config):
        engine.calibrate()
    return engine


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


def assemble(config: ServeConfig, model_dir: Path, tokenizer: Any, recorder: Recorder | None = None,
             fault_hook: Any = None, media_network: Any = None, offline: bool = False
             ) -> tuple[LLMEngine, InputProcessor]:
    """The engine and its processor, as ``firsttoken serve`` and the offline ``LLM`` run them (the
    Ray replica builds the engine half, the ingress the processor half, from the replica's facts)."""
    engine = build_engine(config, model_dir, tokenizer, recorder, fault_hook, offline)
    processor = build_processor(config, model_dir, tokenizer, engine.model_config,
                                engine.max_model_len, media_network)
    return engine, processor


def _decoder(tokenizer: Any) -> Any:
    """The Rust tokenizer decodes without the Python wrapper's overhead; the detokenizer calls it
    per token."""
    return getattr(tokenizer, "backend_tokenizer", None) or tokenizer
