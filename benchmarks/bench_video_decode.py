"""Video decoders side by side (PyAV, OpenCV headless; torchcodec when it loads): header probe time, the time to
decode N sampled frames of a clip, and peak RSS, each measurement in a fresh child process so RSS is its own.

Clips are made locally with PyAV (firsttoken/inputs/video_synth.py; h264 when the wheel has libx264) and cached in
--clip-dir. Both libraries read the clip from bytes in memory (PyAV from a BytesIO, OpenCV 5 from a Python stream),
as the server would. Two ways to reach the sampled frames, per library:

  seek:  per sampled frame, seek to the key frame at or before it, decode forward to it (PyAV: container.seek with
         the stream's pts; OpenCV: CAP_PROP_POS_FRAMES, which seeks and decodes forward inside OpenCV)
  index: PyAV only, what firsttoken ships: demux the packets (no decode) for every frame's pts and the key frames,
         then decode from the latest key frame before each sampled frame, seeking only when that skips work
  firsttoken: the server's whole path at the default budget (inputs/video.py load_video: probe, index, plan, decode,
         resize), frames as the plan decides
  scan:  decode forward from the start, converting only the sampled frames to RGB (PyAV: decode every packet;
         OpenCV: grab() every frame, retrieve() the sampled ones, as vLLM's OpenCV loader does)

    python benchmarks/bench_video_decode.py --json docs/runs/video-decode-avx2.json
"""

from __future__ import annotations

import argparse
import io
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CLIPS = {  # name: (seconds, width, height, frames between key frames; None: libx264's default 250)
    "10s-360p": (10, 640, 360, None),
    "10s-1080p": (10, 1920, 1080, None),
    "60s-360p": (60, 640, 360, None),
    "60s-1080p": (60, 1920, 1080, None),
    "60s-360p-gop60": (60, 640, 360, 60),  # a key frame every 2 s, as phones and streaming encoders write
    "60s-1080p-gop60": (60, 1920, 1080, 60),
}


def _indices(total: int, n: int) -> list[int]:
    import numpy as np

    return [int(i) for i in np.linspace(0, total - 1, n).round()]


# ------------------------------------------------------------------------------------------------ workers


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _reset_peak_rss() -> bool:
    """Linux: writing 5 to clear_refs resets VmHWM (the peak RSS) to the current RSS, so the peak read at the end
    is this measurement's, not the imports'."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def work_pyav(data: bytes, task: str, n: int, threads: int) -> dict:
    import av

    out: dict = {}
    t0 = time.perf_counter()
    with av.open(io.BytesIO(data)) as c:
        s = c.streams.video[0]
        total, fps = s.frames, float(s.average_rate)
        meta = (s.codec_context.width, s.codec_context.height, total, fps, s.codec_context.name)
        out["probe_s"] = time.perf_counter() - t0
        if task == "probe":
            out["meta"] = meta
            return out
        s.thread_type = "AUTO"
        s.codec_context.thread_count = threads
        targets = _indices(total, n)
        tb = s.time_base
        start = s.start_time or 0
        got = 0
        t1 = time.perf_counter()
        if task == "seek":
            for idx in targets:
                pts = start + int(round(idx / fps / tb))
                c.seek(pts, stream=s, backward=True, any_frame=False)
                for frame in c.decode(s):
                    if frame.pts is not None and frame.pts >= pts:
                        frame.to_ndarray(format="rgb24")
                        got += 1
                        break
        elif task == "index":
            # What firsttoken ships (inputs/video.py): demux packets only (no decode) to learn every frame's pts and
            # the key frames, then per sampled frame seek to the latest key frame at or before it unless the decoder
            # is already between that key frame and the target, and decode forward to it.
            pts_all: list[int] = []
            keys: list[int] = []
            for packet in c.demux(s):
                if packet.pts is None:
                    continue
                pts_all.append(packet.pts)
                if packet.is_keyframe:
                    keys.append(packet.pts)
            pts_all.sort()
            keys.sort()
            import bisect

            frames = [pts_all[i] for i in _indices(len(pts_all), n)]
            pos = None
            decoder = None
            for pts in frames:
                key = keys[max(0, bisect.bisect_right(keys, pts) - 1)]
                if pos is None or not key <= pos < pts:
                    c.seek(key, stream=s, backward=True, any_frame=False)
                    decoder = c.decode(s)
                for frame in decoder:
                    pos = frame.pts
                    if frame.pts is not None and frame.pts >= pts:
                        frame.to_ndarray(format="rgb24")
                        got += 1
                        break
        else:  # scan
            want = set(targets)
            for i, frame in enumerate(c.decode(s)):
                if i in want:
                    frame.to_ndarray(format="rgb24")
                    got += 1
                    if got == len(want):
                        break
        out["decode_s"] = time.perf_counter() - t1
        out["frames"] = got
    return out


def work_firsttoken(data: bytes, task: str, n: int, threads: int) -> dict:
    """What the server runs for one video at the default budget (VideoConfig()): probe, packet index, plan,
    decode of the planned frames, each resized to the plan's size. ``n`` is ignored: the plan decides."""
    from firsttoken.config import VideoConfig
    from firsttoken.inputs.video import PyAVBackend, load_video
    from firsttoken.models.model_config import ImageProcessorConfig

    be = PyAVBackend(threads)
    t0 = time.perf_counter()
    loaded = load_video(data, VideoConfig(max_video_bytes=2**30), ImageProcessorConfig(), backend=be)
    return {"decode_s": time.perf_counter() - t0, "frames": loaded.plan.num_frames,
            "frames_through_decoder": be.frames_decoded, "resized": list(loaded.plan.resized_size),
            "tokens": loaded.plan.num_tokens, "max_full_frames_held": be.max_held}


def work_opencv(data: bytes, task: str, n: int, threads: int) -> dict:
    import cv2

    cv2.setNumThreads(threads)
    out: dict = {}
    t0 = time.perf_counter()
    stream = io.BytesIO(data)  # OpenCV does not keep the stream alive: a temporary here is a use-after-free
    cap = cv2.VideoCapture(stream, cv2.CAP_FFMPEG, [cv2.CAP_PROP_N_THREADS, threads])
    try:
        total = int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
        fps = cap.get(cv2.CAP_PROP_FPS)
        meta = (int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT)), total, fps,
                int(cap.get(cv2.CAP_PROP_FOURCC)))
        out["probe_s"] = time.perf_counter() - t0
        if task == "probe":
            out["meta"] = meta
            return out
        targets = _indices(total, n)
        got = 0
        t1 = time.perf_counter()
        if task == "seek":
            for idx in targets:
                cap.set(cv2.CAP_PROP_POS_FRAMES, idx)
                ok, frame = cap.read()
                if ok:
                    cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)
                    got += 1
        else:
            want = set(targets)
            for i in range(max(targets) + 1):
                if not cap.grab():
                    break
                if i in want:
                    ok, frame = cap.retrieve()
                    if ok:
                        cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)
                        got += 1
        out["decode_s"] = time.perf_counter() - t1
        out["frames"] = got
    finally:
        cap.release()
    return out


def worker(lib: str, clip: Path, task: str, n: int, threads: int) -> None:
    import os

    data = clip.read_bytes()
    if task == "firsttoken":  # imported before the measurement (torch comes with it), as in a running server
        import firsttoken.inputs.video  # noqa: F401
    reset = _reset_peak_rss()
    base = _status_kib("VmRSS")
    fn = {"pyav": work_pyav, "opencv": work_opencv}[lib] if task != "firsttoken" else work_firsttoken
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    out = fn(data, task, n, threads)
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    # CPU seconds (user + system) of the measured work: less at the mercy of other processes than wall time on a
    # shared machine (probe's share is small; decode_s/probe_s stay the wall times)
    out["cpu_s"] = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    peak = _status_kib("VmHWM")
    out["peak_rss_mib"] = round(peak / 1024, 1)
    out["peak_rss_over_start_mib"] = round((peak - base) / 1024, 1) if reset else None
    out["clip_mib"] = round(len(data) / 2**20, 2)
    print(json.dumps(out), flush=True)
    os._exit(0)  # nothing to tear down; a crash in a library's teardown must not lose the measurement


# ------------------------------------------------------------------------------------------------ driver


def _child(lib: str, clip: Path, task: str, n: int, threads: int) -> dict:
    # The library is imported in the child before the baseline RSS is read: a child imports it first thing.
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); "
            f"sys.path.insert(1, {str(Path(__file__).resolve().parent.parent)!r}); "
            f"import {'av' if lib == 'pyav' else 'cv2'}, numpy; import bench_video_decode as b; "
            f"b.worker({lib!r}, __import__('pathlib').Path({str(clip)!r}), {task!r}, {n}, {threads})")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        return {"error": res.stderr.strip().splitlines()[-1] if res.stderr.strip() else f"rc {res.returncode}"}
    return json.loads(res.stdout.strip().splitlines()[-1])


def _versions() -> dict:
    out = {}
    for name, mod in (("av", "av"), ("opencv-python-headless", "cv2"), ("torchcodec", "torchcodec")):
        try:
            m = __import__(mod)
            out[name] = getattr(m, "__version__", "?")
            if mod == "torchcodec":
                from torchcodec.decoders import VideoDecoder  # noqa: F401  (loads its native libraries)
        except Exception as err:  # noqa: BLE001 - recorded, not raised
            out[name] = f"unavailable: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
    return out


def _opencv_temporary_stream(clip: Path) -> str:
    """What happens when OpenCV's Python-stream reader is handed a temporary BytesIO (it keeps no reference)."""
    code = ("import cv2, io; cap = cv2.VideoCapture(io.BytesIO(open(%r, 'rb').read()), cv2.CAP_FFMPEG, []); "
            "cap.read(); cap.release()" % str(clip))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    return f"exit status {res.returncode}" + (" (SIGSEGV: the stream was freed under the reader)" if res.returncode == -11 else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clips", default=",".join(CLIPS))
    ap.add_argument("--clip-dir", default="/tmp/firsttoken-video-clips")
    ap.add_argument("--frames", default="20,default", help="sampled frames per decode; 'default': Qwen's 2 fps plan")
    ap.add_argument("--libs", default="pyav,opencv")
    ap.add_argument("--tasks", default="probe,firsttoken,index,seek,scan")
    ap.add_argument("--threads", type=int, default=1, help="decoder threads per library (the server's pool is "
                                                            "what parallelises)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from machine import machine_info

    from firsttoken.inputs.video_synth import make_clip, pick_codec

    clip_dir = Path(args.clip_dir)
    clip_dir.mkdir(parents=True, exist_ok=True)
    codec = pick_codec()
    results = []
    configs = []  # (clip name, path, lib, task, frames)
    for name in args.clips.split(","):
        seconds, w, h, gop = CLIPS[name]
        path = clip_dir / f"{name}-{codec}.mp4"
        if not path.exists():
            t = time.perf_counter()
            path.write_bytes(make_clip(seconds, w, h, fps=30, codec=codec, gop=gop))
            print(f"made {path} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        total = seconds * 30
        for lib in args.libs.split(","):
            for task in args.tasks.split(","):
                if task in ("index", "firsttoken") and lib != "pyav":
                    continue  # OpenCV exposes no packets: it cannot list key frames without decoding
                counts = [0] if task in ("probe", "firsttoken") else sorted({
                    (min(total, seconds * 2) if f == "default" else int(f)) for f in args.frames.split(",")})
                configs += [(name, path, lib, task, n) for n in counts]
    # Rounds outermost: each configuration's runs are spread over the whole run, so a burst of load from other
    # processes on a shared machine lands on all of them rather than on one.
    runs: dict[int, list[dict]] = {k: [] for k in range(len(configs))}
    for _ in range(args.rounds):
        for k, (name, path, lib, task, n) in enumerate(configs):
            runs[k].append(_child(lib, path, task, n, args.threads))
    for k, (name, path, lib, task, n) in enumerate(configs):
        seconds, w, h, gop = CLIPS[name]
        ok = [r for r in runs[k] if "error" not in r]
        row = {"clip": name, "seconds": seconds, "width": w, "height": h, "fps": 30, "codec": codec,
               "gop": gop or 250, "clip_bytes": path.stat().st_size, "lib": lib, "task": task, "frames_asked": n,
               "rounds": len(ok)}
        if not ok:
            row["error"] = runs[k][0]["error"]
        else:
            key = "probe_s" if task == "probe" else "decode_s"
            row["median_s"] = round(statistics.median(r[key] for r in ok), 5)
            row["min_s"] = round(min(r[key] for r in ok), 5)
            row["median_cpu_s"] = round(statistics.median(r["cpu_s"] for r in ok), 5)
            row["peak_rss_mib"] = max(r["peak_rss_mib"] for r in ok)
            row["peak_rss_over_start_mib"] = max(r["peak_rss_over_start_mib"] or 0 for r in ok)
            if task == "probe":
                row["meta"] = ok[0]["meta"]
            else:
                row["frames_decoded"] = ok[0]["frames"]
            for extra in ("frames_through_decoder", "resized", "tokens", "max_full_frames_held"):
                if extra in ok[0]:
                    row[extra] = ok[0][extra]
        results.append(row)
        print(json.dumps(row), file=sys.stderr)
    doc = {"bench": "video_decode", "machine": machine_info(), "versions": _versions(), "threads": args.threads,
           "opencv_temporary_stream": _opencv_temporary_stream(clip_dir / f"{args.clips.split(',')[0]}-{codec}.mp4"),
           "rounds": args.rounds, "results": results}
    text = json.dumps(doc, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
