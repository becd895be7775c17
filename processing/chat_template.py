"""The chat template: Qwen3-VL-style ChatML with vision tokens.

`<|im_start|>{role}\n{content}<|im_end|>\n` per message; an image is
`<|vision_start|><|image_pad|><|vision_end|>` and a video `<|vision_start|><|video_pad|><|vision_end|>`
in content order (with `add_vision_id=True`, prefixed `Picture N: ` / `Video N: ` as Qwen does). The
assistant's content and its <|im_end|> sit inside `{% generation %}` markers, so
`apply_chat_template(..., return_assistant_tokens_mask=True)` marks exactly what training learns.
"""

CHAT_TEMPLATE = (
    "{%- set image_count = namespace(value=0) -%}"
    "{%- set video_count = namespace(value=0) -%}"
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for item in content -%}"
    "{%- if item['type'] == 'image' or 'image' in item or 'image_url' in item -%}"
    "{%- set image_count.value = image_count.value + 1 -%}"
    "{%- if add_vision_id -%}Picture {{ image_count.value }}: {% endif -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif item['type'] == 'video' or 'video' in item -%}"
    "{%- set video_count.value = video_count.value + 1 -%}"
    "{%- if add_vision_id -%}Video {{ video_count.value }}: {% endif -%}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in item -%}{{- item['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- render(message['content']) -}}{{- '<|im_end|>' -}}{%- endgeneration -%}"
    "{{- '\n' -}}"
    "{%- else -%}"
    "{{- render(message['content']) -}}{{- '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)
