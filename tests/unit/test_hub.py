"""--model as a Hugging Face repo id: resolved from a local hub cache laid out by make-model, offline; a clear error
naming the id and the cache when it is not there. Nothing here touches the network (HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from firsttoken.models.checkpoint import make_model
from firsttoken.models.hub import ModelNotFound, is_repo_id, resolve_model

SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A hub cache holding acme/tiny-vl as huggingface_hub lays a download out: models--org--name/{refs,snapshots}."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / "models--acme--tiny-vl"
    make_model(repo / "snapshots" / SNAPSHOT, size="tiny", seed=0)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SNAPSHOT)
    return cache


@pytest.fixture()
def offline(hub: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


def test_repo_ids_and_paths_are_told_apart():
    assert is_repo_id("Qwen/Qwen2.5-VL-3B-Instruct") and is_repo_id("acme/tiny-vl")
    assert not is_repo_id("/models/qwen") and not is_repo_id("./qwen/x") and not is_repo_id("qwen")


def test_a_cached_repo_id_resolves_to_its_snapshot(offline: Path):
    path = resolve_model("acme/tiny-vl")
    assert path.name == SNAPSHOT and (path / "config.json").is_file()


def test_an_uncached_repo_id_offline_names_the_id_and_the_cache(offline: Path):
    with pytest.raises(ModelNotFound) as err:
        resolve_model("acme/not-there")
    assert "acme/not-there" in str(err.value) and str(offline) in str(err.value) and "HF_HUB_OFFLINE" in str(err.value)


def test_serve_and_the_offline_api_take_a_repo_id(offline: Path, tmp_path: Path):
    from firsttoken import LLM

    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    llm = LLM("acme/tiny-vl", dtype="float32", kv_cache_memory="8MiB", chat_template=str(template))
    out = llm.chat([{"role": "user", "content": "hi"}], {"max_tokens": 4, "temperature": 0})
    assert out.usage.prompt_tokens == len(llm.tokenizer.encode("[user] hi\n", add_special_tokens=False))
    env = {**os.environ, "HF_HUB_CACHE": str(offline), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "firsttoken.cli.main", "serve", "--model", "acme/not-there"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().startswith("firsttoken serve: --model acme/not-there: acme/not-there is not in")


def test_clients_send_the_repo_id_as_the_model_name(offline: Path):
    from firsttoken.cli.serve import model_dir_of, serve_config, served_name_of

    config = serve_config(model="acme/tiny-vl")
    assert served_name_of(config, model_dir_of(config)) == "acme/tiny-vl"
    named = serve_config(model="acme/tiny-vl", served_model_name="tiny")
    assert served_name_of(named, model_dir_of(named)) == "tiny"
