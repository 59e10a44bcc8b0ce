"""Cluster configuration: frozen, validated dataclasses loaded from YAML, with dotted overrides.

A file (or an override set) is applied on top of `default_cluster_config(model)`: every key is
optional except `model`, and each pool keeps its own tuned defaults for whatever the file leaves
out. Every error is a `ClusterConfigError` whose message starts with the dotted path of the
offending key, e.g. `decode.engine.max_num_seqs: must be >= 1, got 0`. See docs/configuration.md.
"""

from __future__ import annotations

import dataclasses
import os
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import get_args, get_origin, get_type_hints

import yaml

from splitserve.common.chat_template import CONTENT_FORMAT_OPTIONS
from splitserve.common.config import SCALAR_KINDS, EngineConfig, GenerationConfig, is_scalar_kind
from splitserve.common.kv_transfer_types import TRANSFER_FAILURE_POLICIES
from splitserve.common.log_format import LOG_FORMATS
from splitserve.common.lora import LoRARequest, parse_lora_modules
from splitserve.common.slo import SloConfig
from splitserve.planner.core.types import PlannerConfig
from splitserve.router.http_options import UVICORN_LOG_LEVELS, CorsPolicy, HttpOptions
from splitserve.router.policy import RoutingConfig
from splitserve.router.reasoning_parsers import REASONING_PARSERS
from splitserve.router.tls import TlsConfig
from splitserve.router.tool_parsers import TOOL_CALL_PARSERS
from splitserve.router.worker_link import WorkerLinkConfig

MODES = ("disaggregated", "colocated")
KV_TRANSFER_BACKENDS = ("nixl", "inprocess")
KV_SIZING_FIELDS = ("num_kv_blocks", "kv_cache_memory_bytes", "kv_cache_memory_fraction", "gpu_memory_utilization")
"""EngineConfig's KV pool sizing fields: the first three are mutually exclusive, and win over the last."""
SHARED_ENGINE_FIELDS = ("block_size", "dtype", "hash_seed")
"""Engine fields the two pools must agree on for prefill KV blocks to be readable by decode."""
AGREED_ENGINE_FIELDS = ("scheduling_policy", "runner", "pooler_config")
"""Engine fields the two pools must agree on for the router to serve a request the same way on both
(it refuses a priority other than 0 unless every worker's scheduling policy is priority; an embedding is pooled on a
prefill worker, with the pooling the router read from the decode pool's config)."""


class ClusterConfigError(ValueError):
    """An invalid cluster config; `path` is the dotted key ('' for the whole document)."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path or '(top level)'}: {reason}")
        self.path = path
        self.reason = reason

    def under(self, prefix: str) -> ClusterConfigError:
        """The same error, located inside the section `prefix`."""
        return ClusterConfigError(_join(prefix, self.path), self.reason)


def _join(*parts: str) -> str:
    return ".".join(part for part in parts if part)


def _require(ok: bool, path: str, reason: str) -> None:
    if not ok:
        raise ClusterConfigError(path, reason)


@dataclass(frozen=True)
class RayResources:
    """Ray resources reserved by each actor of a pool."""

    num_cpus: float = 1.0
    """CPUs per actor; Ray also sets the actor's OMP_NUM_THREADS to floor(num_cpus) (at least 1)."""
    num_gpus: float = 0.0
    """GPUs per actor (fractions share a GPU); must be > 0 for an engine on cuda."""
    node_labels: str | None = None
    """Ray node labels an actor must be placed on, comma-separated key=value (a Ray
    label_selector): on KubeRay, `ray.io/node-group=<worker group>` pins a pool to its group.
    A private local Ray (no ray_address) is one node, started with these labels. None: any node."""

    def __post_init__(self) -> None:
        _require(self.num_cpus >= 0, "num_cpus", f"must be >= 0, got {self.num_cpus}")
        _require(self.num_gpus >= 0, "num_gpus", f"must be >= 0, got {self.num_gpus}")
        pairs = [] if self.node_labels is None else [item.partition("=") for item in self.node_labels.split(",")]
        _require(all(key.strip() and sep and value.strip() for key, sep, value in pairs), "node_labels",
                 f"must be comma-separated key=value pairs, got {self.node_labels!r}")

    @property
    def label_selector(self) -> dict[str, str]:
        """node_labels as Ray's label_selector ({} when unset)."""
        if self.node_labels is None:
            return {}
        return {key.strip(): value.strip() for key, _, value in (item.partition("=") for item in self.node_labels.split(","))}


@dataclass(frozen=True)
class PoolConfig:
    """One pool of identical worker actors (the prefill pool or the decode pool)."""

    replicas: int
    """Number of worker actors; 0 only for the unused prefill pool in colocated mode."""
    engine: EngineConfig
    """Engine settings of every worker in the pool (token budget, batch size, KV pool, threads)."""
    resources: RayResources
    """Ray resources reserved per worker actor."""
    max_restarts: int = 3
    """How many times Ray restarts a worker actor whose process died (-1: always, 0: never). A
    restarted worker reloads its model and rejoins with a new engine epoch and transfer agent;
    the requests it had moved to other workers meanwhile."""
    transfer_poll_s: float | None = None
    """How often a worker polls NIXL while transfers are in flight (NIXL reports a pull's end and
    its notification only when asked): a decode worker its pulls' completion, a prefill worker the
    notifications that free its leases. None: the role's default (decode 0.0005, prefill 0.002)."""

    def __post_init__(self) -> None:
        _require(self.replicas >= 0, "replicas", f"must be >= 0, got {self.replicas}")
        _require(self.transfer_poll_s is None or self.transfer_poll_s > 0, "transfer_poll_s",
                 f"must be > 0 or null, got {self.transfer_poll_s}")
        _require(self.max_restarts >= -1, "max_restarts", f"must be >= -1, got {self.max_restarts}")
        _require(self.engine.device != "cuda" or self.resources.num_gpus > 0, "resources.num_gpus",
                 f"must be > 0 when engine.device is 'cuda', got {self.resources.num_gpus}")


@dataclass(frozen=True)
class RouterConfig:
    """The public front: where it listens, how it routes and how long it keeps a request's resources."""

    host: str = "127.0.0.1"
    """Interface the gRPC, HTTP and metrics servers bind to; loopback by default, 0.0.0.0 to serve other hosts."""
    grpc_port: int = 50051
    """gRPC port; 0 picks a free port (tests)."""
    metrics_port: int | None = 9400
    """Port of the Prometheus /metrics endpoint (on `host`); 0 picks a free port; None disables it."""
    http_port: int | None = 8000
    """Port of the OpenAI-compatible HTTP API (on `host`, docs/http_api.md); 0 picks a free port;
    None disables it."""
    request_timeout_s: float | None = None
    """Server-side limit on a request's total time; None = only the client's deadline applies."""
    lease_ttl_s: float = 30.0
    """How long a prefill worker holds a request's KV blocks for decode to pull before freeing them,
    from the hold on the prefill worker's monotonic clock; a decode worker abandons a pull still in
    flight this long after starting it, on its own clock (the machines' clocks need not agree)."""
    drain_timeout_s: float = 30.0
    """On SIGTERM/SIGINT: how long the router, already refusing new requests and reporting
    NOT_SERVING, waits for requests in flight to finish before it cancels the rest and stops."""
    routing: RoutingConfig = RoutingConfig()
    """How requests are placed (prefix-aware by default), when the decode worker prefills a prompt
    itself, and when admission control rejects a request (see docs/routing.md)."""
    slo: SloConfig = SloConfig()
    """The served model's latency targets: admission control (TTFT) and SLO/goodput accounting."""
    api_key_env: str | None = None
    """Name of the environment variable holding the API key (never the key itself); when set, the
    gRPC Generation service and the HTTP /v1/* endpoints need `authorization: Bearer <key>`, and
    serving refuses to start if the variable is unset or empty. None: no auth."""
    cors_allowed_origins: tuple[str, ...] = ()
    """Origins whose web pages may call the HTTP API from a browser (CORS; vLLM's --allowed-origins),
    e.g. ["https://chat.example"]; "*" is any. None by default, as vLLM 0.32: a cross-origin call gets
    no CORS headers and its preflight a 400. A preflight is answered before the API-key check (browsers
    send no credentials on it) and admission."""
    cors_allowed_methods: tuple[str, ...] = ("*",)
    """HTTP methods a preflight allows (vLLM's --allowed-methods); "*" is any."""
    cors_allowed_headers: tuple[str, ...] = ("*",)
    """Request headers a preflight allows (vLLM's --allowed-headers); "*" is any the browser asks for."""
    cors_allow_credentials: bool = False
    """Let browsers send cookies / HTTP auth on cross-origin calls (vLLM's --allow-credentials); an API
    key travels in the Authorization header, which needs no credentials mode."""
    enable_request_id_headers: bool = False
    """Every HTTP answer carries `X-Request-Id`: the request's own header when it sent one, else a fresh
    uuid4 in hex (vLLM's --enable-request-id-headers)."""
    root_path: str | None = None
    """The path prefix a proxy in front serves the HTTP API under and strips before forwarding, e.g.
    /llm (vLLM's --root-path): the ASGI app's root_path; routes, the API-key check and admission match
    the path without it. None: no prefix."""
    http_acceptor_process: bool = True
    """The HTTP API's connections are accepted by a separate process, which answers a full router's
    generation requests (429) itself and hands every other connection to the router's event loop: a
    burst of rejections then costs the loop nothing. Not with TLS, nor with routing.max_in_flight_requests
    null (the loop accepts then)."""
    uvicorn_log_level: str = "info"
    """Level of the HTTP server's (uvicorn's) loggers, uvicorn.error and uvicorn.asgi (vLLM's
    --uvicorn-log-level): critical, error, warning, info, debug or trace."""
    response_role: str = "assistant"
    """The role of a chat completion's message when the request's add_generation_prompt is true
    (vLLM's --response-role); otherwise it is the role of the request's last message, as in vLLM."""
    return_tokens_as_token_ids: bool = False
    """The default of requests' return_tokens_as_token_ids (vLLM's --return-tokens-as-token-ids): logprob
    tokens read "token_id:<id>", so tokens that are no valid UTF-8 on their own can be told apart; a
    request's own true or false wins."""
    enable_prompt_tokens_details: bool = False
    """Completion and chat usage carries prompt_tokens_details.cached_tokens, the prompt tokens whose KV
    came from the prefix cache (vLLM's --enable-prompt-tokens-details); off, as in vLLM, it has none.
    The Responses API's input_tokens_details.cached_tokens is always there, as in vLLM."""
    max_logprobs: int = 20
    """The most top alternatives per token a request may ask for (logprobs, top_logprobs, prompt_logprobs;
    a beam search's 2 x n, so its widest is max_logprobs // 2), vLLM's --max-logprobs with its default;
    -1: the vocabulary's size. More is a 400 / INVALID_ARGUMENT naming the limit."""
    tls: TlsConfig | None = None
    """TLS for the gRPC and OpenAI HTTP APIs (`cert_file`, `key_file`, and `client_ca_file` to
    require client certificates); None: plaintext. The /metrics endpoint stays plaintext."""
    max_prompt_bytes: int | None = None
    """Largest prompt (UTF-8 bytes of a text prompt, or of a chat's messages) any API takes;
    a longer one is refused before it is tokenized. None: (max_model_len - 1) x the longest token
    of the vocabulary in bytes, which refuses only prompts that are over max_model_len tokens
    anyway (docs/serving.md, request limits)."""
    tokenizer_threads: int = 2
    """Threads that tokenize prompts longer than 1024 characters (shorter ones are tokenized on
    the event loop); the tokenizer releases the GIL, so they run beside the router's event loop."""
    max_pending_tokenizations: int = 64
    """Prompts waiting for or in those threads; beyond it a request that needs one is refused at
    once with RESOURCE_EXHAUSTED (HTTP 429)."""
    worker_link: WorkerLinkConfig = WorkerLinkConfig()
    """Timings of the router's report polls and the decode workers' output streams: when a silent
    worker counts as lost, how soon a lost stream is reopened (docs/configuration.md)."""
    access_log: bool = True
    """Log one line per request when it ends (logger `splitserve.access`): status, tokens, TTFT, latency."""
    chat_template: str | None = None
    """A chat template replacing the model's own (vLLM's --chat-template): the path of a file
    holding it, or the template text itself. None: the model directory's template."""
    chat_template_content_format: str = "auto"
    """How a message's content reaches the chat template (vLLM's --chat-template-content-format):
    `string` (text parts joined with newlines), `openai` (a list of {"type": "text", "text": ...}
    parts, a string content included), or `auto`: openai when the template loops over a message's
    content (Gemma 3, Llama 4, Mistral 3), else string."""
    trust_request_chat_template: bool = False
    """Render the chat template a chat or /tokenize request brings in its `chat_template` field, in
    place of the server's (vLLM's --trust-request-chat-template). Off: such a request is a 400. A
    template is code the router runs (sandboxed, but its loops are not bounded): trust the clients."""
    enable_auto_tool_choice: bool = False
    """Serve tool_choice "auto" (the default when a chat request sends tools): the output is split
    into content and tool calls by `tool_call_parser`, which it needs (vLLM's --enable-auto-tool-choice).
    Off: such a request is a 400; "none", "required" and a named function need no parser."""
    tool_call_parser: str | None = None
    """How the model writes tool calls (vLLM's --tool-call-parser): `hermes` (<tool_call>{...}</tool_call>:
    Hermes 2 Pro, Qwen 2.5 / 3), `llama3_json` (Llama 3.1+ JSON calls) or `openai` (GPT-OSS's harmony
    messages to `functions.NAME`)."""
    generation_config: GenerationConfig = GenerationConfig()
    """Default sampling values of requests that leave them unset (vLLM's --generation-config and
    --override-generation-config): `source` auto (the model's generation_config.json), vllm (none)
    or a folder; `overrides` (temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty,
    frequency_penalty, max_new_tokens) win over the file. The OpenAI API and gRPC Generate apply
    them; the Triton API does not (docs/http_api.md#default-sampling-parameters)."""
    reasoning_parser: str | None = None
    """Split a chat's output into its reasoning (a `<think>...</think>` block) and its content (vLLM's
    --reasoning-parser): `deepseek_r1` or `qwen3`, whose tokenizer must have both tags as tokens, or
    `openai_gptoss` (GPT-OSS's harmony analysis channel; its tokenizer must have the harmony tokens).
    None: the output is all content."""
    replicas: int = 1
    """Router processes sharing the workers, each with its own prefix index, admission slots and
    event loop. 1: the router runs in the `splitserve serve` process. More: each is a Ray actor
    (placed by `resources`) listening on the same gRPC and HTTP ports with SO_REUSEPORT, so the
    kernel spreads connections over them; router i serves /metrics on metrics_port + i on a private
    local Ray (on a Ray cluster each router has its own node, see `resources`, and metrics_port). A
    router that dies loses only its own streams (docs/reliability.md)."""
    resources: RayResources = RayResources()
    """Ray resources of each router actor (only when replicas > 1); on KubeRay, node_labels
    `ray.io/node-group=router` puts one router on each pod of the router group."""

    @property
    def http_options(self) -> HttpOptions:
        """The HTTP layer's settings these fields make (router/http_options.py)."""
        return HttpOptions(CorsPolicy(self.cors_allowed_origins, self.cors_allowed_methods, self.cors_allowed_headers,
                                      self.cors_allow_credentials),
                           request_id_headers=self.enable_request_id_headers, root_path=self.root_path or "",
                           uvicorn_log_level=self.uvicorn_log_level, access_log=self.access_log,
                           acceptor_process=self.http_acceptor_process,
                           response_role=self.response_role,
                           return_tokens_as_token_ids=self.return_tokens_as_token_ids,
                           enable_prompt_tokens_details=self.enable_prompt_tokens_details)

    @property
    def auto_tool_call_parser(self) -> str | None:
        """The parser of tool_choice "auto" outputs; None when auto tool choice is off."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None

    def __post_init__(self) -> None:
        _require(self.host != "", "host", "must not be empty")
        _require(self.replicas >= 1, "replicas", f"must be >= 1, got {self.replicas}")
        _require(self.api_key_env is None or (self.api_key_env != "" and not any(
            c.isspace() or c in "=\0" for c in self.api_key_env)), "api_key_env",
            f"must name an environment variable (non-empty, no whitespace or '='), or be null; "
            f"got {self.api_key_env!r}")
        _require(0 <= self.grpc_port <= 65535, "grpc_port", f"must be in [0, 65535], got {self.grpc_port}")
        for name in ("cors_allowed_origins", "cors_allowed_methods", "cors_allowed_headers"):
            values = getattr(self, name)
            _require(all(value.strip() for value in values), name, f"must hold non-empty strings, got {list(values)}")
        _require(self.root_path is None or (self.root_path.startswith("/") and self.root_path != "/"
                                            and not self.root_path.endswith("/")), "root_path",
                 f"must start with '/' and not end with one (e.g. /llm), or be null; got {self.root_path!r}")
        _require(self.max_logprobs >= -1, "max_logprobs", f"must be >= -1 (-1: no limit), got {self.max_logprobs}")
        _require(self.response_role.strip() != "", "response_role", f"must not be empty, got {self.response_role!r}")
        _require(self.uvicorn_log_level in UVICORN_LOG_LEVELS, "uvicorn_log_level",
                 f"must be one of {', '.join(UVICORN_LOG_LEVELS)}, got {self.uvicorn_log_level!r}")
        _require(self.metrics_port is None or 0 <= self.metrics_port <= 65535, "metrics_port",
                 f"must be in [0, 65535] or null, got {self.metrics_port}")
        _require(not self.metrics_port or self.metrics_port != self.grpc_port, "metrics_port",
                 f"must differ from grpc_port ({self.grpc_port})")
        _require(self.http_port is None or 0 <= self.http_port <= 65535, "http_port",
                 f"must be in [0, 65535] or null, got {self.http_port}")
        _require(not self.http_port or self.http_port not in (self.grpc_port, self.metrics_port), "http_port",
                 f"must differ from grpc_port ({self.grpc_port}) and metrics_port ({self.metrics_port})")
        _require(self.request_timeout_s is None or self.request_timeout_s > 0, "request_timeout_s",
                 f"must be > 0, got {self.request_timeout_s}")
        _require(self.lease_ttl_s > 0, "lease_ttl_s", f"must be > 0, got {self.lease_ttl_s}")
        _require(self.drain_timeout_s >= 0, "drain_timeout_s", f"must be >= 0, got {self.drain_timeout_s}")
        _require(self.max_prompt_bytes is None or self.max_prompt_bytes >= 1, "max_prompt_bytes",
                 f"must be >= 1 or null, got {self.max_prompt_bytes}")
        _require(self.tool_call_parser is None or self.tool_call_parser in TOOL_CALL_PARSERS, "tool_call_parser",
                 f"must be one of {', '.join(TOOL_CALL_PARSERS)} or null, got {self.tool_call_parser!r}")
        _require(self.chat_template_content_format in CONTENT_FORMAT_OPTIONS, "chat_template_content_format",
                 f"must be one of {', '.join(CONTENT_FORMAT_OPTIONS)}, got {self.chat_template_content_format!r}")
        _require(self.reasoning_parser is None or self.reasoning_parser in REASONING_PARSERS, "reasoning_parser",
                 f"must be one of {', '.join(REASONING_PARSERS)} or null, got {self.reasoning_parser!r}")
        _require(not self.enable_auto_tool_choice or self.tool_call_parser is not None, "enable_auto_tool_choice",
                 "needs tool_call_parser (how the model writes its calls)")
        _require(self.tokenizer_threads >= 1, "tokenizer_threads", f"must be >= 1, got {self.tokenizer_threads}")
        _require(self.max_pending_tokenizations >= 1, "max_pending_tokenizations",
                 f"must be >= 1, got {self.max_pending_tokenizations}")


@dataclass(frozen=True)
class ClusterConfig:
    """Everything `splitserve serve` starts: the two worker pools, the router and the Ray cluster."""

    model: str
    """Model directory, or 'default' for the embedded model."""
    mode: str
    """disaggregated (prefill pool -> KV transfer -> decode pool) or colocated (decode pool does both)."""
    prefill: PoolConfig
    """Compute-bound prompt processing; unused (0 replicas) in colocated mode."""
    decode: PoolConfig
    """Bandwidth-bound token generation; in colocated mode these workers also prefill."""
    router: RouterConfig
    """The public front: the gRPC and OpenAI-compatible HTTP APIs."""
    kv_transfer_backend: str = "nixl"
    """How decode pulls prefill's KV blocks: nixl (UCX/RDMA); inprocess (the tests' one-process clusters) is
    refused in disaggregated mode, where every worker is a Ray actor of its own."""
    kv_transfer_failure_policy: str = "recompute"
    """What a decode worker does when a pull fails (lease expired, prefill worker gone):
    recompute the prompt itself (the stream goes on, same greedy output) or fail the request."""
    kv_transfer_layerwise: bool = False
    """Layer-wise transfer: prefill workers announce each layer of a prompt's KV as the forward writes
    it, and the decode worker (handed the request when its prefill starts) READs that layer while
    the forward computes the next ones. Off: the decode worker pulls the whole prompt after its
    first token. Disaggregated mode only."""
    ray_address: str | None = None
    """Ray cluster to join; None starts a local Ray bound to 127.0.0.1."""
    worker_start_timeout_s: float = 600.0
    """How long every worker actor may take to be placed and load its model before serving gives
    up with an error naming the workers still missing (e.g. no node has their resources or labels)."""
    log_format: str = "text"
    """How the serving process writes its log lines: text, or json (one JSON object per line,
    every field escaped; the access log's fields become keys). Ray workers' own lines stay Ray's."""
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    """Goodput-driven autoscaling of the two pools (disaggregated mode); off by default."""
    served_model_name: tuple[str, ...] = ()
    """Names clients may give as `model` (vLLM's --served-model-name): the first is the one
    /v1/models reports and responses carry; a request naming another model is refused. Empty:
    `model` itself is the one name."""
    tokenizer: str | None = None
    """The tokenizer directory when it is not the model's (vLLM's --tokenizer: a model directory without
    tokenizer files, a fine-tune reusing its base's tokenizer): the router's tokenizer.json,
    tokenizer_config.json and chat template, and the workers' structured-output vocabulary, come from it;
    EOS ids and sampling defaults (generation_config.json) stay the model directory's, as vLLM reads them.
    A cluster setting beside `model`, not an engine (per-pool) one: the router and every worker of both
    pools must tokenize alike, so there is one value for all of them. None: the model directory."""
    lora_modules: tuple[str, ...] = ()
    """LoRA adapters the OpenAI API's `model` field may name, each NAME=PATH (vLLM's --lora-modules; PATH a PEFT
    adapter directory the workers can read): /v1/models lists them with the model as `parent`. Needs
    engine.enable_lora in every pool that runs requests (docs/lora.md)."""

    def __post_init__(self) -> None:
        _require(self.model != "", "model", "must not be empty")
        _require(self.tokenizer != "", "tokenizer", "must not be empty (null reads the model directory's)")
        _require(self.mode in MODES, "mode", f"must be one of {MODES}, got {self.mode!r}")
        _require(self.kv_transfer_backend in KV_TRANSFER_BACKENDS, "kv_transfer_backend",
                 f"must be one of {KV_TRANSFER_BACKENDS}, got {self.kv_transfer_backend!r}")
        # The in-process backend's peers are agents in the same process: a Ray actor's peer never is (its handshake
        # failed on every request, which then recomputed its prompt on the decode worker).
        _require(self.kv_transfer_backend != "inprocess" or self.mode == "colocated", "kv_transfer_backend",
                 "inprocess moves KV only between workers in one process (the tests' clusters), and each worker here "
                 "is a Ray actor in a process of its own: use nixl")
        _require(self.kv_transfer_failure_policy in TRANSFER_FAILURE_POLICIES, "kv_transfer_failure_policy",
                 f"must be one of {TRANSFER_FAILURE_POLICIES}, got {self.kv_transfer_failure_policy!r}")
        _require(isinstance(self.kv_transfer_layerwise, bool), "kv_transfer_layerwise",
                 f"must be true or false, got {self.kv_transfer_layerwise!r}")
        _require(not self.kv_transfer_layerwise or self.mode == "disaggregated", "kv_transfer_layerwise",
                 "needs mode: disaggregated (a colocated cluster moves no KV)")
        _require(self.ray_address != "", "ray_address", "must not be empty (null starts a local Ray)")
        _require(self.log_format in LOG_FORMATS, "log_format", f"must be one of {LOG_FORMATS}, got {self.log_format!r}")
        _require(self.worker_start_timeout_s > 0, "worker_start_timeout_s",
                 f"must be > 0, got {self.worker_start_timeout_s}")
        _require(self.decode.replicas >= 1, "decode.replicas", f"must be >= 1, got {self.decode.replicas}")
        _require(all(name.strip() for name in self.served_model_name), "served_model_name",
                 f"must hold non-empty names, got {list(self.served_model_name)}")
        self._check_lora_modules()
        if self.ray_address is None:
            self._check_local_labels()
        if self.mode == "colocated":
            _require(self.prefill.replicas == 0, "prefill.replicas",
                     f"must be 0 in colocated mode (decode workers do both phases), got {self.prefill.replicas}")
        else:
            self._check_disaggregated_pools()
        if self.planner.enabled:
            self._check_planner_bounds()
        _require(self.router.replicas == 1 or not self.planner.enabled, "router.replicas",
                 f"must be 1 with planner.enabled (the planner runs in the one router), got {self.router.replicas}")

    def _check_local_labels(self) -> None:
        """A private local Ray is one node: it can carry the labels of both pools only if they agree."""
        prefill, decode = self.prefill.resources.label_selector, self.decode.resources.label_selector
        clash = sorted(key for key in prefill.keys() & decode.keys() if prefill[key] != decode[key])
        _require(not clash, "decode.resources.node_labels",
                 f"cannot differ from prefill's on {clash} when ray_address is null (a local Ray is one node)")
        pools, router = {**prefill, **decode}, self.router.resources.label_selector
        clash = sorted(key for key in pools.keys() & router.keys() if pools[key] != router[key])
        _require(not clash, "router.resources.node_labels",
                 f"cannot differ from the pools' on {clash} when ray_address is null (a local Ray is one node)")

    def _check_lora_modules(self) -> None:
        try:
            adapters = parse_lora_modules(self.lora_modules, self.served_model_names)
        except ValueError as error:
            raise ClusterConfigError("lora_modules", str(error)) from None
        clash = sorted({adapter.lora_name for adapter in adapters} & set(self.served_model_names))
        _require(not clash, "lora_modules", f"adapter names {clash} are the model's own names (served_model_name)")
        pools = ("decode",) if self.mode == "colocated" else ("prefill", "decode")
        for pool in pools:
            _require(not adapters or getattr(self, pool).engine.enable_lora, f"{pool}.engine.enable_lora",
                     "must be true to serve lora_modules (--enable-lora)")

    @property
    def runner(self) -> str:
        """What the workers run the model as (EngineConfig.runner): generate, or pooling (embeddings)."""
        return self.decode.engine.runner

    @property
    def lora_requests(self) -> tuple[LoRARequest, ...]:
        """lora_modules as the LoRARequests the router sends the workers (ids 1, 2, ... in order)."""
        return parse_lora_modules(self.lora_modules, self.served_model_names)

    @property
    def tokenizer_path(self) -> str | None:
        """`tokenizer` made absolute, as lora_modules' paths are (the workers and router actors may run in
        another directory); None: the model directory's tokenizer."""
        return None if self.tokenizer is None else os.path.abspath(os.path.expanduser(self.tokenizer))

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """The names clients may use for the model, the reported one first."""
        return self.served_model_name or (self.model,)

    @property
    def local_node_labels(self) -> dict[str, str]:
        """The labels a private local Ray's one node carries: every pool's and the routers'."""
        return {**self.prefill.resources.label_selector, **self.decode.resources.label_selector,
                **self.router.resources.label_selector}

    def _check_planner_bounds(self) -> None:
        """The planner sizes both pools of a disaggregated cluster, starting from the configured sizes."""
        _require(self.mode == "disaggregated", "planner.enabled", "needs mode: disaggregated")
        for role in ("prefill", "decode"):
            replicas, bounds = getattr(self, role).replicas, getattr(self.planner, role)
            _require(bounds.min_replicas >= 1, f"planner.{role}.min_replicas", f"must be >= 1, got {bounds.min_replicas}")
            _require(bounds.min_replicas <= replicas <= bounds.max_replicas, f"{role}.replicas",
                     f"must be within planner.{role}'s [{bounds.min_replicas}, {bounds.max_replicas}], got {replicas}")

    def _check_disaggregated_pools(self) -> None:
        _require(self.prefill.replicas >= 1, "prefill.replicas",
                 f"must be >= 1 in disaggregated mode, got {self.prefill.replicas}")
        for name in (*SHARED_ENGINE_FIELDS, *AGREED_ENGINE_FIELDS):
            expected, got = getattr(self.prefill.engine, name), getattr(self.decode.engine, name)
            _require(got == expected, f"decode.engine.{name}",
                     f"must equal prefill.engine.{name} ({expected!r}) in disaggregated mode, got {got!r}")


DEFAULT_PREFILL_ENGINE = EngineConfig(max_num_seqs=16, max_num_batched_tokens=8192,
                                      kv_cache_memory_bytes=256 << 20)
"""Prefill is compute-bound: one step's cost grows with its tokens, not its sequences, so a large
token budget (8192) fills the device with a few long prompts (16 sequences); its KV blocks only
live until decode pulls them (or the lease expires), plus whatever prefix cache fits, so the pool
is modest (256 MiB)."""

DEFAULT_DECODE_ENGINE = EngineConfig(max_num_seqs=256, max_num_batched_tokens=512,
                                     kv_cache_memory_bytes=2 << 30)
"""Decode is memory-bandwidth-bound: each step reads every weight once however many sequences it
serves, so throughput comes from a wide batch (256 sequences) at one token each; the budget (512)
covers that plus headroom for short local prefills; every running sequence keeps its whole KV
for its lifetime, so the pool is large (2 GiB)."""


def default_cluster_config(model: str, colocated: bool = False) -> ClusterConfig:
    """1 prefill + 1 decode worker with the per-pool defaults, router on 127.0.0.1:50051 (HTTP on 8000, metrics on
    9400); `colocated`: mode colocated, whose prefill pool is unused (0 replicas)."""
    return ClusterConfig(
        model=model, mode="colocated" if colocated else "disaggregated",
        prefill=PoolConfig(replicas=0 if colocated else 1, engine=DEFAULT_PREFILL_ENGINE, resources=RayResources()),
        decode=PoolConfig(replicas=1, engine=DEFAULT_DECODE_ENGINE, resources=RayResources()),
        router=RouterConfig())


def load_cluster_config(path: str | Path) -> ClusterConfig:
    """Read a YAML cluster config file (see parse_cluster_config)."""
    return parse_cluster_config(Path(path).read_text(encoding="utf-8"))


def parse_cluster_config(text: str) -> ClusterConfig:
    """The YAML document's settings applied on top of default_cluster_config(its model, its mode): a colocated
    config needs no `prefill:` section to say that its prefill pool is empty."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ClusterConfigError("", f"invalid YAML: {error}") from None
    _require(isinstance(data, Mapping), "", f"must be a mapping, got {reprlib.repr(data)}")
    _require("model" in data, "model", "required key is missing")
    model = _convert(data["model"], str, "model")
    return _overlay(default_cluster_config(model, colocated=data.get("mode") == "colocated"), data, "")


def apply_overrides(config: ClusterConfig, overrides: dict[str, object]) -> ClusterConfig:
    """config with dotted-key settings applied at once, e.g. {"prefill.replicas": 2, "mode": ...}."""
    return _overlay(config, _nest(overrides), "")


def dump_cluster_config(config: ClusterConfig) -> str:
    """YAML of every setting; parse_cluster_config(dump_cluster_config(c)) == c."""
    return yaml.safe_dump(dataclasses.asdict(config, dict_factory=_yaml_dict), sort_keys=False)


def _yaml_dict(items: list[tuple[str, object]]) -> dict[str, object]:
    """asdict's mappings with tuples as lists (safe_dump writes no tuples)."""
    return {key: list(value) if isinstance(value, tuple) else value for key, value in items}


class _Tree(dict):
    """A section built from dotted override keys (never a caller's own mapping)."""


def _nest(overrides: dict[str, object]) -> _Tree:
    tree = _Tree()
    for key, value in overrides.items():
        *sections, leaf = key.split(".")
        node = tree
        for section in sections:
            node = node.setdefault(section, _Tree())
            _require(isinstance(node, _Tree), key, "conflicts with another override")
        _require(leaf not in node, key, "conflicts with another override")
        node[leaf] = value
    return tree


def _overlay(current: object, data: object, path: str) -> object:
    """current (a config dataclass) with the mapping `data`'s settings applied; path names current."""
    changes = _settings(type(current), current, data, path)
    return _replace(current, _one_kv_sizing(current, changes), path)


def _settings(kind: type, current: object | None, data: object, path: str) -> dict[str, object]:
    """The mapping `data` as checked field values of the config class `kind`; nested sections are
    applied on top of current's (None: a section being built from `data` alone)."""
    _require(isinstance(data, Mapping), path, f"must be a mapping, got {reprlib.repr(data)}")
    hints = get_type_hints(kind)
    changes = {}
    for key, value in data.items():
        key_path = _join(path, key if isinstance(key, str) and key else repr(key))
        _require(key in hints, key_path, f"unknown key (known: {', '.join(sorted(hints))})")
        if dataclasses.is_dataclass(hints[key]):
            changes[key] = _overlay(getattr(current, key), value, key_path)
        elif _optional_section(hints[key]) is not None and value is not None:
            section = getattr(current, key, None)
            changes[key] = (_overlay(section, value, key_path) if section is not None
                            else _new_section(_optional_section(hints[key]), value, key_path))
        else:
            changes[key] = _convert(value, hints[key], key_path)
    return changes


def _optional_section(hint: object) -> type | None:
    """The config class of a section that is null by default (`TlsConfig | None`), else None."""
    return next((kind for kind in get_args(hint) if dataclasses.is_dataclass(kind)), None)


def _new_section(kind: type, data: object, path: str) -> object:
    """A section that was null, built from `data`: its keys without a default are required."""
    changes = _settings(kind, None, data, path)
    for spec in dataclasses.fields(kind):
        _require(spec.name in changes or spec.default is not dataclasses.MISSING, _join(path, spec.name),
                 "required key is missing")
    try:
        return kind(**changes)
    except ClusterConfigError as error:
        raise error.under(path) from None
    except ValueError as error:
        raise _located(str(error), kind).under(path) from None


def _one_kv_sizing(current: object, changes: dict[str, object]) -> dict[str, object]:
    """Setting a KV sizing field replaces the pool's default sizing: a config layer (the file, the flags, --set)
    that sets gpu_memory_utilization, alone, clears the pool's default kv_cache_memory_bytes, which would win."""
    if not isinstance(current, EngineConfig) or not changes.keys() & set(KV_SIZING_FIELDS):
        return changes
    return {**dict.fromkeys(KV_SIZING_FIELDS), **changes}


def _replace(current: object, changes: dict[str, object], path: str) -> object:
    try:
        return dataclasses.replace(current, **changes)
    except ClusterConfigError as error:
        raise error.under(path) from None
    except ValueError as error:
        raise _located(str(error), type(current)).under(path) from None


def _located(message: str, kind: type) -> ClusterConfigError:
    """A config class's message ("<field> must be ...") as an error at that field, else at the section."""
    name, _, reason = message.partition(" ")
    if name in get_type_hints(kind):
        return ClusterConfigError(name, reason)
    return ClusterConfigError("", message)




def _convert(value: object, hint: object, path: str) -> object:
    """value checked against a scalar field type (ints widen to float; bools are not numbers), or
    against `tuple[str, ...]` (a list of strings, or one string)."""
    if get_origin(hint) is tuple:
        return _string_tuple(value, path)
    kinds = get_args(hint) or (hint,)
    for kind in kinds:
        if is_scalar_kind(value, kind):
            return float(value) if kind is float else value
    raise ClusterConfigError(path, f"must be {' or '.join(SCALAR_KINDS[kind] for kind in kinds)}, got {reprlib.repr(value)}")


def _string_tuple(value: object, path: str) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    _require(isinstance(items, (list, tuple)) and all(isinstance(item, str) for item in items), path,
             f"must be a string or a list of strings, got {reprlib.repr(value)}")
    return tuple(items)
