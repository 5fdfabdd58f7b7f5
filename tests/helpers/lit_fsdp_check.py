"""Run under torchrun: the lit stage's optimiser groups and gradient norm on a model sharded the
way Lightning's FSDP strategy shards it (torch's FullyShardedDataParallel, one unit per block,
use_orig_params), against the same model whole in this process.

    python -m coursekit torchrun --nproc 2 tests/helpers/lit_fsdp_check.py

Prints (rank 0) one JSON line: the parameters in the decayed group, summed over the ranks' shards
and whole, those a grouping by dimension would decay, and the two gradient norms.
"""
import json
from datetime import timedelta

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import FSDPStrategy
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from solutions import train_gpt2_lit as lit
from solutions.gpt import GPT, Block, GPTConfig, cross_entropy

dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a lost rank fails, never hangs
config = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=32)
tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1))
x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def model_and_norm(shard):
    torch.manual_seed(0)
    model = GPT(config)
    matrices = lit.matrix_names(model)  # as LitGPT takes them, before the Trainer wraps
    strategy = None
    if shard:
        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                         use_orig_params=True, device_id=torch.device("cpu"))
        strategy = FSDPStrategy()
    optimizer = lit.configure_optimizer(model, matrices, 1e-3, 0.1)
    cross_entropy(model(x), y).backward()
    decayed = torch.tensor(sum(p.numel() for p in optimizer.param_groups[0]["params"]))
    if shard:  # every rank's shards
        dist.all_reduce(decayed)
    return decayed.item(), lit.gradient_norm(model, strategy).item(), model


sharded_decayed, sharded_norm, sharded = model_and_norm(shard=True)
whole_decayed, whole_norm, whole = model_and_norm(shard=False)
by_dimension = sum(p.numel() for p in sharded.parameters() if p.dim() >= 2)
if dist.get_rank() == 0:
    print(json.dumps({"sharded_decayed": sharded_decayed, "whole_decayed": whole_decayed,
                      "sharded_by_dimension": by_dimension, "world_size": dist.get_world_size(),
                      "sharded_norm": sharded_norm, "whole_norm": whole_norm}))
dist.destroy_process_group()
