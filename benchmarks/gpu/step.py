"""Run one step of the GPU table and write RESULTS_DIR/<step>.json as it goes (run.sh calls this under `timeout`).

    PYTHONPATH=. python benchmarks/gpu/step.py STEP RESULTS_DIR [--smoke]

The JSON is rewritten atomically (a temporary file renamed over it) after every figure, so a step killed by its
bound still leaves what it measured, with "status": "partial". A step that ends writes "done"; one that decides not
to measure (the gate did not pass for what it needs) writes its keys as null with ``why``. A step whose JSON says
"done" is not run again (run.sh resumes a run that way); any other status is run again from the start.

The file: {"step", "status": "partial"|"done", "setting": "device"|"smoke", "values": {key: value},
"why": {key: reason for a null value}, "context": {...}, "stand_ins": {...}, "error", "seconds", "passed" (false
where the step measured and its check failed: the gate; the step then exits 1, also when resumed),
"third_party_modules": [top-level modules imported from outside the repository and the standard library]}.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for path in (str(REPO), str(HERE.parent), str(HERE)):  # firsttoken, tests; roofline, bench_slo; the table's modules
    if path not in sys.path:
        sys.path.insert(0, path)

from manifest import StepSpec, spec  # noqa: E402


class Recorder:
    """A step's JSON under construction: ``put`` a declared key's value (or ``skip`` it with a reason) and the file
    is rewritten at once. ``finish`` checks every declared key was given."""

    def __init__(self, path: Path, step: StepSpec, setting: str, stand_ins: dict[str, str]) -> None:
        self.path, self.step, self.start = path, step, time.monotonic()
        self.data: dict[str, Any] = {"step": step.name, "status": "partial", "setting": setting, "values": {},
                                     "why": {}, "context": {}, "stand_ins": stand_ins, "error": None,
                                     "seconds": 0.0, "passed": None, "third_party_modules": []}  # fmt: skip
        self._write()

    def put(self, key: str, value: Any) -> None:
        self._declared(key)
        if value is None:
            raise ValueError(f"{self.step.name}.{key}: a null value needs a reason (use skip)")
        self.data["values"][key] = value
        self.data["why"].pop(key, None)
        self._write()

    def skip(self, key: str, why: str) -> None:
        self._declared(key)
        self.data["values"][key] = None
        self.data["why"][key] = why
        self._write()

    def has(self, key: str) -> bool:
        return key in self.data["values"]

    def value(self, key: str) -> Any:
        return self.data["values"][key]

    def values(self) -> dict[str, Any]:
        return dict(self.data["values"])

    def note(self, **context: Any) -> None:
        """What the figures were measured on (shapes, resolved flags, times of builds): free-form, not keys."""
        self.data["context"].update(context)
        self._write()

    def finish(self, error: str | None = None, passed: bool = True) -> None:
        """``passed``: False where the step measured and its check failed (the gate)."""
        missing = [k for k in self.step.keys if k not in self.data["values"]]
        if error is None and missing:
            error = f"ended without {len(missing)} declared keys: {missing[:6]}"
        self.data["status"] = "done" if error is None else "partial"
        self.data["error"] = error
        self.data["passed"] = passed
        self._write()

    def _declared(self, key: str) -> None:
        if key not in self.step.keys:
            raise KeyError(f"{self.step.name} declares no key {key!r} (benchmarks/gpu/manifest.py)")

    def _write(self) -> None:
        self.data["seconds"] = round(time.monotonic() - self.start, 3)
        self.data["third_party_modules"] = third_party_modules()
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        tmp.replace(self.path)


def third_party_modules() -> list[str]:
    """Top-level modules imported so far that are neither the standard library's nor this repository's."""
    local = {"firsttoken", "tests", "steps", *(p.stem for p in (*HERE.glob("*.py"), *HERE.parent.glob("*.py")))}
    names = {name.split(".")[0] for name in sys.modules}
    return sorted(n for n in names if n not in sys.stdlib_module_names and n not in local and not n.startswith("_"))


def done(path: Path) -> bool:
    try:
        return json.loads(path.read_text()).get("status") == "done"
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step")
    parser.add_argument("results", type=Path)
    parser.add_argument("--smoke", action="store_true", help="the CPU stands in for the device, tiny shapes")
    args = parser.parse_args(argv)
    step = spec(args.step)
    path = args.results / f"{step.name}.json"
    if done(path):
        passed = json.loads(path.read_text()).get("passed", True)
        print(f"{step.name}: done in an earlier run ({path}); not run again")
        return 0 if passed else 1
    from setting import Setting

    setting = Setting.for_run(args.smoke)
    setting.threads()
    recorder = Recorder(path, step, "smoke" if args.smoke else "device", setting.stand_ins())
    module = importlib.import_module(f"steps.{step.name}")
    try:
        ok = module.run(setting, recorder, args.results)  # False: measured, and the check failed (the gate)
    except Exception as exc:  # the JSON keeps what was measured and says what ended the step
        traceback.print_exc()
        recorder.finish(f"{type(exc).__name__}: {exc}".splitlines()[0][:500])
        return 1
    recorder.finish(passed=ok is not False)
    if recorder.data["status"] != "done":
        print(f"{step.name}: {recorder.data['error']}", file=sys.stderr)
        return 1
    print(f"{step.name}: done in {recorder.data['seconds']:.1f} s; wrote {path}")
    return 1 if ok is False else 0


if __name__ == "__main__":
    sys.exit(main())
