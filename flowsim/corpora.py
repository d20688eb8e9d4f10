"""The text corpora's files: where flowsim looks for them, and ``flowsim data fetch``, which downloads them.

Search order for a corpus's folder (the first that holds the corpus's files is used):

1. ``data.data_dir`` of the config (``--data-dir`` on the command line), alone when given;
2. ``$FLOWSIM_DATA_DIR``;
3. the user data folder, where ``flowsim data fetch`` writes: ``$XDG_DATA_HOME/flowsim/data``
   (``~/.local/share/flowsim/data`` when XDG_DATA_HOME is unset);
4. ``shared/data`` beside the repository (a source checkout).

Nothing is downloaded unless ``flowsim data fetch`` is run. Each corpus is a few plain-text files
(``CORPUS_FILES``); fetching writes them atomically with a ``SOURCES.json`` recording each file's URL,
size and SHA-256. Every file is checked as UTF-8 text: WikiText-2's against the size and SHA-256 shipped here
(``EXPECTED``); TinyStories' sample, cut here from its source (so its bytes follow that source's), as whole stories
that fill its sample size. A file a folder's ``SOURCES.json`` records is checked against that record when it is
fetched again and whenever the bridge reads it (``check_recorded``). No torch here.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import http.client
import json
import os
import re
import shutil
import stat
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

from flowsim.common.io import NEW_FILE_MODE, DamagedFileError, read_json, write_atomic_bytes, write_atomic_json

CORPUS_FILES = {"wikitext2": ("wikitext-2/valid.txt", "wikitext-2/test.txt"), "tinystories": ("tinystories/valid-sample.txt",)}
FETCH_MANIFEST = "SOURCES.json"
# whole stories up to this size, about the size of the sample the shipped examples were measured on (another copy of
# the same validation split, so a fetched sample's stories, and the examples' numbers, can differ from it)
TINYSTORIES_SAMPLE_BYTES = 800_000
STORY_END = "<|endoftext|>"  # TinyStories' separator between stories (blank lines separate paragraphs)
DOWNLOAD_TIMEOUT_S = 60.0  # the network's; a local source is opened without waiting (a FIFO would block forever)
URL_SCHEMES = ("https", "http", "file")


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
    """Where ``flowsim data fetch`` writes: $XDG_DATA_HOME/flowsim/data, or ~/.local/share/flowsim/data where it is
    unset or relative (the XDG spec has a relative one ignored)."""
    xdg = os.environ.get("XDG_DATA_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".local" / "share"
    return base / "flowsim" / "data"


@dataclass(frozen=True)
class Expected:
    """A corpus file as flowsim reads it: its size in bytes and SHA-256."""

    bytes: int
    sha256: str


# WikiText-2's files as SOURCES serves them (the pytorch/examples copy, commit 77f55b9), as shared/data holds them
EXPECTED = {
    "wikitext-2/valid.txt": Expected(1_121_681, "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8"),
    "wikitext-2/test.txt": Expected(1_256_449, "d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0"),
}
# a TinyStories sample's stories are about 1 kB each, so whole stories fill a sample to within a few of them
SAMPLE_FILL = 0.95


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


class CorpusError(ValueError):
    """A corpus file, its source or its record is not what flowsim reads: the message names it, what was expected
    and found, and the remedy."""


MANIFEST_REMEDY = "delete it and run `flowsim data fetch` again (the files already there are checked anew)"


def _manifest_problem(manifest) -> str | None:
    """What is wrong with the shape of a SOURCES.json value, or None: {corpus: {"files": {path: {"bytes": int,
    "sha256": text, ...}}, ...}}."""
    if not isinstance(manifest, dict):
        return f"a JSON {type(manifest).__name__}, expected an object with a record of each corpus"
    for corpus, entry in manifest.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("files"), dict):
            return f"its {corpus!r} is {json.dumps(entry)[:40]}, expected an object with the \"files\" fetched"
        for name, record in entry["files"].items():
            if not (isinstance(record, dict) and type(record.get("bytes")) is int and isinstance(record.get("sha256"), str)):
                return f"its record of {name!r} is {json.dumps(record)[:60]}, expected an object with its bytes and sha256"
    return None


def read_manifest(folder: Path) -> dict:
    """``folder``'s SOURCES.json ({} where it has none), its shape checked; DamagedFileError naming it otherwise."""
    path = Path(folder) / FETCH_MANIFEST
    if not path.exists() and not path.is_symlink():
        return {}
    manifest = read_json(path, MANIFEST_REMEDY)
    problem = _manifest_problem(manifest)
    if problem is not None:
        raise DamagedFileError(path, problem, MANIFEST_REMEDY)
    return manifest


def _sample_bytes(relative: str) -> int | None:
    """The sample size of the corpus file ``relative`` (a path of CORPUS_FILES), None where it is kept whole."""
    return next(download.sample_bytes for _, downloads in SOURCES.values() for download in downloads
                if download.path == relative)


def check_contents(relative: str, data: bytes, shown: str, remedy: str) -> str:
    """The SHA-256 of ``data``, checked as the corpus file ``relative``: the size and SHA-256 ``EXPECTED`` lists for
    it, else (a sample cut here) whole stories filling SAMPLE_FILL of the sample size; UTF-8 text either way.
    CorpusError naming ``shown``, what was expected and found, and ``remedy`` otherwise. O(len(data)): a few ms a MB."""
    digest = hashlib.sha256(data).hexdigest()
    expected = EXPECTED.get(relative)
    if expected is not None and (len(data), digest) != (expected.bytes, expected.sha256):
        raise CorpusError(f"{shown} is not the {relative} flowsim reads: expected {expected.bytes} bytes with SHA-256 "
                          f"{expected.sha256}, found {len(data)} bytes with {digest}; {remedy}")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CorpusError(f"{shown} is not UTF-8 text (byte {error.object[error.start]:#04x} at offset {error.start}), "
                          f"expected the corpus as UTF-8 text; {remedy}") from None
    sample = _sample_bytes(relative)
    if expected is None and sample is not None and len(data) < SAMPLE_FILL * sample:
        raise CorpusError(f"{shown} holds {len(data)} bytes of stories, expected at least {int(SAMPLE_FILL * sample)} "
                          f"(whole stories up to {sample}): its source is cut short or empty; {remedy}")
    return digest


def check_recorded(folder: Path, corpus: str, relative: str, data: bytes) -> None:
    """CorpusError where ``folder``'s SOURCES.json records the file ``relative`` with another size or SHA-256 than
    ``data``'s, the file's bytes as read (it changed since it was fetched); nothing where no record names it. The
    size is compared first, the bytes hashed only where it matches: O(len(data)), a few ms a MB."""
    record = read_manifest(folder).get(corpus, {}).get("files", {}).get(relative)
    if record is not None:
        _compare_with_record(Path(folder) / relative, record, data)


def _compare_with_record(path: Path, record: dict, data: bytes) -> str:
    """``data``'s SHA-256, or CorpusError where its size or SHA-256 is not ``record``'s (SOURCES.json's of ``path``)."""
    remedy = f"delete it and run `flowsim data fetch` to fetch it again"
    if len(data) != record["bytes"]:
        raise CorpusError(f"{path} has {len(data)} bytes, expected the {record['bytes']} SOURCES.json recorded when it "
                          f"was fetched: it changed since; {remedy}")
    digest = hashlib.sha256(data).hexdigest()
    if digest != record["sha256"]:
        raise CorpusError(f"{path} has SHA-256 {digest}, expected the {record['sha256']} SOURCES.json recorded when "
                          f"it was fetched: it changed since; {remedy}")
    return digest


def _base_url(given: str | None, default: str) -> str:
    """The base URL the files are fetched from, ending in "/": ``given`` (an https:// or file: URL, or a folder, read
    as its file: URL) or the corpus's own ``default``; ValueError for an empty or unknown one."""
    if given is None:
        base = default
    elif not given.strip():
        raise ValueError("--from is empty: expected a mirror's https:// URL, a file: URL or a local folder holding "
                         "the corpus's files")
    elif urllib.parse.urlsplit(given).scheme in URL_SCHEMES:
        base = given
    elif "://" in given:
        raise ValueError(f"--from {given!r} is not a URL fetch reads: expected https://, http:// or file:, or a local "
                         "folder")
    else:
        base = Path(given).expanduser().resolve().as_uri()
    return base if base.endswith("/") else base + "/"


def _open_source(url: str) -> tuple[BinaryIO, int]:
    """A binary stream of ``url`` and its size (0 where unknown). A file: URL is opened without waiting and must name
    a regular file (a FIFO would block past any timeout): CorpusError otherwise; a network failure is a
    ConnectionError."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme == "file":
        path = Path(urllib.request.url2pathname(parsed.path))
        try:
            handle = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as error:
            raise CorpusError(f"cannot read {path} ({error.strerror.lower()}): expected the corpus's file "
                              f"{path.name} in the folder --from names") from None
        status = os.fstat(handle)
        if not stat.S_ISREG(status.st_mode):
            os.close(handle)
            raise CorpusError(f"{path} is not a regular file (a FIFO, a device or a folder): expected the corpus's "
                              f"file {path.name} in the folder --from names")
        return os.fdopen(handle, "rb"), status.st_size
    try:
        response = urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S)
    except (urllib.error.URLError, ValueError, OSError) as error:
        reason = getattr(error, "reason", None) or error
        raise ConnectionError(f"could not download {url} ({reason}): fetch needs the network (or --from a local "
                              "copy's folder)") from None
    return response, int(response.headers.get("Content-Length") or 0)


def _download(url: str, destination: Path, say: Callable[[str], None]) -> None:
    """``url`` into ``destination`` through a temporary file beside it (a failed or interrupted download leaves
    nothing)."""
    handle, temporary = tempfile.mkstemp(dir=destination.parent, prefix=f".{destination.name}.", suffix=".part")
    try:
        os.fchmod(handle, NEW_FILE_MODE)  # readable as a plain open() would make it (mkstemp's is owner-only)
        with os.fdopen(handle, "wb") as out:
            source, total = _open_source(url)
            with source:
                say(f"downloading {url}" + (f" ({total / 1e6:.1f} MB)" if total else ""))
                try:
                    shutil.copyfileobj(source, out, length=1 << 20)
                except (OSError, http.client.HTTPException) as error:
                    raise ConnectionError(f"the download of {url} broke off ({error}): run the same command again") from None
        os.replace(temporary, destination)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _fetched(base: str, download: Download, destination: Path, remedy: str, say: Callable[[str], None]) -> dict:
    """Download one file into ``destination``, cut to its sample where it has one, checked (``check_contents``)
    before it is put in place; returns its SOURCES.json record. O(file size)."""
    url = download.url if "://" in download.url else base + download.url
    destination.parent.mkdir(parents=True, exist_ok=True)
    raw = destination.with_name(destination.name + ".download")
    try:
        _download(url, raw, say)
        data = raw.read_bytes()
        if download.sample_bytes:
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as error:
                raise CorpusError(f"{url} is not UTF-8 text (byte {error.object[error.start]:#04x} at offset "
                                  f"{error.start}): not the corpus expected; {remedy}") from None
            data = _stories_sample(text, download.sample_bytes).encode("utf-8")
        digest = check_contents(download.path, data, url, remedy)
        write_atomic_bytes(destination, data)
    finally:
        raw.unlink(missing_ok=True)
    return {"url": url, "bytes": len(data), "sha256": digest,
            **({"sample_bytes": download.sample_bytes} if download.sample_bytes else {})}


def _kept(destination: Path, download: Download, record: dict | None, say: Callable[[str], None]) -> dict:
    """The SOURCES.json record of a file already in the folder, checked against its record (size first, then its
    SHA-256) and as the file flowsim reads (``check_contents``); CorpusError naming it otherwise. O(file size)."""
    remedy = f"delete {destination} and run the same command to fetch it again"
    if destination.is_symlink() or not destination.is_file():
        raise CorpusError(f"{destination} is not a regular file, expected the corpus's {download.path}; {remedy}")
    data = destination.read_bytes()
    if record is not None:
        _compare_with_record(destination, record, data)
    digest = check_contents(download.path, data, str(destination), remedy)
    say(f"{destination} is already there, checked: kept")
    return record if record is not None else {"url": None, "bytes": len(data), "sha256": digest}  # its source unknown


def fetch(corpus: str, to: Path | None = None, base_url: str | None = None,
          say: Callable[[str], None] = lambda line: print(line, file=sys.stderr)) -> Path:
    """Download ``corpus`` into ``to`` (default ``user_data_dir()``) from its source (or ``base_url``, a mirror
    holding the same file names: https://, file: for a local copy, or a folder) and prepare it as flowsim reads it;
    every file is checked (``check_contents``), and files already there against SOURCES.json too. The folder is
    locked while SOURCES.json is updated (a second fetch waits); a failed or interrupted fetch removes the folders it
    made. Returns the folder. O(corpus size)."""
    from flowsim.runs.rundir import discard_unused_folder, folder_lock

    if corpus not in SOURCES:
        raise ValueError(f"no such corpus {corpus!r}; fetch one of {sorted(SOURCES)}")
    folder = Path(to).expanduser() if to is not None else user_data_dir()
    default_base, downloads = SOURCES[corpus]
    base = _base_url(base_url, default_base)
    remedy = ("fetch from the corpus's own source (without --from) or a whole copy of it" if base_url is not None
              else "run the same command again")
    subfolders = {(folder / download.path).parent for download in downloads}
    made = [path for path in (*sorted(subfolders, reverse=True), folder, *folder.parents) if not path.exists()]
    try:
        with folder_lock(folder, "data folder", wait=True):
            manifest = read_manifest(folder)
            records = dict(manifest.get(corpus, {}).get("files", {}))
            for download in downloads:
                destination = folder / download.path
                if destination.exists() or destination.is_symlink():
                    records[download.path] = _kept(destination, download, records.get(download.path), say)
                else:
                    records[download.path] = _fetched(base, download, destination, remedy, say)
            manifest[corpus] = {"fetched": _dt.datetime.now().isoformat(timespec="seconds"), "files": records}
            write_atomic_json(folder / FETCH_MANIFEST, manifest, indent=1)
    except BaseException:
        for path in made:  # deepest first: what this fetch made, where it is still empty
            if path == folder:
                discard_unused_folder(path)
            elif path.is_dir() and not any(path.iterdir()):
                path.rmdir()
        raise
    written = ", ".join(f"{path} ({record['bytes']} bytes)" for path, record in records.items())
    say(f"{corpus}: {written} in {folder}")
    return folder
