#!/bin/bash
# A throw-away Slurm cluster on this one machine for the tests: one slurmctld and N slurmd
# ("node1".."nodeN") in the partition "debug". Each slurmd runs in its own UTS and mount
# namespace, so `hostname` in a job says node1, node2, ... and those names resolve (through a
# private copy of /etc/hosts that only the slurmds and their jobs see) to 127.0.0.11, 127.0.0.12...
# Beside it, for the lines "site partition node_set cores gpus memory_mb max_time max_nodes" of
# SLURM_CI_SITES, a copy of each real site's partitions: a slurmctld of its own (config in
# $SLURM_CI_DIR/sites/<site>/slurm.conf), with 2 nodes of each node set ("gpu1", "gpu2"; "cpu1",
# "cpu2") of the site's shape, and each partition with its time limit and largest job in nodes.
# `sbatch --test-only` against it refuses what the site would refuse for those reasons. No job runs there: its nodes are
# powered-down cloud nodes, which the scheduler counts as available and never contacts.
# Installs Slurm and munge from Debian's packages if they are missing. Needs root.
#   SLURM_CI_DIR=/tmp/slurm-ci tests/slurm/cluster-up.sh     then: export SLURM_CONF=$SLURM_CI_DIR/slurm.conf
#   SLURM_CI_DIR=/tmp/slurm-ci tests/slurm/cluster-down.sh   stops every daemon by its PID file
# Optional: SLURM_CI_NODES (2), SLURM_CI_CPUS (this machine's cores), SLURM_CI_MEM_MB (4000) and
# SLURM_CI_MAX_TIME (INFINITE) shape the debug nodes and partition.
set -euo pipefail
dir=${SLURM_CI_DIR:?set SLURM_CI_DIR to a scratch directory}
nodes=${SLURM_CI_NODES:-2}
cpus=${SLURM_CI_CPUS:-$(nproc)}  # per node: the nodes share this machine's cores
memory=${SLURM_CI_MEM_MB:-4000}
max_time=${SLURM_CI_MAX_TIME:-INFINITE}
sites=${SLURM_CI_SITES:-}

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
   || ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
  # (the test suite installs these first, with its other tools: tests/conftest.py apt_install)
  # another apt-get may hold the package database's lock: wait for it instead of failing at once
  apt=(apt-get -o DPkg::Lock::Timeout=300)
  "${apt[@]}" update -qq
  DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge >/dev/null
fi

# munge authenticates every message between the daemons and the commands
[ -s /etc/munge/munge.key ] || /usr/sbin/mungekey --create --force
chown munge:munge /etc/munge/munge.key && chmod 600 /etc/munge/munge.key
mkdir -p /run/munge /var/lib/munge /var/log/munge
chown munge:munge /run/munge /var/lib/munge /var/log/munge
if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
  su -s /bin/sh munge -c /usr/sbin/munged
  for _ in $(seq 50); do munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  mkdir -p "$dir/run" && cp /run/munge/munged.pid "$dir/run/munged.pid"
fi

# the controllers' ports: 6817 for the debug cluster, 6821, 6822, ... for the sites
site_count=$(printf '%s\n' "$sites" | grep -c . || true)
for port in 6817 $(seq 6821 $((6820 + site_count))); do
  if (exec 3<>/dev/tcp/127.0.0.1/"$port") 2>/dev/null; then
    echo "a slurmctld already listens on port $port: stop that cluster first (cluster-down.sh)" >&2
    exit 1
  fi
done
rm -rf "$dir/state" "$dir/spool" "$dir/log" "$dir/sites"
mkdir -p "$dir/state" "$dir/log" "$dir/run"

# What every controller shares: munge, no accounting (so no account or QoS is checked), and
# partition limits enforced at submission, as the real sites do
common_conf() {  # state directory, controller port, pid file, log file
  cat <<CONF
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job may start again once its old credentials expire: 20 s here, not 120
AuthInfo=cred_expire=20
CredType=cred/munge
MailProg=/bin/true
StateSaveLocation=$1
SlurmctldPort=$2
SlurmctldPidFile=$3
SlurmctldLogFile=$4
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
EnforcePartLimits=ALL
CONF
}

# --- the debug cluster, where the ci site's jobs run ---
cp /etc/hosts "$dir/hosts"
node_lines=""
for i in $(seq 1 "$nodes"); do
  mkdir -p "$dir/spool/node$i"
  echo "127.0.0.$((10 + i)) node$i" >> "$dir/hosts"
  node_lines+="NodeName=node$i NodeHostname=node$i NodeAddr=127.0.0.$((10 + i)) Port=$((17000 + i)) CPUs=$cpus RealMemory=$memory State=UNKNOWN"$'\n'
done
{
  echo "ClusterName=kit-ci"
  common_conf "$dir/state" 6817 "$dir/run/slurmctld.pid" "$dir/log/slurmctld.log"
  cat <<CONF
# slurmd trusts this file over the hardware: the nodes may be shaped unlike this machine
SlurmdParameters=config_overrides
SlurmdSpoolDir=$dir/spool/%n
SlurmdPidFile=$dir/run/slurmd.%n.pid
SlurmdLogFile=$dir/log/slurmd.%n.log
SelectTypeParameters=CR_Core
ReturnToService=2
# a node whose slurmd stops answering is down after 20 s (tests/test_slurm.py kills one)
SlurmdTimeout=20
InactiveLimit=0
# ended jobs stay in slurmctld's memory for the session: a test may ask for a job's record long
# after it ended (tests/test_slurm.py: Jobs, the tests in any order)
MinJobAge=7200
KillWait=10
Waittime=0
${node_lines}PartitionName=debug Nodes=node[1-$nodes] Default=YES MaxTime=$max_time State=UP OverSubscribe=NO
CONF
} > "$dir/slurm.conf"

# --- a copy of each real site's partitions, for `sbatch --test-only` only ---
# Each line of SLURM_CI_SITES: "site partition node_set cores gpus memory_mb max_time max_nodes".
# A site's lines share one controller; each node set (gpu, cpu) is 2 nodes of its line's shape;
# the site's first partition is its default.
index=0
while read -r site partition node_set site_cpus gpus site_memory site_max_time max_nodes; do
  [ -n "$site" ] || continue
  here="$dir/sites/$site"
  default=""
  if [ ! -d "$here" ]; then
    index=$((index + 1))
    mkdir -p "$here/state"
    : > "$here/nodes"
    : > "$here/partitions"
    echo "$index" > "$here/index"
    default="Default=YES"
  fi
  if ! grep -q "^NodeName=$node_set\[" "$here/nodes"; then
    gres=""
    [ "$gpus" -gt 0 ] && gres="Gres=gpu:$gpus"
    echo "NodeName=${node_set}[1-2] CPUs=$site_cpus $gres RealMemory=$site_memory State=CLOUD" \
      >> "$here/nodes"
  fi
  echo "PartitionName=$partition Nodes=${node_set}[1-2] $default MaxTime=$site_max_time" \
    "MaxNodes=$max_nodes State=UP" >> "$here/partitions"
done <<< "$sites"
for here in "$dir"/sites/*/; do
  [ -e "$here/index" ] || continue
  site=$(basename "$here")
  {
    echo "ClusterName=$site"
    common_conf "$here/state" $((6820 + $(cat "$here/index"))) "$dir/run/slurmctld.$site.pid" \
      "$dir/log/slurmctld.$site.log"
    cat <<CONF
GresTypes=gpu
# memory counts: a job asking for more than a node has is refused
SelectTypeParameters=CR_Core_Memory
# cloud nodes that stay powered down: schedulable, never contacted, so no slurmd is needed
SuspendProgram=/bin/true
ResumeProgram=/bin/true
SuspendTime=INFINITE
CONF
    cat "$here/nodes" "$here/partitions"
  } > "$here/slurm.conf"
done

export SLURM_CONF=$dir/slurm.conf
/usr/sbin/slurmctld -f "$SLURM_CONF"
for conf in "$dir"/sites/*/slurm.conf; do
  [ -e "$conf" ] && /usr/sbin/slurmctld -f "$conf"
done
for i in $(seq 1 "$nodes"); do
  "$(dirname "$0")/node-up.sh" "$i"
done

# ready when every node is idle (not "idle*", which means not yet registered)
for _ in $(seq 150); do
  [ "$(sinfo -h -N -o %T 2>/dev/null | grep -cx idle)" = "$nodes" ] && break
  sleep 0.2
done
timeout 60 srun -N "$nodes" --ntasks-per-node=1 -t 1 hostname | sort | tr '\n' ' ' \
  || { tail -n 30 "$dir"/log/*.log >&2; exit 1; }
for conf in "$dir"/sites/*/slurm.conf; do  # each site's controller answers
  [ -e "$conf" ] || continue
  for _ in $(seq 50); do SLURM_CONF=$conf scontrol ping >/dev/null 2>&1 && break; sleep 0.2; done
  SLURM_CONF=$conf scontrol ping >/dev/null \
    || { tail -n 30 "$dir"/log/slurmctld.*.log >&2; exit 1; }
done
echo "up: export SLURM_CONF=$SLURM_CONF"
