#!/usr/bin/env bash
# A real single-node Slurm on this host, for the launcher tests and for trying the Slurm launcher.
#
#   scripts/slurm-local.sh start    write slurm.conf + munge key if needed, start munged,
#                                   slurmctld, slurmd; wait until `sinfo` shows the node idle
#   scripts/slurm-local.sh stop     stop the daemons this script started (by their pid files)
#   scripts/slurm-local.sh status   say whether the cluster answers
#   scripts/slurm-local.sh config   print the slurm.conf `start` would write; start or write nothing
#
# Installs nothing: it needs Debian's `slurm-wlm` and `munge` packages
# (`apt-get install -y slurm-wlm munge`) and root (slurmd runs jobs as their user).
# The config is written to $SLURM_CONF (default /etc/slurm/slurm.conf) only when that file is
# absent or was written by this script; a site's own slurm.conf is never touched.
# No slurmdbd: job states come from `scontrol show job` (MinJobAge keeps finished jobs known).
# The node gets the CPUs this process may run on (RLK_SLURM_CPUS overrides), never a count cut
# down by OMP_NUM_THREADS / OMP_THREAD_LIMIT, which `nproc` honours (tests/conftest.py sets
# OMP_NUM_THREADS=1). The daemons read slurm.conf when they start: after the node's size
# changes, `stop` then `start`.
set -euo pipefail

CONF="${SLURM_CONF:-/etc/slurm/slurm.conf}"
STATE="${RLK_SLURM_STATE:-/var/lib/rlk-slurm}"
MARK="# written by pytest-rlkernel-matrix scripts/slurm-local.sh"
WAIT_S="${RLK_SLURM_WAIT_S:-60}"

die() { echo "slurm-local: $*" >&2; exit 1; }

need() {
  local missing=()
  for tool in munged slurmctld slurmd sinfo scontrol sbatch; do
    command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] || missing+=("$tool")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    die "missing ${missing[*]}: install Debian's slurm-wlm and munge (apt-get install -y slurm-wlm munge)"
  fi
  [ "$(id -u)" = 0 ] || die "must run as root (slurmd starts jobs as their submitting user)"
}

# CPUs this process may run on (its affinity mask), whatever OMP_NUM_THREADS says.
real_cpus() {
  if [ -n "${RLK_SLURM_CPUS:-}" ]; then
    echo "$RLK_SLURM_CPUS"
    return
  fi
  env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || getconf _NPROCESSORS_ONLN
}

render_conf() {
  local host cpus mem
  host="$(hostname -s)"
  cpus="$(real_cpus)"
  case "$cpus" in
    ''|*[!0-9]*|0) die "cannot tell the CPU count (got '${cpus}'); set RLK_SLURM_CPUS" ;;
  esac
  # Modest on purpose: the scheduler only needs to accept jobs, not police memory.
  mem="${RLK_SLURM_MEMORY_MB:-1024}"
  cat <<EOF
$MARK
ClusterName=rlklocal
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
AccountingStorageType=accounting_storage/none
# One core per job, so jobs of one node run side by side (select/linear would serialise them).
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Finished jobs stay known to scontrol for a day (no slurmdbd, so no sacct).
MinJobAge=86400
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
MessageTimeout=10
KillWait=5
InactiveLimit=0
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
}

write_conf() {
  if [ -e "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    echo "slurm-local: $CONF exists and was not written by this script: using it as is"
    return
  fi
  mkdir -p "$(dirname "$CONF")" "$STATE/ctld" "$STATE/d" "$STATE/log"
  render_conf >"$CONF.tmp"
  mv "$CONF.tmp" "$CONF"
}

munge_key() {
  if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
  fi
  chown munge:munge /etc/munge/munge.key 2>/dev/null || true
  chmod 400 /etc/munge/munge.key
}

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_munge() {
  if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    return
  fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  if id munge >/dev/null 2>&1; then
    runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid
  else
    /usr/sbin/munged --force --pid-file=/run/munge/munged.pid
  fi
  for _ in $(seq 50); do
    munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && return
    sleep 0.1
  done
  die "munged did not start (see /var/log/munge/munged.log)"
}

node_state() { sinfo -h -N -o '%T' 2>/dev/null | head -1; }

start() {
  need
  write_conf
  munge_key
  start_munge
  export SLURM_CONF="$CONF"
  alive "$STATE/slurmctld.pid" || /usr/sbin/slurmctld -f "$CONF"
  alive "$STATE/slurmd.pid" || /usr/sbin/slurmd -f "$CONF"
  local state=""
  for _ in $(seq $((WAIT_S * 2))); do
    state="$(node_state)"
    case "$state" in
      idle|mixed|allocated|completing) echo "slurm-local: up, node $(hostname -s) $state ($CONF)"; return 0 ;;
      down*|drain*)
        scontrol update nodename="$(hostname -s)" state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 0.5
  done
  die "node not idle after ${WAIT_S}s (state '${state:-no answer}'); logs: $STATE/log/"
}

stop() {
  for pidfile in "$STATE/slurmd.pid" "$STATE/slurmctld.pid" /run/munge/munged.pid; do
    if alive "$pidfile"; then
      kill "$(cat "$pidfile")"
    fi
  done
  for _ in $(seq 50); do
    alive "$STATE/slurmd.pid" || alive "$STATE/slurmctld.pid" || { echo "slurm-local: stopped"; return 0; }
    sleep 0.1
  done
  echo "slurm-local: daemons still stopping" >&2
}

status() {
  if command -v sinfo >/dev/null && state="$(node_state)" && [ -n "$state" ]; then
    echo "slurm-local: node $(hostname -s) $state"
    return 0
  fi
  echo "slurm-local: not running"
  return 1
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  config) render_conf ;;
  *) echo "usage: $0 start|stop|status|config" >&2; exit 2 ;;
esac
