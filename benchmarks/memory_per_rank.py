"""Peak bytes per rank of every GPT stage under bf16 autocast: measured on CPU processes, and
predicted by coursekit.memory.

Each stage script's own main() trains 2 steps (evaluating and saving a checkpoint after the
second) in 2 CPU processes (std: 1), started by torchrun with the static rendezvous, inside
coursekit.memory.allocated_peak: the most bytes of tensors a rank held at once, which is what
torch.cuda.max_memory_allocated counts on a GPU, where autocast runs the same ATen operators.
The prediction is coursekit.memory.per_rank_bytes for the stage's strategy (std, ddp and lit:
ddp; pp: each rank's own stage, pipeline_stage_bytes). "unreleased" is what the profiler still
counted when the run ended: tensors that a communication thread released last, which it does not
see, so that the measured peak may be too high by up to that much. Writes
benchmarks/results/memory_per_rank.json and prints a Markdown table.

    .venv/bin/python benchmarks/memory_per_rank.py [--presets tiny small]
"""
import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from throughput import machine, stage_command

from coursekit import KIT_ROOT, data, launch, memory, presets, runs, stages

RESULTS = KIT_ROOT / "benchmarks" / "results" / "memory_per_rank.json"
PRECISION = "bf16-mixed"
STEPS = 2  # the second step's backward is the peak: the optimiser state exists by then
MiB = 2**20
#: stage: (coursekit.memory strategy, processes, the stage's own flags)
#: sizes that keep a run within minutes: a CPU without bf16 instructions computes bf16 matmuls
#: about 7 times slower than fp32 ones
SIZES = {"tiny": {}, "small": {"micro_batch": 1, "batch_tokens": 512, "eval_steps": 1}}
STAGES = {"std": ("ddp", 1, []), "ddp": ("ddp", 2, []), "lit": ("ddp", 2, ["--devices", "2"]),
          "fsdp": ("fsdp", 2, []), "tp": ("tp", 2, ["--tp", "2"]), "pp": ("pp", 2, [])}


def predicted(stage, preset):
    """{part: bytes} coursekit.memory predicts for each rank of ``stage``."""
    strategy, processes, _ = STAGES[stage]
    model = memory.Model.from_preset(preset)
    if strategy == "pp":
        return memory.pipeline_stage_bytes(model, processes, PRECISION, preset.micro_batch,
                                           preset.seq_len)
    return [memory.per_rank_bytes(model, strategy, processes, PRECISION, preset.micro_batch,
                                  preset.seq_len)] * processes


def measure(stage, preset_name, data_dir):
    """[{"peak": bytes, "unreleased": bytes}] of each rank of ``stage``, run for STEPS steps."""
    _, processes, flags = STAGES[stage]
    sizes = [flag for name, value in SIZES[preset_name].items()
             for flag in (f"--{name.replace('_', '-')}", str(value))]
    with tempfile.TemporaryDirectory() as out:
        command = [*stage_command(f"train_gpt2_{stage}.py", preset_name, data_dir, out, STEPS),
                   "--device", "cpu", "--precision", "bf16", *sizes, *flags]
        worker = [__file__, "--worker", stage, "--", *command[1:]]
        subprocess.run([*launch.torchrun(processes), *worker], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return [json.loads((Path(out) / f"peak-{rank}.json").read_text())
                for rank in range(processes)]


def worker(stage, argv):
    """In each torchrun process: the stage's main(), its tensors' peak written beside its run."""
    module = stages.load(stage)
    with memory.allocated_peak() as result:
        module.main(argv)
    out = Path(argv[argv.index("--out") + 1])
    (out / f"peak-{os.environ['RANK']}.json").write_text(json.dumps(result))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--stages", nargs="+", default=list(STAGES), choices=list(STAGES))
    parser.add_argument("--data", default=str(KIT_ROOT / "data" / "builtin"))
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if not (Path(args.data) / "meta.json").exists():
        data.prepare_builtin(args.data)
    result = {"benchmark": f"peak tensor bytes per rank, {PRECISION} on CPU processes, "
                           f"{STEPS} steps", "date": time.strftime("%Y-%m-%d"),
              "machine": machine(), "sizes": SIZES, "runs": []}
    print("| preset | stage | rank | predicted MiB | measured MiB | measured / predicted | "
          "unreleased MiB |\n|---|---|---|---|---|---|---|")
    for preset_name in args.presets:
        preset = dataclasses.replace(presets.get_preset(preset_name), **SIZES[preset_name])
        for stage in args.stages:
            peaks = measure(stage, preset_name, args.data)
            for rank, (peak, parts) in enumerate(zip(peaks, predicted(stage, preset),
                                                     strict=True)):
                result["runs"].append({"preset": preset_name, "stage": stage, "rank": rank,
                                       "predicted": parts, "measured": peak})
                print(f"| {preset_name} | {stage} | {rank} | {parts['total'] / MiB:,.1f} | "
                      f"{peak['peak'] / MiB:,.1f} | {peak['peak'] / parts['total']:.3f} | "
                      f"{peak['unreleased'] / MiB:,.1f} |", flush=True)
    runs.write_json_atomic(args.out, result)
    print(f"written to {args.out}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[4:])
    else:
        main()
