"""Build the embedded byte-level BPE tokenizer from the embedded corpus.

    python scripts/build_tokenizer.py [--vocab-size 2048] [--out recipes/assets/tokenizer]

The result is deterministic for a given corpus and `tokenizers` version; the shipped
copy in recipes/assets/tokenizer was made with this script. The vocabulary size must
not exceed the model's (2048 for the debug flavors).
"""

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from recipes.data import TOKENIZER_DIR, corpus_paragraphs

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=TOKENIZER_DIR)
    args = parser.parse_args()

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_paragraphs(), trainer=trainer)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(args.out / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": False}
    (args.out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {args.out} (vocab {tokenizer.get_vocab_size()})")


if __name__ == "__main__":
    main()
