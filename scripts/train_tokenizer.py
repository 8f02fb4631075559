"""Train the project's offline tokenizer on the bundled corpus: atorch/data/assets/tokenizer/.

A byte-level BPE trained with vocab_size=1024, an upper bound: the bundled corpus runs out of
merges at 845 entries (ids 0..844), which the tiny models' vocab_size=1024 covers. Saved as a
`transformers` fast tokenizer so `AutoTokenizer.from_pretrained(dir)` loads it offline.

    python scripts/train_tokenizer.py
"""

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ASSETS = Path(__file__).resolve().parents[1] / "atorch" / "data" / "assets"
VOCAB_SIZE = 1024
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}


def main() -> None:
    tok = Tokenizer(models.BPE(unk_token=SPECIAL["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(ASSETS / "corpus.txt")], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=4096, **SPECIAL)
    out = ASSETS / "tokenizer"
    fast.save_pretrained(str(out))
    print(f"wrote {out} (vocab {fast.vocab_size})")


if __name__ == "__main__":
    main()
