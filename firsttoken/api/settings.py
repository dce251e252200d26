"""What the HTTP layer needs to know about its deployment; the CLI builds it from flags."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str  # the only accepted `model`; anything else is 404 as in vLLM
    max_model_len: int  # context length in tokens, reported by /v1/models and /tokenize
    model_root: str | None = None  # shown as `root` in /v1/models (e.g. the checkpoint directory)
    # Local image paths / file:// URLs are read only inside this directory (None: disabled). The CLI passes it
    # to the InputProcessor's ImageSettings; it is kept here so one object describes the deployment.
    allowed_media_dir: Path | None = None
    max_request_body_bytes: int = 64 * 1024 * 1024  # 413 above it (base64 images are ~4/3 of their bytes)
    max_concurrent_requests: int = 0  # requests in flight (preprocessing + generation); 429 above it; 0 = no cap
    num_preprocess_threads: int = 2  # threads per preprocessing pool (light and heavy; api/preprocess_pools.py)
    # Seconds from a request's headers to the last byte of its body; later: 408 and the connection closes.
    # None: no deadline. 60 s lets a 64 MiB body arrive at ~1 MB/s.
    request_body_timeout_s: float | None = 60.0

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if self.max_request_body_bytes < 1:
            raise ValueError("max_request_body_bytes must be >= 1")
        if self.max_concurrent_requests < 0:
            raise ValueError("max_concurrent_requests must be >= 0 (0 disables the cap)")
        if self.num_preprocess_threads < 1:
            raise ValueError("num_preprocess_threads must be >= 1")
        if self.request_body_timeout_s is not None and not self.request_body_timeout_s > 0:
            raise ValueError("request_body_timeout_s must be > 0 (None disables it)")
