#!/bin/bash
# Stop the daemons tests/slurm/cluster-up.sh started, by the PIDs in their PID files: the slurmds,
# then the controllers (the debug cluster's and each site's), then munged if it started it. The
# daemons of one kind stop together: one at a time, the nine took about 20 s.
dir=${SLURM_CI_DIR:?set SLURM_CI_DIR to the directory cluster-up.sh used}

stop_all() {  # stop_all PIDFILE...: signal every daemon, then wait up to 5 s for them to exit
  local pidfile pid pids=()
  for pidfile in "$@"; do
    [ -s "$pidfile" ] || continue
    pid=$(cat "$pidfile")
    kill "$pid" 2>/dev/null && echo "stopped $pid ($(basename "$pidfile" .pid))" && pids+=("$pid")
    rm -f "$pidfile"
  done
  for _ in $(seq 50); do
    kill -0 "${pids[@]}" 2>/dev/null || break  # true while any of them still runs
    sleep 0.1
  done
}

stop_all "$dir"/run/slurmd.*.pid
stop_all "$dir"/run/slurmctld*.pid
stop_all "$dir/run/munged.pid"
