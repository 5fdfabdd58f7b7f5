"""Lesson 08's stage: a ResNet under DDP resumes a stopped run exactly from either layout, and
refuses bad input in one line. That 2 processes learn the kit's shapes from the sharded layout, each
reading its own shards with its loader worker, the lesson's own run checks (under nbval)."""
import signal
import subprocess
import sys

import pytest

from conftest import ONE_THREAD, kit_env, made_once, run_python, run_stage, stage_command
from coursekit import KIT_ROOT, images, runs, stages
from helpers import interrupt

pytestmark = pytest.mark.stages
RESNET = KIT_ROOT / "solutions" / "train_resnet_ddp.py"
SCRIPT = RESNET.name
#: a ResNet-18 a quarter as wide, 32 images per process and step, on this machine's CPU
SMALL = ["--width", "16", "--batch-size", "32", "--lr", "0.2", "--device", "cpu"]


@pytest.fixture(scope="session")
def shapes(tmp_path_factory):
    """The kit's images, as `coursekit images prepare` writes them: 6,000 for training."""
    return made_once(tmp_path_factory, "shapes", lambda out: images.prepare(out, workers=1, files=True))


SHORT_RUN = [*SMALL, "--max-steps", "12", "--eval-interval", "6", "--ckpt-interval", "100"]


@pytest.mark.parametrize("layout, workers", [("files", "0"), ("shards", "2")])
def test_a_stopped_run_resumes_exactly_where_it_stopped(shapes, tmp_path, layout, workers):
    """SIGUSR1 at step 5: checkpoint, exit 0; --resume then trains steps 6-12 exactly as the
    uninterrupted run did (the same batches of the same shuffle or stream, the same augmentation
    and weights). The stream's batches come from 2 loader workers in turn."""
    run = [*SHORT_RUN, "--layout", layout, "--workers", workers, "--data", shapes]
    whole = run_stage(SCRIPT, *run, "--out", tmp_path / "whole", env=kit_env(ONE_THREAD))
    assert whole.returncode == 0, whole.stderr[-3000:]
    command = stage_command(SCRIPT, *run, "--out", tmp_path / "cut")
    process = interrupt.start(command, kit_env(ONE_THREAD))
    lines = interrupt.read_until(process, "step 5/")
    process.send_signal(signal.SIGUSR1)
    returncode, output = interrupt.finish(process, lines)
    stopped_at = runs.load_checkpoint(tmp_path / "cut")[0]
    assert returncode == 0 and f"SIGUSR1 received: checkpoint saved at step {stopped_at}" in output
    assert 5 <= stopped_at < 12
    resumed = run_python([*command, "--resume"], kit_env(ONE_THREAD), timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    expected, got = runs.read_metrics(tmp_path / "whole"), runs.read_metrics(tmp_path / "cut")
    assert [r["step"] for r in got] == list(range(1, 13))
    for a, b in zip(got, expected, strict=True):
        assert (a["loss"], a["lr"], a.get("val_acc")) == (b["loss"], b["lr"], b.get("val_acc"))


@pytest.mark.parametrize("args, message", [
    (["--workers", "-1"], "--workers -1: use 0 (load in this process) or more"),
    (["--warmup-steps", "900", "--max-steps", "10"],
     "--warmup-steps 900 must be between 0 and --max-steps (10)"),
    (["--layout", "tar"], "argument --layout: invalid choice: 'tar'"),
])
def test_bad_arguments_are_one_line(shapes, tmp_path, capsys, args, message):
    resnet = stages.load_script(RESNET)
    with pytest.raises(SystemExit) as stopped:
        resnet.parse_args(["--data", str(shapes), "--out", str(tmp_path / "r"), *args])
    stderr = capsys.readouterr().err
    assert stopped.value.code == 2 and message in stderr and stderr.count("\n") == 1, stderr


def test_missing_images_say_how_to_prepare_them(tmp_path, capsys):
    with pytest.raises(SystemExit):
        stages.load_script(RESNET).parse_args(["--data", str(tmp_path / "none")])
    assert (f"no prepared images in {tmp_path / 'none'} (meta.json missing): run `python -m "
            f"coursekit images prepare --out {tmp_path / 'none'}`") in capsys.readouterr().err


def test_the_files_layout_of_images_prepared_as_shards_only_is_one_line(tmp_path, capsys):
    images.prepare(tmp_path / "lean", count=20, shard_size=10, workers=1)
    capsys.readouterr()  # the progress bars
    with pytest.raises(SystemExit) as stopped:
        stages.load_script(RESNET).parse_args(["--data", str(tmp_path / "lean"), "--layout", "files"])
    stderr = capsys.readouterr().err
    assert stopped.value.code == 2, stderr
    assert stderr.count("\n") == 1, stderr
    assert stderr.endswith(f"error: --layout files: {tmp_path / 'lean'} holds shards only; use "
                           "--layout shards, or prepare the images again with --files\n")


def test_more_shard_readers_than_shards_stop_the_script_with_one_line(shapes, tmp_path):
    result = run_stage(SCRIPT, *SMALL, "--data", shapes, "--out", tmp_path, "--layout", "shards",
                       "--workers", "7")
    message = "--layout shards: 6 training shards for 1 process(es) x 7 loader worker(s)"
    assert result.returncode == 1 and message in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().count("\n") == 0, result.stderr


def test_torchvisions_model_trains_where_torchvision_imports_and_says_why_not_elsewhere(shapes,
                                                                                      tmp_path):
    """torchvision's registry wheels need a CUDA torch: with this kit's CPU torch they do not
    import, and the script says so in one line; beside a GPU's torch, its resnet18 trains."""
    imports = subprocess.run([sys.executable, "-c", "import torchvision"],
                             capture_output=True).returncode == 0
    result = run_stage(SCRIPT, *SMALL, "--data", shapes, "--out", tmp_path, "--model",
                       "torchvision-resnet18", "--max-steps", "1")
    if imports:
        assert result.returncode == 0, result.stderr[-2000:]
        assert len(runs.read_metrics(tmp_path)) == 1
    else:
        message = "--model torchvision-resnet18: torchvision does not import here"
        assert result.returncode == 1 and message in result.stderr, result.stderr[-2000:]
        assert result.stderr.strip().count("\n") == 0, result.stderr
