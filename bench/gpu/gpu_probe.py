"""The GPU's own state during a run, sampled: clocks, power, temperature and why clocks were held.

    python3 bench/gpu/gpu_probe.py OUT.jsonl [--every 0.2] [--seconds S]   # sample until killed or S
    python3 bench/gpu/gpu_probe.py --summary OUT.jsonl                     # what the samples say
    python3 bench/gpu/gpu_probe.py --pairs OUT.jsonl defaults.json         # beside each seed-pair run

Why: a new proxy's first long prompt met slow engine steps in every run of issue 49's defaults
(bench/results/defaults/h100/run-9f76ea6/: the same 512-800-token steps cost the stream 40-53 ms
in the first pair run, 30 s after the direct row's steady load, and 27-35 ms 10-20 s later; the
host probe flat). Slower clocks would look like that (a hot card, a power cap) and so would
something in the engine; this tells the two apart. One JSON line a sample, appended:

    {"unix": 1796580907.81, "sm_mhz": 1980, "mem_mhz": 2619, "power_w": 312.4, "temp_c": 51,
     "util": 87, "reasons": 0}

``reasons``: NVML's clock event reasons, a bit mask (``REASONS`` names the bits; 1, "GPU idle", is
normal between requests). NVML is read through ctypes from the driver's own library, a few
microseconds a sample: no process per sample beside a host-bound engine.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import host_probe  # noqa: E402  (bench/gpu/host_probe.py: one reader for both probes' files)

# NVML's clock event reasons (nvml.h, nvmlClocksEventReason*), by bit.
REASONS = {
    0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
    0x100: "display_clocks",
}
IDLE = 0x1


def reason_names(mask: int) -> list[str]:
    """The names of the reasons set in ``mask``; bits NVML added since as hex."""
    unknown = mask & ~sum(REASONS)
    return [name for bit, name in REASONS.items() if mask & bit] + ([f"0x{unknown:x}"] if unknown else [])


class Nvml:
    """The few NVML calls a sample needs, on GPU ``index``."""

    def __init__(self, index: int = 0):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._check(self.lib.nvmlInit_v2())
        self.handle = ctypes.c_void_p()
        self._check(self.lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(self.handle)))
        # the reasons' call was renamed in newer drivers; both take (device, unsigned long long *)
        self._reasons = getattr(self.lib, "nvmlDeviceGetCurrentClocksEventReasons", None) \
            or self.lib.nvmlDeviceGetCurrentClocksThrottleReasons

    @staticmethod
    def _check(rc: int) -> None:
        if rc != 0:
            raise OSError(f"NVML returned {rc}")

    def _uint(self, fn, *args) -> int:
        out = ctypes.c_uint()
        self._check(fn(self.handle, *args, ctypes.byref(out)))
        return out.value

    def sample(self) -> dict:
        class Util(ctypes.Structure):
            _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]

        util, reasons = Util(), ctypes.c_ulonglong()
        self._check(self.lib.nvmlDeviceGetUtilizationRates(self.handle, ctypes.byref(util)))
        self._check(self._reasons(self.handle, ctypes.byref(reasons)))
        return {
            "unix": round(time.time(), 3),
            "sm_mhz": self._uint(self.lib.nvmlDeviceGetClockInfo, ctypes.c_int(1)),  # NVML_CLOCK_SM
            "mem_mhz": self._uint(self.lib.nvmlDeviceGetClockInfo, ctypes.c_int(2)),  # NVML_CLOCK_MEM
            "power_w": round(self._uint(self.lib.nvmlDeviceGetPowerUsage) / 1e3, 1),  # milliwatts
            "temp_c": self._uint(self.lib.nvmlDeviceGetTemperature, ctypes.c_int(0)),  # NVML_TEMPERATURE_GPU
            "util": util.gpu,
            "reasons": reasons.value,
        }


def record(path: Path, every: float, seconds: float | None, source=None) -> int:
    """Append a sample every ``every`` s until SIGTERM/SIGINT or ``seconds``; the samples written."""
    try:
        source = source or Nvml()
    except (OSError, AttributeError) as exc:
        print(f"gpu_probe: no NVML here ({exc}); nothing sampled", file=sys.stderr)
        return 0
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    end = None if seconds is None else time.monotonic() + seconds
    n = 0
    with path.open("a") as f:
        while not stop and (end is None or time.monotonic() < end):
            try:
                f.write(json.dumps(source.sample()) + "\n")
            except OSError as exc:
                print(f"gpu_probe: sample failed ({exc}); stopping", file=sys.stderr)
                break
            f.flush()
            n += 1
            time.sleep(every)
    return n


def read(path: Path) -> list[dict]:
    """The samples (``.gz`` too), by time; a line cut by the kill is skipped."""
    return host_probe.read(path, "sm_mhz")


def summarize(samples: list[dict]) -> dict:
    """Clocks, power and temperature over the samples, and how often each reason held the clocks."""
    if not samples:
        return {"samples": 0}
    busy = [s for s in samples if s["util"] > 0]
    out: dict = {"samples": len(samples), "busy_samples": len(busy)}
    for key in ("sm_mhz", "power_w", "temp_c"):
        vals = sorted(s[key] for s in (busy or samples))
        out[f"{key}_min"], out[f"{key}_p50"], out[f"{key}_max"] = vals[0], statistics.median(vals), vals[-1]
    counts: dict[str, int] = {}
    for s in samples:
        for name in reason_names(s["reasons"] & ~IDLE):
            counts[name] = counts.get(name, 0) + 1
    out["held_by"] = {k: round(v / len(samples), 4) for k, v in sorted(counts.items())}
    return out


def window(samples: list[dict], start: float, end: float) -> dict:
    """``summarize`` over the samples from ``start`` to ``end`` (unix s)."""
    return summarize([s for s in samples if start <= s["unix"] <= end])


def pair_windows(defaults: dict) -> list[tuple[str, int, float, float]]:
    """(row, run, start, end) of each seed-pair run's long prompt, from its send to its first
    token, on the wall clock (runs without ``t0_unix``: skipped)."""
    out = []
    for row, parts in (defaults.get("rows") or {}).items():
        for run in ((parts.get("pair") or {}).get("raw") or []):
            a = run.get("a") or {}
            tokens = a.get("tokens") or []
            if "t0_unix" in run and a.get("sent") is not None and tokens:
                out.append((row, run["run"], run["t0_unix"] + a["sent"], run["t0_unix"] + tokens[0]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path", type=Path, help="the samples' JSONL")
    p.add_argument("defaults", type=Path, nargs="?", help="with --pairs: bench defaults' JSON")
    p.add_argument("--every", type=float, default=0.2)
    p.add_argument("--seconds", type=float)
    p.add_argument("--summary", action="store_true")
    p.add_argument("--pairs", action="store_true", help="the samples during each seed-pair run's long prompt")
    args = p.parse_args(argv)
    if args.pairs:
        if args.defaults is None:
            p.error("--pairs needs the defaults JSON")
        samples = read(args.path)
        for row, run, start, end in pair_windows(json.loads(args.defaults.read_text())):
            w = window(samples, start, end)
            print(f"{row} pair run {run} ({end - start:.2f} s): " + (json.dumps(w) if w["samples"] else "no samples"))
        return 0
    if args.summary:
        print(json.dumps(summarize(read(args.path)), indent=1))
        return 0
    record(args.path, args.every, args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
