"""Paths of the bundled corpus and tokenizer (shipped inside the package, used offline)."""

from pathlib import Path
from typing import List, Optional

ASSETS_DIR = Path(__file__).resolve().parents[1] / "data" / "assets"
CORPUS_PATH = ASSETS_DIR / "corpus.txt"
TOKENIZER_DIR = ASSETS_DIR / "tokenizer"


def load_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


def corpus_documents(limit: Optional[int] = None) -> List[str]:
    lines = CORPUS_PATH.read_text(encoding="utf-8").splitlines()
    return lines if limit is None else lines[:limit]
