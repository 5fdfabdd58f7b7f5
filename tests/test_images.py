"""Lesson 08's images: the kit's shapes are the same bytes however they are drawn, both layouts
hold the same images, a file per image only on request, a real data set in ImageNet's folder
layout goes through the same code, and bad input is one line."""
import csv
import hashlib
import io
import subprocess
import sys
import tarfile

import pytest
from PIL import Image

from coursekit import KIT_ROOT, KitError, images

pytestmark = pytest.mark.unit


def digests(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    out = tmp_path_factory.mktemp("shapes") / "data"
    return out, images.prepare(out, count=60, shard_size=25, workers=1, files=True)


def test_the_shapes_are_the_same_bytes_however_many_processes_draw_them(shapes, tmp_path):
    out, meta = shapes
    again = images.prepare(tmp_path / "again", count=60, shard_size=25, workers=2, files=True)
    assert again == meta
    assert digests(tmp_path / "again") == digests(out)


def test_without_files_the_command_writes_the_same_shards_and_no_file_per_image(shapes, tmp_path):
    """A quota counts files: 100,000 images are a few hundred shards, or 100,000 files more."""
    out, meta = shapes
    result = subprocess.run([sys.executable, "-m", "coursekit", "images", "prepare", "--out",
                             str(tmp_path / "lean"), "--count", "60", "--shard-size", "25",
                             "--workers", "1"], capture_output=True, text=True, cwd=KIT_ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "train 60 images in 3 shard(s)" in result.stdout and "file per image" not in result.stdout
    lean = images.read_meta(tmp_path / "lean")
    assert not (tmp_path / "lean" / "files").exists()
    assert (lean["layouts"], meta["layouts"]) == (["shards"], ["files", "shards"])
    assert digests(tmp_path / "lean" / "shards") == digests(out / "shards")
    assert {**lean, "layouts": None} == {**meta, "layouts": None}


def test_every_class_has_its_share_in_both_splits(shapes):
    out, meta = shapes
    assert meta["classes"] == list(images.CLASSES) and meta["size"] == 32
    assert {split: s["images"] for split, s in meta["splits"].items()} == {"train": 60, "val": 10}
    assert meta["splits"]["train"]["shards"] == ["train-000000.tar", "train-000001.tar",
                                                 "train-000002.tar"]
    for split in ("train", "val"):
        rows = list(csv.DictReader(open(out / "files" / split / "index.csv")))
        labels = [int(row["label"]) for row in rows]
        assert sorted(set(labels)) == list(range(10)) and len(set(map(labels.count, set(labels)))) == 1
        first = Image.open(out / "files" / split / rows[0]["path"])
        assert (first.format, first.size, first.mode) == ("JPEG", (32, 32), "RGB")


def test_the_shards_hold_the_files_images_in_order(shapes):
    out, meta = shapes
    rows = list(csv.DictReader(open(out / "files" / "train" / "index.csv")))
    in_shards = []
    for name in meta["splits"]["train"]["shards"]:
        with tarfile.open(out / "shards" / name) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        keys = sorted({name.split(".")[0] for name in members})
        in_shards += [(members[f"{key}.jpg"], int(members[f"{key}.cls"])) for key in keys]
    assert len(in_shards) == len(rows) == 60
    for (data, label), row in zip(in_shards, rows, strict=True):
        assert data == (out / "files" / "train" / row["path"]).read_bytes()
        assert label == int(row["label"])


def test_an_imagenet_style_folder_goes_through_the_same_code(tmp_path):
    source = tmp_path / "source"
    for name in ("cats", "dogs"):
        (source / name).mkdir(parents=True)
        for n in range(10):
            _, image = images.shape_image("train", n, 48)
            image.save(source / name / f"{n}.png")
    meta = images.prepare(tmp_path / "out", source=source, size=16, shard_size=100, workers=1,
                          files=True)
    assert meta["classes"] == ["cats", "dogs"] and meta["size"] == 16
    assert {split: s["images"] for split, s in meta["splits"].items()} == {"train": 18, "val": 2}
    rows = list(csv.DictReader(open(tmp_path / "out" / "files" / "val" / "index.csv")))
    assert [row["label"] for row in rows] == ["0", "1"]  # each class's tenth image
    resized = Image.open(io.BytesIO((tmp_path / "out" / "files" / "val" / rows[0]["path"]).read_bytes()))
    assert resized.size == (16, 16)


@pytest.mark.parametrize("make, kwargs, message", [
    (lambda d: (d / "out").mkdir() or (d / "out" / "x").write_text("x"), {},
     "--out {d}/out is not empty: choose a new folder (nothing is overwritten)"),
    (lambda d: None, {"source": "{d}/missing"}, "--source {d}/missing is not a folder"),
    (lambda d: (d / "flat").mkdir(), {"source": "{d}/flat"},
     "--source {d}/flat holds no class folders: give a folder with one folder of images per class"),
    (lambda d: None, {"image_format": "gif"}, "--format 'gif': use one of jpeg, png"),
], ids=["not-empty", "no-source", "no-classes", "format"])
def test_bad_input_is_one_line_and_overwrites_nothing(tmp_path, make, kwargs, message):
    make(tmp_path)
    before = digests(tmp_path), sorted(tmp_path.rglob("*"))
    kwargs = {key: value.format(d=tmp_path) for key, value in kwargs.items()}
    with pytest.raises(KitError) as error:
        images.prepare(tmp_path / "out", count=10, **kwargs)
    assert str(error.value).startswith(message.format(d=tmp_path))
    assert (digests(tmp_path), sorted(tmp_path.rglob("*"))) == before  # nothing written or made


def test_the_command_line_reports_a_bad_source_in_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "coursekit", "images", "prepare", "--out",
                             str(tmp_path / "out"), "--source", str(tmp_path / "none")],
                            capture_output=True, text=True, cwd=KIT_ROOT)
    assert result.returncode == 2
    assert result.stderr == f"error: --source {tmp_path / 'none'} is not a folder\n"
