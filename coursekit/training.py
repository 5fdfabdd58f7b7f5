"""What every GPT stage script shares and no lesson is about: its command line and the preset
behind it, the precision its device gets, the stop signal, RNG state, the run's config and
banner, and the sample at the end. The model (solutions/gpt.py), the data, the optimiser, the
loop and the parallelism stay in the scripts: they are what the lessons teach.

    parser = training.argument_parser(__doc__, STAGE)   # the flags every stage has
    parser.add_argument("--tp", ...)                     # and the stage's own
    args = training.parse_args(parser, argv, check=check_tp)  # the stage's own checks, if any
"""
import argparse
import functools
import math
import signal
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from coursekit import KitError, caches, data, distributed, perf, presets, runs, tracking
from coursekit.cli import ArgumentParser, non_negative_float, positive_float, positive_int

#: The flags a preset fills in when they are not given
PRESET_DEFAULTS = ("data", "max_steps", "micro_batch", "seq_len", "batch_tokens", "lr",
                   "weight_decay", "n_layer", "eval_interval", "eval_steps", "ckpt_interval")


# --- the command line -------------------------------------------------------------------------

def argument_parser(doc, stage):
    """The flags every stage shares: the preset, its sizes, the run directory, the device."""
    parser = ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--preset", choices=list(presets.PRESETS), default=None,
                        help="model and batch sizes (default: gpt2-124m on a GPU, tiny on a CPU)")
    parser.add_argument("--data", help="prepared data directory (default: the preset's)")
    parser.add_argument("--out", default=None, help=f"run directory (default: runs/{stage}-<preset>)")
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
    parser.add_argument("--precision", choices=PRECISIONS, default="auto",
                        help="auto: bf16 on GPUs that compute in it, fp16 with loss scaling on "
                             "older ones, fp32 on a CPU")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile the model (default: on GPUs, not on a CPU)")
    parser.add_argument("--sample-tokens", type=int, default=64, help="tokens generated at the end")
    parser.add_argument("--prompt", default="The", help="start of the generated sample")
    tracking.add_argument(parser)
    parser.set_defaults(stage=stage)
    return parser


def parse_args(parser, argv=None, check=None):
    """The arguments with the preset's defaults filled in, checked, then checked by the stage's
    own ``check(args, preset)``. A combination that cannot work ends the program with one line
    that says why."""
    args = parser.parse_args(argv)
    try:
        preset = presets.get_preset(args.preset or presets.default_preset_name(
            torch.cuda.is_available() and args.device in ("auto", "cuda")))
        args.preset = preset.name
        if args.device != "auto":  # a device asked for by name must be there
            distributed.device_for(0, args.device)
        fill_defaults(args, preset)
        check_args(args, preset)
        if check is not None:
            check(args, preset)
        if args.compile:  # not /tmp/torchinductor_<user>, which another user can create first
            caches.use_private_compile_cache()
    except KitError as err:
        parser.error(str(err))
    return args


def fill_defaults(args, preset):
    for name in PRESET_DEFAULTS:
        if getattr(args, name) is None:
            setattr(args, name, getattr(preset, name))
    if args.warmup_steps is None:  # a short run warms up for a tenth of its steps at most
        args.warmup_steps = min(preset.warmup_steps, args.max_steps // 10)
    args.out = args.out or f"runs/{args.stage}-{preset.name}"
    if args.compile is None:  # compiling pays on a GPU; on a CPU it costs more than it saves
        args.compile = args.device in ("auto", "cuda") and torch.cuda.is_available()


def check_args(args, preset):
    """Refuse combinations that cannot work, saying why."""
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


def batch_split(args, data_parallel):
    """Microbatches per step and process (gradient accumulation) when ``data_parallel``
    processes each take their own microbatches."""
    B, T = args.micro_batch, args.seq_len
    if args.batch_tokens % (B * T * data_parallel):
        raise KitError(f"--batch-tokens {args.batch_tokens} is not a multiple of micro-batch x "
                       f"seq-len x data-parallel processes = {B} x {T} x {data_parallel}")
    return args.batch_tokens // (B * T * data_parallel)


# --- the device's precision -------------------------------------------------------------------

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
#: AMD GPUs whose matrix cores compute in bf16: MI100 (gfx908), MI200 (gfx90a), MI300 (gfx94x),
#: MI350 (gfx95x), and the RDNA3/4 cards (gfx11, gfx12)
AMD_BF16_ARCHS = ("gfx908", "gfx90a", "gfx94", "gfx95", "gfx11", "gfx12")


def hardware_precision(device_type, capability=None, amd_arch=None):
    """The 16-bit format a device's matrix units compute in: bf16 on NVIDIA GPUs from Ampere
    (compute capability 8.0: A100, H100, L4, RTX 30xx), AMD's CDNA and RDNA3 parts, and Intel's
    GPUs; fp16 on older ones (V100, T4), which torch.cuda.is_bf16_supported() calls bf16-capable
    because it emulates bf16, slowly; fp32 on a CPU, where the course keeps full precision."""
    if device_type == "xpu":
        return "bf16"
    if device_type != "cuda":
        return "fp32"
    if amd_arch is not None:
        return "bf16" if amd_arch.startswith(AMD_BF16_ARCHS) else "fp16"
    return "bf16" if capability >= (8, 0) else "fp16"


def device_precision(device):
    """hardware_precision of this process's device."""
    if device.type != "cuda":
        return hardware_precision(device.type)
    if torch.version.hip:
        return hardware_precision("cuda", amd_arch=torch.cuda.get_device_properties(device).gcnArchName)
    return hardware_precision("cuda", capability=torch.cuda.get_device_capability(device))


def grad_scaler(precision, device):
    """A GradScaler that scales fp16 losses and does nothing otherwise; the sharded kind for fp16
    across processes."""
    if precision == "fp16" and dist.is_initialized():
        # Imported here: it loads torch.distributed.tensor, half a second of every process's start
        # (every rank's, every run's) that only fp16 across processes needs.
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        return ShardedGradScaler(device.type)
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


class Precision:
    """How a stage computes on its device, by name:

        bf16   bf16 autocast: matmuls in bf16, weights, gradients and optimiser state in fp32
        fp16   the same in fp16, with loss scaling: fp16 has bf16's precision and more, but
               gradients below 6e-8 become 0 in it, so the loss is multiplied by a large scale
               before backward and the gradients divided by it before the optimiser step; a step
               whose gradients overflowed (inf or NaN) is skipped and the scale halved
        fp32   no autocast

    ``autocast`` is the context forward runs in; ``scaler`` a torch.amp.GradScaler that does
    nothing unless fp16. Across processes it is the sharded kind: all skip a step together when
    any one's gradients overflowed."""

    def __init__(self, name, device):
        self.name = name
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(name)
        self.autocast = (torch.autocast(device_type=device.type, dtype=self.dtype)
                         if self.dtype else nullcontext())
        self.scaler = grad_scaler(name, device)
        if self.scaler.is_enabled():
            # The scale, made now on every process: in a pipeline only the last stage scales a
            # loss (the schedule's loss_fn), but every stage unscales its own gradients.
            self.scaler.scale(torch.ones((), device=device))

    def in_autocast(self, forward):
        """``forward``, run in autocast: for code whose backward runs elsewhere (a pipeline
        schedule runs both), as backward itself must not run in autocast."""
        @functools.wraps(forward)
        def forward_in_autocast(*args, **kwargs):
            with self.autocast:
                return forward(*args, **kwargs)
        return forward_in_autocast

    def scaled(self, loss_fn):
        """``loss_fn`` whose loss is multiplied by fp16's scale (by 1 otherwise): for a pipeline
        schedule, which runs backward itself on what its loss_fn returns."""
        @functools.wraps(loss_fn)
        def scaled_loss(*args, **kwargs):
            return self.scaler.scale(loss_fn(*args, **kwargs))
        return scaled_loss

    @property
    def description(self):
        return {"bf16": "bf16 autocast", "fp16": "fp16 autocast, loss scaling",
                "fp32": "fp32"}[self.name]


def prepare_device(device, requested="auto"):
    """The Precision to train in (``requested``, or for "auto" the one the device's hardware
    computes fast), and the device's own settings for speed."""
    if device.type == "cpu":
        perf.keep_freed_cpu_memory()  # reuse freed tensors' pages instead of re-faulting them
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for any matmul left in fp32
    return Precision(choose_precision(device, requested), device)


def choose_precision(device, requested="auto"):
    """The name of the precision prepare_device gives."""
    return device_precision(device) if requested == "auto" else requested


# --- stopping, and the loop's state -----------------------------------------------------------

class StopSignal:
    """Slurm sends SIGUSR1 (with --signal) or SIGTERM before it stops a job: finish the step,
    checkpoint, exit 0, and let the requeued job resume."""

    def __init__(self):
        self.received = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self.handle)

    def handle(self, signum, frame):
        self.received = signal.Signals(signum).name

    def flag(self, device):
        """1.0 once a signal came, else 0.0: sent with the loss, so that all stop together."""
        return torch.tensor(float(self.received is not None), device=device)

    def stopped_line(self, step):
        """What a process prints when it stops at ``step``: its signal, or, where the signal
        reached other processes only, that it stops with them."""
        cause = (f"{self.received} received" if self.received
                 else "a stop signal to another process")
        return f"{cause}: checkpoint saved at step {step}; rerun with --resume to continue"


def loop_state(precision, device):
    """What a checkpoint keeps besides the model, the optimiser and the data's position, so that
    a resumed run takes the steps the uninterrupted one would have: the random generators, and
    fp16's loss scale with the count of steps since it last changed (empty in bf16 and fp32).
    Without the scale a resumed fp16 run would start again at 65,536 and skip steps to find it."""
    rng = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    return {"rng": rng, "scaler": precision.scaler.state_dict()}


def restore_loop_state(checkpoint, precision, device):
    """Set what :func:`loop_state` kept in ``checkpoint``."""
    torch.set_rng_state(checkpoint["rng"]["cpu"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(checkpoint["rng"]["cuda"], device)
    # A checkpoint of a bf16 or fp32 run has no scale: an fp16 run resumed from it starts at the
    # scaler's first scale, as a new run does.
    if checkpoint.get("scaler"):
        precision.scaler.load_state_dict(checkpoint["scaler"])


# --- data to the device -----------------------------------------------------------------------

def to_device(batch, device):
    """A batch's tensors on ``device``; to a GPU from pinned (page-locked) memory and without
    waiting for the copy, which then overlaps the work the CPU goes on queueing."""
    if device.type != "cuda":
        return [t.to(device) for t in batch]
    return [t.pin_memory().to(device, non_blocking=True) for t in batch]


# --- the run's config and banner --------------------------------------------------------------

def run_config(args, preset, model_config, parameters, device, precision, **stage_facts):
    """What config.json records of a run: the arguments, the model, the device and its peak in
    the run's Precision, and the stage's own facts (world_size, grad_accum, ...). A device the
    peak table does not know gets the peak of a matmul measured in the precision it trains in."""
    model_shape = perf.model_matmul_shape(args.micro_batch * args.seq_len, model_config.n_embd)
    peak, peak_source = perf.peak_flops(device, precision.dtype or torch.float32, [model_shape])
    return {
        "stage": args.stage, "args": vars(args), "preset": preset.as_dict(),
        "model": asdict(model_config), "parameters": parameters, **stage_facts,
        "flops_per_token": perf.flops_per_token(model_config.n_layer, model_config.n_embd,
                                                args.seq_len, model_config.vocab_size),
        "peak_flops": peak, "peak_source": peak_source, "device": str(device),
        "device_name": perf.device_name(device), "precision": precision.description,
        "torch": torch.__version__,
    }


def print_banner(config, train_tokens):
    """The run's shape in a few lines: device, model, batch, and how much data it will see."""
    args, model = config["args"], config["model"]
    T, tokens = args["seq_len"], args["batch_tokens"]
    accumulation = (f"microbatches = {config['microbatches']}" if "microbatches" in config
                    else f"grad_accum = {config['grad_accum']}")
    print(f"device {config['device']} ({config['device_name']}) | {config['precision']} | "
          f"compile {'on' if args['compile'] else 'off'} | peak "
          f"{config['peak_flops'] / 1e12:.2f} TFLOP/s ({config['peak_source']})")
    print(f"model {args['preset']}: {config['parameters']:,} parameters, {model['n_layer']} "
          f"layers, {model['n_head']} heads, {model['n_embd']} wide, context "
          f"{model['block_size']}")
    print(f"sample = {T} tokens | microbatch = {args['micro_batch']} samples | {accumulation} | "
          f"processes = {config.get('world_size', 1)} | minibatch = {tokens // T} samples = "
          f"{tokens:,} tokens per step")
    steps = args["max_steps"]
    print(f"{steps:,} steps x {tokens:,} tokens = {steps * tokens:,} tokens = "
          f"{steps * tokens / train_tokens:.2f} epochs of {train_tokens:,} training tokens")


def step_line(record, args, first=False):
    """The parseable line each step prints (metrics.jsonl holds the same record). The ``first``
    step of a run with --compile includes the compiling: it says so, and its time is the cost."""
    line = (f"step {record['step']}/{args.max_steps} | loss {record['loss']:.4f} | "
            f"lr {record['lr']:.1e} | grad_norm {record['grad_norm']:.2f} | "
            f"{record['ms']:.1f} ms | {record['tok_per_s']:,.0f} tok/s | "
            f"mfu {100 * record['mfu']:.1f}%")
    if "val_loss" in record:
        line += f" | val {record['val_loss']:.4f}"
    if first and args.compile:
        line += " | compiled the model in this step"
    return line


def stop_if_diverged(record, run_dir, precision):
    """Stop with one line at the first step whose loss or gradient norm is not a number (NaN or
    infinite): the weights are lost from that step on (clipping an infinite norm scales every
    gradient by 0, which turns infinite ones into NaN), and a checkpoint saved now would keep
    them. Under fp16 loss scaling an infinite gradient is expected now and then: the scaler skips
    that step. The step's record is written first (its grad_norm is part of the diagnosis); the
    checkpoints are all older."""
    loss, grad_norm = record["loss"], record["grad_norm"]
    if math.isfinite(loss) and (math.isfinite(grad_norm) or precision.scaler.is_enabled()):
        return
    raise KitError(f"the loss is {loss:.4g} and the gradient norm {grad_norm:.4g} at step "
                   f"{record['step']}: the weights are lost from this step on, and the "
                   f"checkpoints are from before it. grad_norm in {Path(run_dir) / 'metrics.jsonl'} "
                   "shows how it grew: lower --lr or add --warmup-steps, then run again without "
                   "--resume")


# --- the sample at the end --------------------------------------------------------------------

def write_sample(run_dir, args, device, generate, write=True):
    """Complete --prompt with --sample-tokens tokens from ``generate(idx, n, generator=...)``
    (the model's, or a stage's that spreads it over processes) into RUN_DIR/sample.txt."""
    encoding = data.gpt2_encoding()
    prompt = torch.tensor([encoding.encode_ordinary(args.prompt)], device=device)
    generator = torch.Generator(device=device).manual_seed(args.seed)  # leaves the global RNG alone
    # Eager, even where the model was compiled: each token is a forward of a new length (and
    # outside the training's autocast), so a compiled model would compile again for the first
    # few lengths, then once more with the length dynamic (DTensor graphs under tp too): minutes
    # of compiling for a sample that takes seconds eagerly.
    with torch.compiler.set_stance("force_eager"):
        tokens = generate(prompt, args.sample_tokens, generator=generator)[0].tolist()
    text = encoding.decode([t for t in tokens if t < data.EOT_TOKEN])
    if write:
        (Path(run_dir) / "sample.txt").write_text(text + "\n")
        print(f"sample: {text!r}")


def pipelined_last_logits(model, device):
    """``last_logits(context)`` for sampling through a pipeline of GPT stages (one per rank):
    each token's forward runs through the stages in turn, one sample with nothing to overlap,
    and the last stage sends its logits to every rank, which all draw the same token."""
    rank, last = dist.get_rank(), dist.get_world_size() - 1

    def last_logits(context):
        x = context
        if rank > 0:  # the previous stage's residual stream for these tokens
            x = torch.empty(*context.shape, model.config.n_embd, device=device)
            dist.recv(x, src=rank - 1)
        x = model(x, last_position_only=True)  # the last stage: its head at the last position
        if rank < last:
            dist.send(x, dst=rank + 1)
        # fp32 on every rank: under bf16 autocast the head's logits are bf16, and a broadcast
        # into buffers of another dtype reads garbage (gloo) or hangs (NCCL)
        logits = (x[:, -1, :].float() if rank == last else
                  torch.empty(len(context), model.config.vocab_size, device=device))
        dist.broadcast(logits, src=last)
        return logits
    return last_logits
