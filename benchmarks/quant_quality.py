"""Quality of --quantization fp16 / int8 against float32 on the same checkpoint (default: the `small` one the other
benchmarks use), teacher-forced: the oracle suite's prompt shapes (a text prompt, one image, three images), longer
text, every prompt position's logits from a float32 load and from each quantized load. Prints the top-1 agreement
(all positions, and the text positions alone: an image-pad position's logits are never sampled) with n, and the
largest logit error relative to the largest logit. The 2-layer checkpoint of tests/oracle/test_quantization.py is
checked the same way in CI; this is the benchmark checkpoint's figure. Float32 here is firsttoken's (within 1e-5 of
transformers: tests/oracle).

    PYTHONPATH=. python benchmarks/quant_quality.py [--model DIR] [--quantizations fp16,int8] [--json OUT]
    # natural text as llama.cpp's llama-perplexity --kl-divergence scores it ("Same top p"): chunks of 512 tokens,
    # the second half of each scored, so the figure sits beside its Q8_0's on the same file and weights
    PYTHONPATH=. python benchmarks/quant_quality.py --text-file FILE --chunk 512
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import small_model  # noqa: E402
from machine import machine_info  # noqa: E402

from firsttoken.loading.loader import load_model  # noqa: E402
from tests.oracle.parity import Prompt, TinyRunner, make_prompt  # noqa: E402

SHAPES = {"text": [], "one_image": [(336, 224)], "three_images": [(252, 112), (112, 168), (224, 224)]}
TEXT_TOKENS = 400  # beside the images: more text positions than the oracle's 40


def prompts(config) -> dict[str, Prompt]:
    out = {}
    for i, (name, sizes) in enumerate(SHAPES.items()):
        p = make_prompt(config, sizes, seed=11 + i)
        extra = make_prompt(config, [], seed=21 + i).ids * (TEXT_TOKENS // 40)  # 40 random ids per call
        out[name] = Prompt(p.ids + extra, p.pixel_values, p.grid_thw)
    return out


def text_chunks(model_dir: str, path: str, chunk: int) -> dict[str, Prompt]:
    """The file's tokens in whole chunks of ``chunk`` (the tail dropped), each its own text prompt."""
    from firsttoken.inputs.processor import load_tokenizer

    ids = load_tokenizer(model_dir)(Path(path).read_text(), add_special_tokens=False)["input_ids"]
    return {f"text_chunk{i}": Prompt(ids[i * chunk : (i + 1) * chunk], None, []) for i in range(len(ids) // chunk)}


def logits(model, prompt: Prompt) -> torch.Tensor:
    runner = TinyRunner(model)
    with torch.no_grad():
        return runner.prefill(runner.add(prompt), chunk=256)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: build 'small')")
    ap.add_argument("--quantizations", default="fp16,int8")
    ap.add_argument("--json", default=None)
    ap.add_argument("--text-file", default=None, help="score this text instead of the oracle shapes")
    ap.add_argument("--chunk", type=int, default=512, help="with --text-file: tokens per chunk; the second half of "
                    "each is scored")
    args = ap.parse_args()
    model_dir = small_model(args.model)
    exact = load_model(model_dir, torch.float32, cpu_kernels="off")
    config = exact.config
    cases = text_chunks(model_dir, args.text_file, args.chunk) if args.text_file else prompts(config)
    reference = {name: logits(exact, p) for name, p in cases.items()}
    del exact
    results = {"machine": machine_info(), "model": str(model_dir), "text_tokens_added": TEXT_TOKENS, "runs": []}
    print(f"{'quantization':13s}{'prompt':14s}{'n':>6s}{'top-1 all':>11s}{'n text':>8s}{'top-1 text':>12s}"
          f"{'max|dlogit|/max':>17s}")
    for quant in args.quantizations.split(","):
        model = load_model(model_dir, torch.float32, quantization=quant)
        scored = []
        for name, p in cases.items():
            got, want = logits(model, p), reference[name]
            if args.text_file:  # the second half, as llama-perplexity scores
                half = len(p.ids) // 2
                scored.append(got[half:].argmax(-1) == want[half:].argmax(-1))
                continue
            same = got.argmax(-1) == want.argmax(-1)
            text = torch.tensor([t != config.image_token_id for t in p.ids])
            row = {"quantization": quant, "prompt": name, "positions": len(p.ids),
                   "top1_agreement": same.float().mean().item(), "text_positions": int(text.sum()),
                   "top1_agreement_text": same[text].float().mean().item(),
                   "max_logit_error_rel": ((got - want).abs().max() / want.abs().max()).item()}
            results["runs"].append(row)
            print(f"{quant:13s}{name:14s}{row['positions']:6d}{row['top1_agreement']:11.4f}{row['text_positions']:8d}"
                  f"{row['top1_agreement_text']:12.4f}{row['max_logit_error_rel']:17.2e}")
        if scored:
            same = torch.cat(scored).float()
            row = {"quantization": quant, "text_file": args.text_file, "chunks": len(scored),
                   "scored_positions": len(same), "top1_agreement": same.mean().item()}
            results["runs"].append(row)
            print(f"{quant:13s}{'text file':14s}{len(same):6d}{row['top1_agreement']:11.4f}  ({len(scored)} chunks of "
                  f"{args.chunk}, second halves)")
        del model
    m = results["machine"]
    print(f"CPU {m['cpu']}, flags {' '.join(m['cpu_flags'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
