"""Tiny Hugging Face tokenizer directories built on the spot, for tests.

Tests never download anything, so a tokenizer is trained here in milliseconds
with the `tokenizers` library (byte-level BPE, the GPT-2 family's scheme) and
saved the way the Hub lays one out: tokenizer.json plus tokenizer_config.json,
loadable by ``tokenizers.Tokenizer.from_file`` and by
``transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)``.
"""

from __future__ import annotations

import json
import os

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
# Ids 0..3 in this order: trainers assign special tokens first.
SPECIAL_TOKENS = [BOS, EOS, UNK, PAD]

DEFAULT_TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "Peers train one model together over the internet, with no central server.",
    "import torch\nx = torch.zeros(4)\nprint(x.sum())\n",
    "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich.",
]


def build_tokenizer(directory: str, texts: list[str] | None = None, vocab_size: int = 320) -> str:
    """Train a byte-level BPE tokenizer on ``texts`` and save it as a Hugging Face
    tokenizer directory at ``directory`` (created if needed); returns the directory.

    Every byte is in the base alphabet, so any text encodes. The vocabulary has
    exactly ``vocab_size`` entries (at least 260: the 256 bytes and the special
    tokens): when BPE runs out of merges first, added tokens ``<extra_N>`` fill
    it up, so a test can ask for a vocabulary too big for uint16 shards.
    """
    os.makedirs(directory, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts if texts is not None else DEFAULT_TEXTS, trainer=trainer)
    missing = vocab_size - tokenizer.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        tokenizer.add_tokens([AddedToken(f"<extra_{i}>", special=False) for i in range(missing)])
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": PAD,
        "model_max_length": 1024,
        "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(directory, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD}, f, indent=2)
    return directory
