"""Tokens per second of the ddp, fsdp, tp, pp and lit stages with 1 and 2 processes on this machine.

Each run is the real stage script (torchrun for ddp, fsdp, tp and pp, Lightning's own launcher for
lit) at the same global batch (tp: one tensor-parallel group of 2; pp: 2 stages, 1F1B, as many
microbatches as the preset's minibatch holds); the figure is the median tokens/s of the steps after a warm-up. Speedup = tok/s with
2 processes / tok/s with 1; efficiency = speedup / 2. One process uses every core through PyTorch's
intra-op threads; with 2 processes each gets one thread (torchrun sets OMP_NUM_THREADS=1, and this
benchmark does the same for Lightning), so on a CPU-only machine the processes compete for the same
cores: the numbers show the cost of communication and duplication, not a GPU speedup.
Writes benchmarks/results/scaling.json.

    .venv/bin/python benchmarks/scaling.py [--steps 40] [--warmup 10] [--preset tiny]
"""
import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from throughput import machine, stage_command, timed_run

from coursekit import KIT_ROOT, data, runs
from coursekit.launch import torchrun

RESULTS = KIT_ROOT / "benchmarks" / "results" / "scaling.json"
TORCHRUN_STAGES = ("ddp", "fsdp", "tp", "pp")


def launch(stage, processes):
    """(launcher, extra flags, environment) of a stage at a number of processes."""
    if stage in TORCHRUN_STAGES and processes > 1:
        return torchrun(processes), [], None
    if stage == "lit":
        threads = {"OMP_NUM_THREADS": "1"} if processes > 1 else {}
        return [sys.executable], ["--devices", str(processes)], {**os.environ, **threads}
    return [sys.executable], [], None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--data", default=str(KIT_ROOT / "data" / "builtin"))
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if not (Path(args.data) / "meta.json").exists():
        data.prepare_builtin(args.data)
    result = {"benchmark": "ddp, fsdp, tp, pp and lit stages, 1 and 2 processes", "preset": args.preset,
              "steps": args.steps, "warmup_steps": args.warmup, "date": time.strftime("%Y-%m-%d"),
              "machine": machine()}
    for stage in (*TORCHRUN_STAGES, "lit"):
        result[stage] = {}
        for processes in (1, 2):
            launcher, flags, env = launch(stage, processes)
            with tempfile.TemporaryDirectory() as out:
                command = stage_command(f"train_gpt2_{stage}.py", args.preset, args.data, out,
                                        args.steps) + flags
                figures = timed_run(launcher, command, out, args.warmup, env)
            result[stage][f"{processes}_process"] = figures
            print(f"{stage} x{processes}: {figures['median_tok_per_s']:8,.0f} tok/s  "
                  f"{figures['median_ms_per_step']:7.1f} ms/step  (run {figures['wall_s']:.0f} s)")
        one, two = (result[stage][f"{n}_process"]["median_tok_per_s"] for n in (1, 2))
        result[stage]["speedup"], result[stage]["efficiency"] = two / one, two / one / 2
        print(f"{stage}: speedup {two / one:.2f}, efficiency {two / one / 2:.0%}")
    runs.write_json_atomic(args.out, result)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
