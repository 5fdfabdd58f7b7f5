"""The check of lesson 02's exercise 3: your `ddp_step`, run on every rank of a small job, against
one process that trains on all the ranks' microbatches at once. It lives in the kit, not beside
the lesson, so that grading runs the instructor's copy (the grading sandbox shows a submission's
folder and the kit, coursekit/sandbox.py).

    torchrun --nnodes=1 --nproc-per-node=2 --master-addr=127.0.0.1 --master-port=P \
        -m coursekit.ddp_step_check ANSWER.py

ANSWER.py holds the function `ddp_step(ddp_model, optimizer, microbatches, loss_fn)`; it may use
`torch`, `dist` (torch.distributed) and `nullcontext` without importing them. Every rank trains
the same small model for STEPS steps, each on MICROBATCHES microbatches of its own, with a
gradient all-reduce counted by a DDP communication hook. Rank 0 then trains the same model in one
process on every rank's microbatches of each step, and prints one JSON line: the largest
difference between the two models' parameters, the losses the answer returned and those of the
one process, the gradient all-reduces of each step, and the answer's error, if it raised one.
"""
import contextlib
import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from coursekit import distributed, exercise

STEPS, MICROBATCHES, SAMPLES = 3, 2, 4  # samples per microbatch
TIMEOUT = timedelta(seconds=60)  # an answer that leaves a rank waiting fails within a minute


def load_answer(path):
    namespace = {"torch": torch, "dist": dist, "nullcontext": contextlib.nullcontext}
    exec(compile(open(path).read(), path, "exec"), namespace)
    return namespace["ddp_step"]


def make_model():
    torch.manual_seed(0)  # the same starting weights in every process
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def microbatches(step, rank):
    """The (inputs, targets) microbatches of ``rank`` at ``step``, the same in every process."""
    numbers = torch.Generator().manual_seed(1000 * step + rank)
    return [(torch.randn(SAMPLES, 8, generator=numbers), torch.randn(SAMPLES, 1, generator=numbers))
            for _ in range(MICROBATCHES)]


def counted_allreduce(counter, bucket):
    """DDP's own all-reduce of a gradient bucket, counted."""
    counter["all-reduces"] += 1
    return default_hooks.allreduce_hook(None, bucket)


def train_with_answer(ddp_step, rank):
    """(the model trained, the losses ddp_step returned, the all-reduces of each step, its
    error or None)."""
    model = DDP(make_model())
    counter = {"all-reduces": 0}
    model.register_comm_hook(counter, counted_allreduce)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, all_reduces = [], []
    try:
        with exercise.own_work(distributed.all_reduce_mean):  # the kit's: not an answer
            for step in range(STEPS):
                before = counter["all-reduces"]
                losses.append(float(ddp_step(model, optimizer, microbatches(step, rank),
                                             torch.nn.functional.mse_loss)))
                all_reduces.append(counter["all-reduces"] - before)
    except Exception as error:  # reported, not raised: the answer's mistake is the result
        return model.module, losses, all_reduces, f"{type(error).__name__}: {error}"
    return model.module, losses, all_reduces, None


def train_in_one_process(world_size):
    """The model and the losses of one process that takes each step on every rank's data."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        every = [pair for rank in range(world_size) for pair in microbatches(step, rank)]
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(torch.cat([x for x, _ in every])),
                                            torch.cat([y for _, y in every]))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model, losses


def main():
    rank, world_size, _ = distributed.place()
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=TIMEOUT)
    trained, losses, all_reduces, error = train_with_answer(load_answer(sys.argv[1]), rank)
    if rank == 0:
        reference, expected = train_in_one_process(world_size)
        difference = max((mine - theirs).abs().max().item()
                         for mine, theirs in zip(trained.parameters(), reference.parameters()))
        print(json.dumps({"largest_difference": difference, "losses": losses,
                          "expected_losses": expected, "all_reduces": all_reduces,
                          "error": error}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
