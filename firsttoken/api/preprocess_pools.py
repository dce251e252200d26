"""Where preprocessing runs: two thread pools, so one large request never holds every preprocessing
thread.

Template rendering, tokenization and image decoding run off the event loop. With one shared pool, a
request carrying megabytes of text (or a few large photos) occupied every thread while a one-word
chat waited behind it. Light requests, text-only and at most ``LIGHT_MAX_CHARS`` characters, get a
pool of their own, where each job costs little: a light request always finds a thread within a few
light jobs, whatever heavy work is running. Heavy requests share the other pool. Which pool is a
pure function of the parsed request.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

# Text a light request may carry, in characters (~4,000 tokens of English): its template and
# tokenization take milliseconds.
LIGHT_MAX_CHARS = 16_384


class SizedRequest(Protocol):
    """What the routing needs to know of a request (ChatCompletionRequest, CompletionRequest,
    TokenizeRequest)."""

    def texts(self) -> list[str]: ...

    @property
    def num_images(self) -> int: ...


def is_light(request: SizedRequest) -> bool:
    """Text-only and short: cheap to preprocess, whatever the server's limits."""
    if request.num_images:
        return False
    total = 0
    for text in request.texts():
        total += len(text)
        if total > LIGHT_MAX_CHARS:
            return False
    return True


class PreprocessPools:
    def __init__(self, num_threads: int) -> None:
        self.light = ThreadPoolExecutor(
            max_workers=num_threads, thread_name_prefix="ft-preprocess-light"
        )
        self.heavy = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="ft-preprocess")

    def for_request(self, request: SizedRequest) -> ThreadPoolExecutor:
        return self.light if is_light(request) else self.heavy

    def shutdown(self) -> None:
        for pool in (self.light, self.heavy):
            pool.shutdown(wait=False, cancel_futures=True)
