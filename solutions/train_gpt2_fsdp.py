"""Train a GPT-2 language model with fully sharded data parallelism (FSDP2): the "fsdp" stage.

Read it top to bottom: the model, the data, the optimiser and its schedule, checkpoints, then the
training loop. Every later stage (DDP, Lightning, FSDP, ...) is a small diff on this file.

    python -m coursekit data prepare --source builtin --out data/builtin
    torchrun --standalone --nproc-per-node=2 solutions/train_gpt2_fsdp.py --preset tiny

The words of the course, as this script uses them:
    sample      one sequence of T tokens; the model predicts each next token
    microbatch  B samples that go through one forward and backward pass together (memory-bound)
    minibatch   all the samples behind one optimiser step, on every device
    step        one optimiser update;   epoch: one pass over the training tokens
    identity    tokens seen = steps x minibatch x T
"""
import functools
import math
import os
import resource
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from coursekit import KitError, data, faults, launch, perf, presets, runs, tracking
from coursekit.cli import ArgumentParser, non_negative_float, positive_float, positive_int

STAGE = Path(__file__).stem.removeprefix("train_gpt2_")  # names the default run directory


# ----------------------------------------------------------------------------------------------
# The model: GPT-2 (decoder-only transformer, pre-LayerNorm, learned positions, tied embeddings)
# ----------------------------------------------------------------------------------------------
@dataclass
class GPTConfig:
    vocab_size: int = presets.PADDED_VOCAB
    block_size: int = 1024  # longest sequence the position table covers
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_dim = config.n_embd // config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.scale_init_by_depth = True

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim); "-1" heads: a tensor-parallel shard works unchanged
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        # flash attention where the hardware has it; never materialises the T x T matrix
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's GELU
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.c_proj.scale_init_by_depth = True

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))  # residual stream: blocks add to it, never replace it
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying: one matrix in and out
        self.apply(self._init_weights)

    def _init_weights(self, module):
        # GPT-2's initialisation; projections into the residual stream are scaled by
        # 1/sqrt(2 n_layer) so the stream's variance does not grow with depth
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "scale_init_by_depth", False):
                std *= (2 * self.config.n_layer) ** -0.5
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=0.8, top_k=50, generator=None):
        """Continue ``idx`` by sampling from the top_k most likely tokens, one token at a time."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size:])
            logits = logits[:, -1, :] / temperature
            top_values, _ = torch.topk(logits, top_k)
            logits[logits < top_values[:, [-1]]] = -float("inf")
            probs = F.softmax(logits, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx


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
# Device, precision, evaluation, checkpoints
# ----------------------------------------------------------------------------------------------
def init_distributed():
    """Where this process is, as torchrun or Slurm's `srun python` says."""
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))
    world_size = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", 1)))
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0)))
    sys.stdout = open(os.devnull, "w") if rank else sys.stdout  # one log: rank 0's
    # gloo for CPU tensors, and NCCL for GPU tensors where there are GPUs ("gloo" alone, not
    # "cpu:gloo", on CPU: torch 2.13 warns at exit about FSDP's groups otherwise)
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if world_size > 1:
        faults.init_process_group(backend, rank, world_size)  # at MASTER_ADDR:PORT
    else:  # a group of one, in memory: sharding and sharded checkpoints work the same way
        dist.init_process_group(backend, rank=0, world_size=1, store=dist.HashStore())
    print(f"{world_size} processes, backends {dist.get_backend_config()}")
    return rank, world_size, local_rank


def all_reduce_mean(tensor):
    if dist.is_initialized():  # gloo has no AVG: divide by the world size, then sum
        dist.all_reduce(tensor.div_(dist.get_world_size()), op=dist.ReduceOp.SUM)
    return tensor


def pick_device(requested, local_rank):
    if requested != "auto":
        return torch.device(requested)
    if torch.cuda.is_available():  # NVIDIA, and AMD GPUs through ROCm's cuda API
        if local_rank >= torch.cuda.device_count():
            raise KitError(f"local rank {local_rank} has no GPU: fewer processes, or --device cpu")
        torch.cuda.set_device(local_rank)  # one device per process
        return torch.device("cuda", local_rank)
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.device("xpu")
    return torch.device("cpu")


def autocast_for(device):
    """bf16 autocast on GPUs that have it (matmuls in bf16, weights and optimiser in fp32)."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16), "bf16 autocast"
    return nullcontext(), "fp32"


def apply_activation_checkpointing(model):
    """Keep only each block's input in forward; recompute its activations during backward."""
    for block in model.transformer.h:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def apply_fsdp(model, device, world_size, cpu_offload):
    """Shard every block, then the root (embeddings, final norm): each rank keeps 1/N of every
    parameter, gradient and optimiser state, and all-gathers a block's parameters just before
    the block runs, in forward and again in backward."""
    settings = {"mesh": init_device_mesh(device.type, (world_size,))}
    if device.type == "cuda" and torch.cuda.is_bf16_supported():  # gather in bf16, reduce in fp32
        settings["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                     reduce_dtype=torch.float32)
    if cpu_offload:  # shards live in CPU memory; pinned pages make the copies to a GPU fast
        settings["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for block in model.transformer.h:
        fully_shard(block, **settings)
    fully_shard(model, **settings)


def forward_backward(model, x, y, grad_accum, autocast):
    """One microbatch: forward, then backward of its share of the minibatch's mean loss."""
    with autocast:
        _, loss = model(x, y)
    loss = loss / grad_accum  # gradients of the minibatch mean, not a sum of means
    loss.backward()
    return loss.detach()


@torch.no_grad()
def evaluate(model, val_loader, eval_steps, device, autocast):
    model.eval()
    val_loader.load_state_dict({"shard": 0, "offset": 0, "epoch": 0})  # same batches every time
    total = 0.0
    for _ in range(eval_steps):
        x, y = val_loader.next_batch()
        with autocast:
            _, loss = model(x.to(device), y.to(device))
        total += loss.detach()
    model.train()
    return (total / eval_steps).item()


def rng_state(device):
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state, device):
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def training_state(model, optimizer, train_loader, device):
    """What a checkpoint holds. The model and optimiser entries are this rank's shards."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state,
            "train_loader": train_loader.state_dict(), "rng": rng_state(device)}


def save_checkpoint(run_dir, step, model, optimizer, train_loader, device):
    """Every rank writes its own shards in parallel (torch.distributed.checkpoint); rank 0
    publishes the checkpoint once the last shard is on disk."""
    state = training_state(model, optimizer, train_loader, device)
    with runs.room_for_checkpoint(run_dir, step, runs.state_bytes(state)):
        dcp.save(state, checkpoint_id=runs.unpublished_checkpoint(run_dir, step))
        if dist.get_rank() == 0:
            runs.publish_checkpoint(run_dir, step)
    dist.barrier()


def resume(run_dir, model, optimizer, train_loader, device):
    """Restore the newest checkpoint, if any; return the number of steps already done. It may
    come from any number of ranks: each rank reads the parts of the shards it now owns."""
    path = runs.checkpoint_to_resume(run_dir)
    if path is None:
        print(f"no checkpoint in {run_dir}: starting from step 0")
        return 0
    state = training_state(model, optimizer, train_loader, device)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    train_loader.load_state_dict(state["train_loader"])
    set_rng_state(state["rng"], device)
    step = runs.checkpoint_step(path)
    print(f"resumed from {path} at step {step}")
    return step


def local_bytes(tensors):
    return sum(t.to_local().nbytes if isinstance(t, DTensor) else t.nbytes for t in tensors)


MEMORY_PARTS = ("params", "grads", "optimizer", "peak")  # bytes


def memory_report(model, optimizer, device):
    """Bytes this rank holds in its shards of the parameters, gradients and optimiser state,
    and its peak memory: the CUDA allocator's on a GPU, the resident set size on a CPU."""
    params = list(model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    if device.type == "cuda":
        peak, peak_kind = torch.cuda.max_memory_allocated(device), "CUDA allocated"
    else:
        peak, peak_kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "RSS"
    return {"params": local_bytes(params),
            "grads": local_bytes(p.grad for p in params if p.grad is not None),
            "optimizer": local_bytes(state), "peak": peak, "peak_kind": peak_kind}


def report_memory(run_dir, model, optimizer, device):
    """Every rank's memory report, printed and written to memory.json by rank 0."""
    mine = memory_report(model, optimizer, device)
    every_rank = launch.numbers_of_every_rank([mine[part] for part in MEMORY_PARTS], device)
    reports = [{**dict(zip(MEMORY_PARTS, numbers)), "peak_kind": mine["peak_kind"]}
               for numbers in every_rank]  # every rank has the same kind of device
    for rank, r in enumerate(reports):
        print(f"rank {rank} | params {r['params'] / 2**20:.2f} MiB | grads "
              f"{r['grads'] / 2**20:.2f} MiB | optimizer {r['optimizer'] / 2**20:.2f} MiB | "
              f"peak {r['peak'] / 2**20:.1f} MiB ({r['peak_kind']})")
    if dist.get_rank() == 0:
        runs.write_json_atomic(run_dir / "memory.json", reports)


class StopSignal:
    """Slurm sends SIGUSR1 (with --signal) or SIGTERM before it stops a job: finish the step,
    checkpoint, exit 0, and let the requeued job resume."""

    def __init__(self):
        self.received = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self.handle)

    def handle(self, signum, frame):
        self.received = signal.Signals(signum).name


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------
def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=list(presets.PRESETS), default=None,
                        help="model and batch sizes (default: gpt2-124m on a GPU, tiny on a CPU)")
    parser.add_argument("--data", help="prepared data directory (default: the preset's)")
    parser.add_argument("--out", help=f"run directory (default: runs/{STAGE}-<preset>)")
    parser.add_argument("--max-steps", type=positive_int, help="optimiser steps (schedule length)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the run directory's newest checkpoint, if it has one")
    parser.add_argument("--micro-batch", type=positive_int, help="samples per forward pass (B)")
    parser.add_argument("--seq-len", type=positive_int, help="tokens per sample (T)")
    parser.add_argument("--batch-tokens", type=positive_int, help="tokens per optimiser step")
    parser.add_argument("--lr", type=positive_float, help="peak learning rate")
    parser.add_argument("--weight-decay", type=non_negative_float,
                        help="AdamW weight decay of the matrices")
    parser.add_argument("--n-layer", type=positive_int, help="transformer blocks (model depth)")
    parser.add_argument("--warmup-steps", type=int, help="linear warm-up steps")
    parser.add_argument("--eval-interval", type=positive_int, help="steps between validations")
    parser.add_argument("--eval-steps", type=positive_int, help="microbatches per validation")
    parser.add_argument("--ckpt-interval", type=positive_int, help="steps between checkpoints")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "xpu", "cpu"])
    parser.add_argument("--compile", action="store_true", help="torch.compile each block")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute each block's activations in backward: less memory, more time")
    parser.add_argument("--cpu-offload", action="store_true",
                        help="keep parameter, gradient and optimiser shards in CPU memory")
    parser.add_argument("--sample-tokens", type=int, default=64, help="tokens generated at the end")
    tracking.add_argument(parser)
    parser.add_argument("--prompt", default="The", help="start of the generated sample")
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except KitError as err:
        parser.error(str(err))
    return args


def check_args(args):
    """Fill preset defaults, then refuse combinations that cannot work, saying why."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise KitError("--device cuda: no CUDA/ROCm GPU is visible (use --device auto or cpu)")
    preset = presets.get_preset(args.preset or presets.default_preset_name(
        torch.cuda.is_available() and args.device in ("auto", "cuda")))
    args.preset = preset.name
    for name in ("data", "max_steps", "micro_batch", "seq_len", "batch_tokens", "lr",
                 "weight_decay", "n_layer", "eval_interval", "eval_steps", "ckpt_interval"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(preset, name))
    if args.warmup_steps is None:  # a short run warms up for a tenth of its steps at most
        args.warmup_steps = min(preset.warmup_steps, args.max_steps // 10)
    args.out = args.out or f"runs/{STAGE}-{preset.name}"
    if args.seq_len > preset.seq_len:
        raise KitError(f"--seq-len {args.seq_len} is longer than the {preset.name} model's "
                       f"context of {preset.seq_len} tokens")
    if not 0 <= args.warmup_steps <= args.max_steps:
        raise KitError(f"--warmup-steps {args.warmup_steps} must be between 0 and --max-steps "
                       f"({args.max_steps})")
    if args.batch_tokens % (args.micro_batch * args.seq_len):
        raise KitError(f"--batch-tokens {args.batch_tokens} is not a multiple of micro-batch x "
                       f"seq-len = {args.micro_batch} x {args.seq_len} = "
                       f"{args.micro_batch * args.seq_len}")
    if not 0 <= args.sample_tokens <= 4096:
        raise KitError(f"--sample-tokens {args.sample_tokens} must be between 0 and 4096")
    meta = data.read_meta(args.data)
    needed = args.micro_batch * args.seq_len + 1
    for split, info in meta["splits"].items():
        if info["tokens"] < needed:
            raise KitError(f"the {split} split of {args.data} has {info['tokens']:,} tokens, "
                           f"fewer than one microbatch needs ({needed:,}): lower --micro-batch "
                           f"or --seq-len, or prepare more data")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise KitError(f"--out {out} is a file, not a run directory")
    if runs.latest_checkpoint(out) is not None and not args.resume:
        raise KitError(f"{out} already holds a checkpoint: pass --resume to continue that run, "
                       "or choose another --out")


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(argv)
    rank, world_size, local_rank = init_distributed()
    torch.manual_seed(args.seed)
    device = pick_device(args.device, local_rank)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for any matmul left in fp32
    if device.type == "cpu":
        perf.keep_freed_cpu_memory()  # reuse freed tensors' pages instead of re-faulting them
    autocast, precision = autocast_for(device)

    preset = presets.get_preset(args.preset)
    config = GPTConfig(vocab_size=preset.vocab_size, block_size=preset.seq_len,
                       n_layer=args.n_layer, n_head=preset.n_head, n_embd=preset.n_embd)
    model = GPT(config).to(device)
    if args.activation_checkpointing:
        apply_activation_checkpointing(model)
    if args.compile:  # block by block, so FSDP's gathers stay between compiled regions
        for block in model.transformer.h:
            block.compile()
    apply_fsdp(model, device, world_size, args.cpu_offload)

    B, T = args.micro_batch, args.seq_len
    if args.batch_tokens % (B * T * world_size):
        raise KitError(f"--batch-tokens {args.batch_tokens} is not a multiple of B x T x processes")
    grad_accum = args.batch_tokens // (B * T * world_size)
    train_loader = TokenShardLoader(args.data, "train", B, T, rank, world_size)
    val_loader = TokenShardLoader(args.data, "val", B, T)
    optimizer = configure_optimizer(model, args.lr, args.weight_decay, device)

    flops_per_token = perf.flops_per_token(config.n_layer, config.n_embd, T, config.vocab_size)
    peak, peak_source = perf.peak_flops(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"device {device} ({perf.device_name(device)}) | {precision} | "
          f"compile {'on' if args.compile else 'off'} | peak {peak / 1e12:.2f} TFLOP/s "
          f"({peak_source})")
    print(f"model {preset.name}: {n_params:,} parameters, {config.n_layer} layers, "
          f"{config.n_head} heads, {config.n_embd} wide, context {config.block_size}")
    print(f"sample = {T} tokens | microbatch = {B} samples | grad_accum = {grad_accum} | "
          f"minibatch = {args.batch_tokens // T} samples = {args.batch_tokens:,} tokens per step")
    print(f"{args.max_steps:,} steps x {args.batch_tokens:,} tokens = "
          f"{args.max_steps * args.batch_tokens:,} tokens = "
          f"{args.max_steps * args.batch_tokens / train_loader.total_tokens:.2f} epochs of "
          f"{train_loader.total_tokens:,} training tokens")

    run_dir = Path(args.out)
    runs.make_run_dir(run_dir)
    start_step = resume(run_dir, model, optimizer, train_loader, device) if args.resume else 0
    run_config = {
        "stage": STAGE, "args": vars(args), "preset": preset.as_dict(), "model": asdict(config),
        "parameters": n_params, "grad_accum": grad_accum, "world_size": world_size,
        "flops_per_token": flops_per_token, "peak_flops": peak, "peak_source": peak_source,
        "device": str(device), "device_name": perf.device_name(device), "precision": precision,
        "torch": torch.__version__,
    }
    if rank == 0:
        runs.start_run(run_dir, run_config, start_step)
    tracker = tracking.start(args.track, run_dir, resumed=start_step > 0)

    stop, done = StopSignal(), start_step
    for step in range(start_step, args.max_steps):
        t0 = time.perf_counter()
        lr = learning_rate(step, args.lr, args.warmup_steps, args.max_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=device)
        for micro in range(grad_accum):
            x, y = [t.to(device) for t in train_loader.next_batch()]
            # reduce-scatter gradients after the last microbatch only: less traffic, but every
            # rank holds whole gradients until then (sync every microbatch if memory is short)
            model.set_requires_gradient_sync(micro == grad_accum - 1)
            loss_sum += forward_backward(model, x, y, grad_accum, autocast)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), preset.grad_clip)
        grad_norm = grad_norm.full_tensor()  # the norm over every rank's shards
        optimizer.step()
        loss_value = all_reduce_mean(loss_sum).item()  # the whole minibatch's loss; waits too
        dt = time.perf_counter() - t0

        done = step + 1
        tokens_per_s = args.batch_tokens / dt
        record = {"step": done, "loss": loss_value, "lr": lr, "grad_norm": grad_norm.item(),
                  "ms": dt * 1000, "tok_per_s": tokens_per_s,
                  "mfu": perf.mfu(tokens_per_s / world_size, flops_per_token, peak),
                  "epoch": train_loader.epoch + train_loader.offset / train_loader.total_tokens}
        line = (f"step {done}/{args.max_steps} | loss {loss_value:.4f} | lr {lr:.1e} | "
                f"grad_norm {record['grad_norm']:.2f} | {record['ms']:.1f} ms | "
                f"{tokens_per_s:,.0f} tok/s | mfu {100 * record['mfu']:.1f}%")
        if done % args.eval_interval == 0 or done == args.max_steps:
            record["val_loss"] = evaluate(model, val_loader, args.eval_steps, device, autocast)
            line += f" | val {record['val_loss']:.4f}"
        print(line, flush=True)
        if rank == 0:
            runs.append_metrics(run_dir, record)
        tracker.log_step(record)

        # Slurm signals each task at its own moment: stop together once any rank has been told
        stopping = all_reduce_mean(torch.tensor(float(stop.received is not None))).item() > 0
        if done % args.ckpt_interval == 0 or done == args.max_steps or stopping:  # every rank
            save_checkpoint(run_dir, done, model, optimizer, train_loader, device)
        if stopping and done < args.max_steps:
            print(f"{stop.received} received: checkpoint saved at step {done}; "
                  "rerun with --resume to continue", flush=True)
            break

    report_memory(run_dir, model, optimizer, device)
    if args.sample_tokens and done == args.max_steps:  # every rank: forward needs their shards
        write_sample(model, run_dir, args, device, rank)
    dist.barrier()  # every rank's checkpoint shards and memory report are written
    tracker.finish(run_dir, runs.latest_checkpoint(run_dir))
    dist.destroy_process_group()
    return 0


def write_sample(model, run_dir, args, device, rank):
    encoding = data.gpt2_encoding()
    prompt = torch.tensor([encoding.encode_ordinary(args.prompt)], device=device)
    generator = torch.Generator(device=device).manual_seed(args.seed)  # leaves the global RNG alone
    model.eval()
    tokens = model.generate(prompt, args.sample_tokens, generator=generator)[0].tolist()
    text = encoding.decode([t for t in tokens if t < data.EOT_TOKEN])
    if rank == 0:
        (run_dir / "sample.txt").write_text(text + "\n")
        print(f"sample: {text!r}")


if __name__ == "__main__":
    sys.exit(faults.run(main))  # a bad value, a lost peer, a full disk: one line, no traceback
