"""What a model directory must hold for splitserve to serve it, judged from its files alone.

Torch-free and without transformers (whose import takes seconds): the CLI checks a directory
this way in milliseconds, before Ray or any worker starts, and the engine's loader refuses the
same architectures with the same words.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from splitserve.common.errors import UnsupportedModelError

DEFAULT_MODEL_NAME = "default"
"""The model name that means the embedded trained model (shipped with the package, always servable)."""
DRAFT_MODEL_NAME = "default-draft"
"""The embedded ~10x smaller model with the default model's tokenizer, for speculative decoding."""
EMBEDDED_MODELS = (DEFAULT_MODEL_NAME, DRAFT_MODEL_NAME)
"""Names `--model` accepts besides a directory."""
SPARSE_MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM")
"""The supported mixtures of experts (engine/models/moe.py)."""
ATTENTION_SINK_ARCHITECTURES = ("GptOssForCausalLM",)
"""The supported architectures whose attention has sinks: CPU attention only (engine/model_loader.py)."""
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Phi3ForCausalLM", "GraniteForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM",
                           "Gemma3ForCausalLM", "SmolLM3ForCausalLM", "Olmo2ForCausalLM", *SPARSE_MOE_ARCHITECTURES)
"""config.json `architectures` values the engine runs (chosen_architecture picks the first of them in a list)."""
SILU_ACTIVATIONS = ("silu", "swish")
"""config.json `hidden_act` values the engine runs: transformers maps both names to the same SiLU."""
TOKENIZER_FILE = "tokenizer.json"
"""The fast-tokenizer file: the router and the workers read only this (through `tokenizers`)."""
SAFETENSORS_INDEX = "model.safetensors.index.json"
PYTORCH_INDEX = "pytorch_model.bin.index.json"
"""The index files of sharded checkpoints: `weight_map` maps each tensor name to its shard's file name."""
WEIGHT_FILE_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
"""Names of the files weight_files reads when a directory has no index (safetensors first)."""
OTHER_TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "tiktoken.model")
"""Slow-tokenizer files transformers can convert into tokenizer.json; named in the error so the
user knows the conversion is all that is missing."""


@dataclass(frozen=True)
class ActivationField:
    """The config.json field an architecture's MLP reads its activation from, and the values the engine runs."""

    name: str
    default: str
    """What transformers' config class sets when config.json lacks the field."""
    accepted: tuple[str, ...]

    def unsupported_message(self, value: object) -> str:
        return f"{self.name} {value!r} is not supported (only {' / '.join(self.accepted)})"


SILU_ACTIVATION = ActivationField("hidden_act", "silu", SILU_ACTIVATIONS)
GELU_TANH_ACTIVATIONS = {
    # GemmaConfig rewrites the official checkpoints' legacy "gelu" to gelu_pytorch_tanh.
    "GemmaForCausalLM": ActivationField("hidden_act", "gelu_pytorch_tanh", ("gelu_pytorch_tanh", "gelu")),
    "Gemma2ForCausalLM": ActivationField("hidden_activation", "gelu_pytorch_tanh", ("gelu_pytorch_tanh",)),
    "Gemma3ForCausalLM": ActivationField("hidden_activation", "gelu_pytorch_tanh", ("gelu_pytorch_tanh",)),
}
"""Architectures whose MLP gates with gelu(approximate="tanh") instead of SiLU, by their activation field."""


def activation_field(architecture: str) -> ActivationField:
    return GELU_TANH_ACTIVATIONS.get(architecture, SILU_ACTIVATION)


def unsupported_architecture_message(architecture: str) -> str:
    return f"architecture {architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"


def check_model_dir(model_dir: Path, check_tokenizer: bool = True) -> None:
    """UnsupportedModelError (one line, naming the directory) unless `model_dir` has a config.json
    of a supported architecture, weights (weight_files) and, unless `check_tokenizer` is off (a
    --tokenizer directory gives them), a tokenizer.json."""
    if not model_dir.is_dir():
        raise UnsupportedModelError(f"{model_dir}: no such model directory")
    config = read_model_config(model_dir)
    architecture = config_architecture(config, model_dir)
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(f"{model_dir}: {unsupported_architecture_message(architecture)}")
    activation = activation_field(architecture)
    if config.get(activation.name, activation.default) not in activation.accepted:
        raise UnsupportedModelError(f"{model_dir}: {activation.unsupported_message(config[activation.name])}")
    weight_files(model_dir)
    if check_tokenizer:
        check_tokenizer_files(model_dir)


def weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files, sorted: safetensors whenever the directory has them, else PyTorch's
    pickled state dicts (pytorch_model*.bin), which older checkpoints ship instead. Sharded checkpoints are read
    through their index (a directory may hold other files of the same suffix, such as Mistral's
    consolidated.safetensors next to the Hugging Face shards); UnsupportedModelError when there are none or an
    index names a shard that is missing or not a file name in the directory."""
    for index_name, pattern in zip((SAFETENSORS_INDEX, PYTORCH_INDEX), WEIGHT_FILE_PATTERNS):
        index = model_dir / index_name
        if index.is_file():
            names = sorted(set(_index_weight_map(index).values()))
            # A shard is a file of this directory: a path ("../x.bin", "/x") would read weights from elsewhere.
            outside = [name for name in names if Path(name).name != name or name in (".", "..")]
            if outside:
                raise UnsupportedModelError(f"{index}: names shards that are not file names in its directory: "
                                            f"{', '.join(outside)}")
            files = [model_dir / name for name in names]
            missing = [path.name for path in files if not path.is_file()]
            if missing:
                raise UnsupportedModelError(f"{index}: names shards that are missing: {', '.join(missing)}")
            return files
        files = sorted(model_dir.glob(pattern))
        if files:
            return files
    raise UnsupportedModelError(f"{model_dir}: no weights (*.safetensors, or pytorch_model*.bin)")


def _index_weight_map(index: Path) -> dict[str, str]:
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
        raise UnsupportedModelError(f"{index}: has no `weight_map` of tensor names to shard files")
    return weight_map


def read_model_config(model_dir: Path) -> dict:
    """config.json as a mapping; UnsupportedModelError when it is missing or not a JSON object."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise UnsupportedModelError(f"{model_dir}: not a model directory: missing config.json")
    return read_json_object(path)


def read_json_object(path: Path, error: type[Exception] = UnsupportedModelError) -> dict:
    """The JSON object `path` holds; `error` naming the file when it is not readable JSON or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as reason:
        raise error(f"{path}: not readable JSON: {reason}") from None
    if not isinstance(data, dict):
        raise error(f"{path}: not a JSON object, got {type(data).__name__}")
    return data


def no_architecture_message() -> str:
    """Why a config.json without an `architectures` entry is refused (transformers' Auto classes would go by its
    model_type; the engine, like vLLM, runs the class its architectures entry names)."""
    return (f"config.json names no architecture (`architectures` is missing or empty); supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def config_architecture(config: dict, model_dir: Path) -> str:
    """The architecture config.json's `architectures` has the engine run (chosen_architecture);
    UnsupportedModelError when it names none."""
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or not architectures or not all(isinstance(a, str) for a in architectures):
        raise UnsupportedModelError(f"{model_dir}: {no_architecture_message()}")
    return chosen_architecture(architectures)


BASE_MODEL_ARCHITECTURES = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM",
                            "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM"}
"""Decoders saved without their LM head, as embedding models are (e5-mistral's MistralModel): run as their causal-LM
family, whose lm_head only a pooling engine can do without (load_model's needs_lm_head), as vLLM converts them."""
SEQUENCE_CLASSIFICATION_ARCHITECTURES = {"LlamaForSequenceClassification": "LlamaForCausalLM",
                                         "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
                                         "Qwen3ForSequenceClassification": "Qwen3ForCausalLM"}
"""Decoders with transformers' sequence-classification head (`score.weight` [num_labels, hidden] over the last
token's final hidden state, no lm_head): cross-encoders, rerankers and classifiers. They run as their causal-LM family
on a pooling engine only (common/pooling.py's Classifier)."""
_RUN_AS = {**BASE_MODEL_ARCHITECTURES, **SEQUENCE_CLASSIFICATION_ARCHITECTURES}


def chosen_architecture(architectures: Sequence[str]) -> str:
    """The first of a non-empty `architectures` list that the engine runs, as vLLM takes the first it supports
    (["MyWrapper", "LlamaForCausalLM"] runs Llama; a BASE_MODEL_ARCHITECTURES or SEQUENCE_CLASSIFICATION_ARCHITECTURES
    name as its causal-LM family); the first entry when none is (what the refusal names)."""
    runnable = (_RUN_AS.get(name, name) for name in architectures)
    return next((name for name in runnable if name in SUPPORTED_ARCHITECTURES), architectures[0])


def check_tokenizer_files(model_dir: Path) -> None:
    """UnsupportedModelError naming tokenizer.json when the directory lacks it (and what it has instead)."""
    if (model_dir / TOKENIZER_FILE).is_file():
        return
    present = [name for name in OTHER_TOKENIZER_FILES if (model_dir / name).is_file()]
    if present:
        hint = (f"it has {', '.join(present)}: save the tokenizer once with transformers "
                "(AutoTokenizer.from_pretrained(dir).save_pretrained(dir)) to write tokenizer.json")
    else:
        hint = "it has no tokenizer files at all"
    raise UnsupportedModelError(f"{model_dir}: missing {TOKENIZER_FILE} (splitserve reads the fast tokenizer "
                                f"file only); {hint}")


def tokenizer_dir(model_dir: Path, tokenizer: str | Path | None) -> Path:
    """Where the tokenizer files (tokenizer.json, tokenizer_config.json, the chat template) are read:
    `tokenizer` (vLLM's --tokenizer) when given, else the model directory itself."""
    return model_dir if tokenizer is None else Path(tokenizer).expanduser()


TOKENIZER_FLAG = "--tokenizer"
"""vLLM's flag (cluster config key `tokenizer`) naming a tokenizer directory other than the model's."""


def tokenizer_option_label(tokenizer: str | Path) -> str:
    """How errors about a --tokenizer directory begin: the flag and the value given."""
    return f"{TOKENIZER_FLAG} {str(tokenizer)!r}"


def check_tokenizer_option(tokenizer: str | Path) -> None:
    """UnsupportedModelError naming --tokenizer when the directory it gives is missing, not a directory,
    or lacks tokenizer.json (check_tokenizer_files' words after the flag's); a tokenizer.json that does
    not load is RouterTokenizer.from_model_dir's to report (it parses it), under the same label."""
    path = Path(tokenizer).expanduser()
    if not path.is_dir():
        raise UnsupportedModelError(f"{tokenizer_option_label(tokenizer)}: no such tokenizer directory")
    try:
        check_tokenizer_files(path)
    except UnsupportedModelError as error:
        raise UnsupportedModelError(f"{tokenizer_option_label(tokenizer)}: {error}") from None


def check_tokenizer_vocabulary(tokenizer_vocab_size: int, tokenizer_dir: Path, model_dir: Path) -> None:
    """UnsupportedModelError when a --tokenizer given beside a model (added tokens included) has more ids
    than the model's embedding (config.json `vocab_size`): its highest ids would index past the embedding.
    vLLM refuses such ids per request ("Token id N is out of vocabulary"); splitserve refuses the pair at
    start. Only for --tokenizer: a checkpoint's own tokenizer is served as it ships (the engine refuses a
    prompt id outside the embedding per request). A smaller tokenizer is fine (embeddings padded past the
    tokenizer's ids, as Qwen2's)."""
    model_vocab_size = read_model_config(model_dir).get("vocab_size")
    if not isinstance(model_vocab_size, int) or tokenizer_vocab_size <= model_vocab_size:
        return
    raise UnsupportedModelError(f"{tokenizer_dir / TOKENIZER_FILE}: the tokenizer has {tokenizer_vocab_size} "
                                f"tokens, more than the model's vocab_size {model_vocab_size} "
                                f"({model_dir / 'config.json'}); use the model's own tokenizer")
