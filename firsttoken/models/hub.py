"""``--model`` as users of vLLM write it: a local directory, or a Hugging Face repo id
(``Qwen/Qwen2.5-VL-3B-Instruct``).

A repo id is resolved from the local Hugging Face cache (``$HF_HOME/hub``, or ``$HF_HUB_CACHE``)
first; when it is not there and the machine may go online (``HF_HUB_OFFLINE`` unset), it is
downloaded with ``huggingface_hub`` (the weights, config, tokenizer and processor files only).
Neither cached nor reachable is a ``ModelNotFound`` whose message names the id, the cache searched
and what to do.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# what serving needs of a repo: no .bin/.pt duplicates, no original/ checkpoints, no GGUF
ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer.model", "*.tiktoken")


class ModelNotFound(ValueError):
    """Neither a directory nor a repo id we could find or fetch; the message says what was tried."""


def is_repo_id(name: str) -> bool:
    return bool(_REPO_ID.match(name)) and not name.startswith((".", "/", "~"))


def hub_cache() -> Path:
    """The hub cache as the environment says now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path(constants.HF_HUB_CACHE)


def resolve_model(name: str | Path, offline: bool | None = None) -> Path:
    """The local directory a ``--model`` value means (see the module docstring)."""
    path = Path(name).expanduser()
    if path.exists() or not is_repo_id(str(name)):
        # a directory (checked by whoever loads it), or a path that does not exist (said there)
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo_id = str(name)
    if offline is None:
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0", "false", "False")
    cache = hub_cache()
    try:
        return Path(snapshot_download(repo_id, local_files_only=True, cache_dir=cache,
                                      allow_patterns=list(ALLOW_PATTERNS)))
    except LocalEntryNotFoundError:
        if offline:
            raise ModelNotFound(
                f"{repo_id} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set; download it "
                f"first (huggingface-cli download {repo_id}) or pass a local directory"
            ) from None
    try:
        return Path(
            snapshot_download(repo_id, cache_dir=cache, allow_patterns=list(ALLOW_PATTERNS))
        )
    except Exception as exc:  # network down, repo missing or gated: one sentence, not a traceback
        raise ModelNotFound(
            f"{repo_id} is not in the Hugging Face cache ({cache}) and could not be downloaded "
            f"({type(exc).__name__}); check the id and the network, or pass a local directory"
        ) from None
