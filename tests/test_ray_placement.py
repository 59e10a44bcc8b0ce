"""Worker actors are placed by Ray node labels (resources.node_labels -> label_selector), and a
worker no node can take stops serving's start with an error instead of a hang. Runs in its own
module: it starts its own labelled Ray (no other test's Ray may be running)."""

from __future__ import annotations

import pytest

from splitserve.proto.splitserve.v1 import generation_pb2 as pb
from splitserve.testing.event_loop import EventLoopThread
from splitserve.testing.local_cluster import running_cluster, tiny_cluster_config
from tests.factories import stream_tokens

pytestmark = pytest.mark.slow


def test_pools_are_placed_only_on_nodes_with_their_labels(tiny_llama_dir):
    import ray

    from splitserve.deploy.local import LocalCluster

    assert not ray.is_initialized()
    ray.init(address="local", include_dashboard=False, num_cpus=2, labels={"splitserve.io/pool": "tiny"},
             logging_level="ERROR")
    try:
        missing = tiny_cluster_config(tiny_llama_dir, "colocated", decode=1, **{
            "decode.resources.node_labels": "splitserve.io/pool=big", "worker_start_timeout_s": 3})
        loop = EventLoopThread()
        try:
            with pytest.raises(RuntimeError) as error:
                loop.run(LocalCluster(missing).start())
        finally:
            loop.close()
        assert str(error.value) == (
            "workers ['decode-0'] did not start within worker_start_timeout_s (3 s): no Ray node has the resources "
            "and node_labels they ask for, or their model is still loading")
        labelled = tiny_cluster_config(tiny_llama_dir, **{f"{pool}.resources.node_labels": "splitserve.io/pool=tiny"
                                                          for pool in ("prefill", "decode")})
        with running_cluster(labelled) as (cluster, _):
            request = pb.GenerateRequest(text=b"hello", sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True))
            assert len(stream_tokens(cluster.port, request)[0]) == 3
    finally:
        ray.shutdown()
