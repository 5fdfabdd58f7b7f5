"""All-reduce in one page: every process computes the gradient of its own share of a
batch, one all-reduce (sum, then divide by the world size) turns the shares into the
gradient of the whole batch. That is what DistributedDataParallel does for every
parameter of a model.

    python -m coursekit torchrun --nproc 2 allreduce_demo.py  # one machine
    srun python allreduce_demo.py  # under Slurm (see lesson 02)
"""
import os

import torch
import torch.distributed as dist

from coursekit import distributed

SAMPLES_PER_RANK = 8


def main():
    # torchrun's variables, or else Slurm's
    rank, world_size, local_rank = distributed.place()
    # nccl for GPU tensors
    dist.init_process_group("gloo", rank=rank, world_size=world_size)

    torch.manual_seed(0)  # the same batch and the same model in every process
    x = torch.randn(SAMPLES_PER_RANK * world_size, 16)
    y = torch.randn(SAMPLES_PER_RANK * world_size, 1)
    w = torch.zeros(16, 1, requires_grad=True)

    # this rank's share
    mine = slice(rank * SAMPLES_PER_RANK, (rank + 1) * SAMPLES_PER_RANK)
    ((x[mine] @ w - y[mine]) ** 2).mean().backward()
    local_norm = w.grad.norm().item()
    dist.all_reduce(w.grad, op=dist.ReduceOp.SUM)  # every rank now holds the sum...
    w.grad /= world_size  # ...and the mean: the gradient of the whole batch's mean loss
    whole_batch = torch.autograd.grad(((x @ w - y) ** 2).mean(), w)[0]
    difference = (w.grad - whole_batch).abs().max().item()

    # rank 0 prints everyone's numbers, in rank order; they travel as a tensor (an
    # object collective such as all_gather_object would unpickle whatever another
    # process sent)
    mine = torch.tensor([local_rank, os.getpid(), local_norm, w.grad.norm(),
                         difference], dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    if rank == 0:
        print(f"MASTER_ADDR={os.environ.get('MASTER_ADDR')} "
              f"MASTER_PORT={os.environ.get('MASTER_PORT')}"
              f" backend={dist.get_backend()}")
        for other, numbers in enumerate(everyone):
            (its_local_rank, pid, own_norm, reduced_norm,
             its_difference) = numbers.tolist()
            print(f"rank {other} of {world_size} (local rank {its_local_rank:.0f}, "
                  f"pid {pid:.0f}): "
                  f"own-share gradient norm {own_norm:.4f}, "
                  f"after all-reduce {reduced_norm:.4f}, "
                  f"max |all-reduced - whole batch| = {its_difference:.1e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
