#!/usr/bin/env bash
# A single-node SLURM on this machine, for trying `learning_curves.py --cluster slurm` and for the
# test that needs one (CI runs this). Debian's packages; run as root. It writes
# /etc/slurm/slurm.conf (refusing to replace one it did not write), then starts munge, slurmctld and
# slurmd unless they already run. Nothing is left over between jobs but SLURM's state in /var/spool.
set -euo pipefail

if ! command -v slurmctld >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y slurm-wlm munge
fi

conf=/etc/slurm/slurm.conf
marker="# single-node SLURM of benchmarks/slurm_single_node.sh"
if [ -e "$conf" ] && ! grep -qxF "$marker" "$conf"; then
    echo "slurm_single_node.sh: $conf exists and is not ours: this machine has a SLURM already" >&2
    exit 1
fi
node="$(hostname -s)"
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge
# The node as slurmd sees it (its CPUs, sockets, memory); the job's processes tracked as a tree
# (no cgroups needed); no accounting database (learning_curves.py asks squeue, not sacct); the
# daemons on the loopback address, so that the machine's name need not resolve.
cat > "$conf" <<CONF
$marker
ClusterName=single
SlurmctldHost=${node}(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
$(slurmd -C | head -1) NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF

running() { [ -e "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
chown munge:munge /run/munge
munge -n >/dev/null 2>&1 || runuser -u munge -- /usr/sbin/munged
running /run/slurmctld.pid || slurmctld
running /run/slurmd.pid || slurmd
for _ in $(seq 30); do
    sinfo --noheader --format=%T 2>/dev/null | grep -Eq '^(idle|mixed)' && break
    sleep 1
done
sinfo
