"""A small byte-level BPE tokenizer and chat templates for tiny test checkpoints.

Qwen-like: special tokens after the BPE vocabulary (as Qwen numbers them), `<think>`/`<tool_call>`
as non-special added tokens. Nemotron-like: `<unk> <s> </s>` and the chat tokens at low ids.
The templates follow the real ones' conventions (ChatML turns, `<think>` handling with
`enable_thinking`, qwen3_coder-style XML tool calls) in a compact form.
"""

from __future__ import annotations

import functools
import json

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

BPE_VOCAB_SIZE = 480

# Qwen2's pre-tokenizer split pattern (digits one at a time), as in Qwen's tokenizer.json
_QWEN_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

_CORPUS = [
    "Hello world! This is a tiny tokenizer for tests. The quick brown fox jumps over the lazy dog.",
    "def add(x, y):\n    return x + y\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    "import json\nprint(json.dumps({'a': 1, 'b': [1, 2, 3]}))\nfor i in range(10):\n    print(i)\n",
    '{"name": "read_file", "arguments": {"path": "/tmp/a.txt"}}',
    "<function=read_file>\n<parameter=path>\nsrc/main.py\n</parameter>\n</function>",
    "The user asked a question. Let me think about it step by step before answering.",
    "日本語のテキストと中文文本。Ünïcödé çhåråctêrs, émojis 🙂🚀 and symbols → ≤ ≥ ∑.",
    "You are a helpful assistant. Answer the question briefly and correctly.",
    "0123456789 + - * / = ( ) [ ] { } < > ; : , . ! ? ' \" # $ % & @ ^ _ ` | ~ \\",
]

QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"]
QWEN_SPECIAL += ["<|image_pad|>", "<|video_pad|>"]
QWEN_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
NEMOTRON_SPECIAL = ["<unk>", "<s>", "</s>"] + [f"<SPECIAL_{i}>" for i in range(3, 10)]
NEMOTRON_SPECIAL += ["<|im_start|>", "<|im_end|>"]
NEMOTRON_ADDED = QWEN_ADDED[4:] + QWEN_ADDED[:4]
NEMOTRON_IMAGE = ["<image>", "<img>", "</img>"]  # after everything else, so text ids stay put


def _base_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    split = pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated")
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


@functools.lru_cache(maxsize=2)
def tokenizer_json(family: str) -> str:
    """tokenizer.json text for "qwen" or "nemotron"; deterministic (BPE training is)."""
    tok = _base_tokenizer()
    leading = NEMOTRON_SPECIAL + NEMOTRON_ADDED if family == "nemotron" else []
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE + len(leading),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=leading,
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    if family == "nemotron":
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in NEMOTRON_ADDED])
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in NEMOTRON_IMAGE])
    else:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL])
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_ADDED])
    return tok.to_str(pretty=True)


def token_ids(family: str) -> dict[str, int]:
    tok = Tokenizer.from_str(tokenizer_json(family))
    names = (
        NEMOTRON_SPECIAL + NEMOTRON_ADDED + NEMOTRON_IMAGE
        if family == "nemotron"
        else QWEN_SPECIAL + QWEN_ADDED
    )
    return {name: tok.token_to_id(name) for name in names}


def vocab_length(family: str) -> int:
    return Tokenizer.from_str(tokenizer_json(family)).get_vocab_size(with_added_tokens=True)


QWEN_TEMPLATE = """\
{%- if not messages %}{{- raise_exception('No messages provided.') }}{%- endif %}
{%- macro text(content) %}
    {%- if content is string %}{{- content }}
    {%- elif content is iterable and content is not mapping %}
        {%- for item in content %}
            {%- if item.type == 'image' or 'image' in item or 'image_url' in item %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}
            {%- elif 'text' in item %}{{- item.text }}{%- endif %}
        {%- endfor %}
    {%- endif %}
{%- endmacro %}
{%- if tools and tools is iterable and tools is not mapping %}
    {{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
    {{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call>' }}
    {%- if messages[0].role == 'system' %}{{- '\\n\\n' + text(messages[0].content)|trim }}{%- endif %}
    {{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + text(messages[0].content)|trim + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- if message.role == 'user' and not (text(message.content)|trim).startswith('<tool_response>') %}
        {%- set ns.last_query_index = (messages|length - 1) - loop.index0 %}{% break %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = text(message.content)|trim %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}{{- raise_exception('System message must be at the beginning.') }}{%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning|trim + '\\n</think>\\n\\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {%- for call in message.tool_calls or [] %}
            {%- set call = call.function if call.function is defined else call %}
            {{- ('\\n\\n' if loop.first and content else '\\n' if not loop.first else '') + '<tool_call>\\n<function=' + call.name + '>\\n' }}
            {%- for name, value in (call.arguments or {})|items %}
                {{- '<parameter=' + name + '>\\n' + (value if value is string else value|tojson) + '\\n</parameter>\\n' }}
            {%- endfor %}
            {{- '</function>\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}
"""

# Qwen3 / Qwen3-Next style: hermes JSON tool calls (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`)
QWEN_HERMES_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" + (tool | tojson) }}{%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content or '' %}
        {%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}
        {{- '<|im_start|>assistant\\n' + content }}
        {%- for call in message.tool_calls or [] %}
            {%- set call = call.function if call.function is defined else call %}
            {{- ('\\n' if content or not loop.first else '') + '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
            {{- (call.arguments if call.arguments is string else call.arguments | tojson) + '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""


NEMOTRON_TEMPLATE = """\
{%- set thinking = enable_thinking if enable_thinking is defined else true %}
{%- set system = messages[0].content if messages and messages[0].role == 'system' else '' %}
{%- set loop_messages = messages[1:] if messages and messages[0].role == 'system' else messages %}
{{- '<|im_start|>system\\n' + system }}
{%- if tools %}
    {{- ('\\n\\n' if system else '') + '# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}
    {%- for tool in tools %}
        {%- set fn = tool.function if tool.function is defined else tool %}
        {{- '\\n<function>\\n<name>' + fn.name + '</name>' }}
        {%- if fn.description %}{{- '\\n<description>' + fn.description|trim + '</description>' }}{%- endif %}
        {{- '\\n<parameters>' + (fn.parameters|tojson) + '</parameters>\\n</function>' }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in loop_messages %}
    {%- if message.role == 'user' and message.content is string %}
        {{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\\n' }}
        {%- for item in message.content %}
            {%- if item.type == 'image' %}{{- '<image>' }}{%- elif 'text' in item %}{{- item.text }}{%- endif %}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content or '' %}
        {%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}
        {{- '<|im_start|>assistant\\n<think></think>' + content|trim }}
        {%- for call in message.tool_calls or [] %}
            {%- set call = call.function if call.function is defined else call %}
            {{- '\\n<tool_call>\\n<function=' + call.name + '>\\n' }}
            {%- for name, value in (call.arguments or {})|items %}
                {{- '<parameter=' + name + '>\\n' + (value if value is string else value|tojson) + '\\n</parameter>\\n' }}
            {%- endfor %}
            {{- '</function>\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' + ('<think>\\n' if thinking else '<think></think>') }}
{%- endif %}
"""


def chat_template_for(kind: str) -> str:
    if kind.startswith("nemotron"):
        return NEMOTRON_TEMPLATE
    return QWEN_HERMES_TEMPLATE if kind == "qwen3_next" else QWEN_TEMPLATE


def tokenizer_config(family: str, *, template: str | None) -> dict[str, object]:
    """tokenizer_config.json in the family's published shape."""
    ids = token_ids(family)
    tok = Tokenizer.from_str(tokenizer_json(family))
    decoder = {}
    for name, token_id in ids.items():
        special = name not in QWEN_ADDED
        decoder[str(token_id)] = {
            "content": name, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": special,
        }  # fmt: skip
    config: dict[str, object] = {"add_prefix_space": False, "added_tokens_decoder": decoder}
    if family == "nemotron":
        config.update(bos_token="<s>", eos_token="<|im_end|>", unk_token="<unk>", pad_token="<unk>")
        config.update(add_bos_token=False, tokenizer_class="PreTrainedTokenizerFast")
    else:
        config.update(bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>", errors="replace")
        config.update(add_bos_token=False, tokenizer_class="Qwen2Tokenizer", split_special_tokens=False)
    config.update(clean_up_tokenization_spaces=False, model_max_length=262144)
    if template is not None:
        config["chat_template"] = template
    assert tok.get_vocab_size() >= len(ids)
    return config


def generation_config(family: str) -> dict[str, object]:
    ids = token_ids(family)
    if family == "nemotron":
        eos = [ids["</s>"], ids["<|im_end|>"]]
        return {
            "_from_model_config": True,
            "bos_token_id": ids["<s>"],
            "eos_token_id": eos,
            "pad_token_id": 0,
        }
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    return {
        "bos_token_id": ids["<|endoftext|>"], "do_sample": True, "eos_token_id": eos,
        "pad_token_id": ids["<|endoftext|>"], "temperature": 0.6, "top_k": 20, "top_p": 0.95,
    }  # fmt: skip


def dumps(value: object) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False) + "\n"
