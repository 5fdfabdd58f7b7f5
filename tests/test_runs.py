"""Run directories: metrics.jsonl, atomic JSON, checkpoints in safetensors + JSON."""
import hashlib
import io
import json
import os
import shutil
import stat

import pytest
import torch

from conftest import CreatesFile
from coursekit import KitError, runs

pytestmark = pytest.mark.unit


def trained_optimizer():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_optimizer_state_round_trips_through_a_checkpoint(tmp_path):
    model, optimizer = trained_optimizer()
    runs.save_checkpoint(tmp_path, 7, {"optimizer": optimizer.state_dict(), "note": "x"})
    step, state = runs.load_checkpoint(tmp_path)
    assert step == 7 and state["note"] == "x"

    fresh = torch.optim.AdamW(model.parameters(), lr=5.0)
    fresh.load_state_dict(state["optimizer"])
    original, restored = optimizer.state_dict(), fresh.state_dict()
    assert restored["param_groups"][0]["lr"] == 1e-3
    assert list(restored["state"]) == list(original["state"])  # int keys survive JSON
    for index, slots in original["state"].items():
        for name, tensor in slots.items():
            assert torch.equal(restored["state"][index][name], tensor)


def test_tied_tensors_are_stored_once(tmp_path):
    shared = torch.randn(5, 3)
    skeleton, tensors = runs.flatten_state({"wte": shared, "lm_head": shared, "other": shared.clone()})
    assert len(tensors) == 2 and skeleton["wte"] == skeleton["lm_head"]
    runs.save_checkpoint(tmp_path, 1, {"wte": shared, "lm_head": shared})
    _, state = runs.load_checkpoint(tmp_path)
    assert torch.equal(state["wte"], shared) and torch.equal(state["lm_head"], shared)


def test_checkpoint_holds_no_pickle(tmp_path):
    model, optimizer = trained_optimizer()
    path = runs.save_checkpoint(tmp_path, 3, {"model": model.state_dict(), "opt": optimizer.state_dict()})
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "state.json", "tensors.safetensors"]
    json.loads((path / "state.json").read_text())


def test_only_the_newest_checkpoints_are_kept_and_latest_points_to_the_last(tmp_path):
    for step in (10, 20, 30):
        runs.save_checkpoint(tmp_path, step, {"w": torch.full((2,), float(step))})
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_00000020", "step_00000030"]
    step, state = runs.load_checkpoint(tmp_path)
    assert step == 30 and state["w"][0] == 30


def test_an_interrupted_save_leaves_the_previous_checkpoint_usable(tmp_path):
    runs.save_checkpoint(tmp_path, 10, {"w": torch.ones(2)})
    half_written = tmp_path / "ckpt" / ".step_00000020.tmp"
    half_written.mkdir()
    (half_written / "tensors.safetensors").write_bytes(b"\x00" * 5)
    step, state = runs.load_checkpoint(tmp_path)
    assert step == 10 and torch.equal(state["w"], torch.ones(2))


def test_no_checkpoint_is_none(tmp_path):
    assert runs.load_checkpoint(tmp_path) is None


def test_metrics_truncate_and_partial_lines(tmp_path):
    for step in range(1, 6):
        runs.append_metrics(tmp_path, {"step": step, "loss": 1.0 / step})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # a job killed mid-write
    assert [r["step"] for r in runs.read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
    runs.truncate_metrics(tmp_path, 3)
    assert [r["step"] for r in runs.read_metrics(tmp_path)] == [1, 2, 3]


def test_json_is_written_atomically(tmp_path):
    runs.write_json_atomic(tmp_path / "config.json", {"a": 1})
    assert runs.read_json(tmp_path / "config.json") == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_start_run_keeps_the_metrics_up_to_the_resumed_step(tmp_path):
    for step in range(1, 6):
        runs.append_metrics(tmp_path, {"step": step})
    runs.start_run(tmp_path, {"stage": "std"}, 2)
    assert [r["step"] for r in runs.read_metrics(tmp_path)] == [1, 2]
    assert runs.read_json(tmp_path / "config.json") == {"stage": "std", "data_manifest": None}
    runs.start_run(tmp_path, {"stage": "std"}, 0)  # a fresh run in the same directory
    assert runs.read_metrics(tmp_path) == []


def test_start_run_records_the_manifest_of_its_data(tmp_path, builtin_data):
    runs.start_run(tmp_path, {"stage": "std", "args": {"data": str(builtin_data)}}, 0)
    recorded = runs.read_json(tmp_path / "config.json")["data_manifest"]
    assert recorded["files"] == {shard.name: hashlib.sha256(shard.read_bytes()).hexdigest()
                                 for shard in sorted(builtin_data.glob("*.npy"))}
    assert runs.verify_data(tmp_path) == (recorded, [])


def test_verify_data_names_each_file_that_differs(tmp_path, builtin_data):
    run_dir, copy = tmp_path / "run", tmp_path / "data"
    run_dir.mkdir()
    shutil.copytree(builtin_data, copy)
    runs.start_run(run_dir, {"stage": "std", "args": {"data": str(copy)}}, 0)
    shard = bytearray((copy / "val_000000.npy").read_bytes())
    shard[-1] ^= 1  # one token changed
    (copy / "val_000000.npy").write_bytes(bytes(shard))
    (copy / "train_000000.npy").unlink()
    (copy / "train_000001.npy").write_bytes(b"")
    _, problems = runs.verify_data(run_dir)
    assert problems == ["train_000000.npy missing", "val_000000.npy changed",
                        "train_000001.npy not in the manifest"]


def test_a_new_run_directory_is_its_owners_alone(tmp_path):
    run_dir = runs.make_run_dir(tmp_path / "runs" / "mine")
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700


def tampered(tmp_path, change):
    """A saved checkpoint after `change(checkpoint directory)`; loading it must stop in one line."""
    runs.save_checkpoint(tmp_path, 4, {"w": torch.ones(3)})
    change(runs.latest_checkpoint(tmp_path))
    with pytest.raises(KitError) as refused:
        runs.load_checkpoint(tmp_path)
    return str(refused.value)


def test_a_checkpoint_file_changed_since_it_was_written_is_not_resumed_from(tmp_path):
    def flip_a_byte(path):
        data = bytearray((path / "tensors.safetensors").read_bytes())
        data[-1] ^= 1
        (path / "tensors.safetensors").write_bytes(bytes(data))
    message = tampered(tmp_path, flip_a_byte)
    assert "tensors.safetensors: changed, added or removed" in message and "\n" not in message


def test_a_file_added_to_a_checkpoint_is_not_resumed_from(tmp_path):
    message = tampered(tmp_path, lambda path: (path / "extra.distcp").write_bytes(b"\x80\x04."))
    assert "extra.distcp: changed, added or removed" in message


def test_a_checkpoint_others_could_write_is_not_resumed_from(tmp_path):
    def open_to_everyone(path):
        tmp_path.chmod(0o755)  # others can reach into the run directory...
        path.chmod(0o777)  # ...and write in its checkpoint
    message = tampered(tmp_path, open_to_everyone)
    assert "is writable by other users (mode 777)" in message


def test_a_private_run_directory_resumes_whatever_the_umask_left_inside(tmp_path):
    """With umask 002 (common where each user has a group of their own) files come out
    group-writable; inside a run directory no one else can enter, that is harmless."""
    runs.save_checkpoint(runs.make_run_dir(tmp_path / "run"), 4, {"w": torch.ones(3)})
    for path in (tmp_path / "run").rglob("*"):
        path.chmod(stat.S_IMODE(path.stat().st_mode) | stat.S_IWGRP)
    assert runs.load_checkpoint(tmp_path / "run")[0] == 4


def test_a_checkpoint_someone_else_owns_is_not_resumed_from(tmp_path):
    if os.getuid() != 0:
        pytest.skip("giving a file to another user needs root (the suite runs as root on CI)")
    message = tampered(tmp_path, lambda path: os.chown(path / "state.json", 65534, -1))
    assert "belongs to user id 65534, not to you" in message


def break_truncated_tensors(path):
    tensors = path / "tensors.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:tensors.stat().st_size // 2])


def break_missing_state(path):
    (path / "state.json").unlink()


def break_bad_json(path):
    (path / "state.json").write_text('{"step": 4, "state": ')


@pytest.mark.parametrize("breaks", [break_truncated_tensors, break_missing_state, break_bad_json],
                         ids=["truncated tensors", "missing file", "bad JSON"])
def test_a_broken_newest_checkpoint_gives_way_to_the_one_before(tmp_path, capsys, breaks):
    runs.save_checkpoint(tmp_path, 2, {"w": torch.full((3,), 2.0)})
    runs.save_checkpoint(tmp_path, 4, {"w": torch.full((3,), 4.0)})
    newest = runs.latest_checkpoint(tmp_path)
    breaks(newest)
    step, state = runs.load_checkpoint(tmp_path)
    assert step == 2 and torch.equal(state["w"], torch.full((3,), 2.0))
    warning = capsys.readouterr().err
    assert warning.count("\n") == 1 and warning.startswith(f"warning: checkpoint {newest} differs")
    assert warning.endswith(f"resuming from {tmp_path / 'ckpt' / 'step_00000002'} instead\n")


def test_what_a_sharded_checkpoint_keeps_beside_tensors_is_read_as_data(tmp_path):
    """Issue 47, item 9: DCP reads the state that is not a tensor (the data loader's position)
    with torch.load; a crafted object there is refused in one line, and runs nothing."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from coursekit import dcp_data
    marker = tmp_path / "the-attackers-code-ran"
    crafted, plain = io.BytesIO(), io.BytesIO()
    torch.save(CreatesFile(marker), crafted)
    torch.save({"shard": 1, "offset": 2048}, plain)
    planner = dcp_data.DataOnlyLoadPlanner(flatten_state_dict=False)
    planner.state_dict = {}
    index = MetadataIndex("train_loader")
    item = ReadItem(LoadItemType.BYTE_IO, index, torch.Size([0]), index, torch.Size([0]),
                    torch.Size([0]))
    planner.load_bytes(item, io.BytesIO(plain.getvalue()))
    assert planner.state_dict == {"train_loader": {"shard": 1, "offset": 2048}}
    with pytest.raises(KitError) as refused:
        planner.load_bytes(item, io.BytesIO(crafted.getvalue()))
    assert str(refused.value).startswith("train_loader in the checkpoint holds more than tensors "
                                         "and plain values: it is not loaded (")
    assert "\n" not in str(refused.value) and not marker.exists()
