"""Where the fleet sends a request (serving/routing.py), its options (serving/app.py), the merged /metrics
(serving/metrics.py) and the serve-ray flags: plain values, no Ray cluster."""

from __future__ import annotations

import dataclasses

import random

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from firsttoken.cli.main import build_parser
from firsttoken.cli.serve import serve_config
from firsttoken.scheduler.request import Request
from firsttoken.serving.options import FleetOptions, ReplicaCount
from firsttoken.serving.fleet import sum_stats
from firsttoken.serving.metrics import merge_expositions
from firsttoken.serving.routing import (
    LONG_POOL,
    MAX_PREFIX_BLOCKS,
    SHORT_POOL,
    SINGLE_POOL,
    PrefixMemory,
    ReplicaLoad,
    RoutingState,
    pool_for,
    rank_replicas,
    routing_hints,
)
from firsttoken.types import EngineRequest, EngineStats, ImageItem, SamplingParams

BLOCK = 16
CUT_TOKENS = MAX_PREFIX_BLOCKS * BLOCK  # 65,536: the most prompt tokens routing keys cover
IMAGE_TOKEN = 99  # every image's placeholder id: only the content hash tells two pictures apart


def _request(ids: list[int]) -> EngineRequest:
    return EngineRequest("r", tuple(ids), (), torch.zeros(3, len(ids), dtype=torch.int64), 0,
                         SamplingParams(max_tokens=1), 0.0, 0.0)


def _image_request(num_tokens: int, images: list[tuple[str, int, int]]) -> EngineRequest:
    """A prompt of ``num_tokens`` with images given as (content hash, offset, visual tokens)."""
    ids = [1 + i % 50 for i in range(num_tokens)]
    items = []
    for content_hash, offset, n in images:
        ids[offset : offset + n] = [IMAGE_TOKEN] * n
        items.append(ImageItem(content_hash, offset, n, (1, 2, 2 * n), (), None))
    return EngineRequest("r", tuple(ids), tuple(items), torch.zeros(3, num_tokens, dtype=torch.int64), 0,
                         SamplingParams(max_tokens=1), 0.0, 0.0)


def _replica_keys(request: EngineRequest) -> list:
    """The keys a replica's prefix cache gives the prompt's blocks: its scheduler's, over the whole prompt."""
    return Request(request, arrival_seq=0).ensure_block_hashes(BLOCK)


def _loads(*in_flight: int, capacity: int = 4) -> list[ReplicaLoad]:
    return [ReplicaLoad(f"r{i}", n, capacity, 100) for i, n in enumerate(in_flight)]


def test_a_follow_up_turn_shares_the_prefix_keys_of_the_turn_before() -> None:
    first = routing_hints(_request(list(range(40))), BLOCK)
    follow_up = routing_hints(_request(list(range(40)) + [7] * 30), BLOCK)
    other = routing_hints(_request([1] + list(range(39))), BLOCK)
    assert len(first.prefix_keys) == 2 and len(follow_up.prefix_keys) == 4  # full blocks only
    assert follow_up.prefix_keys[:2] == first.prefix_keys
    assert not set(other.prefix_keys) & set(first.prefix_keys)  # keys are chained: one token changes them all


@pytest.mark.parametrize(("images", "num_keys"), [
    ([("before", 64_000, 1_000)], MAX_PREFIX_BLOCKS),  # the image ends before the cut: its blocks are keyed
    ([("straddles", 65_000, 1_000)], 65_000 // BLOCK),  # issue 37: cut before it, at the last block of text
    ([("after", 65_600, 400)], MAX_PREFIX_BLOCKS),  # it starts past the cut: the keys are the text's before it
    ([("before", 100, 64), ("straddles", 65_400, 300), ("after", 65_800, 200)], 65_400 // BLOCK),
])
def test_routing_keys_at_the_cut_are_the_replicas_own_keys(images: list, num_keys: int) -> None:
    request = _image_request(66_000, images)
    keys = routing_hints(request, BLOCK).prefix_keys
    assert len(keys) == num_keys <= CUT_TOKENS // BLOCK
    # every key names a block exactly as the replica caches it: none covers part of an image keyed as text
    assert list(keys) == _replica_keys(request)[:num_keys]


def test_a_different_image_before_the_cut_changes_the_keys_from_its_first_block() -> None:
    one = routing_hints(_image_request(66_000, [("cat", 64_000, 1_000)]), BLOCK).prefix_keys
    other = routing_hints(_image_request(66_000, [("dog", 64_000, 1_000)]), BLOCK).prefix_keys
    first_image_block = 64_000 // BLOCK
    assert one[:first_image_block] == other[:first_image_block]
    assert one[first_image_block] != other[first_image_block]


def test_affinity_prefers_the_replica_that_got_the_prefix_while_it_has_room() -> None:
    state = RoutingState(PrefixMemory())
    hints = routing_hints(_request(list(range(40))), BLOCK)
    state.memory.remember(hints.prefix_keys, "r1")
    rng = random.Random(0)
    assert rank_replicas("affinity", _loads(0, 3), hints, state, 8, rng)[0] == "r1"
    # full, or too far above the least loaded: power of two choices instead (the less loaded first)
    assert rank_replicas("affinity", _loads(0, 4), hints, state, 8, rng) == ["r0", "r1"]
    assert rank_replicas("affinity", _loads(0, 3, capacity=100), hints, state, 2, rng) == ["r0", "r1"]


def test_p2c_takes_the_less_loaded_of_two_then_more_free_kv() -> None:
    state = RoutingState(PrefixMemory())
    rng = random.Random(0)
    assert rank_replicas("p2c", _loads(5, 1), None, state, 8, rng) == ["r1", "r0"]
    tie = [ReplicaLoad("a", 1, 4, 10), ReplicaLoad("b", 1, 4, 90)]
    assert rank_replicas("p2c", tie, None, state, 8, rng)[0] == "b"


def test_round_robin_alternates_whatever_the_load() -> None:
    state = RoutingState(PrefixMemory())
    rng = random.Random(0)
    firsts = [rank_replicas("round-robin", _loads(9, 0), None, state, 8, rng)[0] for _ in range(4)]
    assert firsts == ["r0", "r1", "r0", "r1"]
    with pytest.raises(ValueError, match="routing policy"):
        rank_replicas("random", _loads(0), None, state, 8, rng)


def test_prefix_memory_is_bounded_and_forgets_a_dead_replica() -> None:
    memory = PrefixMemory(max_entries=3)
    memory.remember([b"a", b"b"], "r0")
    memory.remember([b"c", b"d"], "r1")
    assert len(memory) == 3 and memory.holder([b"a"]) is None  # the least recently used went first
    assert memory.holder([b"c", b"d", b"e"]) == ("r1", 2)
    memory.forget("r1")
    assert memory.holder([b"c", b"d"]) is None and memory.holder([b"b"]) == ("r0", 1)


def test_pools_by_counted_length_with_the_engine_threshold() -> None:
    assert pool_for(10_000, 1024, (SINGLE_POOL,)) == SINGLE_POOL
    assert pool_for(1023, 1024, (SHORT_POOL, LONG_POOL)) == SHORT_POOL
    assert pool_for(1024, 1024, (SHORT_POOL, LONG_POOL)) == LONG_POOL


def test_fleet_options_pools_capacity_and_refusals() -> None:
    config = serve_config(max_num_seqs=4, max_queued_requests=10)
    assert FleetOptions().pools() == {SINGLE_POOL: ReplicaCount(2, 2)}
    assert FleetOptions(short_replicas=3, long_replicas=1).pools() == {SHORT_POOL: ReplicaCount(3, 3),
                                                                       LONG_POOL: ReplicaCount(1, 1)}
    assert FleetOptions().capacity(config) == 14
    assert FleetOptions(max_queued_per_replica=0).capacity(config) == 4
    for bad, field in (({"routing": "random"}, "routing"), ({"short_replicas": 2}, "short_replicas"),
                       ({"replicas": 0}, "replicas"), ({"max_queued_per_replica": -1}, "max_queued_per_replica")):
        with pytest.raises(ValueError, match=f"^{field}"):
            FleetOptions(**bad)


def test_serve_ray_help_lists_every_fleet_flag_and_the_config_flags(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve-ray", "--help"])
    text = capsys.readouterr().out
    for flag in ("--replicas", "--short-replicas", "--long-replicas", "--routing", "--max-queued-per-replica",
                 "--replica-cpus", "--ingress-cpus", "--model", "--max-num-seqs", "--long-prompt-threshold"):
        assert flag in text


def test_merged_metrics_label_every_series_with_its_replica() -> None:
    replica = (b'# HELP vllm:num_requests_running Running.\n# TYPE vllm:num_requests_running gauge\n'
               b'vllm:num_requests_running{engine="0",model_name="tiny"} 2.0\n')
    ingress = (b'# HELP firsttoken_rejections_total Refused.\n# TYPE firsttoken_rejections_total counter\n'
               b'firsttoken_rejections_total{reason="queue_full"} 3.0\n'
               b'# HELP vllm:num_requests_running Running.\n# TYPE vllm:num_requests_running gauge\n'
               b'vllm:num_requests_running{engine="0",model_name="tiny"} 9.0\n')
    text = merge_expositions([("all/a", replica), ("all/b", replica)], ingress=ingress).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    running = {s.labels["replica"]: s.value for s in families["vllm:num_requests_running"].samples}
    assert running == {"all/a": 2.0, "all/b": 2.0}  # the ingress's own engine view is not exported
    assert [(s.labels["replica"], s.value) for s in families["firsttoken_rejections"].samples] == [("ingress", 3.0)]


def test_fleet_stats_sum_counts_and_keep_shared_limits() -> None:
    one = EngineStats(10, 2, 1, 8, 16, 1, 2, 5, 0, 4096, {"short": 2}, {}, 0, 1, 1, 0, 0, {"step": 1.0}, 0.5, 3, 6)
    total = sum_stats([one, one])
    assert (total.kv_blocks_total, total.num_running, total.num_waiting, total.block_size) == (20, 2, 4, 16)
    assert total.max_model_len == 4096 and total.num_waiting_by_lane == {"short": 4}
    assert total.cost_model == {} and total.step_time_target_s is None
    lanes = {"throughput": {"steps": 3, "wall_s": 1.5, "at_throughput_s": 1.25}}
    nested = sum_stats([dataclasses.replace(one, long_lane_only=lanes)] * 2).long_lane_only
    assert nested == {"throughput": {"steps": 6, "wall_s": 3.0, "at_throughput_s": 2.5}}  # per leaf, per replica


def test_a_bad_fleet_flag_is_one_line_naming_it_before_ray_starts(capsys: pytest.CaptureFixture) -> None:
    from firsttoken.cli.main import main

    assert main(["serve-ray", "--routing", "random"]) == 2
    assert capsys.readouterr().err.strip() == (
        "firsttoken serve-ray: --routing random: routing must be one of affinity, p2c, round-robin")
    assert main(["serve-ray", "--short-replicas", "2"]) == 2
    assert "--short-replicas 2: short_replicas and long_replicas go together" in capsys.readouterr().err
