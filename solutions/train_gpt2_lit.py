"""Train a GPT-2 language model with PyTorch Lightning: the "lit" stage.

Lightning replaces the training loop: it runs the model of solutions/gpt.py on the data and with
the schedule of the ddp stage, which this file imports. Compare it with train_gpt2_ddp.py side
by side: what that script does by hand, the LightningModule and the Trainer below decide.

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
import re
import sys
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch.utils.data import DataLoader, TensorDataset

from coursekit import KitError, faults, perf, presets, runs, tracking, training
from coursekit.watchdog import StepWatch
from coursekit.cli import positive_int
from solutions import train_gpt2_ddp as ddp
from solutions.gpt import GPT, GPTConfig, cross_entropy

STAGE = Path(__file__).stem.removeprefix("train_gpt2_")  # names the default run directory
STRATEGIES = ["auto", "ddp", "ddp_notebook", "fsdp", "deepspeed_stage_1", "deepspeed_stage_2",
              "deepspeed_stage_3"]

# Lightning hints "prepend srun" whenever srun is on PATH. The hint matters in a Slurm job of
# several tasks started without srun (they would hang); outside Slurm, or in a one-task job such
# as a JupyterLab session, it is wrong, so it is silenced there.
if int(os.environ.get("SLURM_NTASKS", "1")) == 1:
    warnings.filterwarnings("ignore", "The `srun` command is available", PossibleUserWarning)


# ----------------------------------------------------------------------------------------------
# The data and the optimiser: the ddp stage's, as Lightning takes them
# ----------------------------------------------------------------------------------------------
class TokenShardLoader(ddp.TokenShardLoader):
    """The ddp stage's loader, as an iterable Lightning draws microbatches from; its state_dict
    and load_state_dict put its position into Lightning's checkpoints."""

    def __iter__(self):  # Lightning asks for batches with a for loop
        while True:
            yield self.next_batch()

    def __len__(self):  # microbatches per rank in an epoch; with a length, Lightning does not
        return self.total_tokens // (self.B * self.T * self.world_size)  # read ahead of the step


def matrix_names(model):
    """The parameters weight decay applies to: the matrices (the ddp stage decays those with two
    dimensions or more). Taken by name before the Trainer wraps the model: under FSDP,
    configure_optimizers sees each rank's shard of a parameter, flattened to one dimension."""
    return {name for name, p in model.named_parameters() if p.dim() >= 2}


def unwrapped_name(name):
    """A parameter's name without the wrappers' parts: FSDP's, activation checkpointing's."""
    return re.sub(r"(_fsdp_wrapped_module|_checkpoint_wrapped_module)\.", "", name)


def configure_optimizer(model, matrices, lr, weight_decay):
    """AdamW with weight decay on the ``matrices`` (names), not on biases and LayerNorm gains; not
    fused: Lightning clips the gradients itself, and refuses a fused optimizer on GPUs."""
    named = [(unwrapped_name(name), p) for name, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for name, p in named if name in matrices], "weight_decay": weight_decay},
              {"params": [p for name, p in named if name not in matrices], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def gradient_norm(model, strategy):
    """The norm of every gradient, before clipping. Under FSDP each rank holds a shard of each:
    the squares of every rank's shards add up. DeepSpeed keeps its gradients to itself (a
    parameter's .grad may be None): its engine reports the norm after its step instead."""
    if isinstance(strategy, DeepSpeedStrategy):
        return None
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if isinstance(strategy, FSDPStrategy):
        norm = strategy.reduce(norm**2, reduce_op="sum").sqrt()
    return norm


# ----------------------------------------------------------------------------------------------
# The LightningModule: what to compute. The Trainer decides where, on how many devices, and runs
# the loop (accumulation, DDP's no_sync, clipping, precision, checkpoints, Slurm signals).
# ----------------------------------------------------------------------------------------------
class LitGPT(L.LightningModule):
    def __init__(self, config, args, preset, grad_accum):
        super().__init__()
        self.gpt = GPT(config)
        self.matrices = matrix_names(self.gpt)  # before the Trainer wraps (and may shard) it
        # Compiled before the Trainer wraps it in DDP, as Lightning's guide compiles a module before
        # fit (https://lightning.ai/docs/pytorch/stable/advanced/compile.html): it runs inside
        # DDP's forward all the same, where TorchDynamo splits its graph at DDP's buckets
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
        # --eval-steps rounded up to whole microbatches for every rank: a smaller last batch would
        # weigh as much as a full one in the mean, and compile the model again for its shape
        per_rank = math.ceil(self.args.eval_steps / self.trainer.world_size)
        batches = per_rank * self.trainer.world_size
        x, y = zip(*(val_loader.next_batch() for _ in range(batches)))
        return DataLoader(TensorDataset(torch.cat(x), torch.cat(y)), self.args.micro_batch)

    def configure_optimizers(self):
        optimizer = configure_optimizer(self.gpt, self.matrices, self.args.lr,
                                        self.args.weight_decay)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: ddp.learning_rate(
            step, 1.0, self.args.warmup_steps, self.args.max_steps))  # a factor of --lr
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_train_start(self):
        self.first_step = self.global_step + 1  # of this run: with --compile, it compiles
        self.watch = StepWatch(self.run_dir, self.global_rank, self.gpt)  # each rank's steps
        if self.trainer.is_global_zero:  # after a resume, global_step is the checkpoint's step
            runs.start_run(self.run_dir, self.run_config, self.global_step)
            self.tracker = tracking.tracker_for(self.logger, self.run_dir,
                                                resumed=self.global_step > 0)

    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx % self.grad_accum == 0:  # the first microbatch of an optimiser step
            self.t0, self.loss_sum = time.perf_counter(), torch.zeros((), device=self.device)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = cross_entropy(self.gpt(x), y)
        self.loss_sum += loss.detach() / self.grad_accum  # Lightning scales the backward itself
        return loss

    def on_before_optimizer_step(self, optimizer):  # before Lightning clips: the raw norm
        self.grad_norm = gradient_norm(self.gpt, self.trainer.strategy)
        self.lr = optimizer.param_groups[0]["lr"]

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if (batch_idx + 1) % self.grad_accum:  # still accumulating: no optimiser step yet
            return
        loss = self.trainer.strategy.reduce(self.loss_sum, reduce_op="mean").item()
        dt = time.perf_counter() - self.t0
        self.watch.step_done(self.global_step, self.t0)
        tokens_per_s = self.args.batch_tokens / dt
        per_device = tokens_per_s / self.trainer.world_size
        if self.grad_norm is None:  # DeepSpeed's, of the step it took
            self.grad_norm = torch.tensor(self.trainer.model.get_global_grad_norm() or 0.0)
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
        loss = cross_entropy(self.gpt(x), y)
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
        print(training.step_line(record, self.args, record["step"] == self.first_step),
              flush=True)
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


#: the kit's precisions by Lightning's names: 16-bit autocast with fp32 weights, or fp32
LIGHTNING_PRECISION = {"bf16": "bf16-mixed", "fp16": "16-mixed", "fp32": "32-true"}


def make_trainer(args, grad_accum):
    gpu = uses_gpu(args)
    precision = training.choose_precision(torch.device("cuda" if gpu else "cpu"), args.precision)
    checkpoints = ModelCheckpoint(dirpath=Path(args.out) / "ckpt", filename="step_{step:08d}",
                                  auto_insert_metric_name=False, save_top_k=1, save_last="link",
                                  every_n_train_steps=args.ckpt_interval)
    try:
        return L.Trainer(
            accelerator="gpu" if gpu else "cpu", devices=device_count(args),
            num_nodes=args.num_nodes, strategy=args.strategy,
            precision=LIGHTNING_PRECISION[precision],  # fp16: Lightning scales the loss
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
    parser = training.argument_parser(__doc__, STAGE)
    parser.add_argument("--strategy", default="auto", choices=STRATEGIES,
                        help="how Lightning spreads the work (auto: DDP when there are several "
                             "devices)")
    parser.add_argument("--devices", default="auto", type=devices_arg,
                        help="processes per node (default: every GPU, or 1 on a CPU)")
    parser.add_argument("--num-nodes", type=positive_int, default=1, help="nodes (under Slurm)")
    return training.parse_args(parser, argv, check=check_lightning_args)


def devices_arg(text):
    return text if text == "auto" else positive_int(text)


def check_lightning_args(args, preset):
    if args.device == "xpu":
        raise KitError("--device xpu: this stage runs on CUDA/ROCm GPUs or the CPU (Lightning's "
                       "XPU support is a separate package)")
    if args.strategy.startswith("deepspeed"):
        check_deepspeed(args)
    training.batch_split(args, device_count(args) * args.num_nodes)  # refuses what cannot split
    out = Path(args.out)
    if checkpoint_to_resume(out) is not None and not args.resume:
        raise KitError(f"{out} already holds a checkpoint: pass --resume to continue that run, "
                       "or choose another --out")


def check_deepspeed(args):
    """Lightning's DeepSpeed strategy runs on CUDA GPUs only (the fine-tuning stage's Accelerate
    configs run DeepSpeed on CPU too), and DeepSpeed is an optional install."""
    if not uses_gpu(args):
        raise KitError(f"--strategy {args.strategy} runs on CUDA GPUs only (on CPU use ddp, or "
                       f"DeepSpeed through solutions/finetune_lora.py's Accelerate configs)")
    if importlib.util.find_spec("deepspeed") is None:
        raise KitError(f"--strategy {args.strategy} needs DeepSpeed: pip install deepspeed")


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
    grad_accum = training.batch_split(args, world_size)
    module = LitGPT(config, args, preset, grad_accum)
    trainer = make_trainer(args, grad_accum)
    device = trainer.strategy.root_device
    # the device's settings for speed; Lightning brings its own autocast (and loss scaling)
    precision = training.prepare_device(device, args.precision)

    n_params = sum(p.numel() for p in module.gpt.parameters())
    module.run_config = training.run_config(
        args, preset, config, n_params, device, precision, grad_accum=grad_accum,
        world_size=trainer.world_size, strategy=type(trainer.strategy).__name__,
        lightning=L.__version__)
    if trainer.is_global_zero:
        print(f"{trainer.world_size} process(es) | {module.run_config['strategy']}")
        train_tokens = TokenShardLoader(args.data, "train", B, T).total_tokens
        training.print_banner(module.run_config, train_tokens)

    runs.make_run_dir(args.out)
    # Lightning restores weights, optimiser, schedule, loop counters and the data position
    resume_from = checkpoint_to_resume(Path(args.out)) if args.resume else None
    if resume_from:  # weights_only: Lightning unpickles plain data alone; and only yours
        runs.refuse_unless_private(args.out, resume_from)
    trainer.fit(module, ckpt_path=resume_from, weights_only=True)
    if trainer.is_global_zero and args.sample_tokens and module.global_step == args.max_steps:
        module.gpt.eval()
        training.write_sample(args.out, args, module.device, module.gpt.generate)
    module.tracker.finish(args.out, checkpoint_to_resume(Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(faults.run(main))  # a bad value, a lost peer, a full disk: one line, no traceback
