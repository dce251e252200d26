"""Per-request sampling parameters, validated once at the API boundary."""

from __future__ import annotations

from dataclasses import dataclass

SAMPLING_EPS = 1e-5  # a temperature below this samples greedily (as vLLM); dividing by it would overflow
# What one request may make the engine do per token, and what a seeded generator accepts.
MAX_STOP_STRINGS = 32  # OpenAI allows 4; generous, and stop matching costs O(new text) however many (stop_strings.py)
MAX_STOP_STRING_CHARS = 256  # each; text held back waiting for a possible stop is shorter than this
MAX_TOP_LOGPROBS = 20  # alternatives per position, as OpenAI
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # int64, as vLLM; torch's generator refuses 2**64 and above


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
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be a 64-bit signed integer, between {SEED_MIN} and {SEED_MAX}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        longest = max(map(len, self.stop), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise ValueError(
                f"stop strings may be at most {MAX_STOP_STRING_CHARS} characters each, got one of {longest}"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
