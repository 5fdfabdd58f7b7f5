"""Images a second through lesson 08's input pipeline (solutions/train_resnet_ddp.py), stage by
stage: decoding only, decoding and augmenting in the loader (CPU), decoding in the loader and
augmenting on the device, and the whole training step; with 0, 1 and 2 loader workers, from the
per-file layout and from the WebDataset shards.

Each figure is coursekit.pipeline.samples_per_second over --batches batches of --batch-size
images, after 2 batches that start the workers. The data set is the kit's shapes (prepared in
data/shapes if missing); the model, for the full step, the kit's ResNet-18 at --width. On a CPU,
"the device" is the same cores that decode: the device-augmentation figure then shows what a
batched augmentation costs against a per-image one, not what a GPU takes off the CPU. Writes
benchmarks/results/input_pipeline.json.

    .venv/bin/python benchmarks/input_pipeline.py [--batches 20] [--batch-size 64] [--width 16]
"""
import argparse
import tempfile
import time

import torch
from throughput import machine

from coursekit import KIT_ROOT, images, pipeline, runs, stages, training

RESULTS = KIT_ROOT / "benchmarks" / "results" / "input_pipeline.json"
DATA = KIT_ROOT / "data" / "shapes"
STAGE = stages.load_script(KIT_ROOT / "solutions" / "train_resnet_ddp.py")
LAYOUTS = ("files", "shards")
WORKERS = (0, 1, 2)
MODES = ("decode", "decode + augment (CPU)", "decode + augment (device)", "full step")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def batches(layout, workers, mode, batch_size, out):
    """The stage's own loader for one process, as its flags would make it."""
    augment = "cpu" if mode == "decode + augment (CPU)" else "device"
    args = STAGE.parse_args(["--data", str(DATA), "--layout", layout, "--workers", str(workers),
                             "--batch-size", str(batch_size), "--augment", augment,
                             "--out", str(out)])
    return STAGE.make_batches(args, 0, 1, DEVICE)


def step_work(mode, width):
    """What the training loop does with each batch in this mode: nothing, the copy and the
    device's augmentation, or those and the step."""
    if mode in MODES[:2]:
        return None
    augment = STAGE.augmentation().to(DEVICE)
    if mode == "decode + augment (device)":
        return lambda pixels, labels: STAGE.to_inputs(pixels, DEVICE, augment)
    meta = images.read_meta(DATA)
    model = STAGE.make_model("kit", len(meta["classes"]), width, meta["size"])
    model = model.to(DEVICE, memory_format=torch.channels_last)
    optimizer = STAGE.configure_optimizer(model, 0.1, 5e-4)
    precision = training.prepare_device(DEVICE)

    def step(pixels, labels):
        STAGE.train_step(model, optimizer, precision, STAGE.to_inputs(pixels, DEVICE, augment),
                         labels.to(DEVICE))
    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=16, help="the ResNet's first channels")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if not (DATA / "meta.json").exists():
        images.prepare(DATA, files=True)
    torch.set_num_threads(1)  # the main process's share of the cores, as under the stage's jobs
    result = {"benchmark": "images/s through train_resnet_ddp.py's input pipeline, per stage",
              "batches": args.batches, "batch_size": args.batch_size, "width": args.width,
              "image_size": images.read_meta(DATA)["size"], "date": time.strftime("%Y-%m-%d"),
              "machine": machine(), "images_per_s": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for layout in LAYOUTS:
            for mode in MODES:
                work = step_work(mode, args.width)
                for workers in WORKERS:
                    loader = batches(layout, workers, mode, args.batch_size, tmp)
                    rate = pipeline.samples_per_second(loader, args.batches, work)
                    result["images_per_s"][f"{layout} | {mode} | {workers} workers"] = rate
                    print(f"{layout:6s} | {mode:26s} | {workers} worker(s): {rate:8,.0f} images/s",
                          flush=True)
    runs.write_json_atomic(args.out, result)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
