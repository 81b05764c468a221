"""`pydflash serve --demo`: a synthetic target and DFlash draft (random weights) whose chat template renders
tools and thinking the way Qwen3.5/3.6 templates do, so every server feature can be tried with no download."""
from __future__ import annotations

import os

# ChatML with Qwen3.5/3.6-style tools (XML calls, <tool_response> turns) and thinking. Unlike Qwen's own
# templates the demo thinks only when asked (chat_template_kwargs {"enable_thinking": true}): its random weights
# never close a <think> block, so a default-on switch would hide every reply in the reasoning. Past assistant
# turns keep their (possibly empty) think block, so a chat's next prompt extends the last one token for token
# and the engine's prefix cache can resume it.
DEMO_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call these functions:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call a function, reply with\\n<tool_call>\\n<function=NAME>\\n<parameter=NAME>\\n"
    "VALUE\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{{- '<think>\\n' + (message.reasoning_content or '') + '\\n</think>\\n\\n' }}"
    "{{- message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n<function=' + fn.name + '>\\n' }}"
    "{%- for name, value in fn.arguments | items %}"
    "{{- '<parameter=' + name + '>\\n' + (value if value is string else value | tojson) + '\\n</parameter>\\n' }}"
    "{%- endfor %}"
    "{{- '</function>\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking %}{{- '<think>\\n' }}"
    "{%- else %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def write_demo_pair(directory, seed: int = 0) -> tuple[str, str | None]:
    """Write the demo target (and, when this build has the draft model, a draft); returns their paths."""
    from .. import testing

    os.makedirs(directory, exist_ok=True)
    target = os.path.join(directory, "pydflash-demo.gguf")
    testing.write_qwen35_gguf(target, seed=seed, chat_template=DEMO_TEMPLATE)
    draft = os.path.join(directory, "draft")
    testing.write_dflash_draft(draft, target, seed=seed)
    return target, draft
