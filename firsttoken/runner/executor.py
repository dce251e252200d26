"""The executor: where a step's ``ScheduledBatch`` runs. The engine talks to this interface only.

Today one implementation, ``InProcessExecutor``: the model, its KV cache and the ModelRunner live in
the engine's thread. Because the batch is plain data and the runner owns all per-request state
(runner/model_runner.py), a process, a Ray actor or a GPU worker can implement the same two members
without the engine changing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from firsttoken.batch import RunnerOutput, ScheduledBatch
from firsttoken.config import GrammarConfig
from firsttoken.loading.loader import build_model
from firsttoken.loading.plan_values import Machine, ModelPlan
from firsttoken.models.model_config import ModelConfig
from firsttoken.runner.cuda_graphs import CudaGraphRunner, GraphInputs
from firsttoken.runner.kv_cache import allocate_kv_caches
from firsttoken.runner.model_runner import FaultHook, ModelRunner, ThreadPlan
from firsttoken.runner.profile import ProfileStep, profile_forward
from firsttoken.sampling.sampler import Sampler


class Executor(Protocol):
    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        """Run one step; per-request failures are reported in the output, never raised."""
        ...

    def finish_step(self) -> RunnerOutput | None:
        """Run what ``execute`` left for after the step's tokens went out (interruptible encoder
        work); None when nothing was left. Per-request failures are reported, never raised."""
        ...

    @property
    def encoder_cache_bytes(self) -> int:
        """Bytes of vision-tower outputs held (for /v1/engine/stats)."""
        ...


class InProcessExecutor:
    """Loads the checkpoint as its plan says and runs batches in the calling thread. Built in
    start-up's order (engine.py): the constructor loads the weights; ``profile_step`` may run the
    profiling forward (the device sizes the KV pool from its peak); ``allocate_kv_cache`` allocates
    the paged KV cache and makes the runner, before the first ``execute``."""

    def __init__(
        self,
        model_dir: str | Path,
        model_config: ModelConfig,
        plan: ModelPlan,
        machine: Machine,
        block_size: int,
        seed: int | None = None,
        fault_hook: FaultHook | None = None,
        threads: ThreadPlan | None = None,
        interrupt: Callable[[], bool] | None = None,
        grammar: GrammarConfig | None = None,
    ) -> None:
        """``plan``: how the model runs here (loading/load_plan.py, resolved by the engine);
        ``interrupt``: the runner asks it between interruptible encoder units; ``grammar``: how it
        runs constrained requests' grammar work (ModelRunner)."""
        self.model = build_model(model_dir, plan, machine)
        self.model_config = model_config
        self.plan = plan
        self.block_size = block_size
        self._seed, self._fault_hook, self._threads, self._interrupt = (
            seed,
            fault_hook,
            threads,
            interrupt,
        )
        self._grammar = grammar
        self.runner: ModelRunner  # made by allocate_kv_cache (no step runs before it)

    def profile_step(self, step: ProfileStep) -> None:
        """One forward at ``step`` (runner/profile.py); only before ``allocate_kv_cache``."""
        profile_forward(self.model, self.model_config, step, self.block_size, self.plan.device)

    def allocate_kv_cache(self, num_blocks: int, cuda_graph_sizes: tuple[int, ...] = (),
                          max_model_len: int = 0) -> None:
        """The KV pool of ``num_blocks`` blocks, and the runner over it. With ``cuda_graph_sizes``
        (cuda only) one block more, the scratch block the graphs' padding rows write (block
        ``num_blocks``, outside the scheduler's pool), and the decode graphs for contexts up to
        ``max_model_len``, captured now."""
        scratch = 1 if cuda_graph_sizes else 0
        kv_caches = allocate_kv_caches(self.model_config, num_blocks + scratch, self.block_size,
                                       self.plan.torch_dtype, self.plan.device)
        graphs = None
        if cuda_graph_sizes:
            inputs = GraphInputs(
                max(cuda_graph_sizes), max_model_len, self.block_size, num_blocks, self.plan.device
            )
            graphs = CudaGraphRunner(self.model, kv_caches, inputs, cuda_graph_sizes)
            graphs.capture()
        sampler = Sampler(self._seed, kernels=self.plan.sampler_kernels)
        self.runner = ModelRunner(
            self.model,
            kv_caches,
            self.block_size,
            sampler,
            self._fault_hook,
            self._threads,
            self._interrupt,
            self.plan.device,
            graphs,
            self._grammar,
        )

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        return self.runner.execute(batch)

    def finish_step(self) -> RunnerOutput | None:
        return self.runner.finish_step()

    @property
    def encoder_cache_bytes(self) -> int:
        return self.runner.encoder_cache_bytes
