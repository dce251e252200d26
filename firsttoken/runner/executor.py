"""The executor: where a step's ``ScheduledBatch`` runs. The engine talks to this interface only.

Today one implementation, ``InProcessExecutor``: the model, its KV cache and the ModelRunner live in the engine's
thread. Because the batch is plain data and the runner owns all per-request state (runner/model_runner.py), a
process, a Ray actor or a GPU worker can implement the same two members without the engine changing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from firsttoken.batch import RunnerOutput, ScheduledBatch
from firsttoken.loading.loader import build_model
from firsttoken.loading.plan_values import Machine, ModelPlan
from firsttoken.models.config import ModelConfig
from firsttoken.runner.kv_cache import allocate_kv_caches
from firsttoken.runner.model_runner import FaultHook, ModelRunner, ThreadPlan
from firsttoken.sampling.sampler import Sampler


class Executor(Protocol):
    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        """Run one step; per-request failures are reported in the output, never raised."""
        ...

    def finish_step(self) -> RunnerOutput | None:
        """Run what ``execute`` left for after the step's tokens went out (interruptible encoder work); None when
        nothing was left. Per-request failures are reported, never raised."""
        ...

    @property
    def encoder_cache_bytes(self) -> int:
        """Bytes of vision-tower outputs held (for /v1/engine/stats)."""
        ...


class InProcessExecutor:
    """Loads the checkpoint as its plan says, allocates the paged KV cache, and runs batches in the calling
    thread."""

    def __init__(
        self,
        model_dir: str | Path,
        model_config: ModelConfig,
        plan: ModelPlan,
        machine: Machine,
        num_kv_blocks: int,
        block_size: int,
        seed: int | None = None,
        fault_hook: FaultHook | None = None,
        threads: ThreadPlan | None = None,
        interrupt: Callable[[], bool] | None = None,
    ) -> None:
        """``plan``: how the model runs here (loading/plan.py, resolved by the engine); ``interrupt``: the runner
        asks it between interruptible encoder units (ModelRunner)."""
        model = build_model(model_dir, plan, machine)
        kv_caches = allocate_kv_caches(model_config, num_kv_blocks, block_size, plan.torch_dtype, plan.device)
        sampler = Sampler(seed, kernels=plan.sampler_kernels)
        self.runner = ModelRunner(model, kv_caches, block_size, sampler, fault_hook, threads, interrupt, plan.device)

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        return self.runner.execute(batch)

    def finish_step(self) -> RunnerOutput | None:
        return self.runner.finish_step()

    @property
    def encoder_cache_bytes(self) -> int:
        return self.runner.encoder_cache_bytes
