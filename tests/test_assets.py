import pytest

from oscar_compile import assets


class _Tok:
    """A stand-in tokenizer returning fixed ids (what a converter produced)."""

    def __init__(self, ids):
        self.ids = list(ids)

    def __call__(self, text):
        assert text == assets.CHECK_TEXT
        return type("Enc", (), {"input_ids": self.ids})()


def test_tokenizer_check_accepts_the_validated_ids():
    assets.check_tokenizer("gemma3-270m", _Tok(assets.MODELS["gemma3-270m"].tokenizer_check))


def test_tokenizer_check_refuses_a_converter_that_drops_bos():
    # what transformers 5.17 makes of Gemma 3's GGUF tokenizer: no BOS, words split differently
    bad = (818, 510, 702, 620, 1072, 563, 236743, 236812)
    with pytest.raises(assets.AssetError, match="gemma3-270m.*tokenizers"):
        assets.check_tokenizer("gemma3-270m", _Tok(bad))


def test_every_packaged_model_has_a_tokenizer_check():
    assert all(s.tokenizer_check and s.tokenizer_check[0] != s.tokenizer_check[1] for s in assets.MODELS.values())


def test_tokenizer_override_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("OSCAR_CACHE", str(tmp_path))
    assert assets.tokenizer_dir("gemma3-270m") is None
    d = tmp_path / "tokenizers" / "gemma3-270m"
    d.mkdir(parents=True)
    (d / "tokenizer_config.json").write_text("{}")
    assert assets.tokenizer_dir("gemma3-270m") == d
    assert assets.tokenizer_dir("not-a-model") is None
