"""A driver for the Ray job of tests/test_slurm.py: it joins the job's cluster, says so, and holds
it until SIGUSR1 (what the batch file passes on before the time limit), then ends cleanly."""
import signal
import threading

import ray

from coursekit import raycluster

stop = threading.Event()
signal.signal(signal.SIGUSR1, lambda signum, frame: stop.set())
raycluster.connect()
print(f"driver ready: {len(ray.nodes())} nodes", flush=True)
stop.wait()
print("SIGUSR1 received: the driver stops", flush=True)
