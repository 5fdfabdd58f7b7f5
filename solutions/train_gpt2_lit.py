"""Train a GPT-2 language model with PyTorch Lightning: the "lit" stage.

Read it top to bottom: the model, the data, the optimiser and its schedule, checkpoints, then the
training loop. Every later stage (DDP, Lightning, FSDP, ...) is a small diff on this file.

    python -m coursekit data prepare --source builtin --out data/builtin
    python solutions/train_gpt2_lit.py --preset tiny --devices 2          # one machine
    srun python solutions/train_gpt2_lit.py --devices 4 --num-nodes 2       # under Slurm

The words of the course, as this script uses them:
    sample      one sequence of T tokens; the model predicts each next token
    microbatch  B samples that go through one forward and backward pass together (memory-bound)
    minibatch   all the samples behind one optimiser step, on every device
    step        one optimiser update;   epoch: one pass over the training tokens
    identity    tokens seen = steps x minibatch x T
"""
import importlib.util
import math
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import grad_norm
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch.utils.data import DataLoader, TensorDataset

from coursekit import KitError, data, faults, perf, presets, runs, tracking
from coursekit.cli import ArgumentParser, non_negative_float, positive_float, positive_int

STAGE = Path(__file__).stem.removeprefix("train_gpt2_")  # names the default run directory
STRATEGIES = ["auto", "ddp", "ddp_notebook", "fsdp", "deepspeed_stage_1", "deepspeed_stage_2",
              "deepspeed_stage_3"]

# Lightning hints "prepend srun" whenever srun is on PATH. The hint matters in a Slurm job of
# several tasks started without srun (they would hang); outside Slurm, or in a one-task job such
# as a JupyterLab session, it is wrong, so it is silenced there.
if int(os.environ.get("SLURM_NTASKS", "1")) == 1:
    warnings.filterwarnings("ignore", "The `srun` command is available", PossibleUserWarning)


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

    def state_dict(self):  # Lightning saves it in its checkpoints, as it has these two methods
        return {"shard": self.shard, "offset": self.offset, "epoch": self.epoch}

    def __iter__(self):  # Lightning asks for batches with a for loop
        while True:
            yield self.next_batch()

    def __len__(self):  # microbatches per rank in an epoch; with a length, Lightning does not
        return self.total_tokens // (self.B * self.T * self.world_size)  # read ahead of the step

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
def configure_optimizer(model, lr, weight_decay):
    # decay the matrices (matmul weights, embeddings), not biases and LayerNorm gains
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    # not fused: Lightning clips the gradients itself, and refuses a fused optimizer on GPUs
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def learning_rate(step, max_lr, warmup_steps, max_steps, min_lr_ratio=0.1):
    """Linear warm-up to max_lr, then cosine decay to min_lr_ratio x max_lr at max_steps."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    min_lr = min_lr_ratio * max_lr
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)


# ----------------------------------------------------------------------------------------------
# The LightningModule: what to compute. The Trainer decides where, on how many devices, and runs
# the loop (accumulation, DDP's no_sync, clipping, precision, checkpoints, Slurm signals).
# ----------------------------------------------------------------------------------------------
class LitGPT(L.LightningModule):
    def __init__(self, config, args, preset, grad_accum):
        super().__init__()
        self.gpt = GPT(config)
        if args.compile:
            self.gpt.compile()  # in place: state_dict keys stay the same as without compile
        self.args, self.preset, self.grad_accum = args, preset, grad_accum
        self.run_config = None  # main() fills it in once the Trainer knows the devices
        self.run_dir = Path(args.out)
        self.pending = None  # the record of a step whose validation has not run yet
        self.tracker = tracking.Tracker()  # rank 0's logs to --track once training starts

    def train_dataloader(self):  # called once the processes exist: each knows its rank
        return TokenShardLoader(self.args.data, "train", self.args.micro_batch, self.args.seq_len,
                                self.global_rank, self.trainer.world_size)

    def val_dataloader(self):  # the same samples at every validation, shared out across ranks
        val_loader = TokenShardLoader(self.args.data, "val", self.args.micro_batch,
                                      self.args.seq_len)
        x, y = zip(*(val_loader.next_batch() for _ in range(self.args.eval_steps)))
        return DataLoader(TensorDataset(torch.cat(x), torch.cat(y)), self.args.micro_batch)

    def configure_optimizers(self):
        optimizer = configure_optimizer(self.gpt, self.args.lr, self.args.weight_decay)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: learning_rate(
            step, 1.0, self.args.warmup_steps, self.args.max_steps))  # a factor of --lr
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_train_start(self):
        if self.trainer.is_global_zero:  # after a resume, global_step is the checkpoint's step
            runs.start_run(self.run_dir, self.run_config, self.global_step)
            self.tracker = tracking.tracker_for(self.logger, self.run_dir,
                                                resumed=self.global_step > 0)

    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx % self.grad_accum == 0:  # the first microbatch of an optimiser step
            self.t0, self.loss_sum = time.perf_counter(), torch.zeros((), device=self.device)

    def training_step(self, batch, batch_idx):
        x, y = batch
        _, loss = self.gpt(x, y)
        self.loss_sum += loss.detach() / self.grad_accum  # Lightning scales the backward itself
        return loss

    def on_before_optimizer_step(self, optimizer):  # before Lightning clips: the raw norm
        self.grad_norm = grad_norm(self.gpt, norm_type=2)["grad_2.0_norm_total"]
        self.lr = optimizer.param_groups[0]["lr"]

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if (batch_idx + 1) % self.grad_accum:  # still accumulating: no optimiser step yet
            return
        loss = self.trainer.strategy.reduce(self.loss_sum, reduce_op="mean").item()
        dt = time.perf_counter() - self.t0
        tokens_per_s = self.args.batch_tokens / dt
        per_device = tokens_per_s / self.trainer.world_size
        record = {"step": self.global_step, "loss": loss, "lr": self.lr,
                  "grad_norm": self.grad_norm.item(), "ms": dt * 1000, "tok_per_s": tokens_per_s,
                  "mfu": perf.mfu(per_device, self.run_config["flops_per_token"],
                                  self.run_config["peak_flops"])}
        if self.global_step % self.args.eval_interval == 0:
            self.pending = record  # Lightning validates next; the record waits for val_loss
        else:
            self.log_step(record)

    def on_validation_epoch_start(self):
        self.val_sum = torch.zeros((), device=self.device)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        _, loss = self.gpt(x, y)
        self.val_sum += loss / len(self.trainer.val_dataloaders)  # this rank's batches

    def on_validation_epoch_end(self):
        if self.pending is not None:
            val_loss = self.trainer.strategy.reduce(self.val_sum, reduce_op="mean")
            self.pending["val_loss"] = val_loss.item()
            self.log_step(self.pending)

    def on_train_end(self):
        if self.pending is not None:  # the last step's validation did not run
            self.log_step(self.pending)

    def log_step(self, record):
        self.pending = None
        if not self.trainer.is_global_zero:
            return
        line = (f"step {record['step']}/{self.args.max_steps} | loss {record['loss']:.4f} | "
                f"lr {record['lr']:.1e} | grad_norm {record['grad_norm']:.2f} | "
                f"{record['ms']:.1f} ms | {record['tok_per_s']:,.0f} tok/s | "
                f"mfu {100 * record['mfu']:.1f}%")
        if "val_loss" in record:
            line += f" | val {record['val_loss']:.4f}"
        print(line, flush=True)
        runs.append_metrics(self.run_dir, record)
        self.tracker.log_step(record)


# ----------------------------------------------------------------------------------------------
# The Trainer: devices, strategy, precision, checkpoints
# ----------------------------------------------------------------------------------------------
def device_count(args):
    """Processes per node: --devices, or every visible GPU (one CPU process without a GPU)."""
    if args.devices != "auto":
        return args.devices
    return torch.cuda.device_count() if uses_gpu(args) else 1


def uses_gpu(args):
    return torch.cuda.is_available() and args.device in ("auto", "cuda")


def make_trainer(args, grad_accum):
    gpu = uses_gpu(args)
    bf16 = gpu and torch.cuda.is_bf16_supported()
    checkpoints = ModelCheckpoint(dirpath=Path(args.out) / "ckpt", filename="step_{step:08d}",
                                  auto_insert_metric_name=False, save_top_k=1, save_last="link",
                                  every_n_train_steps=args.ckpt_interval)
    try:
        return L.Trainer(
            accelerator="gpu" if gpu else "cpu", devices=device_count(args),
            num_nodes=args.num_nodes, strategy=args.strategy,
            precision="bf16-mixed" if bf16 else "32-true",  # bf16 autocast, fp32 weights
            max_steps=args.max_steps, accumulate_grad_batches=grad_accum,
            gradient_clip_val=presets.get_preset(args.preset).grad_clip,
            val_check_interval=args.eval_interval * grad_accum,  # counted in microbatches
            check_val_every_n_epoch=None, num_sanity_val_steps=0,
            callbacks=[checkpoints], default_root_dir=args.out,  # Slurm's requeue checkpoint too
            logger=tracking.lightning_logger(args.track, args.out, args.resume),
            enable_progress_bar=False, enable_model_summary=False,
        )
    except (MisconfigurationException, ValueError, RuntimeError) as err:
        reason = " ".join(str(err).split())  # Lightning's messages span lines: one line here
        raise KitError(f"--strategy {args.strategy} --devices {args.devices}: {reason}") from None


def checkpoint_to_resume(run_dir):
    """The newer of the last periodic checkpoint and the one Lightning saves when Slurm pre-empts
    the job (hpc_ckpt_N.ckpt in the run directory), or None."""
    found = [p for p in [run_dir / "ckpt" / "last.ckpt", *run_dir.glob("hpc_ckpt_*.ckpt")]
             if p.exists()]
    return str(max(found, key=lambda p: p.stat().st_mtime)) if found else None


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
                        help="continue from the run directory's last checkpoint, if it has one")
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
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--strategy", default="auto", choices=STRATEGIES,
                        help="how Lightning spreads the work (auto: DDP when there are several "
                             "devices)")
    parser.add_argument("--devices", default="auto", type=devices_arg,
                        help="processes per node (default: every GPU, or 1 on a CPU)")
    parser.add_argument("--num-nodes", type=positive_int, default=1, help="nodes (under Slurm)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--sample-tokens", type=int, default=64, help="tokens generated at the end")
    tracking.add_argument(parser)
    parser.add_argument("--prompt", default="The", help="start of the generated sample")
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except KitError as err:
        parser.error(str(err))
    return args


def check_deepspeed(args):
    """Lightning's DeepSpeed strategy runs on CUDA GPUs only (the fine-tuning stage's Accelerate
    configs run DeepSpeed on CPU too), and DeepSpeed is an optional install."""
    if not uses_gpu(args):
        raise KitError(f"--strategy {args.strategy} runs on CUDA GPUs only (on CPU use ddp, or "
                       f"DeepSpeed through solutions/finetune_lora.py's Accelerate configs)")
    if importlib.util.find_spec("deepspeed") is None:
        raise KitError(f"--strategy {args.strategy} needs DeepSpeed: pip install deepspeed")


def devices_arg(text):
    return text if text == "auto" else positive_int(text)


def check_args(args):
    """Fill preset defaults, then refuse combinations that cannot work, saying why."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise KitError("--device cuda: no CUDA/ROCm GPU is visible (use --device auto or cpu)")
    if args.strategy.startswith("deepspeed"):
        check_deepspeed(args)
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
    world_size = device_count(args) * args.num_nodes
    if args.batch_tokens % (args.micro_batch * args.seq_len * world_size):
        raise KitError(f"--batch-tokens {args.batch_tokens} is not a multiple of micro-batch x "
                       f"seq-len x processes = {args.micro_batch} x {args.seq_len} x {world_size}")
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
    if checkpoint_to_resume(out) is not None and not args.resume:
        raise KitError(f"{out} already holds a checkpoint: pass --resume to continue that run, "
                       "or choose another --out")


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)  # before the model: the same initial weights in every process
    preset = presets.get_preset(args.preset)
    config = GPTConfig(vocab_size=preset.vocab_size, block_size=preset.seq_len,
                       n_layer=args.n_layer, n_head=preset.n_head, n_embd=preset.n_embd)
    B, T = args.micro_batch, args.seq_len
    world_size = device_count(args) * args.num_nodes
    grad_accum = args.batch_tokens // (B * T * world_size)
    module = LitGPT(config, args, preset, grad_accum)
    trainer = make_trainer(args, grad_accum)
    device = trainer.strategy.root_device
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for any matmul left in fp32
    if device.type == "cpu":
        perf.keep_freed_cpu_memory()  # reuse freed tensors' pages instead of re-faulting them

    n_params = sum(p.numel() for p in module.gpt.parameters())
    flops_per_token = perf.flops_per_token(config.n_layer, config.n_embd, T, config.vocab_size)
    peak, peak_source = perf.peak_flops(device)
    run_config = {
        "stage": STAGE, "args": vars(args), "preset": preset.as_dict(), "model": asdict(config),
        "parameters": n_params, "grad_accum": grad_accum, "world_size": trainer.world_size,
        "flops_per_token": flops_per_token, "peak_flops": peak, "peak_source": peak_source,
        "device": str(device), "device_name": perf.device_name(device),
        "precision": trainer.precision, "strategy": type(trainer.strategy).__name__,
        "torch": torch.__version__, "lightning": L.__version__,
    }
    module.run_config = run_config
    if trainer.is_global_zero:
        print(f"{trainer.world_size} process(es) | {run_config['strategy']} | "
              f"device {device} ({perf.device_name(device)}) | {trainer.precision} | "
              f"compile {'on' if args.compile else 'off'} | peak {peak / 1e12:.2f} TFLOP/s "
              f"({peak_source})")
        print(f"model {preset.name}: {n_params:,} parameters, {config.n_layer} layers, "
              f"{config.n_head} heads, {config.n_embd} wide, context {config.block_size}")
        print(f"sample = {T} tokens | microbatch = {B} samples | grad_accum = {grad_accum} | "
              f"processes = {trainer.world_size} | minibatch = {args.batch_tokens // T} samples = "
              f"{args.batch_tokens:,} tokens per step")

    runs.make_run_dir(args.out)
    # Lightning restores weights, optimiser, schedule, loop counters and the data position
    resume_from = checkpoint_to_resume(Path(args.out)) if args.resume else None
    if resume_from:  # weights_only: Lightning unpickles plain data alone; and only yours
        runs.refuse_unless_private(args.out, resume_from)
    trainer.fit(module, ckpt_path=resume_from, weights_only=True)
    if trainer.is_global_zero and args.sample_tokens and module.global_step == args.max_steps:
        write_sample(module.gpt, Path(args.out), args, module.device)
    module.tracker.finish(args.out, checkpoint_to_resume(Path(args.out)))
    return 0


def write_sample(model, run_dir, args, device):
    encoding = data.gpt2_encoding()
    prompt = torch.tensor([encoding.encode_ordinary(args.prompt)], device=device)
    generator = torch.Generator(device=device).manual_seed(args.seed)  # leaves the global RNG alone
    model.eval()
    tokens = model.generate(prompt, args.sample_tokens, generator=generator)[0].tolist()
    text = encoding.decode([t for t in tokens if t < data.EOT_TOKEN])
    (run_dir / "sample.txt").write_text(text + "\n")
    print(f"sample: {text!r}")


if __name__ == "__main__":
    sys.exit(faults.run(main))  # a bad value, a lost peer, a full disk: one line, no traceback
