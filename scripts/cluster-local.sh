#!/usr/bin/env bash
# N throwaway "hosts" on this machine, and (unless --no-slurm) a Slurm cluster over them: the multi-host tests.
#
#   scripts/cluster-local.sh start DIR --hosts N [--no-slurm] [--owner PID]
#                                                              # prints `export SLURM_CONF=DIR/slurm.conf`
#   scripts/cluster-local.sh exec DIR hI CMD ARGS...           # run CMD on host hI (cwd kept)
#   scripts/cluster-local.sh link DIR hI down|up               # cut host hI off the bridge / reconnect it
#   scripts/cluster-local.sh stop DIR                          # removes all that start made for DIR
#
# Needs root. A host hI (I = 1..N) is a network namespace with its own address on a private bridge
# (the bridge's .1 is this machine), a UTS namespace with hostname hI and a mount namespace in which
# DIR/hosts (every host's name and address) is /etc/hosts; a holder process (`sleep`) keeps the three
# namespaces alive and `nsenter -t HOLDER -n -u -m` enters them. Only the network, the hostname and
# /etc/hosts differ: the file system (DIR, the repository, the data) is the same on all hosts, as a
# cluster's shared storage. /etc/netns/NS/hosts is written too, so `ip netns exec NS` resolves the names.
# With Slurm: a private munged, slurmctld on this machine (SlurmctldHost=`hostname -s`(BRIDGE ADDRESS)),
# one `slurmd -N hI` entered into host I's namespaces (not `ip netns exec`, which remounts /sys: slurmd
# then finds no cgroup file system), NodeAddr its address; spool, pid and log files `%n`-named in DIR.
#
# What start makes is named after DIR (namespaces mrnXXXXXX-hI, bridge mrnbXXXXXX, a 10.231.X.0/24
# subnet) and recorded in /run/mariana-cluster/NS; stop removes exactly that. A failed start undoes
# itself (trap). Start first removes every cluster left stale by a crashed run: its holder is dead, its
# DIR is gone, or the --owner process (a test run's pid) has ended; daemons and namespaces alike.
set -Eeuo pipefail
export PATH="$PATH:/usr/sbin:/sbin"
OWNERS=/run/mariana-cluster  # NS -> what start made for it (holder pid, bridge, DIR)

usage() {
	echo "usage: $0 start DIR --hosts N [--no-slurm] | exec DIR hI CMD... | link DIR hI down|up | stop DIR" >&2
	exit 2
}
[ $# -ge 2 ] || usage
cmd=$1
dir=$2
shift 2

tag() { printf '%s' "$1" | md5sum | cut -c1-6; }  # DIR -> 6 hex digits naming what start makes

free_port() {
	python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
}

stop_pid() {  # stop process $1 (if it runs), waiting up to 10 s for it to exit
	local pid=$1
	[ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 0
	kill -TERM "$pid" 2>/dev/null || true
	for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
	kill -KILL "$pid" 2>/dev/null || true
}

stop_pidfile() { [ -f "$1" ] && { stop_pid "$(cat "$1" 2>/dev/null || true)"; rm -f "$1"; }; return 0; }

remove_ns() {  # netns $1 with its holder and bridge (from its owner record)
	local ns=$1 owner="$OWNERS/$1" holder="" bridge=""
	if [ -f "$owner" ]; then
		holder=$(sed -n 's/^holder=//p' "$owner")
		bridge=$(sed -n 's/^bridge=//p' "$owner")
	fi
	stop_pid "$holder"
	ip netns del "$ns" 2>/dev/null || true
	[ -n "$bridge" ] && ip link del "$bridge" 2>/dev/null || true
	rm -rf "/etc/netns/$ns" "${OWNERS:?}/$ns"
}

stop_slurm() {
	[ -f "$dir/slurm.conf" ] || return 0
	export SLURM_CONF="$dir/slurm.conf"
	# Jobs outlive slurmd (their slurmstepd runs on): cancel them first, while the controller answers.
	if [ -f "$dir/slurmctld.pid" ] && kill -0 "$(cat "$dir/slurmctld.pid")" 2>/dev/null; then
		squeue -h -o %i 2>/dev/null | xargs -r scancel --signal=KILL --full 2>/dev/null || true
		squeue -h -o %i 2>/dev/null | xargs -r scancel 2>/dev/null || true
		for _ in $(seq 100); do
			[ -z "$(squeue -h -t running,completing -o %i 2>/dev/null)" ] && break
			sleep 0.1
		done
	fi
	local f
	for f in "$dir"/slurmd-*.pid; do [ -e "$f" ] && stop_pidfile "$f"; done
	stop_pidfile "$dir/slurmctld.pid"
	stop_pidfile "$dir/munged.pid"
}

stop() {
	stop_slurm
	local t ns
	t=$(tag "$dir")
	for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^mrn$t-h" || true); do remove_ns "$ns"; done
	ip link del "mrnb$t" 2>/dev/null || true
}

remove_stale() {  # clusters of crashed runs (see the header); other live clusters are kept
	local ns holder owner old
	for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep '^mrn[0-9a-f]\{6\}-h' || true); do
		holder=$(sed -n 's/^holder=//p' "$OWNERS/$ns" 2>/dev/null || true)
		owner=$(sed -n 's/^owner=//p' "$OWNERS/$ns" 2>/dev/null || true)
		old=$(sed -n 's/^dir=//p' "$OWNERS/$ns" 2>/dev/null || true)
		if [ -n "$holder" ] && kill -0 "$holder" 2>/dev/null && [ -d "$old" ] &&
			{ [ -z "$owner" ] || kill -0 "$owner" 2>/dev/null; }; then
			continue
		fi
		echo "cluster-local: removing the stale $ns (of $old: its holder, directory or owner is gone)" >&2
		[ -d "$old" ] && (dir=$old && stop_slurm) || true
		remove_ns "$ns"
	done
}

holder_of() {  # host name hI -> its holder pid
	local ns
	ns="mrn$(tag "$dir")-$1"
	sed -n 's/^holder=//p' "$OWNERS/$ns" 2>/dev/null || true
}

make_hosts() {  # $1 hosts on bridge mrnbTAG, subnet 10.231.$2.0/24, owner pid $3 (or "")
	local n=$1 net=$2 owner=$3 t br i ns
	t=$(tag "$dir")
	br="mrnb$t"
	ip link add "$br" type bridge
	ip addr add "10.231.$net.1/24" dev "$br"
	ip link set "$br" up
	{
		echo "127.0.0.1 localhost"
		echo "::1 localhost"
		echo "10.231.$net.1 $(hostname -s)"
		for i in $(seq "$n"); do echo "10.231.$net.$((10 + i)) h$i"; done
		# IPv4-mapped forms too: c10d's store looks its peers up by their IPv6 socket addresses.
		for i in $(seq "$n"); do echo "::ffff:10.231.$net.$((10 + i)) h$i"; done
	} >"$dir/hosts"
	for i in $(seq "$n"); do
		ns="mrn$t-h$i"
		ip netns add "$ns"
		mkdir -p "/etc/netns/$ns" "$OWNERS"
		cp "$dir/hosts" "/etc/netns/$ns/hosts"
		echo "bridge=$br" >"$OWNERS/$ns"
		ip link add "mrn$t$i" type veth peer name "mrp$t$i"
		ip link set "mrn$t$i" master "$br" up
		ip link set "mrp$t$i" netns "$ns"
		ip -n "$ns" link set "mrp$t$i" name eth0
		ip -n "$ns" addr add "10.231.$net.$((10 + i))/24" dev eth0
		ip -n "$ns" link set eth0 up
		ip -n "$ns" link set lo up
		# The holder: new UTS and mount namespaces inside the network one; /etc/hosts bound to DIR/hosts.
		nsenter --net="/run/netns/$ns" unshare --uts --mount --propagation private \
			sh -c "mount --bind '$dir/hosts' /etc/hosts && hostname h$i && exec sleep infinity" \
			</dev/null >"$dir/holder-h$i.log" 2>&1 9>&- &
		echo "holder=$!" >>"$OWNERS/$ns"
		printf 'dir=%s\nowner=%s\n' "$dir" "$owner" >>"$OWNERS/$ns"
	done
	for i in $(seq "$n"); do  # the holders are ready once their hostname is set
		for _ in $(seq 100); do
			[ "$(nsenter -t "$(holder_of "h$i")" -u hostname 2>/dev/null)" = "h$i" ] && continue 2
			sleep 0.1
		done
		echo "cluster-local.sh: host h$i did not come up:" >&2
		cat "$dir/holder-h$i.log" >&2
		return 1
	done
}

write_conf() {
	local n=$1 net=$2 cpus=$3 ctld_port=$4 slurmd_port=$5 i
	cat >"$dir/slurm.conf" <<EOF
# Generated by scripts/cluster-local.sh: $n hosts in network namespaces on this machine.
ClusterName=mariana-local
SlurmctldHost=$(hostname -s)(10.231.$net.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
MinJobAge=${MIN_JOB_AGE:-10}
KillWait=5
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
EOF
	for i in $(seq "$n"); do
		echo "NodeName=h$i NodeAddr=10.231.$net.$((10 + i)) CPUs=$cpus State=UNKNOWN" >>"$dir/slurm.conf"
	done
	echo "PartitionName=debug Nodes=h[1-$n] Default=YES MaxTime=INFINITE State=UP" >>"$dir/slurm.conf"
}

start_slurm() {
	local n=$1 net=$2 cpus i
	for bin in munged mungekey slurmctld slurmd; do
		command -v "$bin" >/dev/null ||
			{ echo "cluster-local.sh: $bin not found (make slurm: apt-get install slurm-wlm munge)" >&2; return 1; }
	done
	rm -rf "$dir/state" "$dir/spool" "$dir/munge"
	mkdir -p "$dir/state" "$dir/munge"
	for i in $(seq "$n"); do mkdir -p "$dir/spool/h$i"; done
	chmod 0755 "$dir" "$dir/munge"  # clients of any user reach the socket; the key stays 0400
	mungekey --create --keyfile "$dir/munge/munge.key" --force
	chmod 0400 "$dir/munge/munge.key"
	munged --key-file "$dir/munge/munge.key" --socket "$dir/munge/munge.socket" \
		--pid-file "$dir/munged.pid" --log-file "$dir/munged.log" --seed-file "$dir/munge/munged.seed" --force
	cpus=$(($(nproc) * 32 > 64 ? $(nproc) * 32 : 64))  # test jobs never wait for cores
	write_conf "$n" "$net" "$cpus" "$(free_port)" "$(free_port)"
	export SLURM_CONF="$dir/slurm.conf"
	slurmctld -i  # -i: ignore state left from an earlier cluster
	for i in $(seq "$n"); do nsenter -t "$(holder_of "h$i")" -n -u -m slurmd -N "h$i"; done
	for _ in $(seq 300); do
		[ "$(sinfo -h -N -o '%T' 2>/dev/null | grep -cx idle)" = "$n" ] && return 0
		sleep 0.1
	done
	echo "cluster-local.sh: the $n nodes did not become idle within 30 s; sinfo says:" >&2
	sinfo -N -l >&2 || true
	tail -n 30 "$dir"/*.log >&2 || true
	return 1
}

start() {
	local n=0 slurm=1 owner="" net
	while [ $# -gt 0 ]; do
		case $1 in
		--hosts) n=${2:-}; shift 2 ;;
		--no-slurm) slurm=0; shift ;;
		--owner) owner=${2:-}; shift 2 ;;
		*) usage ;;
		esac
	done
	[[ $n =~ ^[1-9][0-9]?$ ]] || { echo "cluster-local.sh: --hosts expects a number 1-99, got '$n'" >&2; exit 2; }
	[ "$(id -u)" = 0 ] || { echo "cluster-local.sh: needs root (namespaces, slurmd)" >&2; exit 1; }
	mkdir -p "$OWNERS"
	exec 9>"$OWNERS/.lock"
	flock 9  # one start at a time: another start's half-made hosts (no holder yet) are not stale
	remove_stale
	stop  # an earlier cluster under DIR
	trap 'echo "cluster-local.sh: start failed; undoing it" >&2; stop' ERR
	net=$((16#$(tag "$dir" | cut -c1-2)))
	make_hosts "$n" "$net" "$owner"
	flock -u 9
	exec 9>&-
	if [ "$slurm" = 1 ]; then start_slurm "$n" "$net"; fi
	trap - ERR
	echo "cluster-local: $n host(s) h1..h$n on 10.231.$net.0/24 (this machine: 10.231.$net.1); state in $dir"
	if [ "$slurm" = 1 ]; then echo "export SLURM_CONF=$dir/slurm.conf"; fi
}

case $cmd in
start)
	mkdir -p "$dir"
	dir=$(cd "$dir" && pwd)
	start "$@"
	;;
exec)
	[ $# -ge 2 ] || usage
	dir=$(cd "$dir" && pwd)
	pid=$(holder_of "$1")
	[ -n "$pid" ] || { echo "cluster-local.sh: no host $1 in $dir" >&2; exit 2; }
	shift
	exec nsenter -t "$pid" -n -u -m --wd="$PWD" "$@"
	;;
link)  # a pulled cable: hI's bridge port down, so its packets are dropped silently (no reset, no ICMP)
	[ $# = 2 ] && [[ $2 =~ ^(down|up)$ ]] || usage
	dir=$(cd "$dir" && pwd)
	[ -n "$(holder_of "$1")" ] || { echo "cluster-local.sh: no host $1 in $dir" >&2; exit 2; }
	ip link set "mrn$(tag "$dir")${1#h}" "$2"
	# back up: forget the neighbours that failed meanwhile, else connects get "No route to host" for a while
	if [ "$2" = up ]; then
		for ns in $(ip netns list | grep -o "^mrn$(tag "$dir")-h[0-9]*"); do ip -n "$ns" neigh flush all; done
	fi
	;;
stop) [ -d "$dir" ] && { dir=$(cd "$dir" && pwd); stop; echo "cluster-local: stopped ($dir)"; } || true ;;
*) usage ;;
esac
