"""The word-level tokenizer for text clients of the tiny models (replayer/recorder/live/tokenizer.py)."""

from __future__ import annotations

from conftest import REPO
from replayer.recorder.live.tokenizer import main, write_word_tokenizer

MODEL = REPO / "replayer" / "models" / "tiny-llama"


def test_every_id_round_trips_through_text(tmp_path):
    from tokenizers import Tokenizer

    out = write_word_tokenizer(MODEL, tmp_path / "tok")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = [0, 5, 77, 31999]
    assert tok.encode(tok.decode(ids)).ids == ids
    assert tok.get_vocab_size() == 32000


def test_bad_arguments_exit_2_in_one_line(tmp_path, capsys):
    assert main([]) == 2
    assert capsys.readouterr().err.startswith("usage: python -m replayer.recorder.live.tokenizer")
    assert main([str(tmp_path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == (f"{tmp_path}: no config.json (a model directory, "
                   "e.g. replayer/models/tiny-llama)\n")
    assert not (tmp_path / "out").exists()
