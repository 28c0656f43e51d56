#!/usr/bin/env bash
# Installs and starts a one-host SLURM cluster for the cluster tests (tests/test_slurm.py),
# through Debian/Ubuntu apt: munge (authentication), slurmctld (the controller) and slurmd
# (this host as the only node), accounting disabled.
#   bash scripts/install_slurm.sh
# Idempotent and never fatal: when a cluster already answers (`sinfo`), it does nothing; when it
# cannot make one (no apt, not root, no network, a daemon that will not start) it says why and
# exits 0; the SLURM tests then skip with their own reason. NBDDP_NO_SLURM_INSTALL=1 skips it.
#
# The node declares more CPUs than the machine has (SlurmdParameters=config_overrides), so
# the tests' small CPU jobs can run side by side on a 2-core machine, as on a shared node.
set -u

say() { echo "install_slurm: $*"; }

answers() { timeout 10 sinfo -h -o %P >/dev/null 2>&1; }

MARK="# A one-host cluster made by nbddp's scripts/install_slurm.sh for its tests."
OURS=0
[ "$(head -n 1 /etc/slurm/slurm.conf 2>/dev/null)" = "$MARK" ] && OURS=1
if command -v sinfo >/dev/null 2>&1 && answers && [ "$OURS" = "0" ]; then
  say "a SLURM cluster already answers (partitions: $(sinfo -h -o %P | tr '\n' ' ')): nothing to do"
  exit 0
fi
if [ -e /etc/slurm/slurm.conf ] && [ "$OURS" = "0" ]; then  # a site's, even one whose controller is down
  say "skipped: /etc/slurm/slurm.conf was not made by this script, and is never touched (the SLURM tests will skip)"
  exit 0
fi
if [ "${NBDDP_NO_SLURM_INSTALL:-0}" = "1" ]; then
  say "skipped: NBDDP_NO_SLURM_INSTALL=1 (the SLURM tests will skip)"
  exit 0
fi
if [ "$(id -u)" != "0" ]; then
  say "skipped: a one-host cluster needs root to install and start its daemons; the SLURM tests will skip"
  exit 0
fi

if ! command -v slurmctld >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
  if ! command -v apt-get >/dev/null 2>&1; then
    say "skipped: no apt-get on this system; install slurm-wlm and munge yourself to run the SLURM tests"
    exit 0
  fi
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-cache show slurm-wlm >/dev/null 2>&1; then
    say "refreshing the apt package lists"
    timeout 300 apt-get update -qq >/dev/null 2>&1 || { say "skipped: apt-get update failed (no network?)"; exit 0; }
  fi
  say "installing slurm-wlm and munge with apt-get (a minute or two the first time)"
  # A fresh name (mktemp: O_EXCL, mode 0600), never a fixed one: in a shared /tmp any user may have
  # put a link at a fixed name, and root writing through it overwrites the file it points to.
  LOG=$(mktemp -t nbddp-install-slurm.XXXXXXXX) || { say "skipped: mktemp failed"; exit 0; }
  if ! timeout 900 apt-get install -y -qq --no-install-recommends slurm-wlm munge >"$LOG" 2>&1; then
    say "skipped: apt-get install slurm-wlm munge failed; its output: $LOG"
    tail -n 5 "$LOG" 2>/dev/null | sed 's/^/install_slurm:   /'
    exit 0
  fi
  rm -f "$LOG"
fi

HOST=$(hostname -s)
MEM_MB=$(awk '/MemTotal/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)
CONF=/etc/slurm/slurm.conf
mkdir -p /etc/slurm /var/lib/slurm/slurmctld /var/lib/slurm/slurmd /var/log/slurm /run/munge
if [ ! -s /etc/munge/munge.key ]; then
  if command -v mungekey >/dev/null 2>&1; then mungekey --create --force >/dev/null 2>&1
  else dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; fi
fi
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null
chmod 0700 /etc/munge; chmod 0600 /etc/munge/munge.key

OLD_CONF=$(cat "$CONF" 2>/dev/null || true)
cat > "$CONF" <<EOF
$MARK
ClusterName=nbddp-test
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits until the credentials of its last start expire (120 s by default): 20 s here,
# so that the preemption test sees SLURM's own requeue, delay included, in a test's time.
AuthInfo=cred_expire=20
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
SlurmdParameters=config_overrides
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
KillWait=10
MinJobAge=30
SchedulerParameters=sched_interval=1
NodeName=$HOST CPUs=16 RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF

# A daemon is found by its pid file (in root's /run), and only taken for ours when that process is the
# daemon's own executable run by its own user: any user may start a process named "slurmctld", and one
# found by name alone would be taken for the controller (never started, the tests skip) or be killed.
daemon_pid() {
  local name=$1 pidfile=$2 owner=$3 pid exe
  pid=$(cat "$pidfile" 2>/dev/null) || return 1
  case "$pid" in ''|*[!0-9]*) return 1 ;; esac
  [ "$(stat -c %u "/proc/$pid" 2>/dev/null)" = "$(id -u "$owner" 2>/dev/null)" ] || return 1
  exe=$(readlink -f "/proc/$pid/exe" 2>/dev/null) || return 1
  [ -n "$exe" ] && [ "$exe" = "$(readlink -f "/usr/sbin/$name")" ] || return 1
  echo "$pid"
}
slurmctld_pid() { daemon_pid slurmctld /run/slurmctld.pid root; }
slurmd_pid() { daemon_pid slurmd /run/slurmd.pid root; }
munged_pid() { daemon_pid munged /run/munge/munged.pid munge || daemon_pid munged /run/munge/munged.pid root; }

# Our cluster's daemons read the configuration at their start: a changed one restarts them.
stop_daemon() {
  local pid=$1
  [ -n "$pid" ] || return 0
  kill "$pid" 2>/dev/null || return 0
  for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.5; done
  kill -9 "$pid" 2>/dev/null || true
}
if [ "$OLD_CONF" != "$(cat "$CONF")" ] && { slurmctld_pid >/dev/null || slurmd_pid >/dev/null; }; then
  say "the configuration changed: restarting slurmctld and slurmd"
  stop_daemon "$(slurmctld_pid)"
  stop_daemon "$(slurmd_pid)"
fi
munged_pid >/dev/null || su -s /bin/sh munge -c "/usr/sbin/munged" 2>/dev/null || /usr/sbin/munged --force
slurmctld_pid >/dev/null || /usr/sbin/slurmctld
slurmd_pid >/dev/null || /usr/sbin/slurmd

for _ in $(seq 1 60); do
  if answers && [ "$(sinfo -h -N -o %T 2>/dev/null | head -1)" = "idle" ]; then
    say "started: one-host cluster, partition debug, node $HOST ($(sinfo -V 2>/dev/null))"
    exit 0
  fi
  sleep 1
done
scontrol update nodename="$HOST" state=resume >/dev/null 2>&1
if answers; then
  say "started, but node $HOST is $(sinfo -h -N -o %T 2>/dev/null | head -1); logs: /var/log/slurm"
else
  say "skipped: slurmctld does not answer; logs: /var/log/slurm (the SLURM tests will skip)"
  tail -n 5 /var/log/slurm/slurmctld.log 2>/dev/null | sed 's/^/install_slurm:   /'
fi
exit 0
