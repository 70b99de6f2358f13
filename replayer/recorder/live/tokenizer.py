"""A text tokenizer for the tiny models, which ship none (no model hub here).

Text clients (``vllm bench serve``, a chat UI) need one; the project's own
client sends token ids instead. A word-level tokenizer over the model's whole
vocabulary (``w0`` .. ``w<vocab_size-1>``, split on whitespace, no special
tokens) round-trips every id, so a text prompt of N words is N tokens and a
shared text prefix is a shared token prefix. Built with the ``tokenizers``
library vLLM already depends on; ``vllm serve --tokenizer DIR`` loads it as a
``PreTrainedTokenizerFast``.

    python -m replayer.recorder.live.tokenizer MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def write_word_tokenizer(model_dir: Path, out: Path) -> Path:
    """``tokenizer.json`` and ``tokenizer_config.json`` for ``model_dir``'s vocabulary
    in ``out`` (created); returns ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab_size = int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)   # joins words with spaces
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20,
         "clean_up_tokenization_spaces": False}, indent=1) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m replayer.recorder.live.tokenizer MODEL_DIR OUT_DIR", file=sys.stderr)
        return 2
    model = Path(args[0])
    if not (model / "config.json").is_file():
        print(f"{model}: no config.json (a model directory, e.g. replayer/models/tiny-llama)",
              file=sys.stderr)
        return 2
    print(write_word_tokenizer(model, Path(args[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
