"""Train a ResNet image classifier with DDP, fed from either layout of an image data set: the
stage of lesson 08, where the question is no longer the model but keeping the GPUs fed.

    python -m coursekit images prepare --out data/shapes
    python -m coursekit torchrun --nproc 2 solutions/train_resnet_ddp.py --data data/shapes \\
        --layout shards --workers 2 --augment device

The input pipeline, stage by stage, and what each flag changes:
    read      --layout files: a file open per image, found through the index, and a
              DistributedSampler that deals every process its own share, reshuffled each epoch
              (set_epoch); --layout shards: WebDataset tar files, whole shards per process and
              per loader worker (split_by_node, split_by_worker), read as streams
    decode    JPEG to pixels (Pillow), in the DataLoader's --workers processes (0: in this one)
    augment   random affine and colour changes (Kornia): --augment cpu in the workers, per image,
              as floats; --augment device on the GPU, per batch, after the copy of uint8 pixels
    transfer  pinned memory, non-blocking copies; channels_last for the convolutions
    compute   forward, backward (DDP's all-reduce), the optimiser, in the device's precision
The run directory is the GPT stages': config.json, metrics.jsonl (with images/s and the time each
step waited for its batch), checkpoints, --resume, SIGUSR1/SIGTERM checkpoint and exit.
"""
import csv
import functools
import io
import itertools
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from coursekit import KitError, distributed, faults, images, runs, training
from coursekit.cli import ArgumentParser, non_negative_float, positive_float, positive_int
from solutions.resnet import ResNet
from solutions.train_gpt2_std import learning_rate

STAGE = "resnet"
MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)  # the inputs scaled to about -2..2


# ----------------------------------------------------------------------------------------------
# Reading and decoding: the two layouts
# ----------------------------------------------------------------------------------------------
def decode(data):
    """Encoded image bytes or a file to a (3, H, W) uint8 tensor."""
    image = Image.open(data).convert("RGB")
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)


class ImageFiles(Dataset):
    """One file per image, found through the split's index.csv; ``transform`` (the CPU
    augmentation, or none) runs in the loader's worker."""

    def __init__(self, data_dir, split, transform=None):
        self.folder = Path(data_dir) / "files" / split
        with open(self.folder / "index.csv") as index:
            self.rows = [(row["path"], int(row["label"])) for row in csv.DictReader(index)]
        self.transform = transform

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        path, label = self.rows[i]
        pixels = decode(self.folder / path)
        return (self.transform(pixels) if self.transform else pixels), label


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way: a resumed run skips the samples the
    interrupted one had already trained on, without reading them."""

    def __init__(self, dataset, rank, world_size, seed):
        super().__init__(dataset, world_size, rank, shuffle=True, seed=seed, drop_last=True)
        self.skip = 0

    def __iter__(self):
        return iter(list(super().__iter__())[self.skip:])

    def __len__(self):
        return self.num_samples - self.skip


def shard_stream(data_dir, split, transform, seed, skip_batches=0, batch_size=1):
    """WebDataset over the split's tar shards: each process its own shards (split_by_node), each
    loader worker its own of those (split_by_worker), round and round (repeat), samples shuffled
    in a buffer. A resumed run passes the batches already trained on: they are read again but
    not decoded, so that training goes on with the very batch it stopped before."""
    import webdataset as wds

    meta = images.read_meta(data_dir)
    urls = [str(Path(data_dir) / "shards" / name) for name in meta["splits"][split]["shards"]]
    suffix = images.FORMATS[meta["format"]][0]
    return (wds.WebDataset(urls, nodesplitter=wds.split_by_node, workersplitter=wds.split_by_worker,
                           shardshuffle=False, empty_check=False)
            .repeat().shuffle(1000, rng=random.Random(seed))
            .compose(functools.partial(skip_taken, batches=skip_batches, batch_size=batch_size))
            .map(functools.partial(decode_sample, suffix=suffix, transform=transform)))


def skip_taken(samples, batches, batch_size):
    """Drop this loader worker's part of the first ``batches`` batches: the DataLoader takes
    batch i from worker i % workers, so worker w made every workers-th of them from w on."""
    worker = torch.utils.data.get_worker_info()
    workers, me = (worker.num_workers, worker.id) if worker else (1, 0)
    return itertools.islice(samples, len(range(me, batches, workers)) * batch_size, None)


def decode_sample(sample, suffix, transform):
    """A WebDataset sample ({"jpg": bytes, "cls": bytes, ...}) to (pixels, label)."""
    pixels = decode(io.BytesIO(sample[suffix]))
    return (transform(pixels) if transform else pixels), int(sample["cls"])


def check_shards(data_dir, world_size, workers):
    """Every loader worker of every process needs whole shards of its own."""
    shards = len(images.read_meta(data_dir)["splits"]["train"]["shards"])
    readers = world_size * max(1, workers)
    if shards < readers:
        raise KitError(f"--layout shards: {shards} training shards for {world_size} process(es) "
                       f"x {max(1, workers)} loader worker(s): each reads whole shards of its own; "
                       "use fewer --workers, or prepare smaller shards (--shard-size)")


class Batches:
    """Training batches, forever: the layout's data through a DataLoader with ``workers``
    processes, pinned memory and prefetching. The position (epoch, batches into it) goes into
    checkpoints, and a resumed run starts at exactly that batch in either layout: the files
    layout's sampler skips the indices already dealt, the shards layout's one endless stream the
    samples already taken."""

    def __init__(self, args, rank, world_size, transform, device):
        self.args, self.rank, self.world_size = args, rank, world_size
        self.transform, self.device = transform, device
        self.epoch, self.batch = 0, 0
        if args.layout == "files":
            self.dataset = ImageFiles(args.data, "train", transform)
            self.sampler = ResumableSampler(self.dataset, rank, world_size, args.seed)
            self.per_epoch = len(self.sampler) // args.batch_size
        else:
            self.per_epoch = images.read_meta(args.data)["splits"]["train"]["images"] // (
                args.batch_size * world_size)

    def loader(self):
        args = self.args
        if args.layout == "files":
            self.sampler.set_epoch(self.epoch)  # a new shuffle every epoch, the same on every rank
            self.sampler.skip = self.batch * args.batch_size
            source, sampler = self.dataset, self.sampler
        else:  # epochs only count: the stream goes on across them
            source = shard_stream(args.data, "train", self.transform, f"{args.seed}-{self.rank}",
                                  self.epoch * self.per_epoch + self.batch, args.batch_size)
            sampler = None
        # a generator of its own: starting a loader draws a seed, which must not come from the
        # global RNG the augmentation draws from (a resumed run starts one more loader)
        return DataLoader(source, args.batch_size, sampler=sampler, drop_last=True,
                          num_workers=args.workers, pin_memory=self.device.type == "cuda",
                          prefetch_factor=args.prefetch if args.workers else None,
                          generator=torch.Generator().manual_seed(args.seed + self.epoch))

    def __iter__(self):
        iterator = iter(self.loader())
        while True:
            if self.batch == self.per_epoch:  # an epoch is over
                self.epoch, self.batch = self.epoch + 1, 0
                if self.args.layout == "files":  # the next one, shuffled anew
                    iterator = iter(self.loader())
            batch = next(iterator)
            self.batch += 1  # before the step: a checkpoint after it resumes at the next batch
            yield batch

    def state_dict(self):
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state):
        self.epoch, self.batch = state["epoch"], state["batch"]


def make_batches(args, rank, world_size, device):
    """The training batches of a process, as its flags ask (lesson 08 and
    benchmarks/input_pipeline.py time them outside a run, from parse_args' flags)."""
    return Batches(args, rank, world_size, AugmentOnCpu() if args.augment == "cpu" else None,
                   device)


# ----------------------------------------------------------------------------------------------
# Augmentation, the model, evaluation
# ----------------------------------------------------------------------------------------------
def augmentation():
    """Random shifts, rotations, scalings and colour changes (Kornia: the same code on a CPU or a
    GPU), on float images in [0, 1]."""
    import kornia.augmentation as K
    return K.AugmentationSequential(
        K.RandomAffine(degrees=20, translate=(0.1, 0.1), scale=(0.85, 1.15), p=1.0),
        K.ColorJitter(0.2, 0.2, 0.2, 0.02, p=0.8))


class AugmentOnCpu:
    """What a loader worker does to each image with --augment cpu: the augmentation, one image at
    a time, handing on floats (four times the bytes of uint8 to copy to the device)."""

    def __init__(self):
        self.augment = augmentation()

    def __call__(self, pixels):
        return self.augment(pixels.float().div(255).unsqueeze(0))[0]


def to_inputs(pixels, device, augment_on_device):
    """A batch as the model takes it: on the device, floats, augmented there if asked,
    normalised, channels_last (the memory layout convolutions run fastest in on GPUs)."""
    x = pixels.to(device, non_blocking=True)
    if x.dtype == torch.uint8:
        x = x.float().div(255)
        if augment_on_device is not None:
            x = augment_on_device(x)
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1)
    return ((x - mean) / std).contiguous(memory_format=torch.channels_last)


def make_model(name, classes, width, size):
    if name == "kit":
        return ResNet(classes, width=width, small_images=size <= 64)
    try:
        import torchvision
    except Exception as err:  # a wheel built for another torch fails in many ways
        raise KitError(f"--model {name}: torchvision does not import here ({str(err).strip()}); "
                       "use --model kit, the kit's own ResNet-18") from None
    return torchvision.models.resnet18(num_classes=classes)


def configure_optimizer(model, lr, weight_decay):
    """SGD with Nesterov momentum, decay on the convolution and linear weights only."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.SGD(groups, lr=lr, momentum=0.9, nesterov=True)


@torch.no_grad()
def evaluate(model, data_dir, batch_size, rank, world_size, device, precision):
    """(mean loss, accuracy) over the whole validation split, each process a share of it."""
    model.eval()
    val = ImageFiles(data_dir, "val")
    share = Subset(val, range(rank, len(val), world_size))
    totals = torch.zeros(3, device=device)  # loss sum, correct, count
    for pixels, labels in DataLoader(share, batch_size, generator=torch.Generator()):
        x, labels = to_inputs(pixels, device, None), labels.to(device)
        with precision.autocast:
            logits = model(x)
        totals += torch.stack([F.cross_entropy(logits.float(), labels, reduction="sum"),
                               (logits.argmax(1) == labels).sum().float(),
                               torch.tensor(float(len(labels)), device=device)])
    distributed.all_reduce_mean(totals)  # a mean of sums: the ratios below are the whole split's
    model.train()
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


# ----------------------------------------------------------------------------------------------
# Command line and training
# ----------------------------------------------------------------------------------------------
def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default="data/shapes", help="prepared images (coursekit images)")
    parser.add_argument("--layout", choices=["files", "shards"], default="shards")
    parser.add_argument("--out", default="runs/resnet", help="run directory")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    parser.add_argument("--model", choices=["kit", "torchvision-resnet18"], default="kit")
    parser.add_argument("--width", type=positive_int, default=64,
                        help="channels of the kit ResNet's first stage (64: ResNet-18)")
    parser.add_argument("--batch-size", type=positive_int, default=128, help="images per process")
    parser.add_argument("--max-steps", type=positive_int, default=500)
    parser.add_argument("--warmup-steps", type=int,
                        help="linear warm-up steps (default: a tenth of the steps, at most 50)")
    parser.add_argument("--lr", type=positive_float, default=0.1, help="peak learning rate")
    parser.add_argument("--weight-decay", type=non_negative_float, default=5e-4)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    parser.add_argument("--prefetch", type=positive_int, default=2, help="batches each worker "
                        "keeps ready")
    parser.add_argument("--augment", choices=["device", "cpu", "none"], default="device")
    parser.add_argument("--eval-interval", type=positive_int, default=100)
    parser.add_argument("--ckpt-interval", type=positive_int, default=250)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "xpu", "cpu"])
    parser.add_argument("--precision", choices=training.PRECISIONS, default="auto")
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except KitError as err:
        parser.error(str(err))
    return args


def check_args(args):
    images.check_layout(args.data, args.layout)
    if args.warmup_steps is None:
        args.warmup_steps = min(50, args.max_steps // 10)
    if args.workers < 0:
        raise KitError(f"--workers {args.workers}: use 0 (load in this process) or more")
    if not 0 <= args.warmup_steps <= args.max_steps:
        raise KitError(f"--warmup-steps {args.warmup_steps} must be between 0 and --max-steps "
                       f"({args.max_steps})")
    if runs.latest_checkpoint(args.out) is not None and not args.resume:
        raise KitError(f"{args.out} already holds a checkpoint: pass --resume to continue that "
                       "run, or choose another --out")


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    rank, world_size, device = distributed.setup(args.device)
    precision = training.prepare_device(device, args.precision)
    if args.layout == "shards":
        check_shards(args.data, world_size, args.workers)
    meta = images.read_meta(args.data)
    model = make_model(args.model, len(meta["classes"]), args.width, meta["size"] or 224)
    model = model.to(device, memory_format=torch.channels_last)
    ddp_model = DDP(model)
    optimizer = configure_optimizer(model, args.lr, args.weight_decay)
    augment_on_device = augmentation().to(device) if args.augment == "device" else None
    batches = make_batches(args, rank, world_size, device)

    run_dir = Path(args.out)
    runs.make_run_dir(run_dir)
    start_step = resume(run_dir, model, optimizer, batches, precision, device) if args.resume else 0
    config = {"stage": STAGE, "args": vars(args), "world_size": world_size, "device": str(device),
              "precision": precision.description, "classes": meta["classes"],
              "parameters": sum(p.numel() for p in model.parameters()),
              "images_per_step": args.batch_size * world_size}
    if rank == 0:
        runs.start_run(run_dir, config, start_step)
    print(f"{world_size} process(es) | {args.model} ResNet, {config['parameters']:,} parameters | "
          f"{args.layout} layout, {args.workers} worker(s), augment on {args.augment} | "
          f"{config['images_per_step']} images per step | {precision.description}")

    stop, done, stream = training.StopSignal(), start_step, iter(batches)
    for step in range(start_step, args.max_steps):
        t0 = time.perf_counter()
        pixels, labels = next(stream)
        waited = time.perf_counter() - t0  # the step's wait for its batch: the input pipeline
        x, labels = to_inputs(pixels, device, augment_on_device), labels.to(device)
        lr = learning_rate(step, args.lr, args.warmup_steps, args.max_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss, grad_norm = train_step(ddp_model, optimizer, precision, x, labels)
        totals = distributed.all_reduce_mean(torch.stack([loss.detach(), stop.flag(device)]))
        loss_value, stopping = totals.tolist()
        dt = time.perf_counter() - t0

        done = step + 1
        record = {"step": done, "loss": loss_value, "lr": lr, "grad_norm": grad_norm.item(),
                  "ms": dt * 1000, "wait_ms": waited * 1000,
                  "images_per_s": config["images_per_step"] / dt,
                  "epoch": batches.epoch + batches.batch / batches.per_epoch}
        if done % args.eval_interval == 0 or done == args.max_steps:
            record["val_loss"], record["val_acc"] = evaluate(model, args.data, args.batch_size,
                                                             rank, world_size, device, precision)
        print(step_line(record, args.max_steps), flush=True)
        if rank == 0:
            runs.append_metrics(run_dir, record)
            if done % args.ckpt_interval == 0 or done == args.max_steps or stopping:
                save_checkpoint(run_dir, done, model, optimizer, batches, precision, device)
        if stopping and done < args.max_steps:
            print(stop.stopped_line(done), flush=True)
            break

    del ddp_model  # its reducer holds the group: free it first
    distributed.finish()
    return 0


def train_step(model, optimizer, precision, x, labels):
    """Forward, backward (under DDP, the gradients are all-reduced as they come), a clipped
    step in the device's precision: (the loss, the gradient norm before clipping)."""
    optimizer.zero_grad(set_to_none=True)
    with precision.autocast:
        loss = F.cross_entropy(model(x).float(), labels)
    precision.scaler.scale(loss).backward()
    precision.scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
    precision.scaler.step(optimizer)
    precision.scaler.update()
    return loss, grad_norm


def step_line(record, max_steps):
    line = (f"step {record['step']}/{max_steps} | loss {record['loss']:.4f} | "
            f"lr {record['lr']:.1e} | {record['ms']:.1f} ms (waited {record['wait_ms']:.1f}) | "
            f"{record['images_per_s']:,.0f} images/s")
    if "val_acc" in record:
        line += f" | val {record['val_loss']:.4f}, accuracy {record['val_acc']:.1%}"
    return line


def save_checkpoint(run_dir, step, model, optimizer, batches, precision, device):
    runs.save_checkpoint(run_dir, step, {
        "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "batches": batches.state_dict(), **training.loop_state(precision, device)})


def resume(run_dir, model, optimizer, batches, precision, device):
    """Restore the newest intact checkpoint, if any; return the number of steps already done."""
    path = runs.checkpoint_to_resume(run_dir)
    if path is None:
        print(f"no checkpoint in {run_dir}: starting from step 0")
        return 0
    step, state = runs.read_checkpoint(path)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    batches.load_state_dict(state["batches"])
    training.restore_loop_state(state, precision, device)
    print(f"resumed from {path} at step {step}")
    return step


if __name__ == "__main__":
    sys.exit(faults.run(main))  # a bad value, a lost peer, a full disk: one line, no traceback
