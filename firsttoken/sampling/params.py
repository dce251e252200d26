"""Per-request sampling parameters, validated once at the API boundary."""

from __future__ import annotations

from dataclasses import dataclass

SAMPLING_EPS = 1e-5  # a temperature below this samples greedily (as vLLM); dividing by it would overflow


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # 0 (or anything below SAMPLING_EPS) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None  # a per-request generator: same seed, same output
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # EOS ids from generation_config.json + the request's own
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per position, 0..20

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError("temperature must be between 0 and 2")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 disables it)")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError("presence_penalty must be between -2 and 2")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError("frequency_penalty must be between -2 and 2")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError("repetition_penalty must be in (0, 10]")
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError("top_logprobs must be between 0 and 20")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
