"""The ingress's engine over replica pools (serving/fleet.py), against fake Serve handles that play back a script
per call: the pool bound (429), a lost replica before and after the first output, the stream cancelled when the
consumer leaves, lane pools by counted length."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch
from ray.exceptions import ActorDiedError

from firsttoken.models.model_config import ModelConfig
from firsttoken.serving.options import ReplicaCount
from firsttoken.serving.fleet import FleetEngineClient, Pool
from firsttoken.serving.replica import ReplicaFacts
from firsttoken.serving.routing import LONG_POOL, SHORT_POOL, SINGLE_POOL
from firsttoken.types import EngineRequest, FinishReason, PromptWork, RequestOutput, SamplingParams

THRESHOLD = 100


@dataclass
class FakeStream:
    script: list  # RequestOutput values to yield, or an exception to raise there
    cancelled: bool = False

    def __aiter__(self):
        return self._play()

    async def _play(self):
        for item in self.script:
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class FakeHandle:
    """handle.options(stream=True).generate.remote(request, hints=...) -> the next scripted stream."""

    scripts: list
    streams: list = field(default_factory=list)
    hints: list = field(default_factory=list)

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, request, hints=None):
        self.hints.append(hints)
        self.streams.append(FakeStream(self.scripts.pop(0)))
        return self.streams[-1]


def _request(num_tokens: int = 40, rid: str = "r") -> EngineRequest:
    return EngineRequest(rid, tuple(range(num_tokens)), (), torch.zeros(3, num_tokens, dtype=torch.int64), 0,
                         SamplingParams(max_tokens=4), 0.0, 0.0)


def _out(text: str, finished: bool = False, rid: str = "r", **kw) -> RequestOutput:
    return RequestOutput(rid, (1,), text, finished, FinishReason.LENGTH if finished else None, 40, 1, **kw)


def _fleet(pools: dict[str, FakeHandle], capacity: int = 1, replicas: int | str = 2) -> FleetEngineClient:
    facts = ReplicaFacts(ModelConfig.__new__(ModelConfig), 4096, "tiny", "/m", 64, 16)
    count = ReplicaCount.parse(replicas)
    return FleetEngineClient({n: Pool(n, h, count, capacity) for n, h in pools.items()}, facts, THRESHOLD, 16)


def _collect(fleet: FleetEngineClient, request: EngineRequest) -> list[RequestOutput]:
    async def run() -> list[RequestOutput]:
        return [out async for out in fleet.generate(request)]
    return asyncio.run(run())


def test_full_pool_answers_429_with_retry_after_and_a_place_is_held_until_released() -> None:
    fleet = _fleet({SINGLE_POOL: FakeHandle([])})
    work = PromptWork(40)
    assert fleet.check_admission(work, "a").admitted and fleet.check_admission(work, "b").admitted
    refused = fleet.check_admission(work, "c")
    assert (refused.admitted, refused.status, refused.reason) == (False, 429, "queue_full")
    assert refused.retry_after_s == 1 and "full" in refused.message
    fleet.release("a")
    assert fleet.check_admission(work, "c").admitted


def test_an_autoscaled_pool_admits_up_to_its_largest_size_so_the_autoscaler_sees_the_queue() -> None:
    fleet = _fleet({SINGLE_POOL: FakeHandle([])}, capacity=2, replicas="1:3")
    work = PromptWork(40)
    assert all(fleet.check_admission(work, f"r{i}").admitted for i in range(6))  # 3 replicas x 2, not 1 x 2
    refused = fleet.check_admission(work, "r6")
    assert (refused.status, refused.reason) == (429, "queue_full") and "1:3 replicas" in refused.message


def test_a_prompt_no_replica_can_hold_is_400_before_any_replica_is_asked() -> None:
    fleet = _fleet({SINGLE_POOL: FakeHandle([])})
    verdict = fleet.check_admission(PromptWork(64 * 16))  # the whole KV pool, before the decode reserve
    assert (verdict.admitted, verdict.status, verdict.reason) == (False, 400, "never_fits")


def test_a_replica_lost_before_any_output_is_resent_and_answered() -> None:
    handle = FakeHandle([[ActorDiedError()], [_out("a"), _out("b", finished=True)]])
    fleet = _fleet({SINGLE_POOL: handle})
    outs = _collect(fleet, _request())
    assert [o.new_text for o in outs] == ["a", "b"] and outs[-1].finish_reason is FinishReason.LENGTH
    assert len(handle.streams) == 2 and handle.hints[0] == handle.hints[1]  # the same request, the same keys
    assert fleet.pools[SINGLE_POOL].num_in_flight == 0


def test_a_replica_lost_after_an_output_ends_the_request_with_a_retryable_503() -> None:
    handle = FakeHandle([[_out("a"), ActorDiedError()]])
    fleet = _fleet({SINGLE_POOL: handle})
    outs = _collect(fleet, _request())
    assert [o.new_text for o in outs] == ["a", ""]
    assert outs[-1].finish_reason is FinishReason.ERROR and outs[-1].error_status == 503
    assert "retry" in outs[-1].error and len(handle.streams) == 1


def test_a_replica_whose_engine_stopped_is_resent_until_the_resends_run_out() -> None:
    stopped = RequestOutput("r", (), "", True, FinishReason.ERROR, 40, 0, error="stopped", error_status=503)
    handle = FakeHandle([[stopped], [stopped], [stopped]])
    outs = _collect(_fleet({SINGLE_POOL: handle}), _request())
    assert len(handle.streams) == 3 and len(outs) == 1 and outs[0].error_status == 503


def test_a_consumer_leaving_cancels_the_replica_call() -> None:
    handle = FakeHandle([[_out("a"), _out("b"), _out("c", finished=True)]])
    fleet = _fleet({SINGLE_POOL: handle})

    async def first_only() -> None:
        outputs = fleet.generate(_request())
        await outputs.__anext__()
        await outputs.aclose()

    asyncio.run(first_only())
    assert handle.streams[0].cancelled and fleet.pools[SINGLE_POOL].num_in_flight == 0


def test_lane_pools_take_prompts_by_counted_length() -> None:
    short, long = FakeHandle([[_out("s", finished=True)]]), FakeHandle([[_out("l", finished=True)]])
    fleet = _fleet({SHORT_POOL: short, LONG_POOL: long})
    assert _collect(fleet, _request(THRESHOLD - 1))[0].new_text == "s"
    assert _collect(fleet, _request(THRESHOLD))[0].new_text == "l"
    assert fleet.check_admission(PromptWork(THRESHOLD)).lane == LONG_POOL


def test_a_request_that_fails_before_its_stream_starts_gives_its_place_back() -> None:
    # anything that raises inside generate (here the handle itself, before any stream exists) used to leave the
    # in-flight count one higher per failure, until the pool refused everyone with 429 for ever
    class BrokenHandle(FakeHandle):
        def remote(self, request, hints=None):
            raise RuntimeError("serve handle broke")

    fleet = _fleet({SINGLE_POOL: BrokenHandle([])}, capacity=1, replicas=2)
    for i in range(10):
        assert fleet.check_admission(PromptWork(40), f"r{i}").admitted
        try:
            _collect(fleet, _request(rid=f"r{i}"))
        except RuntimeError:
            pass
        else:
            raise AssertionError("the broken handle did not raise")
    pool = fleet.pools[SINGLE_POOL]
    assert pool.num_in_flight == 0 and not pool.reservations
    assert all(fleet.check_admission(PromptWork(40), f"after{i}").admitted for i in range(2))  # the limit is 2


def test_an_image_across_the_routing_cut_is_routed_on_the_prefix_before_it() -> None:
    # 66,000 tokens with an image at 65,000: the hints' cut (4096 blocks of 16) falls inside the image. Its hashing
    # used to raise before the in-flight count's try, so the client got a 400 and the place leaked.
    from firsttoken.serving.routing import MAX_PREFIX_BLOCKS
    from firsttoken.types import ImageItem

    n, offset = 66_000, 65_000
    ids = list(range(1, n + 1))
    ids[offset : offset + 1000] = [99] * 1000
    image = ImageItem("photo", offset, 1000, (1, 2, 2000), (), None)
    request = EngineRequest("r", tuple(ids), (image,), torch.zeros(3, n, dtype=torch.int64), 0,
                            SamplingParams(max_tokens=4), 0.0, 0.0)
    handle = FakeHandle([[_out("a", finished=True)]])
    fleet = _fleet({SINGLE_POOL: handle})
    assert [o.new_text for o in _collect(fleet, request)] == ["a"]
    assert len(handle.hints[0].prefix_keys) == offset // 16 < MAX_PREFIX_BLOCKS  # the blocks before the image
    assert fleet.pools[SINGLE_POOL].num_in_flight == 0
