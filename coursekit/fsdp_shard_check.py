"""The check of lesson 04's exercise 4: your `shard_model`, run on every rank of a small job,
against one process that trains the same model on all the ranks' batches at once. It lives in the
kit, not beside the lesson, so that grading runs the instructor's copy (the grading sandbox shows
a submission's folder and the kit, coursekit/sandbox.py).

    torchrun --nnodes=1 --nproc-per-node=2 --master-addr=127.0.0.1 --master-port=P \
        -m coursekit.fsdp_shard_check ANSWER.py

ANSWER.py holds the function `shard_model(model, mesh)`; it may use `torch` and `fully_shard`
without importing them. The model is a small stack: a token embedding (`embed`), BLOCKS blocks
(`blocks`, an nn.ModuleList) and an output head (`head`). Every rank shards it with the answer,
then takes STEPS SGD steps on a batch of its own, while forward hooks note how many blocks hold
their whole weights (gathered) as each block runs. Rank 0 then trains the same model in one process
on every rank's batch of each step, and prints one JSON line: which modules are FSDP units, the
most blocks gathered at once, the largest difference between the two models' parameters, and the
answer's error, if it raised one.
"""
import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from coursekit import distributed, exercise
from solutions import train_gpt2_fsdp

BLOCKS, WIDTH, VOCAB, TOKENS, STEPS = 4, 16, 32, 8, 2
TIMEOUT = timedelta(seconds=60)  # an answer that leaves a rank waiting fails within a minute


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.mlp = torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.tanh(self.mlp(self.norm(x)))


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def load_answer(path):
    namespace = {"torch": torch, "fully_shard": fully_shard}
    exec(compile(open(path).read(), path, "exec"), namespace)
    return namespace["shard_model"]


def make_model():
    torch.manual_seed(0)  # the same starting weights in every process
    return Stack()


def batch(step, rank):
    """(tokens, targets) of ``rank`` at ``step``, the same in every process."""
    numbers = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (2, TOKENS + 1), generator=numbers)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model, tokens, targets):
    return torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def gathered(block):
    """Whether ``block`` holds its whole weights now: FSDP keeps a sharded parameter as a DTensor
    and swaps in the plain, whole tensor while the block's unit is gathered."""
    return not isinstance(next(block.parameters()), DTensor)


def count_gathered(model):
    """A list that forward hooks fill, as each block runs, with how many blocks are gathered."""
    counts = []
    for block in model.blocks:
        block.register_forward_hook(
            lambda *_: counts.append(sum(gathered(b) for b in model.blocks)))
    return counts


def train_with_answer(shard_model, rank, mesh):
    """(the model trained, its FSDP units, the most blocks gathered at once, its error or None)."""
    model = make_model()
    counts = count_gathered(model)
    try:
        with exercise.own_work(train_gpt2_fsdp.apply_fsdp):  # the stage's: not an answer
            model = shard_model(model, mesh) or model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(STEPS):
            optimizer.zero_grad()
            loss_of(model, *batch(step, rank)).backward()
            optimizer.step()
    except Exception as error:  # reported, not raised: the answer's mistake is the result
        return model, [], 0, f"{type(error).__name__}: {error}"
    units = [name or "(the whole model)" for name, module in model.named_modules()
             if isinstance(module, FSDPModule)]
    return model, units, max(counts, default=0), None


def train_in_one_process(world_size):
    """The model of one process that takes each step on every rank's batch."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        pairs = [batch(step, rank) for rank in range(world_size)]
        optimizer.zero_grad()
        tokens, targets = (torch.cat(part) for part in zip(*pairs))
        loss_of(model, tokens, targets).backward()
        optimizer.step()
    return model


def whole(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def main():
    rank, world_size, _ = distributed.place()
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=TIMEOUT)
    mesh = init_device_mesh("cpu", (world_size,))
    trained, units, most_gathered, error = train_with_answer(load_answer(sys.argv[1]), rank, mesh)
    # every rank takes part in gathering the sharded parameters, whatever the answer did
    parameters = [whole(p.detach()) for p in trained.parameters()] if error is None else []
    if rank == 0:
        difference = max(((mine - theirs).abs().max().item() for mine, theirs in
                          zip(parameters, train_in_one_process(world_size).parameters())),
                         default=None)
        print(json.dumps({"units": units, "blocks": BLOCKS, "most_blocks_gathered": most_gathered,
                          "largest_difference": difference, "error": error}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
