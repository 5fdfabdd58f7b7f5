"""Train a GPT-2 language model with pipeline parallelism (torch.distributed.pipelining): "pp".

The model, GPT-2, is solutions/gpt.py: every stage trains it unchanged. Read this file top to
bottom: the data, the optimiser and its schedule, checkpoints, then the training loop. Every later
stage (DDP, FSDP, tensor and pipeline parallelism) is a small diff on it.

    python -m coursekit data prepare --source builtin --out data/builtin
    python -m coursekit torchrun --nproc 2 solutions/train_gpt2_pp.py --schedule 1f1b

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
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.utils.checkpoint import checkpoint

from coursekit import KitError, distributed, faults, memory, perf, presets, runs, tracking, training
from coursekit.watchdog import StepWatch
from solutions.gpt import GPT, GPTConfig, cross_entropy

STAGE = Path(__file__).stem.removeprefix("train_gpt2_")  # names the default run directory
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}  # torch's, by their --schedule names


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


def stage_blocks(n_layer, stage, n_stages):
    """The blocks pipeline stage ``stage`` holds: as even a split as can be, the extra ones on the
    earlier stages, as the last also runs the output head (in a small GPT, more than the blocks)."""
    base, extra = divmod(n_layer, n_stages)  # the first `extra` stages hold base + 1 blocks
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def keep_stage(model, stage, n_stages):
    """Delete what this stage does not hold, as torchtitan does: every rank built the whole model
    from the same seed, and what remains keeps its name (checkpoints stay readable)."""
    kept = stage_blocks(model.config.n_layer, stage, n_stages)
    for index in list(model.transformer.h):
        if int(index) not in kept:
            del model.transformer.h[index]
    if stage > 0:
        model.transformer.wte = model.transformer.wpe = None
    if stage < n_stages - 1:
        model.transformer.ln_f = model.lm_head = None
    return model


def all_reduce_tied_gradient(model, group):
    """Weight tying across stages, Megatron-LM's way: the first stage's embedding and the last
    stage's head are copies of one matrix; summing their gradients keeps them equal."""
    for module in (model.transformer.wte, model.lm_head):  # ranks 0 and N-1 hold one each
        if module is not None and group is not None:
            dist.all_reduce(module.weight.grad, group=group)


def clip_grad_norm(model, max_norm):
    """Clip by the norm over every stage's gradients: the sum of each stage's squared norm, the
    tied matrix counted once (the last stage's copy left out; one stage lists it as wte)."""
    grads = [p.grad for name, p in model.named_parameters() if name != "lm_head.weight"]
    squared = torch.nn.utils.get_total_norm(grads) ** 2
    dist.all_reduce(squared)
    norm = squared.sqrt()
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)
    return norm


def run_pipeline(run, stage, x, y, precision):
    """A minibatch through the schedule's step (train) or eval in M microbatches, for the losses
    only (not the last stage's logits of every microbatch): N x the mean loss on the last of the
    N stages, 0 on the others; averaged over the ranks (all_reduce_mean), the loss."""
    losses = []
    run(*([x] if stage.is_first else []), target=y if stage.is_last else None, losses=losses,
        return_outputs=False)
    if not losses:
        return torch.zeros((), device=x.device)
    mean_loss = torch.stack(losses).detach().mean() / precision.scaler.get_scale()  # unscaled
    return mean_loss * dist.get_world_size()


@torch.no_grad()
def evaluate(model, schedule, stage, val_loader, eval_steps, device, precision):
    model.eval()
    val_loader.load_state_dict({"shard": 0, "offset": 0, "epoch": 0})  # same batches every time
    total = 0.0
    for _ in range(eval_steps):
        x, y = val_loader.next_batch()
        total += run_pipeline(schedule.eval, stage, x.to(device), y.to(device), precision)
    model.train()
    return distributed.all_reduce_mean(total / eval_steps).item()


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
    parser.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b",
                        help="order of the microbatches' forward and backward passes")
    return training.parse_args(parser, argv)


def main(argv=None):
    args = parse_args(argv)
    distributed.check_pipeline_schedules()
    torch.manual_seed(args.seed)
    # this process's rank, the number of processes and its device: its GPU, or the CPU
    rank, world_size, device = distributed.setup(args.device)
    precision = training.prepare_device(device, args.precision)

    preset = presets.get_preset(args.preset)
    config = GPTConfig(vocab_size=preset.vocab_size, block_size=preset.seq_len,
                       n_layer=args.n_layer, n_head=preset.n_head, n_embd=preset.n_embd)
    if world_size > config.n_layer:  # every stage needs at least one block
        raise KitError(f"{world_size} processes for a {config.n_layer}-block model: a pipeline has "
                       f"one stage per process and at least a block per stage")
    B, T = args.micro_batch, args.seq_len
    M = args.batch_tokens // (B * T)  # microbatches: what grad_accum was in the fsdp stage
    if args.schedule == "1f1b" and M < world_size:  # torch's Schedule1F1B refuses
        raise KitError(f"--schedule 1f1b needs a microbatch per stage: {M} microbatches < "
                       f"{world_size} stages (lower --micro-batch, or --schedule gpipe)")
    model = GPT(config).to(device)  # the whole model on every rank, from the same seed
    n_params = sum(p.numel() for p in model.parameters())  # the whole model's, before the split
    keep_stage(model, rank, world_size)
    if args.activation_checkpointing:
        apply_activation_checkpointing(model)
    if args.compile:  # block by block, so FSDP's gathers stay between compiled regions
        for block in model.transformer.h.values():
            block.compile()
    model.forward = precision.in_autocast(model.forward)  # not backward, which the schedule runs
    stage = PipelineStage(model, rank, world_size, device)  # stage `rank`: sends to rank + 1
    # scale_grads: the schedule divides the gradients of M microbatch means by M (as grad_accum)
    schedule = SCHEDULES[args.schedule](stage, M, scale_grads=True,
                                         loss_fn=precision.scaled(cross_entropy))
    tied_group = dist.new_group([0, world_size - 1]) if world_size > 1 else None  # wte, lm_head

    # every stage reads the same whole minibatch (the first uses its inputs, the last its targets)
    train_loader = TokenShardLoader(args.data, "train", M * B, T)
    val_loader = TokenShardLoader(args.data, "val", M * B, T)
    val_passes = math.ceil(args.eval_steps / M)  # whole pipeline passes of M microbatches
    optimizer = configure_optimizer(model, args.lr, args.weight_decay, device)

    run_config = training.run_config(args, preset, config, n_params, device, precision,
                                     microbatches=M, world_size=world_size)
    blocks = [list(stage_blocks(config.n_layer, r, world_size)) for r in range(world_size)]
    print(f"pipeline: {world_size} stages, schedule {args.schedule}, {M} microbatches of {B} "
          f"samples; the blocks of each stage: {blocks}")
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
        x, y = training.to_device(train_loader.next_batch(), device)
        loss_sum = run_pipeline(schedule.step, stage, x, y, precision)
        all_reduce_tied_gradient(model, tied_group)
        precision.scaler.unscale_(optimizer)  # fp16: the true gradients, to clip them
        grad_norm = clip_grad_norm(model, preset.grad_clip)
        precision.scaler.step(optimizer)  # fp16: skipped if a gradient overflowed on any stage
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
            record["val_loss"] = evaluate(model, schedule, stage, val_loader, val_passes, device,
                                          precision)
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
    if args.sample_tokens and done == args.max_steps:  # every rank: each holds a stage
        model.eval()
        generate = functools.partial(model.generate, last_logits=training.pipelined_last_logits(
            model, device))
        training.write_sample(run_dir, args, device, generate, write=rank == 0)
    tracker.finish(run_dir, runs.latest_checkpoint(run_dir))
    distributed.finish()
    return 0


if __name__ == "__main__":
    sys.exit(faults.run(main))  # a bad value, a lost peer, a full disk: one line, no traceback
