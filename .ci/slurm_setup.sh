#!/usr/bin/env bash
# A single-node Slurm for the sweep tests: controller and one compute node on this machine, as root.
# Installs Debian's slurm-wlm (22.05) and munge, writes the config (this machine's CPUs and memory), starts munged,
# slurmctld and slurmd, and waits until `sinfo` shows the node idle. Idempotent: where the same config already runs,
# it returns in about a second. Needs root (CI containers run as root).
set -euo pipefail

conf=/etc/slurm/slurm.conf
say() { echo "slurm_setup: $*"; }
node_up() { sinfo -h -N -o '%T' 2>/dev/null | grep -qx 'idle\|mixed\|allocated'; }

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  say "installing slurm-wlm and munge"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi

# munge: one key, the daemon as its own user
if [[ ! -s /etc/munge/munge.key ]]; then
  mungekey --create --force 2>/dev/null || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
mkdir -p /run/munge /var/log/munge /var/lib/munge && chown munge:munge /run/munge /var/log/munge /var/lib/munge
if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
  runuser -u munge -- /usr/sbin/munged
fi

# the config: this machine is the controller and the only node, with its CPUs (as slurmd detects them) and 90 % of
# its memory. JobRequeue=1: batch jobs may be requeued (preemption, `scontrol requeue`). cred_expire=5 and a
# scheduler pass every second: a requeued job starts again about 6 s later (the default 120 s holds it 2 minutes).
host=$(hostname -s)
hw=$(slurmd -C | head -1 | sed -e 's/^NodeName=[^ ]* //' -e 's/ RealMemory=[0-9]*//')
mem_mb=$(awk '/MemTotal/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
cat >"$conf.new" <<CONF
ClusterName=ci
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=5
SchedulerParameters=sched_interval=1,bf_interval=1
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
JobRequeue=1
ReturnToService=2
KillWait=30
MinJobAge=600
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=$host $hw RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF

if cmp -s "$conf.new" "$conf" && node_up; then
  rm "$conf.new"
  say "already up ($(sinfo -h -N -o '%N %T %c CPUs %m MB'))"
  exit 0
fi
mv "$conf.new" "$conf"

# (re)start the daemons with this config; stop only those an earlier run started (their pid files)
for daemon in slurmctld slurmd; do
  pidfile=/run/$daemon.pid
  if [[ -s $pidfile ]] && kill "$(cat "$pidfile")" 2>/dev/null; then
    for _ in $(seq 100); do kill -0 "$(cat "$pidfile" 2>/dev/null)" 2>/dev/null || break; sleep 0.1; done
  fi
done
/usr/sbin/slurmctld
/usr/sbin/slurmd

deadline=$((SECONDS + 60))
until node_up; do
  if ((SECONDS > deadline)); then
    say "the node did not come up idle within 60 s:"
    sinfo -N -l >&2 || true
    tail -20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
    exit 1
  fi
  scontrol update NodeName="$host" State=RESUME >/dev/null 2>&1 || true
  sleep 0.5
done
say "up ($(sinfo -h -N -o '%N %T %c CPUs %m MB'))"
