#!/usr/bin/env bash
# A real single-node Slurm on this host, for the launcher tests and for trying the Slurm launcher.
#
#   scripts/slurm-local.sh start    write slurm.conf + munge key if needed, start munged,
#                                   slurmctld, slurmd; wait until `sinfo` shows the node idle
#   scripts/slurm-local.sh stop     stop the daemons this script started (by their pid files),
#                                   then remove every file and folder `start` created
#   scripts/slurm-local.sh status   say whether the cluster answers
#   scripts/slurm-local.sh config   print the slurm.conf `start` would write; start or write nothing
#
# Installs nothing: it needs Debian's `slurm-wlm` and `munge` packages
# (`apt-get install -y slurm-wlm munge`) and root (slurmd runs jobs as their user).
# The config is written to $SLURM_CONF (default /etc/slurm/slurm.conf) only when that file is
# absent or was written by this script; a site's own slurm.conf is never touched.
# `start` leaves the machine restorable: before it touches anything it lists what already exists
# under the paths it may write ($TOUCHED, into $MANIFEST), and `stop` removes whatever is there
# beyond that list, so slurm.conf, the munge key, munged's socket and seed and the state and log
# folders go again. A munged that was already running is left running; a munge key that already
# existed keeps its owner and mode.
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
MANIFEST="${RLK_SLURM_MANIFEST:-/run/rlk-slurm-local.manifest}"
# every path `start` (or the daemons it starts) may create files under
TOUCHED=("$(dirname "$CONF")" /etc/munge /run/munge /var/log/munge /var/lib/munge "$STATE"
         /run/slurm /run/slurmctld.pid /run/slurmd.pid /var/spool/slurmd /var/spool/slurmctld
         /var/log/slurm)

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
    chown munge:munge /etc/munge/munge.key 2>/dev/null || true
    chmod 400 /etc/munge/munge.key
  fi
}

# What exists before `start`: one line per path (find -print0 would be exact; these are system
# folders without newlines in names). Written once: a second `start` keeps the first list.
record_manifest() {
  [ -e "$MANIFEST" ] && return
  local tmp="$MANIFEST.tmp"
  : >"$tmp"
  for path in "${TOUCHED[@]}"; do
    [ -e "$path" ] && find "$path" -xdev >>"$tmp" 2>/dev/null
  done
  pgrep -x munged >/dev/null 2>&1 && echo "#munged-was-running" >>"$tmp"
  mv "$tmp" "$MANIFEST"
}

# Remove what is under $TOUCHED now and was not in the manifest (deepest paths first).
restore_manifest() {
  [ -e "$MANIFEST" ] || return 0
  local path
  for top in "${TOUCHED[@]}"; do
    [ -e "$top" ] || continue
    find "$top" -xdev -depth 2>/dev/null | while IFS= read -r path; do
      grep -qxF -- "$path" "$MANIFEST" && continue
      if [ -d "$path" ] && [ ! -L "$path" ]; then rmdir -- "$path" 2>/dev/null || true
      else rm -f -- "$path"; fi
    done
  done
  rm -f "$MANIFEST"
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
  record_manifest
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
  local pidfiles=("$STATE/slurmd.pid" "$STATE/slurmctld.pid")
  # munged only where this script started it (a site's running munged is left alone)
  if [ -e "$MANIFEST" ] && ! grep -qxF "#munged-was-running" "$MANIFEST"; then
    pidfiles+=(/run/munge/munged.pid)
  fi
  for pidfile in "${pidfiles[@]}"; do
    if alive "$pidfile"; then
      kill "$(cat "$pidfile")"
    fi
  done
  local stopped=""
  for _ in $(seq 100); do
    still=""
    for pidfile in "${pidfiles[@]}"; do alive "$pidfile" && still=1; done
    [ -z "$still" ] && { stopped=1; break; }
    sleep 0.1
  done
  if [ -z "$stopped" ]; then
    echo "slurm-local: daemons still stopping; files left in place" >&2
    return 1
  fi
  restore_manifest
  echo "slurm-local: stopped"
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
