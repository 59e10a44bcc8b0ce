"""A LocalCluster (Ray on loopback + router) for the duration of a block, and a small cluster
config for it."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from splitserve.testing.event_loop import EventLoopThread


@contextmanager
def running_cluster(config):
    """A LocalCluster (Ray on loopback + router) for the duration of the block; yields (cluster, loop).

    A Ray session it starts is shut down afterwards, so no later test depends on it."""
    import ray

    from splitserve.deploy.local import LocalCluster

    owns_ray = not ray.is_initialized()
    loop = EventLoopThread()
    cluster = LocalCluster(config)
    try:
        loop.run(cluster.start())
        yield cluster, loop
    finally:
        loop.run(cluster.stop())
        loop.close()
        if owns_ray:
            ray.shutdown()


def tiny_cluster_config(model_dir: Path, mode: str = "disaggregated", prefill: int = 1, decode: int = 1,
                        backend: str = "nixl", **overrides):
    """A small cluster for tests: tiny KV pools, one thread per worker, any free gRPC, HTTP and metrics port."""
    from splitserve.deploy.cluster_config import apply_overrides, default_cluster_config

    settings = {"mode": mode, "prefill.replicas": prefill if mode == "disaggregated" else 0,
                "decode.replicas": decode, "router.grpc_port": 0, "router.metrics_port": 0, "router.http_port": 0,
                "kv_transfer_backend": backend,
                "router.routing.disaggregation": "always"}  # as in InProcessCluster
    for pool in ("prefill", "decode"):
        settings.update({f"{pool}.engine.num_threads": 1, f"{pool}.engine.device": "cpu",
                         f"{pool}.engine.num_kv_blocks": 512, f"{pool}.engine.block_size": 8,
                         f"{pool}.resources.num_cpus": 0.25})
    settings.update(overrides)
    return apply_overrides(default_cluster_config(str(model_dir)), settings)
