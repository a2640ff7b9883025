#!/usr/bin/env bash
# Two "nodes" on this machine: two torchrun agents, started the way two real nodes would start them, that
# find each other through a c10d rendezvous on localhost and run launch/train_ddp.py together (lesson 09).
#
#   bash launch/multinode_local.sh [train_ddp.py arguments...]
#   PYTHON=.venv/bin/python NPROC_PER_NODE=1 bash launch/multinode_local.sh --epochs 2
#
# On real nodes, run the same torchrun command on every node, with HOST = the first node's address:
#   torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 --rdzv-id=JOB \
#       launch/train_ddp.py ...
# Under c10d the rendezvous gives the agents node ranks (sorted by host, then pid): --node-rank is not needed
# (and is ignored).
#
# Environment: PYTHON (default python3), NPROC_PER_NODE (workers per node, default 1), PORT (rendezvous
# port, default: a free one), JOIN_TIMEOUT (seconds an agent waits for the other, default 60). With GPUs,
# node i sees only its own NPROC_PER_NODE GPUs (CUDA_VISIBLE_DEVICES), as on separate machines, so both
# nodes' workers use cuda:0.. (their LOCAL_RANK); without enough GPUs the workers use the CPU and gloo.
# Output lines are prefixed [node0] / [node1]. When one agent fails the other is stopped; Ctrl-C stops both.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
python=${PYTHON:-python3}
nproc=${NPROC_PER_NODE:-1}
port=${PORT:-$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
join_timeout=${JOIN_TIMEOUT:-60}
run_id="local-$$"
gpus=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)

pids=()
stop() {
    # SIGTERM: torchrun stops its workers (they run in sessions of their own) before it exits.
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
}
trap 'stop; wait' EXIT
trap 'exit 130' INT TERM

echo "rendezvous: c10d at 127.0.0.1:$port, 2 nodes x $nproc workers"
for node in 0 1; do
    visible=""
    if (( gpus >= 2 * nproc )); then
        visible=$(seq -s, $((node * nproc)) $((node * nproc + nproc - 1)))
    fi
    # Every node runs the same command: same endpoint, same --rdzv-id, no --node-rank.
    CUDA_VISIBLE_DEVICES=${visible:-${CUDA_VISIBLE_DEVICES-}} \
    "$python" -m torch.distributed.run \
        --nnodes=2 --nproc-per-node="$nproc" \
        --rdzv-backend=c10d --rdzv-endpoint="127.0.0.1:$port" --rdzv-id="$run_id" \
        --rdzv-conf="join_timeout=$join_timeout" \
        "$here/train_ddp.py" "$@" \
        > >(sed -u "s/^/[node$node] /") 2>&1 &
    pids+=($!)
done

# Wait for the first agent to finish; if it failed, the other would wait for it forever: stop it.
status=0
wait -n "${pids[@]}" || status=$?
if (( status != 0 )); then
    echo "an agent exited with status $status: stopping the other" >&2
    stop
fi
for pid in "${pids[@]}"; do
    wait "$pid" || { s=$?; (( status == 0 )) && status=$s; }
done
pids=()
exit "$status"
