"""Run under torchrun: one DDP step of the ddp stage's model against a single process.

Prints (rank 0) the largest difference between the DDP gradient and the single-process gradient of
the concatenated batch, and the largest difference of the parameters across ranks after a step.
"""
import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

spec = importlib.util.spec_from_file_location("ddp_stage", Path(sys.argv[1]))
stage = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stage)

rank, world_size, _ = stage.init_distributed()
config = stage.GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32)
tokens = torch.randint(0, 256, (2 * world_size, 17), generator=torch.Generator().manual_seed(1))
x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

torch.manual_seed(0)
model = stage.GPT(config)
wrapped = DDP(model)  # keep a reference: the reducer that all-reduces lives in this object
_, loss = wrapped(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])  # this rank's share
loss.backward()

torch.manual_seed(0)
reference = stage.GPT(config)  # the same initial weights, the whole batch in one process
_, reference_loss = reference(x, y)
reference_loss.backward()
grad_diff = max((p.grad - r.grad).abs().max().item()
                for p, r in zip(model.parameters(), reference.parameters(), strict=True))

torch.optim.AdamW(model.parameters(), lr=1e-2).step()
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
everyone = [torch.empty_like(flat) for _ in range(world_size)]
dist.all_gather(everyone, flat)
param_diff = max((other - everyone[0]).abs().max().item() for other in everyone)
print(json.dumps({"world_size": world_size, "max_grad_diff": grad_diff,
                  "max_param_diff_across_ranks": param_diff}))
dist.destroy_process_group()
