#!/usr/bin/env bash
# The CPU seconds a command and every process it starts use, counted by the kernel (a cgroup of its own), beside its
# wall seconds: what a test file costs the suite's two cores, whatever else the machine runs meanwhile (wall time on
# a shared machine moves 2x with the load; CPU seconds by about +-20%, from cache and core sharing).
#   bash scripts/cpu_seconds.sh NAME COMMAND...    prints "NAME <cpu s> <wall s> <status>"; the command's output goes
#                                                  to $CPU_SECONDS_LOG (default /dev/null)
#   bash scripts/cpu_seconds.sh sft .venv/bin/python -m pytest -q -p no:cacheprovider tests/recipes/test_sft_recipe.py
# Needs a writable cgroup hierarchy with CPU accounting (cgroup v1 cpuacct or cgroup v2, usually as root).
set -uo pipefail
if [ $# -lt 2 ]; then
  echo "usage: cpu_seconds.sh NAME COMMAND..." >&2
  exit 2
fi
name=$1
shift
if [ -w /sys/fs/cgroup/cpuacct ]; then
  root=/sys/fs/cgroup/cpuacct usage=cpuacct.usage scale=1000000000
elif [ -f /sys/fs/cgroup/cgroup.controllers ] && [ -w /sys/fs/cgroup ]; then
  root=/sys/fs/cgroup usage=cpu.stat scale=1000000
else
  echo "cpu_seconds.sh: no writable cgroup with CPU accounting (/sys/fs/cgroup/cpuacct or a cgroup v2 root): run" \
    "it as root on a machine that mounts one, or use /usr/bin/time, which misses processes it does not wait for" >&2
  exit 2
fi
group=$root/cpu_seconds_$$
mkdir "$group" || exit 2
echo $$ >"$group/cgroup.procs"
start=$(date +%s.%N)
"$@" >"${CPU_SECONDS_LOG:-/dev/null}" 2>&1
status=$?
end=$(date +%s.%N)
echo $$ >"$root/cgroup.procs"
sleep 0.5  # processes the command left behind end (or are counted as they stand)
if [ "$usage" = cpu.stat ]; then
  used=$(awk '$1 == "usage_usec" {print $2}' "$group/cpu.stat")
else
  used=$(cat "$group/$usage")
fi
rmdir "$group" 2>/dev/null
awk -v n="$name" -v u="$used" -v s="$scale" -v a="$start" -v b="$end" -v r="$status" \
  'BEGIN {printf "%s %.1f %.1f %d\n", n, u / s, b - a, r}'
exit "$status"
