"""What experiment tracking costs a training run: the std stage with --track none, mlflow and
tensorboard, the same steps, on this machine.

Each run is the real `solutions/train_gpt2_std.py --preset tiny` on data/builtin. Step time is the
median of the script's own per-step timing (metrics.jsonl, after a warm-up), which covers the
forward, backward and optimiser step; the tracker's per-step call happens after that timing, so
the run's wall time, start-up and the final artifact upload included, is the figure that shows
all of tracking's cost. The three settings are interleaved and repeated so that a slow moment of
the machine does not land on one of them. MLflow logs to a fresh SQLite store in a temporary
folder (its first use creates the tables, part of the cost a first run pays). Writes
benchmarks/results/tracking_overhead.json.

    .venv/bin/python benchmarks/tracking_overhead.py [--steps 60] [--repeats 2]
"""
import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from throughput import machine

from coursekit import KIT_ROOT, runs

RESULTS = KIT_ROOT / "benchmarks" / "results" / "tracking_overhead.json"
TRACKERS = ("none", "mlflow", "tensorboard")
WARMUP = 5


def train(track, out, steps):
    """One std run; returns (wall seconds, median ms per step after the warm-up)."""
    command = [sys.executable, str(KIT_ROOT / "solutions" / "train_gpt2_std.py"), "--preset",
               "tiny", "--data", str(KIT_ROOT / "data" / "builtin"), "--out", str(out),
               "--max-steps", str(steps), "--eval-interval", str(steps), "--ckpt-interval",
               str(steps), "--sample-tokens", "0", "--track", track]
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   cwd=KIT_ROOT)
    wall = time.perf_counter() - start
    timed = [r["ms"] for r in runs.read_metrics(out) if r["step"] > WARMUP]
    return wall, statistics.median(timed)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    subprocess.run(["make", "data/builtin/meta.json"], cwd=KIT_ROOT, check=True,
                   stdout=subprocess.DEVNULL)
    measured = {track: [] for track in TRACKERS}
    for repeat in range(args.repeats):
        for track in TRACKERS:
            with tempfile.TemporaryDirectory() as tmp:  # a fresh MLflow store every time
                measured[track].append(train(track, Path(tmp) / f"run-{track}", args.steps))
    result = {"benchmark": "std stage with and without experiment tracking", "preset": "tiny",
              "steps": args.steps, "warmup_steps": WARMUP, "repeats": args.repeats,
              "date": time.strftime("%Y-%m-%d"), "machine": machine()}
    baseline = statistics.median(wall for wall, _ in measured["none"])
    for track, samples in measured.items():
        wall = statistics.median(w for w, _ in samples)
        result[track] = {"wall_s": wall, "median_ms_per_step": statistics.median(m for _, m in samples),
                         "wall_overhead_s": wall - baseline,
                         "overhead_ms_per_step": (wall - baseline) * 1000 / args.steps}
        figures = result[track]
        print(f"--track {track:11s} {wall:6.1f} s wall ({figures['wall_overhead_s']:+5.1f} s, "
              f"{figures['overhead_ms_per_step']:+6.1f} ms per step), step "
              f"{figures['median_ms_per_step']:6.1f} ms", flush=True)
    runs.write_json_atomic(args.out, result)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
