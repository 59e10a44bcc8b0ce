"""Chat template rules shared by the router (torch-free rendering) and the offline `LLM.chat`
(transformers' apply_chat_template): how a message's content and its tool calls' arguments become
what a template sees, and which variables a caller's chat_template_kwargs may not set."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal

from splitserve.common.errors import InvalidRequestError, json_excerpt
from splitserve.common.log_escape import quote_for_log

if TYPE_CHECKING:
    import jinja2.nodes

ContentFormat = Literal["string", "openai"]
"""How a message's content reaches the template (vLLM's chat_template_content_format once resolved):
"string" (text parts joined with newlines) or "openai" (a list of {"type": "text", "text": ...} parts)."""

CONTENT_FORMAT_OPTIONS = ("auto", "string", "openai")
"""vLLM's --chat-template-content-format values; "auto" detects the format from the template."""

TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
"""Variables every chat template is rendered with from the caller's own arguments (transformers'
render_jinja_template), never from chat_template_kwargs."""

TEXT_PART_KEYS = {"text": "text", "refusal": "refusal", "thinking": "thinking"}
"""Content part types read as text, and the key holding it, as vLLM reads them: an assistant message's
`refusal` part (what the openai SDK sends back for a refused answer) and a `thinking` part (what gateways
translating Anthropic messages send) are their text."""


def content_parts(value: Any, field: str) -> tuple[str, ...]:
    """The texts of a message's content as vLLM reads them: a string is one part, null none, a list
    of text parts (a plain string, as LangChain sends a list content; OpenAI's {"type": "text", "text": ...};
    "refusal" or "thinking") each part's text.
    InvalidRequestError naming `field` (or the part) for anything else: models here are text-only."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list):
        return tuple(_part_text(part, f"{field}[{index}]") for index, part in enumerate(value))
    raise InvalidRequestError(field, f"must be a string or a list of text parts, got {value!r}")


def _part_text(part: Any, field: str) -> str:
    """One content part's text (content_parts)."""
    if isinstance(part, str):
        return part
    kind = part.get("type") if isinstance(part, dict) else None
    key = TEXT_PART_KEYS.get(kind) if isinstance(kind, str) else None  # a JSON list or object: unhashable
    if key is None or not isinstance(part.get(key), str):
        raise InvalidRequestError(field, 'only text content parts are supported (a string, {"type": "text", '
                                         f'"text": ...}}, "refusal" or "thinking"), got {part!r}')
    return part[key]


def joined_text(texts: tuple[str, ...]) -> str:
    """A message's content (its parts' texts, content_parts) as a "string" template sees it: joined with
    newlines, empty texts left out as vLLM leaves them (["a", "", "b"] is "a\\nb")."""
    return "\n".join(text for text in texts if text)


def template_content(texts: tuple[str, ...], content_format: ContentFormat) -> str | list[dict[str, str]]:
    """A message's content (its parts' texts) as the template sees it in `content_format`: vLLM hands an
    "openai" template every content as a list of text parts, a plain string included."""
    if content_format == "openai":
        return [{"type": "text", "text": text} for text in texts]
    return joined_text(texts)


def content_format_of(tree: jinja2.nodes.Template) -> ContentFormat:
    """vLLM's "auto" content format: "openai" when the template loops over a message's content
    (`{% for part in message['content'] %}`, as Gemma 3's, Llama 4's and Mistral 3's do), else "string".
    Read from the template's syntax tree, following (as vLLM does) the names `messages` and its
    messages are assigned to. `tree`: the template as the caller's jinja2 environment parsed it (the router's
    and transformers' environments know different extension tags); read by node type name, so common/ needs
    no jinja2 at run time."""
    message_names = set(_loop_targets(tree, _aliases(tree, "messages"), None))
    return "string" if next(_loop_targets(tree, message_names, "content"), None) is None else "openai"


def resolve_content_format(option: str, template: jinja2.nodes.Template | None) -> ContentFormat:
    """The content format of --chat-template-content-format / chat_template_content_format `option`:
    "string" or "openai" as given, "auto" detected from `template`, a parsed template (content_format_of;
    "string" without one, or for a template that does not parse: rendering it reports why). ValueError for
    another option."""
    if option not in CONTENT_FORMAT_OPTIONS:
        raise ValueError(f"chat template content format must be one of {', '.join(CONTENT_FORMAT_OPTIONS)}, "
                         f"got {option!r}")
    if option != "auto":
        return option  # type: ignore[return-value]  # checked above
    return "string" if template is None else content_format_of(template)


def _aliases(tree: jinja2.nodes.Template, name: str) -> set[str]:
    """`name` and every variable assigned from it (or from a slice or filter of it), transitively."""
    names, pending = {name}, [name]
    while pending:
        source = pending.pop()
        for assign in _nodes(tree, "Assign"):
            if _is(assign.target, "Name") and _reads(assign.node, source, None) \
                    and assign.target.name not in names:
                names.add(assign.target.name)
                pending.append(assign.target.name)
    return names


def _loop_targets(tree: jinja2.nodes.Template, names: set[str], key: str | None) -> Iterator[str]:
    """The loop variables of `for` loops over one of `names` (over `name[key]` / `name.key` when key is given)."""
    for loop in _nodes(tree, "For"):
        if _is(loop.target, "Name") and any(_reads(loop.iter, name, key) for name in names):
            yield loop.target.name


def _reads(node: jinja2.nodes.Node, name: str, key: str | None) -> bool:
    """Whether `node` is variable `name` (its item or attribute `key` when given), through filters,
    tests and slices (`messages[1:]`, `message['content'] | list`)."""
    if _is(node, "Filter", "Test"):
        return node.node is not None and _reads(node.node, name, key)
    if _is(node, "Getitem") and _is(node.arg, "Slice"):
        return _reads(node.node, name, key)
    if key is None:
        return _is(node, "Name") and node.ctx == "load" and node.name == name
    if _is(node, "Getitem"):
        return _is(node.arg, "Const") and node.arg.value == key and _reads(node.node, name, None)
    return _is(node, "Getattr") and node.attr == key and _reads(node.node, name, None)


def _is(node: jinja2.nodes.Node, *kinds: str) -> bool:
    """Whether `node` is one of jinja2.nodes' `kinds` (by class name: jinja2 is not imported here)."""
    return type(node).__name__ in kinds


def _nodes(tree: jinja2.nodes.Node, kind: str) -> Iterator[jinja2.nodes.Node]:
    """Every node of type name `kind` under `tree`, depth first (jinja2's find_all, by name)."""
    for child in tree.iter_child_nodes():
        if _is(child, kind):
            yield child
        yield from _nodes(child, kind)


def check_template_kwargs(template_kwargs: Mapping[str, Any], reserved: Mapping[str, str]) -> None:
    """InvalidRequestError `chat_template_kwargs.<key>` for the first key (in sorted order) that
    `reserved` holds, with `reserved[key]` (why it cannot be set there) as the message."""
    taken = sorted(reserved.keys() & template_kwargs.keys())
    if taken:
        raise InvalidRequestError(f"chat_template_kwargs.{taken[0]}", reserved[taken[0]])


def parse_call_arguments(value: Any, field: str) -> Any:
    """A call's arguments: JSON text parsed (vLLM's rule: null or "" is {}; an object already parsed
    is taken as it is); InvalidRequestError naming `field`.arguments otherwise."""
    if not value:
        return {}
    if isinstance(value, (dict, list)):
        return value
    if not isinstance(value, str):
        raise InvalidRequestError(f"{field}.arguments", f"must be a JSON string, got {json_excerpt(value)}")
    try:
        return json.loads(value)
    except (ValueError, RecursionError) as error:  # RecursionError: nested deeper than the decoder goes
        raise InvalidRequestError(f"{field}.arguments", f"is not valid JSON: {error}") from None


CHAT_ROLES = ("system", "user", "assistant", "tool", "developer", "function")
"""The roles OpenAI's chat API defines: every template is sent them (it may still refuse one itself)."""

QUOTED_ROLE_CHARS = 64
"""How much of a refused role its error message quotes."""
_QUOTED_NAME = re.compile(r"""(?=(["'])([A-Za-z_][A-Za-z0-9_-]{0,63})\1)""")
"""A name between two like quotes, looked for at every position (a lookahead), so a quote closing one string
and opening the next (`'a'developer'`) finds both, as a plain substring test does."""


def quoted_names(template_source: str) -> frozenset[str]:
    """The names a chat template's source quotes (`message['role'] == 'ipython'`): the roles of its own
    it knows by name beyond CHAT_ROLES (Llama 3.1's `ipython`, GLM's `observation`), found as vLLM
    finds the `developer` role (its name quoted anywhere in the source). Other quoted names come along; as roles
    they are harmless, while a role with markup in it (`user<|im_end|>...`) can never be one."""
    return frozenset(match.group(2) for match in _QUOTED_NAME.finditer(template_source))


def check_roles(roles: Iterable[str], template_names: frozenset[str]) -> None:
    """Every message's role is one of CHAT_ROLES or a name the template quotes (quoted_names), so a
    template that prints roles verbatim never renders a client's made-up role or markup smuggled in
    as one; InvalidRequestError `messages[i].role` otherwise."""
    for index, role in enumerate(roles):
        if role not in CHAT_ROLES and role not in template_names:
            raise InvalidRequestError(f"messages[{index}].role",
                                      f"must be one of {', '.join(CHAT_ROLES)}, or a role the chat template names "
                                      f"(quoted in its source, as Llama 3.1's names 'ipython'); got "
                                      f"{quote_for_log(role, QUOTED_ROLE_CHARS)}")


def developer_as_system(messages: list[dict[str, Any]], content_format: ContentFormat) -> list[dict[str, Any]]:
    """The messages as vLLM hands them to a template that does not know the `developer` role (OpenAI's
    newer name for system instructions): each developer message becomes a system message, and when
    that leaves a system message after the first message or several of them, they are merged into one
    system message first, their non-empty contents joined with blank lines (a list of parts' texts
    joined with newlines first; the merged message keeps only role and content). Messages without a
    developer role are returned as they are."""
    if not any(message["role"] == "developer" for message in messages):
        return messages
    converted = [{**message, "role": "system"} if message["role"] == "developer" else message
                 for message in messages]
    systems = [i for i, message in enumerate(converted) if message["role"] == "system"]
    if systems in ([], [0]):
        return converted
    texts = [_content_text(converted[i]["content"]) for i in systems]
    merged = "\n\n".join(text for text in texts if text)
    content = [{"type": "text", "text": merged}] if content_format == "openai" else merged
    return [{"role": "system", "content": content}, *(m for m in converted if m["role"] != "system")]


def _content_text(content: str | list[dict[str, str]]) -> str:
    return content if isinstance(content, str) else "\n".join(part["text"] for part in content)
