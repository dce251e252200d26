"""tests/gpu/: what only a CUDA device can check (issue 39). Collected only where torch sees one: on a CPU machine
pytest ignores every module here, so CPU CI neither runs these nor counts them as skipped (a skip would read as a
pass). benchmarks/gpu/run.sh runs them on a GPU loan: ``python -m pytest tests/gpu -q``."""

from __future__ import annotations

import torch

# Where CUDA is absent: ignore every test module of this directory before it is imported.
collect_ignore_glob = [] if torch.cuda.is_available() else ["test_*.py"]
