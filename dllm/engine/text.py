"""Text in and out: prompts to token ids (chat template, unknown characters refused, no special tokens smuggled
into a turn) and answer ids back to text."""
from __future__ import annotations

import re
import warnings

from torch import Tensor

from ..core.errors import DllmError, DllmNotice


def encode_prompts(tokenizer, prompts, chat: bool | None) -> list[list[int]]:
    """Token ids of each prompt (a string, or a list of token ids); `chat` wraps a string as a user turn with
    the tokenizer's chat template. Characters the tokenizer does not know are an error, never a silent unk."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise DllmError(f"prompts must be a string or a non-empty list of strings or token-id lists, got {prompts!r}")
    if chat is not None and not isinstance(chat, bool):
        raise DllmError(f"chat must be True, False or None (the tokenizer decides), got {chat!r}")
    if chat is None:
        chat = getattr(tokenizer, "chat_template", None) is not None
    if chat and getattr(tokenizer, "chat_template", None) is None:
        raise DllmError("this tokenizer has no chat template; pass chat=False (--no-chat)")
    out = []
    for row, p in enumerate(prompts):
        if isinstance(p, str):
            out.append(_encode_text(tokenizer, p, row, chat))
        elif isinstance(p, (list, tuple, Tensor)) and all(is_token_id(t) for t in p):
            out.append([int(t) for t in p])
        else:
            raise DllmError(f"prompt {row} is {p!r}; a prompt is a string or a list of token ids "
                            f"(wrap one prompt's ids in a list: [[1, 2, 3]])")
    return out


def is_token_id(t) -> bool:
    return (isinstance(t, int) and not isinstance(t, bool)) or (isinstance(t, Tensor) and t.dim() == 0
                                                                 and not t.dtype.is_floating_point)


def check_plain_text(tokenizer, text: str, what: str) -> None:
    """Text that goes into the chat template must not hold the tokenizer's special tokens: `<|eot_id|>` typed in
    a prompt would end the user's turn (a template injection), `<|mdm_mask|>` would be a mask."""
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    special = [*getattr(tokenizer, "all_special_tokens", []), *(t.content for t in added if t.special)]
    found = next((s for s in special if s and s in text), None)
    if found is not None:
        raise DllmError(f"{what} contains the special token {found!r}, which the chat template would read as a "
                        f"control token; remove it (chat=False / --no-chat sends raw text as it is)")


def _encode_text(tokenizer, text: str, row: int, chat: bool) -> list[int]:
    if not text.strip():
        raise DllmError(f"prompt {row} is empty; give some text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise DllmError(f"prompt {row} is not valid UTF-8 text; convert it to UTF-8") from None
    if chat:
        check_plain_text(tokenizer, text, f"prompt {row}")
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return encode_text(tokenizer, text, f"prompt {row}")


def encode_text(tokenizer, text: str, what: str) -> list[int]:
    """Token ids of `text` as it is (no special tokens added); characters the tokenizer does not know are an error
    naming `what`, never a silent unk (the tiny models' unk is their end of text)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None or not getattr(tokenizer, "is_fast", False):  # byte-level BPE (the real models) has no unk
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    unknown = sorted({text[a:b] for t, (a, b) in zip(enc["input_ids"], enc["offset_mapping"])
                      if t == unk and text[a:b] != tokenizer.unk_token})
    if unknown:
        raise DllmError(f"{what} has characters the tokenizer does not know: "
                        f"{', '.join(map(repr, unknown))}; remove or replace them")
    return enc["input_ids"]


def answer_text(tokenizer, ids: list[int]) -> str:
    """The text of answer token ids (ids past the tokenizer's vocabulary, a padded embedding's, are dropped)."""
    return tokenizer.decode([t for t in ids if t < len(tokenizer)], skip_special_tokens=True)

def warn_outside_format(model, tokenizer, prompts: list[list[int]]) -> None:
    """A one-line `DllmNotice` (not an error) when prompts fall outside the formats the model was trained on
    (`prompt_formats` of its generation_config.json, each alone in a chat turn: the shipped tiny models), where
    its answers are likely wrong."""
    formats = model.generation_defaults.get("prompt_formats")
    if not formats:
        return
    turn = "\0"
    if getattr(tokenizer, "chat_template", None) is not None:
        turn = tokenizer.apply_chat_template([{"role": "user", "content": turn}], add_generation_prompt=True,
                                             tokenize=False)
    head, _, tail = turn.partition("\0")
    outside = []
    for ids in prompts:
        text = tokenizer.decode(ids)
        inner = text[len(head):len(text) - len(tail)]
        if not (text.startswith(head) and text.endswith(tail) and len(text) >= len(head) + len(tail)):
            outside.append(f"{text[:60]!r} (not in the chat template)")
        elif not any(re.fullmatch(f, inner) for f in formats):
            outside.append(repr(inner[:60]))
    if outside:
        which = outside[0] if len(prompts) == 1 else f"{len(outside)} of {len(prompts)} prompts (first: {outside[0]})"
        warnings.warn(f"{which} {'is' if len(outside) == 1 else 'are'} outside the prompts this model was trained "
                      f"on ({model.generation_defaults.get('trained_on', 'see its generation_config.json')}); expect "
                      f"wrong answers", DllmNotice, stacklevel=4)  # the caller of generate or stream
