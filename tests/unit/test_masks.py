"""The token rule a constrained answer's grammar work is started by (structured/masks.py, runner/model_runner.py)
is the engine's: one rule, on the request's sampling parameters."""

from __future__ import annotations

import pytest

from firsttoken.types import FinishReason, SamplingParams


@pytest.mark.parametrize("token, num_output_tokens, reason", [
    (9, 1, None), (9, 4, FinishReason.LENGTH), (2, 1, FinishReason.STOP), (7, 1, FinishReason.STOP),
    (2, 4, FinishReason.STOP)])
def test_the_token_rule_says_why_an_answer_ends(token: int, num_output_tokens: int, reason) -> None:
    """The one rule the engine ends an answer by and the runner starts a grammar job by (no job after the last
    token): a stop token id or an EOS id is a stop, the max_tokens-th token a length, anything else goes on."""
    params = SamplingParams(max_tokens=4, stop_token_ids=(7,), eos_token_ids=(2,))
    assert params.finish_after(token, num_output_tokens) == reason


def test_with_ignore_eos_only_the_requests_own_stop_tokens_end_it() -> None:
    params = SamplingParams(max_tokens=4, stop_token_ids=(7,), eos_token_ids=(2,), ignore_eos=True)
    assert params.finish_after(2, 1) is None and params.finish_after(7, 1) == FinishReason.STOP
