"""Chat templates as transformers 5 saves them (``chat_template.jinja``), rendered as transformers'
own ``apply_chat_template`` renders them: the same ids (the real BOS/EOS strings, a BOS never
doubled), the same assistant mask where the template has ``{% generation %}`` blocks, the template
compiled once and each conversation rendered once; an export carries the template and
generation_config.json, and ``apply_chat_template`` on it works.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from shardlib.hf import chat_template as chat_template_lib  # noqa: E402
from shardlib.hf.tokenizer import instruction_rows, load_tokenizer  # noqa: E402

CORPUS = "hello there, how are you? I am fine. bye see you later. def main(): return 0\n" * 30
SPECIALS = ["<s>", "<|im_start|>", "<|im_end|>"]
BODY = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}"
        "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PLAIN = BODY.replace("{% generation %}", "").replace("{% endgeneration %}", "")  # no blocks: content + EOS count
CHATS = [
    [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "I am fine."},
     {"role": "user", "content": "bye"}, {"role": "assistant", "content": "see you later"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "how are you?"},
     {"role": "assistant", "content": "fine"}],
    [{"role": "user", "content": "def main():"}, {"role": "assistant", "content": "  return 0  "}],
]


def _tokenizer_dir(root, template):
    """A byte-level BPE tokenizer whose post-processor adds a BOS, saved by transformers with ``template``."""
    root.mkdir(parents=True, exist_ok=True)
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator([CORPUS], vocab_size=300, show_progress=False, special_tokens=SPECIALS)
    bpe.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    bpe.save(str(root / "source.json"))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(root / "source.json"), bos_token="<s>",
                                              eos_token="<|im_end|>")
    hf.chat_template = template
    hf.save_pretrained(root)
    (root / "source.json").unlink()
    return root


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    return _tokenizer_dir(root / "blocks", BODY), _tokenizer_dir(root / "plain", PLAIN)


def _rows(tmp_path, tokenizer, chats, seq_len=96):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    return instruction_rows(tokenizer, data, seq_len=seq_len)


def _reference(directory, chat):
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    out = hf.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def test_transformers_5_writes_the_template_to_chat_template_jinja(tokenizer_dirs):
    blocks, _ = tokenizer_dirs
    assert (blocks / "chat_template.jinja").read_text() == BODY
    assert "chat_template" not in json.loads((blocks / "tokenizer_config.json").read_text())
    tokenizer = load_tokenizer(blocks)
    assert tokenizer.chat_template == BODY and tokenizer.template_file == blocks / "chat_template.jinja"
    assert tokenizer.special == {"bos_token": "<s>", "eos_token": "<|im_end|>"}
    assert tokenizer.encode("hello")[0] == 0  # the tokenizer adds a BOS of its own: a chat must not get two


def test_ids_and_generation_mask_equal_apply_chat_template(tokenizer_dirs, tmp_path):
    blocks, _ = tokenizer_dirs
    tokenizer = load_tokenizer(blocks)
    rows = _rows(tmp_path, tokenizer, CHATS)
    for k, chat in enumerate(CHATS):
        ids, mask = _reference(blocks, chat)
        assert ids.count(0) == 1 and sum(mask) > 0
        np.testing.assert_array_equal(rows.tokens[k][:len(ids)], ids)
        assert not rows.tokens[k][len(ids):].any()
        np.testing.assert_array_equal(rows.mask[k][:len(ids) - 1], mask[1:])  # target t counts when token t+1 does
        assert tokenizer.eos_id in [t for t, m in zip(ids, mask) if m]  # the model learns to stop


def test_without_generation_blocks_the_assistant_content_and_its_eos_count(tokenizer_dirs, tmp_path):
    """The same template without blocks: the same ids, and the same mask the blocks would mark."""
    blocks, plain = tokenizer_dirs
    rows = _rows(tmp_path, load_tokenizer(plain), CHATS)
    for k, chat in enumerate(CHATS):
        ids, mask = _reference(blocks, chat)
        assert _reference(plain, chat)[0] == ids
        np.testing.assert_array_equal(rows.tokens[k][:len(ids)], ids)
        np.testing.assert_array_equal(rows.mask[k][:len(ids) - 1], mask[1:])


def test_the_template_is_compiled_once_and_each_conversation_rendered_once(tokenizer_dirs, tmp_path, monkeypatch):
    blocks, _ = tokenizer_dirs
    compiled, renders = [], []
    environment, render = chat_template_lib._environment, chat_template_lib.ChatTemplate.render_marked
    monkeypatch.setattr(chat_template_lib, "_environment", lambda: compiled.append(1) or environment())
    monkeypatch.setattr(chat_template_lib.ChatTemplate, "render_marked",
                        lambda self, **kw: renders.append(len(kw["messages"])) or render(self, **kw))
    _rows(tmp_path, load_tokenizer(blocks), CHATS * 4)
    assert len(compiled) == 1
    assert renders == [len(c) for c in CHATS * 4]  # one render per conversation, of all its turns


def test_a_template_in_tokenizer_config_still_reads_and_the_jinja_file_wins(tokenizer_dirs, tmp_path):
    blocks, _ = tokenizer_dirs
    directory = tmp_path / "old"
    directory.mkdir()
    (directory / "tokenizer.json").write_bytes((blocks / "tokenizer.json").read_bytes())
    config = json.loads((blocks / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": [
        {"name": "tool_use", "template": "unused"}, {"name": "default", "template": PLAIN}]}))
    assert load_tokenizer(directory).chat_template == PLAIN
    (directory / "chat_template.jinja").write_text(BODY)
    assert load_tokenizer(directory).chat_template == BODY


def test_a_template_that_rewrites_the_content_without_blocks_is_one_line(tokenizer_dirs, tmp_path):
    _, plain = tokenizer_dirs
    directory = tmp_path / "upper"
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((plain / name).read_bytes())
    (directory / "chat_template.jinja").write_text(PLAIN.replace("m['content']", "m['content'] | upper"))
    with pytest.raises(ValueError, match=r"chat.jsonl:1: the chat template rewrites message 0's content.*generation"):
        _rows(tmp_path, load_tokenizer(directory), CHATS[:1])


def test_a_chat_run_exports_the_template_and_generation_config(tokenizer_dirs, tmp_path):
    """The issue's done-when: a tokenizer whose template lives in chat_template.jinja trains on chat rows
    (1 step from a transformers-written Llama), and the export's ``apply_chat_template`` is the tokenizer's."""
    torch = pytest.importorskip("torch")
    from shardlib.cli import main

    blocks, _ = tokenizer_dirs
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, bos_token_id=0, eos_token_id=2)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    generation = (tmp_path / "llama" / "generation_config.json").read_text()
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    assert main(["train", "--init-from", str(tmp_path / "llama"), "--tokenizer", str(blocks), "--data", str(data),
                 "--steps", "1", "--batch-size", "8", "--seq-len", "64", "--out", str(tmp_path / "R"),
                 "--no-progress", "--sample-tokens", "0", "--eval-every", "0"]) == 0
    assert main(["export", "--ckpt", str(tmp_path / "R"), "--out", str(tmp_path / "EXP"), "--hf"]) == 0
    exported = tmp_path / "EXP"
    assert (exported / "chat_template.jinja").read_text() == BODY
    assert (exported / "generation_config.json").read_text() == generation
    for chat in CHATS:
        assert _reference(exported, chat) == _reference(blocks, chat)
    prompt = transformers.AutoTokenizer.from_pretrained(exported).apply_chat_template(CHATS[1][:2], tokenize=False,
                                                                                      add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
