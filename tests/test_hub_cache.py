"""`--init-from org/name` from the local Hugging Face cache (`shardlib.hf.hub_cache`), on a cache
directory built here as `huggingface_hub` lays one out (``models--org--name/refs/main`` naming a
commit, ``snapshots/<commit>/`` the files): the snapshot ``refs/main`` names is used and said; a
model not in the cache is one line, exit 2, with every socket refused (nothing is downloaded)."""

from __future__ import annotations

import socket

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from shardlib.cli import main  # noqa: E402
from shardlib.hf.hub_cache import cache_dir, resolve  # noqa: E402
from shardlib.hf.load import PretrainedError  # noqa: E402
from shardlib.run.config import TrainConfig  # noqa: E402
from shardlib.run.setup import _pretrained  # noqa: E402

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A cache holding ``tiny-org/tiny-llama`` at COMMIT (an older snapshot beside it, not main)."""
    root = tmp_path_factory.mktemp("hf_home") / "hub"
    repo = root / "models--tiny-org--tiny-llama"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    transformers.LlamaForCausalLM(config).save_pretrained(repo / "snapshots" / COMMIT)
    (repo / "snapshots" / ("f" * 40)).mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return root


@pytest.fixture
def offline(monkeypatch):
    """Any name lookup or outgoing connection fails the test (local socket pairs still work)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a network connection was attempted: nothing may be downloaded")

    for name in ("getaddrinfo", "create_connection"):
        monkeypatch.setattr(socket, name, refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


def test_the_cache_is_where_huggingface_hub_keeps_it(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert cache_dir() == tmp_path / "elsewhere"


def test_a_hub_id_opens_the_snapshot_refs_main_names(hub, monkeypatch, offline, capsys):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(hub.parent))
    directory, note = resolve("tiny-org/tiny-llama")
    assert directory == hub / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    pretrained = _pretrained(TrainConfig(init_from="tiny-org/tiny-llama", seq_len=16))
    assert pretrained.directory == directory and pretrained.model_config.d_model == 32
    assert f"init-from  tiny-org/tiny-llama from the Hugging Face cache: snapshot {COMMIT}" in capsys.readouterr().out


def test_a_local_directory_of_that_name_wins(hub, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    (tmp_path / "tiny-org" / "tiny-llama").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve("tiny-org/tiny-llama") == ((tmp_path / "tiny-org" / "tiny-llama").relative_to(tmp_path), None)


def test_a_model_not_in_the_cache_is_one_line_and_no_download(hub, monkeypatch, offline, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    with pytest.raises(PretrainedError, match="nothing is downloaded: fetch it first with huggingface-cli download"):
        resolve("tiny-org/absent")
    assert main(["train", "--init-from", "tiny-org/absent", "--steps", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardlib train: error: --init-from: tiny-org/absent is not a local directory "
                                               f"and not in the Hugging Face cache ({hub} holds no "
                                               "models--tiny-org--absent)"), err


def test_plan_reads_a_hub_id_from_the_cache_too(hub, monkeypatch, offline):
    from shardlib.tools.plan_candidates import PlanError, resolve_config

    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    assert resolve_config("tiny-org/tiny-llama").d_model == 32
    with pytest.raises(PlanError, match="tiny-org/absent is not a local directory and not in the Hugging Face cache"):
        resolve_config("tiny-org/absent")
