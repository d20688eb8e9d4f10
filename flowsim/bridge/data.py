"""Training data for the bridge: sampled Markov sequences and word-level text corpora.

Every batch is a pure function of (seed, step), so a resumed run draws exactly the
batches an uninterrupted one would. Text comes from local files only:

* WikiText-2 (``wikitext2``): already word-level with ``<unk>`` marked; tokens are the
  whitespace-separated words of ``wikitext-2/valid.txt`` (training) and
  ``wikitext-2/test.txt`` (validation).
* TinyStories (``tinystories``): plain text; tokens are lower-cased words and single
  punctuation marks; the first 90% of ``tinystories/valid-sample.txt``'s stories train,
  the rest validate.
* A corpus of your own (``text``): ``data.train_file`` and ``data.valid_file``: lower-cased words of any script
  (Unicode letters, digits and combining marks, with apostrophes kept within them) and single punctuation marks; on
  ASCII text these are TinyStories' tokens. (TinyStories keeps its ASCII words: its sample holds mis-encoded
  quotes, "didnâ€™t", which Unicode words would glue to the words beside them, changing its shipped runs.)

The vocabulary is ``<unk>`` plus the top-V other words of the training split (ties by
first occurrence); other words map to ``<unk>``. A corpus directory saved with the
``datasets`` library (``save_to_disk``, one ``text`` column) can be read instead with
``source = "datasets_disk"``. Where the files are looked for, and ``flowsim data fetch``, which downloads them
(nothing else ever does): ``flowsim.corpora``.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flowsim.model.chains import MarkovChain
from flowsim.corpora import CORPUS_FILES, check_recorded, data_dir_candidates, find_data_dir, holds

UNK = "<unk>"
CORPORA = ("wikitext2", "tinystories")
TINYSTORIES_TRAIN_FRACTION = 0.9
ASCII_WORDS = re.compile(r"[a-z0-9']+|[^\sa-z0-9']")  # TinyStories' tokens: lower-case ASCII words, other marks alone


def batch_seed(seed: int, step: int) -> int:
    """An independent seed for the batch of ``step`` (pure in (seed, step))."""
    return int(np.random.SeedSequence([seed, step]).generate_state(1)[0])


def markov_batch(chain: MarkovChain, batch_size: int, length: int, seed: int, step: int) -> torch.Tensor:
    """``batch_size`` sequences of ``length`` tokens from the chain (x_1 from its start law)."""
    return torch.as_tensor(chain.sample(batch_size, length, batch_seed(seed, step)), dtype=torch.long)


def default_data_dir() -> Path | None:
    """The first folder of the search order (``flowsim.corpora``) that holds every corpus, else None."""
    for _, folder in data_dir_candidates():
        if all(holds(folder, corpus) for corpus in CORPORA):
            return folder
    return None


@functools.cache
def unicode_words() -> re.Pattern:
    """Words of any script (letters and digits, ``[^\\W_]``, and combining marks, which ``\\w`` lacks, with
    apostrophes), else one non-space character: on ASCII text the tokens of ``ASCII_WORDS``. Built once, about 50 ms
    (the marks are read from Unicode's tables)."""
    planes = (*range(0x20000), *range(0xE0100, 0xE01F0))  # every combining mark lies in these
    marks = "".join(chr(code) for code in planes if unicodedata.category(chr(code)).startswith("M"))
    return re.compile(rf"(?:[^\W_]|['{re.escape(marks)}])+|\S")


def tokenize(corpus: str, text: str) -> list[str]:
    """WikiText-2: its whitespace-separated words; TinyStories: ``ASCII_WORDS``; text of your own: ``unicode_words``
    of its NFC form (so a precomposed and a decomposed "é" are one letter), lower-cased."""
    if corpus == "wikitext2":
        return text.split()
    if corpus == "tinystories":
        return ASCII_WORDS.findall(text.lower())
    return unicode_words().findall(unicodedata.normalize("NFC", text).lower())


def _read_utf8(path: Path, recorded_in: tuple[Path, str] | None = None) -> str:
    """The text of ``path``; with ``recorded_in`` = (data folder, corpus), checked against that folder's SOURCES.json
    record of it where there is one (``flowsim.corpora.check_recorded``: a hash of the bytes read, a few ms a MB)."""
    data = path.read_bytes()
    if recorded_in is not None:
        folder, corpus = recorded_in
        check_recorded(folder, corpus, path.relative_to(folder).as_posix(), data)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text (byte {error.object[error.start]:#04x} at offset {error.start}); "
                         "the corpora are read as UTF-8") from None


def check_text_file(key: str, path: Path) -> None:
    """FileNotFoundError or ValueError naming ``key`` and ``path`` unless it is a regular file: a folder, a device
    (/dev/null, /dev/zero) or a FIFO is not a text (one would be read as empty, endless or never)."""
    if not path.exists():
        raise FileNotFoundError(f"text: {key} {str(path)!r} not found; expected a UTF-8 text file")
    if path.is_dir():
        raise ValueError(f"text: {key} {str(path)!r} is a folder; expected a UTF-8 text file")
    if not path.is_file():
        raise ValueError(f"text: {key} {str(path)!r} is not a regular file (a device or a FIFO); expected a UTF-8 text file")


def _read_splits(corpus: str, data_dir: Path, source: str) -> tuple[str, str]:
    """(training text, validation text) of a corpus."""
    if source == "datasets_disk":
        from datasets import (
            load_from_disk,  # optional; reads a local save_to_disk folder
        )

        saved = load_from_disk(str(data_dir))
        train, valid = ("train", "validation") if "validation" in saved else ("train", "test")
        return "\n".join(saved[train]["text"]), "\n".join(saved[valid]["text"])
    paths = [data_dir / name for name in CORPUS_FILES[corpus]]
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"{corpus}: {path} not found; point data.data_dir at a folder holding {list(CORPUS_FILES[corpus])}")
    if corpus == "wikitext2":
        return _read_utf8(paths[0], (data_dir, corpus)), _read_utf8(paths[1], (data_dir, corpus))
    stories = [story for story in re.split(r"\n\s*\n", _read_utf8(paths[0], (data_dir, corpus))) if story.strip()]
    cut = int(TINYSTORIES_TRAIN_FRACTION * len(stories))
    return "\n\n".join(stories[:cut]), "\n\n".join(stories[cut:])


@dataclass(frozen=True)
class Corpus:
    """A tokenised corpus: ids into ``vocabulary`` (id 0 is <unk>) and the training counts."""

    name: str
    vocabulary: tuple[str, ...]
    train: np.ndarray
    valid: np.ndarray
    word_counts: dict[str, int]  # raw training counts before the vocabulary cut

    @property
    def frequencies(self) -> np.ndarray:
        """Token frequencies of the training ids (π over the vocabulary)."""
        return np.bincount(self.train, minlength=len(self.vocabulary)) / len(self.train)

    def batch(self, batch_size: int, length: int, seed: int, step: int, split: str = "train") -> torch.Tensor:
        """``batch_size`` windows of ``length`` consecutive tokens at random offsets."""
        ids = self.train if split == "train" else self.valid
        if len(ids) <= length:
            raise ValueError(f"the {split} split has {len(ids)} tokens, fewer than a window of {length}")
        starts = np.random.default_rng(batch_seed(seed, step)).integers(0, len(ids) - length, size=batch_size)
        return torch.as_tensor(ids[starts[:, None] + np.arange(length)], dtype=torch.long)

    def windows_ending_in(self, fold: np.ndarray, per_type: int, length: int, seed: int, split: str = "valid") -> torch.Tensor:
        """Up to ``per_type`` windows of ``length`` tokens ending in each folded type, drawn from
        every position of the split: a rare type gets as many probes as the split holds."""
        ids = self.train if split == "train" else self.valid
        last_type = fold[ids[length - 1:]]
        rng = np.random.default_rng(batch_seed(seed, 0))
        starts = []  # window i holds ids[i : i + length] and ends in last_type[i]
        for folded in range(int(fold.max()) + 1):
            positions = np.flatnonzero(last_type == folded)
            starts.append(np.sort(rng.choice(positions, size=min(per_type, len(positions)), replace=False)))
        starts = np.concatenate(starts)
        return torch.as_tensor(ids[starts[:, None] + np.arange(length)], dtype=torch.long)


def load_corpus(corpus: str, vocab_size: int, data_dir: Path | str | None = None, source: str = "files",
                files: tuple[str | Path, str | Path] | None = None) -> Corpus:
    """Read, tokenise and index a corpus with a top-``vocab_size`` vocabulary plus <unk>; ``corpus = "text"`` reads
    ``files`` (training, validation) and tokenises them into words of any script (``tokenize``)."""
    if corpus not in (*CORPORA, "text"):
        raise ValueError(f"data.kind must be one of {('markov', *CORPORA, 'text')}, got {corpus!r}")
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"data.vocab_size must be a positive integer, got {vocab_size!r}")
    if source not in ("files", "datasets_disk"):
        raise ValueError(f"data.source must be 'files' or 'datasets_disk', got {source!r}")
    if corpus == "text":
        if files is None or len(files) != 2:
            raise ValueError("data.kind = 'text' needs its two files: data.train_file and data.valid_file")
        for key, path in zip(("data.train_file", "data.valid_file"), map(Path, files)):
            check_text_file(key, path)
        data_dir = Path(files[0]).parent
        train_text, valid_text = (_read_utf8(Path(path)) for path in files)
    else:
        if source == "files":
            data_dir = find_data_dir(corpus, data_dir)  # the search order of flowsim.corpora; its error lists where it looked
        elif data_dir is None:
            raise FileNotFoundError("data.source = 'datasets_disk' reads the folder data.data_dir names: set it")
        data_dir = Path(data_dir)
        train_text, valid_text = _read_splits(corpus, data_dir, source)
    train_words, valid_words = tokenize(corpus, train_text), tokenize(corpus, valid_text)
    counts = Counter(train_words)
    ranked = sorted((word for word in counts if word != UNK), key=lambda w: -counts[w])  # stable: first occurrence
    if len(ranked) < vocab_size or len(valid_words) < 2:
        raise ValueError(f"{corpus} in {data_dir}: the training text has {len(train_words)} words, {len(ranked)} distinct, "
                         f"and the validation text {len(valid_words)}; data.vocab_size = {vocab_size} needs at least that "
                         "many distinct training words (and a validation text): lower data.vocab_size or use a larger corpus")
    vocabulary = (UNK, *ranked[:vocab_size])
    index = {word: i for i, word in enumerate(vocabulary)}

    def ids(words: list[str]) -> np.ndarray:
        return np.fromiter((index.get(word, 0) for word in words), dtype=np.int64, count=len(words))

    return Corpus(corpus, vocabulary, ids(train_words), ids(valid_words), dict(counts))
