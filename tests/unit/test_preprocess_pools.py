"""Which pool a request's preprocessing runs in, and at what CPU priority: image decoding (the heavy pool) yields the
core to the engine's steps, a short text request's own preprocessing (the light pool) does not."""

from __future__ import annotations

import os
import threading

from firsttoken.api.preprocess_pools import PreprocessPools, is_light
from firsttoken.config import ServerConfig


class Sized:
    def __init__(self, text: str, num_images: int = 0) -> None:
        self._text, self.num_images = text, num_images

    def texts(self) -> list[str]:
        return [self._text]


def own_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_the_heavy_pool_runs_below_the_engine_and_the_light_pool_beside_it():
    base = own_nice()
    pools = PreprocessPools(2, heavy_nice=ServerConfig().preprocess_nice)
    try:
        photo, chat = Sized("what is in the picture?", num_images=1), Sized("hello")
        assert not is_light(photo) and is_light(chat)
        heavy = {pools.for_request(photo).submit(own_nice).result() for _ in range(4)}
        light = {pools.for_request(chat).submit(own_nice).result() for _ in range(4)}
        assert heavy == {min(base + 10, 19)} and light == {base}
        assert own_nice() == base  # only the pool's threads, never the caller's (the event loop's) priority
    finally:
        pools.shutdown()


def test_nice_zero_leaves_every_thread_at_the_engines_priority():
    base = own_nice()
    pools = PreprocessPools(1, heavy_nice=0)
    try:
        assert pools.heavy.submit(own_nice).result() == base
    finally:
        pools.shutdown()
