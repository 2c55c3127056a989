"""Datasets and tokenizer: an embedded default that needs no network, and real-run paths.

Datasets (``[training] dataset``):
- ``uniep_corpus``: the small English corpus shipped in ``recipes/assets/corpus``; one
  sample per paragraph. The default of the debug configs.
- ``jsonl`` / ``parquet``: local files or globs given in ``[training] dataset_path``,
  text in the ``text`` field.
- ``c4`` (TorchTitan's), ``fineweb``: streamed from the Hugging Face hub (real runs;
  they need network or a populated HF cache).

Tokenizer (``[model] hf_assets_path``): ``embedded`` selects the byte-level BPE (vocab
2048) shipped in ``recipes/assets/tokenizer``, built from the corpus by
``scripts/build_tokenizer.py``; any other value is a Hugging Face tokenizer folder.
"""

from __future__ import annotations

import glob
from functools import partial
from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
CORPUS_DIR = ASSETS / "corpus"
TOKENIZER_DIR = ASSETS / "tokenizer"
EMBEDDED_TOKENIZER = "embedded"

# Datasets whose [training] dataset_path must name existing local files, and the
# Hugging Face ``datasets`` builder that reads each (packaged with it: no download).
LOCAL_FILE_DATASETS = {"jsonl": "json", "parquet": "parquet"}


def corpus_paragraphs(corpus_dir: Path = CORPUS_DIR) -> list[str]:
    """Paragraphs of the embedded corpus, files in name order."""
    paragraphs = []
    for path in sorted(corpus_dir.glob("*.txt")):
        for block in path.read_text(encoding="utf-8").split("\n\n"):
            text = " ".join(block.split())
            if text:
                paragraphs.append(text)
    return paragraphs


def _load_corpus(path: str):
    from datasets import Dataset

    return Dataset.from_dict({"text": corpus_paragraphs(Path(path))})


def _load_local(kind: str, path: str):
    from datasets import load_dataset

    return load_dataset(LOCAL_FILE_DATASETS[kind], data_files=sorted(glob.glob(path)) or path, split="train")


def _load_streaming(name: str | None, path: str):
    from datasets import load_dataset

    return load_dataset(path, name=name, split="train", streaming=True)


def _text(sample: dict) -> str:
    return sample["text"]


def register_datasets() -> None:
    """Add UniEP's datasets to TorchTitan's registry (idempotent)."""
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    DATASETS.setdefault("uniep_corpus", DatasetConfig(str(CORPUS_DIR), _load_corpus, _text))
    for kind in LOCAL_FILE_DATASETS:
        DATASETS.setdefault(kind, DatasetConfig("", partial(_load_local, kind), _text))
    DATASETS.setdefault(
        "fineweb", DatasetConfig("HuggingFaceFW/fineweb", partial(_load_streaming, None), _text)
    )


def tokenizer_path(hf_assets_path: str) -> str:
    return str(TOKENIZER_DIR) if hf_assets_path == EMBEDDED_TOKENIZER else hf_assets_path


def build_tokenizer(job_config):
    """TorchTitan's HF tokenizer, with ``embedded`` resolved to the shipped one."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer(tokenizer_path(job_config.model.hf_assets_path))
