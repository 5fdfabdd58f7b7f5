"""Run under torchrun on a GPU machine: every rank starts as the stages do (distributed.setup
with --device cuda) and rank 0 prints the list of the ranks' current CUDA devices."""
import torch
import torch.distributed as dist

from coursekit import distributed

rank, world_size, device = distributed.setup("cuda")
mine = torch.tensor([torch.cuda.current_device()], device=device)
every = [torch.empty_like(mine) for _ in range(world_size)]
dist.all_gather(every, mine)  # over NCCL: a rank on the wrong GPU would fail or hang here
print([t.item() for t in every])
distributed.finish()
