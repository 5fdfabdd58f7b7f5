"""Run under torchrun: one step of the pp stage's pipeline against a single process, for each
schedule named (one launch checks them all).

    torchrun --nproc-per-node=2 pp_check.py solutions/train_gpt2_pp.py gpipe,1f1b MICROBATCHES

Every rank builds the same small GPT from the same seed and keeps its stage; the whole model in
one process is the reference (the same batch, the loss its mean). For each schedule rank 0
prints one JSON line: the largest differences of the loss, the last stage's logits, every
parameter's gradient (by name, after the tied gradients are summed) and the global gradient
norm, and which parameter names the stages cover between them.
"""
import importlib.util
import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

spec = importlib.util.spec_from_file_location("pp_stage", Path(sys.argv[1]))
stage_module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stage_module)
schedule_names, microbatches = sys.argv[2].split(","), int(sys.argv[3])

dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a missed collective fails fast
rank, world_size = dist.get_rank(), dist.get_world_size()
config = stage_module.GPTConfig(vocab_size=256, block_size=16, n_layer=4, n_head=2, n_embd=32)
tokens = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(1))
x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

torch.manual_seed(0)
reference = stage_module.GPT(config)  # the same initial weights, the whole model in one process
reference_logits = reference(x)
reference_loss = stage_module.cross_entropy(reference_logits, y)
reference_loss.backward()
reference_grads = {name: p.grad for name, p in reference.named_parameters(remove_duplicate=False)}
reference_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])


def check(schedule_name):
    """One pipeline step with this schedule, from fresh weights: rank 0 prints its report."""
    torch.manual_seed(0)
    model = stage_module.keep_stage(stage_module.GPT(config), rank, world_size)
    stage = PipelineStage(model, rank, world_size, torch.device("cpu"))
    schedule = stage_module.SCHEDULES[schedule_name](stage, microbatches,
                                                     loss_fn=stage_module.cross_entropy)
    losses = []
    logits = schedule.step(*([x] if stage.is_first else []), target=y if stage.is_last else None,
                           losses=losses)
    tied_group = dist.new_group([0, world_size - 1]) if world_size > 1 else None
    stage_module.all_reduce_tied_gradient(model, tied_group)
    grad_norm = stage_module.clip_grad_norm(model, max_norm=1e9)  # the norm; clips nothing
    loss = torch.stack(losses).mean() if losses else torch.zeros(())
    dist.broadcast(loss, src=world_size - 1)  # the last stage's

    differences = torch.tensor([
        (loss - reference_loss).abs().item(),
        (logits - reference_logits).abs().max().item() if stage.is_last else 0.0,
        max((p.grad - reference_grads[name]).abs().max().item()
            for name, p in model.named_parameters(remove_duplicate=False)),
        (grad_norm - reference_norm).abs().item(),
    ])
    dist.all_reduce(differences, op=dist.ReduceOp.MAX)
    names = [None] * world_size
    dist.all_gather_object(names, [name for name, _ in model.named_parameters()])
    covered = sorted(name for stage_names in names for name in stage_names)
    if rank == 0:
        print(json.dumps({
            "world_size": world_size, "schedule": schedule_name, "microbatches": microbatches,
            "max_loss_diff": differences[0].item(), "max_logits_diff": differences[1].item(),
            "max_grad_diff": differences[2].item(), "grad_norm_diff": differences[3].item(),
            "names_covered_once": covered == sorted(set(covered)),
            "names_missing": sorted(set(reference_grads) - set(covered)),
        }), flush=True)


for name in schedule_names:
    check(name)
dist.destroy_process_group()
