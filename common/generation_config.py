"""A model's generation_config.json, read once (router/tokenizer.py reads the model directory's):
the EOS ids generation stops on, and the default sampling values vLLM takes from it; and the
defaults requests get, resolved from it and a GenerationConfig (vLLM's get_diff_sampling_param).

vLLM's rules, kept here: `auto` reads the model directory's file (config.json's generation fields
when it has none, as transformers' GenerationConfig.from_model_config does for a legacy model),
`vllm` reads none, a folder reads that folder's; the overrides win over the file; null values
and do_sample are ignored; max_new_tokens is the default max_tokens, and also a limit on every
request's when the overrides or a folder set it. Unlike vLLM, a value SamplingParams would refuse
(temperature -1, top_p 2) stops the server at start naming the file and the field, where vLLM
starts and then refuses every request that leaves the field unset; and a folder without the file
is refused, where vLLM silently uses no defaults.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitserve.common.config import GenerationConfig, SamplingDefaults
from splitserve.common.model_dir import read_json_object

GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"
SAMPLING_KEYS = tuple(spec.name for spec in dataclasses.fields(SamplingDefaults))
"""The generation_config.json keys read as request defaults."""
DEFAULTED_SAMPLING_FIELDS = frozenset(SAMPLING_KEYS) - {"max_new_tokens"}
"""The SamplingParams fields the defaults fill (max_new_tokens stands for max_tokens, by other rules)."""


class GenerationConfigError(ValueError):
    """A generation config that cannot serve; the message names the file (or setting) and the field."""


def _read_json(path: Path) -> dict[str, Any]:
    """The file's JSON object; {} when there is no such file."""
    return read_json_object(path, GenerationConfigError) if path.is_file() else {}


def _eos_ids(value: object) -> frozenset[int] | None:
    """An eos_token_id as saved: an int or a list of ints; None when unset."""
    if value is None:
        return None
    return frozenset([value] if isinstance(value, int) else value)


@dataclass(frozen=True)
class GenerationConfigFile:
    """What a model folder's generation_config.json says (else its config.json's generation fields)."""

    path: Path | None
    """The file the sampling values were read from; None when the folder has neither file."""
    eos_token_ids: frozenset[int]
    """Ids that end generation: generation_config.json's eos_token_id, else config.json's."""
    sampling_values: tuple[tuple[str, Any], ...] = ()
    """(key, value) of each SAMPLING_KEYS key the file sets (not null), as written: checked by
    sampling_defaults(), so a bad value only matters where the file's defaults are used."""

    @classmethod
    def read(cls, folder: str | Path) -> GenerationConfigFile:
        folder = Path(folder).expanduser()
        generation_path, model_path = folder / GENERATION_CONFIG_FILE, folder / MODEL_CONFIG_FILE
        generation, model = _read_json(generation_path), _read_json(model_path)
        eos = _eos_ids(generation.get("eos_token_id"))
        eos = _eos_ids(model.get("eos_token_id")) if eos is None else eos
        if generation_path.is_file():
            path, source = generation_path, generation
        else:  # a legacy model's generation fields live in config.json
            path, source = (model_path, model) if model_path.is_file() else (None, {})
        values = tuple((key, source[key]) for key in SAMPLING_KEYS if source.get(key) is not None)
        return cls(path, eos or frozenset(), values)

    def sampling_defaults(self, overrides: SamplingDefaults = SamplingDefaults()) -> SamplingDefaults:
        """The file's values as defaults, with the fields `overrides` sets replaced (a bad value they
        replace does not matter); GenerationConfigError naming the file and the field."""
        try:
            return SamplingDefaults(**{**dict(self.sampling_values), **overrides.set_fields()})
        except ValueError as error:
            raise GenerationConfigError(f"{self.path}: {error} (fix the file, override the field with "
                                        "--override-generation-config, or ignore the file with "
                                        "--generation-config vllm)") from None


@dataclass(frozen=True)
class RequestDefaults:
    """What a request gets for the sampling fields it leaves unset, resolved once at start (vLLM's
    default_sampling_params): a request's own value, an explicit temperature 0 included, always wins."""

    sampling: SamplingDefaults = SamplingDefaults()
    """The defaults: the file's values with the overrides applied."""
    max_tokens_limit: int | None = None
    """Every request's max_tokens is cut to this (the overrides' max_new_tokens, or a folder's);
    None: no limit beyond the context."""
    origin: str = ""
    """Where the defaults came from, for the start-up log line ("" when there are none)."""

    def sampling_fields(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """SamplingParams fields: the request's `given` ones over the defaults."""
        return {**self.sampling.sampling_fields(), **given}

    def default_max_tokens(self, fallback: int) -> int:
        """A chat or Responses request's max_tokens when it sets none: max_new_tokens, else `fallback`."""
        return fallback if self.sampling.max_new_tokens is None else self.sampling.max_new_tokens

    def limited(self, max_tokens: int) -> int:
        """max_tokens cut to max_tokens_limit."""
        return max_tokens if self.max_tokens_limit is None else min(max_tokens, self.max_tokens_limit)


NO_REQUEST_DEFAULTS = RequestDefaults()
"""SamplingParams' own defaults (--generation-config vllm without overrides)."""


def resolve_request_defaults(config: GenerationConfig, model_file: GenerationConfigFile) -> RequestDefaults:
    """The defaults `config` gives requests, `model_file` being the model directory's file (read
    once, by the router's tokenizer); GenerationConfigError for a file whose values cannot serve."""
    if config.source == "vllm":
        file, sampling = None, config.overrides
    else:
        file = model_file if config.folder is None else _folder_file(config.folder)
        sampling = file.sampling_defaults(config.overrides)
    limit = sampling.max_new_tokens if config.folder is not None else config.overrides.max_new_tokens
    origins = [str(file.path)] if file is not None and file.sampling_values else []
    origins += ["the overrides"] if config.overrides.set_fields() else []
    return RequestDefaults(sampling, limit, " and ".join(origins))


def _folder_file(folder: str) -> GenerationConfigFile:
    """The file of a --generation-config folder, which must hold one."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise GenerationConfigError(f"generation config folder {folder!r} (--generation-config) is not a directory "
                                    "(auto and vllm are the other values)")
    file = GenerationConfigFile.read(path)
    if file.path is None:
        raise GenerationConfigError(f"generation config folder {folder!r} (--generation-config) holds no "
                                    f"{GENERATION_CONFIG_FILE}")
    return file
