"""Chat rows: shardlib's one render per conversation (template compiled once) against the former
way, a render and a tokenization of every prefix of the conversation (template compiled per
conversation). Both in this process; the minimum of 3 runs each, and their ratio.

    python scripts/benchmark_chat_rows.py [TURNS ...]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import tokenizers

from shardlib.hf.chat_template import ChatTemplate
from shardlib.hf.tokenizer import instruction_rows, load_tokenizer

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% generation %}{{ m['content'] }}"
            "{{ eos_token }}{% endgeneration %}\n{% endfor %}")
CONVERSATIONS = 50


def _tokenizer(root: Path):
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(["hello there, how are you? I am fine."] * 20, vocab_size=300, show_progress=False,
                            special_tokens=["<s>", "<|im_start|>", "<|im_end|>"])
    bpe.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "<|im_end|>"}))
    (root / "chat_template.jinja").write_text(TEMPLATE)
    return load_tokenizer(root)


def _best(fn) -> float:
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(turns_list: list[int]) -> None:
    root = Path(tempfile.mkdtemp())
    tok = _tokenizer(root)
    for turns in turns_list:
        chat = [{"role": ("user", "assistant")[i % 2], "content": "hello there, how are you? " * 3} for i in range(turns)]
        data = root / f"chat{turns}.jsonl"
        data.write_text((json.dumps({"messages": chat}) + "\n") * CONVERSATIONS)

        def prefixes() -> None:
            for _ in range(CONVERSATIONS):
                template, ids = ChatTemplate(tok.chat_template, "bench"), []
                for i in range(turns):
                    ids += tok.encode(template.render(messages=chat[:i + 1], **tok.special))[len(ids):]

        def once() -> None:
            tok._compiled = None  # compiled once per run, as a training run does
            instruction_rows(tok, data, seq_len=40 * turns)

        before, after = _best(prefixes), _best(once)
        print(f"{turns:3d} turns x {CONVERSATIONS} conversations: prefixes {before:.3f} s, one render {after:.3f} s, "
              f"{before / after:.1f}x")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [4, 16, 64])
