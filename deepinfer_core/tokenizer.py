"""Tokenizer: a thin wrapper around a checkpoint's ``tokenizer.json`` and its chat template.

Special tokens come from ``tokenizer_config.json`` (``bos_token``, ``eos_token``, ``pad_token``,
``add_bos_token`` ...), falling back to the ids in ``config.json`` / ``generation_config.json``. Chat
templates are rendered in a jinja2 ``ImmutableSandboxedEnvironment``: templates are untrusted input.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from deepinfer_core.errors import DeepInferError


class TokenizerError(DeepInferError, ValueError):
    """A tokenizer folder that cannot be used, or a chat template that failed, with what to do."""


class Tokenizer:
    """Encode, decode and chat-format text for one checkpoint."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        tokenizer_config: dict[str, Any] | None = None,
        model_config: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> None:
        """Wrap a ``tokenizers.Tokenizer``; most callers use :meth:`from_folder` instead."""
        self._tok = tokenizer
        self.config = dict(tokenizer_config or {})
        self._model_config = dict(model_config or {})
        self.chat_template = chat_template if chat_template is not None else _template_from_config(self.config)
        self.bos_token = self._special("bos_token", "bos_token_id")
        self.eos_token = self._special("eos_token", "eos_token_id")
        self.pad_token = self._special("pad_token", "pad_token_id")
        self.unk_token = self._special("unk_token", None)
        self.add_bos_token = bool(self.config.get("add_bos_token", False))
        self.add_eos_token = bool(self.config.get("add_eos_token", False))

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` plus ``tokenizer_config.json``, ``config.json``, ``generation_config.json``
        and ``chat_template.jinja`` (each optional except tokenizer.json) from a checkpoint folder."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(
                f"no tokenizer.json in {folder}; this engine needs the fast tokenizer file. Re-download the "
                "checkpoint, or create it with transformers: AutoTokenizer.from_pretrained(src).save_pretrained(dst)"
            )
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for malformed files
            raise TokenizerError(f"{path} could not be parsed ({exc}); re-download the checkpoint") from None
        model_config = _read_json(folder / "config.json")
        generation = _read_json(folder / "generation_config.json")
        if "eos_token_id" in generation:
            model_config = {**model_config, "generation_eos_token_id": generation["eos_token_id"]}
        template_file = folder / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else None
        return cls(tok, _read_json(folder / "tokenizer_config.json"), model_config, template)

    def _special(self, key: str, id_key: str | None) -> str | None:
        value = self.config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if value is None and id_key is not None:
            token_id = self._model_config.get(id_key)
            if isinstance(token_id, list):
                token_id = token_id[0] if token_id else None
            value = self._tok.id_to_token(token_id) if isinstance(token_id, int) else None
        return value

    # ----------------------------------------------------------------- ids and vocab
    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        """Id of a token string, or None when it is not in the vocabulary."""
        return None if token is None else self._tok.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        """Id of the beginning-of-sequence token, or None."""
        return self.token_to_id(self.bos_token)

    @property
    def pad_token_id(self) -> int | None:
        """Id of the padding token, or None."""
        return self.token_to_id(self.pad_token)

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation: the tokenizer's eos token plus the model/generation config ids."""
        ids = [self.token_to_id(self.eos_token)]
        for key in ("eos_token_id", "generation_eos_token_id"):
            value = self._model_config.get(key)
            ids += value if isinstance(value, list) else [value]
        return list(dict.fromkeys(i for i in ids if isinstance(i, int)))

    @property
    def special_token_ids(self) -> set[int]:
        """Ids of all special added tokens (bos, eos, chat role markers ...)."""
        return {i for i, tok in self._tok.get_added_tokens_decoder().items() if tok.special}

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | None | list[str | None]:
        """Token strings for ids (a single id gives a single string)."""
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        return [self._tok.id_to_token(i) for i in ids]

    # ----------------------------------------------------------------- encode / decode
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``text``.

        With ``add_special_tokens`` the tokenizer's post-processor runs, and BOS (EOS) is added when
        ``tokenizer_config.json`` says ``add_bos_token`` (``add_eos_token``) and the post-processor did
        not already add it, so BOS is never doubled.
        """
        _check_text(text)
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if not add_special_tokens:
            return ids
        bos, eos = self.bos_token_id, self.token_to_id(self.eos_token)
        if self.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        if self.add_eos_token and eos is not None and (not ids or ids[-1] != eos):
            ids = [*ids, eos]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text for token ids, dropping special tokens unless ``skip_special_tokens`` is False."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ----------------------------------------------------------------- chat
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render ``messages`` with the checkpoint's chat template (sandboxed jinja2).

        Extra keyword arguments (``tools``, ``thinking`` ...) are passed to the template. With
        ``tokenize`` the rendered text is encoded without adding special tokens again (the template
        writes BOS itself). Raises TokenizerError when there is no template or the template raises.
        """
        if not self.chat_template:
            raise TokenizerError(
                "this checkpoint has no chat template (no 'chat_template' in tokenizer_config.json and no "
                "chat_template.jinja); format the prompt yourself and call encode(), or add a chat template"
            )
        variables = {
            **_plain(kwargs),
            "messages": _plain(messages),
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": self.pad_token or "",
            "unk_token": self.unk_token or "",
        }
        try:
            text = _compile(self.chat_template).render(**variables)
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"the chat template failed: {exc}") from exc
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _check_text(text: str) -> None:
    """Raise TokenizerError when ``text`` is not a string of Unicode text (a byte that was not UTF-8, kept by Python's
    ``surrogateescape`` as a lone surrogate, cannot be tokenized)."""
    if not isinstance(text, str):
        raise TokenizerError(f"a prompt must be text (str), got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:04X}"
        raise TokenizerError(f"the text is not valid UTF-8 ({what} at character {exc.start}); pass UTF-8 text") \
            from None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        content = json.loads(path.read_text())
    except ValueError as exc:  # invalid JSON, or bytes that are not UTF-8
        raise TokenizerError(f"{path} is not valid JSON ({exc}); re-download the checkpoint") from None
    if not isinstance(content, dict):
        raise TokenizerError(f"{path} holds a {type(content).__name__}, not a JSON object; fix or re-download it")
    return content


def _template_from_config(config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def _plain(value: Any) -> Any:
    """A copy of ``value`` built only from JSON types, so the template sees no live Python objects."""
    return json.loads(json.dumps(value, default=str))


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore attributes, so templates cannot reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja2's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.sandbox.SecurityError(f"chat templates may not set underscore attributes ({name!r})")


_TEMPLATES: dict[str, jinja2.Template] = {}


def _compile(source: str) -> jinja2.Template:
    if source not in _TEMPLATES:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace)
        try:
            _TEMPLATES[source] = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TokenizerError(f"the chat template is not valid jinja2 (line {exc.lineno}: {exc.message})") from None
    return _TEMPLATES[source]
