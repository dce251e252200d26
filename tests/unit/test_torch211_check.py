"""benchmarks/gpu/torch211.py, the Python half of check_torch211.sh (the GPU machine's torch 2.11 checked on the CPU):
the import walk picks the CUDA path's tests, and the name check finds a name or keyword this torch lacks."""

from __future__ import annotations

from pathlib import Path

from benchmarks.gpu import torch211


def test_the_walk_from_the_loan_s_files_reaches_the_device_code_and_its_tests() -> None:
    chosen = torch211.select()
    assert {"firsttoken.runner.cuda_graphs", "firsttoken.device_memory", "firsttoken.attention.triton_kernels",
            "firsttoken.runner.model_runner", "firsttoken.loading.loader"} <= set(chosen["device_facing_modules"])
    assert {"tests/unit/test_triton_attention.py", "tests/unit/test_cuda_graph_inputs.py"} <= set(
        chosen["interpreter_tests"])
    assert "firsttoken.runner.cuda_graphs" in chosen["test_files"]["tests/unit/test_cuda_graph_inputs.py"]
    assert "tests/engine/test_gpu_memory.py" in chosen["test_files"]
    assert not any(t.startswith("tests/gpu/") for t in chosen["test_files"])  # those need CUDA to be collected
    assert "firsttoken.api.server" not in chosen["device_facing_modules"]  # nothing the loan runs imports it


def test_a_missing_name_and_an_unknown_keyword_are_reported_with_their_line(tmp_path: Path) -> None:
    source = tmp_path / "planted.py"
    source.write_text("import torch\nimport torch.nn.functional as F\nfrom torch.cuda import graph\n"
                      "torch.cuda.no_such_api()\n"
                      "torch.zeros(3, dtype=torch.float32, no_such_keyword=1)\n"
                      "F.scaled_dot_product_attention(q, k, v, enable_gqa=True)\n"
                      "graph(g, pool=None)\n")
    checked, missing = torch211.missing_names({"planted": source})
    assert checked == 5  # the four calls and torch.float32
    assert [(m["line"], m["name"]) for m in missing] == [(4, "torch.cuda.no_such_api"), (5, "torch.zeros")]
    assert "no_such_keyword" in missing[1]["why"]
