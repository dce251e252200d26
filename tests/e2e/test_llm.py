"""The offline Python API (``from firsttoken import LLM``): same greedy answers as the server for the same prompts,
batches through the same scheduler, and the server's validation."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from firsttoken import LLM, SamplingRequest
from tests.e2e.conftest import LiveServer, image_message, make_image

GREEDY = {"temperature": 0.0, "max_tokens": 12}


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    # the options start_server gives the session's live server
    return LLM(tiny_model_dir, dtype="float32", kv_cache_memory="16MiB", max_batched_tokens=256)


def conversations() -> list[list[dict]]:
    return [
        [{"role": "user", "content": "Tell me about lighthouses."}],
        image_message("What is in this picture?", make_image(160, 120, seed=1)),
        [{"role": "system", "content": "Be brief."}, *image_message("And these?", make_image(96, 200, seed=2),
                                                                     make_image(140, 140, seed=3))],
    ]


def test_chat_batch_equals_the_servers_answers_one_by_one(llm: LLM, live_server: LiveServer):
    client = live_server.client()
    expected = [client.chat.completions.create(model=live_server.model, messages=c, **GREEDY)
                for c in conversations()]
    results = llm.chat(conversations(), GREEDY)
    assert [r.text for r in results] == [e.choices[0].message.content for e in expected]
    assert [r.finish_reason for r in results] == [e.choices[0].finish_reason for e in expected]
    assert [r.usage.prompt_tokens for r in results] == [e.usage.prompt_tokens for e in expected]
    assert all(len(r.token_ids) == r.usage.completion_tokens for r in results)
    # one batch through the scheduler: the prefills shared steps
    assert any(r.timings["shared_prefill_steps"] > 0 for r in results)
    assert all(r.timings["ttft_s"] > 0 and r.timings["images_encoded"] == i for i, r in enumerate(results))


def test_completion_and_sampling_request_and_pil_images(llm: LLM, live_server: LiveServer):
    client = live_server.client()
    expected = client.completions.create(model=live_server.model, prompt="Once upon a time", **GREEDY)
    got = llm.complete("Once upon a time", SamplingRequest(temperature=0.0, max_tokens=12))
    assert got.text == expected.choices[0].text
    picture = make_image(160, 120, seed=1)
    by_url = llm.chat(image_message("Describe it.", picture), GREEDY)
    by_pil = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": picture},
                                                     {"type": "text", "text": "Describe it."}]}], GREEDY)
    assert by_pil.text == by_url.text and by_pil.token_ids == by_url.token_ids
    # same pixels, same content hash: the second prompt's image blocks come from the prefix cache, no encode
    assert by_pil.usage.cached_tokens > 0 and by_pil.timings["images_encoded"] == 0


def test_bad_input_raises_the_servers_message_before_anything_runs(llm: LLM):
    steps = llm.engine.stats().num_steps
    with pytest.raises(ValueError, match="max_tokens"):
        llm.chat([{"role": "user", "content": "hi"}], {"max_tokens": 10**6})
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"role": "wizard", "content": "hi"}])
    assert llm.engine.stats().num_steps == steps and llm.engine.stats().kv_blocks_used == 0


def test_an_empty_prompt_is_refused_at_once_and_leaves_nothing_behind(llm: LLM):
    steps = llm.engine.stats().num_steps
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.complete("")
    stats = llm.engine.stats()
    assert stats.num_steps == steps and not llm.engine.requests and stats.kv_blocks_used == 0
    assert llm.complete("a", GREEDY).finish_reason == "length"  # and the next prompt is served


def test_stop_token_ids_end_the_answer_even_with_ignore_eos(llm: LLM):
    free = llm.complete("Once upon a time", {**GREEDY, "ignore_eos": True})
    k = next(i for i, t in enumerate(free.token_ids) if i >= 3 and t not in free.token_ids[:i])
    stopped = llm.complete("Once upon a time", {**GREEDY, "ignore_eos": True, "stop_token_ids": [free.token_ids[k]]})
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: k + 1]  # the stop token ends it; its text is not in the answer
    assert free.text.startswith(stopped.text) and len(stopped.text) < len(free.text)


def test_the_callers_torch_threads_are_the_same_after_a_call(tiny_model_dir: Path):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        # (num_threads given: the default is the machine's count at import, 1 under `taskset -c 0`, 4 on 4 cores)
        llm = LLM(tiny_model_dir, dtype="float32", kv_cache_memory="16MiB", num_threads=2)
        assert llm.engine.executor.runner.threads.decode_threads == 2  # offline, no server: decode on all
        fewer = LLM(tiny_model_dir, dtype="float32", kv_cache_memory="16MiB", num_threads=2, decode_threads=1)
        assert torch.get_num_threads() == 2  # calibrating at construction gave it back too
        switches = fewer.engine.executor.runner.threads.switches
        fewer.chat([{"role": "user", "content": "hi"}], GREEDY)
        assert fewer.engine.executor.runner.threads.switches == switches + 1  # prefill on 2, decode on 1, ...
        assert torch.get_num_threads() == 2  # ... and the caller's count given back
    finally:
        torch.set_num_threads(before)


def test_the_offline_llm_sizes_its_steps_as_the_server_does(llm: LLM, tiny_model_dir: Path):
    """One assembly for both: given the same options, the offline engine fits its step-cost model before the first
    request exactly when the server's does, so both run time-bounded steps from the first (the default
    --step-time-target auto) and report a step bound; with the bound off, neither calibrates."""
    from firsttoken.cli.serve import build_server
    from firsttoken.config import config_from_options

    options = dict(dtype="float32", kv_cache_memory="16MiB", max_batched_tokens=256)
    for extra in ({}, {"step_time_target": "off"}):
        _, served = build_server(config_from_options(model=str(tiny_model_dir), **options, **extra))
        offline = llm if not extra else LLM(tiny_model_dir, **options, **extra)
        bounded = not extra
        assert served.engine.cost_model.is_fitted is offline.engine.cost_model.is_fitted is bounded
        assert (served.stats().step_time_target_s is not None) is bounded
        assert (offline.engine.stats().step_time_target_s is not None) is bounded


def test_a_batch_takes_one_sampling_per_conversation(llm: LLM):
    convs = conversations()[:2]
    alone = [llm.chat(convs[0], {"temperature": 0.0, "max_tokens": 3}),
             llm.chat(convs[1], {"temperature": 0.0, "max_tokens": 7, "stop": ["\n"]})]
    both = llm.chat(convs, [{"temperature": 0.0, "max_tokens": 3},
                            SamplingRequest(temperature=0.0, max_tokens=7, stop=("\n",))])
    assert [r.token_ids for r in both] == [r.token_ids for r in alone]
    assert both[0].usage.completion_tokens == 3
    steps = llm.engine.stats().num_steps
    with pytest.raises(ValueError, match="2 sampling settings for 3 prompts"):
        llm.complete(["a", "b", "c"], [GREEDY, GREEDY])
    assert llm.engine.stats().num_steps == steps  # refused before anything ran


def test_fp16_weights_through_the_engine_give_the_float32_answers(llm: LLM, tiny_model_dir: Path):
    from firsttoken.loading.quant import Fp16Weights

    fp16 = LLM(tiny_model_dir, quantization="fp16", kv_cache_memory="16MiB", max_batched_tokens=256)
    model = fp16.engine.executor.runner.model
    assert isinstance(model.layers[0].mlp.gate_up_proj.method, Fp16Weights)
    assert isinstance(model.lm_head.method, Fp16Weights)
    assert model.embed_tokens.weight.dtype == torch.float32  # --dtype auto is float32 with fp16 weights
    got = fp16.chat(conversations(), GREEDY)
    expected = llm.chat(conversations(), GREEDY)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    with pytest.raises(ValueError, match="float32"):
        LLM(tiny_model_dir, quantization="fp16", dtype="bfloat16")


def test_bf16_weights_through_the_engine_decode_in_the_fused_layers(llm: LLM, tiny_model_dir: Path):
    """--quantization bf16: float32 activations (--dtype auto), bf16 linear weights; decode steps take the fused
    layers. The tiny checkpoint is float32, so its weights are rounded: the answers are close to float32's (exact
    against a checkpoint of bf16 values: tests/oracle/test_quantization.py)."""
    from firsttoken.loading.fused_decode import FusedDecode
    from firsttoken.loading.quant import Bf16Weights
    from tests.conftest import require_program

    require_program("cc", "gcc", "gcc")  # the kernels that read bf16 weights in decode steps are built with it
    bf16w = LLM(tiny_model_dir, quantization="bf16", kv_cache_memory="16MiB", max_batched_tokens=256)
    model = bf16w.engine.executor.runner.model
    assert isinstance(model.layers[0].mlp.gate_up_proj.method, Bf16Weights)
    assert isinstance(model.lm_head.method, Bf16Weights)
    assert model.embed_tokens.weight.dtype == torch.float32 and isinstance(model.decode, FusedDecode)
    steps = model.decode.steps
    got = bf16w.chat(conversations(), {"temperature": 0.0, "max_tokens": 8})
    assert model.decode.steps > steps
    expected = llm.chat(conversations(), {"temperature": 0.0, "max_tokens": 8})
    assert [r.finish_reason for r in got] == ["length"] * 3
    print("bf16 weights vs float32 answers:", [(g.token_ids, e.token_ids) for g, e in zip(got, expected)])
    assert sum(g.token_ids[0] == e.token_ids[0] for g, e in zip(got, expected)) >= 2
    with pytest.raises(ValueError, match="float32"):
        LLM(tiny_model_dir, quantization="bf16", dtype="bfloat16")


def test_a_bf16_checkpoint_keeps_its_bf16_weights_by_default_where_activations_are_float32(tmp_path: Path):
    """--quantization auto (the default): a checkpoint published in bf16, run with float32 activations (--dtype
    auto on a CPU without native bf16; float32 here, whatever this CPU has), keeps its linear weights bf16; a
    float32 checkpoint keeps float32 weights."""
    from firsttoken.kernels.cpu_linear import kernel_unavailable
    from firsttoken.models.checkpoint import make_model

    published = make_model(tmp_path / "bf16", size="tiny", seed=3, dtype="bfloat16")
    llm = LLM(published, dtype="float32", kv_cache_memory="16MiB", max_batched_tokens=256)
    # without a C compiler there are no kernels to read bf16 weights, and auto keeps float32 ones
    expected = "bf16" if kernel_unavailable() is None else "none"
    assert llm.engine.config.quantization == "auto" and llm.engine.resolved.model.quantization == expected
    answers = llm.chat(conversations(), {"temperature": 0.0, "max_tokens": 4})
    assert [r.finish_reason for r in answers] == ["length"] * 3
    explicit = LLM(published, dtype="float32", quantization="none", kv_cache_memory="16MiB", max_batched_tokens=256)
    assert explicit.engine.resolved.model.quantization == "none"
    f32 = make_model(tmp_path / "f32", size="tiny", seed=3)
    assert LLM(f32, dtype="float32", kv_cache_memory="16MiB",
               max_batched_tokens=256).engine.resolved.model.quantization == "none"


def test_int8_weights_through_the_engine_answer_like_float32_and_regress_runs_unchanged(
        llm: LLM, tiny_model_dir: Path, tmp_path: Path, capsys):
    from firsttoken.cli.main import main
    from firsttoken.loading.quant import Int8Weights
    from tests.e2e.conftest import start_server, stop_server

    int8 = LLM(tiny_model_dir, quantization="int8", kv_cache_memory="16MiB", max_batched_tokens=256)
    model = int8.engine.executor.runner.model
    assert isinstance(model.layers[0].mlp.gate_up_proj.method, Int8Weights)
    assert isinstance(model.lm_head.method, Int8Weights)
    assert isinstance(model.visual.blocks[0].mlp.fc1.method, Int8Weights)
    assert model.embed_tokens.weight.dtype == torch.float32  # --dtype auto is float32 with int8 weights
    got = int8.chat(conversations(), {"temperature": 0.0, "max_tokens": 8})
    expected = llm.chat(conversations(), {"temperature": 0.0, "max_tokens": 8})
    assert [r.finish_reason for r in got] == ["length"] * 3
    assert [r.usage.prompt_tokens for r in got] == [r.usage.prompt_tokens for r in expected]
    # the same numbers from torch's ops alone, decode steps included: the same tokens
    twins = LLM(tiny_model_dir, quantization="int8", cpu_kernels="off", kv_cache_memory="16MiB", max_batched_tokens=256)
    assert [r.token_ids for r in twins.chat(conversations(), {"temperature": 0.0, "max_tokens": 8})] == [
        r.token_ids for r in got]
    # not exact: the first token of each answer (the prompt's last position) is what top-1 agreement measures
    print("int8 vs float32 answers:", [(g.token_ids, e.token_ids) for g, e in zip(got, expected)])
    assert sum(g.token_ids[0] == e.token_ids[0] for g, e in zip(got, expected)) >= 2
    with pytest.raises(ValueError, match="float32"):
        LLM(tiny_model_dir, quantization="int8", dtype="bfloat16")
    # the quality tool takes an int8 server as it takes any other: the same pixels give the same answers
    live, srv, thread = start_server(tiny_model_dir, quantization="int8", image_max_tokens=1280)
    try:
        images = tmp_path / "images"
        images.mkdir()
        for seed in range(2):
            make_image(448, 448, seed=seed).save(images / f"im{seed}.png")
        prompts = tmp_path / "prompts.txt"
        prompts.write_text("What is in this picture?\n")
        capsys.readouterr()  # what was printed before: the report alone is read back
        code = main(["regress", "--url", live.base_url, "--images", str(images), "--prompts", str(prompts),
                     "--max-tokens", "4", "--budgets", "1280,400", "--json"])
        report = json.loads(capsys.readouterr().out)
    finally:
        stop_server(srv, thread, live.engine)
    assert code == 0 and [b["mean_visual_tokens"] for b in report["budgets"]] == [256, 256]


# sampling fields each route refuses; the offline API must refuse them with the same 400 message and param
BAD_SAMPLING = [{"temperature": "hot"}, {"max_tokens": "many"}, {"seed": 2**70}, {"logit_bias": {"five": 1}},
                {"logit_bias": {"5": 1000}}, {"logit_bias": [5, 100]}, {"stop": [""]}, {"stop": 7}, {"min_p": 0.5},
                {"response_format": {"type": "bogus"}}, {"top_k": 1.5}, {"ignore_eos": "sometimes"}]
HI = [{"role": "user", "content": "hi"}]


def test_logit_bias_in_openais_form_biases_offline_as_over_http(llm: LLM, live_server: LiveServer):
    client, biased = live_server.client(), {**GREEDY, "logit_bias": {"5": 100}}
    over_http = client.chat.completions.create(model=live_server.model, messages=HI, **biased)
    offline = llm.chat(HI, biased)
    assert offline.token_ids == (5,) * GREEDY["max_tokens"]
    assert offline.text == over_http.choices[0].message.content
    completion = client.completions.create(model=live_server.model, prompt="Once upon a time", **biased)
    assert llm.complete("Once upon a time", biased).text == completion.choices[0].text


def test_a_bad_sampling_field_raises_the_routes_400_message_and_param(llm: LLM, live_server: LiveServer):
    steps = llm.engine.stats().num_steps
    mismatches = []
    for route, body, offline in (("chat/completions", {"messages": HI}, lambda s: llm.chat(HI, s)),
                                 ("completions", {"prompt": "hi"}, lambda s: llm.complete("hi", s))):
        for bad in BAD_SAMPLING:
            r = httpx.post(f"{live_server.base_url}/v1/{route}", json={"model": live_server.model, **body, **bad})
            assert r.status_code == 400, (route, bad, r.text)
            error = r.json()["error"]
            try:
                offline(bad)
                got = "no error"
            except ValueError as err:
                got = (str(err), getattr(err, "param", None))
            if got != (error["message"], error["param"]):
                mismatches.append(f"{route} {bad}: offline {got!r}, http {(error['message'], error['param'])!r}")
    assert not mismatches, "\n".join(mismatches)
    assert llm.engine.stats().num_steps == steps  # refused before anything ran


def test_a_field_the_offline_api_does_not_take_is_refused_by_name(llm: LLM):
    for run, prompt, sampling, param in ((llm.chat, HI, {"max_token": 5}, "max_token"),  # a typo: not ignored
                                         (llm.chat, HI, {"n": 2}, "n"),  # one result per prompt
                                         (llm.chat, HI, {"stream": True}, "stream"),
                                         (llm.complete, "hi", {"top_logprobs": 2}, "top_logprobs")):  # logprobs=N
        with pytest.raises(ValueError, match=f"'{param}'") as refused:
            run(prompt, sampling)
        assert refused.value.param == param


def test_preprocess_chat_gives_the_ids_and_patches_chat_runs_and_runs_nothing(llm: LLM):
    conversation = conversations()[2]  # a system message and two images
    steps = llm.engine.scheduler.num_steps
    request = llm.preprocess_chat(conversation, GREEDY)
    # nothing queued and no step run (runner state an earlier test's answers left for the next step to release is
    # not a request: the shared LLM may hold some)
    assert not llm.engine.scheduler.has_work and llm.engine.scheduler.num_steps == steps
    answer = llm.chat(conversation, GREEDY)
    assert request.num_prompt_tokens == answer.usage.prompt_tokens
    image_id = llm.engine.model_config.image_token_id
    assert [im.offset for im in request.images] == [i for i, t in enumerate(request.prompt_token_ids)
                                                    if t == image_id and request.prompt_token_ids[i - 1] != image_id]
    for im in request.images:
        assert im.pixel_values.shape[0] == im.grid_thw[0] * im.grid_thw[1] * im.grid_thw[2]
