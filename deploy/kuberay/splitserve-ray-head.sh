#!/usr/bin/env bash
# The head container of a splitserve RayCluster (installed as /usr/local/bin/splitserve-ray-head).
#
# Starts the Ray head with the command KubeRay generated for this pod (KUBERAY_GEN_RAY_START_CMD:
# `ray start --head ... --block`, with the RayCluster's rayStartParams), waits until its GCS
# answers, then runs the router, `splitserve serve "$@"`, which joins that Ray cluster
# (ray_address: auto) and starts the worker actors. The container lives as long as both do:
#
#   SIGTERM/SIGINT  the router stops its workers and exits, then Ray is stopped; the router's status
#   router exits    Ray is stopped; the router's exit status
#   Ray exits       the router is stopped; status 1 (Kubernetes restarts the container)
#
# The head pod template carries `ray.io/overwrite-container-cmd: "true"`, so KubeRay runs this
# as the container's command instead of putting its own `ray start` around it.
set -uo pipefail

readonly gcs_wait_s=${SPLITSERVE_GCS_WAIT_S:-300}
readonly gcs_address="127.0.0.1:${RAY_PORT:-6379}"

log() { echo "splitserve-ray-head: $*" >&2; }

if [[ -z "${KUBERAY_GEN_RAY_START_CMD:-}" ]]; then
    log "KUBERAY_GEN_RAY_START_CMD is not set: run this in the head container of a KubeRay RayCluster"
    exit 2
fi
ulimit -n 65536 2>/dev/null || log "cannot raise the open-file limit to 65536 (it stays $(ulimit -n))"

serve_pid=""
stopping=0
on_signal() {
    stopping=1
    if [[ -n "$serve_pid" ]]; then
        kill -TERM "$serve_pid" 2>/dev/null
    fi
}
trap on_signal TERM INT

stop_ray() {
    kill -TERM "$ray_pid" 2>/dev/null
    wait "$ray_pid" 2>/dev/null
}

# The generated command holds shell quoting (e.g. --resources='{...}'): let a shell parse it.
bash -c "exec ${KUBERAY_GEN_RAY_START_CMD}" &
ray_pid=$!
log "started the Ray head (pid $ray_pid): ${KUBERAY_GEN_RAY_START_CMD}"

deadline=$((SECONDS + gcs_wait_s))
until ray health-check --address "$gcs_address" >/dev/null 2>&1; do
    if ! kill -0 "$ray_pid" 2>/dev/null; then
        wait "$ray_pid"
        log "the Ray head exited (status $?) before its GCS at $gcs_address answered"
        exit 1
    fi
    if ((stopping)); then
        stop_ray
        exit 0
    fi
    if ((SECONDS >= deadline)); then
        log "the GCS at $gcs_address did not answer within ${gcs_wait_s}s"
        stop_ray
        exit 1
    fi
    sleep 1 &
    wait $!  # a signal interrupts this wait at once, not the sleep
done

splitserve serve "$@" &
serve_pid=$!
log "GCS at $gcs_address is up; started the router (pid $serve_pid): splitserve serve $*"
if ((stopping)); then
    kill -TERM "$serve_pid" 2>/dev/null
fi

while true; do
    done_pid=""  # wait -p unsets it first, and leaves it unset when a signal interrupts the wait
    wait -n -p done_pid "$ray_pid" "$serve_pid"
    status=$?
    if [[ "${done_pid:-}" == "$serve_pid" ]]; then
        log "the router exited (status $status); stopping the Ray head"
        stop_ray
        exit "$status"
    fi
    if [[ "${done_pid:-}" == "$ray_pid" ]]; then
        log "the Ray head exited (status $status); stopping the router"
        kill -TERM "$serve_pid" 2>/dev/null
        wait "$serve_pid"
        exit 1
    fi
    # No pid: a signal interrupted the wait; on_signal passed it to the router. Wait for it to end.
done
