"""The server end to end, through the official openai client: what a user of the API would notice."""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest
import torch

from tests.e2e.conftest import LiveServer, image_message, make_image


def chat(live: LiveServer, messages, **kw):
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0.0)
    return live.client().chat.completions.create(model=live.model, messages=messages, **kw)


def test_stream_concatenates_to_the_non_stream_answer(live_server: LiveServer):
    messages = image_message("What is in this picture?", make_image(120, 90))
    whole = chat(live_server, messages)
    chunks = list(chat(live_server, messages, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    usage = chunks[-1].usage
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens == 12
    live_server.wait_idle()


def test_usage_counts_image_tokens_and_reports_phase_timings_that_sum_to_ttft(live_server: LiveServer):
    text_only = chat(live_server, [{"role": "user", "content": "Describe it."}], max_tokens=2)
    with_image = chat(live_server, image_message("Describe it.", make_image(112, 112)), max_tokens=2)
    # 112x112 -> 8x8 patches -> 16 visual tokens, plus <|vision_start|> and <|vision_end|>
    assert with_image.usage.prompt_tokens - text_only.usage.prompt_tokens == 16 + 2
    timings = with_image.usage.model_extra["firsttoken"]
    assert sum(timings[p] for p in PHASES) == pytest.approx(timings["ttft_s"], abs=1e-6)
    assert timings["images_encoded"] + timings["encoder_cache_hits"] >= 1 or timings["cached_prompt_tokens"] > 0


PHASES = ("preprocess_s", "queue_s", "encode_s", "prefill_s", "sample_s", "send_s")


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("max_tokens", [1, 4])
def test_a_timeline_is_monotone_on_every_route(live_server: LiveServer, route, stream, max_tokens):
    # (e2e_s was once smaller than ttft_s: a response sent whole is built after the engine finished)
    client = live_server.client()
    kw = dict(model=live_server.model, max_tokens=max_tokens, temperature=0.0, stream=stream,
              **({"stream_options": {"include_usage": True}} if stream else {}))
    for _ in range(3):
        if route == "chat":
            out = client.chat.completions.create(messages=image_message("Describe it.", make_image(56, 56)), **kw)
        else:
            out = client.completions.create(prompt="Once upon a time", **kw)
        usage = [c.usage for c in out if c.usage][-1] if stream else out.usage
        t = usage.model_extra["firsttoken"]
        assert all(t[p] >= 0 for p in PHASES), t
        assert sum(t[p] for p in PHASES) == pytest.approx(t["ttft_s"], abs=1e-9)
        assert 0 < t["ttft_s"] <= t["e2e_s"], t
        # and where the time from the end of preprocessing to the first token went, every second of it
        parts = ("handoff_s", "encoder_compute_s", "forward_s", "step_overhead_s", "other_steps_s", "engine_idle_s")
        assert all(t[p] >= 0 for p in parts) and t["steps_to_first_token"] >= 1
        engine_s = t["queue_s"] + t["encode_s"] + t["prefill_s"] + t["sample_s"]
        assert sum(t[p] for p in parts) == pytest.approx(engine_s, abs=1e-6), t
    live_server.wait_idle()


def test_greedy_output_is_the_same_alone_and_batched_with_seven_others(live_server: LiveServer):
    prompts = [
        [{"role": "user", "content": "hi"}],
        [{"role": "user", "content": "Tell me about the weather " * 12}],
        image_message("What colour is the square?", make_image(200, 150, seed=1)),
        [{"role": "user", "content": "def fib(n):\n    return n" * 20}],
        image_message("Compare these.", make_image(64, 300, seed=2), make_image(300, 64, seed=3)),
        [{"role": "user", "content": "Once upon a time " * 40}],
        image_message("Read the text.", make_image(150, 150, seed=4)),
        [{"role": "user", "content": "ok?"}],
    ]
    alone = [chat(live_server, p, max_tokens=10).choices[0].message.content for p in prompts]

    async def together():
        client = live_server.async_client()
        calls = [
            client.chat.completions.create(model=live_server.model, messages=p, max_tokens=10, temperature=0.0)
            for p in prompts
        ]
        return [r.choices[0].message.content for r in await asyncio.gather(*calls)]

    assert asyncio.run(together()) == alone
    live_server.wait_idle()


def test_image_prompt_matches_transformers_greedy_generate(live_server: LiveServer, tiny_model_dir):
    from transformers import Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    img = make_image(180, 110, seed=5)
    messages = image_message("Describe the picture in detail.", img)
    tokens = httpx.post(f"{live_server.base_url}/tokenize", json={"model": "tiny", "messages": messages}).json()
    ours = chat(live_server, messages, max_tokens=16, temperature=0.0)

    model = Qwen2VLForConditionalGeneration.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    pixels = Qwen2VLImageProcessorPil.from_pretrained(tiny_model_dir)(images=[img], return_tensors="pt")
    input_ids = torch.tensor([tokens["tokens"]])
    with torch.inference_mode():
        ref = model.generate(
            input_ids=input_ids,
            pixel_values=pixels["pixel_values"],
            image_grid_thw=pixels["image_grid_thw"],
            mm_token_type_ids=(input_ids == model.config.image_token_id).long(),
            max_new_tokens=16,
            do_sample=False,  # repetition_penalty comes from generation_config.json on both sides
        )[0, input_ids.shape[1]:]
    from transformers import AutoTokenizer

    ref_text = AutoTokenizer.from_pretrained(tiny_model_dir).decode(ref, skip_special_tokens=True)
    assert ours.usage.prompt_tokens == tokens["count"]
    assert ours.choices[0].message.content == ref_text


def _completion_prompt_of(live: LiveServer, num_tokens: int) -> str:
    """A plain prompt that tokenizes to exactly num_tokens tokens."""
    for word in (" cat", " dog", " tree"):
        for head in ("Hello", "Data", "x"):
            text = head + word * (num_tokens - 1)
            count = httpx.post(f"{live.base_url}/tokenize", json={"model": "tiny", "prompt": text}).json()["count"]
            if count == num_tokens:
                return text
    raise AssertionError(f"could not build a {num_tokens}-token prompt")


@pytest.mark.parametrize("num_tokens", [16, 17, 32])
def test_prompts_at_block_boundaries_generate_like_transformers(live_server: LiveServer, tiny_model_dir, num_tokens):
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    prompt = _completion_prompt_of(live_server, num_tokens)
    out = live_server.client().completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0.0)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = Qwen2VLForConditionalGeneration.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([tok(prompt)["input_ids"]])
    assert ids.shape[1] == num_tokens == out.usage.prompt_tokens
    with torch.inference_mode():
        ref = model.generate(input_ids=ids, mm_token_type_ids=torch.zeros_like(ids), max_new_tokens=8,
                             do_sample=False)[0, num_tokens:]
    assert out.choices[0].text == tok.decode(ref, skip_special_tokens=True)


def test_image_whose_tokens_straddle_a_block_boundary(live_server: LiveServer):
    messages = image_message("Where is the square?", make_image(140, 84, seed=6))
    tokens = httpx.post(f"{live_server.base_url}/tokenize", json={"model": "tiny", "messages": messages}).json()
    ids = tokens["tokens"]
    first = ids.index(16012)  # <|image_pad|>
    last = len(ids) - 1 - ids[::-1].index(16012)
    assert first // 16 != last // 16 and first % 16 != 0  # starts inside a block, ends in another
    a = chat(live_server, messages, max_tokens=8)
    b = chat(live_server, messages, max_tokens=8)  # second time: prefix blocks and encoder output reused
    assert a.choices[0].message.content == b.choices[0].message.content
    assert b.usage.prompt_tokens_details.cached_tokens > 0
    live_server.wait_idle()


def test_max_tokens_one(live_server: LiveServer):
    out = chat(live_server, [{"role": "user", "content": "One word."}], max_tokens=1)
    assert out.usage.completion_tokens == 1
    assert out.choices[0].finish_reason == "length"


def _open_stream(live: LiveServer, body: dict) -> tuple[httpx.Client, httpx.Response]:
    client = httpx.Client(timeout=30)
    req = client.build_request("POST", f"{live.base_url}/v1/chat/completions", json=body)
    return client, client.send(req, stream=True)


def test_client_disconnect_mid_stream_frees_all_blocks(live_server: LiveServer):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Count to a thousand."}],
            "max_tokens": 2000, "temperature": 0.0, "stream": True, "ignore_eos": True}
    client, resp = _open_stream(live_server, body)
    lines = resp.iter_lines()
    content_chunks = 0
    for line in lines:
        if '"content":"' in line and '"role"' not in line:
            content_chunks += 1
            if content_chunks == 3:
                break
    assert live_server.stats()["num_running"] == 1
    resp.close()
    client.close()
    idle = live_server.wait_idle()
    assert idle["kv_blocks_used"] == 0
    assert chat(live_server, [{"role": "user", "content": "still there?"}], max_tokens=2).usage.completion_tokens == 2


def test_client_disconnect_mid_prefill_frees_all_blocks_and_health_answers_during_prefill(tiny_model_dir):
    from tests.e2e.conftest import HoldEngine, start_server, stop_server

    gate = HoldEngine()
    live, server, thread = start_server(tiny_model_dir, fault_hook=gate, max_batched_tokens=64)
    try:
        body = {"model": "tiny", "messages": image_message("Describe. " * 50, make_image(280, 280, seed=7)),
                "max_tokens": 4, "temperature": 0.0, "stream": True}
        client, resp = _open_stream(live, body)
        assert gate.entered.wait(30)  # the engine thread is inside this request's first prefill step
        assert httpx.get(f"{live.base_url}/health").status_code == 200  # answered while the prefill runs
        resp.close()
        client.close()
        gate.release.set()
        assert live.wait_idle()["kv_blocks_used"] == 0
        out = live.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=2)
        assert out.usage.completion_tokens == 2
    finally:
        gate.release.set()
        stop_server(server, thread, live.engine)


def test_models_and_health(live_server: LiveServer):
    models = live_server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].model_extra["max_model_len"] > 0
    assert live_server.client().models.retrieve("tiny").id == "tiny"  # GET /v1/models/{id}
    with pytest.raises(openai.NotFoundError) as missing:
        live_server.client().models.retrieve("gpt-imaginary")
    assert missing.value.body["param"] == "model"
    assert httpx.get(f"{live_server.base_url}/health").status_code == 200


def test_engine_config_reports_what_the_engine_runs_with(live_server: LiveServer):
    """GET /v1/engine/config: the flags as given beside every choice they resolved to, the very configuration the
    engine was built from (the server asks for float32 and 16 MiB of KV cache)."""
    got = httpx.get(f"{live_server.base_url}/v1/engine/config")
    assert got.status_code == 200
    config = got.json()
    assert config == live_server.engine.engine.resolved.as_dict()
    assert config["requested"]["dtype"] == "float32" and config["model"]["dtype"] == "float32"
    assert config["requested"]["quantization"] == "auto" and config["model"]["quantization"] == "none"  # an F32 file
    assert config["requested"]["device"] == "auto" and config["model"]["device"] == (
        "cuda" if torch.cuda.is_available() else "cpu") and config["model"]["device_why"].startswith("auto: ")
    assert config["kv"]["num_blocks"] * config["kv"]["block_size"] * config["kv"]["kv_bytes_per_token"] <= 16 * 2**20


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": 9}, 400, "temperature"),
        ({"messages": [], "max_tokens": 4}, 400, None),
        ({"messages": "nope"}, 400, None),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]}]}, 400, None),
    ],
)
def test_bad_requests_get_openai_shaped_400s(live_server: LiveServer, body, status, param):
    resp = httpx.post(f"{live_server.base_url}/v1/chat/completions", json={"model": "tiny", **body})
    assert resp.status_code == status
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    if param:
        assert err["param"] == param
    assert "Traceback" not in err["message"] and "0x" not in err["message"]


def test_unknown_model_is_404(live_server: LiveServer):
    resp = httpx.post(f"{live_server.base_url}/v1/chat/completions",
                      json={"model": "gpt-nope", "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == 404


def test_seeded_sampling_repeats(live_server: LiveServer):
    msgs = [{"role": "user", "content": "Pick a word."}]
    a = chat(live_server, msgs, temperature=1.0, top_p=0.9, seed=123, max_tokens=8)
    b = chat(live_server, msgs, temperature=1.0, top_p=0.9, seed=123, max_tokens=8)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_stop_string_is_never_emitted(live_server: LiveServer):
    msgs = [{"role": "user", "content": "Say anything."}]
    full = chat(live_server, msgs, max_tokens=12).choices[0].message.content
    stop = full[4:7]
    assert stop
    cut = chat(live_server, msgs, max_tokens=12, stop=[stop])
    assert stop not in cut.choices[0].message.content
    assert full.startswith(cut.choices[0].message.content)
    assert cut.choices[0].finish_reason == "stop"


def test_concurrent_streams_from_threads_all_finish(live_server: LiveServer):
    results: list[str] = []

    def one(i: int) -> None:
        out = chat(live_server, [{"role": "user", "content": f"thread {i}"}], max_tokens=5)
        results.append(out.choices[0].finish_reason)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == ["length"] * 6
    live_server.wait_idle()


def test_logprobs_come_back_for_every_generated_token(live_server: LiveServer):
    out = chat(live_server, [{"role": "user", "content": "Say something."}], max_tokens=5, logprobs=True,
               top_logprobs=3)
    entries = out.choices[0].logprobs.content
    assert len(entries) == 5
    for e in entries:
        assert len(e.top_logprobs) == 3
        assert e.logprob <= 0.0
        assert e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
    # greedy: the chosen token is the most likely one
    assert all(abs(e.logprob - e.top_logprobs[0].logprob) < 1e-5 for e in entries)
