"""Tokens per second of the std stage on the tiny preset, eager and compiled.

Runs the real stage script as a subprocess (what a trainee runs), reads its metrics.jsonl and
reports the median tokens/s over the steps after a warm-up (the first steps pay for thread pools,
allocator growth and, compiled, for compilation). Writes benchmarks/results/throughput.json with a
description of the machine.

    .venv/bin/python benchmarks/throughput.py [--steps 60] [--warmup 15] [--preset tiny]
"""
import argparse
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from coursekit import KIT_ROOT, data, envcheck, perf, runs

RESULTS = KIT_ROOT / "benchmarks" / "results" / "throughput.json"


def cpu_model():
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def children_cpu():
    """The user + system CPU-seconds of the children waited for so far (what `time` counts)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def machine():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return {
        "cpu": cpu_model(), "cores": envcheck.usable_cpu_cores(), "platform": platform.platform(),
        "python": platform.python_version(), "torch": torch.__version__,
        "device": perf.device_name(device),
        "matmul_peak_tflops": perf.peak_flops(device)[0] / 1e12,
    }


def stage_command(script, preset, data_dir, out, steps):
    """The stage script's command line for a short timed run that writes nothing but metrics."""
    return [str(KIT_ROOT / "solutions" / script), "--preset", preset, "--data", str(data_dir),
            "--out", str(out), "--max-steps", str(steps), "--sample-tokens", "0",
            "--eval-interval", str(steps), "--ckpt-interval", str(steps)]


def timed_run(launcher, command, out, warmup, env=None):
    """Run launcher + command, then summarise its metrics.jsonl after the warm-up steps."""
    start = time.perf_counter()
    subprocess.run(launcher + command, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, env=env)
    wall = time.perf_counter() - start
    metrics = runs.read_metrics(out)
    timed = [r for r in metrics if r["step"] > warmup]
    return {
        "median_tok_per_s": statistics.median(r["tok_per_s"] for r in timed),
        "median_ms_per_step": statistics.median(r["ms"] for r in timed),
        "median_mfu": statistics.median(r["mfu"] for r in timed),
        "first_step_ms": metrics[0]["ms"],
        "steps_timed": len(timed),
        "wall_s": wall,
    }


def measure(preset, data_dir, steps, warmup, compile_):
    with tempfile.TemporaryDirectory() as out:
        command = stage_command("train_gpt2_std.py", preset, data_dir, out, steps)
        return timed_run([sys.executable], command + (["--compile"] if compile_ else []), out,
                         warmup)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=15)
    parser.add_argument("--data", default=str(KIT_ROOT / "data" / "builtin"))
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if not (Path(args.data) / "meta.json").exists():
        data.prepare_builtin(args.data)
    result = {"benchmark": "std stage throughput", "preset": args.preset, "steps": args.steps,
              "warmup_steps": args.warmup, "date": time.strftime("%Y-%m-%d"), "machine": machine()}
    for mode, compile_ in (("eager", False), ("compiled", True)):
        result[mode] = measure(args.preset, args.data, args.steps, args.warmup, compile_)
        print(f"{mode:9s} {result[mode]['median_tok_per_s']:10,.0f} tok/s  "
              f"{result[mode]['median_ms_per_step']:7.1f} ms/step  "
              f"mfu {100 * result[mode]['median_mfu']:.1f}%  (run {result[mode]['wall_s']:.0f} s)")
    result["compiled_speedup"] = result["compiled"]["median_tok_per_s"] / result["eager"]["median_tok_per_s"]
    runs.write_json_atomic(args.out, result)
    print(f"compiled / eager = {result['compiled_speedup']:.2f}x; written to {args.out}")


if __name__ == "__main__":
    main()
