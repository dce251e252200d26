"""IncrementalDetokenizer with the shipped byte-level BPE tokenizer: what a streaming client would see."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from tokenizers import Tokenizer

from firsttoken.engine.detokenizer import IncrementalDetokenizer
from firsttoken.models.train_tokenizer import ASSET_PATH

REPLACEMENT_CHAR = "\ufffd"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(str(ASSET_PATH))


def encode(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def stream(detok: IncrementalDetokenizer, ids: Sequence[int]) -> list[str]:
    """Feed one token per step, as decode does; the flush is the last element."""
    deltas = []
    for token_id in ids:
        delta = detok.add([token_id])
        deltas.append(delta.text)
        if delta.stopped:
            return deltas
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize(
    "text",
    [
        "def main():\n    return 42  # plain ASCII",
        "emoji 😀🎉 and family 👨‍👩‍👧 in a row",
        "中文字符，日本語のテキスト、한국어",
        "mixed: café naïve Ωmega ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    ],
)
def test_streamed_text_equals_full_decode_and_never_splits_a_character(tok: Tokenizer, text: str) -> None:
    ids = encode(tok, text)
    deltas = stream(IncrementalDetokenizer(tok), ids)
    assert "".join(deltas) == text
    assert all(REPLACEMENT_CHAR not in d for d in deltas)


def test_emoji_spread_over_byte_tokens_arrives_whole(tok: Tokenizer) -> None:
    ids = encode(tok, "😀")
    assert len(ids) > 1 and all(tok.decode([i]) == REPLACEMENT_CHAR for i in ids)  # the case under test
    deltas = stream(IncrementalDetokenizer(tok), ids)
    assert deltas[:-2] == [""] * (len(ids) - 1)
    assert deltas[-2] == "😀"


def test_flush_releases_an_incomplete_character_as_replacement(tok: Tokenizer) -> None:
    ids = encode(tok, "ok 😀")[:-1]  # generation ended (max_tokens) inside the emoji
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.add([i]).text for i in ids)
    assert text == "ok "
    assert set(detok.flush()) == {REPLACEMENT_CHAR}
    assert detok.flush() == ""


def test_leading_space_after_prompt_is_kept(tok: Tokenizer) -> None:
    prompt = encode(tok, "Say hello")
    out = encode(tok, " world and more")
    deltas = stream(IncrementalDetokenizer(tok, prompt_token_ids=prompt), out)
    assert "".join(deltas) == " world and more"


def test_special_tokens_are_skipped(tok: Tokenizer) -> None:
    im_end = tok.token_to_id("<|im_end|>")
    ids = encode(tok, "done") + [im_end]
    assert "".join(stream(IncrementalDetokenizer(tok), ids)) == "done"


def test_stop_string_across_token_boundaries_is_cut_and_never_sent(tok: Tokenizer) -> None:
    text = "The answer is 42.</stop> and then garbage"
    ids = encode(tok, text)
    # the stop string is spread over several tokens
    assert not any("</stop>" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, stop=("</stop>",))
    sent = ""
    for token_id in ids:
        delta = detok.add([token_id])
        sent += delta.text
        assert "<" not in sent  # no prefix of the stop string ever leaves before the match is decided
        if delta.stopped:
            break
    assert delta.stopped and delta.stop_str == "</stop>"
    assert sent == "The answer is 42."
    assert detok.add(encode(tok, "more")).text == "" and detok.flush() == ""


def test_stop_string_inside_one_token_cuts_mid_token(tok: Tokenizer) -> None:
    ids = encode(tok, "return value")
    detok = IncrementalDetokenizer(tok, stop=("urn",))
    text = "".join(detok.add([i]).text for i in ids)
    assert text == "ret" and detok.stopped


def test_earliest_stop_string_wins(tok: Tokenizer) -> None:
    ids = encode(tok, "alpha beta gamma")
    detok = IncrementalDetokenizer(tok, stop=("gamma", "beta"))
    delta = detok.add(ids)  # several tokens in one step (e.g. speculative decoding)
    assert (delta.text, delta.stopped, delta.stop_str) == ("alpha ", True, "beta")


def test_false_start_of_a_stop_string_is_released(tok: Tokenizer) -> None:
    ids = encode(tok, "a <b c <bx")
    deltas = stream(IncrementalDetokenizer(tok, stop=("<bx",)), ids)
    assert "".join(deltas) == "a <b c "


def test_held_partial_stop_is_released_by_flush(tok: Tokenizer) -> None:
    ids = encode(tok, "end with <b")
    deltas = stream(IncrementalDetokenizer(tok, stop=("<bx",)), ids)
    assert deltas[-1] == "<b" and "".join(deltas) == "end with <b"


class CountingDecoder:
    """Records how many ids each decode call receives."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.max_ids = 0

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.max_ids = max(self.max_ids, len(ids))
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def test_each_step_decodes_a_small_window_not_the_whole_output(tok: Tokenizer) -> None:
    text = "word 中文 😀 " * 300
    ids = encode(tok, text)
    decoder = CountingDecoder(tok)
    deltas = stream(IncrementalDetokenizer(decoder, prompt_token_ids=encode(tok, "prompt " * 50)), ids)
    assert "".join(deltas) == text
    assert len(ids) > 1000 and decoder.max_ids <= 12


def test_stops_end_where_a_character_by_character_check_would_end_them(tok: Tokenizer) -> None:
    """Oracle: the text before the first stop string to complete (the longest when two end together), whatever
    the tokens' boundaries and however many stops there are."""
    rng = random.Random(7)
    words = ["the", " cat", " sat", " on", " a", " mat", ".", " 😀", "中文", " </s", "top>", "\n"]
    for _ in range(200):
        text = "".join(rng.choices(words, k=rng.randint(3, 25)))
        stops = tuple({text[i : i + rng.randint(1, 6)] for i in rng.sample(range(len(text)), k=min(4, len(text)))})
        stops = tuple(s for s in stops if s) + ("never-present",)
        expected = text
        for end in range(1, len(text) + 1):
            ending = [s for s in stops if text[:end].endswith(s)]
            if ending:
                expected = text[: end - len(max(ending, key=len))]
                break
        deltas = stream(IncrementalDetokenizer(tok, stop=stops), encode(tok, text))
        assert "".join(deltas) == expected, (text, stops)


def test_stop_matching_work_is_bounded_by_the_text_not_the_stops(tok: Tokenizer) -> None:
    """32 stop strings of 256 characters that the output keeps almost matching: the work counted stays within
    two steps per generated character (the old scan did 32 x 256 comparisons per token)."""
    stops = tuple("word " * 51 + f"#{i}" for i in range(32))  # 257 > 256: trimmed below to the request limit
    stops = tuple(s[-256:] for s in stops)
    ids = encode(tok, "word " * 2000)
    detok = IncrementalDetokenizer(tok, stop=stops)
    text = "".join(stream(detok, ids))
    assert text == "word " * 2000
    assert detok.num_stop_steps <= 2 * len(text)
