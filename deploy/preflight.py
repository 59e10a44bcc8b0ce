"""What `splitserve serve` checks before Ray starts: every mistake that the config and the files
it names already show (the model directory, its tokenizer (or --tokenizer's) and chat template, a max_model_len
longer than its positions, a weight quantization the checkpoint does not fit, sampling defaults a
generation_config.json cannot give, TLS files,
the API key's variable, a host that is not this machine's, ports in use, LoRA adapter directories the
engines would refuse, a pooling model's sentence-transformers files the engines would refuse), each reported as one
line within milliseconds instead of after Ray, the workers and a model load.

Only the standard library, the router's torch-free tokenizer and common/ are imported here, so
the checks themselves take milliseconds.
"""

from __future__ import annotations

import importlib.util
import socket
from pathlib import Path

from splitserve.common.errors import InvalidRequestError, UnsupportedModelError
from splitserve.common.generation_config import GenerationConfigFile, resolve_request_defaults
from splitserve.common.lora import adapter_weight_file, read_adapter_config
from splitserve.common.model_dir import (ATTENTION_SINK_ARCHITECTURES, EMBEDDED_MODELS,
                                         SEQUENCE_CLASSIFICATION_ARCHITECTURES, check_model_dir, chosen_architecture,
                                         read_model_config)
from splitserve.common.pooling import read_model_pooling
from splitserve.common.quantization_spec import resolve_quantization
from splitserve.deploy.cluster_config import ClusterConfig, RouterConfig
from splitserve.router.auth import api_key_from_env
from splitserve.router.tls import load_tls
from splitserve.router.tokenizer import RouterTokenizer, compile_chat_template, read_chat_template_option

PORT_KEYS = (("grpc_port", "--grpc-port"), ("http_port", "--port"), ("metrics_port", "--metrics-port"))
"""The router's ports: (config key under router., the serve flag that sets it)."""


class PreflightError(ValueError):
    """A config that cannot serve; the message is one line naming the setting at fault."""


def preflight(config: ClusterConfig, api_key: str | None = None) -> None:
    """PreflightError (or UnsupportedModelError, both ValueErrors) for the first problem found;
    `api_key`: the key given on the command line, which makes router.api_key_env unnecessary."""
    check_model(config.model, config.router.chat_template, config.tokenizer)
    check_max_model_len(config)
    check_quantization(config)
    check_lora_modules(config)
    check_pooling(config)
    check_serving_sinks(config)
    resolve_request_defaults(config.router.generation_config, GenerationConfigFile.read(_model_dir(config.model)))
    if config.router.tls is not None:
        load_tls(config.router.tls)
    if api_key is None and config.router.api_key_env is not None:
        api_key_from_env(config.router.api_key_env)
    check_ports_free(config.router)


def check_model(model: str, chat_template: str | None, tokenizer: str | None = None) -> None:
    """The model directory serves (architecture, weights, tokenizer.json: `tokenizer`'s when given,
    with no more ids than the model's vocab_size) and the chat template compiles: the override when
    given, else the tokenizer directory's own. The embedded models always serve (with their own tokenizer)."""
    template = read_chat_template_option(chat_template) if chat_template is not None else None
    if model in EMBEDDED_MODELS and tokenizer is None:
        if template is not None:
            _compile(template)
        return
    model_dir = _model_dir(model)
    check_model_dir(model_dir, check_tokenizer=tokenizer is None)
    RouterTokenizer.from_model_dir(model_dir, template, tokenizer=tokenizer)


def check_max_model_len(config: ClusterConfig) -> None:
    """PreflightError when a serving pool's engine.max_model_len is longer than config.json's
    max_position_embeddings (the engine refuses it too, but only once Ray and the workers started)."""
    model_dir = _model_dir(config.model)
    max_positions = read_model_config(model_dir).get("max_position_embeddings")
    if not isinstance(max_positions, int):
        return  # transformers' default for the architecture applies: the engine checks it
    for role in ("prefill", "decode") if config.mode == "disaggregated" else ("decode",):
        length = getattr(config, role).engine.max_model_len
        if length is not None and length > max_positions:
            raise PreflightError(f"{role}.engine.max_model_len (--max-model-len): {length} exceeds the model's "
                                 f"max_position_embeddings {max_positions} ({model_dir / 'config.json'})")


def check_quantization(config: ClusterConfig) -> None:
    """PreflightError when a serving pool's engine.quantization does not fit the checkpoint (gptq / awq of
    float weights, int8 of a packed checkpoint, a packing the engine cannot run): the workers refuse it
    with the same message (common/quantization_spec.py), but only once Ray started and they loaded."""
    checkpoint_config = read_model_config(_model_dir(config.model)).get("quantization_config")
    for role in ("prefill", "decode") if config.mode == "disaggregated" else ("decode",):
        engine = getattr(config, role).engine
        try:
            resolve_quantization(engine.quantization, engine.quantization_group_size, checkpoint_config)
        except UnsupportedModelError as error:
            raise PreflightError(f"{role}.engine.quantization (--quantization): {error}") from None


def check_lora_modules(config: ClusterConfig) -> None:
    """PreflightError naming the first lora_modules adapter whose directory an engine would refuse by its
    adapter_config.json (a rank above a serving pool's max_lora_rank among them) or that has no weight file (the
    engines check its tensors when a request first names it)."""
    roles = ("prefill", "decode") if config.mode == "disaggregated" else ("decode",)
    max_rank = min(getattr(config, role).engine.max_lora_rank for role in roles)
    for adapter in config.lora_requests:
        try:
            read_adapter_config(Path(adapter.lora_path), max_rank)
            adapter_weight_file(Path(adapter.lora_path))
        except InvalidRequestError as error:
            raise PreflightError(f"lora_modules (--lora-modules) {adapter.lora_name}: {error.message}") from None


def check_pooling(config: ClusterConfig) -> None:
    """With --runner pooling: the model's sentence-transformers files name a pooling the engines run (no Dense
    module, a LAST / MEAN / CLS Pooling module), as each worker reads them when it starts. Without it: the model is
    not a sequence-classification one (no LM head: the engines would refuse it once Ray and the workers started)."""
    if config.runner != "pooling":
        architectures = read_model_config(_model_dir(config.model)).get("architectures") or []
        classifiers = [name for name in architectures if name in SEQUENCE_CLASSIFICATION_ARCHITECTURES]
        if classifiers:
            raise PreflightError(f"{config.model}: a {classifiers[0]} (a sequence-classification head, no LM head) "
                                 "runs with --runner pooling only")
        return
    try:
        read_model_pooling(_model_dir(config.model), config.decode.engine.pooler_config)
    except ValueError as error:
        raise PreflightError(f"--runner pooling: {error}") from None


def check_serving_sinks(config: ClusterConfig) -> None:
    """PreflightError when a model with attention sinks (GPT-OSS) is asked to run where the workers would refuse it
    once Ray started: a pool on device cuda or on the flashinfer backend (its sinks are attended on the CPU only).
    A pool on device auto resolves on its worker's node, which the engine checks there."""
    if config.model in EMBEDDED_MODELS:
        return
    architectures = read_model_config(_model_dir(config.model)).get("architectures") or []
    if not architectures or chosen_architecture(architectures) not in ATTENTION_SINK_ARCHITECTURES:
        return
    for role in ("prefill", "decode") if config.mode == "disaggregated" else ("decode",):
        engine = getattr(config, role).engine
        if engine.device == "cuda" or engine.attention_backend == "flashinfer":
            raise PreflightError(f"{role}.engine: {chosen_architecture(architectures)} has attention sinks, which run "
                                 f"on device cpu only (the CUDA attention path, FlashInfer, has not been verified with "
                                 f"them: docs/gpu.md); got device {engine.device!r}, attention_backend "
                                 f"{engine.attention_backend!r}")


def _model_dir(model: str) -> Path:
    """The directory of `model`: an embedded model's is package data of splitserve.engine, found
    without importing that package (it imports torch)."""
    if model not in EMBEDDED_MODELS:
        return Path(model).expanduser()
    engine_dir = importlib.util.find_spec("splitserve.engine").submodule_search_locations[0]
    return Path(engine_dir) / "default_models" / model


def _compile(template: str) -> None:
    try:
        compile_chat_template(template)
    except Exception as error:  # jinja2's TemplateSyntaxError and its kin
        raise UnsupportedModelError(f"the chat template given does not compile: {error}") from None


def check_ports_free(router: RouterConfig) -> None:
    """PreflightError when router.host is no address of this machine (whatever the ports, 0
    included), else for the first fixed router port that another socket holds (port 0 picks a free
    one when the server starts, so it cannot clash)."""
    problem = bind_problem(router.host, 0)
    if problem is not None:
        raise PreflightError(f"router.host (--host): cannot listen on {router.host}: {problem}")
    for key, flag in PORT_KEYS:
        port = getattr(router, key)
        if not port:
            continue
        problem = bind_problem(router.host, port)
        if problem is not None:
            raise PreflightError(f"router.{key} ({flag}): cannot listen on {router.host}:{port}: {problem}")


def bind_problem(host: str, port: int) -> str | None:
    """Why host:port cannot be listened on now (e.g. "Address already in use"), or None. Binds the
    way the servers do (SO_REUSEADDR: a port left in TIME_WAIT by a stopped server is free)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as error:
        return error.strerror or str(error)
    return None
