"""Run directories: what a training run leaves behind for lessons, plots and a resumed job.

    RUN_DIR/config.json      arguments, preset, model and batch arithmetic, device, data manifest
    RUN_DIR/metrics.jsonl    one JSON object per optimiser step (the same numbers as the printed line)
    RUN_DIR/ckpt/step_NNNNNNNN/{tensors.safetensors,state.json}
    RUN_DIR/ckpt/latest.json which checkpoint is the newest
    RUN_DIR/sample.txt       text generated at the end

Everything is written atomically (a temporary file or directory, then a rename), so a job killed at
any moment leaves either the old file or the new one, never half of one.

A checkpoint is code as much as data where its format unpickles: the kit's own (std, ddp) holds
tensors in safetensors and the rest in JSON and unpickles nothing, but PyTorch's distributed
checkpoints (fsdp, tp, pp) read their `.metadata` with pickle, and DeepSpeed's ZeRO states (lora)
load with `weights_only=False`. So a run directory is created readable by its owner alone, every
published checkpoint carries a manifest of its files' SHA-256, and a resume refuses a checkpoint
that someone else owns or could have written. One whose files no longer match its manifest is
broken (or was changed): a resume warns and takes the one before it.
"""
import hashlib
import json
import os
import shutil
import stat
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from coursekit import KitError, data, faults

KEEP_CHECKPOINTS = 2


def write_json_atomic(path, obj):
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # writers may race (HPO workers)
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path):
    return json.loads(Path(path).read_text())


def make_run_dir(run_dir):
    """Create RUN_DIR, and its parents, if need be. RUN_DIR is its owner's alone (0700) however it
    came to exist (`mkdir -p` makes it 0755): it holds checkpoints and logs. One that was open and
    holds files is closed only if no one else wrote, or could have written, any of them."""
    run_dir = Path(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    run_dir.mkdir(mode=0o700, exist_ok=True)
    if stat.S_IMODE(run_dir.stat().st_mode) & 0o077 and any(run_dir.iterdir()):
        refuse_unless_private(run_dir, *run_dir.rglob("*"))
    keep_private(run_dir)
    return run_dir


def keep_private(path):
    """Close ``path`` to other users (0700 for a folder, 0600 for a file); one line if it is not
    its user's to close."""
    info = Path(path).stat()
    if info.st_uid != os.getuid():
        raise KitError(f"{path} belongs to user id {info.st_uid}, not to you: the kit writes only "
                       "where you alone can read (choose a folder of your own)")
    Path(path).chmod(0o700 if stat.S_ISDIR(info.st_mode) else 0o600)


def refuse_unless_private(run_dir, *inside):
    """Stop with one line if someone else could have written what a resume reads: RUN_DIR or a
    path inside it owned by another user, or, where other users can reach into RUN_DIR at all
    (its mode lets them), one of these paths writable by them."""
    for path in (run_dir, *inside):
        info = Path(path).stat()
        if info.st_uid != os.getuid():
            raise KitError(f"{path} belongs to user id {info.st_uid}, not to you: the kit resumes "
                           "only from checkpoints you wrote (start a fresh --out)")
    if stat.S_IMODE(Path(run_dir).stat().st_mode) & 0o077 == 0:
        return  # no one else can reach anything inside, whatever the modes in there
    for path in (run_dir, *inside):
        mode = stat.S_IMODE(Path(path).stat().st_mode)
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise KitError(f"{path} is writable by other users (mode {mode:o}): use it only after "
                           f"`chmod -R go-w {run_dir}`, if no one else has written to it")


def start_run(run_dir, config, start_step):
    """Write config.json, with the data's manifest for lineage, and keep the metrics of steps up
    to ``start_step``: a fresh run starts an empty log, a resumed one re-does the steps after its
    checkpoint."""
    truncate_metrics(run_dir, start_step)
    data_dir = config.get("args", {}).get("data")
    write_json_atomic(Path(run_dir) / "config.json",
                      {**config, "data_manifest": data_manifest(data_dir) if data_dir else None})


def data_manifest(data_dir):
    """{"dir", "files": {name: sha256}, "sha256"} of a prepared data directory (one hash that
    names the exact data a run saw), or None for data that is not a local prepared directory."""
    meta = Path(data_dir) / "meta.json"
    if not meta.is_file() or "manifest" not in read_json(meta):
        return None
    files = read_json(meta)["manifest"]
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    return {"dir": str(Path(data_dir).resolve()), "files": files, "sha256": digest}


def verify_data(run_dir, data_dir=None):
    """Compare a data directory (by default the one the run recorded) with the manifest in the
    run's config.json; returns (manifest, problems), problems empty when every file matches."""
    config_path = Path(run_dir) / "config.json"
    if not config_path.is_file():
        raise KitError(f"{run_dir} is not a run directory (no config.json)")
    recorded = read_json(config_path).get("data_manifest")
    if not recorded:
        raise KitError(f"{run_dir} recorded no data manifest (its data had no meta.json "
                       "manifest, or the run predates lineage)")
    data_dir = Path(data_dir or recorded["dir"])
    problems = []
    for name, digest in sorted(recorded["files"].items()):
        path = data_dir / name
        if not path.is_file():
            problems.append(f"{name} missing")
        elif data.sha256_file(path) != digest:
            problems.append(f"{name} changed")
    data_files = {p.name for p in data_dir.glob("*") if p.suffix in (".npy", ".jsonl")}
    problems += [f"{name} not in the manifest" for name in sorted(data_files - set(recorded["files"]))]
    return recorded, problems



# --- metrics.jsonl ---------------------------------------------------------------------------

def append_metrics(run_dir, record):
    """Append one step's record; a line is flushed at once so live plots can follow the run."""
    with open(Path(run_dir) / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def read_metrics(run_dir):
    """All complete records of a run (a line still being written is skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def truncate_metrics(run_dir, last_step):
    """Keep the records up to ``last_step``: a resumed run re-does the steps after its checkpoint."""
    kept = [r for r in read_metrics(run_dir) if r["step"] <= last_step]
    path = Path(run_dir) / "metrics.jsonl"
    tmp = path.with_name(".metrics.jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)


# --- nested state <-> (flat tensors, JSON skeleton) ------------------------------------------
# An optimizer's state_dict mixes tensors, numbers, tuples and int-keyed dicts. It is split into a
# flat {name: tensor} dict for safetensors and a JSON skeleton that says where each tensor goes.

def flatten_state(obj, prefix="", tensors=None, seen=None):
    """Return (skeleton, tensors). Tensors sharing storage (tied weights) are stored once."""
    tensors = {} if tensors is None else tensors
    seen = {} if seen is None else seen
    if isinstance(obj, torch.Tensor):
        key = (obj.untyped_storage().data_ptr(), obj.storage_offset(), tuple(obj.shape), obj.dtype)
        if key not in seen:
            seen[key] = prefix or "tensor"
            tensors[seen[key]] = obj.detach().cpu().contiguous()
        return {"__tensor__": seen[key]}, tensors
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: flatten_state(v, f"{prefix}{k}.", tensors, seen)[0]
                    for k, v in obj.items()}, tensors
        return {"__items__": [[k, flatten_state(v, f"{prefix}{k}.", tensors, seen)[0]]
                              for k, v in obj.items()]}, tensors
    if isinstance(obj, (list, tuple)):
        return [flatten_state(v, f"{prefix}{i}.", tensors, seen)[0]
                for i, v in enumerate(obj)], tensors
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj, tensors
    raise TypeError(f"cannot store a {type(obj).__name__} in a checkpoint")


def unflatten_state(skeleton, tensors):
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            return tensors[skeleton["__tensor__"]]
        if "__items__" in skeleton:
            return {k: unflatten_state(v, tensors) for k, v in skeleton["__items__"]}
        return {k: unflatten_state(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [unflatten_state(v, tensors) for v in skeleton]
    return skeleton


# --- checkpoints -----------------------------------------------------------------------------

def checkpoint_dir(run_dir):
    return Path(run_dir) / "ckpt"


def latest_checkpoint(run_dir):
    """The newest complete checkpoint directory, or None."""
    pointer = checkpoint_dir(run_dir) / "latest.json"
    if not pointer.exists():
        return None
    return checkpoint_dir(run_dir) / read_json(pointer)["dir"]


def save_checkpoint(run_dir, step, state):
    """Write ``state`` (nested dicts of tensors and JSON values) as checkpoint ``step``."""
    tmp = unpublished_checkpoint(run_dir, step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    skeleton, tensors = flatten_state(state)
    with room_for_checkpoint(run_dir, step, state_bytes(tensors)):
        save_file(tensors, tmp / "tensors.safetensors")
        write_json_atomic(tmp / "state.json", {"step": step, "state": skeleton})
        return publish_checkpoint(run_dir, step)


def state_bytes(state):
    """The bytes of the tensors in nested ``state``: whole tensors, every rank's shards of a
    sharded (DTensor) one, which is what a checkpoint of them takes on a shared file system."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    values = state.values() if isinstance(state, dict) else state
    return sum(map(state_bytes, values)) if isinstance(state, (dict, list, tuple)) else 0


@contextmanager
def room_for_checkpoint(run_dir, step, needed):
    """Write checkpoint ``step`` (``needed`` bytes) inside this block, where the disk or the
    quota may run out. Then the half-written checkpoint goes, the one before it and
    metrics.jsonl stay as they were, and the run stops with one line that says how much room
    the checkpoint needs."""
    try:
        yield
    except Exception as err:
        reason = faults.out_of_room(err)
        if reason is None:
            raise
        shutil.rmtree(unpublished_checkpoint(run_dir, step), ignore_errors=True)
        free = shutil.disk_usage(checkpoint_dir(run_dir)).free
        before = latest_checkpoint(run_dir)
        kept = f"{before} is intact" if before else "there is no earlier checkpoint"
        raise KitError(f"no room to write checkpoint {checkpoint_dir(run_dir)}/step_{step:08d} "
                       f"({reason}): it needs {needed:,} bytes and its file system has {free:,} "
                       f"free; {kept}: make room, or give --out another place, and run again "
                       "with --resume") from None


def unpublished_checkpoint(run_dir, step):
    """Where checkpoint ``step`` is written before it is complete (hidden from resume)."""
    return checkpoint_dir(run_dir) / f".step_{step:08d}.tmp"


def publish_checkpoint(run_dir, step):
    """Make the complete checkpoint ``step`` the one a resume finds, in one rename, with the
    manifest of its files; keep the newest few."""
    ckpt_root = checkpoint_dir(run_dir)
    write_json_atomic(unpublished_checkpoint(run_dir, step) / MANIFEST,
                      file_hashes(unpublished_checkpoint(run_dir, step)))
    final = ckpt_root / f"step_{step:08d}"
    shutil.rmtree(final, ignore_errors=True)
    os.replace(unpublished_checkpoint(run_dir, step), final)
    write_json_atomic(ckpt_root / "latest.json", {"dir": final.name, "step": step})
    _prune_checkpoints(ckpt_root, keep=KEEP_CHECKPOINTS)
    return final


def _prune_checkpoints(ckpt_root, keep):
    for old in sorted(ckpt_root.glob("step_*"))[:-keep]:
        shutil.rmtree(old)


MANIFEST = "manifest.json"


def file_hashes(folder):
    """{path relative to folder: SHA-256} of every file under folder but the manifest."""
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(Path(folder).rglob("*"))
            if path.is_file() and path.name != MANIFEST}


def load_sharded(state, path):
    """dcp.load of ``state`` from the sharded (DCP) checkpoint ``path``, reading its pickles as
    data only: coursekit.dcp_data says why."""
    from coursekit import dcp_data  # loads torch.distributed.checkpoint: for the sharded stages
    dcp_data.load(state, path)


def checkpoint_step(path):
    """The step a published checkpoint folder (step_NNNNNNNN) was saved at."""
    return int(Path(path).name.removeprefix("step_"))


def published_checkpoints(run_dir):
    """The complete checkpoints, newest first (each was renamed into place once written)."""
    return sorted(checkpoint_dir(run_dir).glob("step_*"), reverse=True)


def checkpoint_to_resume(run_dir):
    """The newest checkpoint that is yours and unchanged since it was written; None when there is
    none. A newer one that is broken (a file missing, cut short or changed since its manifest was
    written: a disk that filled up, a copy that stopped half-way) is passed over, with a one-line
    warning that names it, for the one before. Call it right before loading one."""
    broken = []
    for path in published_checkpoints(run_dir):
        problem = checkpoint_problem(run_dir, path)
        if problem is None:
            if broken:
                print(f"warning: {'; '.join(broken)}: resuming from {path} instead",
                      file=sys.stderr, flush=True)
            return path
        broken.append(f"checkpoint {path} {problem}")
    if broken:
        raise KitError(f"{'; '.join(broken)}: no checkpoint of {run_dir} can be resumed from")
    return None


def checkpoint_problem(run_dir, path):
    """What is wrong with checkpoint ``path``, or None. One that someone else owns or could have
    written stops the resume at once (KitError): its files are not yours to trust."""
    manifest = path / MANIFEST
    if not manifest.exists():
        return (f"has no {MANIFEST} (it was not written by this kit's stages, or by an older "
                "version of them)")
    found = file_hashes(path)
    pointer = checkpoint_dir(run_dir) / "latest.json"
    refuse_unless_private(run_dir, checkpoint_dir(run_dir), path, manifest,
                          *(path / name for name in found), *filter(Path.exists, [pointer]))
    try:
        expected = read_json(manifest)
    except ValueError:
        return f"has an unreadable {MANIFEST}"
    if found != expected:
        changed = sorted(name for name in {*found, *expected} if found.get(name) != expected.get(name))
        return (f"differs from its {MANIFEST} ({', '.join(changed)}: changed, added or removed "
                "since it was written)")
    return None


def load_checkpoint(run_dir, map_location="cpu"):
    """(step, state) of the newest intact checkpoint (checkpoint_to_resume), or None."""
    path = checkpoint_to_resume(run_dir)
    return None if path is None else read_checkpoint(path, map_location)


def read_checkpoint(path, map_location="cpu"):
    """(step, state) of the checkpoint in folder ``path``."""
    try:
        tensors = load_file(path / "tensors.safetensors", device=str(map_location))
        saved = read_json(path / "state.json")
    except (OSError, ValueError) as err:
        raise KitError(f"checkpoint {path} is unreadable ({err})") from None
    return saved["step"], unflatten_state(saved["state"], tensors)
