"""The router, composed in one place from its config: the orchestrator over the workers' proxies,
and the servers in front of it (tokenizer pool, gRPC, OpenAI HTTP, /metrics).

The local launcher (deploy/local.py) builds it over Ray actors; the tests' in-process cluster
(splitserve.testing.in_process_cluster) over in-process workers behind the fault-injecting double. Both go through
these functions, so a router setting means the same thing in both.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from splitserve.common.generation_config import RequestDefaults, resolve_request_defaults
from splitserve.common.lora import LoRARequest
from splitserve.common.pooling import ModelPooling, read_model_pooling
from splitserve.common.stats import RequestRecord
from splitserve.common.worker_api import DecodeWorkerAPI, PrefillWorkerAPI
from splitserve.deploy.cluster_config import ClusterConfig, RouterConfig
from splitserve.router.access_log import log_access
from splitserve.router.metrics_server import RouterMetrics
from splitserve.router.lora_adapters import AdapterRegistry, runtime_updating_allowed
from splitserve.router.http_server import HttpServer
from splitserve.router.openai_server import start_http_server
from splitserve.router.orchestrator import Orchestrator
from splitserve.router.server import GrpcServer, drain, start_grpc_server
from splitserve.router.tokenizer import RouterTokenizer, read_chat_template_option
from splitserve.router.tokenizer_pool import TokenizerPool

logger = logging.getLogger(__name__)


def build_orchestrator(router_id: str, config: RouterConfig, mode: str, prefill: Sequence[PrefillWorkerAPI],
                       decode: Sequence[DecodeWorkerAPI], tokenizer: RouterTokenizer,
                       observer: Callable[[RequestRecord], None] | None = None) -> Orchestrator:
    """The orchestrator over the workers, with the router config's routing, SLO and worker-link
    settings; `observer` gets every ended request's record (RouterMetrics.observe)."""
    return Orchestrator(router_id, prefill, decode, tokenizer.backend, mode, config.routing, config.slo, observer,
                        config.worker_link, tokenizer.eos_token_ids)


def each_of(observers: Sequence[Callable[[RequestRecord], None]]) -> Callable[[RequestRecord], None] | None:
    """One request observer that calls every one of `observers` in order (None for none)."""
    if not observers:
        return None
    if len(observers) == 1:
        return observers[0]

    def observe(record: RequestRecord) -> None:
        for observer in observers:
            observer(record)
    return observe


@dataclass(frozen=True)
class BoundPorts:
    """Where a started router listens (None: that server is disabled)."""

    grpc: int
    http: int | None
    metrics: int | None


@dataclass
class RouterServers:
    """What serves an orchestrator: the tokenizer pool both APIs share, the gRPC server, the
    OpenAI HTTP API (None when http_port is null) and the /metrics port (None when disabled)."""

    orchestrator: Orchestrator
    tokenizers: TokenizerPool
    grpc: GrpcServer
    http: HttpServer | None
    metrics: RouterMetrics | None
    metrics_port: int | None

    @property
    def ports(self) -> BoundPorts:
        return BoundPorts(self.grpc.port, None if self.http is None else self.http.port, self.metrics_port)

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests and report NOT_SERVING, then wait up to timeout_s for the requests
        in flight; returns how many are left."""
        return await drain(self.orchestrator, self.grpc, timeout_s)

    async def stop(self, grace_s: float | None = 2.0) -> None:
        """Stop serving: requests in flight get grace_s to finish (None: none), then end with UNAVAILABLE
        (an HTTP stream with an error event and [DONE], a gRPC call with that status) before the servers close."""
        if grace_s is not None:
            await self.orchestrator.drain(grace_s)
        self.orchestrator.end_requests("the server is shutting down")
        if self.http is not None:
            await self.http.stop()
        if self.metrics is not None:
            await asyncio.to_thread(self.metrics.stop)
        await self.grpc.stop(grace_s)
        self.tokenizers.close()


async def start_servers(orchestrator: Orchestrator, tokenizer: RouterTokenizer, config: RouterConfig,
                        model_name: str, metrics: RouterMetrics | None, api_key: str | None,
                        aliases: tuple[str, ...] = (), reuse_port: bool = False,
                        adapters: tuple[LoRARequest, ...] = (), pooling: ModelPooling | None = None) -> RouterServers:
    """Start the servers `config` asks for in front of a started orchestrator. `metrics` (already
    the orchestrator's observer) is watched, served on config.metrics_port when set, and on the
    HTTP API's /metrics; `api_key` (resolved from config.api_key_env by the caller) guards both
    APIs; requests may name the model `model_name` or any of `aliases`. `reuse_port`: the gRPC
    and HTTP ports are shared with other routers (SO_REUSEPORT). `adapters`: the LoRA adapters the HTTP API's
    `model` field may name (ClusterConfig.lora_requests; SPLITSERVE_ALLOW_RUNTIME_LORA_UPDATING=true also serves
    /v1/load_lora_adapter and /v1/unload_lora_adapter, router/lora_adapters.py). `pooling`: how the workers embed
    (a cluster of runner pooling, whose HTTP API serves /v1/embeddings); None: they generate. On failure, whatever
    started is stopped; a generation config whose defaults cannot serve (GenerationConfigError) starts nothing."""
    defaults = request_defaults(config, tokenizer)
    tokenizers = TokenizerPool.for_orchestrator(tokenizer, orchestrator, config.max_prompt_bytes,
                                                config.tokenizer_threads, config.max_pending_tokenizations,
                                                config.max_logprobs)
    grpc = http = None
    metrics_port = None
    try:
        if metrics is not None:
            metrics.watch(orchestrator)
            if config.metrics_port is not None:
                metrics_port = metrics.serve(config.host, config.metrics_port)
        registry = AdapterRegistry(adapters, frozenset((model_name, *aliases)))  # both APIs' (runtime loads too)
        grpc = await start_grpc_server(orchestrator, tokenizers, model_name, config.host, config.grpc_port,
                                       config.request_timeout_s, api_key, config.tls, aliases, reuse_port, defaults,
                                       registry, config.access_log)
        if config.http_port is not None:
            http = await start_http_server(orchestrator, tokenizers, model_name, config.host, config.http_port,
                                           config.request_timeout_s,
                                           metrics.asgi_app() if metrics is not None else None, api_key, config.tls,
                                           aliases, reuse_port, config.http_options,
                                           config.auto_tool_call_parser, config.reasoning_parser, defaults,
                                           registry, runtime_updating_allowed(), pooling)
    except BaseException:
        if grpc is not None:
            await grpc.stop(0)
        if metrics is not None:
            await asyncio.to_thread(metrics.stop)
        tokenizers.close()
        raise
    return RouterServers(orchestrator, tokenizers, grpc, http, metrics, metrics_port)


def request_defaults(config: RouterConfig, tokenizer: RouterTokenizer) -> RequestDefaults:
    """The sampling defaults config.generation_config gives requests (the model directory's file
    as the tokenizer read it); says so in one log line when there are any, as vLLM does."""
    defaults = resolve_request_defaults(config.generation_config, tokenizer.generation_config)
    if defaults.origin:
        fields = {**defaults.sampling.sampling_fields(), "max_new_tokens": defaults.sampling.max_new_tokens}
        shown = ", ".join(f"{name}={value}" for name, value in fields.items() if value is not None)
        logger.warning("default sampling parameters from %s: %s (a request's own values win; serve with "
                       "--generation-config vllm to ignore the model's file)", defaults.origin, shown)
    return defaults


def log_content_format(tokenizer: RouterTokenizer, option: str) -> None:
    """Say once which content format the server's chat template gets (vLLM's line): the one "auto"
    detected, or a warning when the one given differs from it. Nothing without a template."""
    detected = tokenizer.detected_content_format
    if detected is None:
        return
    if option == "auto":
        logger.info("Detected the chat template content format to be '%s'. You can set "
                    "`--chat-template-content-format` to override this.", detected)
    elif option != detected:
        logger.warning("You specified `--chat-template-content-format %s` which is different from the detected "
                       "format '%s'; the one given is used.", option, detected)


async def start_router(router_id: str, config: ClusterConfig, model_dir: str, prefill: Sequence[PrefillWorkerAPI],
                       decode: Sequence[DecodeWorkerAPI], api_key: str | None,
                       observers: Sequence[Callable[[RequestRecord], None]] = (),
                       reuse_port: bool = False) -> RouterServers:
    """One whole router over started workers, as config.router says: its tokenizer, metrics (when
    config.router.metrics_port is set), access log, orchestrator and servers. `observers` also get
    every ended request's record (the planner's); `reuse_port`: share the gRPC and HTTP ports with
    other routers (SO_REUSEPORT). On failure, whatever started is stopped."""
    router = config.router
    chat_template = None if router.chat_template is None else read_chat_template_option(router.chat_template)
    tokenizer = await asyncio.to_thread(RouterTokenizer.from_model_dir, model_dir, chat_template,
                                        router.chat_template_content_format, router.trust_request_chat_template,
                                        config.tokenizer_path)
    log_content_format(tokenizer, router.chat_template_content_format)
    model_name, *aliases = config.served_model_names
    metrics = RouterMetrics(router.slo, model_name) if router.metrics_port is not None else None
    observers = [*([metrics.observe] if metrics is not None else []), *observers,
                 *([log_access] if router.access_log else [])]
    orchestrator = build_orchestrator(router_id, router, config.mode, prefill, decode, tokenizer, each_of(observers))
    await orchestrator.start()
    try:
        return await start_servers(orchestrator, tokenizer, router, model_name, metrics, api_key, tuple(aliases),
                                   reuse_port, config.lora_requests, _model_pooling(config, model_dir))
    except BaseException:
        await orchestrator.stop()
        raise


def _model_pooling(config: ClusterConfig, model_dir: str) -> ModelPooling | None:
    """How the workers embed (as their engines resolve it from the same directory), None when they generate."""
    if config.runner != "pooling":
        return None
    return read_model_pooling(model_dir, config.decode.engine.pooler_config)
