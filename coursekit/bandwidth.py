"""All-reduce bandwidth between the processes of a job, measured as nccl-tests measures it.

    torchrun --nproc-per-node=4 -m coursekit.bandwidth --out allreduce.json

For each message size, every rank all-reduces a buffer of that many bytes (fp32) a few times
after a warm-up; the time is the slowest rank's mean. nccl-tests' two figures:

    algorithm bandwidth  algbw = bytes / time
    bus bandwidth        busbw = algbw x 2 (n - 1) / n

An all-reduce over n ranks sends and receives 2 (n - 1) / n of the buffer on each link in a ring,
so busbw is the speed each link ran at, comparable across n and with the hardware's link speed
(NVLink, InfiniBand, Slingshot). Small messages measure latency, large ones bandwidth.
"""
import argparse
import sys
import time

import torch
import torch.distributed as dist

from coursekit import distributed, faults, runs

WARMUP, ITERATIONS = 3, 10


def sizes(largest, smallest=1024):
    """Message sizes in bytes from ``smallest`` up to ``largest``, each four times the last."""
    size, found = smallest, []
    while size <= largest:
        found.append(size)
        size *= 4
    return found


def bus_bandwidth(bytes_, seconds, ranks):
    """(algbw, busbw) in bytes per second of an all-reduce of ``bytes_`` taking ``seconds``."""
    algbw = bytes_ / seconds
    return algbw, algbw * 2 * (ranks - 1) / ranks


def time_all_reduce(buffer, device):
    """Mean seconds of one all-reduce of ``buffer``, the slowest rank's."""
    for _ in range(WARMUP):
        dist.all_reduce(buffer)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(ITERATIONS):
        dist.all_reduce(buffer)
    synchronize(device)
    seconds = torch.tensor((time.perf_counter() - start) / ITERATIONS, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(largest_bytes, device):
    """[{bytes, seconds, algbw, busbw}] for every size up to ``largest_bytes``."""
    ranks = dist.get_world_size()
    results = []
    for size in sizes(largest_bytes):
        buffer = torch.ones(size // 4, dtype=torch.float32, device=device)
        seconds = time_all_reduce(buffer, device)
        algbw, busbw = bus_bandwidth(size, seconds, ranks)
        results.append({"bytes": size, "seconds": seconds, "algbw": algbw, "busbw": busbw})
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes the results to")
    parser.add_argument("--largest", type=int, default=2**30, help="largest message, bytes")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "xpu", "cpu"])
    args = parser.parse_args(argv)
    rank, world_size, device = distributed.setup(args.device)
    results = measure(args.largest, device)
    if rank == 0:
        runs.write_json_atomic(args.out, {"ranks": world_size, "device": str(device),
                                          "backend": dist.get_backend(), "sizes": results})
    distributed.finish()


if __name__ == "__main__":
    sys.exit(faults.run(main))  # a lost peer, a bad device: one line, no traceback
