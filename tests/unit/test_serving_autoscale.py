"""Autoscaling a pool on queued requests (serving/autoscale.py), replica counts N or MIN:MAX, and the Serve config
file (deploy/ray-serve.yaml) read exactly as the command line. No cluster: Serve's config objects and a context
shaped like Serve's ``AutoscalingContext``."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml
from ray.serve import Application
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve.config import AutoscalingContext
from ray.serve.schema import ServeDeploySchema

from firsttoken.cli.serve_ray import app_builder, options_from_args
from firsttoken.serving.app import replica_count_options
from firsttoken.serving.options import FleetOptions, ReplicaCount
from firsttoken.serving.autoscale import NUM_RUNNING, NUM_WAITING, QueuedRequestsPolicy, desired_replicas
from firsttoken.serving.routing import LONG_POOL, SHORT_POOL

SERVE_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "ray-serve.yaml"


def test_replicas_scale_up_to_hold_the_queue_at_the_target_per_replica() -> None:
    assert desired_replicas(1, queued=1, running=1, target_queued=1, max_num_seqs=8) == 1  # at the target: stay
    assert desired_replicas(1, queued=2, running=1, target_queued=1, max_num_seqs=8) == 2
    assert desired_replicas(2, queued=7, running=16, target_queued=2, max_num_seqs=8) == 4  # ceil(7 / 2)


def test_a_replica_goes_only_when_nothing_waits_and_the_rest_run_what_runs() -> None:
    assert desired_replicas(3, queued=0, running=16, target_queued=1, max_num_seqs=8) == 2
    assert desired_replicas(3, queued=0, running=17, target_queued=1, max_num_seqs=8) == 3  # 2 x 8 < 17
    assert desired_replicas(3, queued=0.5, running=0, target_queued=1, max_num_seqs=8) == 3  # something waits
    assert desired_replicas(1, queued=0, running=0, target_queued=1, max_num_seqs=8) == 1  # never below one


def _ctx(waiting: dict[str, float], running: dict[str, float], at_handles: float) -> AutoscalingContext:
    return AutoscalingContext(
        deployment_id=None, deployment_name="engine-all", app_name="firsttoken", current_num_replicas=len(waiting),
        target_num_replicas=len(waiting), running_replicas=list(waiting), total_num_requests=0.0,
        total_queued_requests=at_handles, aggregated_metrics={NUM_WAITING: waiting, NUM_RUNNING: running},
        raw_metrics=None, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4, policy_state={},
        last_scale_up_time=None, last_scale_down_time=None, current_time=None, config=None)


def test_the_policy_counts_requests_waiting_in_the_engines_and_at_the_router() -> None:
    policy = QueuedRequestsPolicy(target_queued=1, max_num_seqs=1)
    assert policy(_ctx({"a": 1.0, "b": 1.0}, {"a": 1.0, "b": 1.0}, at_handles=0.0))[0] == 2
    assert policy(_ctx({"a": 1.0, "b": 1.0}, {"a": 1.0, "b": 1.0}, at_handles=2.0))[0] == 4  # 4 queued / 1
    assert policy(_ctx({"a": 0.0, "b": 0.0}, {"a": 1.0, "b": 0.0}, at_handles=0.0))[0] == 1
    with pytest.raises(ValueError, match="target_queued"):
        QueuedRequestsPolicy(target_queued=0, max_num_seqs=1)


def test_replica_counts_are_n_or_min_max_and_a_fixed_pool_has_no_autoscaler() -> None:
    assert ReplicaCount.parse(2) == ReplicaCount(2, 2) and not ReplicaCount.parse("2").autoscaled
    assert ReplicaCount.parse("1:4") == ReplicaCount(1, 4) and str(ReplicaCount(1, 4)) == "1:4"
    for bad in ("4:1", "x", "1:", "-1"):
        with pytest.raises(ValueError, match="N or MIN:MAX"):
            ReplicaCount.parse(bad)
    options = FleetOptions(short_replicas="1:3", long_replicas=1, upscale_delay_s=5, autoscale_window_s=8)
    assert options.pools() == {SHORT_POOL: ReplicaCount(1, 3), LONG_POOL: ReplicaCount(1, 1)}
    assert replica_count_options(ReplicaCount(1, 1), options, 8) == {"num_replicas": 1}
    scaled = replica_count_options(ReplicaCount(1, 3), options, 8)["autoscaling_config"]
    assert (scaled.min_replicas, scaled.initial_replicas, scaled.max_replicas) == (1, 1, 3)
    assert (scaled.upscale_delay_s, scaled.look_back_period_s) == (5, 8)
    policy = scaled.policy.get_policy()
    assert policy is QueuedRequestsPolicy and scaled.policy.policy_kwargs == {"target_queued": 1.0, "max_num_seqs": 8}
    with pytest.raises(ValueError, match="at least one replica each"):
        FleetOptions(short_replicas="0:2", long_replicas=1)


def test_the_serve_config_file_is_valid_for_serve_and_its_args_are_the_command_lines(tiny_model_dir: Path) -> None:
    doc = yaml.safe_load(SERVE_CONFIG.read_text())
    ServeDeploySchema.model_validate(doc)  # what `serve deploy` checks
    app = doc["applications"][0]
    module, _, name = app["import_path"].partition(":")
    assert getattr(importlib.import_module(module), name) is app_builder
    args = {**app["args"], "model": str(tiny_model_dir)}
    config, options = options_from_args(args)
    assert options.replicas == ReplicaCount(1, 4) and options.routing == "affinity"
    assert (config.engine.scheduler.max_num_seqs, config.engine.num_threads) == (16, 8)
    with pytest.raises(ValueError, match="--max-num-seqs 0: must be >= 1"):
        options_from_args({**args, "max_num_seqs": 0})
    with pytest.raises(ValueError, match="unrecognized arguments: --replica 2"):
        options_from_args({**args, "replica": 2})
    with pytest.raises(ValueError, match="--model /nonexistent/model"):  # the model is checked too, not only flags
        options_from_args({**args, "model": "/nonexistent/model"})
    switched_config, switched = options_from_args({**args, "no-prefix-cache": True})
    assert switched_config.engine.cache.enable_prefix_caching is False and switched == options
    # what `serve run` / `serve deploy` do with import_path and args (no cluster needed to build the graph)
    assert isinstance(call_user_app_builder_with_args_if_necessary(app_builder, args), Application)
