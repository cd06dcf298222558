"""A tiny Llama that vLLM's CPU build serves with dummy weights, and a tokenizer for it, so that
text load generators (guidellm) can drive it without a model download.

The model is a ``config.json`` alone (2 layers, 2 heads of 32 dims, a 512-token vocabulary),
served with ``--load-format dummy``. The tokenizer is a word-level one built with the
``tokenizers`` library: the word ``t<i>`` is token id ``i`` for every id from
:data:`~kvscope.rollout.trace_workload.FIRST_TOKEN` up, split on whitespace, and ``<pad>``,
``<s>``, ``</s>`` are ids 0, 1, 2 (the config's bos and eos). One word is one token and no
token is added, so a text prompt written by :func:`words` tokenizes to exactly the token ids it
was made from: a workload's shared prefixes reach the server's prefix cache unchanged.

``python -m kvscope.rollout.tiny_model DIR`` writes it to ``DIR``; ``tokenizers`` (a test
extra, and in every vLLM environment) is imported only to write the tokenizer.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path

from kvscope.files import write_atomic
from kvscope.rollout.trace_workload import FIRST_TOKEN

VOCAB = 512
SPECIALS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2: padding, bos, eos
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 1024,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float32",
          "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}


def word(token_id: int) -> str:
    """The word the tokenizer reads as ``token_id`` (ids below FIRST_TOKEN are special)."""
    return SPECIALS[token_id] if token_id < len(SPECIALS) else f"t{token_id}"


def words(token_ids: Iterable[int]) -> str:
    """Token ids as the text that tokenizes back to them (one word each, spaces between)."""
    return " ".join(word(i) for i in token_ids)


def tokenizer_json() -> str:
    """The tokenizer as ``tokenizer.json`` text (the ``tokenizers`` library's format)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    vocab = {word(i): i for i in range(VOCAB)}
    assert len(SPECIALS) == FIRST_TOKEN  # the workloads never put a special id in a prompt
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=SPECIALS[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.add_special_tokens(list(SPECIALS))
    return tokenizer.to_str()


def write(directory: str | Path, *, tokenizer: bool = True) -> Path:
    """Write the model's ``config.json`` (and, ``tokenizer``, ``tokenizer.json`` with the
    ``tokenizer_config.json`` that ``transformers.AutoTokenizer`` reads) into ``directory``,
    created if missing; each file whole or not at all. Returns the directory."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    files = {"config.json": json.dumps(CONFIG)}
    if tokenizer:
        files["tokenizer.json"] = tokenizer_json()
        files["tokenizer_config.json"] = json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "pad_token": SPECIALS[0],
            "bos_token": SPECIALS[1], "eos_token": SPECIALS[2], "unk_token": SPECIALS[0],
            "add_bos_token": False, "add_eos_token": False, "model_max_length": 1024,
            "clean_up_tokenization_spaces": False})
    for name, text in files.items():
        write_atomic(path / name, text)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit("usage: python -m kvscope.rollout.tiny_model DIR  (writes the tiny Llama's "
                 "config.json and its word-level tokenizer into DIR)")
    print(write(sys.argv[1]))
