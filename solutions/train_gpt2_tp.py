"""Train GPT-2 with tensor parallelism in groups of --tp processes, FSDP2 across: the "tp" stage.

The model, GPT-2, is solutions/gpt.py: every stage trains it unchanged. Read this file top to
bottom: the data, the optimiser and its schedule, checkpoints, then the training loop. Every later
stage (DDP, FSDP, tensor and pipeline parallelism) is a small diff on it.

    python -m coursekit data prepare --source builtin --out data/builtin
    python -m coursekit torchrun --nproc 4 solutions/train_gpt2_tp.py --preset tiny --tp 2

The words of the course, as this script uses them:
    sample      one sequence of T tokens; the model predicts each next token
    microbatch  B samples that go through one forward and backward pass together (memory-bound)
    minibatch   all the samples behind one optimiser step, on every device
    step        one optimiser update;   epoch: one pass over the training tokens
    identity    tokens seen = steps x minibatch x T
"""
import functools
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)
from torch.utils.checkpoint import checkpoint

from coursekit import KitError, distributed, faults, memory, perf, presets, runs, tracking, training
from coursekit.watchdog import StepWatch
from solutions.gpt import GPT, GPTConfig, cross_entropy

STAGE = Path(__file__).stem.removeprefix("train_gpt2_")  # names the default run directory


# ----------------------------------------------------------------------------------------------
# Data: microbatches read in order from the token shards
# ----------------------------------------------------------------------------------------------
class TokenShardLoader:
    """Serves (inputs, targets) microbatches of B samples x T tokens from ``{split}_*.npy``.

    Targets are the inputs shifted by one token. The position (shard, offset, epoch) goes into
    checkpoints, so a resumed run sees exactly the batches the interrupted one would have seen.
    """

    def __init__(self, data_dir, split, B, T, rank=0, world_size=1):
        self.paths = sorted(Path(data_dir).glob(f"{split}_*.npy"))
        self.B, self.T = B, T
        self.rank, self.world_size = rank, world_size
        self.total_tokens = sum(len(np.load(p, mmap_mode="r")) for p in self.paths)
        self.load_state_dict({"shard": 0, "offset": 0, "epoch": 0})

    def load_state_dict(self, state):
        self.shard, self.offset, self.epoch = state["shard"], state["offset"], state["epoch"]
        self.tokens = np.load(self.paths[self.shard], mmap_mode="r")

    def state_dict(self):
        return {"shard": self.shard, "offset": self.offset, "epoch": self.epoch}

    def next_batch(self):
        n = self.B * self.T * self.world_size  # every rank's microbatch, side by side
        if self.offset + n + 1 > len(self.tokens):  # this shard is used up: on to the next
            self.shard = (self.shard + 1) % len(self.paths)
            self.epoch += self.shard == 0
            self.load_state_dict({"shard": self.shard, "offset": 0, "epoch": self.epoch})
        chunk = torch.from_numpy(self.tokens[self.offset:self.offset + n + 1].astype(np.int64))
        self.offset += n
        x, y = chunk[:-1].view(-1, self.B, self.T), chunk[1:].view(-1, self.B, self.T)
        return x[self.rank], y[self.rank]  # this rank's share


# ----------------------------------------------------------------------------------------------
# Optimiser and learning-rate schedule
# ----------------------------------------------------------------------------------------------
def configure_optimizer(model, lr, weight_decay, device):
    # decay the matrices (matmul weights, embeddings), not biases and LayerNorm gains
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    fused = device.type == "cuda"  # one kernel for all parameters instead of one per tensor
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def learning_rate(step, max_lr, warmup_steps, max_steps, min_lr_ratio=0.1):
    """Linear warm-up to max_lr, then cosine decay to min_lr_ratio x max_lr at max_steps."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    min_lr = min_lr_ratio * max_lr
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)


# ----------------------------------------------------------------------------------------------
# One step's forward and backward, evaluation, checkpoints
# ----------------------------------------------------------------------------------------------
def apply_activation_checkpointing(model):
    """Keep only each block's input in forward; recompute its activations during backward."""
    for block in model.transformer.h.values():
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def apply_tp(model, tp_mesh):
    """Split every matrix over the tp ranks, Megatron-style with sequence parallelism: between
    blocks a rank holds a slice of the sequence, which attention and MLP gather and scatter."""
    parallelize_module(model, tp_mesh, {
        # each rank looks up the tokens of its slice of the vocabulary; the sum is reduce-scattered
        "transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "transformer.wpe": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "transformer.ln_f": SequenceParallel(),
        # logits stay split over the vocabulary: loss_parallel() never gathers them
        "lm_head": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
    })
    for block in model.transformer.h.values():
        parallelize_module(block, tp_mesh, {
            "ln_1": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
            "attn.q_proj": ColwiseParallel(),  # whole heads per rank: view(B, T, -1, head_dim)
            "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(),
            "attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
            "ln_2": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
            "mlp.c_fc": ColwiseParallel(),
            "mlp.c_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
    model.transformer.wte.weight = model.lm_head.weight  # sharding made two copies: tie again


def apply_fsdp(model, mesh, cpu_offload, precision):
    """Shard every block, then the root (embeddings, final norm): each rank keeps 1/N of every
    parameter, gradient and optimiser state, and gathers a block's just before it runs."""
    settings = {"mesh": mesh}
    if precision.dtype is not None:  # gather in bf16 (or fp16), reduce in fp32
        settings["mp_policy"] = MixedPrecisionPolicy(param_dtype=precision.dtype,
                                                     reduce_dtype=torch.float32)
    if cpu_offload:  # shards live in CPU memory; pinned pages make the copies to a GPU fast
        settings["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
    for block in model.transformer.h.values():
        fully_shard(block, **settings)
    fully_shard(model, **settings, reshard_after_forward=False)  # kept gathered: used at both ends


def forward_backward(model, x, y, grad_accum, precision):
    """One microbatch: forward, then backward of its share of the minibatch's mean loss."""
    with precision.autocast:
        loss = cross_entropy(model(x), y)
    loss = loss / grad_accum  # gradients of the minibatch mean, not a sum of means
    precision.scaler.scale(loss).backward()  # fp16: scaled, so small gradients stay above 0
    return loss.detach()


@torch.no_grad()
def evaluate(model, val_loader, eval_steps, device, precision):
    model.eval()
    val_loader.load_state_dict({"shard": 0, "offset": 0, "epoch": 0})  # same batches every time
    total = 0.0
    for _ in range(eval_steps):
        x, y = val_loader.next_batch()
        with precision.autocast, loss_parallel():  # vocabulary-split logits: the loss of their slices
            loss = cross_entropy(model(x.to(device)), y.to(device))
        total += loss.detach()
    model.train()
    return (total / eval_steps).item()


# optimiser state under the parameters' names (as torchtitan keeps it), not positional ids
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def training_state(model, optimizer, train_loader, precision, device):
    """What a checkpoint holds. The model and optimiser entries are this rank's part of them."""
    model_state, optimizer_state = get_state_dict(model, optimizer, options=STATE_DICT_OPTIONS)
    return {"model": model_state, "optimizer": optimizer_state,
            "train_loader": train_loader.state_dict(), **training.loop_state(precision, device)}


def save_checkpoint(run_dir, step, model, optimizer, train_loader, precision, device):
    """Every rank writes its part in parallel (torch.distributed.checkpoint); rank 0 publishes."""
    state = training_state(model, optimizer, train_loader, precision, device)
    with runs.room_for_checkpoint(run_dir, step, runs.state_bytes(state)):
        dcp.save(state, checkpoint_id=runs.unpublished_checkpoint(run_dir, step))
        if dist.get_rank() == 0:
            runs.publish_checkpoint(run_dir, step)
    dist.barrier()


def resume(run_dir, model, optimizer, train_loader, precision, device):
    """Restore the newest intact checkpoint, if any; return the number of steps already done."""
    path = runs.checkpoint_to_resume(run_dir)
    if path is None:
        print(f"no checkpoint in {run_dir}: starting from step 0")
        return 0
    state = training_state(model, optimizer, train_loader, precision, device)
    runs.load_sharded(state, path)  # its pickles read as data: no code in them runs
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"], options=STATE_DICT_OPTIONS)
    train_loader.load_state_dict(state["train_loader"])
    training.restore_loop_state(state, precision, device)
    step = runs.checkpoint_step(path)
    print(f"resumed from {path} at step {step}")
    return step


# ----------------------------------------------------------------------------------------------
# Command line and training
# ----------------------------------------------------------------------------------------------
def parse_args(argv=None):
    parser = training.argument_parser(__doc__, STAGE)
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute each block's activations in backward: less memory, more time")
    parser.add_argument("--cpu-offload", action="store_true",
                        help="keep parameter, gradient and optimiser shards in CPU memory")
    parser.add_argument("--tp", type=training.positive_int,
                        help="tensor-parallel group size (default: the processes per node)")
    return training.parse_args(parser, argv, check=check_tp)


def check_tp(args, preset):
    """--tp (default: a node's processes; TP talks at every layer) must divide heads and tokens."""
    world_size, seq_len = distributed.place()[1], args.seq_len
    args.tp = args.tp or distributed.processes_per_node()
    allowed = [n for n in range(1, world_size + 1)
               if world_size % n == preset.n_head % n == seq_len % n == 0]
    if args.tp not in allowed:
        raise KitError(f"--tp {args.tp} must divide the number of processes ({world_size}), heads "
                       f"({preset.n_head}), tokens ({seq_len}): choose from {str(allowed)[1:-1]}")


def generate_tp(model, tp):
    """Sampling through the tensor-parallel model, whose logits are split over the vocabulary."""
    def last_logits(context):  # padded to a multiple of tp tokens: sequence parallelism splits it
        logits = model(torch.nn.functional.pad(context, (0, -context.shape[1] % tp)))
        return logits.full_tensor()[:, context.shape[1] - 1, :]
    return functools.partial(model.generate, last_logits=last_logits)


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    # this process's rank, the number of processes and its device: its GPU, or the CPU
    rank, world_size, device = distributed.setup(args.device)
    precision = training.prepare_device(device, args.precision)

    preset = presets.get_preset(args.preset)
    config = GPTConfig(vocab_size=preset.vocab_size, block_size=preset.seq_len,
                       n_layer=args.n_layer, n_head=preset.n_head, n_embd=preset.n_embd)
    model = GPT(config).to(device)
    if args.activation_checkpointing:
        apply_activation_checkpointing(model)
    if args.compile:  # block by block, so FSDP's gathers stay between compiled regions
        for block in model.transformer.h.values():
            block.compile()
    dp = world_size // args.tp  # data parallel across TP groups of tp consecutive ranks (a node)
    mesh = init_device_mesh(device.type, (dp, args.tp), mesh_dim_names=("dp", "tp"))
    mesh._flatten()  # a dp x tp group too: the gradient norm's sum in one all-reduce, not two
    print(f"mesh dp={dp} x tp={args.tp}")
    apply_tp(model, mesh["tp"])  # first: FSDP then shards each rank's tensor-parallel slices
    apply_fsdp(model, mesh["dp"], args.cpu_offload, precision)

    B, T = args.micro_batch, args.seq_len
    grad_accum = training.batch_split(args, dp)  # the ranks of a TP group share each microbatch
    train_loader = TokenShardLoader(args.data, "train", B, T, mesh["dp"].get_local_rank(), dp)
    val_loader = TokenShardLoader(args.data, "val", B, T)
    optimizer = configure_optimizer(model, args.lr, args.weight_decay, device)

    n_params = sum(p.numel() for p in model.parameters())
    run_config = training.run_config(args, preset, config, n_params, device, precision,
                                     grad_accum=grad_accum, world_size=world_size)
    training.print_banner(run_config, train_loader.total_tokens)
    run_dir = Path(args.out)
    runs.make_run_dir(run_dir)
    start_step = (resume(run_dir, model, optimizer, train_loader, precision, device)
                  if args.resume else 0)
    if rank == 0:
        runs.start_run(run_dir, run_config, start_step)
    tracker = tracking.start(args.track, run_dir, resumed=start_step > 0)

    stop, done = training.StopSignal(), start_step
    watch = StepWatch(run_dir, rank, model)  # per-rank step times, stacks if one hangs
    for step in range(start_step, args.max_steps):
        t0 = time.perf_counter()
        lr = learning_rate(step, args.lr, args.warmup_steps, args.max_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=device)
        for micro in range(grad_accum):
            x, y = training.to_device(train_loader.next_batch(), device)
            # reduce-scatter gradients after the last microbatch only: less traffic, but every
            # rank holds whole gradients until then (sync every microbatch if memory is short)
            model.set_requires_gradient_sync(micro == grad_accum - 1)
            with loss_parallel():  # cross-entropy of vocabulary-split logits, and its backward
                loss_sum += forward_backward(model, x, y, grad_accum, precision).full_tensor()
        precision.scaler.unscale_(optimizer)  # fp16: the true gradients, to clip them
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), preset.grad_clip)
        grad_norm = grad_norm.full_tensor()  # the norm over every rank's shards
        precision.scaler.step(optimizer)  # fp16: skipped if a gradient overflowed
        precision.scaler.update()
        # the minibatch's mean loss over every rank, and whether any rank was told to stop (Slurm
        # signals each task at its own moment): one all-reduce; .item() waits for it too
        totals = distributed.all_reduce_mean(torch.stack([loss_sum, stop.flag(device)]))
        loss_value, stopping = totals.tolist()
        dt = time.perf_counter() - t0
        watch.step_done(step + 1, t0)

        done = step + 1
        tokens_per_s = args.batch_tokens / dt
        record = {"step": done, "loss": loss_value, "lr": lr, "grad_norm": grad_norm.item(),
                  "ms": dt * 1000, "tok_per_s": tokens_per_s,
                  "mfu": perf.mfu(tokens_per_s / world_size, run_config["flops_per_token"],
                                  run_config["peak_flops"]),
                  "epoch": train_loader.epoch + train_loader.offset / train_loader.total_tokens}
        if done % args.eval_interval == 0 or done == args.max_steps:
            record["val_loss"] = evaluate(model, val_loader, args.eval_steps, device, precision)
        print(training.step_line(record, args, step == start_step), flush=True)
        if rank == 0:
            runs.append_metrics(run_dir, record)
        tracker.log_step(record)
        training.stop_if_diverged(record, run_dir, precision)  # before a checkpoint keeps NaNs

        if done % args.ckpt_interval == 0 or done == args.max_steps or stopping:  # every rank
            save_checkpoint(run_dir, done, model, optimizer, train_loader, precision, device)
        if stopping and done < args.max_steps:
            print(stop.stopped_line(done), flush=True)
            break

    memory.report(run_dir, model, optimizer, device)
    if args.sample_tokens and done == args.max_steps:  # every rank: forward needs their shards
        model.eval()
        training.write_sample(run_dir, args, device, generate_tp(model, args.tp), write=rank == 0)
    tracker.finish(run_dir, runs.latest_checkpoint(run_dir))
    distributed.finish()
    return 0


if __name__ == "__main__":
    sys.exit(faults.run(main))  # a bad value, a lost peer, a full disk: one line, no traceback
