#!/usr/bin/env bash
# Stops the daemons .ci/slurm-up.sh started (slurmd per node, slurmctld, munged), by their pid files.
# Leaves the packages and /etc/slurm/slurm.conf; running slurm-up.sh again restarts them.
set -euo pipefail

stop_daemon() {  # stop_daemon <name> <pidfile>
  local pid
  [[ -s $2 ]] || return 0
  pid=$(cat "$2")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid"
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid" 2>/dev/null || true; fi
    echo "slurm-down: stopped $1 ($pid)"
  fi
  rm -f "$2"
}

for pidfile in /run/slurm/slurmd-*.pid; do
  [[ -e $pidfile ]] && stop_daemon slurmd "$pidfile"
done
stop_daemon slurmctld /run/slurm/slurmctld.pid
stop_daemon munged /run/munge/munged.pid
