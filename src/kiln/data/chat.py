"""Chat and prompt/completion records -> tokens and per-token loss weights.

Only what the model should learn to produce is scored: the assistant turns of a chat (each
with its end-of-turn token) or the completion of a prompt. Prompts, system text and the
template's own tokens get weight 0.

Chat templates are Jinja, rendered the way Hugging Face transformers renders
`tokenizer_config.json`'s `chat_template`: a sandboxed environment with trim_blocks and
lstrip_blocks, `raise_exception`, a `tojson` that does not escape HTML, the special tokens
as variables. `strftime_now` is left undefined on purpose: templates that date their system
prompt then fall back to their fixed date, so the same records always give the same tokens
(and the tokenized cache stays valid).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kiln.data.sources import DecodeErrors, OnDecodeError, Task, jsonl_records, line_number
from kiln.data.tokenizers import Tokenizer
from kiln.errors import KilnError, first_line

FORMATS = ("text", "chat", "prompt_completion")
ROLES = ("system", "user", "assistant", "tool")

# format=chat with the byte tokenizer and no template given: plain-text turn markers (bytes
# cannot hold special tokens), ending each turn with `<|end|>`.
BYTE_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class RecordFormat:
    """How JSONL records become documents; picklable, so `kiln prepare` workers get it."""

    kind: str  # chat | prompt_completion
    template: str | None = None  # chat: the Jinja source
    origin: str = ""  # where the template came from, for messages
    variables: tuple[tuple[str, str], ...] = field(default=())  # bos_token, eos_token, ...

    def identity(self) -> dict[str, Any]:
        """What shards made with this format depend on (manifests and cache keys)."""
        out: dict[str, Any] = {"kind": self.kind}
        if self.template is not None:
            text = json.dumps([self.template, self.variables])
            out["template_sha256"] = hashlib.sha256(text.encode()).hexdigest()
        return out


def record_format(
    kind: str,
    tokenizer: Tokenizer,
    template: str | None,
    what: str = "data.chat_template",
    kind_field: str = "data.format",
) -> RecordFormat | None:
    """The format of data.format / --record-format (None for text); the template is compiled
    now, so a syntax error stops the run before anything is tokenized. `what` and
    `kind_field` name the template's and the format's settings in messages."""
    if kind == "text":
        return None
    if kind == "prompt_completion":
        return RecordFormat(kind)
    if tokenizer.kind not in ("byte", "huggingface"):
        raise KilnError(
            f"{kind_field}: chat needs character offsets of tokens, which a {tokenizer.kind} "
            f"tokenizer ({tokenizer.spec!r}) does not give; allowed: the byte tokenizer or a "
            "tokenizer.json (or format prompt_completion)"
        )
    variables: dict[str, str] = {}
    origin = what
    if tokenizer.kind == "huggingface":
        config_path = Path(tokenizer.spec).expanduser().parent / "tokenizer_config.json"
        variables, found = _tokenizer_config(config_path)
        if template is None:
            template, origin = found, f"{config_path} (chat_template)"
        if template is None:
            raise KilnError(
                f"{what}: not given, and {config_path} has no chat_template; allowed: a Jinja "
                "chat template (data.chat_template, or kiln prepare --chat-template FILE)"
            )
    elif template is None:
        template, origin = BYTE_TEMPLATE, "kiln's byte-tokenizer template"
    fmt = RecordFormat(kind, template, origin, tuple(sorted(variables.items())))
    _compiled(fmt.template, fmt.origin)
    return fmt


def encode_records(
    task: Task, fmt: RecordFormat, tokenizer: Tokenizer, on_decode_error: OnDecodeError
) -> tuple[list[np.ndarray], list[np.ndarray], DecodeErrors]:
    """Token ids (without the EOS kiln appends) and their loss weights (uint8 0/1) of every
    record of a JSONL task, and the lines that were not UTF-8; bad records raise KilnError
    naming file:line."""
    errors = DecodeErrors()
    path = task.paths[0]
    ids_list, weights_list = [], []
    for n, record in jsonl_records(task, on_decode_error, errors):
        where = functools.partial(_where, path, task.start, n)  # computed only for a message
        if fmt.kind == "chat":
            ids, weights = _encode_chat(record, fmt, tokenizer, where)
        else:
            ids, weights = _encode_prompt_completion(record, tokenizer, where)
        ids_list.append(ids)
        weights_list.append(weights)
    return ids_list, weights_list, errors


def _where(path: str, start: int, n: int) -> str:
    return f"{path}:{line_number(path, start, n)}"


def eos_weight(fmt: RecordFormat) -> int:
    """Weight of the EOS kiln appends to a document: a completion ends there (the model must
    learn to stop), while a chat's assistant turns already end in the template's end-of-turn."""
    return 1 if fmt.kind == "prompt_completion" else 0


def _encode_prompt_completion(record: Any, tokenizer: Tokenizer, where) -> tuple[Any, Any]:
    ok = isinstance(record, dict) and all(
        isinstance(record.get(k), str) for k in ("prompt", "completion")
    )
    if not ok:
        got = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise KilnError(
            f"{where()}: format prompt_completion needs string fields 'prompt' and "
            f"'completion'; the record has {got}"
        )
    if not record["completion"]:
        raise KilnError(f"{where()}: 'completion' is empty; allowed: text to train on")
    # Tokenized apart, as at generation time, where the prompt is tokenized on its own and the
    # model continues from its last token: the boundary between weights 0 and 1 is exact.
    prompt, completion = tokenizer.encode_batch([record["prompt"], record["completion"]])
    ids = np.concatenate([prompt, completion])
    weights = np.concatenate([np.zeros(len(prompt), np.uint8), np.ones(len(completion), np.uint8)])
    return ids, weights


def _encode_chat(
    record: Any, fmt: RecordFormat, tokenizer: Tokenizer, where
) -> tuple[np.ndarray, np.ndarray]:
    messages = _checked_messages(record, where)
    text, spans = assistant_spans(messages, fmt, where)
    ids, offsets = tokenizer.encode_offsets(text)
    weights = np.zeros(len(ids), np.uint8)
    for start, end in spans:
        # A token is scored when its characters overlap an assistant span, so a token that
        # straddles the span's edge (merged with template text) still counts.
        weights |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
    return ids, weights


def assistant_spans(
    messages: list[dict[str, Any]], fmt: RecordFormat, where=lambda: "chat"
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character span of each assistant turn.

    Found by rendering prefixes of the conversation: a turn starts where the render of the
    messages before it, with the generation prompt, ends, and ends where the render that
    includes it ends (whitespace after its end-of-turn token, which the model never emits,
    is left out). This works with any template, also those without `{% generation %}`
    blocks (most published ones), and the check that each render is a prefix of the next
    refuses templates that rewrite earlier turns, rather than guessing at their spans.
    """
    full = _render(fmt, messages, False, where)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(fmt, messages[:i], True, where)
        upto = _render(fmt, messages[: i + 1], False, where)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise KilnError(
                f"{where()}: the chat template ({fmt.origin}) renders message {i} differently "
                "once later messages follow (or its generation prompt is not how the assistant "
                "turn starts), so the assistant tokens cannot be found; allowed: templates "
                "whose rendering of a conversation prefix is a prefix of the whole"
            )
        spans.append((len(before), max(len(before), len(upto.rstrip()))))
    return full, spans


def _checked_messages(record: Any, where) -> list[dict[str, Any]]:
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        got = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise KilnError(
            f"{where()}: format chat needs 'messages', a list of {{role, content}} objects; "
            f"the record has {got}"
        )
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES:
            raise KilnError(
                f"{where()}: messages[{i}].role is {m.get('role')!r}; allowed: {', '.join(ROLES)}"
            )
        if not isinstance(m.get("content"), str):
            raise KilnError(
                f"{where()}: messages[{i}].content is {type(m.get('content')).__name__}; "
                "allowed: a string"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise KilnError(
            f"{where()}: no assistant message, so nothing to train on; allowed: conversations "
            "with at least one message of role assistant"
        )
    return messages


def _render(fmt: RecordFormat, messages: Sequence[dict], add_generation_prompt: bool, where):
    template = _compiled(fmt.template, fmt.origin)
    try:
        return template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            **dict(fmt.variables),
        )
    except Exception as e:
        line = _template_line(e)
        at = f", template line {line}" if line else ""
        raise KilnError(
            f"{where()}: the chat template ({fmt.origin}{at}) failed to render: "
            f"{type(e).__name__}: {first_line(e)}"
        ) from None


@functools.lru_cache(maxsize=8)
def _compiled(template: str, origin: str):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes <, > and & for HTML; templates expect plain JSON.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise KilnError(
            f"{origin}: template line {e.lineno}: not a valid Jinja template ({e.message})"
        ) from None


def _template_line(e: BaseException) -> int | None:
    """The template line an exception was raised at (Jinja maps its frames to '<template>')."""
    line, tb = None, e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _tokenizer_config(path: Path) -> tuple[dict[str, str], str | None]:
    """Special-token variables and the chat template of a tokenizer_config.json (if any)."""
    try:
        raw = json.loads(path.read_text())
    except OSError:
        return {}, None
    except ValueError as e:
        raise KilnError(f"{path}: not JSON ({e})") from None
    variables = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = raw.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            variables[key] = value
    template = raw.get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise KilnError(f"{path}: chat_template is {type(template).__name__}; allowed: a string")
    return variables, template
