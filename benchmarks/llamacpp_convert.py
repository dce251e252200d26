"""Run llama.cpp's convert_hf_to_gguf.py on a firsttoken checkpoint, unchanged but for one lookup.

The converter names a BPE tokenizer's pre-tokenizer by hashing how it splits a fixed text; our locally trained
tokenizer gives a hash it has never seen, so it stops with "BPE pre-tokenizer was not recognized". Our
tokenizer.json splits with exactly Qwen2's regex followed by ByteLevel, so "qwen2" is the right answer: this
shim checks that (and refuses otherwise), then answers "qwen2" where the converter's table has no entry.

Runs under the converter's own Python (a venv with transformers 4.57.x and llama.cpp's gguf-py), never
firsttoken's, so it imports nothing from firsttoken:

    CONVERT_PY llamacpp_convert.py LLAMA_CPP_SRC MODEL_DIR --outtype f32 --outfile model.gguf [--mmproj]
"""

from __future__ import annotations

import json
import logging
import runpy
import sys
from pathlib import Path

# The split regex of Qwen2's tokenizer.json (Qwen/Qwen2-VL-2B-Instruct), which llama.cpp's "qwen2" implements.
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
FALLBACK_PRE = "qwen2"


def splits_like_qwen2(model_dir: Path) -> bool:
    """True when tokenizer.json's pre-tokenizer is [Split(Qwen2 regex, Isolated), ByteLevel(no regex)]."""
    pre = json.loads((model_dir / "tokenizer.json").read_text()).get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds != ["Split", "ByteLevel"]:
        return False
    split, byte_level = steps
    return (split.get("pattern", {}).get("Regex") == QWEN2_SPLIT_REGEX and split.get("behavior") == "Isolated"
            and byte_level.get("use_regex") is False)  # fmt: skip


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit(__doc__)
    src, model_dir = Path(argv[0]).resolve(), Path(argv[1])
    if not splits_like_qwen2(model_dir):
        raise SystemExit(f"{model_dir}/tokenizer.json does not split like Qwen2: refusing to label it 'qwen2'")
    sys.path.insert(0, str(src))
    from conversion import base  # llama.cpp's converter package, next to convert_hf_to_gguf.py

    lookup = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return lookup(self, tokenizer)
        except NotImplementedError:  # the converter's "not recognized": an unknown hash
            logging.getLogger("llamacpp_convert").warning("unknown pre-tokenizer hash: using %r", FALLBACK_PRE)
            return FALLBACK_PRE

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    script = src / "convert_hf_to_gguf.py"
    sys.argv = [str(script), str(model_dir), *argv[2:]]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
