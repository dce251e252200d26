"""The served seed mix: `firsttoken serve` on the Qwen2-VL-7B shape (dummy weights, otherwise default flags: bf16,
SDPA, the KV pool sized from the device) driven by `firsttoken bench`'s library at U 0.6 of the capacity measured
there, default flags against --scheduling fcfs on the same seeded arrivals, with benchmarks/bench_slo.py's own
parts: ``calibrate_on`` (each class's service time and unloaded TTFT, its requests sent alone), ``run_on`` (one
request per class first, then the Poisson arrivals) and ``summarize`` (nearest-rank P99 of each class's successful
requests), so its targets read as docs/performance.md's CPU rows: text P99 <= 2.5x its unloaded TTFT; one- and
three-image P99 <= 1.05x fcfs's. Unlike bench_slo.py, the default server that was calibrated then serves its loaded
run (two server starts, not three: a 7B server's start costs the loan tens of seconds); fcfs gets a fresh one.
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

import bench_slo
from _common import start_server, stop_server
from firsttoken.config import ImageConfig
from manifest import CLASSES, SERVED_CONFIGS, SERVED_UTILIZATION
from setting import Setting, gate_verdict
from step import Recorder

FAMILY = "qwen2-vl"
SERVE_FLAGS = {"default": [], "fcfs": ["--scheduling", "fcfs"]}  # beside the run's own (server_flags)


def server_flags(setting: Setting) -> list[str]:
    """What every server of the run gets: dummy weights; on the CPU the smoke's stand-ins."""
    if not setting.smoke:
        return ["--load-format", "dummy"]
    return ["--load-format", "dummy", "--device", "cpu", "--dtype", "float32", "--cpu-kernels", "off",
            "--kv-cache-memory", setting.kv_cache_memory, "--num-threads", "1"]  # fmt: skip


def run(setting: Setting, rec: Recorder, results: Path) -> None:
    ok, why = gate_verdict(results, "sdpa")  # the served default's backend
    side = setting.image_side_px
    args = argparse.Namespace(mix=bench_slo.SEED_MIX, seed=0, output_tokens=setting.served_output_tokens,
                              video_seconds=4.0, unloaded_requests=setting.served_probes,
                              num_requests=setting.served_requests, image_size=(side, side))  # fmt: skip
    rec.put("utilization", SERVED_UTILIZATION)
    rec.put("num_requests", setting.served_requests)
    rec.put("output_tokens", setting.served_output_tokens)
    rec.put("shape", setting.shape_name(FAMILY))
    keys = ("capacity_rps", "rate_rps", *(f"unloaded.{c}.ttft_s" for c in CLASSES),
            *(f"{cfg}.{c}.{k}" for cfg in SERVED_CONFIGS for c in CLASSES for k in ("p99_s", "n")))
    if not ok:
        for key in keys:
            rec.skip(key, why)
        return
    os.environ["FIRSTTOKEN_BENCH_SERVE_ARGS"] = shlex.join(server_flags(setting))  # _common.start_server's seam
    model = str(setting.model_dir(FAMILY))
    rec.note(server_flags=server_flags(setting), image_size=f"{side}x{side}")
    rate = 0.0
    for cfg in SERVED_CONFIGS:
        proc, base = start_server(model, SERVE_FLAGS[cfg])
        try:
            if cfg == "default":  # calibrated on the default server, which then serves its loaded run
                calibration = bench_slo.calibrate_on(base, args)
                rec.put("capacity_rps", calibration["capacity_rps"])
                for cls in CLASSES:
                    rec.put(f"unloaded.{cls}.ttft_s", calibration["unloaded_ttft_s"][cls])
                rate = SERVED_UTILIZATION * calibration["capacity_rps"]
                rec.put("rate_rps", rate)
                rec.note(calibration=calibration)
            result = bench_slo.run_on(base, SERVE_FLAGS[cfg], rate, args)
        finally:
            stop_server(proc)
        summary = bench_slo.summarize(result, None, ImageConfig().image_max_tokens)
        for cls in CLASSES:
            row = summary[cls]
            if row["p99"] is None:
                rec.skip(f"{cfg}.{cls}.p99_s", f"no successful {cls} request ({row['sent']} sent, "
                                               f"{row['refused_429']} refused, {row['other_errors']} errors)")
            else:
                rec.put(f"{cfg}.{cls}.p99_s", row["p99"])
            rec.put(f"{cfg}.{cls}.n", row["n"])
        rec.note(**{f"{cfg}.summary": summary, f"{cfg}.records": result["records"]})
