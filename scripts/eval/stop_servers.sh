#!/usr/bin/env bash
# Stop the evaluation servers (this user's) an earlier device call left running on this host:
# a call cut off by its time limit takes run.py with it, but its servers
# (python -m sglang_elastic.eval.ray_entry --placement-group ...) and their
# Ray scheduler actors keep the GPUs the next call's placement groups wait for.
# SIGTERM (SGLang's launcher stops its children), SIGKILL after GRACE_S
# (default 30) seconds. Prints what it stopped on stderr; status 0.
#
#   bash scripts/eval/stop_servers.sh        (scripts/eval/host_batch.sh runs it first on a GPU host)
set -uo pipefail
entry='-m sglang_elastic[.]eval[.]ray_entry --placement-group'
# -- ends pgrep's options: the pattern itself starts with -m
pids=$(pgrep -u "$(id -u)" -f -- "$entry" | tr '\n' ' ')
[ -n "${pids// /}" ] || exit 0
echo "stop_servers.sh: stopping servers an earlier call left running: $pids" >&2
pkill -u "$(id -u)" -TERM -f -- "$entry"
for _ in $(seq "${GRACE_S:-30}"); do pgrep -u "$(id -u)" -f -- "$entry" > /dev/null || exit 0; sleep 1; done
pkill -u "$(id -u)" -KILL -f -- "$entry"
exit 0
