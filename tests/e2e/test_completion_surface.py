"""The completions and chat surface clients built for vLLM assume (issue 41, item 5), through the real server and
the official openai client: a list of prompts, token-id prompts, n choices (the prompt prefilled once: the later
choices find it in the prefix cache), stream_options.continuous_usage_stats, and the OpenAPI schema."""

from __future__ import annotations

import httpx
import pytest

PROMPT = "The quick brown fox jumps over the lazy dog and keeps on running through the field until night"


def tokens_of(live, text: str) -> list[int]:
    return httpx.post(f"{live.base_url}/tokenize", json={"prompt": text}).json()["tokens"]


def test_a_list_of_prompts_gets_a_choice_each_in_order(live_server) -> None:
    client = live_server.client()
    prompts = ["Hello there", "Once upon a time", "1, 2, 3,"]
    alone = [client.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0.0) for p in prompts]
    together = client.completions.create(model="tiny", prompt=prompts, max_tokens=6, temperature=0.0)
    assert [c.index for c in together.choices] == [0, 1, 2]
    assert [c.text for c in together.choices] == [a.choices[0].text for a in alone]
    assert together.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert together.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    live_server.wait_idle()


def test_token_id_prompts_answer_as_their_text(live_server) -> None:
    client = live_server.client()
    texts = ["Hello there", "Once upon a time"]
    ids = [tokens_of(live_server, t) for t in texts]
    by_text = client.completions.create(model="tiny", prompt=texts, max_tokens=5, temperature=0.0)
    one = client.completions.create(model="tiny", prompt=ids[0], max_tokens=5, temperature=0.0)
    many = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0.0)
    assert one.choices[0].text == by_text.choices[0].text
    assert [c.text for c in many.choices] == [c.text for c in by_text.choices]
    assert one.usage.prompt_tokens == len(ids[0])


def test_n_choices_share_one_prefill_through_the_prefix_cache(live_server) -> None:
    client = live_server.client()
    messages = [{"role": "user", "content": PROMPT * 3}]
    before = live_server.wait_idle()
    out = client.chat.completions.create(model="tiny", messages=messages, n=3, max_tokens=4, temperature=0.0)
    after = live_server.wait_idle()
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.message.content for c in out.choices}) == 1  # greedy: the same answer three times
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens > 64
    block = after["block_size"]
    shared = (out.usage.prompt_tokens - 1) // block * block  # what a later choice can find cached
    hits = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    assert hits >= 2 * shared, f"{hits} prompt tokens found cached; the two later choices could find {2 * shared}"


def test_n_choices_with_a_seed_are_the_seed_and_the_next_ones(live_server) -> None:
    # as vLLM: choice j of a request seeded s samples with seed s + j
    client = live_server.client()
    ask = dict(model="tiny", prompt="Tell me a story", max_tokens=8, temperature=1.0, top_p=1.0,
               extra_body={"top_k": 0})  # (the checkpoint's defaults are near greedy)
    three = client.completions.create(n=3, seed=40, **ask)
    again = client.completions.create(n=3, seed=40, **ask)
    singles = [client.completions.create(seed=40 + j, **ask).choices[0].text for j in range(3)]
    assert [c.text for c in three.choices] == [c.text for c in again.choices] == singles
    assert len(set(singles)) > 1


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_streamed_choices_arrive_with_their_index_and_usage_once(live_server, route) -> None:
    client = live_server.client()
    if route == "chat":
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=5, temperature=0.0,
            stream=True, stream_options={"include_usage": True})
    else:
        stream = client.completions.create(model="tiny", prompt=["Hi", "Hello there"], max_tokens=5, temperature=0.0,
                                           stream=True, stream_options={"include_usage": True})
    text = {0: "", 1: ""}
    finishes, usages = {}, []
    for chunk in stream:
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for ch in chunk.choices:
            text[ch.index] += (ch.delta.content or "") if route == "chat" else ch.text
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert sorted(finishes) == [0, 1] and len(usages) == 1
    assert usages[0].completion_tokens == 10
    plain = (client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], n=2,
                                            max_tokens=5, temperature=0.0).choices if route == "chat" else
             client.completions.create(model="tiny", prompt=["Hi", "Hello there"], max_tokens=5,
                                       temperature=0.0).choices)
    assert [text[0], text[1]] == [c.message.content if route == "chat" else c.text for c in plain]
    live_server.wait_idle()


def test_continuous_usage_stats_count_each_chunk(live_server) -> None:
    # aiperf and guidellm read the running count from every chunk (vLLM's stream_options.continuous_usage_stats)
    client = live_server.client()
    stream = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=0.0, stream=True,
                                       stream_options={"include_usage": True, "continuous_usage_stats": True})
    counts = [c.usage.completion_tokens for c in stream if c.choices and c.usage is not None]
    assert counts == sorted(counts) and counts[-1] == 6 and len(counts) >= 2


def test_the_openapi_schema_describes_the_generation_routes(live_server) -> None:
    schema = httpx.get(f"{live_server.base_url}/openapi.json").json()
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/v1/responses"):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        ref = body["$ref"].rsplit("/", 1)[-1]
        assert ref in schema["components"]["schemas"]
    chat = schema["components"]["schemas"]["ChatCompletionRequest"]
    assert {"messages", "response_format", "tools", "tool_choice", "n"} <= set(chat["properties"])
    responses = schema["components"]["schemas"]["ResponsesRequest"]
    assert {"input", "instructions", "max_output_tokens", "text"} <= set(responses["properties"])
    assert "ResponseObject" in schema["components"]["schemas"]
    refs = [v for v in _walk(schema) if isinstance(v, str) and v.startswith("#/")]
    for ref in refs:  # every reference resolves
        node = schema
        for part in ref[2:].split("/"):
            node = node[part]
    assert httpx.get(f"{live_server.base_url}/docs").status_code == 200


def _walk(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref":
                yield v
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


def test_logit_bias_forces_and_bans_tokens(live_server) -> None:
    client = live_server.client()
    word = tokens_of(live_server, "the quick brown fox")[2]
    forced = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=1.0, seed=1,
                                       logit_bias={str(word): 100}, logprobs=1)
    free = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=1.0, seed=1, logprobs=1)
    tokens = forced.choices[0].logprobs.tokens
    assert len(set(tokens)) == 1 and forced.choices[0].text == tokens[0] * 4
    assert free.choices[0].logprobs.tokens != tokens
    plain = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0.0, logprobs=1)
    first = tokens_of(live_server, plain.choices[0].logprobs.tokens[0])
    banned = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0.0, logprobs=1,
                                       logit_bias={str(first[0]): -100})
    assert banned.choices[0].logprobs.tokens[0] != plain.choices[0].logprobs.tokens[0]


def test_echo_scores_the_prompt_as_lm_eval_reads_it(live_server) -> None:
    # lm-eval's loglikelihood request: token ids, max_tokens 1, logprobs 1, echo; it sums token_logprobs[ctxlen:-1]
    client = live_server.client()
    context = tokens_of(live_server, "The quick brown fox")
    plain = client.completions.create(model="tiny", prompt=context, max_tokens=1, temperature=0.0, logprobs=1)
    greedy = tokens_of(live_server, "The quick brown fox" + plain.choices[0].text)[len(context):]
    assert len(greedy) == 1
    echoed = client.completions.create(model="tiny", prompt=[context + greedy], max_tokens=1, temperature=0.0,
                                       logprobs=1, echo=True)
    lp = echoed.choices[0].logprobs
    assert len(lp.tokens) == len(context) + 2 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    # the continuation's score is what the plain request reported for sampling it
    assert abs(lp.token_logprobs[len(context)] - plain.choices[0].logprobs.token_logprobs[0]) < 1e-4
    assert echoed.choices[0].text.startswith("The quick brown fox" + plain.choices[0].text)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_echo_streams_the_prompt_first(live_server) -> None:
    client = live_server.client()
    whole = client.completions.create(model="tiny", prompt="Once upon", max_tokens=4, temperature=0.0, echo=True)
    assert whole.choices[0].text.startswith("Once upon")
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="Once upon", max_tokens=4, temperature=0.0, echo=True, stream=True) if c.choices)
    assert streamed == whole.choices[0].text
