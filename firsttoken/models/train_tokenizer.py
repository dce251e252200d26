"""Train the byte-level BPE tokenizer that ships in ``firsttoken/models/assets/tokenizer.json``.

The corpus is the Python standard library's own ``.py`` and ``.txt`` files (test suites and
site-packages left out), read in sorted path order, so the result depends only on the Python
version that ships them. Training is single-threaded (``RAYON_NUM_THREADS=1``) and deterministic:
the same interpreter produces a byte-identical file. Run it only when the tokenizer should change:

    python -m firsttoken.models.train_tokenizer [--out PATH]

Layout of the vocabulary (ids are contiguous):
    [0, 256)                 the 256 byte-level symbols
    [256, NUM_BPE_TOKENS)    learnt merges
    [NUM_BPE_TOKENS, +14)    SPECIAL_TOKENS, in list order (``<|endoftext|>`` first)
"""

from __future__ import annotations

import argparse
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

# Must be set before tokenizers spins up its thread pool: one thread keeps merges deterministic.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

ASSET_PATH = Path(__file__).parent / "assets" / "tokenizer.json"

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
NUM_BPE_TOKENS = 16_000  # len(tokenizer) == 16_014; checkpoints pad the embedding rows to 16_064

# Qwen2's pre-tokenizer split: contractions, letters with one leading non-letter, single digits,
# punctuation runs, newlines, whitespace.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

MAX_CORPUS_BYTES = 16_000_000


def corpus_files(stdlib: Path | None = None) -> list[Path]:
    """The stdlib's .py and .txt files in sorted order, without test suites or site-packages."""
    root = stdlib or Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = [
        p
        for ext in ("*.py", "*.txt")
        for p in root.rglob(ext)
        if not skip & set(p.relative_to(root).parts)
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def iter_corpus(files: list[Path], max_bytes: int = MAX_CORPUS_BYTES) -> Iterator[str]:
    """File texts (undecodable bytes replaced) until ``max_bytes`` have been read."""
    total_bytes = 0
    for path in files:
        data = path.read_bytes()
        total_bytes += len(data)
        if total_bytes > max_bytes:
            return
        yield data.decode("utf-8", errors="replace")


def build_empty_tokenizer() -> Tokenizer:
    """A Qwen2-style byte-level BPE pipeline with no vocabulary yet."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    return tok


def train_tokenizer(files: list[Path] | None = None) -> Tokenizer:
    tok = build_empty_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=NUM_BPE_TOKENS,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(
        iter_corpus(files if files is not None else corpus_files()), trainer=trainer
    )
    if tok.get_vocab_size() != NUM_BPE_TOKENS:
        raise RuntimeError(
            f"corpus too small: learnt {tok.get_vocab_size()} of {NUM_BPE_TOKENS} tokens"
        )
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ASSET_PATH)
    args = parser.parse_args(argv)
    tok = train_tokenizer()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out), pretty=False)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes, {tok.get_vocab_size()} tokens)")


if __name__ == "__main__":
    main()
