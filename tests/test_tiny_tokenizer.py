import json

import pytest
from transformers import AutoTokenizer

from dllm.eval.synthetic import CHARSET, make_split
from dllm.models.tokenizer import SPECIAL_TOKENS, STYLES, build_tokenizer, save_tokenizer, vocab_chars

CONVERSATION = [
    {"role": "user", "content": "  add: 457+168\n"},
    {"role": "assistant", "content": "#### 625"},
]

EXPECTED_CHAT = {
    "llada": (
        "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nadd: 457+168<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n#### 625<|eot_id|>"
    ),
    "dream": (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n  add: 457+168\n<|im_end|>\n"
        "<|im_start|>assistant\n#### 625<|im_end|>\n"
    ),
}
GENERATION_PROMPT = {
    "llada": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "dream": "<|im_start|>assistant\n",
}


@pytest.fixture(scope="module", params=STYLES)
def style_tok(request):
    return request.param, build_tokenizer(request.param, CHARSET)


def test_special_tokens_come_first_and_are_single_ids(style_tok):
    style, tok = style_tok
    specials = SPECIAL_TOKENS[style]
    for i, t in enumerate(specials):
        assert tok.convert_tokens_to_ids(t) == i
        assert tok(t, add_special_tokens=False)["input_ids"] == [i]
    assert len(tok) == len(specials) + len(vocab_chars(CHARSET))
    assert len(set(tok.get_vocab().values())) == len(tok)
    text = f"ab{specials[-1]}c{specials[0]}"
    ids = tok(text)["input_ids"]
    assert ids == [tok.convert_tokens_to_ids(c) for c in "ab"] + [len(specials) - 1] + [
        tok.convert_tokens_to_ids("c"),
        0,
    ]


def test_chat_headers_are_one_token_each(style_tok):
    style, tok = style_tok
    text = tok.apply_chat_template([{"role": "user", "content": "copy: user"}], add_generation_prompt=True,
                                   tokenize=False)
    pieces = tok.convert_ids_to_tokens(tok(text, add_special_tokens=False)["input_ids"])
    content = list("copy: user")  # a role name inside the content stays characters
    if style == "llada":
        assert pieces == ["<|startoftext|>", "<|start_header_id|>user<|end_header_id|>\n\n", *content,
                          "<|eot_id|>", GENERATION_PROMPT[style]]
    else:
        assert pieces == ["<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n", "<|im_start|>user\n",
                          *content, "<|im_end|>", "\n", GENERATION_PROMPT[style]]


def test_named_special_ids(style_tok):
    style, tok = style_tok
    if style == "llada":
        assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|startoftext|>",) + ("<|endoftext|>",) * 2
        assert tok.mask_token == "<|mdm_mask|>"
        assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.mask_token_id) == (0, 1, 1, 2)
    else:
        assert tok.bos_token == tok.eos_token == tok.pad_token == "<|endoftext|>"
        assert tok.mask_token == "<|mask|>"
        assert (tok.bos_token_id, tok.pad_token_id, tok.mask_token_id) == (0, 0, 3)
    assert tok.pad_token_id != tok.mask_token_id
    assert tok.padding_side == "left"


def test_character_level_round_trip(style_tok):
    _, tok = style_tok
    samples = [
        "a b  c\n\nd\n",
        " leading and trailing ",
        "add: 457+168 #### 625",
        *[ex.prompt + "\n" + ex.answer for ex in make_split("test", n_per_family=5)],
    ]
    for s in samples:
        ids = tok(s, add_special_tokens=True)["input_ids"]
        assert len(ids) == len(s)  # one token per character, no bos/eos added
        assert tok.decode(ids) == s
    # Every letter is in the vocab (roles are spelled with characters), never the unk token.
    ids = tok("abcdefghijklmnopqrstuvwxyz user system assistant")["input_ids"]
    assert tok.unk_token_id not in ids
    specials = "".join(SPECIAL_TOKENS[style_tok[0]])
    ids = tok("x" + specials + "y")["input_ids"]
    assert tok.decode(ids) == "x" + specials + "y"
    assert tok.decode(ids, skip_special_tokens=True) == "xy"


def test_left_padding(style_tok):
    _, tok = style_tok
    batch = tok(["ab", "abcd"], padding=True)
    assert batch["input_ids"][0][:2] == [tok.pad_token_id] * 2
    assert batch["attention_mask"] == [[0, 0, 1, 1], [1, 1, 1, 1]]


def test_chat_template_renders_expected_string(style_tok):
    style, tok = style_tok
    text = tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert text == EXPECTED_CHAT[style]
    with_prompt = tok.apply_chat_template(CONVERSATION[:1], tokenize=False, add_generation_prompt=True)
    assert not tok.apply_chat_template(CONVERSATION[:1], tokenize=False).endswith(GENERATION_PROMPT[style])
    assert with_prompt == tok.apply_chat_template(CONVERSATION[:1], tokenize=False) + GENERATION_PROMPT[style]
    ids = tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"]
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    if style == "llada":
        assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    else:
        sys_first = [{"role": "system", "content": "be brief"}, CONVERSATION[0]]
        rendered = tok.apply_chat_template(sys_first, tokenize=False)
        assert rendered.startswith("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n")
        assert "helpful" not in rendered


def test_save_load_round_trip(style_tok, tmp_path):
    style, tok = style_tok
    out = save_tokenizer(tok, tmp_path / style)
    loaded = AutoTokenizer.from_pretrained(str(out))
    assert loaded.get_vocab() == tok.get_vocab()
    assert loaded.chat_template == tok.chat_template
    assert loaded.padding_side == "left"
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "mask_token_id", "unk_token_id"):
        assert getattr(loaded, name) == getattr(tok, name), name
    assert sorted(loaded.all_special_ids) == sorted(tok.all_special_ids) == list(range(len(SPECIAL_TOKENS[style])))
    text = EXPECTED_CHAT[style] + "\n x"
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"]) == text
    assert loaded.apply_chat_template(CONVERSATION, tokenize=False) == EXPECTED_CHAT[style]
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config.get("trust_remote_code") in (None, False) and "auto_map" not in config
    # Layout that transformers 4 reads too: known class name, template inline, no jinja file.
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["chat_template"] == tok.chat_template
    assert not (out / "chat_template.jinja").exists()
    assert config["additional_special_tokens"] == [
        t for t in SPECIAL_TOKENS[style] if t not in {tok.bos_token, tok.eos_token, tok.mask_token}
    ]
    # Saving the loaded tokenizer again gives the same files.
    again = save_tokenizer(loaded, tmp_path / "again")
    assert json.loads((again / "tokenizer_config.json").read_text()) == config
    assert (again / "tokenizer.json").read_text() == (out / "tokenizer.json").read_text()


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown tokenizer style"):
        build_tokenizer("gpt2", CHARSET)
    with pytest.raises(ValueError, match="charset must be a str"):
        build_tokenizer("llada", list(CHARSET))  # type: ignore[arg-type]


def test_minimal_charset_still_has_letters_space_newline():
    tok = build_tokenizer("dream", "0")
    assert tok.decode(tok("user 0\nassistant")["input_ids"]) == "user 0\nassistant"
