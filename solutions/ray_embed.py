"""Embed the course's documents with Ray Data: chunks in, one vector per chunk out, computed by a
pool of embedder replicas across the Ray cluster's nodes (lesson 09).

    python solutions/ray_embed.py --embedder models/kit-embed --workers 2      # a local Ray
    sbatch batchfiles/<site>/batch-ray-2n4g.sh solutions/ray_embed.py \\
        --embedder sentence-transformers/all-MiniLM-L6-v2 --workers 8

`map_batches` with a class runs that many long-lived copies of it (Ray actors), each loading the
embedder once and then embedding batch after batch, while Ray Data streams the chunks to whichever
copy is free. With GPUs, each copy holds one. A hub embedder must be in the Hugging Face cache
first (download it on a login node: compute nodes are often offline).

The run directory holds what retrieval needs, each file written atomically:
    RUN_DIR/config.json     the arguments, the number of chunks and the vectors' width
    RUN_DIR/chunks.jsonl    one chunk per line (document, title, start, end, body)
    RUN_DIR/vectors.npy     float32, one unit-length row per chunk, in the order of chunks.jsonl
"""
import sys
import time
from pathlib import Path

import numpy as np

from coursekit import faults, rag, raycluster, runs
from coursekit.cli import ArgumentParser, positive_int


class Embedder:
    """One replica of the embedder: Ray Data builds it once per actor and then calls it with
    batch after batch of chunks, as columns of numpy arrays."""

    def __init__(self, name_or_path, device):
        self.model = rag.embedder(name_or_path, device=device)

    def __call__(self, batch):
        return {"index": batch["index"], "vector": rag.embed(self.model, batch["text"])}


def embed_with_ray_data(chunks, args, replica=Embedder):
    """The chunks' vectors, row i for chunk i, embedded by ``args.workers`` copies of
    ``replica`` (lesson 09 passes its own)."""
    import ray

    gpus = args.device in ("auto", "cuda") and ray.cluster_resources().get("GPU", 0) > 0
    items = ray.data.from_items([{"index": i, "text": c.text} for i, c in enumerate(chunks)])
    embedded = items.map_batches(replica, fn_constructor_args=(args.embedder,
                                                               "cuda" if gpus else "cpu"),
                                 batch_size=args.batch_size, num_gpus=1 if gpus else 0,
                                 compute=ray.data.ActorPoolStrategy(size=args.workers))
    vectors = None
    for batch in embedded.iter_batches(batch_size=args.batch_size, batch_format="numpy"):
        if vectors is None:  # the width is the embedder's
            vectors = np.empty((len(chunks), batch["vector"].shape[1]), dtype=np.float32)
        vectors[batch["index"]] = batch["vector"]  # batches arrive in any order
    return vectors


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--embedder", default="models/kit-embed",
                        help="a sentence-transformers model: a local directory or a hub name")
    parser.add_argument("--chunk-tokens", type=positive_int, default=64,
                        help="tokens of each chunk (a quarter of them shared with the next)")
    parser.add_argument("--workers", type=positive_int, default=2,
                        help="replicas of the embedder (a GPU each, where the cluster has them)")
    parser.add_argument("--batch-size", type=positive_int, default=256,
                        help="chunks per call of a replica")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--out", default="runs/ray-embed", help="run directory")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    run_dir = runs.make_run_dir(args.out)
    if Path(args.embedder).exists():  # the replicas run elsewhere: an absolute path
        args.embedder = str(Path(args.embedder).resolve())
    chunks = rag.chunk(rag.documents(), args.chunk_tokens)
    raycluster.connect()
    started = time.perf_counter()
    vectors = embed_with_ray_data(chunks, args)
    seconds = time.perf_counter() - started
    rag.save_embeddings(run_dir, chunks, vectors)
    runs.write_json_atomic(run_dir / "config.json", {"args": vars(args), "chunks": len(chunks),
                                                     "width": vectors.shape[1]})
    print(f"ray data: {len(chunks)} chunks of {args.chunk_tokens} tokens embedded by "
          f"{args.workers} replicas in {seconds:.1f} s ({len(chunks) / seconds:,.0f} chunks/s), "
          f"{vectors.shape[1]} wide; {run_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(faults.run(main))
