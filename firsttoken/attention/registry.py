"""Attention backends by name. Model code asks for a backend here and never imports a kernel
directly."""

from __future__ import annotations

from collections.abc import Callable

from firsttoken.attention.base import AttentionBackend


def _sdpa() -> AttentionBackend:
    from firsttoken.attention.sdpa import SdpaBackend

    return SdpaBackend()


def _triton() -> AttentionBackend:
    # imports triton on first forward only
    from firsttoken.attention.triton_backend import TritonBackend

    return TritonBackend()


# name -> factory. A CUDA "flash" backend (firsttoken/attention/flash.py, flash-attn varlen + paged
# KV) registers here as "flash": _flash imports lazily so CPU-only installs never import CUDA
# kernels.
_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "sdpa": _sdpa,
    # issue 39's kernels: --attention-backend triton on cuda (or CPU under TRITON_INTERPRET=1)
    "triton": _triton,
}


def available_backends() -> tuple[str, ...]:
    return tuple(sorted(_BACKENDS))


def get_backend(name: str) -> AttentionBackend:
    """A fresh backend instance; ValueError naming the known backends for an unknown name."""
    factory = _BACKENDS.get(name)
    if factory is None:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {', '.join(available_backends())}"
        )
    return factory()
