"""lm-eval (EleutherAI's lm-evaluation-harness) against the real server, as a user runs it: a multiple-choice
(loglikelihood) task through `local-completions` (token-id prompts, echo + logprobs) and a generation task through
`local-chat-completions`, both from task files in the repository (tests/fixtures/lm_eval), no dataset download."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import httpx
import lm_eval  # the test extra's (a missing one fails collection: CI never passes by skipping this)
import pytest
import yaml

TASKS = Path(__file__).resolve().parent.parent / "fixtures" / "lm_eval"
# simple_evaluate seeds random, numpy and torch's global generators unless told not to: the suite's other tests and
# the server's engine thread share this process (zero-shot tasks draw nothing at random)
KEEP_GLOBAL_RNGS = {"random_seed": None, "numpy_random_seed": None, "torch_random_seed": None}


@pytest.fixture
def task_manager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """lm-eval's TaskManager over a copy of the repository's task files whose data files are named by absolute path
    (the fixtures name them relative to the repository root, where a user runs `lm_eval`; the datasets library
    resolves them against the working directory) and whose datasets cache is inside tmp_path. Only these tasks are
    indexed (not lm-eval's own thousands). Offline: nothing may come from a hub."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # both libraries read those when first imported, and transformers has imported huggingface_hub already
    import datasets.config
    import huggingface_hub.constants
    from lm_eval.tasks import TaskManager

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for spec in TASKS.glob("*.yaml"):
        config = yaml.safe_load(spec.read_text())
        kwargs = config["dataset_kwargs"]
        for split, data in kwargs["data_files"].items():
            source = TASKS / Path(data).name
            assert source.is_file(), f"{spec.name} names {data}, which is not in {TASKS}"
            kwargs["data_files"][split] = str(shutil.copy(source, tasks / source.name))
        kwargs["cache_dir"] = str(tmp_path / "datasets-cache")
        (tasks / spec.name).write_text(yaml.safe_dump(config))
    return TaskManager(include_path=str(tasks), include_defaults=False)


def _docs(name: str) -> int:
    return sum(1 for line in (TASKS / name).read_text().splitlines() if line.strip())

def every_document_scored(results: dict | None, task: str, data_file: str, metric: str) -> tuple[list[dict], float]:
    """lm-eval ran ``task`` over every document of ``data_file`` once and its ``metric`` is a share: (the samples in
    document order, the metric)."""
    assert results is not None
    n_docs = _docs(data_file)
    assert results["n-samples"][task] == {"original": n_docs, "effective": n_docs}
    value = results["results"][task][metric]
    assert isinstance(value, float) and 0.0 <= value <= 1.0
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in samples] == list(range(n_docs))
    return samples, value



def _no_live_request(live_server) -> None:
    """Nothing runs or waits and no KV block is held once lm-eval has its answers (it returns after the last one)."""
    stats = live_server.wait_idle()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_blocks_used"] == 0


def test_multiple_choice_through_local_completions(live_server, tiny_model_dir, task_manager) -> None:
    # as `lm_eval --model local-completions --model_args base_url=...,model=tiny,tokenizer=<dir>,...` runs it:
    # token-id prompts, four to a request (a list of token-id lists), two requests in flight
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": f"{live_server.base_url}/v1/completions", "model": live_server.model,
                    "tokenizer": str(tiny_model_dir), "tokenizer_backend": "huggingface", "tokenized_requests": True,
                    "batch_size": 4, "num_concurrent": 2, "max_retries": 1},
        tasks=["firsttoken_colours"], task_manager=task_manager, log_samples=True, bootstrap_iters=0,
        **KEEP_GLOBAL_RNGS)
    samples, acc = every_document_scored(results, "firsttoken_colours", "colours.jsonl", "acc,none")
    n_docs = len(samples)
    assert all(len(s["resps"]) == len(s["doc"]["choices"]) == 4 for s in samples)
    # the accuracy is the share of documents whose answer has the highest loglikelihood
    picked = [max(range(4), key=lambda i: s["filtered_resps"][i][0]) for s in samples]
    assert acc == pytest.approx(sum(p == s["target"] for p, s in zip(picked, samples)) / n_docs)

    # each loglikelihood lm-eval received is the sum of the continuation's token_logprobs that the server's echo
    # returns for context + continuation, scored one prompt to a request here
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for sample in samples:
        for (context, continuation), (received, received_greedy) in zip(sample["arguments"],
                                                                         sample["filtered_resps"]):
            context_ids = tokenizer(context, add_special_tokens=False).input_ids
            whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
            assert whole[:len(context_ids)] == context_ids and len(whole) > len(context_ids)
            answer = httpx.post(f"{live_server.base_url}/v1/completions", timeout=60, json={
                "model": live_server.model, "prompt": whole, "max_tokens": 1, "temperature": 0, "logprobs": 1,
                "echo": True}).raise_for_status().json()
            lp = answer["choices"][0]["logprobs"]
            assert len(lp["token_logprobs"]) == len(whole) + 1  # the prompt's tokens, then the one sampled
            scored = lp["token_logprobs"][len(context_ids):len(whole)]
            assert math.isclose(received, sum(scored), rel_tol=1e-5, abs_tol=1e-4)
            greedy = all(v == max(top.values()) for v, top in
                         zip(scored, lp["top_logprobs"][len(context_ids):len(whole)]))
            assert received_greedy == greedy
    _no_live_request(live_server)


def test_generation_through_local_chat_completions(live_server, task_manager) -> None:
    results = lm_eval.simple_evaluate(
        model="local-chat-completions",
        model_args={"base_url": f"{live_server.base_url}/v1/chat/completions", "model": live_server.model,
                    "num_concurrent": 2, "max_retries": 1},
        tasks=["firsttoken_counting"], task_manager=task_manager, apply_chat_template=True, log_samples=True,
        bootstrap_iters=0, **KEEP_GLOBAL_RNGS)
    samples, em = every_document_scored(results, "firsttoken_counting", "counting.jsonl", "exact_match,none")
    n_docs = len(samples)
    assert em == pytest.approx(sum(s["filtered_resps"][0] == s["target"] for s in samples) / n_docs)
    # what lm-eval received is what the server answers the chat it sent (greedy, at most 8 tokens, stop at a newline)
    client = live_server.client()
    for sample in samples[:2]:
        (chat, gen_kwargs), = sample["arguments"]
        messages = json.loads(chat[0])  # lm-eval's JsonChatStr (a 1-tuple in the record): the chat it posts
        assert messages == [{"role": "user", "content": sample["doc"]["question"]}]
        assert gen_kwargs["until"] == ["\n"] and gen_kwargs["max_gen_toks"] == 8
        received = sample["resps"][0][0]
        assert isinstance(received, str) and "\n" not in received
        direct = client.chat.completions.create(model=live_server.model, messages=messages, max_tokens=8,
                                                temperature=0, stop=["\n"], seed=1234)
        assert received == direct.choices[0].message.content
    _no_live_request(live_server)


def test_the_servers_own_greedy_continuation_is_greedy_to_lm_eval(live_server, tiny_model_dir) -> None:
    # lm-eval's is_greedy (lambada's acc) compares each continuation token's logprob with the largest of its
    # top_logprobs: the continuation the server chose greedily must read back as greedy, with the logprobs it
    # reported while sampling it
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(base_url=f"{live_server.base_url}/v1/completions", model=live_server.model,
                             tokenizer=str(tiny_model_dir), tokenizer_backend="huggingface", max_retries=1)
    context = "The quick brown fox"
    sampled = httpx.post(f"{live_server.base_url}/v1/completions", timeout=60, json={
        "model": live_server.model, "prompt": lm.tok_encode(context), "max_tokens": 3, "temperature": 0,
        "logprobs": 1}).raise_for_status().json()["choices"][0]
    logprobs = sampled["logprobs"]
    # the sampled tokens re-tokenize as themselves after the context (lm-eval splits context + text so)
    assert lm.tok_encode(context + sampled["text"])[len(lm.tok_encode(context)):] == \
        [lm.tok_encode(t)[0] for t in logprobs["tokens"]]
    (whole, whole_greedy), (first, first_greedy) = lm.loglikelihood([
        Instance("loglikelihood", doc={}, arguments=(context, sampled["text"]), idx=0),
        Instance("loglikelihood", doc={}, arguments=(context, logprobs["tokens"][0]), idx=1)])
    assert whole_greedy and first_greedy
    assert math.isclose(whole, sum(logprobs["token_logprobs"]), rel_tol=1e-5, abs_tol=1e-4)
    assert math.isclose(first, logprobs["token_logprobs"][0], rel_tol=1e-5, abs_tol=1e-4)
    _no_live_request(live_server)
