"""firsttoken: a multimodal inference server built for a fast first token.

``from firsttoken import LLM, SamplingRequest`` is the offline Python API (firsttoken/llm.py); it is
imported on first use, so ``import firsttoken`` alone stays cheap for the command-line tools.
"""

from typing import Any

from firsttoken.version import __version__

__all__ = ["LLM", "SamplingRequest", "RequestResult", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "RequestResult"):
        from firsttoken import llm

        return getattr(llm, name)
    if name == "SamplingRequest":
        from firsttoken.inputs.prompt import SamplingRequest

        return SamplingRequest
    raise AttributeError(f"module 'firsttoken' has no attribute {name!r}")
