#!/usr/bin/env bash
# Start one testbed node on this host as part of a real multi-host Ray cluster: the node image
# with the testbed's settings (compose/.env, the environment overriding each, as for `make up`),
# host networking as vLLM's examples/online_serving/run_cluster.sh does.
#
#   scripts/join.sh head            on the head host: Ray head, then (once every worker joined,
#                                   TESTBED_WORKERS of them within TESTBED_NODES_WAIT_S) the
#                                   OpenAI API server on port 8000
#   scripts/join.sh HEAD_ADDRESS    on each worker host: join the head's Ray cluster
#
# Environment: NODE_IP  the address the other hosts reach this one at (default: this host's
#                       source address towards HEAD_ADDRESS, or its first address for the head)
#              NETWORK  docker network (default host; any other is for trying it on one machine)
#              NAME     container name (default testbed-head / testbed-worker)
#              PROFILE  cpu (default) | gpu (all GPUs of the host, the gpu image and defaults)
#              CPUSET   cores to pin the node to (default none; two nodes on one machine: 0 and 1)
# Ports on the head host: 6379 (Ray GCS), 8000 (OpenAI API), 8265 (Ray dashboard, with
# TESTBED_DASHBOARD=1); on every host, Ray's node ports (raylet, object manager, workers
# 10002-19999) and vLLM's (the MessageQueue's ZMQ sockets, gloo/NCCL): the hosts must reach each
# other on all of them (docs/multihost.md). Stop a node with: docker rm -f NAME.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ROLE=${1:?usage: scripts/join.sh head | HEAD_ADDRESS}
PROFILE=${PROFILE:-cpu}
NETWORK=${NETWORK:-host}

# The knobs: compose/.env (and gpu.env on the gpu profile), each overridden by the environment.
declare -A KNOBS
for file in "$ROOT/compose/.env" $([ "$PROFILE" = gpu ] && echo "$ROOT/compose/gpu.env"); do
  while IFS= read -r line; do
    [[ -z "$line" || "$line" == \#* || "$line" != *=* ]] && continue
    KNOBS[${line%%=*}]=${line#*=}
  done <"$file"
done
ENV_ARGS=()
for key in "${!KNOBS[@]}"; do
  ENV_ARGS+=(-e "$key=${!key-${KNOBS[$key]}}")
done
ENV_ARGS+=(-e "TESTBED_PROFILE=$PROFILE" -e "RAY_DEDUP_LOGS=0")
IMAGE=${TESTBED_IMAGE:-${KNOBS[TESTBED_IMAGE]}}
DEVICE_ARGS=(--shm-size 2g)
if [ "$PROFILE" = gpu ]; then
  IMAGE=${TESTBED_GPU_IMAGE:-${KNOBS[TESTBED_GPU_IMAGE]}}
  DEVICE_ARGS=(--gpus all --shm-size "${KNOBS[TESTBED_GPU_SHM_SIZE]}")
fi
docker image inspect "$IMAGE" >/dev/null 2>&1 || {
  echo "join: image $IMAGE not on this host: build it (make image) or pull it from your registry" >&2; exit 1; }

if [ "$ROLE" = head ]; then
  NAME=${NAME:-testbed-head}
  NODE_IP=${NODE_IP:-$(hostname -I | awk '{print $1}')}
  COMMAND=testbed-head
else
  NAME=${NAME:-testbed-worker}
  NODE_IP=${NODE_IP:-$(ip -4 route get "$ROLE" 2>/dev/null | awk '{for (i = 1; i < NF; i++) if ($i == "src") print $(i + 1)}')}
  COMMAND=testbed-worker
  ENV_ARGS+=(-e "TESTBED_HEAD_HOST=$ROLE")
fi
[ -n "$NODE_IP" ] || { echo "join: cannot tell this host's address: set NODE_IP" >&2; exit 1; }
ENV_ARGS+=(-e "TESTBED_NODE_IP=$NODE_IP")
NET_ARGS=(--network "$NETWORK" ${CPUSET:+--cpuset-cpus "$CPUSET"})
[ "$NETWORK" = host ] || NET_ARGS+=(--ip "$NODE_IP")

docker run --detach --name "$NAME" --init "${NET_ARGS[@]}" "${DEVICE_ARGS[@]}" "${ENV_ARGS[@]}" \
  --label vllm-zerocopy-testbed.join="$COMMAND" "$IMAGE" "$COMMAND" >/dev/null
echo "join: $NAME ($COMMAND) started on $NODE_IP, network $NETWORK, image $IMAGE"
if [ "$ROLE" = head ]; then
  echo "join: workers: scripts/join.sh $NODE_IP; API (once warmed up): http://$NODE_IP:8000/v1; logs: docker logs -f $NAME"
fi
