"""Loading a torch.distributed.checkpoint (DCP) folder as data, never as code.

DCP keeps its metadata (`.metadata`: every tensor's name, shape, dtype and place in the files) as
a pickle, and the state that is not a tensor (the data loader's position, the random generators'
states, fp16's loss scale) as objects read back with `torch.load(weights_only=False)`. Both run
whatever a crafted file asks when they are read: a checkpoint that someone else made, copied into
your run directory with a manifest that matches, would run their code on `--resume`. (The
manifest is a hash of the files, which anyone can compute; it finds damage, not intent.)

So the fsdp, tp and pp stages, and `export-hf`, read DCP with this module: the metadata through
an unpickler that makes only DCP's own metadata classes, torch's sizes, dtypes and layouts and a
path, and every other object through `torch.load(weights_only=True)`, which makes only tensors
and plain containers. Anything else stops the load with a one-line error naming the class.
"""
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

from coursekit import KitError

#: The classes a DCP metadata file of this kit's checkpoints is made of, as pickle names them.
METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")}


class MetadataUnpickler(pickle.Unpickler):
    """pickle's Unpickler, making only METADATA_CLASSES and torch's dtypes."""

    def find_class(self, module, name):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in METADATA_CLASSES or dtype:
            return super().find_class(module, name)
        raise KitError(f"a checkpoint's metadata asks for {module}.{name}, which a DCP "
                       "checkpoint of the kit does not hold: it is not loaded (was it made "
                       "by someone else?)")


class DataOnlyReader(dcp.FileSystemReader):
    """DCP's file reader, unpickling its metadata with MetadataUnpickler."""

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as metadata_file:
            metadata = MetadataUnpickler(metadata_file).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class DataOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, reading what is not a tensor with torch.load(weights_only=True)."""

    def load_bytes(self, read_item, value):
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as refused:
            raise KitError(f"{read_item.dest_index.fqn} in the checkpoint holds more than "
                           f"tensors and plain values: it is not loaded "
                           f"({str(refused).splitlines()[0]})") from None
        if self.flatten_state_dict:  # where DefaultLoadPlanner.load_bytes puts it
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def load(state, path, **options):
    """dcp.load of ``state`` from the checkpoint folder ``path``, as data (the module says how).
    A refusal on any rank is raised as its one line (DCP gathers every rank's exceptions)."""
    reader = DataOnlyReader(path)
    reader.read_metadata()  # refused here in one line: inside dcp.load, the refusal is folded
    try:                    # into an AssertionError about per-rank metadata
        dcp.load(state, storage_reader=reader, planner=DataOnlyLoadPlanner(), **options)
    except CheckpointException as failed:
        refusals = [error for error, _ in failed.failures.values() if isinstance(error, KitError)]
        if refusals:
            raise refusals[0] from None
        raise
