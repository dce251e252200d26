"""Intake: a prompt to an admitted EngineRequest, on a preprocessing pool's thread.

The processor drafts the request from its text and its images' headers (every limit checked,
nothing decoded); the engine client's admission check is asked about the draft's work and, while it
asks for a lower image budget, the budget steps down the family's ladder (the one rule,
scheduler/admission.negotiate, which the simulator calls too); then the processor decodes. The input
layer never asks the engine: this module, which holds both, does.
"""

from __future__ import annotations

from dataclasses import replace

from firsttoken.engine.client import EngineClient
from firsttoken.inputs.draft import TokenCount
from firsttoken.inputs.processor import Draft, InputProcessor
from firsttoken.inputs.prompt import Prompt, SamplingRequest
from firsttoken.scheduler.admission import negotiate
from firsttoken.types import AdmissionVerdict, EngineRequest


class AdmissionRefused(Exception):
    """The engine would not queue this request now (lane full) or ever (never fits); carries the
    verdict."""

    def __init__(self, verdict: AdmissionVerdict, param: str = "messages") -> None:
        super().__init__(verdict.message)
        self.verdict = verdict
        self.param = param  # the prompt's request field (messages, prompt, input)


class Intake:
    """Thread-safe: the processor is, and the engine client's admission check is."""

    def __init__(self, processor: InputProcessor, engine: EngineClient) -> None:
        self.processor = processor
        self.engine = engine
        self.ladder = processor.vision.ladder
        self.floor = processor.images.image_min_tokens_under_load

    def request(self, prompt: Prompt, sampling: SamplingRequest, request_id: str,
                arrival_s: float) -> EngineRequest:
        """The admitted EngineRequest (it holds its admission place until the engine client's
        ``generate`` or ``release``); AdmissionRefused when the engine will not queue it, at the
        ladder's floor if its images could be lowered."""
        draft = self.processor.draft(prompt, sampling)
        start = draft.prompt.degradable_budget

        def ask(d: Draft) -> AdmissionVerdict:
            return self.engine.check_admission(self.processor.work(d), request_id)

        deal = negotiate(ask, lambda budget: self.processor.lowered(draft, budget), draft, start,
                         self.ladder, self.floor)
        if not deal.verdict.admitted:
            raise AdmissionRefused(deal.verdict, prompt.param)
        note = None
        if deal.budget is not None:
            note = (f"visual-token budget lowered from {start} to {deal.budget} per image: the predicted time to "
                    "first token, with its predicted wait counted with the server's margin, was over its objective")
        return self.processor.finish(deal.plan, request_id, arrival_s, deal.verdict, note)

    def count(self, prompt: Prompt) -> TokenCount:
        """What /tokenize reports, with the TTFT the engine predicts if it were sent now."""
        count = self.processor.count(prompt)
        assert count.work is not None
        verdict = self.engine.check_admission(count.work)
        return replace(count, predicted_ttft_s=verdict.predicted_ttft_s)
