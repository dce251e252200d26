"""One config tree: every option's only default lives in firsttoken/config.py, and `firsttoken serve`'s flags are
generated from it, so a flag cannot exist without a config field, nor a field without a flag and its default."""

from __future__ import annotations

from dataclasses import fields, is_dataclass

from firsttoken.cli.main import build_parser
from firsttoken.cli.serve import serve_config
from firsttoken.config import ServeConfig, config_flags


def _leaves(obj: object, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for f in fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        out += _leaves(value, (*prefix, f.name)) if is_dataclass(value) else [(*prefix, f.name)]
    return out


def test_every_leaf_of_the_tree_is_one_serve_flag() -> None:
    flags = list(config_flags())
    assert [f.path for f in flags] == _leaves(ServeConfig())
    assert len({f.flag for f in flags}) == len(flags)  # no two fields share a flag
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    options = {opt for action in serve._actions for opt in action.option_strings} - {"-h", "--help"}
    assert options == {f.flag for f in flags}


def test_serve_without_flags_is_the_trees_defaults() -> None:
    args = build_parser().parse_args(["serve"])
    assert serve_config(args) == ServeConfig()


def test_help_shows_each_flags_default() -> None:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    text = " ".join(serve.format_help().split())
    for f in config_flags():
        assert f.flag in text
        if f.parse is not None and "default:" not in f.help:
            assert f"(default: {' '.join(f.shown.split())})" in text, f.flag


def test_a_choice_flags_values_help_and_check_come_from_its_type() -> None:
    """Every option with a fixed set of values is a Literal field: --help lists exactly its values, and a value
    outside them is refused naming the field."""
    from typing import get_args

    import pytest

    from firsttoken.config import CpuKernels, Dtype, EngineConfig, Quantization

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    text = " ".join(serve.format_help().split())
    by_flag = {f.flag: f for f in config_flags()}
    for flag, kind in (("--dtype", Dtype), ("--quantization", Quantization), ("--cpu-kernels", CpuKernels)):
        assert by_flag[flag].choices == get_args(kind)
        assert f"{flag} {{{','.join(get_args(kind))}}}" in text
    assert by_flag["--scheduling"].choices == ("lanes", "fcfs") and by_flag["--block-size"].choices == ()
    with pytest.raises(ValueError, match="cpu_kernels must be one of auto, on, off"):
        EngineConfig(cpu_kernels="sometimes")  # type: ignore[arg-type]


def test_an_option_by_flag_name_sets_the_same_field_as_the_flag() -> None:
    args = build_parser().parse_args(["serve", "--long-prompt-threshold", "2048", "--kv-cache-memory", "16MiB"])
    from_flags = serve_config(args)
    from_options = serve_config(long_prompt_threshold=2048, kv_cache_memory="16MiB")
    assert from_flags == from_options
    assert from_flags.engine.scheduler.long_prompt_threshold == 2048
    assert from_flags.engine.cache.kv_cache_memory_bytes == 16 * 2**20


def test_every_range_check_in_post_init_runs() -> None:
    # A check written after its method's return never runs (max_queued_requests 0 was accepted that way);
    # tests/unit/test_layers.py keeps any statement from hiding behind a return again.
    import pytest

    from firsttoken.config import SchedulerConfig

    with pytest.raises(ValueError, match="max_queued_requests"):
        SchedulerConfig(max_queued_requests=0)
    with pytest.raises(ValueError, match="max_queued_requests"):
        serve_config(build_parser().parse_args(["serve", "--max-queued-requests", "0"]))
