#!/bin/bash
# Stop the daemons tests/slurm/cluster-up.sh started, by the PIDs in their PID files: the slurmds,
# the controllers (the debug cluster's and each site's), then munged if it started it.
dir=${SLURM_CI_DIR:?set SLURM_CI_DIR to the directory cluster-up.sh used}
for pidfile in "$dir"/run/slurmd.*.pid "$dir"/run/slurmctld*.pid "$dir/run/munged.pid"; do
  [ -s "$pidfile" ] || continue
  pid=$(cat "$pidfile")
  kill "$pid" 2>/dev/null && echo "stopped $pid ($(basename "$pidfile" .pid))"
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  rm -f "$pidfile"
done
