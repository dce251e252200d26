"""Unloaded TTFT of a ~800-token text and one 1024x1024 image, one checkout vs another: both servers up side by side
(the `small` checkpoint built by benchmarks/_common.small_model, caches off, no image budget), requests alternating
between them, round 0 a warm-up; medians of the rest. Run on a quiet machine:

    python benchmarks/bench_ttft_before_after.py AFTER_CHECKOUT BEFORE_CHECKOUT OUT.json
"""
import base64, io, json, os, subprocess, sys, time, statistics
import httpx
from PIL import Image, ImageDraw
MODEL = "/tmp/bench-small"
def start(root, port):
    env = dict(os.environ, PYTHONPATH=root)
    return subprocess.Popen([sys.executable, "-m", "firsttoken.cli.main", "serve", "--model", MODEL, "--port", str(port),
                             "--num-threads", "2", "--no-prefix-cache", "--no-encoder-cache", "--image-max-tokens", "16384"],
                            cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=open(f"/tmp/srv{port}.log", "w"))
def wait(port):
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200: return
        except Exception: pass
        time.sleep(1)
    raise SystemExit(f"server {port} did not start")
img = Image.new("RGB", (1024, 1024), (30, 90, 160)); d = ImageDraw.Draw(img)
for i in range(0, 1024, 16): d.line([(i, 0), (0, i)], fill=(i % 256, 80, 200), width=3)
b = io.BytesIO(); img.save(b, "PNG"); url = "data:image/png;base64," + base64.b64encode(b.getvalue()).decode()
words = " ".join(f"word{i}" for i in range(260))
bodies = {"text": [{"role": "user", "content": words}],
          "1img": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe."}]}]}
roots = {"after": sys.argv[1], "before": sys.argv[2]}
procs = {k: start(r, p) for (k, r), p in zip(roots.items(), (8101, 8102))}
try:
    for p in (8101, 8102): wait(p)
    out = {k: {c: [] for c in bodies} for k in roots}
    for rnd in range(6):
        for c, msgs in bodies.items():
            for k, port in (("after", 8101), ("before", 8102)) if rnd % 2 else (("before", 8102), ("after", 8101)):
                r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"model": "bench-small", "messages": msgs, "max_tokens": 1}, timeout=300)
                body = r.json()
                if "error" in body: raise SystemExit(json.dumps(body))
                if rnd: out[k][c].append(body["usage"]["firsttoken"]["ttft_s"])  # round 0 is a warm-up
    res = {c: {"after_median_s": statistics.median(out["after"][c]), "before_median_s": statistics.median(out["before"][c]),
               "ratio": statistics.median(out["after"][c]) / statistics.median(out["before"][c]), "n": len(out["after"][c]),
               "after_s": out["after"][c], "before_s": out["before"][c]} for c in bodies}
    print(json.dumps(res, indent=1))
    json.dump({"cpu_flags": sorted(set(open("/proc/cpuinfo").read().split()) & {"avx2", "avx512f", "avx512_bf16", "fma"}), **res},
              open(sys.argv[3], "w"), indent=1)
finally:
    for p in procs.values(): p.terminate()
