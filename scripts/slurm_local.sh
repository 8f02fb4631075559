#!/usr/bin/env bash
# A Slurm cluster on this machine (127.0.0.1), for trying `srun`/`sbatch` launches of atorch locally.
#
#   scripts/slurm_local.sh start     # munged + slurmctld + slurmd; waits until sinfo shows the node idle
#   scripts/slurm_local.sh status    # sinfo of the local cluster (exit 1 when it is not up)
#   scripts/slurm_local.sh stop      # stops the daemons this script started (by their pid files)
#   scripts/slurm_local.sh env       # prints `export SLURM_CONF=...` (eval it, then use srun/sbatch/sinfo)
#   ATORCH_SLURM_NODES=2 scripts/slurm_local.sh start   # two nodes on this one machine (see below)
#
# Needs Debian's `slurm-wlm` and `munge` (apt-get install slurm-wlm munge) and root: slurmd
# launches tasks as the submitting user. Everything lives under $ATORCH_SLURM_DIR (default
# /tmp/atorch-slurm): a private munge key and socket (a system munged, if any, is not touched),
# the generated slurm.conf (this machine's hostname, CPUs and memory from `slurmd -C`), state,
# spool and logs. `start` is idempotent: daemons already running are kept, missing ones started.
# Environment: ATORCH_SLURM_DIR, ATORCH_SLURM_TIMEOUT (seconds to wait for the node, default 60),
# ATORCH_SLURM_CTLD_PORT / ATORCH_SLURM_SLURMD_PORT (default 6817 / 6818; node i listens on the
# latter + i), ATORCH_SLURM_FIRST_JOB_ID (default random: atorch derives a job's rendezvous port
# from its id, so two local clusters numbering their jobs alike would collide).
# ATORCH_SLURM_NODES=2: two slurmd daemons on this machine pose as nodes <hostname> and
# <hostname>-2 (the first resolves, and tasks use it as their rendezvous host; Slurm reaches both
# at 127.0.0.1), with half the CPUs each and no CPU binding (each slurmd would bind its tasks to
# the "first" CPU, the same one). For trying multi-node launches (`srun -N2`); one node is the default.
set -euo pipefail

DIR=${ATORCH_SLURM_DIR:-/tmp/atorch-slurm}
TIMEOUT=${ATORCH_SLURM_TIMEOUT:-60}
NODES=${ATORCH_SLURM_NODES:-1}
CTLD_PORT=${ATORCH_SLURM_CTLD_PORT:-6817}
SLURMD_PORT=${ATORCH_SLURM_SLURMD_PORT:-6818}
FIRST_JOB_ID=${ATORCH_SLURM_FIRST_JOB_ID:-$(((RANDOM << 8 | RANDOM & 255) + 1))}
CONF=$DIR/slurm.conf
MUNGE_SOCKET=$DIR/munge/munge.socket
export SLURM_CONF=$CONF

die() { echo "slurm_local.sh: error: $*" >&2; exit 1; }
say() { echo "slurm_local.sh: $*" >&2; }

alive() {  # alive PIDFILE: the process named by the pid file runs
    [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

need_tools() {
    local missing=() tool
    for tool in munged munge unmunge slurmctld slurmd sinfo srun scontrol; do
        command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
    done
    ((${#missing[@]} == 0)) || die "not found on PATH: ${missing[*]} (Debian: apt-get install slurm-wlm munge)"
    [[ $(id -u) == 0 ]] || die "must run as root (slurmd starts tasks as the submitting user)"
}

start_munge() {
    if alive "$DIR/munge/munged.pid"; then return; fi
    mkdir -p "$DIR/munge"
    chmod 755 "$DIR" "$DIR/munge"   # munged requires a socket directory everybody can traverse
    if [[ ! -s $DIR/munge/munge.key ]]; then
        dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
    fi
    chmod 400 "$DIR/munge/munge.key"
    rm -f "$MUNGE_SOCKET"
    munged --key-file="$DIR/munge/munge.key" --socket="$MUNGE_SOCKET" --pid-file="$DIR/munge/munged.pid" \
        --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed" \
        || die "munged did not start; see $DIR/munge/munged.log"
    munge -n -S "$MUNGE_SOCKET" | unmunge -S "$MUNGE_SOCKET" >/dev/null \
        || die "munge cannot encode/decode a credential on $MUNGE_SOCKET; see $DIR/munge/munged.log"
}

write_conf() {
    # `slurmd -C` prints this machine's node line (NodeName=<short hostname> CPUs=... RealMemory=...).
    local node_line host names=() i cpus memory task_plugin=task/affinity nodes_conf=""
    node_line=$(slurmd -C | grep '^NodeName=') || die "slurmd -C printed no NodeName line"
    host=$(sed -E 's/^NodeName=([^ ]+).*/\1/' <<<"$node_line")
    case $NODES in
        1) names=("$host")
           nodes_conf="$node_line NodeAddr=127.0.0.1 Port=$SLURMD_PORT State=UNKNOWN" ;;
        2) names=("$host" "$host-2")
           cpus=$(sed -E 's/.* CPUs=([0-9]+).*/\1/' <<<"$node_line")
           memory=$(sed -E 's/.* RealMemory=([0-9]+).*/\1/' <<<"$node_line")
           ((cpus >= 2)) || die "$cpus CPU(s) cannot make 2 nodes of at least one CPU each"
           task_plugin=task/none
           for i in 0 1; do
               nodes_conf+="NodeName=${names[i]} NodeHostname=${names[i]} NodeAddr=127.0.0.1 Port=$((SLURMD_PORT + i))"
               nodes_conf+=" CPUs=$((cpus / 2)) RealMemory=$((memory / 2)) State=UNKNOWN"$'\n'
           done ;;
        *) die "ATORCH_SLURM_NODES=$NODES: use 1 or 2" ;;
    esac
    getent hosts "${names[0]}" >/dev/null \
        || say "warning: node name '${names[0]}' does not resolve here, yet srun tasks use it as MASTER_ADDR"
    mkdir -p "$DIR/state" "$DIR/log"
    cat >"$CONF.tmp" <<CONF
# Generated by atorch's scripts/slurm_local.sh: $NODES node(s) on 127.0.0.1.
ClusterName=atorch-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool-%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
# No cgroups (containers rarely delegate them); on one node tasks are still bound to their own cores.
ProctrackType=proctrack/linuxproc
TaskPlugin=$task_plugin
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
InactiveLimit=0
KillWait=5
MinJobAge=30
FirstJobId=$FIRST_JOB_ID
SlurmdTimeout=120
$nodes_conf
PartitionName=debug Nodes=$(IFS=,; echo "${names[*]}") Default=YES MaxTime=INFINITE State=UP
CONF
    mv "$CONF.tmp" "$CONF"
}

conf_nodes() {  # the node names of the written slurm.conf
    sed -nE 's/^NodeName=([^ ]+).*/\1/p' "$CONF"
}

node_state() {  # the worst node state sinfo shows (empty when slurmctld does not answer)
    local states
    states=$(timeout 10 sinfo -h -N -o '%T' 2>/dev/null | sort -u) || true
    grep -vxE 'idle|mixed|allocated|completing' <<<"$states" | head -1 || head -1 <<<"$states"
}

wait_until_idle() {
    local deadline=$((SECONDS + TIMEOUT)) state resumed=0
    while :; do
        state=$(node_state)
        case $state in
            idle|mixed|allocated|completing) say "$(conf_nodes | wc -l) node(s) up, $state"; return 0 ;;
            down*|drain*|fail*)   # 'idle*' (not responding yet) falls through to waiting
                if ((resumed == 0)); then   # left down by an earlier run: give it back to service once
                    scontrol update NodeName=ALL State=RESUME >/dev/null 2>&1 || true
                    resumed=1
                fi ;;
        esac
        if ((SECONDS >= deadline)); then
            say "nodes not idle after ${TIMEOUT} s (state: '${state:-slurmctld not answering}')"
            timeout 10 sinfo -N -l 2>&1 | sed 's/^/  /' >&2 || true
            timeout 10 scontrol show node 2>&1 | grep -iE 'state|reason' | sed 's/^/  /' >&2 || true
            tail -n 15 "$DIR"/log/*.log 2>/dev/null | sed 's/^/  /' >&2 || true
            die "the local cluster did not come up; logs in $DIR/log"
        fi
        sleep 1
    done
}

any_slurm_daemon() {
    local f
    for f in "$DIR"/slurmctld.pid "$DIR"/slurmd-*.pid; do alive "$f" && return 0; done
    return 1
}

start() {
    need_tools
    mkdir -p "$DIR"
    start_munge
    any_slurm_daemon || write_conf
    [[ -s $CONF ]] || die "$CONF is missing while a Slurm daemon of $DIR runs; run '$0 stop' first"
    if ! alive "$DIR/slurmctld.pid"; then
        # -c: start from a clean state (no jobs or node states left from an earlier cluster).
        slurmctld -f "$CONF" -c || die "slurmctld did not start; see $DIR/log/slurmctld.log"
    fi
    local name
    for name in $(conf_nodes); do
        if ! alive "$DIR/slurmd-$name.pid"; then
            slurmd -f "$CONF" -N "$name" || die "slurmd of node $name did not start; see $DIR/log/slurmd-$name.log"
        fi
    done
    wait_until_idle
    echo "export SLURM_CONF=$CONF"
}

stop_daemons() {  # stop_daemons PIDFILE...: TERM them all at once, KILL what still runs after 15 s
    local pidfile pids=() pid
    for pidfile in "$@"; do
        alive "$pidfile" && pids+=("$(cat "$pidfile")")
    done
    ((${#pids[@]})) || return 0
    kill -TERM "${pids[@]}" 2>/dev/null || true
    for _ in $(seq 150); do
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && break; pid=""; done
        [[ -n ${pid:-} ]] || { rm -f "$@"; return 0; }
        sleep 0.1
    done
    say "pids ${pids[*]} ignored SIGTERM for 15 s; killing them"
    kill -KILL "${pids[@]}" 2>/dev/null || true
    rm -f "$@"
}

stop() {
    stop_daemons "$DIR"/slurmd-*.pid "$DIR/slurmctld.pid"   # each takes 1 to 2 s to shut down
    stop_daemons "$DIR/munge/munged.pid"                    # last: the Slurm daemons use it until they exit
    say "stopped"
}

status() {
    alive "$DIR/slurmctld.pid" || { say "slurmctld of $DIR is not running"; return 1; }
    timeout 10 sinfo -N -l
}

case ${1:-} in
    start) start ;;
    stop) stop ;;
    status) status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
