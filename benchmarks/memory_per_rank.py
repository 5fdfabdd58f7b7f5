"""Bytes per rank of the model-parallel stages, predicted by coursekit.memory and measured.

Runs fsdp, tp and pp on 2 and 4 processes (and tp as dp=2 x tp=2) for a few tiny steps, reads each
run's memory.json (the bytes of the parameter, gradient and optimiser tensors every rank holds,
and its peak resident memory) and sets them beside the arithmetic. Writes
benchmarks/results/memory_per_rank.json and prints a Markdown table.

    .venv/bin/python benchmarks/memory_per_rank.py
"""
import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from throughput import machine, stage_command

from coursekit import KIT_ROOT, data, memory, presets, runs

RESULTS = KIT_ROOT / "benchmarks" / "results" / "memory_per_rank.json"
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
TINY = memory.Model.from_preset(presets.get_preset("tiny"))
MiB = 2**20
# (stage, processes, extra flags): the micro-batch keeps the 1,024-token minibatch splitting
RUNS = [("fsdp", 2, []), ("fsdp", 4, ["--micro-batch", "2"]),
        ("tp", 2, ["--tp", "2"]), ("tp", 4, ["--tp", "4"]),
        ("tp", 4, ["--tp", "2", "--micro-batch", "2"]),
        ("pp", 2, []), ("pp", 4, ["--micro-batch", "2"])]


def predicted_params(stage, processes, flags):
    """Parameters each rank should hold, rank by rank."""
    if stage == "fsdp":
        return [TINY.parameters / processes] * processes
    if stage == "tp":  # FSDP splits each tensor-parallel shard again over the dp replicas
        tp = int(flags[flags.index("--tp") + 1])
        return [TINY.tensor_parallel_parameters(tp) / (processes // tp)] * processes
    return TINY.pipeline_stage_parameters(processes)


def measure(stage, processes, flags, data_dir, steps):
    with tempfile.TemporaryDirectory() as out:
        command = stage_command(f"train_gpt2_{stage}.py", "tiny", data_dir, out, steps)
        subprocess.run([TORCHRUN, "--standalone", f"--nproc-per-node={processes}", *command,
                        "--device", "cpu", *flags], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        return runs.read_json(Path(out) / "memory.json")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--data", default=str(KIT_ROOT / "data" / "builtin"))
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if not (Path(args.data) / "meta.json").exists():
        data.prepare_builtin(args.data)
    result = {"benchmark": "bytes per rank, tiny preset, fp32 on CPU", "steps": args.steps,
              "date": time.strftime("%Y-%m-%d"), "machine": machine(),
              "whole_model_params_bytes": 4 * TINY.parameters, "runs": []}
    print("| stage | processes | flags | rank | params MiB predicted | measured | grads MiB "
          "| optimizer MiB | peak RSS MiB |\n|---|---|---|---|---|---|---|---|---|")
    for stage, processes, flags in RUNS:
        reports = measure(stage, processes, flags, args.data, args.steps)
        predicted = predicted_params(stage, processes, flags)
        result["runs"].append({"stage": stage, "processes": processes, "flags": flags,
                               "predicted_params_bytes": [4 * n for n in predicted],
                               "measured": reports})
        for rank, (report, n) in enumerate(zip(reports, predicted, strict=True)):
            print(f"| {stage} | {processes} | {' '.join(flags)} | {rank} | {4 * n / MiB:.2f} | "
                  f"{report['params'] / MiB:.2f} | {report['grads'] / MiB:.2f} | "
                  f"{report['optimizer'] / MiB:.2f} | {report['peak'] / MiB:.0f} |")
    runs.write_json_atomic(args.out, result)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
