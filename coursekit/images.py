"""Image data for lesson 08: a data set the kit draws itself, and the two layouts an image data
set takes on a cluster's file system.

    python -m coursekit images prepare --out data/shapes                   # the kit's own
    python -m coursekit images prepare --source ~/imagenette --out data/imagenette --size 128

The kit's own images: ten classes of shapes (a circle, a ring, a triangle, ...) drawn at a random
size, place, angle and colour on a noisy background. Each image comes from its own seed (the
split and its number), so the data set is the same bytes on every machine and in any order of
drawing, owes nothing to anyone's licence, and is learnable without being trivial. A real data set
in ImageNet's folder layout (a folder of images per class, with train/ and val/ folders or without)
goes through the same code: its images are read, resized if --size says so, and encoded again.

Two layouts hold the same encoded images (JPEG by default, as real data sets are; PNG on request):

    OUT/shards/<split>-<nnnnnn>.tar     WebDataset's layout: the images in order inside a few
                                        large tar files, read as streams (always written)
    OUT/files/<split>/<class>/<n>.jpg, OUT/files/<split>/index.csv    one file per image, with
                                        --files only: a file open per image, what a parallel
                                        file system hates, and a file each against the quota
    OUT/meta.json                       the classes, sizes, counts and layouts
"""
import csv
import io
import json
import math
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from tqdm import tqdm

from coursekit import KitError, runs

CLASSES = ("circle", "ring", "triangle", "square", "frame", "dots", "star", "cross", "half-disc",
           "stripes")
FORMATS = {"jpeg": ("jpg", {"quality": 90}), "png": ("png", {})}
SPLITS = {"train": 0, "val": 1}  # part of each image's seed
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp"}
VAL_EVERY = 10  # a folder without train/ and val/: every tenth image of a class is validation


# --- drawing the kit's shapes --------------------------------------------------------------------

def polygon(centre, radius, corners, angle, inner=None):
    """The corners of a regular polygon (or, with an inner radius, a star) around ``centre``."""
    points = []
    steps = corners * (2 if inner else 1)
    for k in range(steps):
        r = inner if inner and k % 2 else radius
        a = angle + 2 * math.pi * k / steps
        points.append((centre[0] + r * math.cos(a), centre[1] + r * math.sin(a)))
    return points


def draw_shape(draw, label, centre, radius, angle, colour, size):
    """One shape of class ``label`` on ``draw``."""
    x, y = centre
    box = (x - radius, y - radius, x + radius, y + radius)
    width = max(1, round(radius / 3))
    name = CLASSES[label]
    if name == "circle":
        draw.ellipse(box, fill=colour)
    elif name == "ring":
        draw.ellipse(box, outline=colour, width=width)
    elif name == "half-disc":
        start = math.degrees(angle)
        draw.pieslice(box, start, start + 180, fill=colour)
    elif name == "cross":
        for a in (angle, angle + math.pi / 2):
            dx, dy = radius * math.cos(a), radius * math.sin(a)
            draw.line((x - dx, y - dy, x + dx, y + dy), fill=colour, width=width)
    elif name == "frame":  # a square's outline
        draw.polygon(polygon(centre, radius, 4, angle), outline=colour, width=width)
    elif name == "dots":  # three small discs on a circle
        for k in range(3):
            a = angle + 2 * math.pi * k / 3
            dx, dy = 0.6 * radius * math.cos(a), 0.6 * radius * math.sin(a)
            r = radius * 0.3
            draw.ellipse((x + dx - r, y + dy - r, x + dx + r, y + dy + r), fill=colour)
    elif name == "stripes":
        dx, dy = math.cos(angle), math.sin(angle)  # three parallel bars across the shape's box
        for offset in (-0.6, 0, 0.6):
            ox, oy = -dy * offset * radius, dx * offset * radius
            draw.line((x + ox - dx * radius, y + oy - dy * radius,
                       x + ox + dx * radius, y + oy + dy * radius), fill=colour,
                      width=max(1, width // 2))
    else:
        corners = {"triangle": 3, "square": 4, "star": 5}[name]
        draw.polygon(polygon(centre, radius, corners, angle,
                             inner=radius * 0.45 if name == "star" else None), fill=colour)


def shape_image(split, index, size):
    """Image ``index`` of ``split``: (its class, a size x size RGB image). The class cycles, so
    every class has the same number of images."""
    rng = np.random.default_rng([SPLITS[split], index])
    label = index % len(CLASSES)
    background = rng.integers(0, 256, 3)
    noise = rng.normal(0, 12, (size, size, 3))
    pixels = np.clip(background + noise, 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels, "RGB")
    colour = tuple(int(c) for c in (background + 128 + rng.integers(-40, 41, 3)) % 256)
    radius = size * rng.uniform(0.28, 0.45)
    centre = tuple(size / 2 + rng.uniform(-0.5, 0.5, 2) * (size - 2 * radius))
    draw_shape(ImageDraw.Draw(image), label, centre, radius, rng.uniform(0, 2 * math.pi),
               colour, size)
    return label, image


# --- reading a real data set ---------------------------------------------------------------------

def folder_classes(root):
    """The class folders of an ImageNet-style data set (of its train/ folder if it has one)."""
    top = root / "train" if (root / "train").is_dir() else root
    classes = sorted(p.name for p in top.iterdir() if p.is_dir())
    if not classes:
        raise KitError(f"--source {root} holds no class folders: give a folder with one folder "
                       "of images per class (ImageNet's layout), or leave --source out")
    return classes


def folder_samples(root, classes):
    """{split: [(class, path), ...]} of an ImageNet-style folder: its train/ and val/ folders, or
    every tenth image of each class for validation."""
    def images(folder):
        return sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)

    if (root / "train").is_dir() and (root / "val").is_dir():
        return {split: [(label, path) for label, name in enumerate(classes)
                        for path in images(root / split / name)] for split in SPLITS}
    samples = {split: [] for split in SPLITS}
    for label, name in enumerate(classes):
        for n, path in enumerate(images(root / name)):
            samples["val" if n % VAL_EVERY == VAL_EVERY - 1 else "train"].append((label, path))
    return samples


def folder_image(path, size):
    image = Image.open(path).convert("RGB")
    return image.resize((size, size), Image.BICUBIC) if size else image


# --- writing both layouts -----------------------------------------------------------------------

def encode(image, image_format):
    suffix, options = FORMATS[image_format]
    buffer = io.BytesIO()
    image.save(buffer, format=image_format.upper(), **options)
    return buffer.getvalue()


def encoded_shape(job):
    split, index, size, image_format = job
    label, image = shape_image(split, index, size)
    return label, encode(image, image_format)


def encoded_file(job):
    label, path, size, image_format = job
    return label, encode(folder_image(path, size), image_format)


def write_split(out, split, encoded, count, classes, image_format, shard_size, files):
    """Write the split's images, in order, as tar shards and, with ``files``, as files with an
    index."""
    import webdataset as wds

    suffix = FORMATS[image_format][0]
    folder = out / "files" / split
    if files:
        for name in classes:
            (folder / name).mkdir(parents=True, exist_ok=True)
    (out / "shards").mkdir(exist_ok=True)
    pattern = str(out / "shards" / f"{split}-%06d.tar")
    index_rows = []
    # mtime fixed: the shards' bytes depend on the images alone, not on when they were written
    with wds.ShardWriter(pattern, maxcount=shard_size, verbose=0, mtime=0) as shards:
        for n, (label, data) in enumerate(tqdm(encoded, total=count, desc=split, unit="image")):
            shards.write({"__key__": f"{n:07d}", suffix: data, "cls": str(label).encode()})
            relative = f"{classes[label]}/{n:07d}.{suffix}"
            index_rows.append((relative, label))
            if files:
                (folder / relative).write_bytes(data)
    if files:
        with open(folder / "index.csv", "w", newline="") as index:
            writer = csv.writer(index)
            writer.writerow(["path", "label"])
            writer.writerows(index_rows)
    return {"images": len(index_rows),
            "shards": sorted(p.name for p in (out / "shards").glob(f"{split}-*.tar"))}


def prepare(out, source=None, size=None, count=6000, image_format="jpeg", shard_size=1000,
            workers=None, val_count=None, files=False):
    """Build OUT/shards (and, with ``files``, OUT/files) and OUT/meta.json from the kit's shapes
    (``source`` None: ``count`` training images and a sixth as many for validation, ``size``
    pixels, 32 by default) or from an ImageNet-style folder. Returns the meta."""
    if image_format not in FORMATS:
        raise KitError(f"--format {image_format!r}: use one of {', '.join(FORMATS)}")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise KitError(f"--out {out} is not empty: choose a new folder (nothing is overwritten)")
    if source is None:
        size = size or 32
        classes = CLASSES
        counts = {"train": count, "val": val_count or max(len(CLASSES), count // 6)}
        jobs = {split: [(split, i, size, image_format) for i in range(n)]
                for split, n in counts.items()}
        work = encoded_shape
    else:
        root = Path(source).expanduser()
        if not root.is_dir():
            raise KitError(f"--source {source} is not a folder")
        classes = folder_classes(root)
        jobs = {split: [(label, path, size, image_format) for label, path in samples]
                for split, samples in folder_samples(root, classes).items()}
        work = encoded_file
    out.mkdir(parents=True, exist_ok=True)
    splits = {}
    with ProcessPoolExecutor(workers) as pool:
        for split, split_jobs in jobs.items():
            encoded = pool.map(work, split_jobs, chunksize=64)
            splits[split] = write_split(out, split, encoded, len(split_jobs), classes,
                                        image_format, shard_size, files)
    meta = {"source": "shapes" if source is None else str(source), "classes": list(classes),
            "size": size, "format": image_format, "shard_size": shard_size,
            "layouts": ["files", "shards"] if files else ["shards"], "splits": splits}
    runs.write_json_atomic(out / "meta.json", meta)
    return meta


def read_meta(data_dir):
    """The meta.json of a prepared image folder, or a KitError saying how to prepare it."""
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        raise KitError(f"no prepared images in {data_dir} (meta.json missing): run "
                       f"`python -m coursekit images prepare --out {data_dir}`")
    return json.loads(path.read_text())


def check_layout(data_dir, layout):
    """A KitError unless the prepared image folder holds ``layout``."""
    # a folder prepared before --files existed holds both layouts
    if layout not in read_meta(data_dir).get("layouts", ["files", "shards"]):
        raise KitError(f"--layout {layout}: {data_dir} holds shards only; use --layout shards, or "
                       f"prepare the images again with --files")
