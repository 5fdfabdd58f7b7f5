#!/bin/bash
# Start the slurmd of node N of the cluster tests/slurm/cluster-up.sh built: in a UTS and mount
# namespace of its own, so that `hostname` in its jobs says nodeN and the nodes' names resolve
# through the cluster's copy of /etc/hosts. cluster-up.sh starts every node so; a test that
# killed a node (every process of its namespace) brings it back the same way.
#   SLURM_CI_DIR=/tmp/slurm-ci tests/slurm/node-up.sh 2
set -euo pipefail
dir=${SLURM_CI_DIR:?set SLURM_CI_DIR to the directory cluster-up.sh used}
i=${1:?which node: 1, 2, ...}
unshare --uts --mount --fork sh -c "mount --bind '$dir/hosts' /etc/hosts && hostname node$i \
  && exec /usr/sbin/slurmd -f '$dir/slurm.conf' -N node$i"
