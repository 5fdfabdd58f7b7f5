"""Run under torchrun: one forward and backward of the tp stage's model, tensor parallel in groups
of TP ranks and fully sharded across the groups, against the same model in a single process.

    python -m coursekit torchrun --nproc 4 tests/helpers/tp_check.py solutions/train_gpt2_tp.py 2

Prints (rank 0) one JSON line: the largest differences of the logits, of every parameter's
gradient (the tied embedding / lm_head matrix included) and of the loss, and whether the tied
matrix is still one parameter.
"""
import importlib.util
import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel

from coursekit import training

spec = importlib.util.spec_from_file_location("tp_stage", Path(sys.argv[1]))
stage = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stage)

tp = int(sys.argv[2])
dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a lost rank fails, never hangs
world_size = dist.get_world_size()
dp = world_size // tp
mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
config = stage.GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=32)
tokens = torch.randint(0, 256, (2 * dp, 17), generator=torch.Generator().manual_seed(1))
x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
share = slice(2 * mesh["dp"].get_local_rank(), 2 * mesh["dp"].get_local_rank() + 2)  # a TP group's

torch.manual_seed(0)
model = stage.GPT(config)
stage.apply_tp(model, mesh["tp"])
stage.apply_fsdp(model, mesh["dp"], False, training.prepare_device(torch.device("cpu"), "fp32"))
with loss_parallel():
    logits = model(x[share])
    loss = stage.cross_entropy(logits, y[share])
    loss.backward()
loss = stage.distributed.all_reduce_mean(loss.full_tensor().detach())  # the mean over the dp shares

torch.manual_seed(0)
reference = stage.GPT(config)  # the same initial weights, the whole batch in one process
reference_logits = reference(x)
reference_loss = stage.cross_entropy(reference_logits, y)
reference_loss.backward()

grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
reference_grads = {name: p.grad for name, p in reference.named_parameters()}
assert grads.keys() == reference_grads.keys(), (grads.keys(), reference_grads.keys())
report = {
    "world_size": world_size, "dp": dp, "tp": tp,
    "max_logits_diff": (logits.full_tensor() - reference_logits[share]).abs().max().item(),
    "max_grad_diff": max((grads[n] - reference_grads[n]).abs().max().item() for n in grads),
    "max_tied_grad_diff":  # the embedding's and lm_head's gradients, summed in one matrix
        (grads["transformer.wte.weight"] - reference.lm_head.weight.grad).abs().max().item(),
    "loss_diff": abs(loss.item() - reference_loss.item()),
    "tied": model.transformer.wte.weight is model.lm_head.weight,
}
if dist.get_rank() == 0:
    print(json.dumps(report))
dist.destroy_process_group()
