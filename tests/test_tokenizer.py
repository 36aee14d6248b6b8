"""Tokenizer wrapper: round trips, BOS handling, special tokens, chat templates, errors."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from deepinfer_core.tokenizer import Tokenizer, TokenizerError

BOS, EOS, PAD, USER, ASSISTANT = "<|bos|>", "<|eos|>", "<|pad|>", "<|User|>", "<|Assistant|>"
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "DeepSeek models route tokens to experts.",
    "Hello world! Hello tokenizer, hello engine.",
    "Numbers like 12345 and symbols like #@! also appear.",
] * 20
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|User|>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|Assistant|>{{ m['content'] }}{{ eos_token }}"
    "{% else %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|Assistant|>{% endif %}"
)


def _train(with_bos_post_processor: bool) -> RawTokenizer:
    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[BOS, EOS, PAD, USER, ASSISTANT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    if with_bos_post_processor:
        tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    return tok


def _folder(tmp_path, *, post_processor=False, tokenizer_config=None, model_config=None, name="tok"):
    folder = tmp_path / name
    folder.mkdir()
    _train(post_processor).save(str(folder / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": {"content": EOS, "special": True}, "pad_token": PAD,
              "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, **(tokenizer_config or {})}))
    if model_config is not None:
        (folder / "config.json").write_text(json.dumps(model_config))
    return folder


@pytest.fixture
def tok(tmp_path) -> Tokenizer:
    return Tokenizer.from_folder(_folder(tmp_path, tokenizer_config={"add_bos_token": True}))


def test_round_trip(tok):
    for text in ["Hello world!", "unseen wörds ünïcode ✓ and 日本語", "  leading and trailing spaces  ", ""]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text


def test_special_tokens_and_ids(tok):
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (BOS, EOS, PAD)
    assert (tok.bos_token_id, tok.pad_token_id) == (0, 2)
    assert tok.eos_token_ids == [1]
    assert tok.convert_ids_to_tokens([0, 1, 3]) == [BOS, EOS, USER]
    assert tok.convert_ids_to_tokens(4) == ASSISTANT
    assert tok.vocab_size == 300
    assert {0, 1, 2, 3, 4} <= tok.special_token_ids


def test_add_bos_token_prepends_bos_once(tok):
    ids = tok.encode("Hello world")
    assert ids[0] == 0 and ids[1] != 0
    assert tok.encode("Hello world", add_special_tokens=False) == ids[1:]


def test_post_processor_bos_is_not_doubled(tmp_path):
    both = Tokenizer.from_folder(_folder(tmp_path, post_processor=True, tokenizer_config={"add_bos_token": True}))
    ids = both.encode("Hello world")
    assert ids[:1] == [0] and ids[1] != 0
    only_post = Tokenizer.from_folder(_folder(tmp_path, post_processor=True, name="post"))
    assert only_post.encode("Hello world") == ids
    neither = Tokenizer.from_folder(_folder(tmp_path, name="plain"))
    assert neither.encode("Hello world") == ids[1:]


def test_decode_skips_special_tokens_unless_asked(tok):
    ids = [*tok.encode("Hello"), 1]
    assert tok.decode(ids) == "Hello"
    assert tok.decode(ids, skip_special_tokens=False) == f"{BOS}Hello{EOS}"


def test_eos_ids_merge_model_and_generation_config(tmp_path):
    folder = _folder(tmp_path, model_config={"model_type": "deepseek_v4", "eos_token_id": [1, 4]})
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert Tokenizer.from_folder(folder).eos_token_ids == [1, 4, 3]


def test_bos_from_model_config_when_tokenizer_config_has_none(tmp_path):
    folder = _folder(tmp_path, tokenizer_config={"bos_token": None, "add_bos_token": True},
                     model_config={"bos_token_id": 0})
    tok = Tokenizer.from_folder(folder)
    assert tok.bos_token == BOS and tok.encode("Hi")[0] == 0


def test_chat_template_renders(tok):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Bye"}]
    text = tok.apply_chat_template(messages)
    assert text == f"{BOS}{USER}Hi{ASSISTANT}Hello{EOS}{USER}Bye{ASSISTANT}"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == text.removesuffix(ASSISTANT)


def test_chat_template_tokenized_has_single_bos(tok):
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True)
    assert ids[0] == 0 and ids.count(0) == 1
    assert ids[1] == 3 and ids[-1] == 4  # <|User|> ... <|Assistant|> as single special tokens
    assert tok.decode(ids, skip_special_tokens=False) == f"{BOS}{USER}Hi{ASSISTANT}"


def test_chat_template_from_jinja_file_wins(tmp_path):
    folder = _folder(tmp_path)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert Tokenizer.from_folder(folder).apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"


def test_raise_exception_in_template(tok):
    with pytest.raises(TokenizerError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_template_is_sandboxed(tmp_path):
    folder = _folder(tmp_path, tokenizer_config={"chat_template": "{{ messages.append(1) }}"})
    with pytest.raises(TokenizerError, match="chat template failed"):
        Tokenizer.from_folder(folder).apply_chat_template([{"role": "user", "content": "x"}])
    folder = _folder(tmp_path, name="escape",
                     tokenizer_config={"chat_template": "{{ ''.__class__.__mro__[1].__subclasses__() }}"})
    with pytest.raises(TokenizerError):
        Tokenizer.from_folder(folder).apply_chat_template([])


def test_missing_chat_template_is_an_error(tmp_path):
    folder = _folder(tmp_path, tokenizer_config={"chat_template": None})
    with pytest.raises(TokenizerError, match="no chat template"):
        Tokenizer.from_folder(folder).apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_tokenizer_json_is_an_error(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerError, match=rf"no tokenizer\.json in {tmp_path}"):
        Tokenizer.from_folder(tmp_path)
