"""Pooling (embedding) requests: what a model pools by default and what one request asks for.

A pooling request runs its prompt's prefill and ends with one vector pooled from the final hidden states (after
the model's final norm, before lm_head) instead of a sampled token: vLLM's `--runner pooling` / `LLM.embed`.
The model's defaults come as vLLM reads them: sentence-transformers' `modules.json` (its Pooling module's
`config.json` names the pooling, a Normalize module turns L2 normalization on), else a decoder LLM's defaults
(LAST pooling, normalized); `PoolerConfig` (vLLM's `--pooler-config`) overrides either. sentence_bert_config.json's
max_seq_length bounds the prompt as vLLM bounds it (the default max_model_len). A sequence-classification checkpoint
(common.model_dir.SEQUENCE_CLASSIFICATION_ARCHITECTURES) pools LAST and its `score` head turns the vector into one
logit per label (Classifier): the engine returns the logits, and the API applies the activation vLLM applies.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from splitserve.common.errors import InvalidRequestError
from splitserve.common.model_dir import SEQUENCE_CLASSIFICATION_ARCHITECTURES

POOLING_TYPES = ("LAST", "MEAN", "CLS")
"""Sequence poolings: the last prompt token's hidden state, the mean over every prompt position, the first's."""
RUNNERS = ("generate", "pooling")
"""vLLM's --runner values served here: generate (sample tokens) or pooling (embed prompts)."""
DEFAULT_POOLING_TYPE = "LAST"
"""vLLM's pooling of a decoder LLM served as an embedding model (Qwen3-Embedding, e5-mistral)."""

_ST_POOLING_MODULES = frozenset({"sentence_transformers.models.Pooling",
                                 "sentence_transformers.sentence_transformer.modules.pooling.Pooling"})
_ST_NORMALIZE_MODULES = frozenset({"sentence_transformers.models.Normalize",
                                   "sentence_transformers.base.modules.normalize.Normalize",
                                   "sentence_transformers.sentence_transformer.modules.normalize.Normalize"})
_ST_DENSE_MODULES = frozenset({"sentence_transformers.models.Dense", "sentence_transformers.base.modules.dense.Dense"})
_ST_POOLING_NAMES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
                     "pooling_mode_cls_token": "CLS", "lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}
"""sentence-transformers' Pooling config keys (set to true) and pooling_mode values, as pooling types."""


@dataclass(frozen=True)
class PoolerConfig:
    """vLLM's --pooler-config: overrides of the pooling the model directory declares (None: the model's)."""

    pooling_type: str | None = None
    """LAST, MEAN or CLS."""
    use_activation: bool | None = None
    """vLLM's name for an embedding's L2 normalization."""

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise ValueError(f"use_activation must be a bool or None, got {self.use_activation!r}")


ACTIVATIONS = ("softmax", "sigmoid", "identity")
"""What turns a classifier's logits into its outputs (vLLM's PoolerClassify with num_labels >= 2, with one label or
multi-label classification, and regression's none)."""
_SBERT_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.modules.linear.Identity": "identity"}
"""sentence-transformers' CrossEncoder activation_fn values served (vLLM accepts any torch.nn.modules class)."""


@dataclass(frozen=True)
class Classifier:
    """A sequence-classification head as vLLM reads config.json (num_labels, id2label, problem_type, and a
    sentence-transformers cross-encoder's activation_fn)."""

    labels: tuple[str, ...]
    """id2label in label order: label i names logit i (transformers' LABEL_i when config.json names none)."""
    classify_activation: str
    """What /classify and LLM.classify apply (vLLM's get_classification_act_fn): regression none, multi-label
    classification a sigmoid per label, otherwise a sigmoid for one label and a softmax over several."""
    score_activation: str
    """What /score, /rerank and LLM.score apply (vLLM's get_cross_encoder_act_fn): the sentence-transformers
    activation_fn config.json names, else the same sigmoid / softmax rule."""
    activates: bool = True
    """Whether a request that does not say (use_activation None) gets activated outputs: --pooler-config's
    use_activation (vLLM's default true), else the logits."""

    def __post_init__(self) -> None:
        if not self.labels:
            raise ValueError("a classifier needs at least one label")
        for activation in (self.classify_activation, self.score_activation):
            if activation not in ACTIVATIONS:
                raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    def classified(self, logits: Sequence[float], use_activation: bool | None) -> tuple[float, ...]:
        """A classification's outputs (`probs`): the logits through classify_activation, or as they are when the
        request (else the model) says no activation."""
        return self._outputs(logits, use_activation, self.classify_activation)

    def scored(self, logits: Sequence[float], use_activation: bool | None) -> float:
        """A cross-encoder's score of a pair: its one logit through score_activation (or as it is)."""
        return self._outputs(logits, use_activation, self.score_activation)[0]

    def _outputs(self, logits: Sequence[float], use_activation: bool | None, activation: str) -> tuple[float, ...]:
        activates = self.activates if use_activation is None else use_activation
        return _activated(logits, activation) if activates else tuple(logits)


def _activated(logits: Sequence[float], activation: str) -> tuple[float, ...]:
    """A classifier's outputs from its logits (float64 here; the logits are the engine's float32)."""
    if activation == "identity":
        return tuple(float(x) for x in logits)
    if activation == "sigmoid":
        return tuple(_sigmoid(x) for x in logits)
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = sum(exps)
    return tuple(e / total for e in exps)


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def check_cross_encoder(classifier: Classifier) -> None:
    """A pair's score is one logit: a classifier of several labels has no score (vLLM's cross-encoders have one)."""
    if classifier.num_labels != 1:
        raise InvalidRequestError("model", f"scores need a cross-encoder of one label (num_labels 1); this model "
                                           f"classifies into {classifier.num_labels} labels: classify instead "
                                           f"(/classify)")


def score_pairs(first: object, second: object, first_field: str = "text_1",
                second_field: str = "text_2") -> list[tuple[str, str]]:
    """vLLM's score pairing: each side a string or a list of strings; 1:1, 1:N (the one first text with every second
    one) or N:N (pairwise); anything else a 400 naming the field."""
    firsts, seconds = _texts(first, first_field), _texts(second, second_field)
    if not firsts:
        raise InvalidRequestError(first_field, "At least one text element must be given")
    if not seconds:
        raise InvalidRequestError(second_field, "At least one text_pair element must be given")
    if len(firsts) > 1 and len(firsts) != len(seconds):
        raise InvalidRequestError(second_field, f"Input lengths must be either 1:1, 1:N or N:N; got "
                                                f"{len(firsts)}:{len(seconds)}")
    return list(zip(firsts * len(seconds) if len(firsts) == 1 else firsts, seconds))


def _texts(value: object, field: str) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not all(isinstance(text, str) for text in texts):
        raise InvalidRequestError(field, "must be a string or a list of strings")
    return texts


def cosine_similarity(first: Sequence[float], second: Sequence[float]) -> float:
    """torch's CosineSimilarity (vLLM's embedding score): the dot product over the product of the norms, each norm
    at least 1e-8."""
    dot = math.fsum(a * b for a, b in zip(first, second, strict=True))
    norms = max(math.sqrt(math.fsum(a * a for a in first)), 1e-8) * max(math.sqrt(math.fsum(b * b for b in second)),
                                                                         1e-8)
    return dot / norms


@dataclass(frozen=True)
class ModelPooling:
    """How a model embeds, resolved once from its directory and the PoolerConfig overrides."""

    pooling_type: str
    normalize: bool
    """L2-normalize every embedding unless a request says otherwise (PoolingParams.use_activation)."""
    hidden_size: int
    """Length of a full embedding."""
    matryoshka_dimensions: tuple[int, ...] | None
    """config.json's matryoshka_dimensions: the only lengths a request's `dimensions` may ask for."""
    is_matryoshka: bool
    """The model declares Matryoshka embeddings (is_matryoshka or matryoshka_dimensions in config.json): a
    request may ask for a shorter prefix of the vector (vLLM's rule; otherwise `dimensions` is refused)."""
    max_seq_length: int | None = None
    """sentence_bert_config.json's max_seq_length: the longest prompt the model embeds (sentence-transformers cuts
    longer ones there; vLLM makes it the default max_model_len and refuses a longer max_model_len). None: no file."""
    classifier: Classifier | None = None
    """A sequence-classification model's head: its pooled vector is the head's logits, never normalized. None: an
    embedding model."""

    def check_dimensions(self, dimensions: int | None, model_name: str) -> None:
        """vLLM's checks (and messages) of a request's `dimensions`."""
        if dimensions is None:
            return
        if not self.is_matryoshka:
            raise InvalidRequestError("dimensions", f"Model {model_name!r} does not support Matryoshka embeddings; "
                                                    f"dimensions must be unset (received dimensions={dimensions}).")
        if not 1 <= dimensions <= self.hidden_size:
            raise InvalidRequestError("dimensions", f"Model {model_name!r} only supports dimensions in range "
                                                    f"[1, {self.hidden_size}], got {dimensions}.")
        if self.matryoshka_dimensions is not None and dimensions not in self.matryoshka_dimensions:
            raise InvalidRequestError("dimensions", f"Model {model_name!r} only supports Matryoshka dimensions "
                                                    f"{list(self.matryoshka_dimensions)}, got {dimensions}.")


@dataclass(frozen=True)
class PoolingParams:
    """vLLM's PoolingParams for an embedding request (None: the model's default)."""

    dimensions: int | None = None
    """Keep the first `dimensions` entries of the pooled vector (before normalizing); Matryoshka models only."""
    use_activation: bool | None = None
    """L2-normalize the embedding; None: ModelPooling.normalize."""

    def __post_init__(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)):
            raise InvalidRequestError("dimensions", f"must be an integer or None, got {self.dimensions!r}")
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise InvalidRequestError("use_activation", f"must be a bool or None, got {self.use_activation!r}")


@dataclass(frozen=True)
class ResolvedPooling:
    """What the engine pools one request with: the model's pooling, the request's length and normalization."""

    pooling_type: str
    normalize: bool
    dimensions: int | None

    @property
    def reads_prefix_cache(self) -> bool:
        """Only LAST pooling may start after cached blocks: its pooled position (the last) is always computed
        (BlockManager.match_prefix leaves it), while MEAN needs every position's hidden state and CLS the
        first's, which a cache hit would skip. Their blocks still enter the cache for others to reuse."""
        return self.pooling_type == "LAST"


def resolve_pooling(model: ModelPooling, params: PoolingParams, model_name: str) -> ResolvedPooling:
    """A classifier's logits are never normalized: its use_activation is the API's activation (the engine returns
    the logits whatever the request says)."""
    model.check_dimensions(params.dimensions, model_name)
    if model.classifier is not None:
        return ResolvedPooling(model.pooling_type, False, None)
    normalize = model.normalize if params.use_activation is None else params.use_activation
    return ResolvedPooling(model.pooling_type, normalize, params.dimensions)


def read_model_pooling(model_dir: str | Path, overrides: PoolerConfig | None = None) -> ModelPooling:
    """The model's pooling: overrides, else its sentence-transformers files, else LAST and normalized."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    classifier = _classifier(config, model_dir)
    overrides = overrides or PoolerConfig()
    if classifier is not None:  # vLLM's pooling of a converted *ForSequenceClassification: the last token, as is
        if overrides.use_activation is not None:
            classifier = replace(classifier, activates=overrides.use_activation)
        return ModelPooling(overrides.pooling_type or "LAST", False, int(config["hidden_size"]), None, False,
                            _max_seq_length(model_dir), classifier)
    declared = _sentence_transformers_pooling(model_dir)
    pooling_type = overrides.pooling_type or declared.pooling_type or DEFAULT_POOLING_TYPE
    normalize = next(v for v in (overrides.use_activation, declared.use_activation, True) if v is not None)
    dims = config.get("matryoshka_dimensions")
    return ModelPooling(pooling_type, normalize, int(config["hidden_size"]),
                        tuple(int(d) for d in dims) if dims else None,
                        bool(dims) or bool(config.get("is_matryoshka", False)), _max_seq_length(model_dir))


def _classifier(config: dict, model_dir: Path) -> Classifier | None:
    """The head of a SEQUENCE_CLASSIFICATION_ARCHITECTURES checkpoint as transformers' config reads it (id2label,
    else num_labels labels LABEL_i, else 2); None for any other architecture."""
    architectures = config.get("architectures") or []
    if not any(name in SEQUENCE_CLASSIFICATION_ARCHITECTURES for name in architectures):
        return None
    id2label = config.get("id2label")
    if isinstance(id2label, dict) and id2label:
        labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(len(id2label)))
    else:
        labels = tuple(f"LABEL_{i}" for i in range(int(config.get("num_labels", 2))))
    if not labels:
        raise ValueError(f"{model_dir / 'config.json'}: a sequence-classification model needs num_labels >= 1")
    default = "sigmoid" if len(labels) < 2 else "softmax"
    problem_type = config.get("problem_type")
    classify = {"regression": "identity", "multi_label_classification": "sigmoid"}.get(problem_type, default)
    return Classifier(labels, classify, _cross_encoder_activation(config, model_dir, default))


def _cross_encoder_activation(config: dict, model_dir: Path, default: str) -> str:
    """config.json's sentence_transformers.activation_fn (or sbert_ce_default_activation_function), as vLLM reads
    it; Sigmoid and Softmax are vLLM's default rule, Identity none; another class is refused."""
    settings = config.get("sentence_transformers")
    name = settings.get("activation_fn") if isinstance(settings, dict) else None
    name = name or config.get("sbert_ce_default_activation_function")
    if name is None or name == "torch.nn.modules.activation.Softmax":
        return default
    if name in _SBERT_ACTIVATIONS:
        return default if _SBERT_ACTIVATIONS[name] == "sigmoid" else "identity"
    raise ValueError(f"{model_dir / 'config.json'}: the cross-encoder activation_fn {name!r} is not supported; "
                     f"supported: {', '.join([*_SBERT_ACTIVATIONS, 'torch.nn.modules.activation.Softmax'])}")


def _max_seq_length(model_dir: Path) -> int | None:
    """sentence_bert_config.json's max_seq_length (vLLM's encoder_config), None without the file or the key. Its
    do_lower_case (sentence-transformers and vLLM lowercase every text input) is refused: this server embeds text as
    given, and vectors of the original case would be silently different."""
    config_file = model_dir / "sentence_bert_config.json"
    settings = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if settings.get("do_lower_case"):
        raise ValueError(f"{config_file}: do_lower_case (lowercasing every text input) is not supported")
    length = settings.get("max_seq_length")
    if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
        raise ValueError(f"{config_file}: max_seq_length must be a positive integer, got {length!r}")
    return length


def _sentence_transformers_pooling(model_dir: Path) -> PoolerConfig:
    """What modules.json declares (vLLM's get_pooling_config): the Pooling module's type and whether a Normalize
    module follows; nothing without modules.json. A Dense module (a projection after pooling) is refused: this
    engine does not run it, and embeddings without it would be silently wrong."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return PoolerConfig()
    modules = json.loads(modules_file.read_text())
    types = {module.get("type") for module in modules}
    if types & _ST_DENSE_MODULES:
        raise ValueError(f"{modules_file}: a sentence-transformers Dense module (a projection after pooling) is not "
                         "supported; only Pooling and Normalize modules are")
    normalize = bool(types & _ST_NORMALIZE_MODULES)
    pooling = next((module for module in modules if module.get("type") in _ST_POOLING_MODULES), None)
    if pooling is None:
        return PoolerConfig(use_activation=normalize)
    pooling_file = model_dir / pooling.get("path", "") / "config.json"
    settings = json.loads(pooling_file.read_text()) if pooling_file.is_file() else {}
    return PoolerConfig(_pooling_type_of(settings, pooling_file), normalize)


def _pooling_type_of(settings: dict, pooling_file: Path) -> str | None:
    """The pooling a sentence-transformers Pooling config.json selects (pooling_mode, or the key set to true)."""
    names = [settings["pooling_mode"]] if isinstance(settings.get("pooling_mode"), str) else [
        key for key, value in settings.items() if value is True and key.startswith("pooling_mode_")]
    for name in names:
        if name in _ST_POOLING_NAMES:
            return _ST_POOLING_NAMES[name]
        raise ValueError(f"{pooling_file}: pooling {name!r} is not supported; supported: lasttoken, mean, cls")
    return None
