"""The soak driver's probe (bench/soak_served.py puts this folder first on PYTHONPATH, so every Python
process of the served cluster imports it at start: the `splitserve serve` process that runs the router,
and the Ray worker processes that host the prefill and decode actors). Inert unless
SPLITSERVE_SOAK_PROBE_DIR is set. In a process that has imported splitserve, a daemon thread appends one
JSON line every SPLITSERVE_SOAK_PROBE_PERIOD_S seconds to <dir>/<pid>.jsonl: RSS, open fds, threads, live
asyncio tasks, Python's allocated memory blocks, and from the router's and the workers' root objects every
reachable splitserve instance by class and the summed length of every container attribute of them
("Orchestrator._runs": 0). Growth of any of these between idle
points that grows with the requests served is a leak. Never part of the product."""

from __future__ import annotations

import os

def _start() -> None:
    import threading

    directory = os.environ.get("SPLITSERVE_SOAK_PROBE_DIR")
    if not directory:
        return
    period_s = float(os.environ.get("SPLITSERVE_SOAK_PROBE_PERIOD_S", "3"))
    threading.Thread(target=_run, args=(directory, period_s), name="soak-probe", daemon=True).start()


ROOT_CLASSES = frozenset({"RouterServers", "PrefillWorker", "DecodeWorker"})
"""What the walk starts from: the router's composition (orchestrator, tokenizer pool, servers, metrics)
and each worker actor."""
MIN_TYPE_COUNT = 50
MAX_DEPTH = 8
MAX_ELEMENTS_WALKED = 64
"""Per container, how many elements the walk descends into (every container's length is counted)."""


def _run(directory: str, period_s: float) -> None:
    import json
    import sys
    import time

    path = os.path.join(directory, f"{os.getpid()}.jsonl")
    roots: list = []
    while True:
        time.sleep(period_s)
        if "splitserve" not in sys.modules:
            continue
        try:
            roots = roots or _find_roots()
            line = json.dumps(_snapshot(roots))
        except Exception as error:  # a probe must never take its process down
            line = json.dumps({"t": time.time(), "pid": os.getpid(), "probe_error": repr(error)})
        with open(path, "a") as out:
            out.write(line + "\n")


def _with_other_threads_held(scan):
    """scan() run while no other thread of this process runs Python. gc.get_objects() hands out references to
    every tracked object, a tuple still being built by another thread included, and a second reference makes
    that thread's tuple resize fail (SystemError: bad argument to internal function): so no other thread may
    run while the list exists, and scan() must drop it before returning. A switch interval far longer than
    the scan keeps the GIL here; the short sleep first lets every thread that was already waiting on the
    old interval run."""
    import sys
    import time

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        time.sleep(0.01)
        return scan()
    finally:
        sys.setswitchinterval(interval)


def _find_roots() -> list:
    import gc

    return _with_other_threads_held(lambda: [
        obj for obj in gc.get_objects() if type(obj).__name__ in ROOT_CLASSES
        and str(getattr(type(obj), "__module__", "")).startswith("splitserve.")])


def _type_counts() -> dict[str, int]:
    """Live gc-tracked objects by type, for the types with at least MIN_TYPE_COUNT of them."""
    import collections
    import gc

    counts = _with_other_threads_held(lambda: collections.Counter(map(type, gc.get_objects())))
    return {f"{getattr(cls, '__module__', '?')}.{cls.__qualname__}": count for cls, count in counts.items()
            if count >= MIN_TYPE_COUNT}


def _snapshot(roots: list) -> dict:
    import asyncio
    import collections
    import sys
    import threading
    import time

    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm") as statm:
        rss_mb = int(statm.read().split()[1]) * page / 2**20
    containers: collections.Counter[str] = collections.Counter()
    instances: collections.Counter[str] = collections.Counter()
    _walk(roots, containers, instances)
    return {
        "t": time.time(), "pid": os.getpid(), "argv": " ".join(sys.argv)[:200],
        "rss_mb": round(rss_mb, 1), "fds": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(), "os_threads": len(os.listdir("/proc/self/task")),
        "asyncio_tasks": len(asyncio.tasks._all_tasks), "task_coroutines": _task_coroutines(),
        "allocated_blocks": sys.getallocatedblocks(), "ray_object_refs": _ray_object_refs(),
        "roots": sorted(type(root).__name__ for root in roots),
        "instances": dict(instances), "containers": dict(containers),
        "types": _type_counts() if os.environ.get("SPLITSERVE_SOAK_PROBE_TYPES") == "1" else {},
    }


def _ray_object_refs() -> int:
    """Ray object references this process holds (owned or borrowed; 0 where Ray is not connected)."""
    import sys

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return 0
    return len(ray._private.worker.global_worker.core_worker.get_all_reference_counts())


def _task_coroutines() -> dict[str, int]:
    """The live asyncio tasks by their coroutine's name."""
    import asyncio
    import collections

    names = collections.Counter(getattr(task.get_coro(), "__qualname__", "?") for task in list(asyncio.tasks._all_tasks))
    return dict(names)


def _walk(roots: list, containers, instances) -> None:
    """Counts every splitserve instance reachable from the roots through attributes and container elements,
    and sums the length of each container attribute by "Class.attribute". Reads only: list(...) copies
    of a dict's items are made in one C call, so another thread's changes cannot break the iteration."""
    import collections

    seen: set[int] = set()
    stack = [(root, 0) for root in roots]
    while stack:
        obj, depth = stack.pop()
        if id(obj) in seen or depth > MAX_DEPTH:
            continue
        seen.add(id(obj))
        cls = type(obj)
        instances[cls.__qualname__] += 1
        if cls.__name__ == "FreeBlockList":  # the KV pool: every block must be free again once idle
            containers["kv_pool.free_blocks"] += len(obj)
            containers["kv_pool.num_blocks"] += obj.num_blocks
        for name, value in list(getattr(obj, "__dict__", {}).items()):
            if isinstance(value, (dict, set, frozenset, list, tuple, collections.deque)):
                containers[f"{cls.__qualname__}.{name}"] += len(value)
                elements = list(value.values() if isinstance(value, dict) else value)[:MAX_ELEMENTS_WALKED]
                stack.extend((element, depth + 1) for element in elements if _is_ours(element))
            elif _is_ours(value):
                stack.append((value, depth + 1))


def _is_ours(value) -> bool:
    cls = type(value)
    return str(getattr(cls, "__module__", "")).startswith("splitserve.") and hasattr(value, "__dict__") \
        and not isinstance(value, type)


_start()
