"""The token history penalties read, kept up to date one sampled token at a time.

The repetition penalty (transformers) touches every distinct token of prompt + output; presence and
frequency penalties (OpenAI) every distinct output token, by its count. Rebuilding those sets from
the whole history each step cost O(prompt + output) Python per request per step (a 1,400-token image
prompt: the largest part of the sampler's time). ``TokenHistory`` holds them as tensors and grows
them by the step's one token, so a step costs a few tensor ops over the distinct tokens, whatever
the history's length.

Index order is irrelevant to the result: every penalty is applied per distinct id (gather, modify,
scatter back).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class TokenHistory:
    def __init__(
        self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int] = ()
    ) -> None:
        self._seen: set[int] = set(prompt_token_ids)
        # output token id -> its row in output_ids / output_counts
        self._out_index: dict[int, int] = {}
        out_ids: list[int] = []
        out_counts: list[int] = []
        for t in output_token_ids:
            self._seen.add(t)
            row = self._out_index.setdefault(t, len(out_ids))
            if row == len(out_ids):
                out_ids.append(t)
                out_counts.append(0)
            out_counts[row] += 1
        # [distinct prompt + output tokens]
        self.seen_ids = torch.tensor(sorted(self._seen), dtype=torch.long)
        self.output_ids = torch.tensor(out_ids, dtype=torch.long)  # [distinct output tokens]
        # [distinct output tokens], >= 1
        self.output_counts = torch.tensor(out_counts, dtype=torch.long)

    def has_seen(self, token_id: int) -> bool:
        """Is this token in the prompt or the output so far?"""
        return token_id in self._seen

    def append(self, token_id: int) -> None:
        """One more output token."""
        if token_id not in self._seen:
            self._seen.add(token_id)
            self.seen_ids = torch.cat((self.seen_ids, torch.tensor([token_id])))
        row = self._out_index.get(token_id)
        if row is None:
            self._out_index[token_id] = len(self._out_index)
            self.output_ids = torch.cat((self.output_ids, torch.tensor([token_id])))
            self.output_counts = torch.cat((self.output_counts, torch.ones(1, dtype=torch.long)))
        else:
            self.output_counts[row] += 1
