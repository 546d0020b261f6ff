#!/usr/bin/env python
"""Build the tiny models whose chat templates write tool calls the way other families do, from ``assets/models/tiny``.

    python assets/build_tool_families.py     # after build_assets.py (which calls it too)

Tool rollouts choose the response template that reads a policy's calls by recognising the chat template's call
syntax (``modules/agent/response_templates.py``); the tests prove each family on a model of that family. The shipped
tiny model is the Qwen/Hermes ``<tool_call>`` family; this script writes two more, with the shipped byte-level
tokenizer plus the family's special tokens, each chat template written here with the real family's call syntax (not
its prose), and no ``response_template`` in the tokenizer (the recognition has to find one):

* ``tiny-llama3``: Llama architecture, a Llama-3.1-style template (header tokens, ``<|eot_id|>``; a call is the
  assistant turn ``{"name": ..., "parameters": {...}}<|eot_id|>``; results are ``ipython`` turns).
* ``tiny-mistral``: Mistral architecture, a Mistral-v0.3-style template (``[INST] ...[/INST]``,
  ``[AVAILABLE_TOOLS]`` before the last user turn, calls ``[TOOL_CALLS] [{"name", "arguments"}]</s>``, results
  ``[TOOL_RESULTS] {"content": ...}[/TOOL_RESULTS]``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

ASSETS = Path(__file__).resolve().parent
MODELS_DIR = ASSETS / "models"
BASE = MODELS_DIR / "tiny"

LLAMA3_TOOL_TEMPLATE = r"""{{- '<|begin_of_text|>' }}
{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}{%- set messages = messages[1:] %}
{%- else %}{%- set system = '' %}{%- endif %}
{%- if system or tools %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if tools %}{{- 'Environment: ipython\n' }}{%- endif %}
{{- system }}
{%- if tools %}
{{- 'Call a function by answering with JSON {"name": function name, "parameters": {argument: value}}.\n' }}
{%- for tool in tools %}{{- tool | tojson }}{{- '\n' }}{%- endfor %}
{%- endif %}
{{- '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
{%- if message['role'] == 'assistant' and message['tool_calls'] %}
{%- if message['tool_calls'] | length != 1 %}{{- raise_exception('one tool call per turn') }}{%- endif %}
{%- set call = message['tool_calls'][0] %}{%- set call = call['function'] if call['function'] is defined else call %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- generation %}
{{- '{"name": "' + call['name'] + '", "parameters": ' + call['arguments'] | tojson + '}<|eot_id|>' }}
{%- endgeneration %}
{%- elif message['role'] == 'assistant' %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}
{%- elif message['role'] in ('tool', 'ipython') %}
{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message['content'] | string + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"""

MISTRAL_TOOL_TEMPLATE = r"""{{- '<s>' }}
{%- set ns = namespace(last_user=-1, system='') %}
{%- for message in messages %}
{%- if message['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- if message['role'] == 'system' %}{%- set ns.system = message['content'] %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- if message['role'] == 'user' %}
{%- if tools and loop.index0 == ns.last_user %}
{{- '[AVAILABLE_TOOLS] ' + tools | tojson + '[/AVAILABLE_TOOLS]' }}
{%- endif %}
{%- if ns.system and loop.index0 == ns.last_user %}
{{- '[INST] ' + ns.system + '\n\n' + message['content'] + '[/INST]' }}
{%- else %}
{{- '[INST] ' + message['content'] + '[/INST]' }}
{%- endif %}
{%- elif message['role'] == 'assistant' and message['tool_calls'] %}
{%- generation %}
{{- '[TOOL_CALLS] [' }}
{%- for call in message['tool_calls'] %}
{%- set call = call['function'] if call['function'] is defined else call %}
{{- {'name': call['name'], 'arguments': call['arguments']} | tojson }}{%- if not loop.last %}{{- ', ' }}{%- endif %}
{%- endfor %}
{{- ']</s>' }}
{%- endgeneration %}
{%- elif message['role'] == 'assistant' %}
{%- generation %}{{- ' ' + message['content'] | trim + '</s>' }}{%- endgeneration %}
{%- elif message['role'] == 'tool' %}
{{- '[TOOL_RESULTS] ' + {'content': message['content']} | tojson + '[/TOOL_RESULTS]' }}
{%- endif %}
{%- endfor %}"""

# name -> (architecture, chat template, special tokens added, the end-of-turn token)
FAMILIES = {
    "tiny-llama3": ("llama", LLAMA3_TOOL_TEMPLATE,
                    ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"],
                    "<|eot_id|>"),
    "tiny-mistral": ("mistral", MISTRAL_TOOL_TEMPLATE,
                     ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                      "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], "</s>"),
}


def build() -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig, LlamaConfig, MistralConfig

    base = json.loads((BASE / "config.json").read_text())
    size = {k: base[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                 "num_key_value_heads", "max_position_embeddings", "rms_norm_eps",
                                 "initializer_range", "tie_word_embeddings", "rope_parameters")}
    for name, (arch, chat_template, specials, end_of_turn) in FAMILIES.items():
        tok = AutoTokenizer.from_pretrained(BASE)
        tok.add_special_tokens({"additional_special_tokens": specials})
        tok.chat_template = chat_template
        tok.response_template = None  # the family is recognised from the chat template
        out = MODELS_DIR / name
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        tok.save_pretrained(out)
        config_file = out / "tokenizer_config.json"  # loading-time keys transformers writes back: not the asset's
        config = {k: v for k, v in json.loads(config_file.read_text()).items()
                  if k not in ("is_local", "local_files_only")}
        config_file.write_text(json.dumps(config, indent=2) + "\n")
        eos = [tok.convert_tokens_to_ids(end_of_turn), tok.eos_token_id]
        kwargs = dict(vocab_size=len(tok), bos_token_id=None, eos_token_id=eos, pad_token_id=tok.pad_token_id,
                      use_cache=True, dtype="float32", **size)
        cfg = LlamaConfig(attention_bias=False, mlp_bias=False, **kwargs) if arch == "llama" else MistralConfig(
            sliding_window=None, **kwargs)
        cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
        cfg.save_pretrained(out)
        GenerationConfig(bos_token_id=None, eos_token_id=eos, pad_token_id=tok.pad_token_id,
                         do_sample=False).save_pretrained(out)
        verify(out, AutoConfig, AutoTokenizer)
        print(f"wrote {out.relative_to(ASSETS.parent)}: vocab {len(tok)}, eos {eos}")


def verify(path: Path, AutoConfig, AutoTokenizer) -> None:
    """The folder loads, the template renders a call, and the base tokenisation is unchanged."""
    tok = AutoTokenizer.from_pretrained(path)
    assert getattr(tok, "response_template", None) is None
    assert AutoConfig.from_pretrained(path).vocab_size == len(tok)
    base = AutoTokenizer.from_pretrained(BASE)
    assert tok.encode("12+7=19 hello", add_special_tokens=False) == base.encode("12+7=19 hello",
                                                                                 add_special_tokens=False)
    call = {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    text = tok.apply_chat_template([{"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": "", "tool_calls": [call]}], tokenize=False)
    assert '"name": "f"' in text, text


if __name__ == "__main__":
    build()
