"""Run under torchrun: the pipeline bubble, timed on a pipeline of equal stages.

    python -m coursekit torchrun --nproc 2 bubble_demo.py 1 2 4 8 [--schedule 1f1b]

A stack of identical layers is cut into one stage per process, so that every stage does
the same work (GPT-2's output head would make the last stage the slowest, which is
imbalance, not bubble). For each number of microbatches on the command line, rank 0
prints one JSON line with the median time of a training step (GPipe by default; 1F1B
needs at least as many microbatches as stages). Every process computes with one thread,
so that one process and one stage per core can be compared.
"""
import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

LAYERS, WIDTH, SAMPLES = 8, 512, 512  # one step: 8 x 512 x 512^2 multiply-adds, forward
WARMUP, TIMED = 1, 5
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def stage_module(rank, stages):
    """This rank's run of consecutive layers, the same weights whatever the number of
    stages."""
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(LAYERS)]
    per_stage = LAYERS // stages
    return nn.Sequential(*layers[rank * per_stage:(rank + 1) * per_stage])


def step_time(schedule, rank, stages, x, y):
    """Seconds of one training step, every stage done (the barrier waits for the
    last)."""
    start = time.perf_counter()
    if stages == 1:
        schedule.step(x, target=y)
    elif rank == 0:
        schedule.step(x)
    elif rank == stages - 1:
        schedule.step(target=y)
    else:
        schedule.step()
    dist.barrier()
    return time.perf_counter() - start


def main(microbatch_counts, schedule_name):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, stages = dist.get_rank(), dist.get_world_size()
    module = stage_module(rank, stages)
    x, y = torch.randn(SAMPLES, WIDTH), torch.randn(SAMPLES, WIDTH)
    for m in microbatch_counts:
        stage = PipelineStage(module, rank, stages, torch.device("cpu"))
        schedule = SCHEDULES[schedule_name](stage, n_microbatches=m,
                                            loss_fn=nn.functional.mse_loss)
        times = [step_time(schedule, rank, stages, x, y) for _ in range(WARMUP + TIMED)]
        if rank == 0:
            print(json.dumps({"stages": stages, "schedule": schedule_name,
                              "microbatches": m,
                              "step_ms": 1000 * statistics.median(times[WARMUP:])}),
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("microbatches", type=int, nargs="+")
    parser.add_argument("--schedule", choices=list(SCHEDULES), default="gpipe")
    args = parser.parse_args()
    main(args.microbatches, args.schedule)
