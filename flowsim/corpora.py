"""The text corpora's files: where flowsim looks for them, and ``flowsim data fetch``, which downloads them.

Search order for a corpus's folder (the first that holds the corpus's files is used):

1. ``data.data_dir`` of the config (``--data-dir`` on the command line), alone when given;
2. ``$FLOWSIM_DATA_DIR``;
3. the user data folder, where ``flowsim data fetch`` writes: ``$XDG_DATA_HOME/flowsim/data``
   (``~/.local/share/flowsim/data`` when XDG_DATA_HOME is unset);
4. ``shared/data`` beside the repository (a source checkout).

Nothing is downloaded unless ``flowsim data fetch`` is run. Each corpus is a few plain-text files
(``CORPUS_FILES``); fetching writes them atomically with a ``SOURCES.json`` recording each file's URL,
size and SHA-256. No torch here: fetching needs only the standard library.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import os
import re
import shutil
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from flowsim.common.io import NEW_FILE_MODE, read_json, write_atomic_json, write_atomic_text

CORPUS_FILES = {"wikitext2": ("wikitext-2/valid.txt", "wikitext-2/test.txt"), "tinystories": ("tinystories/valid-sample.txt",)}
FETCH_MANIFEST = "SOURCES.json"
# whole stories up to this size, about the size of the sample the shipped examples were measured on (another copy of
# the same validation split, so a fetched sample's stories, and the examples' numbers, can differ from it)
TINYSTORIES_SAMPLE_BYTES = 800_000
STORY_END = "<|endoftext|>"  # TinyStories' separator between stories (blank lines separate paragraphs)
DOWNLOAD_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Download:
    """One file of a corpus: where it comes from (``url``, relative to the corpus's base URL unless absolute) and the
    path it is written to; ``sample_bytes`` keeps only the first whole stories up to that many bytes."""

    url: str
    path: str
    sample_bytes: int | None = None


SOURCES = {
    # the word-level WikiText-2 of the PyTorch examples (CC BY-SA 3.0, Merity et al. 2016)
    "wikitext2": ("https://raw.githubusercontent.com/pytorch/examples/main/word_language_model/data/wikitext-2/",
                  (Download("valid.txt", "wikitext-2/valid.txt"), Download("test.txt", "wikitext-2/test.txt"))),
    # TinyStories' validation split (CDLA-Sharing-1.0, Eldan & Li 2023), cut to whole stories
    "tinystories": ("https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main/",
                    (Download("TinyStories-valid.txt", "tinystories/valid-sample.txt", TINYSTORIES_SAMPLE_BYTES),)),
}


def user_data_dir() -> Path:
    """Where ``flowsim data fetch`` writes: $XDG_DATA_HOME/flowsim/data, or ~/.local/share/flowsim/data."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "flowsim" / "data"


def repository_data_dir() -> Path:
    """``shared/data`` beside the repository (exists in a source checkout only)."""
    return Path(__file__).resolve().parents[2] / "shared" / "data"


def data_dir_candidates(explicit: str | Path | None = None) -> list[tuple[str, Path]]:
    """The folders searched, in order, each with where it comes from."""
    if explicit is not None:
        return [("data.data_dir", Path(explicit).expanduser())]
    candidates = []
    if os.environ.get("FLOWSIM_DATA_DIR"):
        candidates.append(("$FLOWSIM_DATA_DIR", Path(os.environ["FLOWSIM_DATA_DIR"]).expanduser()))
    candidates += [("the user data folder (flowsim data fetch)", user_data_dir()), ("beside the repository", repository_data_dir())]
    return candidates


def holds(folder: Path, corpus: str) -> bool:
    return all((folder / name).is_file() for name in CORPUS_FILES[corpus])


def find_data_dir(corpus: str, explicit: str | Path | None = None) -> Path:
    """The first folder of the search order that holds ``corpus``'s files, or a FileNotFoundError listing every
    folder looked in and how to get the files."""
    if corpus not in CORPUS_FILES:
        raise ValueError(f"no such corpus {corpus!r}; known: {sorted(CORPUS_FILES)}")
    candidates = data_dir_candidates(explicit)
    for _, folder in candidates:
        if holds(folder, corpus):
            return folder
    def what_is_there(folder: Path) -> str:
        missing = [name for name in CORPUS_FILES[corpus] if not (folder / name).is_file()]
        return f"exists, without {', '.join(missing)}" if folder.is_dir() else "no such folder"

    looked = "; ".join(f"{folder} ({origin}: {what_is_there(folder)})" for origin, folder in candidates)
    raise FileNotFoundError(f"{corpus}: its files {list(CORPUS_FILES[corpus])} were not found. Looked in: {looked}. "
                            f"Run `flowsim data fetch {corpus}` (downloads into {user_data_dir()}), or set data.data_dir "
                            "(--data-dir) or $FLOWSIM_DATA_DIR to a folder holding them")


def _stories_sample(text: str, size: int) -> str:
    """The first whole stories of ``text`` within ``size`` bytes (at least one), blank-line separated as flowsim reads
    them. Stories end at a ``<|endoftext|>`` line when the text has them (TinyStories' own files), else at blank
    lines."""
    pieces = text.split(STORY_END) if STORY_END in text else re.split(r"\n\s*\n", text)
    stories, kept, used = [piece.strip("\n") for piece in pieces if piece.strip()], [], 0
    for story in stories:
        cost = len(story.encode("utf-8")) + 2
        if kept and used + cost > size:
            break
        kept.append(story)
        used += cost
    return "\n\n".join(kept) + "\n"


def _download(url: str, destination: Path, say: Callable[[str], None]) -> None:
    """``url`` into ``destination`` through a temporary file beside it (a failed download leaves nothing)."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=destination.parent, prefix=f".{destination.name}.", suffix=".part")
    try:
        os.fchmod(handle, NEW_FILE_MODE)  # readable as a plain open() would make it (mkstemp's is owner-only)
        with os.fdopen(handle, "wb") as out, urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
            total = int(response.headers.get("Content-Length") or 0)
            say(f"downloading {url}" + (f" ({total / 1e6:.1f} MB)" if total else ""))
            shutil.copyfileobj(response, out, length=1 << 20)
        os.replace(temporary, destination)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _sample_stories(raw: Path, destination: Path, size: int, url: str) -> None:
    """``raw``'s first whole stories up to ``size`` bytes into ``destination`` (atomically); ``raw`` is removed
    whatever happens."""
    try:
        try:
            text = raw.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{url} is not UTF-8 text (byte {error.object[error.start]:#04x} at offset {error.start}): "
                             "not the corpus expected") from None
        write_atomic_text(destination, _stories_sample(text, size))
    finally:
        raw.unlink(missing_ok=True)


def fetch(corpus: str, to: Path | None = None, base_url: str | None = None,
          say: Callable[[str], None] = lambda line: print(line, file=sys.stderr)) -> Path:
    """Download ``corpus`` into ``to`` (default ``user_data_dir()``) from its source (or ``base_url``, a mirror
    holding the same file names: https://, or file:// for a local copy) and prepare it as flowsim reads it.
    Returns the folder. Files already there are kept (delete them to fetch again). O(corpus size)."""
    if corpus not in SOURCES:
        raise ValueError(f"no such corpus {corpus!r}; fetch one of {sorted(SOURCES)}")
    folder = Path(to).expanduser() if to is not None else user_data_dir()
    default_base, downloads = SOURCES[corpus]
    base = base_url if base_url is not None else default_base
    if "://" not in base:
        base = Path(base).expanduser().resolve().as_uri()  # a plain folder: its file:// URL
    base = base if base.endswith("/") else base + "/"
    manifest_path = folder / FETCH_MANIFEST
    manifest = read_json(manifest_path) if manifest_path.is_file() else {}
    records = dict(manifest.get(corpus, {}).get("files", {}))
    for download in downloads:
        destination = folder / download.path
        url = download.url if "://" in download.url else base + download.url
        if destination.is_file():
            say(f"{destination} is already there: kept")
            if download.path in records:
                continue
            url = None  # not fetched here: its source is unknown
        else:
            raw = destination.with_name(destination.name + ".download") if download.sample_bytes else destination
            try:
                _download(url, raw, say)
            except (urllib.error.URLError, ValueError) as error:  # the URL could not be read; local OSErrors go up as they are
                reason = getattr(error, "reason", None) or error
                raise ConnectionError(f"could not download {url} ({reason}): fetch needs the network (or --from a "
                                      "local copy's folder)") from None
            if download.sample_bytes:
                _sample_stories(raw, destination, download.sample_bytes, url)
        data = destination.read_bytes()
        records[download.path] = {"url": url, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                                  **({"sample_bytes": download.sample_bytes} if download.sample_bytes else {})}
    manifest[corpus] = {"fetched": _dt.datetime.now().isoformat(timespec="seconds"), "files": records}
    write_atomic_json(manifest_path, manifest, indent=1)
    written = ", ".join(f"{path} ({record['bytes']} bytes)" for path, record in records.items())
    say(f"{corpus}: {written} in {folder}")
    return folder
