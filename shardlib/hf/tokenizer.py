"""A Hugging Face tokenizer (``tokenizer.json``, through the ``tokenizers`` library) for training data.

Text is tokenized once and cached as a ``.npy`` token file beside the data, named by a digest
of the tokenizer and of the data files (path, size, modification time), so a rerun, or the
other processes of a job, read the cache instead of tokenizing again. Instruction data
(``.jsonl``: ``{"prompt", "completion"}`` rows, or chat ``{"messages"}`` rendered by the
tokenizer's chat template) becomes one padded row per example with a mask on the tokens the
loss counts: the completion's, or the assistant's turns.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from shardlib.runtime.files import AtomicFile

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers 5 saves the template (it wins over the config's)
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")  # the strings a template may write


class TokenizerError(ValueError):
    """A tokenizer or instruction file that cannot be used: one line naming the file and the fix."""

    user_facing = True


@dataclasses.dataclass
class Tokenizer:
    """A ``tokenizers.Tokenizer`` with the file it came from and its special tokens."""

    path: Path  # the tokenizer.json
    backend: Any  # tokenizers.Tokenizer
    eos_id: int | None
    chat_template: str | None
    template_file: Path | None = None  # where chat_template was read (named in its errors)
    special: dict[str, str] = dataclasses.field(default_factory=dict)  # bos_token, eos_token, ... as text
    _compiled: Any = dataclasses.field(default=None, repr=False)

    def template(self) -> Any:
        """The chat template, compiled once (`shardlib.hf.chat_template.ChatTemplate`)."""
        from shardlib.hf.chat_template import ChatTemplate

        if self._compiled is None:
            self._compiled = ChatTemplate(self.chat_template or "", str(self.template_file))
        return self._compiled

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=special).ids

    def decode(self, ids: Any) -> str:
        return self.backend.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=False)

    def digest(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()[:16]


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """``path``: a tokenizer.json, or a directory holding one (a Hugging Face model directory)."""
    try:
        import tokenizers
    except ImportError:
        raise TokenizerError("--tokenizer needs the tokenizers library: pip install 'shardlib[hf]'") from None
    given = Path(path).expanduser()
    file = given / TOKENIZER_FILE if given.is_dir() else given
    if not file.is_file():
        raise TokenizerError(f"no tokenizer at {given}: give a {TOKENIZER_FILE} or the directory holding one")
    try:
        backend = tokenizers.Tokenizer.from_file(str(file))
    except Exception as err:  # the library raises its own Exception subclasses for any bad file
        raise TokenizerError(f"{file} is not a tokenizers file: {' '.join(str(err).split())}") from None
    settings = _json(file.parent / TOKENIZER_CONFIG)
    special = {name: _token_text(settings.get(name)) for name in SPECIAL_TOKENS}
    special = {name: text for name, text in special.items() if text is not None}
    eos_id = backend.token_to_id(special["eos_token"]) if "eos_token" in special else None
    if eos_id is None:
        eos_id = _json(file.parent / "config.json").get("eos_token_id")
        eos_id = eos_id[0] if isinstance(eos_id, list) and eos_id else eos_id
    eos_id = eos_id if isinstance(eos_id, int) else None
    if "eos_token" not in special and eos_id is not None and backend.id_to_token(eos_id) is not None:
        special["eos_token"] = backend.id_to_token(eos_id)
    template, template_file = _chat_template(file.parent, settings)
    return Tokenizer(file, backend, eos_id, template, template_file, special)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's ``{"content": ...}``."""
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


def _chat_template(directory: Path, settings: dict[str, Any]) -> tuple[str | None, Path | None]:
    """The template and its file: ``chat_template.jinja`` (transformers 5) over the config's field,
    which may also be a list of named templates (the ``default`` one is taken)."""
    jinja = directory / CHAT_TEMPLATE_FILE
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8"), jinja
        except (OSError, UnicodeDecodeError) as err:
            raise TokenizerError(f"{jinja} cannot be read as UTF-8 text ({' '.join(str(err).split())}): fix or "
                                 "remove it") from None
    found = settings.get("chat_template")
    if isinstance(found, list):
        found = next((t.get("template") for t in found if isinstance(t, dict) and t.get("name") == "default"), None)
    return (found, directory / TOKENIZER_CONFIG) if isinstance(found, str) else (None, None)


def _json(path: Path) -> dict[str, Any]:
    try:
        found = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (ValueError, UnicodeDecodeError):
        return {}
    return found if isinstance(found, dict) else {}


def check_vocab(tokenizer: Tokenizer, vocab_size: int, model: str) -> None:
    """The model needs an embedding row for every id the tokenizer can produce."""
    if tokenizer.vocab_size > vocab_size:
        raise TokenizerError(f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} ids, and {model} embeds only "
                             f"{vocab_size}: use the tokenizer the model was trained with")


# --------------------------------------------------------------------------------------------
# Text -> a cached token file
# --------------------------------------------------------------------------------------------


def cache_path(tokenizer: Tokenizer, data: str, files: list[Path]) -> Path:
    """``<data>.<digest>.tokens.npy`` beside the data: the digest covers the tokenizer and each
    file's path, size and modification time, so an edit of either is a new cache."""
    h = hashlib.sha256(tokenizer.digest().encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    base = Path(data).expanduser()
    base = base / "corpus" if base.is_dir() else base.with_name(base.name.replace("*", "_"))
    return base.with_name(f"{base.name}.{h.hexdigest()[:16]}.tokens.npy")


def tokenize_text(tokenizer: Tokenizer, data: str) -> tuple[np.ndarray, Path, bool]:
    """(token ids, cache file, whether it was read from the cache) of the text ``data`` names (a
    file, folder or glob, as `shardlib.runtime.data.load_text` reads it). Every process of a job
    calls it: process 0 tokenizes (in chunks, streamed to the cache: `shardlib.hf.token_cache`),
    the others wait for the cache and read it."""
    import jax

    from shardlib.hf import token_cache
    from shardlib.runtime.data import resolve_text_files

    files = resolve_text_files(data)
    cache = cache_path(tokenizer, data, files)
    if cache.is_symlink():
        raise TokenizerError(f"the token cache {cache} is a symbolic link (to {os.readlink(cache)}); shardlib reads "
                             "and writes its cache only as a regular file beside the data: remove the link")
    found, ids, failed = cache.is_file(), None, None
    if not found and jax.process_index() == 0:
        try:
            ids = _tokenize(tokenizer, data, cache)
        except Exception as err:  # raised after the barrier: the others, finding no cache, raise it too
            failed = err
    token_cache.barrier(f"shardlib-token-cache-{cache.name}")  # every process, whatever it found
    if failed is not None:
        raise failed
    if ids is not None:
        return ids, cache, False
    if cache.is_file():
        return _cached_ids(cache, tokenizer.vocab_size), cache, found
    return _tokenize(tokenizer, data, cache), cache, False  # storage process 0's cache is not on


def _tokenize(tokenizer: Tokenizer, data: str, cache: Path) -> np.ndarray:
    """``data``'s ids, streamed into ``cache`` (then read back as a memory map), or in memory
    where the cache cannot be written (a read-only data directory: tokenized again next time)."""
    from shardlib.hf import token_cache
    from shardlib.runtime.data import load_text

    text = load_text(data).decode("utf-8", errors="replace")
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32)
    try:
        with AtomicFile(cache, what="the token cache") as f:  # whole or absent: a killed tokenization leaves none
            token_cache.stream(tokenizer.backend, text, f, dtype)
    except OSError:
        return np.concatenate([np.zeros(0, dtype), *token_cache.encoded(tokenizer.backend, text, dtype)])
    del text
    return _cached_ids(cache, tokenizer.vocab_size)


def _cached_ids(cache: Path, vocab_size: int) -> np.ndarray:
    """The ids of a token cache, once they are what a tokenizer of ``vocab_size`` ids writes: a
    1-D unsigned array, every id below ``vocab_size`` (a cache edited or left by another tokenizer
    would train on ids without an embedding row, to a NaN loss)."""
    try:
        ids = np.load(cache, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as err:
        raise TokenizerError(f"the token cache {cache} cannot be read ({' '.join(str(err).split())}): delete it, "
                             "and the next run tokenizes again") from None
    if ids.dtype.kind != "u" or ids.ndim != 1:
        raise TokenizerError(f"the token cache {cache} holds a {ids.dtype} array of shape {ids.shape}, not the 1-D "
                             "unsigned ids shardlib writes: delete it, and the next run tokenizes again")
    largest = int(ids.max()) if ids.size else -1
    if largest >= vocab_size:
        raise TokenizerError(f"the token cache {cache} holds token id {largest}, and the tokenizer has {vocab_size} "
                             "ids: delete it, and the next run tokenizes again")
    return ids


# --------------------------------------------------------------------------------------------
# Instruction data -> padded rows with a loss mask
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class InstructionRows:
    """One row per example: ``tokens`` uint32[N, T + 1] (padded with 0), ``mask`` float32[N, T]
    (1 where the target token counts), how many examples were cut at T + 1 tokens, and each
    example's tokens before padding (``lengths`` int64[N]: packing and the padding counted)."""

    tokens: np.ndarray
    mask: np.ndarray
    truncated: int
    lengths: np.ndarray | None = None


def instruction_rows(tokenizer: Tokenizer, path: str | os.PathLike[str], seq_len: int) -> InstructionRows:
    """The examples of a ``.jsonl`` file, each ``{"prompt": ..., "completion": ...}`` or
    ``{"messages": [{"role": ..., "content": ...}, ...]}``, tokenized and padded to ``seq_len + 1``."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise TokenizerError(f"instruction file {path} does not exist")
    rows, masks, lengths, truncated = [], [], [], 0
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            ids, counted = _example(tokenizer, _row(line, path, number), path, number, seq_len + 1)
            truncated += len(ids) > seq_len + 1
            ids, counted = ids[:seq_len + 1], counted[:seq_len + 1]
            row = np.zeros(seq_len + 1, np.uint32)
            row[:len(ids)] = ids
            mask = np.zeros(seq_len + 1, np.float32)
            mask[:len(counted)] = counted
            rows.append(row)
            lengths.append(len(ids))
            masks.append(mask[1:])  # a target counts when the token it predicts does
    if not rows:
        raise TokenizerError(f"instruction file {path} has no examples")
    tokens, mask = np.stack(rows), np.stack(masks)
    if not mask.any():
        raise TokenizerError(f"instruction file {path}: no example has a completion token within {seq_len} tokens; "
                             "raise --seq-len or shorten the prompts")
    return InstructionRows(tokens, mask, truncated, np.asarray(lengths, np.int64))


def _row(line: str, path: Path, number: int) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except (ValueError, RecursionError) as err:
        raise TokenizerError(f"{path}:{number} is not JSON this reads ({type(err).__name__}: "
                             f"{' '.join(str(err).split())[:200]})") from None
    if not isinstance(row, dict):
        raise TokenizerError(f"{path}:{number} holds {type(row).__name__}; each line is an object")
    return row


CHARS_PER_TOKEN = 16  # text cut at this many characters per token kept, before it is tokenized


def _encode_cut(tokenizer: Tokenizer, text: str, budget: int, *, special: bool = True) -> list[int]:
    """The ids of ``text``, cut before tokenizing when it is far longer than ``budget`` tokens need:
    memory stays bounded by ``--seq-len``, not by the line (a 100 MB line is not tokenized whole).
    A cut yields more than ``budget`` ids (then the row is counted as cut), else a longer cut is tried."""
    limit = max(budget, 1) * CHARS_PER_TOKEN
    while len(text) > limit:
        ids = tokenizer.encode(text[:limit], special=special)
        if len(ids) > budget + 8:  # the tokens the cut may have changed lie past the budget
            return ids
        limit *= 4
    return tokenizer.encode(text, special=special)


def _example(tokenizer: Tokenizer, row: dict[str, Any], path: Path, number: int,
             budget: int) -> tuple[list[int], list[int]]:
    """(token ids, 1 for each token the loss counts): a completion's tokens and its end token."""
    if isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
        prompt = _encode_cut(tokenizer, row["prompt"], budget)
        completion = _encode_cut(tokenizer, row["completion"], budget - len(prompt), special=False)
        completion += [tokenizer.eos_id] if tokenizer.eos_id is not None else []
        return prompt + completion, [0] * len(prompt) + [1] * len(completion)
    if isinstance(row.get("messages"), list):
        return _chat(tokenizer, row["messages"], path, number, budget)
    raise TokenizerError(f"{path}:{number} has neither string 'prompt' and 'completion' fields nor a 'messages' list")


def _chat(tokenizer: Tokenizer, messages: list[Any], path: Path, number: int,
          budget: int) -> tuple[list[int], list[int]]:
    """A conversation rendered once by the chat template, with the tokenizer's BOS/EOS strings, and
    tokenized as transformers' ``apply_chat_template`` does (no special tokens added: a BOS the
    template writes is not doubled). The tokens the loss counts: the template's ``{% generation %}``
    blocks where it has them; otherwise each assistant message's content and the EOS the template
    writes right after it (`_assistant_spans`)."""
    if tokenizer.chat_template is None:
        raise TokenizerError(f"{path}:{number} is a chat ('messages'), and {tokenizer.path.parent} has no chat template "
                             f"({CHAT_TEMPLATE_FILE}, or chat_template in {TOKENIZER_CONFIG}) to render it: use "
                             "prompt/completion rows, or a tokenizer with one")
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
               for m in messages):
        raise TokenizerError(f"{path}:{number}: each message needs string 'role' and 'content' fields")
    template = tokenizer.template()
    cut = budget * CHARS_PER_TOKEN  # the text --seq-len can keep bounds what is rendered
    kept, size = [], 0
    for m in messages:
        if size > cut:  # later turns would be cut anyway: not rendered
            break
        kept.append({**m, "content": m["content"][:cut]})
        size += len(kept[-1]["content"])
    text, spans = template.render_marked(messages=kept, add_generation_prompt=False, **tokenizer.special)
    if not template.has_generation:
        spans = _assistant_spans(text, kept, tokenizer.special.get("eos_token"), path, number)
    encoding = tokenizer.backend.encode(text, add_special_tokens=False)
    counted = [int(any(a < end and start < b for start, end in spans)) for a, b in encoding.offsets]
    return list(encoding.ids), counted


def _assistant_spans(text: str, messages: list[dict[str, Any]], eos: str | None, path: Path,
                     number: int) -> list[tuple[int, int]]:
    """Each message's content found in order in ``text``; an assistant's span is its content and the
    EOS string when the template writes it next (after whitespace at most): what it must learn to end with."""
    spans, at = [], 0
    for i, m in enumerate(messages):
        content = m["content"]
        start = text.find(content, at)
        if start < 0 and content.strip():
            content = content.strip()
            start = text.find(content, at)
        if start < 0:
            raise TokenizerError(f"{path}:{number}: the chat template rewrites message {i}'s content, so its tokens "
                                 "cannot be found; mark the assistant's text with {% generation %} blocks in the "
                                 "template, or use prompt/completion rows")
        at = start + len(content)
        if m["role"] == "assistant":
            end = at
            rest = len(text[at:]) - len(text[at:].lstrip())
            if eos and text.startswith(eos, at + rest):
                end = at + rest + len(eos)
            spans.append((start, end))
            at = end
    return spans
