"""Character-level Hugging Face tokenizers for the tiny shipped models.

Every character of the charset is one token; special tokens and chat templates mimic the real models so that
the same code paths serve real and tiny checkpoints:

- ``llada``: ``<|startoftext|>`` bos, ``<|endoftext|>`` eos/pad, ``<|mdm_mask|>`` mask, Llama-3-like headers.
- ``dream``: ``<|endoftext|>`` bos/eos/pad, ``<|mask|>`` mask, Qwen2.5 ChatML.

Special tokens take ids ``0..k-1`` (in the order of ``SPECIAL_TOKENS[style]``), then the characters in
sorted order. A character outside the vocab encodes as the unk token, which is ``<|endoftext|>`` in both
styles (as in Dream's real tokenizer). No bos/eos is added by ``tok(text)``; the llada chat template writes
the bos itself.

Used by `scripts/train_tiny.py` (charset of the synthetic suite) and by `random:` models (printable ASCII).
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

STYLES: tuple[str, ...] = ("llada", "dream")

CHAT_ROLES: tuple[str, ...] = ("system", "user", "assistant")
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

SPECIAL_TOKENS: dict[str, tuple[str, ...]] = {
    "llada": (
        "<|startoftext|>",
        "<|endoftext|>",
        "<|mdm_mask|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
        # Whole chat headers, one token each (a real tokenizer spends ~4 on one, a character-level one ~15).
        *(f"<|start_header_id|>{role}<|end_header_id|>\n\n" for role in CHAT_ROLES),
    ),
    "dream": (
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|mask|>",
        *(f"<|im_start|>{role}\n" for role in CHAT_ROLES),
        f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n",
    ),
}

# Roles of the named special tokens per style; the rest go to the additional special tokens.
_ROLES: dict[str, dict[str, str]] = {
    "llada": {
        "bos_token": "<|startoftext|>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "mask_token": "<|mdm_mask|>",
    },
    "dream": {
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "mask_token": "<|mask|>",
    },
}

# LLaDA format: bos, then per message header + role + header end + blank line + stripped content + eot.
# Unlike the real LLaDA template, the assistant header is added only with add_generation_prompt.
LLADA_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + (message['content'] | trim) + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- endif -%}"
)

# Qwen2.5 ChatML (without tools): a default system turn unless the first message is a system message.
DREAM_CHAT_TEMPLATE = (
    "{%- if not messages or messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

CHAT_TEMPLATES: dict[str, str] = {"llada": LLADA_CHAT_TEMPLATE, "dream": DREAM_CHAT_TEMPLATE}


def vocab_chars(charset: str) -> list[str]:
    """The characters that get a token, sorted: ``charset`` plus space, newline, lowercase letters (role
    names) and the characters of the default Dream system prompt (both styles share one character set)."""
    return sorted(set(charset) | set(string.ascii_lowercase) | set(DEFAULT_SYSTEM_PROMPT) | {" ", "\n"})


def build_tokenizer(style: str, charset: str) -> PreTrainedTokenizerFast:
    """A character-level tokenizer in ``style`` ("llada" or "dream") over ``charset``."""
    if style not in STYLES:
        raise ValueError(f"unknown tokenizer style {style!r}; use 'llada' or 'dream'")
    if not isinstance(charset, str):
        raise ValueError(f"charset must be a str of characters, got {type(charset).__name__}")
    specials = SPECIAL_TOKENS[style]
    vocab = {tok: i for i, tok in enumerate([*specials, *vocab_chars(charset)])}

    roles = _ROLES[style]
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=roles["unk_token"]))
    # Isolate every character (newlines included); Fuse joins decoded tokens with nothing in between.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    # Added special tokens are matched before pre-tokenization, longest first, so they stay whole tokens.
    core.add_special_tokens(
        [AddedToken(t, special=True, normalized=False, lstrip=False, rstrip=False) for t in specials]
    )

    named = set(roles.values())
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        additional_special_tokens=[t for t in specials if t not in named],
        clean_up_tokenization_spaces=False,
        padding_side="left",
        **roles,
    )
    tok.padding_side = "left"
    tok.chat_template = CHAT_TEMPLATES[style]
    return tok


def save_tokenizer(tok: PreTrainedTokenizerFast, out_dir: str | Path) -> Path:
    """Write ``tok`` to ``out_dir`` so that ``AutoTokenizer.from_pretrained`` loads it in transformers 4 and 5.

    transformers 5 writes ``tokenizer_class: TokenizersBackend``, a list under ``extra_special_tokens`` and the
    chat template in ``chat_template.jinja``; version 4 knows none of these. The config is rewritten in the
    older layout (the one of LLaDA's own ``tokenizer_config.json``), which version 5 still reads.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    # "backend" is v5-only; the other two are loading arguments v5 writes back when a loaded tokenizer is saved.
    for key in ("backend", "is_local", "local_files_only"):
        config.pop(key, None)
    extra = config.pop("extra_special_tokens", None)
    if isinstance(extra, list):
        config["additional_special_tokens"] = extra
    elif extra:
        config["extra_special_tokens"] = extra
    jinja = out / "chat_template.jinja"
    if tok.chat_template is not None:
        config["chat_template"] = tok.chat_template
    jinja.unlink(missing_ok=True)
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return out


def build_char_tokenizer(style: str) -> PreTrainedTokenizerFast:
    """A printable-ASCII tokenizer in ``style``, for ``random:`` models that ship no tokenizer of their own."""
    return build_tokenizer(style, string.ascii_letters + string.digits + string.punctuation + " \n")
