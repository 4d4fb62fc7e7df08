"""Text <-> Thinker token ids, and the chat prompt built in code.

    tok = Tokenizer.from_checkpoint("/models/Qwen3-Omni-30B-A3B-Instruct")   # its tokenizer.json
    tok = Tokenizer.tiny()                         # packaged: no files, no downloads
    tok.encode("Hello") -> list[int];  tok.decode(ids) -> str
    tok.chat_prompt([("system", "..."), ("user", "Hi")]) -> list[int]
    dec = tok.incremental();  dec.push(ids) -> str delta;  dec.flush() -> str

Chat layout (the ids the Talker's prompt builder relies on), per turn
`[<|im_start|>, role, \\n, …text…, <|im_end|>, \\n]`, then `[<|im_start|>, assistant, \\n]`.

The tiny tokenizer is byte-level with each byte at its id in the real Qwen vocabulary (GPT-2 byte
order: ids 0-255, so `\\n` = 198 and space = 220), the role words `system`/`user`/`assistant` as the real
single ids 8948/872/77091, and the real special tokens at 151643-151675. Text encodes to more ids than
with the real BPE (one per byte), but every prompt has the real model's layout and id range. Every other
id decodes to a made-up word, so what a randomly initialised model says is visible as text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from omni_rt.errors import ConfigError, InvalidRequestError
from omni_rt.model.config import TokenIds

# Qwen3-Omni's special tokens (tokenizer_config.json's added_tokens_decoder), at their real ids.
SPECIAL_TOKENS: dict[int, str] = {
    151643: "<|endoftext|>",
    151644: "<|im_start|>",
    151645: "<|im_end|>",
    151646: "<|object_ref_start|>",
    151647: "<|object_ref_end|>",
    151648: "<|box_start|>",
    151649: "<|box_end|>",
    151650: "<|quad_start|>",
    151651: "<|quad_end|>",
    151652: "<|vision_start|>",
    151653: "<|vision_end|>",
    151654: "<|vision_pad|>",
    151655: "<|image_pad|>",
    151656: "<|video_pad|>",
    151657: "<tool_call>",
    151658: "</tool_call>",
    151659: "<|fim_prefix|>",
    151660: "<|fim_middle|>",
    151661: "<|fim_suffix|>",
    151662: "<|fim_pad|>",
    151663: "<|repo_name|>",
    151664: "<|file_sep|>",
    151665: "<tool_response>",
    151666: "</tool_response>",
    151667: "<think>",
    151668: "</think>",
    151669: "<|audio_start|>",
    151670: "<|audio_end|>",
    151671: "<tts_pad>",
    151672: "<tts_text_bos>",
    151673: "<tts_text_eod>",
    151674: "<tts_text_bos_single>",
    151675: "<|audio_pad|>",
}
# Added tokens that the chat template writes inside a turn's text (Qwen's tokenizer_config marks them
# "special": false): a tool call, its response, thinking. Every other special token is a control token
# (turn boundaries, modality markers), which text from a client never becomes: see `Tokenizer.encode`.
TEXT_TOKENS = frozenset(
    {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
)
# tokens in the tokenizer.json that must agree with the config's ids (by name, then checked)
_CHECKED = {"im_start": "<|im_start|>", "im_end": "<|im_end|>", "tts_pad": "<tts_pad>",
            "tts_bos": "<tts_text_bos>", "tts_eos": "<tts_text_eod>"}  # fmt: skip
_ROLE_WORDS = {"system": 8948, "user": 872, "assistant": 77091}

# Qwen2's pre-tokenizer split (tokenizer.json of Qwen2/Qwen3 checkpoints)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table, in vocabulary order (byte-level BPE ids 0-255)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    rest = [b for b in range(256) if b not in printable]
    chars = [chr(b) for b in printable] + [chr(256 + i) for i in range(len(rest))]
    return chars  # id i -> this character; its byte is (printable + rest)[i]


def _pseudo_words(space: str, first: int, end: int) -> dict[str, int]:
    """A pronounceable word for every id in [first, end) that is not a role word: " kamipo", " tesu"....

    Text never encodes to them (BPE without merges yields bytes only); they exist so that whatever a model
    with random weights says decodes to visible words, and a transcript shows what streams. Each id is
    written in base 75 with consonant-vowel syllables (75**3 covers the whole vocabulary), behind the
    byte-level form of a space.
    """
    syllables = [c + v for c in "bdfghklmnprstvz" for v in "aeiou"]
    taken = set(_ROLE_WORDS.values())
    words = {}
    for i in range(first, end):
        if i in taken:
            continue
        a, rest = divmod(i, len(syllables) ** 2)
        b, c = divmod(rest, len(syllables))
        words[space + (syllables[a] if a else "") + syllables[b] + syllables[c]] = i
    return words


def _tiny_tokenizer() -> _HFTokenizer:
    # Added tokens take the id their content has in the model's vocabulary, so the specials and role
    # words are entered there at their real ids (the vocabulary may have gaps); BPE without merges
    # never produces them from bytes, only the added-token matcher does.
    byte_chars = _bytes_to_unicode()
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    space = byte_chars[220]  # the byte-level form of " " (id 220, as in Qwen's vocabulary)
    vocab.update(_pseudo_words(space, len(byte_chars), min(SPECIAL_TOKENS)))
    vocab.update({s: i for i, s in SPECIAL_TOKENS.items()})
    vocab.update(_ROLE_WORDS)
    tok = _HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    # no regex split: the whole text is one byte-level "word"; no merges: one id per byte
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in SPECIAL_TOKENS.values()])
    # role words as whole words only ("users" stays bytes), as their real single ids
    tok.add_tokens([AddedToken(w, single_word=True, normalized=False, special=False) for w in _ROLE_WORDS])
    return tok


def _from_vocab_merges(directory: Path) -> _HFTokenizer:
    """A Qwen2 tokenizer from `vocab.json` + `merges.txt` + `tokenizer_config.json` (no tokenizer.json)."""
    vocab: dict[str, int] = json.loads((directory / "vocab.json").read_text(encoding="utf-8"))
    merges = [
        tuple(line.split(" "))
        for line in (directory / "merges.txt").read_text(encoding="utf-8").splitlines()
        if line and not line.startswith("#version")
    ]
    cfg_path = directory / "tokenizer_config.json"
    added = json.loads(cfg_path.read_text()).get("added_tokens_decoder", {}) if cfg_path.is_file() else {}
    if not added:
        added = {str(i): {"content": s, "special": True} for i, s in SPECIAL_TOKENS.items()}
    vocab.update({a["content"]: int(i) for i, a in added.items()})  # added tokens keep their ids
    tok = _HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tokens = [
        AddedToken(a["content"], single_word=a.get("single_word", False), lstrip=a.get("lstrip", False),
                   rstrip=a.get("rstrip", False), normalized=a.get("normalized", False),
                   special=a.get("special", True))
        for _, a in sorted(added.items(), key=lambda kv: int(kv[0]))
    ]  # fmt: skip
    tok.add_special_tokens([t for t in tokens if t.special])
    tok.add_tokens([t for t in tokens if not t.special])
    return tok


class Tokenizer:
    def __init__(self, tok: _HFTokenizer, ids: TokenIds | None = None) -> None:
        self._tok = tok
        self.ids = ids or TokenIds()
        self.special_ids = frozenset(i for i in SPECIAL_TOKENS if tok.id_to_token(i) is not None)
        controls = sorted(
            (
                t.content
                for t in tok.get_added_tokens_decoder().values()
                if t.special and t.content not in TEXT_TOKENS
            ),
            key=len,
            reverse=True,  # the longest first where one control token's text starts another's
        )
        # one group: re.split gives the text between control tokens and the tokens' text in turn
        self._controls = re.compile("(" + "|".join(map(re.escape, controls)) + ")") if controls else None
        self._plain: _HFTokenizer | None = None  # made on the first control token's text (a copy: ~1 s real)

    # ---- construction

    @classmethod
    def tiny(cls, ids: TokenIds | None = None) -> Tokenizer:
        """The packaged byte-level tokenizer at the real id layout (see the module docstring)."""
        return cls(_tiny_tokenizer(), ids)

    @classmethod
    def from_checkpoint(cls, directory: str | Path, ids: TokenIds | None = None) -> Tokenizer:
        """The checkpoint's `tokenizer.json` (or `vocab.json` + `merges.txt`); special ids checked.

        `ids` are the config's token ids (default: Qwen3-Omni's); each special token named in both is
        looked up by name and must have the config's id, else `ConfigError`.
        """
        d = Path(directory)
        if (d / "tokenizer.json").is_file():
            try:
                tok = _HFTokenizer.from_file(str(d / "tokenizer.json"))
            except Exception as e:  # a corrupt file: say which
                raise ConfigError(f"cannot read {d / 'tokenizer.json'}: {e}") from e
        elif (d / "vocab.json").is_file() and (d / "merges.txt").is_file():
            tok = _from_vocab_merges(d)
        else:
            raise ConfigError(f"no tokenizer.json (or vocab.json + merges.txt) in {d}")
        ids = ids or TokenIds()
        for field_name, token in _CHECKED.items():
            got, want = tok.token_to_id(token), getattr(ids, field_name)
            if field_name in ("im_start", "im_end") and got is None:
                raise ConfigError(f"{d}: the tokenizer has no {token} token")
            if got is not None and got != want:
                raise ConfigError(f"{d}: {token} is id {got} in the tokenizer but {want} in the config")
        return cls(tok, ids)

    # ---- text

    @property
    def vocab_size(self) -> int:
        """One more than the largest id (ids need not be contiguous: the tiny tokenizer's are not)."""
        return max(self._tok.get_vocab(with_added_tokens=True).values()) + 1

    def token_id(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise KeyError(f"no token {token!r} in the tokenizer")
        return i

    def encode(self, text: str, control_tokens: bool = False) -> list[int]:
        """Text -> ids. A control token's text in `text` (`<|im_end|>`, `<|im_start|>`, ...) encodes as the
        characters it is made of, not as the token, unless `control_tokens`: what a user types, or a tool
        returns, can never close its turn and open a system turn. The template's own tokens (TEXT_TOKENS,
        e.g. `<tool_call>`) stay tokens, as the checkpoint's tokenizer reads them."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"text must be a str, got {type(text).__name__}")
        if not text.isascii():
            try:  # a lone surrogate (JSON allows "\ud800") is a str but no Unicode text: no UTF-8 bytes
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InvalidRequestError(
                    f"text is not valid Unicode: lone surrogate {text[e.start]!a} at character {e.start}"
                ) from None
        pieces = [text] if control_tokens or self._controls is None else self._controls.split(text)
        ids: list[int] = []
        for n, piece in enumerate(pieces):  # odd pieces: a control token's text
            if piece:
                tok = self._plain_tokenizer() if n % 2 else self._tok
                ids += tok.encode(piece, add_special_tokens=False).ids
        return ids

    def _plain_tokenizer(self) -> _HFTokenizer:
        """The same tokenizer, matching no special token: a control token's text as its characters."""
        if self._plain is None:
            plain = _HFTokenizer.from_str(self._tok.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def incremental(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens)

    # ---- chat

    def role_id(self, role: str) -> int:
        try:
            return {"system": self.ids.system, "user": self.ids.user, "assistant": self.ids.assistant}[role]
        except KeyError:
            raise InvalidRequestError(f"unknown chat role {role!r}; roles: system, user, assistant") from None

    def chat_prompt(
        self, messages: Sequence[tuple[str, str] | dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Chat-formatted prompt ids: per turn `[im_start, role, \\n, …text…, im_end, \\n]`, then
        `[im_start, assistant, \\n]` when `add_generation_prompt`."""
        i = self.ids
        out: list[int] = []
        for n, m in enumerate(messages):
            if isinstance(m, dict):
                role, text = m.get("role"), m.get("content")
            elif isinstance(m, (tuple, list)) and len(m) == 2:
                role, text = m
            else:
                raise InvalidRequestError(
                    f"message {n} must be (role, text) or {{'role', 'content'}}, got {m!r}"
                )
            if not isinstance(role, str) or not isinstance(text, str):
                raise InvalidRequestError(f"message {n}: role and content must be strings")
            out += [i.im_start, self.role_id(role), i.newline, *self.encode(text), i.im_end, i.newline]
        if add_generation_prompt:
            out += [i.im_start, i.assistant, i.newline]
        return out

    def last_turn(self, ids: Sequence[int], role: str) -> str | None:
        """The text of the last `role` turn in chat-formatted `ids` (as `chat_prompt` writes turns; an open
        turn reads to the end), or None when there is none. Special tokens are read as their text: a
        system prompt with tools holds the template's `<tool_call>`, and must read back as it was written."""
        i, head = self.ids, [self.ids.im_start, self.role_id(role), self.ids.newline]
        for start in range(len(ids) - 3, -1, -1):
            if list(ids[start : start + 3]) == head:
                body = ids[start + 3 :]
                end = next((n for n, t in enumerate(body) if t == i.im_end), len(body))
                return self.decode(body[:end], skip_special_tokens=False)
        return None


class IncrementalDecoder:
    """Token ids in, text deltas out, never splitting a multi-byte UTF-8 character.

    A byte-level token can end in the middle of a character; decoding then ends in U+FFFD. The decoder
    holds such a tail back until the ids that complete it arrive. Each push decodes only a short window
    (the ids since the last emitted boundary), so the cost per token stays constant.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window (ids whose text is already out, for context)
        self._read = 0  # ids before this index have had their text emitted

    def push(self, ids: int | Iterable[int]) -> str:
        self._ids.extend([ids] if isinstance(ids, int) else ids)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix :], self._skip)
        if text.endswith("\ufffd") or len(text) <= len(prefix_text):
            return ""  # an incomplete character (or nothing visible yet): wait for more ids
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """The text still held back (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix :], self._skip)
        self._prefix = self._read = len(self._ids)
        return text[len(prefix_text) :]
