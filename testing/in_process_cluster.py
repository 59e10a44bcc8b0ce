"""The router's orchestrator and prefill/decode workers in one process (in-process KV transfer unless
asked for NIXL), the workers behind a double that can die or hang as a Ray actor can."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

from splitserve.common.config import EngineConfig
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.worker_api import WorkerLostError


def worker_engine_config(block_size: int = 8, max_model_len: int | None = None,
                         kv_cache_dtype: str = "auto") -> EngineConfig:
    """The in-process workers' engine: a 256-block fp32 pool on CPU (max_model_len: the model's unless given;
    kv_cache_dtype int8 / fp8_e4m3 quantizes the pool)."""
    return EngineConfig(block_size=block_size, num_kv_blocks=256, max_num_batched_tokens=256, dtype="float32",
                        device="cpu", max_model_len=max_model_len, kv_cache_dtype=kv_cache_dtype)


def make_prefill_worker(model_dir: Path, engine_config: EngineConfig | None = None, worker_id: str = "prefill-0",
                        lease_ttl_s: float = 30.0, layerwise: bool = False, transfer_backend: str = "inprocess",
                        tokenizer_dir: Path | None = None):
    """A PrefillWorker in this process with the in-process KV transfer backend unless `transfer_backend`
    says "nixl" (call shutdown()); `layerwise`: it announces each layer (kv_transfer_layerwise);
    `tokenizer_dir`: the --tokenizer directory, None: the model's."""
    from splitserve.prefill_worker.worker import PrefillWorker

    return PrefillWorker(model_dir, engine_config or worker_engine_config(), transfer_backend, lease_ttl_s,
                         worker_id=worker_id, layerwise=layerwise, tokenizer_dir=tokenizer_dir)


def make_decode_worker(model_dir: Path, engine_config: EngineConfig | None = None, worker_id: str = "decode-0",
                       transfer_failure_policy: str = "recompute", transfer_backend: str = "inprocess",
                       tokenizer_dir: Path | None = None):
    """A DecodeWorker in this process with the in-process KV transfer backend unless `transfer_backend`
    says "nixl", its output streams on loopback (call shutdown()); `tokenizer_dir`: the --tokenizer
    directory, None: the model's."""
    from splitserve.decode_worker.worker import DecodeWorker

    return DecodeWorker(model_dir, engine_config or worker_engine_config(), transfer_backend, worker_id=worker_id,
                        transfer_failure_policy=transfer_failure_policy, output_host="127.0.0.1",
                        tokenizer_dir=tokenizer_dir)

def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


class KillableWorker:
    """A worker (prefill or decode) behind the worker protocols that can die or hang as a
    Ray-backed one can: after kill(), every call, pending ones too, raises WorkerLostError as the
    Ray proxy does for a dead actor. After freeze(), no call answers and its engine steps no
    more (a hung process, or a cut network) until kill()."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.worker_id = worker.worker_id
        self._killed = asyncio.Event()
        self._frozen = False

    def freeze(self) -> None:
        self._frozen = True
        self.worker._loop.set_step_gate(lambda engine: False)

    @property
    def is_killed(self) -> bool:
        return self._killed.is_set()

    def kill(self) -> None:
        self._killed.set()

    async def info(self):
        return await self._answer(self.worker.info())

    async def abort(self, request_id: str) -> bool:
        return await self._answer(self.worker.abort(request_id))

    async def stats(self):
        return await self._answer(self.worker.stats())

    async def report(self, epoch, after_seq: int, max_wait_s: float):
        return await self._answer(self.worker.report(epoch, after_seq, max_wait_s))

    async def prefill(self, request):
        return await self._answer(self.worker.prefill(request))

    async def prefill_layerwise(self, request):
        """The worker's stream, each item answered as a call is (a kill ends it with WorkerLostError)."""
        items = self.worker.prefill_layerwise(request)
        try:
            while True:
                try:
                    item = await self._answer(anext(items))
                except StopAsyncIteration:
                    return
                yield item
        finally:
            if not items.ag_running:  # else its cancelled step ends it (and aborts the request there)
                await items.aclose()

    async def add_peer(self, peer) -> None:
        await self._answer(self.worker.add_peer(peer))

    async def remove_peer(self, agent_name: str) -> None:
        await self._answer(self.worker.remove_peer(agent_name))

    async def open_output_stream(self, router_id: str):
        return await self._answer(self.worker.open_output_stream(router_id))

    async def _answer(self, reply):
        call = asyncio.ensure_future(reply)
        killed = asyncio.ensure_future(self._killed.wait())
        try:
            await asyncio.wait({call, killed}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this call is cancelled: the worker call is cancelled with it
            killed.cancel()
            if not call.done() or self.is_killed:
                call.cancel()
                call.add_done_callback(_retrieve)  # a dead worker's late error is nobody's business
        if self._frozen and not self.is_killed:
            await self._killed.wait()
        if self.is_killed:
            raise WorkerLostError(self.worker_id, "killed by the test")
        return call.result()

class InProcessCluster:
    """Router orchestrator + prefill/decode workers in this process (in-process KV transfer unless
    `transfer_backend` is "nixl").

    Use inside a running event loop: `async with InProcessCluster(...) as cluster:`."""

    def __init__(self, model_dir: Path, mode: str = "disaggregated", num_prefill: int = 1, num_decode: int = 1,
                 lease_ttl_s: float = 30.0, transfer_failure_policy: str = "recompute", block_size: int = 8,
                 routing=None, slo=None, observer=None, max_model_len: int | None = None, worker_link=None,
                 kv_cache_dtype: str = "auto", decode_speculative=None, layerwise: bool = False,
                 engine_config: EngineConfig | None = None, transfer_backend: str = "inprocess",
                 chat_template: str | None = None, trust_request_chat_template: bool = False,
                 decode_engine_config: EngineConfig | None = None, tokenizer_dir: Path | None = None):
        """`observer` gets every ended request's RequestRecord (e.g. a RouterMetrics' observe);
        `max_model_len` caps every request's prompt + output (the model's limit by default);
        `kv_cache_dtype` every worker's KV pool element type;
        `engine_config` every worker's engine, in place of worker_engine_config(block_size, max_model_len,
        kv_cache_dtype) (a bench's pool size and chunk budget); `decode_engine_config` the decode workers'
        engine in its place (a smaller KV pool than the prefill workers');
        `transfer_backend` every worker's KV transfer backend (kv_transfer.BACKENDS);
        `worker_link` (a WorkerLinkConfig) the router's report and stream timings;
        `decode_speculative` (a SpeculativeConfig) makes the decode workers speculate;
        `layerwise` makes the prefill workers announce each layer (kv_transfer_layerwise);
        `chat_template` (its text) replaces the model's own in the router's tokenizer;
        `trust_request_chat_template` lets requests bring their own (router.trust_request_chat_template);
        `tokenizer_dir` is the router's and the workers' tokenizer directory (--tokenizer), None: the model's."""
        from splitserve.common.slo import SloConfig
        from splitserve.router.policy import RoutingConfig

        # Remote prefill for every request unless a test asks otherwise: most tests here are about
        # the transfer path, which the default (auto) skips for short prompts.
        self.model_dir, self.mode, self.tokenizer_dir = model_dir, mode, tokenizer_dir
        self.routing = routing or RoutingConfig(disaggregation="always")
        self.slo = slo or SloConfig()
        self.num_prefill = num_prefill if mode == "disaggregated" else 0
        self.num_decode, self.lease_ttl_s, self.policy = num_decode, lease_ttl_s, transfer_failure_policy
        self.layerwise, self.transfer_backend = layerwise, transfer_backend
        self.observer = observer
        self.worker_link = worker_link
        self.chat_template, self.trust_request_chat_template = chat_template, trust_request_chat_template
        self.engine_config = engine_config or worker_engine_config(block_size, max_model_len, kv_cache_dtype)
        self.decode_engine_config = replace(decode_engine_config or self.engine_config, speculative=decode_speculative)

    async def __aenter__(self) -> "InProcessCluster":
        from splitserve.deploy.cluster_config import RouterConfig
        from splitserve.deploy.router_app import build_orchestrator
        from splitserve.router.worker_link import WorkerLinkConfig
        from splitserve.router.tokenizer import RouterTokenizer

        self.prefill_workers = [self._prefill_worker(f"prefill-{i}") for i in range(self.num_prefill)]
        self.decode_workers = [self._decode_worker(f"decode-{i}") for i in range(self.num_decode)]
        self.tokenizer = RouterTokenizer.from_model_dir(self.model_dir, self.chat_template,
                                                        trust_request_chat_template=self.trust_request_chat_template,
                                                        tokenizer=self.tokenizer_dir)
        self.clients = {w.worker_id: KillableWorker(w)
                        for w in [*self.prefill_workers, *self.decode_workers]}
        router_config = RouterConfig(routing=self.routing, slo=self.slo,
                                     worker_link=self.worker_link or WorkerLinkConfig())
        self.orchestrator = build_orchestrator(
            "router-test", router_config, self.mode, [self.clients[w.worker_id] for w in self.prefill_workers],
            [self.clients[w.worker_id] for w in self.decode_workers], self.tokenizer, self.observer)
        await self.orchestrator.start()
        return self

    def _prefill_worker(self, worker_id: str):
        return make_prefill_worker(self.model_dir, self.engine_config, worker_id, self.lease_ttl_s, self.layerwise,
                                   self.transfer_backend, self.tokenizer_dir)

    def _decode_worker(self, worker_id: str):
        return make_decode_worker(self.model_dir, self.decode_engine_config, worker_id, self.policy,
                                  self.transfer_backend, self.tokenizer_dir)

    async def __aexit__(self, *exc_info) -> None:
        await self.orchestrator.stop()
        for worker in [*self.prefill_workers, *self.decode_workers]:
            worker.shutdown()

    async def generate(self, request_id: str, prompt_token_ids, params: SamplingParams, deadline=None,
                       cache_salt: str | None = None, priority: int = 0):
        """All chunks of one request."""
        from splitserve.router.api_types import GenerationInput

        inp = GenerationInput(request_id, tuple(prompt_token_ids), params, deadline, cache_salt=cache_salt,
                              priority=priority)
        return [chunk async for chunk in self.orchestrator.generate(inp)]

    async def add_worker(self, role: str) -> str:
        """Start one more worker of the role (the planner's scale-up) and add it to the router's
        pool; returns its id ('decode-2' after decode-0 and decode-1)."""
        workers = self.prefill_workers if role == "prefill" else self.decode_workers
        worker_id = f"{role}-{len(workers)}"
        worker = self._prefill_worker(worker_id) if role == "prefill" else self._decode_worker(worker_id)
        workers.append(worker)
        self.clients[worker_id] = KillableWorker(worker)
        await self.orchestrator.add_worker(role, self.clients[worker_id])
        return worker_id

    async def retire_worker(self, worker_id: str, timeout_s: float) -> None:
        """The planner's scale-down: the router drains the worker (its requests finish, or move
        after timeout_s), then it shuts down."""
        await self.orchestrator.retire_worker(worker_id, timeout_s)
        for workers in (self.prefill_workers, self.decode_workers):
            for worker in [w for w in workers if w.worker_id == worker_id]:
                workers.remove(worker)
                worker.shutdown()
        del self.clients[worker_id]

    def freeze(self, worker_id: str) -> None:
        """The worker stops answering (its process hangs): calls to it wait until kill()."""
        self.clients[worker_id].freeze()

    def kill(self, worker_id: str) -> None:
        """The worker dies as a process would: the router's calls to it fail from now on and its
        engine stops (what it held dies with it)."""
        self.clients[worker_id].kill()
        next(w for w in [*self.prefill_workers, *self.decode_workers] if w.worker_id == worker_id).shutdown()

    async def wait_idle(self, timeout_s: float = 10.0) -> None:
        """Wait until every live worker is idle and the router's own accounting is back to zero (an abort
        the router sent can leave a worker idle a moment before the router hears of it)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            stats = [await w.stats() for w in [*self.prefill_workers, *self.decode_workers]
                     if not self.clients[w.worker_id].is_killed]
            accounting = self._router_accounting()
            if all(s.is_idle for s in stats) and not any(accounting.values()):
                return
            assert loop.time() < deadline, f"not idle after {timeout_s} s: workers {stats}, router {accounting}"
            await asyncio.sleep(0.02)

    def _router_accounting(self) -> dict[str, int]:
        """What the router still counts as running: requests and prefill tokens per pool, requests in flight, and
        the ids reserved for client requests."""
        orchestrator = self.orchestrator
        counts = {"in_flight": orchestrator.num_in_flight, "reserved_ids": orchestrator.request_ids.num_reserved}
        for name, pool in (("prefill", orchestrator.prefill_pool), ("decode", orchestrator.decode_pool)):
            counts[f"{name}_requests"] = sum(pool.num_requests(w) for w in pool.clients)
            counts[f"{name}_prefill_tokens"] = sum(pool.num_prefill_tokens(w) for w in pool.clients)
        return counts
