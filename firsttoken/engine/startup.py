"""Start-up, in vLLM's order: load the weights; where the device sizes the KV pool (cuda without
--kv-cache-memory), one profiling forward at the largest step the budgets allow (runner/profile.py),
the device's memory measured around both, and the configuration resolved again with those facts (a
one-line DeviceMemoryTooSmall when they leave no pool); then the KV pool of the resolved blocks, and
the decode graphs captured over it (--cuda-graphs). On the CPU: load, allocate, nothing else."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from firsttoken.device_memory import MeasureDeviceMemory, measure_device_memory
from firsttoken.engine.resolve import ResolvedEngineConfig, resolve_engine_config
from firsttoken.loading.plan_values import Machine
from firsttoken.models.model_config import ModelConfig
from firsttoken.runner.executor import InProcessExecutor
from firsttoken.runner.model_runner import FaultHook, ThreadPlan
from firsttoken.runner.profile import ProfileStep


def start_executor(
    model_dir: str | Path,
    model_config: ModelConfig,
    config: ResolvedEngineConfig,
    machine: Machine,
    interrupt: Callable[[], bool],
    image_tokens: int,
    fault_hook: FaultHook | None = None,
    measure: MeasureDeviceMemory | None = None,
    executor_factory: Callable[..., InProcessExecutor] = InProcessExecutor,
) -> tuple[ResolvedEngineConfig, InProcessExecutor]:
    """(the configuration as finally resolved, the executor with its KV pool). ``interrupt``: what
    the runner asks between interruptible encoder units; ``image_tokens``: the profiling step's
    image (--image-max-tokens)."""
    threads = ThreadPlan(config.num_threads, config.decode_threads)

    def load() -> InProcessExecutor:
        return executor_factory(
            model_dir,
            model_config,
            config.model,
            machine,
            config.kv.block_size,
            config.requested.seed,
            fault_hook,
            threads=threads,
            interrupt=interrupt,
            grammar=config.requested.grammar,
        )

    if not config.needs_device_memory:
        executor = load()
    else:
        loaded: list[InProcessExecutor] = []
        step = ProfileStep.of(config.requested, model_config, image_tokens)
        facts = (measure or measure_device_memory)(lambda: loaded.append(load()),
                                                   lambda: loaded[0].profile_step(step))
        executor = loaded[0]
        config = resolve_engine_config(config.requested, model_dir, machine, model_config,
                                       device_memory=facts)
    executor.allocate_kv_cache(config.kv.num_blocks, config.cuda_graph_sizes, config.kv.max_model_len)
    return config, executor
