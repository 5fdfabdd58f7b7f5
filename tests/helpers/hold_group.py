"""Run under torchrun: join the process group, hold it for SECONDS while another
process attacks the launch's store, then leave together.

    python -m torch.distributed.run --nproc-per-node=2 ... tests/helpers/hold_group.py SECONDS
"""
import sys
import time
from datetime import timedelta

import torch.distributed as dist

dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a lost rank fails, never hangs
time.sleep(float(sys.argv[1]))
dist.barrier()
dist.destroy_process_group()
