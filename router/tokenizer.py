"""The router's tokenizer: Hugging Face model-directory tokenization without torch or transformers.

Reads tokenizer.json (the `tokenizers` fast tokenizer), tokenizer_config.json, the chat template
(all three from --tokenizer's directory when given) and generation_config.json (EOS ids, sampling
defaults) of a model directory, and gives the same
token ids as transformers 5:
`encode(text)` equals `AutoTokenizer.from_pretrained(dir)(text)["input_ids"]` (the tokenizer's own
post-processor adds BOS/EOS where the model wants them), and `apply_chat_template` equals
`apply_chat_template(messages, add_generation_prompt=..., tokenize=True)`: the template is
rendered in the same sandboxed jinja2 environment and the text encoded without added special
tokens (a template writes its own BOS). `import transformers` can pull in torch, so this
module uses only `tokenizers`, `jinja2` and `json`: the router never imports torch.

Encoding goes through `Tokenizer.encode_batch`, which releases the GIL while it works; `encode`
holds it (measured: a 4 MB prompt encoded in a worker thread stopped a 10 ms heartbeat on the
event loop for 4.4 s with `encode`, and never for more than 0.4 s with `encode_batch`), so a
long prompt encoded in a thread no longer stalls the router's event loop.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from splitserve.common.chat_template import (TEMPLATE_VARIABLES, ContentFormat, check_roles, check_template_kwargs,
                                             content_parts, developer_as_system, quoted_names,
                                             resolve_content_format, template_content)
from splitserve.common.errors import InvalidRequestError, UnsupportedModelError
from splitserve.common.generation_config import MODEL_CONFIG_FILE, GenerationConfigFile
from splitserve.common.model_dir import (TOKENIZER_FILE, check_tokenizer_files, check_tokenizer_option,
                                       check_tokenizer_vocabulary, tokenizer_dir, tokenizer_option_label)

CHAT_TEMPLATE_FILE = "chat_template.jinja"
"""transformers 5 saves a single chat template here; it takes priority over tokenizer_config.json."""


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore-prefixed attributes (no path to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's Namespace signature, allows self=...
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` without exposing the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Unlike jinja's own filter, no HTML escaping (what transformers does).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markup in some templates) renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


def _template_environment() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in (sandboxed, immutable)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_TemplateNamespace)
    return env


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers renders it in."""
    return _template_environment().from_string(source)


@dataclass(frozen=True)
class CompiledChatTemplate:
    """A chat template ready to render, and how message content reaches it."""

    template: jinja2.Template
    content_format: ContentFormat
    """The content format its messages are rendered with: the --chat-template-content-format given,
    or `detected_format` for "auto"."""
    detected_format: ContentFormat
    """The format "auto" detects from the template (common.chat_template.content_format_of)."""
    named_roles: frozenset[str]
    """The names its source quotes: the roles beyond CHAT_ROLES it is sent (common.chat_template.check_roles)."""

    @property
    def knows_developer_role(self) -> bool:
        """False: developer messages reach it as system messages (common.chat_template.developer_as_system);
        vLLM's test, the role's name quoted anywhere in the template's source (quoted_names)."""
        return "developer" in self.named_roles


def prepare_chat_template(source: str, content_format_option: str) -> CompiledChatTemplate:
    """`source` compiled in the environment transformers renders it in, with the content format
    `content_format_option` (auto, string or openai) gives it. jinja2.TemplateSyntaxError when it
    does not compile; ValueError for another option."""
    env = _template_environment()
    tree = env.parse(source)
    # Read before compiling it: jinja's optimizer rewrites the tree it compiles.
    detected = resolve_content_format("auto", tree)
    chosen = detected if content_format_option == "auto" else resolve_content_format(content_format_option, tree)
    return CompiledChatTemplate(env.from_string(tree), chosen, detected, quoted_names(source))


REQUEST_TEMPLATE_CACHE_SIZE = 32
"""Request chat templates kept compiled (the least recently used dropped first), as many as vLLM
keeps the content formats of: a client that sends one template with every request compiles it once."""
UNTRUSTED_REQUEST_TEMPLATE = ("this server does not trust request chat templates (start it with "
                              "--trust-request-chat-template to render a request's own template)")
"""Why a request's chat_template is refused by a server that does not trust them (vLLM's default)."""


class RequestTemplateCache:
    """Chat templates that requests bring (vLLM's per-request chat_template), compiled on first use:
    a bounded LRU keyed by the template text, safe to share across the tokenizer pool's threads."""

    def __init__(self, content_format_option: str, max_size: int = REQUEST_TEMPLATE_CACHE_SIZE) -> None:
        resolve_content_format(content_format_option, None)  # ValueError for an unknown option, at start-up
        self._content_format_option = content_format_option
        self._max_size = max_size
        self._compiled: OrderedDict[str, CompiledChatTemplate] = OrderedDict()
        """Least recently used first; guarded by _lock."""
        self._lock = threading.Lock()

    def __contains__(self, source: str) -> bool:
        with self._lock:
            return source in self._compiled

    def __len__(self) -> int:
        with self._lock:
            return len(self._compiled)

    def get(self, source: str) -> CompiledChatTemplate:
        """`source` compiled (from the cache when it holds it); InvalidRequestError `chat_template`
        with jinja's message when it does not compile. Two threads that miss on one template both
        compile it (the lock is not held while compiling, which takes milliseconds); one copy stays."""
        with self._lock:
            compiled = self._compiled.get(source)
            if compiled is not None:
                self._compiled.move_to_end(source)
                return compiled
        compiled = _prepare_request_template(source, self._content_format_option)
        with self._lock:
            self._compiled[source] = compiled
            self._compiled.move_to_end(source)
            while len(self._compiled) > self._max_size:
                self._compiled.popitem(last=False)
        return compiled


def _prepare_request_template(source: str, content_format_option: str) -> CompiledChatTemplate:
    try:
        return prepare_chat_template(source, content_format_option)
    except jinja2.TemplateSyntaxError as error:  # TemplateAssertionError too: an unknown filter or test
        raise InvalidRequestError("chat_template", f"does not compile: {error} (line {error.lineno})") from None
    except RecursionError:  # jinja's parser recurses once per nesting level
        raise InvalidRequestError("chat_template", "does not compile: nested too deeply") from None


def _render_error(error: Exception) -> str:
    """What a template failing to render says: jinja's message, or the Python error's type and message."""
    return str(error) if isinstance(error, jinja2.TemplateError) else f"{type(error).__name__}: {error}"


def read_chat_template_option(value: str) -> str:
    """The template text of a --chat-template value (vLLM's meaning): the path of a file holding
    it, or the template itself, told apart by its jinja markup. ValueError for a value that is
    neither (most likely a mistyped path)."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"chat template file {value!r} is not readable: {error}") from None
    if any(markup in value for markup in ("{{", "{%", "\n")):
        return value
    raise ValueError(f"chat template {value!r}: no such file, and not a template either (no {{{{ }}}} or "
                     "{% %} markup)")


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_content(value: object) -> str | None:
    """A special token as saved: a string, or a serialized AddedToken ({"content": ...})."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _named_special_tokens(config: Mapping[str, Any], legacy_map: Mapping[str, Any]) -> dict[str, str]:
    """Every named special token (`bos_token`, ..., model-specific `*_token`s) as transformers 5 reads it.

    special_tokens_map.json (legacy) is only read, and overrides, when tokenizer_config.json has
    no `added_tokens_decoder` (the transformers rule).
    """
    merged = dict(config) if "added_tokens_decoder" in config else {**config, **legacy_map}
    tokens = {key: value for key, value in merged.items() if key.endswith("_token")}
    if isinstance(merged.get("extra_special_tokens"), Mapping):  # a list there holds unnamed tokens
        tokens.update(merged["extra_special_tokens"])
    contents = {key: _token_content(value) for key, value in tokens.items()}
    return {key: content for key, content in contents.items() if content is not None}


def _read_chat_template(model_dir: Path, config: Mapping[str, Any]) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's `chat_template` (a string, or named templates' "default")."""
    path = model_dir / CHAT_TEMPLATE_FILE
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        template = {entry["name"]: entry["template"] for entry in template}.get("default")
    return template


def check_unicode(text: str, field: str) -> None:
    """InvalidRequestError unless `text` is valid Unicode: a JSON body can carry a lone surrogate
    ("\\ud800"), which has no UTF-8 form and which the tokenizer refuses with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidRequestError(field, f"is not valid Unicode (lone surrogate {text[error.start]!r} at index "
                                         f"{error.start})") from None


def _check_rendered_unicode(text: str, tools: Sequence[Mapping[str, Any]] | None) -> None:
    """InvalidRequestError unless the rendered chat is valid Unicode: contents are checked by name
    (_validate_messages), but a template also writes tools, tool calls, ids and names, where a lone
    surrogate would reach the tokenizer (a TypeError). Blamed on `tools` when it is there."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        surrogate = text[error.start]
        if tools is not None and surrogate in json.dumps(tools, ensure_ascii=False):
            raise InvalidRequestError("tools", f"is not valid Unicode (lone surrogate {surrogate!r})") from None
        raise InvalidRequestError("messages", f"the chat as rendered is not valid Unicode (lone surrogate "
                                              f"{surrogate!r})") from None


TEMPLATE_MESSAGE_KEYS = ("tool_calls", "tool_call_id", "name", "reasoning", "reasoning_content", "thinking")
"""Message keys a template also sees when set, passed as the OpenAI front parsed them (ChatMessage.template_message):
an assistant's calls (router/tool_calling.py), a tool result's call id and name, an assistant's earlier reasoning
under the names templates read it by."""


def _validate_messages(messages: object, content_format: ContentFormat) -> list[dict[str, Any]]:
    """{"role", "content"} dicts, with TEMPLATE_MESSAGE_KEYS where set (the only keys a template sees), the
    content (a string or a list of text parts) in `content_format`; raises InvalidRequestError."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError("messages", "must be a non-empty list of {role, content} messages")
    plain = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"messages[{index}]", f"must be a {{role, content}} object, got {message!r}")
        if not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"messages[{index}].role", "missing or not a string")
        check_unicode(message["role"], f"messages[{index}].role")
        if not isinstance(message.get("content"), (str, list)):
            raise InvalidRequestError(f"messages[{index}].content", "missing, or not a string or a list of text parts")
        texts = content_parts(message["content"], f"messages[{index}].content")
        for text in texts:
            check_unicode(text, f"messages[{index}].content")
        plain.append({"role": message["role"], "content": template_content(texts, content_format),
                      **{key: message[key] for key in TEMPLATE_MESSAGE_KEYS if message.get(key) is not None}})
    return plain


_RESERVED_TEMPLATE_VARIABLES = {
    **dict.fromkeys(TEMPLATE_VARIABLES, "is set by the request's own fields"),
    # vLLM refuses these two in chat_template_kwargs, and reads continue_final_message there as the
    # option: as a mere template variable each would be ignored without a word.
    "chat_template": "is not a template variable (send a request's own template as its chat_template field)",
    "tokenize": "is not a template variable (vLLM refuses it here too)",
    "continue_final_message": "is set by the request's own field continue_final_message",
}
"""Template variables a request's chat_template_kwargs may not set, each with why."""


@dataclass(frozen=True)
class ChatTemplateOptions:
    """How a chat request wants its template rendered, beyond add_generation_prompt (vLLM's
    chat request extensions)."""

    continue_final_message: bool = False
    """Leave the last message open (no end-of-turn after it): the model continues it."""
    documents: tuple[Mapping[str, str], ...] | None = None
    """Retrieved documents for templates that render them (the `documents` variable)."""
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """More template variables (e.g. enable_thinking); never one of common's TEMPLATE_VARIABLES."""
    add_special_tokens: bool = False
    """Also add the tokenizer's own special tokens (a BOS) to the rendered text."""
    tools: tuple[Mapping[str, Any], ...] | None = None
    """The request's tools as the client sent them ({"type": "function", "function": {...}}), the
    `tools` variable (the Hugging Face convention); None: the template gets none."""
    chat_template: str | None = None
    """The request's own template text (vLLM's chat_template), rendered in place of the server's when
    the server trusts request templates (else a 400); None: the server's template."""

    def __post_init__(self) -> None:
        check_template_kwargs(self.template_kwargs, _RESERVED_TEMPLATE_VARIABLES)


DEFAULT_CHAT_OPTIONS = ChatTemplateOptions()


CONTINUE_FINAL_MESSAGE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
"""transformers' mark for continue_final_message: appended to the final message's content before
rendering, so the cut lands right after that content even where the content also appears in what
the template closes the turn with ("end" in "<|im_end|>") or earlier in the chat."""


def _marked_final_message(plain: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with CONTINUE_FINAL_MESSAGE_TAG after the final message's content (a copy): after
    its last text part when the content is a list of parts, as transformers marks it."""
    content = plain[-1]["content"]
    if isinstance(content, str):
        return [*plain[:-1], {**plain[-1], "content": content + CONTINUE_FINAL_MESSAGE_TAG}]
    if not content:
        raise InvalidRequestError("continue_final_message", "the final message has no text to continue")
    last = {**content[-1], "text": content[-1]["text"] + CONTINUE_FINAL_MESSAGE_TAG}
    return [*plain[:-1], {**plain[-1], "content": [*content[:-1], last]}]


def _final_text(plain: list[dict[str, Any]]) -> str:
    """The text the model continues: the final message's content, or its last text part."""
    content = plain[-1]["content"]
    return content if isinstance(content, str) else content[-1]["text"]


def _open_final_message(text: str, final_content: str) -> str:
    """`text` (rendered from _marked_final_message) cut right after the last message's content,
    dropping what the template closes the turn with: transformers' continue_final_message, including
    its handling of a template that strips the content's trailing whitespace (and so the mark's)."""
    mark = CONTINUE_FINAL_MESSAGE_TAG.strip()
    if final_content.strip() not in text or mark not in text:
        raise InvalidRequestError("continue_final_message", "the final message's content does not appear in "
                                                            "the rendered chat")
    at = text.rindex(mark)
    return text[:at] if text.startswith(CONTINUE_FINAL_MESSAGE_TAG, at) else text[:at].rstrip()


NORMALIZER_SHRINK = 3
"""How many times shorter (in UTF-8 bytes) a normalizer can make text: NFC/NFKC compose up to three
code points into one (Hangul jamo L+V+T, 9 bytes, into one 3-byte syllable), Lowercase maps the
3-byte Kelvin sign to "k". (Strip, or a Replace with "", can delete any amount: not bounded.)"""


def max_bytes_per_token(backend: Tokenizer) -> int:
    """The most prompt bytes one token can stand for: the longest vocabulary entry in UTF-8, added
    tokens included, times NORMALIZER_SHRINK when the tokenizer normalizes.

    An entry is at least as long in UTF-8 as the text it covers: byte-level BPE spells each byte
    with one character of 1-2 UTF-8 bytes, SentencePiece writes a space as "▁" (3 bytes) and a
    byte as "<0xNN>" (6), WordPiece prefixes "##"; an added token covers exactly its content."""
    longest = max(len(entry.encode("utf-8")) for entry in backend.get_vocab(with_added_tokens=True))
    return longest * (NORMALIZER_SHRINK if backend.normalizer is not None else 1)


def _byte_level_alphabet() -> dict[str, int]:
    """The byte each character of a byte-level vocabulary stands for (GPT-2's alphabet, which
    `tokenizers`' ByteLevel uses): printable Latin-1 bytes as themselves, the other bytes as the
    characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(0x100 + i): b for i, b in enumerate(others)}}


_BYTE_LEVEL_ALPHABET = _byte_level_alphabet()
_BYTE_FALLBACK_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
"""SentencePiece's byte-fallback piece: one byte of a character the vocabulary does not hold."""
_LAYOUT_ONLY_DECODERS = frozenset({"Fuse", "Strip"})
"""Decoder steps that only join pieces or trim the whole text's ends: no piece's bytes change."""


class TokenBytes:
    """Each token's bytes in the output text: what OpenAI's logprobs report as `bytes`, so that a
    client can put back a character split across tokens (a token that holds part of a multi-byte
    UTF-8 character decodes alone to U+FFFD, whose bytes say nothing).

    Read from the vocabulary entry with the decoder's own rules: byte-level BPE (GPT-2's alphabet),
    SentencePiece (a `Replace` of "▁" by a space, byte-fallback pieces `<0xNN>`, a `Metaspace`).
    An added token is its content. A tokenizer with another decoder (WordPiece, CTC, ...) gets the
    UTF-8 of the token decoded alone."""

    def __init__(self, backend: Tokenizer) -> None:
        self._backend = backend
        self._added = {token_id: token.content.encode() for token_id, token
                       in backend.get_added_tokens_decoder().items()}
        decoder = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else {}
        steps = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
        rules = [_piece_rule(step) for step in steps if step.get("type") not in _LAYOUT_ONLY_DECODERS]
        self._rules = None if None in rules else rules
        """The decoder's steps as read on one piece, in order; None: a step not known here."""

    def __call__(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id]
        piece = self._backend.id_to_token(token_id)
        if piece is None or self._rules is None:
            return self._backend.decode([token_id], skip_special_tokens=False).encode()
        for rule in self._rules:
            piece = rule(piece)
            if isinstance(piece, bytes):
                return piece
        return piece.encode()


def _piece_rule(step: Mapping[str, Any]) -> Callable[[str], str | bytes] | None:
    """What one decoder step does to a lone vocabulary piece: text for the next step, or its final
    bytes; None for a step this reading does not know. (Module functions and partials: picklable.)"""
    kind = step.get("type")
    if kind == "ByteLevel":
        return _byte_level_piece
    if kind == "ByteFallback":
        return _byte_fallback_piece
    if kind == "Replace" and isinstance(step.get("pattern", {}).get("String"), str):
        return functools.partial(_replaced, step["pattern"]["String"], step["content"])
    if kind == "Metaspace":
        return functools.partial(_replaced, step.get("replacement", "\u2581"), " ")
    return None


def _byte_level_piece(piece: str) -> str | bytes:
    if all(c in _BYTE_LEVEL_ALPHABET for c in piece):
        return bytes(_BYTE_LEVEL_ALPHABET[c] for c in piece)
    return piece


def _byte_fallback_piece(piece: str) -> str | bytes:
    match = _BYTE_FALLBACK_PIECE.fullmatch(piece)
    return bytes([int(match[1], 16)]) if match else piece


def _replaced(old: str, new: str, piece: str) -> str:
    return piece.replace(old, new)


class RouterTokenizer:
    """One model directory's tokenizer and chat template; immutable and safe to share across requests."""

    def __init__(self, backend: Tokenizer, special_tokens: Mapping[str, str], chat_template: str | None,
                 generation_config: GenerationConfigFile, name: str, content_format: str = "auto",
                 trust_request_chat_template: bool = False) -> None:
        self.backend = backend
        """The `tokenizers.Tokenizer`; satisfies common.detokenizer.Decoder (incremental detokenization)."""
        self.special_tokens = dict(special_tokens)
        """Named special tokens (`eos_token`, ...) by name; also chat template variables."""
        self.generation_config = generation_config
        """The model directory's generation_config.json, read once: its EOS ids, and the request
        defaults --generation-config auto takes from it (common/generation_config.py)."""
        self.eos_token_ids = generation_config.eos_token_ids
        """Ids that end generation (generation_config.json, else config.json)."""
        self.name = name
        """The model directory, for error messages and /v1/models' `root`."""
        self.max_bytes_per_token = max_bytes_per_token(backend)
        """The most prompt bytes one token can stand for: a prompt of more than n times this many
        bytes has more than n tokens (router/request_limits.py)."""
        self._chat_template = None if chat_template is None else prepare_chat_template(chat_template, content_format)
        self.content_format = resolve_content_format(content_format, None) if self._chat_template is None \
            else self._chat_template.content_format
        """How message content reaches the template: the --chat-template-content-format given, or the
        one "auto" detects from the template (common.chat_template.content_format_of)."""
        self.detected_content_format = None if self._chat_template is None else self._chat_template.detected_format
        """The content format "auto" detects from the server's template (None without one), logged at start-up."""
        self.trust_request_chat_template = trust_request_chat_template
        """Render a request's own chat_template (vLLM's --trust-request-chat-template); off: refuse it (400)."""
        self._request_templates = RequestTemplateCache(content_format)
        self.token_bytes = TokenBytes(backend)
        """Each token's bytes in the output (OpenAI's logprobs `bytes`)."""

    @classmethod
    def from_model_dir(cls, path: str | Path, chat_template: str | None = None, content_format: str = "auto",
                       trust_request_chat_template: bool = False,
                       tokenizer: str | Path | None = None) -> RouterTokenizer:
        """Load a Hugging Face model directory; `chat_template` (its text) replaces the model's own;
        `content_format` is --chat-template-content-format; `trust_request_chat_template` lets requests
        bring their own template (--trust-request-chat-template); `tokenizer` (vLLM's --tokenizer) is the
        directory the tokenizer files and the chat template are read from instead of the model's, whose
        generation_config.json (EOS ids, sampling defaults) is still read, as vLLM reads it.
        UnsupportedModelError without tokenizer.json, with an unreadable one, a tokenizer with more ids
        than the model's vocab_size, or with a bad template; about a `tokenizer` directory, it names
        --tokenizer."""
        model_dir = Path(path).expanduser()
        if tokenizer is not None:
            check_tokenizer_option(tokenizer)
        files = tokenizer_dir(model_dir, tokenizer)
        check_tokenizer_files(files)
        config = _read_json(files / "tokenizer_config.json")
        try:
            backend = Tokenizer.from_file(str(files / TOKENIZER_FILE))
        except Exception as error:  # tokenizers raises plain Exception for a malformed file
            label = "" if tokenizer is None else f"{tokenizer_option_label(tokenizer)}: "
            raise UnsupportedModelError(f"{label}{files / TOKENIZER_FILE}: not a tokenizer file: {error}") from None
        if tokenizer is not None and (model_dir / MODEL_CONFIG_FILE).is_file():
            check_tokenizer_vocabulary(backend.get_vocab_size(with_added_tokens=True), files, model_dir)
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        special_tokens = _named_special_tokens(config, _read_json(files / "special_tokens_map.json"))
        template = chat_template if chat_template is not None else _read_chat_template(files, config)
        try:
            return cls(backend, special_tokens, template, GenerationConfigFile.read(model_dir), str(model_dir),
                       content_format, trust_request_chat_template)
        except jinja2.TemplateSyntaxError as error:
            source = "the chat template given" if chat_template is not None else f"{files}: the chat template"
            raise UnsupportedModelError(f"{source} does not compile: {error} (line {error.lineno})") from error

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included (`len(AutoTokenizer)`); may be below the model's."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        """Whether the server has a chat template (without one, only a chat that brings its own can
        be rendered, on a server that trusts request templates; others are rejected as invalid)."""
        return self._chat_template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text, with the tokenizer's own special tokens (e.g. a BOS) added unless told
        not to; InvalidRequestError (field `prompt`) for text that is not valid Unicode."""
        check_unicode(text, "prompt")
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def render_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                             options: ChatTemplateOptions = DEFAULT_CHAT_OPTIONS) -> str:
        """The chat as prompt text, rendered by the request's own template (options.chat_template) or
        the server's; InvalidRequestError for bad messages, no template, a request template the server
        does not trust or that does not compile, or a template's refusal."""
        template = self._template_of(options)
        plain = _validate_messages(messages, template.content_format)
        check_roles((message["role"] for message in plain), template.named_roles)
        if not template.knows_developer_role:
            plain = developer_as_system(plain, template.content_format)
        variables = {**self.special_tokens, **options.template_kwargs}
        rendered = _marked_final_message(plain) if options.continue_final_message else plain
        try:
            tools = None if options.tools is None else list(options.tools)
            text = template.template.render(messages=rendered, tools=tools, documents=options.documents,
                                            add_generation_prompt=add_generation_prompt, **variables)
        except Exception as error:
            # A template refusing the chat (raise_exception(...), a sandbox refusal) or failing on it (a
            # client's chat_template_kwargs replacing what it calls or concatenates: its namespace(),
            # raise_exception, bos_token; a request's own template dividing by zero): a bad request, as
            # vLLM answers any error of a template (400), never a 500.
            field = "messages" if options.chat_template is None else "chat_template"
            raise InvalidRequestError(field, f"rejected by the chat template: {_render_error(error)}") from error
        _check_rendered_unicode(text, options.tools)
        return _open_final_message(text, _final_text(plain)) if options.continue_final_message else text

    def compiles_template(self, options: ChatTemplateOptions) -> bool:
        """Whether rendering with `options` first compiles the request's own template (milliseconds of
        jinja work, for the tokenizer pool's threads): a trusted request template not compiled yet."""
        return (options.chat_template is not None and self.trust_request_chat_template
                and options.chat_template not in self._request_templates)

    def _template_of(self, options: ChatTemplateOptions) -> CompiledChatTemplate:
        if options.chat_template is not None:
            if not self.trust_request_chat_template:
                raise InvalidRequestError("chat_template", UNTRUSTED_REQUEST_TEMPLATE)
            return self._request_templates.get(options.chat_template)
        if self._chat_template is None:
            raise InvalidRequestError("messages", f"model {self.name} has no chat template; "
                                                  "send a text prompt or token ids instead")
        return self._chat_template

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            options: ChatTemplateOptions = DEFAULT_CHAT_OPTIONS) -> list[int]:
        """Token ids of the rendered chat; the template writes every special token (none are
        added unless options.add_special_tokens)."""
        text = self.render_chat_template(messages, add_generation_prompt, options)
        return self.encode(text, add_special_tokens=True) if options.add_special_tokens else self.encode_rendered(text)

    def encode_pair(self, text: str, text_pair: str) -> list[int]:
        """Token ids of a text pair with the tokenizer's special tokens, as transformers' tokenizer(text=...,
        text_pair=...) encodes them (a cross-encoder's prompt: vLLM's score prompt for a classification model)."""
        check_unicode(text, "text_1")
        check_unicode(text_pair, "text_2")
        return self.backend.encode_batch([(text, text_pair)], add_special_tokens=True)[0].ids

    @property
    def pad_token_id(self) -> int | None:
        """The id of the tokenizer's `pad_token`, None without one (transformers' pad_token_id)."""
        pad = self.special_tokens.get("pad_token")
        return None if pad is None else self.backend.token_to_id(pad)

    def encode_rendered(self, text: str) -> list[int]:
        """Token ids of a rendered chat (render_chat_template's text): no special tokens added."""
        return self.backend.encode_batch([text], add_special_tokens=False)[0].ids

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each id's vocabulary entry (`convert_ids_to_tokens`: "Ġthe", not " the")."""
        return [self.backend.id_to_token(token_id) or "" for token_id in ids]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ids (no clean_up_tokenization_spaces: transformers 5's default, and what streaming emits)."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
