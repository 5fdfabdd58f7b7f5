"""Run under torchrun: join the process group, say so by creating RELEASE.held (rank 0), hold
the group until the file RELEASE exists (another process attacks the launch's store meanwhile,
and says when it is done by creating the file; at most 120 s), then leave together.

    python -m torch.distributed.run --nproc-per-node=2 ... tests/helpers/hold_group.py RELEASE
"""
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

dist.init_process_group("gloo", timeout=timedelta(seconds=180))  # a lost rank fails, never hangs
release, deadline = Path(sys.argv[1]), time.monotonic() + 120
if dist.get_rank() == 0:  # every rank joined: the launch's rendezvous is complete
    Path(f"{release}.held").touch()
while not release.exists() and time.monotonic() < deadline:
    time.sleep(0.1)
dist.barrier()
dist.destroy_process_group()
