#!/bin/bash
# A throw-away Slurm cluster on this one machine for the tests: one slurmctld and N slurmd
# ("node1".."nodeN"). Each slurmd runs in its own UTS and mount namespace, so `hostname` in a job
# says node1, node2, ... and those names resolve (through a private copy of /etc/hosts that only
# the slurmds and their jobs see) to 127.0.0.11, 127.0.0.12, ...
# Two more nodes, "site1" and "site2" in the partition "sites", are shaped like the largest GPU
# node of the real site profiles (288 cores, 8 GPUs; the GPUs are stand-in device files and
# slurmd trusts slurm.conf over the hardware): there the real sites' batch files pass
# `sbatch --test-only --partition=sites`. No job runs on them.
# Installs Slurm and munge from Debian's packages if they are missing. Needs root.
#   SLURM_CI_DIR=/tmp/slurm-ci tests/slurm/cluster-up.sh     then: export SLURM_CONF=$SLURM_CI_DIR/slurm.conf
#   SLURM_CI_DIR=/tmp/slurm-ci tests/slurm/cluster-down.sh   stops every daemon by its PID file
set -euo pipefail
dir=${SLURM_CI_DIR:?set SLURM_CI_DIR to a scratch directory}
nodes=${SLURM_CI_NODES:-2}
cpus=$(nproc)  # per node: the nodes share this machine's cores
site_cpus=288 site_gpus=8

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
   || ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
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

if (exec 3<>/dev/tcp/127.0.0.1/6817) 2>/dev/null; then
  echo "a slurmctld already listens on port 6817: stop that cluster first (cluster-down.sh)" >&2
  exit 1
fi
rm -rf "$dir/state" "$dir/spool" "$dir/log"
mkdir -p "$dir/state" "$dir/log" "$dir/run"
cp /etc/hosts "$dir/hosts"
node_lines=""
for i in $(seq 1 "$nodes"); do
  mkdir -p "$dir/spool/node$i"
  echo "127.0.0.$((10 + i)) node$i" >> "$dir/hosts"
  node_lines+="NodeName=node$i NodeHostname=node$i NodeAddr=127.0.0.$((10 + i)) Port=$((17000 + i)) CPUs=$cpus RealMemory=4000 State=UNKNOWN"$'\n'
done
mkdir -p "$dir/dev"
for g in $(seq 0 $((site_gpus - 1))); do
  [ -e "$dir/dev/gpu$g" ] || mknod "$dir/dev/gpu$g" c 1 3  # like /dev/null
done
echo "NodeName=site[1-2] Name=gpu File=$dir/dev/gpu[0-$((site_gpus - 1))]" > "$dir/gres.conf"
for i in 1 2; do
  mkdir -p "$dir/spool/site$i"
  echo "127.0.0.$((20 + i)) site$i" >> "$dir/hosts"
  node_lines+="NodeName=site$i NodeHostname=site$i NodeAddr=127.0.0.$((20 + i)) Port=$((17020 + i)) CPUs=$site_cpus Gres=gpu:$site_gpus RealMemory=500000 State=UNKNOWN"$'\n'
done
cat > "$dir/slurm.conf" <<CONF
ClusterName=kit-ci
SlurmdParameters=config_overrides
GresTypes=gpu
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job may start again once its old credentials expire: 20 s here, not 120
AuthInfo=cred_expire=20
CredType=cred/munge
MailProg=/bin/true
SlurmctldPort=6817
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmdTimeout=300
InactiveLimit=0
MinJobAge=300
KillWait=10
Waittime=0
${node_lines}PartitionName=debug Nodes=node[1-$nodes] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
PartitionName=sites Nodes=site[1-2] MaxTime=INFINITE State=UP
CONF
export SLURM_CONF=$dir/slurm.conf

/usr/sbin/slurmctld -f "$SLURM_CONF"
for name in $(seq -f "node%g" 1 "$nodes") site1 site2; do
  unshare --uts --mount --fork sh -c "mount --bind '$dir/hosts' /etc/hosts && hostname $name \
    && exec /usr/sbin/slurmd -f '$SLURM_CONF' -N $name"
done

# ready when every node is idle (not "idle*", which means not yet registered)
for _ in $(seq 150); do
  [ "$(sinfo -h -N -o %T 2>/dev/null | grep -cx idle)" = "$((nodes + 2))" ] && break
  sleep 0.2
done
timeout 60 srun -N "$nodes" --ntasks-per-node=1 -t 1 hostname | sort | tr '\n' ' ' \
  || { tail -n 30 "$dir"/log/*.log >&2; exit 1; }
echo "up: export SLURM_CONF=$SLURM_CONF"
