"""The tiny models of tests and benches (tests/conftest.py builds them once per test session,
bench/fault_matrix.py into a temporary directory): same builder as `make-tiny-model`."""

from __future__ import annotations

from pathlib import Path

from splitserve.engine.tiny_model import TinyModelSpec, build_tiny_model, default_cache_dir

TINY_SPECS = {
    "llama": TinyModelSpec(arch="llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                           vocab_size=512, seed=0),
    "qwen2": TinyModelSpec(arch="qwen2", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                           vocab_size=512, seed=1),
}

RANDOM_SERVING_SPEC = TinyModelSpec(arch="llama", num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=4,
                                    vocab_size=2048, seed=0)
"""The random-weight model the serving benchmarks measure with (it was `--model default` until a trained model
took that name): their recorded results stay comparable, and its 2048 positions fit their longest prompts."""


def cached_tiny_model(spec: TinyModelSpec) -> Path:
    """The model of `spec`, built on first use into the cache and reused (keyed by its fingerprint)."""
    path = default_cache_dir() / f"bench-{spec.fingerprint()}"
    if not (path / "config.json").is_file():
        build_tiny_model(path, spec)
    return path


TOOLS_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Their signatures are in <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each call, return <tool_call>{\"name\": <name>, \"arguments\": <args>}</tool_call>"
    "<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for call in message.get('tool_calls', []) %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{%- if call['function']['arguments'] is string %}{{- call['function']['arguments'] }}"
    "{%- else %}{{- call['function']['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response id=\"' + message.get('tool_call_id', '') + '\">\\n' + message['content']"
    " + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""A ChatML template that renders tools, an assistant's tool calls (their arguments as a mapping,
as vLLM and transformers pass them) and tool results, in the Hermes / Qwen 2.5 way: for tests of
tool calling, with any of the tiny models (`--chat-template` or RouterTokenizer's `chat_template`).
The tiny models' own template (engine/tiny_model.py's CHAT_TEMPLATE) ignores tools."""


PARTS_CHAT_TEMPLATE = (
    "{%- set loop_messages = messages %}"
    "{%- for message in loop_messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}{{- '[' + part['text'] + ']' }}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""A ChatML template that loops over a message's content parts (through an alias of `messages`, as
Gemma 3's does), writing each part's text in brackets and a string content as it is: vLLM's "auto"
content format reads it as "openai" (content as a list of parts)."""

THINK_TAGS = ("<think>", "</think>")
THINKING_SPEC = TinyModelSpec(arch="qwen2", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                              vocab_size=512, seed=3)
THINKING_CHAT_TEMPLATE = TOOLS_CHAT_TEMPLATE.replace(
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")
"""TOOLS_CHAT_TEMPLATE with Qwen3's switch: enable_thinking false writes an empty think block
into the prompt (the model then answers at once)."""
THINK_END_WEIGHT = 0.5
"""The LM head's row of `</think>`: this times the unit mean direction of the model's last hidden
states over a chat prompt, so that a random model writes `</think>` after a few dozen tokens of most
seeds (and rarely twice): served tests then see reasoning end and content follow."""


def build_thinking_model(out_dir: Path) -> Path:
    """A tiny Qwen-style model whose tokenizer has `<think>` and `</think>` as plain added tokens (as
    Qwen3's and DeepSeek-R1's do), with THINKING_CHAT_TEMPLATE, for reasoning parser tests."""
    import torch

    from splitserve.engine.tiny_model import build_tokenizer, random_model, write_model_dir

    spec = THINKING_SPEC
    tokenizer = build_tokenizer(spec.vocab_size - len(THINK_TAGS), spec.seed, spec.arch)
    tokenizer.add_tokens(list(THINK_TAGS))
    tokenizer.chat_template = THINKING_CHAT_TEMPLATE
    tokenizer.model_max_length = spec.max_position_embeddings
    model = random_model(spec, tokenizer)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Why?"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)["input_ids"]  # [1, P]
    with torch.no_grad():
        hidden = model(prompt, output_hidden_states=True).hidden_states[-1][0]  # [P, hidden_size]
        direction = hidden.mean(0)
        model.lm_head.weight[tokenizer.convert_tokens_to_ids(THINK_TAGS[1])] = \
            THINK_END_WEIGHT * direction / direction.norm()
    return write_model_dir(out_dir, model, tokenizer)


HARMONY_SPECIAL_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>",
                          "<|constrain|>")
HARMONY_WORDS = ("analysis", "final", " to=functions.get_time", "{\"tz\": \"UTC\"}")
"""Plain added tokens: the channel names (`analysis` is one token in GPT-OSS's tokenizer, as the
openai_gptoss parser needs), a recipient and a JSON body, so that a sampled output can spell messages."""
HARMONY_CHAT_TEMPLATE = (
    "{%- set last_call = namespace(name=none) %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and 'tool_calls' in message %}"
    "{%- set later_final = namespace(found=false) %}"
    "{%- for later in messages[loop.index:] %}"
    "{%- if later.role == 'assistant' and 'tool_calls' not in later %}{%- set later_final.found = true %}{%- endif %}"
    "{%- endfor %}"
    "{%- if message.content and message.thinking %}"
    "{{- raise_exception('Cannot pass both content and thinking in an assistant message with tool calls') }}"
    "{%- elif (message.content or message.thinking) and not later_final.found %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + (message.content or message.thinking) + '<|end|>' }}"
    "{%- endif %}"
    "{%- set call = message.tool_calls[0].function %}"
    "{{- '<|start|>assistant to=functions.' + call.name + '<|channel|>commentary json<|message|>' }}"
    "{{- call.arguments | tojson + '<|call|>' }}"
    "{%- set last_call.name = call.name %}"
    "{%- elif message.role == 'assistant' and loop.last and not add_generation_prompt %}"
    "{%- if 'thinking' in message %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}"
    "{%- endif %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|return|>' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start|>functions.' + last_call.name + ' to=assistant<|channel|>commentary<|message|>' }}"
    "{{- message.content | tojson + '<|end|>' }}"
    "{%- else %}"
    "{{- '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)
"""Harmony's shape (GPT-OSS's template ends the prompt with `<|start|>assistant`), without its system and developer
messages, and its rules for earlier turns: an assistant turn's analysis is its `thinking`, rendered before a tool call
(or that turn's content, and a turn with both is refused) unless a final answer follows later, and after a final
answer only when that turn ends a chat without a generation prompt; a tool result is rendered as the last call's."""


def build_harmony_model(out_dir: Path) -> Path:
    """A tiny random model whose tokenizer has GPT-OSS's harmony tokens (special) and HARMONY_WORDS, with
    HARMONY_CHAT_TEMPLATE, for served tests of the openai_gptoss / openai parsers (requests bias the
    harmony tokens so that outputs are made of messages)."""
    from splitserve.engine.tiny_model import build_tokenizer, random_model, write_model_dir

    spec = THINKING_SPEC
    tokenizer = build_tokenizer(spec.vocab_size - len(HARMONY_SPECIAL_TOKENS) - len(HARMONY_WORDS), spec.seed,
                                spec.arch)
    tokenizer.add_special_tokens({"additional_special_tokens": list(HARMONY_SPECIAL_TOKENS)})
    tokenizer.add_tokens(list(HARMONY_WORDS))
    tokenizer.chat_template = HARMONY_CHAT_TEMPLATE
    tokenizer.model_max_length = spec.max_position_embeddings
    return write_model_dir(out_dir, random_model(spec, tokenizer), tokenizer)
