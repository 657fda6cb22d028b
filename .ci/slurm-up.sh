#!/usr/bin/env bash
# A real Slurm cluster on this machine, for `make test-slurm` (tests/test_slurm_real.py).
# Needs root and apt-get (Debian/Ubuntu: slurm-wlm 22.05 on Debian 12). Idempotent: installs
# what is missing, (re)writes /etc/slurm/slurm.conf, starts munged, slurmctld and slurmd
# unless they run, and waits until the nodes are idle. No systemd: the daemons are started
# directly; .ci/slurm-down.sh stops them (pid files under /run/slurm and /run/munge).
#
# SLURM_NODES=1 (default): one node named `hostname -s` with this machine's CPUs and memory,
# in partition `debug`. SLURM_NODES=N > 1: N nodes <host>-1..N on this one machine (one
# slurmd each: Debian builds Slurm with multiple-slurmd), each with all the CPUs and 1/N of
# the memory, so that a run spread over nodes (srun + torchrun rendezvous) can be tried.
#
# The cluster has no slurmdbd: AccountingStorageType=accounting_storage/none. `sacct` then
# answers nothing useful, so the Snakemake Slurm plugin must query job states with squeue
# (`--slurm-status-command squeue`); squeue keeps finished jobs for MinJobAge seconds.
set -euo pipefail

if [[ $(id -u) -ne 0 ]]; then
  echo "slurm-up: must run as root (installs packages, starts daemons)" >&2
  exit 1
fi

# ------------------------------------------------------------------ packages
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null \
   || ! command -v sinfo >/dev/null; then
  echo "slurm-up: installing slurm-wlm and munge"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # the packages' postinst cannot start services here (no systemd); we start them below
  apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi

# ------------------------------------------------------------------ slurm.conf
host=$(hostname -s)
nodes=${SLURM_NODES:-1}
[[ $nodes =~ ^[1-9][0-9]*$ ]] || { echo "slurm-up: SLURM_NODES must be a positive integer, not '$nodes'" >&2; exit 1; }
# Sockets/cores/threads as slurmd sees them (its first line: NodeName=... CPUs=... RealMemory=...)
topology=$(slurmd -C | head -n 1 | tr ' ' '\n' | grep -E '^(CPUs|Boards|SocketsPerBoard|CoresPerSocket|ThreadsPerCore)=' | tr '\n' ' ')
mem_total=$(free -m | awk '/^Mem:/ {print $2}')
real_memory=$(( mem_total * 95 / 100 / nodes ))  # a bit under the total: slurmd drains a node that has less than it claims
if [[ $nodes -eq 1 ]]; then
  names=("$host")
  node_lines="NodeName=${host} ${topology}RealMemory=${real_memory} State=UNKNOWN"
  node_list=$host
else
  names=() node_lines=""
  for i in $(seq "$nodes"); do
    names+=("${host}-${i}")
    node_lines+="NodeName=${host}-${i} NodeHostname=${host} NodeAddr=127.0.0.1 Port=$((17000 + i)) ${topology}RealMemory=${real_memory} State=UNKNOWN"$'\n'
  done
  node_lines=${node_lines%$'\n'}
  node_list="${host}-[1-${nodes}]"
fi

conf=$(cat <<EOF
# Written by .ci/slurm-up.sh: a one-node test cluster, no accounting database.
ClusterName=gnnpipe-ci
SlurmctldHost=${host}
AuthType=auth/munge
SlurmUser=slurm
SlurmdUser=root
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd/%n
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd-%n.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# squeue shows a finished job for this long: the plugin's squeue status queries need it
MinJobAge=600
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
${node_lines}
PartitionName=debug Nodes=${node_list} Default=YES MaxTime=INFINITE State=UP
EOF
)

install -d -m 0755 /etc/slurm /run/slurm
install -d -o slurm -g slurm -m 0755 /var/lib/slurm/slurmctld /var/log/slurm
for name in "${names[@]}"; do install -d -m 0755 "/var/lib/slurm/slurmd/$name"; done

running() {  # running <pidfile>: the process in the pid file is alive
  [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

stop_daemon() {  # stop_daemon <pidfile>
  running "$1" || return 0
  local pid
  pid=$(cat "$1")
  kill "$pid"
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
  kill -9 "$pid" 2>/dev/null || true
}

if [[ ! -f /etc/slurm/slurm.conf ]] || [[ "$(cat /etc/slurm/slurm.conf)" != "$conf" ]]; then
  echo "slurm-up: writing /etc/slurm/slurm.conf"
  printf '%s\n' "$conf" > /etc/slurm/slurm.conf
  for pidfile in /run/slurm/slurmd-*.pid; do  # a changed node or partition needs a restart
    [[ -e $pidfile ]] && stop_daemon "$pidfile"
  done
  stop_daemon /run/slurm/slurmctld.pid
fi

# ------------------------------------------------------------------ daemons
if [[ ! -s /etc/munge/munge.key ]]; then
  mungekey --create --keyfile /etc/munge/munge.key
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
fi
install -d -o munge -g munge -m 0755 /run/munge
install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
if ! running /run/munge/munged.pid; then
  runuser -u munge -- /usr/sbin/munged
fi
for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.2; done
munge -n | unmunge >/dev/null

if ! running /run/slurm/slurmctld.pid; then
  slurmctld  # daemonizes, writes its pid file
fi
for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.2; done
for name in "${names[@]}"; do
  running "/run/slurm/slurmd-$name.pid" || slurmd -N "$name"
done

usable() {  # every node of the partition is up: idle, or running jobs
  local states
  states=$(sinfo -h -N -p debug -o %t 2>/dev/null) || return 1
  [[ $(wc -w <<<"$states") -eq $nodes ]] && ! grep -qvE '^(idle|mix|alloc)$' <<<"$states"
}
for _ in $(seq 120); do usable && break; sleep 0.5; done
if ! usable; then
  echo "slurm-up: the nodes are not idle:" >&2
  sinfo -N >&2 || true
  tail -n 20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd-*.log >&2 || true
  exit 1
fi
sinfo -N
