#!/usr/bin/env bash
# A one-node SLURM cluster for tests/slurm/ (make test-slurm), without systemd.
#
#   tests/slurm/cluster.sh up      install what is missing (apt, as root), start munged, MariaDB,
#                                  slurmdbd, slurmctld and slurmd; wait until the node is idle
#   tests/slurm/cluster.sh down    stop every daemon `up` started, by its own pid; check none is left
#   tests/slurm/cluster.sh env     the environment the tests need (SLURM_CONF, the partition)
#   tests/slurm/cluster.sh logs    every daemon's log
#   tests/slurm/cluster.sh run CMD...  up, CMD with the environment, the logs if it failed, down
#                                  (make test-slurm); exits with CMD's code, 0 when `up` skipped
#
# Exit codes of `up`: 0 the cluster is up; 3 it cannot be brought up here (not
# root, no apt, packages fail to install: one line says why; the caller skips);
# 1 a daemon failed to start (the daemons' logs are printed, everything is stopped).
#
# Everything lives in $FLASHRT_SLURM_DIR (default /tmp/flashrt-slurm): configs,
# MariaDB's data, spool, logs, pids. Nothing is written under /etc; the clients
# find the cluster through SLURM_CONF. The accounting (slurmdbd over MariaDB) is
# required: without it `sacct` answers nothing and submitit never sees a
# cancelled or timed-out job end.
set -euo pipefail

STATE=${FLASHRT_SLURM_DIR:-/tmp/flashrt-slurm}
PARTITION=flashrt
CLUSTER=flashrt
DB_PORT=${FLASHRT_SLURM_DB_PORT:-33061}
PACKAGES=(slurm-wlm slurmdbd munge mariadb-server)
DAEMONS=(slurmd slurmctld slurmdbd mariadbd munged) # the order `down` stops them in
export SLURM_CONF=$STATE/etc/slurm.conf

say() { echo "cluster.sh: $*" >&2; }

pid_alive() { [[ -f $STATE/run/$1.pid ]] && kill -0 "$(cat "$STATE/run/$1.pid")" 2>/dev/null; }

# wait_for SECONDS DESCRIPTION COMMAND...: poll COMMAND once a second until it succeeds.
wait_for() {
    local seconds=$1 what=$2
    shift 2
    for ((i = 0; i < seconds; i++)); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 1
    done
    say "$what: not ready after ${seconds}s"
    return 1
}

# start NAME COMMAND...: a daemon in the foreground of a background process of its own session.
start() {
    local name=$1
    shift
    setsid "$@" >>"$STATE/log/$name.out" 2>&1 </dev/null &
    echo $! >"$STATE/run/$name.pid"
}

logs() {
    for f in "$STATE"/log/*; do
        [[ -f $f ]] || continue
        echo "===== $f (last 60 lines)"
        tail -n 60 "$f"
    done
}

install_packages() {
    local missing=()
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    [[ ${#missing[@]} -eq 0 ]] && return 0
    if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
        say "SKIP: SLURM packages missing (${missing[*]}) and they cannot be installed here (needs root and apt-get)"
        return 3
    fi
    say "installing ${missing[*]} (about a minute)"
    # Stop the packages' init scripts from starting daemons we do not manage.
    local policy=/usr/sbin/policy-rc.d added_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && added_policy=1
    fi
    local ok=0
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}"; } >"$STATE/log/apt.log" 2>&1 || ok=$?
    [[ $added_policy -eq 1 ]] && rm -f "$policy"
    if [[ $ok -ne 0 ]]; then
        say "SKIP: apt-get could not install ${missing[*]} (see $STATE/log/apt.log): $(tail -n 1 "$STATE/log/apt.log")"
        return 3
    fi
}

write_configs() {
    local host cpus mem
    host=$(hostname -s)
    cpus=$(slurmd -C | sed -n 's/.*CPUs=\([0-9]*\).*/\1/p')
    mem=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
    mem=$((mem * 8 / 10)) # at or under what slurmd finds, with room for the daemons
    mkdir -p "$STATE"/{etc,ctld,spool}
    cat >"$SLURM_CONF" <<EOF
ClusterName=$CLUSTER
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/run/slurmctld.daemon.pid
SlurmdPidFile=$STATE/run/slurmd.daemon.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
KillWait=30
MinJobAge=600
InactiveLimit=0
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=$PARTITION Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
    cat >"$STATE/etc/slurmdbd.conf" <<EOF
DbdHost=localhost
SlurmUser=root
AuthType=auth/munge
LogFile=$STATE/log/slurmdbd.log
PidFile=$STATE/run/slurmdbd.daemon.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=flashrt
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$STATE/etc/slurmdbd.conf"
}

start_munge() {
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    chmod 755 /run/munge
    if [[ ! -s /etc/munge/munge.key ]]; then
        mungekey --create --keyfile=/etc/munge/munge.key
        chown munge:munge /etc/munge/munge.key
        chmod 400 /etc/munge/munge.key
    fi
    start munged setpriv --reuid=munge --regid=munge --init-groups munged --foreground \
        --socket=/run/munge/munge.socket.2 --pid-file="$STATE/run/munged.daemon.pid" --log-file="$STATE/log/munged.log"
    wait_for 30 munged sh -c 'munge -n | unmunge'
}

start_mariadb() {
    local data=$STATE/mysql socket=$STATE/run/mysqld.sock
    if [[ ! -d $data/mysql ]]; then
        mariadb-install-db --user=mysql --datadir="$data" --skip-test-db --auth-root-authentication-method=socket \
            >>"$STATE/log/mariadb-install.log" 2>&1
    fi
    start mariadbd mariadbd --no-defaults --user=mysql --datadir="$data" --socket="$socket" --port="$DB_PORT" \
        --bind-address=127.0.0.1 --pid-file="$STATE/run/mariadbd.daemon.pid" --log-error="$STATE/log/mariadb.log" \
        --innodb-buffer-pool-size=64M
    wait_for 60 mariadbd mariadb-admin --socket="$socket" ping
    mariadb --socket="$socket" <<EOF
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'flashrt';
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'flashrt';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
EOF
}

up() {
    if pid_alive slurmctld && pid_alive slurmd; then
        say "already up ($STATE)"
        return 0
    fi
    if [[ $(id -u) -ne 0 ]]; then
        say "SKIP: the test cluster needs root (its daemons run as root, munge and mysql)"
        return 3
    fi
    down quiet || true
    mkdir -p "$STATE"/{run,log}
    chmod 755 "$STATE"
    chmod 1777 "$STATE/run" "$STATE/log" # munged and mariadbd write there as their own users
    install_packages || return $?
    write_configs
    start_munge || fail
    start_mariadb || fail
    start slurmdbd slurmdbd -D
    wait_for 120 slurmdbd sacctmgr -n list cluster || fail
    sacctmgr -i -Q add cluster "$CLUSTER" >/dev/null 2>&1 || true
    start slurmctld slurmctld -D
    wait_for 60 slurmctld scontrol ping || fail
    start slurmd slurmd -D
    wait_for 120 "the node idle" sh -c "sinfo -h -p $PARTITION -o %t | grep -qx idle" || fail
    wait_for 60 "accounting" sh -c "sacctmgr -n -P list cluster format=cluster,controlport | grep -q '^$CLUSTER|[1-9]'" || fail
    say "up: partition $PARTITION, $(sinfo -h -p $PARTITION -o '%D node(s), %c CPUs, %m MB'), SLURM_CONF=$SLURM_CONF"
}

fail() {
    say "a daemon did not start; the logs follow, then everything is stopped"
    logs >&2
    down quiet
    exit 1
}

down() {
    local quiet=${1:-}
    if pid_alive slurmctld && [[ -n $(squeue -h -o %i 2>/dev/null) ]]; then
        scancel --full --partition="$PARTITION" 2>/dev/null || true # a job left behind ends before its node
        wait_for 90 "the queue empty" sh -c '[ -z "$(squeue -h -o %i)" ]' || true
    fi
    for name in "${DAEMONS[@]}"; do
        local file=$STATE/run/$name.pid
        [[ -f $file ]] || continue
        local pid
        pid=$(cat "$file")
        if kill -0 "$pid" 2>/dev/null; then
            kill -TERM "$pid" 2>/dev/null || true
            for ((i = 0; i < 60; i++)); do
                kill -0 "$pid" 2>/dev/null || break
                sleep 0.5
            done
            if kill -0 "$pid" 2>/dev/null; then
                say "$name (pid $pid) ignored SIGTERM for 30 s: SIGKILL"
                kill -KILL "$pid" 2>/dev/null || true
            fi
        fi
        rm -f "$file"
    done
    # A slurmstepd outlives its slurmd by design: one left holds a job of ours that would not end.
    local steps
    steps=$(pgrep -x slurmstepd || true)
    for pid in $steps; do kill -KILL "$pid" 2>/dev/null || true; done
    [[ -z $steps ]] || sleep 1
    local left
    left=$(for name in "${DAEMONS[@]}" slurmstepd; do pgrep -x "$name"; done || true)
    if [[ -n $left ]]; then
        [[ -n $quiet ]] || say "left running after down: $(ps -o pid=,comm= -p "${left//$'\n'/,}" | tr '\n' ' ')"
        return 1
    fi
    [[ -n $quiet ]] || say "down: no daemon left running"
    return 0
}

# run CMD...: the cluster up for CMD only; down whatever happens (a failed CMD first prints the logs).
run() {
    local rc=0
    up || rc=$?
    if [[ $rc -eq 3 ]]; then
        return 0 # skipped: up said why in one line
    elif [[ $rc -ne 0 ]]; then
        return "$rc"
    fi
    trap 'down' EXIT
    export FLASHRT_SLURM_PARTITION=$PARTITION FLASHRT_SLURM_DIR=$STATE
    "$@" || rc=$?
    if [[ $rc -ne 0 ]]; then
        say "$* failed (exit code $rc): the daemons' logs follow"
        logs >&2
    fi
    trap - EXIT
    down || { [[ $rc -ne 0 ]] || rc=1; } # a daemon left running fails the run
    return "$rc"
}

case ${1:-} in
up) up ;;
run)
    shift
    run "$@"
    ;;
down) down ;;
logs) logs ;;
env) echo "SLURM_CONF=$SLURM_CONF FLASHRT_SLURM_PARTITION=$PARTITION FLASHRT_SLURM_DIR=$STATE" ;;
*)
    echo "usage: $0 up|down|env|logs" >&2
    exit 2
    ;;
esac
