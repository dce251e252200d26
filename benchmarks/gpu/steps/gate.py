"""The correctness gate: our engine's greedy tokens against transformers' on the benchmark shape (Qwen2-VL-7B,
dummy weights shared by both models: benchmarks/gpu/reference.py), for a short text and a one-image prompt, in bf16
and fp32, with each attention backend. The timing steps measure a backend only where its gate passed.

The rule (``RULE``, also in docs/gpu.md): our engine generates N greedy tokens (``ignore_eos``, no repetition
penalty); transformers then scores the prompt followed by those tokens in one forward (teacher forcing) and, at
each step, our token's logit must be within ``TOLERANCE_SIGMA[dtype]`` x the standard deviation of that step's
logits of transformers' best. A step where transformers' argmax is our token counts as equal; one within the
tolerance as a near-tie (the two implementations round differently, and with random weights the top two logits of
a 152k vocabulary are often closer than bf16's rounding: a benign tie must not fail the gate); one beyond it fails
the case. Teacher forcing keeps comparing after a benign tie, where comparing two free generations would stop. The
literal comparison (transformers' own ``generate``, greedy, against our tokens up to its length) is recorded
beside the verdict.
"""

from __future__ import annotations

from pathlib import Path

import torch

from firsttoken.llm import LLM
from firsttoken.tools.bench.images import synth_image
from manifest import BACKENDS, GATE_DTYPES, GATE_PROMPTS, backend_verdict
from reference import model_inputs, transformers_over
from setting import DTYPES, GATE_FAMILY, Setting, model_of
from step import Recorder

TOLERANCE_SIGMA = {"bf16": 0.2, "fp32": 0.002}  # x the std of the step's logits over the vocabulary
RULE = ("each of our greedy tokens within TOL x std(logits) of transformers' best logit at that step, teacher-forced "
        f"on our tokens; TOL {TOLERANCE_SIGMA}")


def prompts(setting: Setting) -> dict[str, list[dict]]:
    side = setting.image_side_px
    question = "Tell me about the lighthouse keeper who kept the light burning through the storm."
    return {
        "text": [{"role": "user", "content": question}],
        "image": [{"role": "user", "content": [{"type": "image_pil", "image_pil": synth_image(side, side, "gate")},
                                               {"type": "text", "text": "What is in this picture?"}]}],
    }  # fmt: skip


def compare(llm: LLM, reference: torch.nn.Module, messages: list[dict], dtype: str, setting: Setting) -> dict:
    """One case: our greedy tokens scored by transformers (the rule above), and transformers' own generate."""
    sampling = {"max_tokens": setting.gate_new_tokens, "temperature": 0, "ignore_eos": True,
                "repetition_penalty": 1.0}
    ours = llm.chat(messages, sampling)
    if ours.error is not None:
        raise RuntimeError(f"our engine failed the request: {ours.error}")
    tokens = list(ours.token_ids)
    request = llm.preprocess_chat(messages, sampling)  # the same ids and patches the engine got
    torch_dtype = DTYPES[dtype][1]
    with torch.inference_mode():
        scored = model_inputs(request, torch_dtype, setting.device, tuple(tokens[:-1]))
        logits = reference(**scored, logits_to_keep=len(tokens)).logits[0].float()  # [N, vocab]
        generated = reference.generate(**model_inputs(request, torch_dtype, setting.device),
                                       max_new_tokens=len(tokens), do_sample=False, repetition_penalty=1.0)
    theirs = generated[0, len(request.prompt_token_ids):].tolist()
    return judge(logits, tokens, TOLERANCE_SIGMA[dtype]) | {
        "generate_equal": tokens[:len(theirs)] == theirs, "prompt_tokens": len(request.prompt_token_ids),
        "ours": tokens, "transformers_generate": theirs}  # fmt: skip


def judge(logits: torch.Tensor, tokens: list[int], tolerance_sigma: float) -> dict:
    """The rule on transformers' teacher-forced ``logits`` [steps, vocab] and our ``tokens`` (one per step):
    "equal" where every token is the argmax, "near-tie" where every one is within ``tolerance_sigma`` x that step's
    logit std of the best, else "mismatch"."""
    chosen = torch.tensor(tokens, device=logits.device)
    sigma = logits.std(-1)
    deficit = logits.max(-1).values - logits.gather(1, chosen[:, None])[:, 0]  # >= 0: how far ours is from best
    exact = logits.argmax(-1) == chosen
    within = deficit <= tolerance_sigma * sigma
    verdict = "equal" if bool(exact.all()) else "near-tie" if bool(within.all()) else "mismatch"
    return {"verdict": verdict, "steps": len(tokens), "steps_argmax_equal": int(exact.sum()),
            "steps_within_tolerance": int(within.sum()), "max_deficit_over_sigma": float((deficit / sigma).max()),
            "tolerance_sigma": tolerance_sigma}  # fmt: skip


def run(setting: Setting, rec: Recorder, results: Path) -> bool:
    """Whether every case passed (the step exits 1 otherwise; its JSON is done either way)."""
    if setting.device == "cuda":  # fp32 means fp32 on both sides: no TF32 in matmuls or transformers' Conv3d
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    model_dir = setting.model_dir(GATE_FAMILY)
    cases = prompts(setting)
    rec.put("rule", RULE)
    rec.note(shape=setting.shape_name(GATE_FAMILY), new_tokens=setting.gate_new_tokens)
    checked: dict[tuple[str, str], dict[str, dict]] = {}  # (dtype, backend as run) -> prompt -> case
    for backend in BACKENDS:  # backend by backend, sdpa (the default) first: a gate cut short still clears it
        for dtype in GATE_DTYPES:
            used = setting.backend(backend)
            if (dtype, used) not in checked:  # a stand-in is checked once
                llm = setting.llm(model_dir, dtype, backend, max_num_seqs=1)  # triton: batch 1's graph replays
                reference = transformers_over(model_dir, model_of(llm), DTYPES[dtype][1], setting.device)
                checked[dtype, used] = {name: compare(llm, reference, cases[name], dtype, setting)
                                        | {"backend_used": used} for name in GATE_PROMPTS}  # fmt: skip
                del llm, reference
                rec.note(**{f"memory_after.{dtype}.{used}": setting.free()})
            for name, case in checked[dtype, used].items():
                rec.put(f"{dtype}.{backend}.{name}", case)
    passed = {b: backend_verdict(rec.values(), b)[0] for b in BACKENDS}
    for backend in BACKENDS:
        rec.put(f"{backend}.passed", passed[backend])
    rec.put("passed", all(passed.values()))
    return all(passed.values())
