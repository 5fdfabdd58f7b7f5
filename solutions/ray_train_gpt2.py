"""Train the course's GPT-2 with Ray Train: the ddp stage's training loop, run by the workers of a
TorchTrainer on a Ray cluster (lesson 09).

    python solutions/ray_train_gpt2.py --preset tiny --workers 2 --device cpu   # a local Ray
    sbatch batchfiles/<site>/batch-ray-2n4g.sh solutions/ray_train_gpt2.py --workers 8

Ray Train starts --workers worker processes wherever the cluster has room (a GPU each, with
--device cuda or a cluster that has GPUs), makes them a process group (NCCL on GPUs, gloo on
CPUs) and wraps the model in DDP (prepare_model). Each worker then runs the ddp stage's loop step
for step: its own share of the same data, the same schedule and clipping, so the losses are the
ddp stage's at the same global batch. The run directory is the stages': config.json,
metrics.jsonl, ckpt/ and --resume; Ray's own records go to its ray/ folder. SIGUSR1 or SIGTERM to
the driver (the batch file passes the time limit's warning on) leaves a STOP file there, and every
worker checkpoints and stops at the next step.
"""
import argparse
import os
import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from coursekit import distributed, faults, perf, presets, raycluster, runs, training
from coursekit.cli import positive_int
from solutions import train_gpt2_ddp as ddp
from solutions.gpt import GPT, GPTConfig

STAGE = "ray"
STOP_FILE = "STOP"  # in the run directory: the driver's word to stop, which every worker can read


def train_loop(config):
    """What every Ray Train worker runs: the ddp stage's training, rank and device from Ray."""
    import ray.train
    import ray.train.torch

    args = argparse.Namespace(**config)
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()
    torch.manual_seed(args.seed)
    precision = training.prepare_device(device, args.precision)
    preset = presets.get_preset(args.preset)
    model_config = GPTConfig(vocab_size=preset.vocab_size, block_size=preset.seq_len,
                             n_layer=args.n_layer, n_head=preset.n_head, n_embd=preset.n_embd)
    model = GPT(model_config).to(device)
    if args.compile:
        model.compile()
    ddp_model = ray.train.torch.prepare_model(model)  # DDP (one worker: the model as it is)
    no_sync = getattr(ddp_model, "no_sync", nullcontext)

    B, T = args.micro_batch, args.seq_len
    grad_accum = training.batch_split(args, world_size)
    train_loader = ddp.TokenShardLoader(args.data, "train", B, T, rank, world_size)
    val_loader = ddp.TokenShardLoader(args.data, "val", B, T)
    optimizer = ddp.configure_optimizer(model, args.lr, args.weight_decay, device)
    run_dir = Path(args.out)
    run_config = training.run_config(args, preset, model_config,
                                     sum(p.numel() for p in model.parameters()), device,
                                     precision, grad_accum=grad_accum, world_size=world_size)
    start_step = (ddp.resume(run_dir, model, optimizer, train_loader, precision, device)
                  if args.resume else 0)
    if rank == 0:
        training.print_banner(run_config, train_loader.total_tokens)
        runs.start_run(run_dir, run_config, start_step)

    for step in range(start_step, args.max_steps):
        t0 = time.perf_counter()
        lr = ddp.learning_rate(step, args.lr, args.warmup_steps, args.max_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=device)
        for micro in range(grad_accum):
            x, y = training.to_device(train_loader.next_batch(), device)
            with no_sync() if micro < grad_accum - 1 else nullcontext():
                loss_sum += ddp.forward_backward(ddp_model, x, y, grad_accum, precision)
        precision.scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), preset.grad_clip)
        precision.scaler.step(optimizer)
        precision.scaler.update()
        stop = torch.tensor(float((run_dir / STOP_FILE).exists()), device=device)
        loss_value, stopping = distributed.all_reduce_mean(torch.stack([loss_sum, stop])).tolist()
        dt = time.perf_counter() - t0

        done = step + 1
        tokens_per_s = args.batch_tokens / dt
        record = {"step": done, "loss": loss_value, "lr": lr, "grad_norm": grad_norm.item(),
                  "ms": dt * 1000, "tok_per_s": tokens_per_s,
                  "mfu": perf.mfu(tokens_per_s / world_size, run_config["flops_per_token"],
                                  run_config["peak_flops"]),
                  "epoch": train_loader.epoch + train_loader.offset / train_loader.total_tokens}
        if done % args.eval_interval == 0 or done == args.max_steps:
            record["val_loss"] = ddp.evaluate(model, val_loader, args.eval_steps, device,
                                              precision)
        if rank == 0:
            print(training.step_line(record, args, step == start_step), flush=True)
            runs.append_metrics(run_dir, record)
            if done % args.ckpt_interval == 0 or done == args.max_steps or stopping:
                ddp.save_checkpoint(run_dir, done, model, optimizer, train_loader, precision,
                                    device)
        if stopping and done < args.max_steps:
            if rank == 0:
                print(f"stop asked ({STOP_FILE} in the run directory): checkpoint saved at step "
                      f"{done}; rerun with --resume to continue", flush=True)
            break


def parse_args(argv=None):
    parser = training.argument_parser(__doc__, STAGE)
    parser.add_argument("--workers", type=positive_int, default=2,
                        help="Ray Train workers: the processes of the DDP group")
    return training.parse_args(parser, argv)


def main(argv=None):
    args = parse_args(argv)
    training.batch_split(args, args.workers)  # a minibatch the workers cannot share: one line now
    # the workers run elsewhere (another node, Ray's working directory): absolute paths
    args.out, args.data = str(Path(args.out).resolve()), str(Path(args.data).resolve())
    run_dir = Path(args.out)
    runs.make_run_dir(run_dir)
    (run_dir / STOP_FILE).unlink(missing_ok=True)
    for signum in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(signum, lambda number, frame: (run_dir / STOP_FILE).touch())

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    # a worker's print reaches this output once, as Ray forwards every worker's output; Train's
    # own patch of print would log each line a second time
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    raycluster.connect()
    gpus = args.device in ("auto", "cuda") and ray.cluster_resources().get("GPU", 0) > 0
    trainer = TorchTrainer(train_loop, train_loop_config=vars(args),
                           scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=gpus),
                           run_config=RunConfig(name=STAGE, storage_path=str(run_dir)))
    trainer.fit()  # raises what a worker raised
    (run_dir / STOP_FILE).unlink(missing_ok=True)
    last = runs.read_metrics(run_dir)[-1]
    print(f"ray train: {args.workers} workers, step {last['step']}, loss {last['loss']:.4f}; "
          f"{run_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(faults.run(main))
