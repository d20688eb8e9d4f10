"""Where the bridge finds the text corpora, and `flowsim data fetch`, checked offline against local fixture files
(file:// URLs through the same urllib code that fetches from the network)."""

import hashlib
import json

import pytest
from typer.testing import CliRunner

from flowsim import corpora
from flowsim.cli import app

WIKI = {"valid.txt": " = Valkyria = \n the game is a <unk> game . \n", "test.txt": " = Robert = \n he was born in the city . \n"}
STORIES = "Once upon a time there was a cat.\n\nThe cat saw a dog. They played.\n\nLily had a red ball.\n"


@pytest.fixture
def mirror(tmp_path, monkeypatch):
    """A local mirror of small stand-in files, which the fetch's checks are told to expect (the real checks:
    ``test_fetch_checks_every_file_against_what_flowsim_reads``)."""
    folder = tmp_path / "mirror"
    folder.mkdir()
    for name, text in WIKI.items():
        (folder / name).write_text(text)
        monkeypatch.setitem(corpora.EXPECTED, f"wikitext-2/{name}",
                            corpora.Expected(len(text.encode()), hashlib.sha256(text.encode()).hexdigest()))
    (folder / "TinyStories-valid.txt").write_text(STORIES)
    monkeypatch.setattr(corpora, "SAMPLE_FILL", 0.0)
    return folder


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """No $FLOWSIM_DATA_DIR, a user data folder under tmp_path, and no repository folder."""
    monkeypatch.delenv("FLOWSIM_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(corpora, "repository_data_dir", lambda: tmp_path / "repo" / "shared" / "data")
    return tmp_path


def test_fetch_writes_the_files_the_bridge_reads_and_records_their_digests(mirror, isolated):
    folder = corpora.fetch("wikitext2", base_url=mirror.as_uri(), say=lambda line: None)
    assert folder == isolated / "xdg" / "flowsim" / "data"
    for name, relative in (("valid.txt", "wikitext-2/valid.txt"), ("test.txt", "wikitext-2/test.txt")):
        assert (folder / relative).read_text() == WIKI[name]
    manifest = json.loads((folder / corpora.FETCH_MANIFEST).read_text())["wikitext2"]["files"]
    assert manifest["wikitext-2/valid.txt"]["sha256"] == hashlib.sha256(WIKI["valid.txt"].encode()).hexdigest()
    assert manifest["wikitext-2/valid.txt"]["url"] == mirror.as_uri() + "/valid.txt"
    assert corpora.find_data_dir("wikitext2") == folder  # the user data folder is searched
    assert not list(folder.rglob("*.part")) and not list(folder.rglob("*.download"))


def test_tinystories_is_cut_to_whole_stories(mirror, isolated, monkeypatch):
    first_two = "Once upon a time there was a cat.\n\nThe cat saw a dog. They played.\n"
    assert corpora._stories_sample(STORIES, len(first_two.encode()) + 2) == first_two
    assert corpora._stories_sample(STORIES, 3) == "Once upon a time there was a cat.\n"  # at least one story
    folder = corpora.fetch("tinystories", to=isolated / "mine", base_url=mirror.as_uri(), say=lambda line: None)
    assert (folder / "tinystories" / "valid-sample.txt").read_text() == corpora._stories_sample(STORIES, 10**6)
    assert corpora.find_data_dir("tinystories", folder) == folder


def test_a_failed_download_names_the_url_and_leaves_nothing(isolated):
    """A local source that lacks a file is named as such (not as a network failure, issue 83 item 9), and the failed
    fetch leaves no folder behind, not even an empty one."""
    with pytest.raises(corpora.CorpusError, match=r"^cannot read /no/such/mirror/valid.txt \(no such file or directory\): "
                                                  r"expected the corpus's file valid.txt in the folder --from names$"):
        corpora.fetch("wikitext2", to=isolated / "out", base_url="file:///no/such/mirror", say=lambda line: None)
    assert not (isolated / "out").exists()
    with pytest.raises(ValueError, match="no such corpus 'c4'"):
        corpora.fetch("c4", say=lambda line: None)


def test_the_search_order_and_an_error_that_lists_where_it_looked(mirror, isolated, monkeypatch):
    env = isolated / "env"
    env.mkdir()
    monkeypatch.setenv("FLOWSIM_DATA_DIR", str(env))
    with pytest.raises(FileNotFoundError) as error:
        corpora.find_data_dir("wikitext2")
    message = str(error.value)
    assert f"{env} ($FLOWSIM_DATA_DIR: exists, without wikitext-2/valid.txt, wikitext-2/test.txt)" in message
    assert f"{isolated / 'xdg' / 'flowsim' / 'data'} (the user data folder (flowsim data fetch): no such folder)" in message
    assert "beside the repository: no such folder" in message and "flowsim data fetch wikitext2" in message
    user = corpora.fetch("wikitext2", base_url=mirror.as_uri(), say=lambda line: None)
    assert corpora.find_data_dir("wikitext2") == user  # $FLOWSIM_DATA_DIR lacks it: the next folder
    corpora.fetch("wikitext2", to=env, base_url=mirror.as_uri(), say=lambda line: None)
    assert corpora.find_data_dir("wikitext2") == env  # first in the order once it holds the files
    assert corpora.find_data_dir("wikitext2", user) == user  # data.data_dir alone when given


def test_the_data_commands(mirror, isolated):
    runner = CliRunner()
    fetched = runner.invoke(app, ["data", "fetch", "tinystories", "--from", mirror.as_uri()])
    assert fetched.exit_code == 0 and fetched.output.strip().endswith(f"written: {isolated / 'xdg' / 'flowsim' / 'data'}"), fetched.output
    where = runner.invoke(app, ["data", "where", "tinystories"])
    assert where.exit_code == 0 and f"the bridge reads tinystories from {isolated / 'xdg' / 'flowsim' / 'data'}" in where.output
    missing = runner.invoke(app, ["data", "where", "wikitext2"])
    assert missing.exit_code == 1 and "`flowsim data fetch wikitext2` downloads it" in missing.output
    offline = runner.invoke(app, ["data", "fetch", "wikitext2", "--from", "file:///no/such/mirror"])
    assert offline.exit_code == 2 and "cannot read /no/such/mirror/valid.txt" in offline.output
    assert "network" not in offline.output


def test_tinystories_own_separators_cut_stories_not_paragraphs(isolated, tmp_path, monkeypatch):
    """TinyStories' files end each story with an <|endoftext|> line, and a story may hold blank lines (paragraphs):
    the sample keeps whole stories without the markers. A plain folder as --from is read as its file:// URL, and the
    files written are readable like any other (not owner-only)."""
    import os
    import stat

    monkeypatch.setattr(corpora, "SAMPLE_FILL", 0.0)  # two short stories stand in for the sample
    mirror = tmp_path / "plain"
    mirror.mkdir()
    (mirror / "TinyStories-valid.txt").write_text("Tom had a kite.\n\nIt flew high.\n<|endoftext|>\nSue ran.\n<|endoftext|>\n")
    folder = corpora.fetch("tinystories", to=tmp_path / "out", base_url=str(mirror), say=lambda line: None)
    sample = folder / "tinystories" / "valid-sample.txt"
    assert sample.read_text() == "Tom had a kite.\n\nIt flew high.\n\nSue ran.\n"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(sample.stat().st_mode) == 0o666 & ~umask


def test_a_local_failure_is_not_called_a_network_failure_and_a_bad_download_leaves_nothing(mirror, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(OSError) as error:
        corpora.fetch("wikitext2", to=blocker, base_url=mirror.as_uri(), say=lambda line: None)
    assert not isinstance(error.value, ConnectionError)
    (mirror / "TinyStories-valid.txt").write_bytes(b"caf\xe9 au lait\n")
    with pytest.raises(ValueError, match=r"TinyStories-valid.txt is not UTF-8 text \(byte 0xe9 at offset 3\)"):
        corpora.fetch("tinystories", to=tmp_path / "out", base_url=mirror.as_uri(), say=lambda line: None)
    assert not [path for path in (tmp_path / "out").rglob("*") if path.is_file()]


SHARED = corpora.repository_data_dir()
needs_shared = pytest.mark.skipif(not corpora.holds(SHARED, "wikitext2"), reason="the shared corpora are not beside the repository")


def synthetic_stories(count: int) -> str:
    """TinyStories-like text: ``count`` stories of about 1 kB, each ended by its own <|endoftext|> line."""
    story = "Once upon a time, a little fox named Léa found a shiny stone. " * 15
    return "".join(f"{story}{i}\n<|endoftext|>\n" for i in range(count))


def test_fetch_checks_every_file_against_what_flowsim_reads(tmp_path, isolated):
    """Guards issue 83, item 6: fetch accepted an empty file or random bytes as WikiText-2 and an empty TinyStories
    source (a 1-byte sample). Now each WikiText-2 file is checked against its shipped size and SHA-256, the TinyStories
    sample as UTF-8 whole stories filling its size, each failure named (source, expected, found) with the remedy, and
    nothing is left behind."""
    import os

    bad = tmp_path / "bad"
    bad.mkdir()
    for payload, found in ((b"", "found 0 bytes with e3b0c442"), (os.urandom(3000), "found 3000 bytes with ")):
        (bad / "valid.txt").write_bytes(payload)
        with pytest.raises(corpora.CorpusError, match=rf"valid.txt is not the wikitext-2/valid.txt flowsim reads: expected "
                                                      rf"1121681 bytes with SHA-256 f0737ed3\w+, {found}.*; fetch from the "
                                                      r"corpus's own source \(without --from\) or a whole copy of it$"):
            corpora.fetch("wikitext2", to=tmp_path / "out", base_url=str(bad), say=lambda line: None)
        assert not (tmp_path / "out").exists()
    for source, found in (("", "holds 1 bytes of stories"), (synthetic_stories(300), r"holds \d+ bytes of stories")):
        (bad / "TinyStories-valid.txt").write_text(source)
        with pytest.raises(corpora.CorpusError, match=rf"{found}, expected at least 760000 \(whole stories up to 800000\)"):
            corpora.fetch("tinystories", to=tmp_path / "out", base_url=str(bad), say=lambda line: None)
        assert not (tmp_path / "out").exists()
    (bad / "TinyStories-valid.txt").write_text(synthetic_stories(1000))
    sample = corpora.fetch("tinystories", to=tmp_path / "out", base_url=str(bad), say=lambda line: None) / "tinystories" / "valid-sample.txt"
    assert 760_000 <= sample.stat().st_size <= 800_000 and "Léa" in sample.read_text(encoding="utf-8")


@needs_shared
def test_the_shipped_sizes_and_digests_are_the_shared_files_and_a_changed_file_is_named(tmp_path, isolated):
    """Guards issue 83, item 6: after a fetched file was truncated a second fetch said "kept" with its old size and
    SOURCES.json kept the old SHA-256, and the bridge read it. Now the shipped records are those of the shared files,
    a file that changed since its fetch is named (file, expected, found, remedy) by fetch and by the bridge's read, and
    SOURCES.json is left as it was."""
    import shutil

    for relative, expected in corpora.EXPECTED.items():
        assert (SHARED / relative).stat().st_size == expected.bytes
        assert hashlib.sha256((SHARED / relative).read_bytes()).hexdigest() == expected.sha256
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    for name in ("valid.txt", "test.txt"):
        shutil.copyfile(SHARED / "wikitext-2" / name, mirror / name)
    folder = corpora.fetch("wikitext2", to=tmp_path / "data", base_url=f"file:{mirror}", say=lambda line: None)
    said = []
    corpora.fetch("wikitext2", to=folder, base_url=f"file:{mirror}", say=said.append)
    assert f"{folder / 'wikitext-2/valid.txt'} is already there, checked: kept" in said
    manifest = (folder / corpora.FETCH_MANIFEST).read_text()
    valid = folder / "wikitext-2" / "valid.txt"
    valid.write_bytes(valid.read_bytes()[:1000])
    with pytest.raises(corpora.CorpusError, match=rf"^{valid} has 1000 bytes, expected the 1121681 SOURCES.json recorded "
                                                  r"when it was fetched: it changed since; delete it and run `flowsim data fetch`"):
        corpora.fetch("wikitext2", to=folder, base_url=f"file:{mirror}", say=lambda line: None)
    assert (folder / corpora.FETCH_MANIFEST).read_text() == manifest
    same_size = bytearray((mirror / "valid.txt").read_bytes())
    same_size[:5] = b"HELLO"
    valid.write_bytes(bytes(same_size))
    with pytest.raises(corpora.CorpusError, match=r"valid.txt has SHA-256 \w+, expected the f0737ed3\w+ SOURCES.json recorded"):
        corpora.fetch("wikitext2", to=folder, say=lambda line: None)
    torch = pytest.importorskip("torch")  # noqa: F841  the bridge's read
    from flowsim.bridge.data import load_corpus

    with pytest.raises(corpora.CorpusError, match=r"valid.txt has SHA-256 \w+, expected the f0737ed3"):
        load_corpus("wikitext2", 100, folder)


@pytest.mark.parametrize("manifest, problem", [
    ([1, 2], "a JSON list, expected an object with a record of each corpus"),
    ({"wikitext2": 5}, "its 'wikitext2' is 5, expected an object with the \"files\" fetched"),
    ({"wikitext2": {"files": ["valid.txt"]}}, "its 'wikitext2' is {\"files\": [\"valid.txt\"]}, expected an object"),
    ({"wikitext2": {"files": {"wikitext-2/valid.txt": {"bytes": "many"}}}}, "its record of 'wikitext-2/valid.txt' is"),
])
def test_a_sources_json_of_the_wrong_shape_is_one_line(mirror, isolated, manifest, problem):
    """Guards issue 83, item 7: a SOURCES.json that is a list, maps a corpus to a number, or holds its files as a list
    ended fetch in a traceback. Now it is named as damaged in one line with the remedy, exit 2."""
    folder = isolated / "data"
    folder.mkdir()
    (folder / corpora.FETCH_MANIFEST).write_text(json.dumps(manifest))
    result = CliRunner().invoke(app, ["data", "fetch", "wikitext2", "--to", str(folder), "--from", str(mirror)])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert f"SOURCES.json is damaged ({problem}" in result.output and "delete it and run `flowsim data fetch` again" in result.output


def test_a_second_fetch_into_a_folder_waits_for_the_first(mirror, isolated):
    """Guards issue 83, item 8: two fetches into one folder lost one corpus's record in SOURCES.json (both read it,
    each wrote its own). Now a fetch holds the folder's lock while it updates SOURCES.json, so a second one waits for
    it and both records are kept."""
    import threading
    import time

    from flowsim.runs.rundir import folder_lock

    folder = isolated / "data"
    corpora.fetch("wikitext2", to=folder, base_url=str(mirror), say=lambda line: None)
    second = threading.Thread(target=corpora.fetch, args=("tinystories", folder, str(mirror)), kwargs={"say": lambda line: None})
    with folder_lock(folder, "data folder"):  # a first fetch, still at work
        second.start()
        time.sleep(0.5)
        assert second.is_alive() and "tinystories" not in json.loads((folder / corpora.FETCH_MANIFEST).read_text())
    second.join(timeout=30)
    assert set(json.loads((folder / corpora.FETCH_MANIFEST).read_text())) == {"wikitext2", "tinystories"}


def test_the_source_and_the_destination_are_read_as_given(mirror, isolated, monkeypatch):
    """Guards issue 83, item 9: a FIFO in a local mirror blocked fetch forever; --from file:/abs was read as a folder
    named 'file:'; --from '' meant the working directory; a relative $XDG_DATA_HOME was used. Now the FIFO is refused
    at once, file:/abs is a URL, '' is refused, and a relative $XDG_DATA_HOME is ignored as the XDG spec says."""
    import os
    import threading

    fifo = isolated / "fifo-mirror"
    fifo.mkdir()
    os.mkfifo(fifo / "valid.txt")
    outcome = []

    def fetch_from_fifo():
        try:
            corpora.fetch("wikitext2", to=isolated / "from-fifo", base_url=str(fifo), say=lambda line: None)
        except corpora.CorpusError as error:
            outcome.append(str(error))

    worker = threading.Thread(target=fetch_from_fifo, daemon=True)  # a daemon: the old code blocks here for ever
    worker.start()
    worker.join(timeout=20)
    assert outcome == [f"{fifo / 'valid.txt'} is not a regular file (a FIFO, a device or a folder): expected the "
                       "corpus's file valid.txt in the folder --from names"]
    assert not (isolated / "from-fifo").exists()
    folder = corpora.fetch("wikitext2", to=isolated / "abs", base_url=f"file:{mirror}", say=lambda line: None)
    assert (folder / "wikitext-2" / "valid.txt").read_text() == WIKI["valid.txt"]
    monkeypatch.chdir(isolated)
    empty = CliRunner().invoke(app, ["data", "fetch", "wikitext2", "--to", "x", "--from", ""])
    assert empty.exit_code == 2 and "--from is empty: expected a mirror's https:// URL, a file: URL or a local folder" in empty.output
    unknown = CliRunner().invoke(app, ["data", "fetch", "wikitext2", "--to", "x", "--from", "ftp://mirror/"])
    assert unknown.exit_code == 2 and "--from 'ftp://mirror/' is not a URL fetch reads" in unknown.output
    assert not (isolated / "x").exists()
    monkeypatch.setenv("XDG_DATA_HOME", "relative/xdg")
    monkeypatch.setenv("HOME", str(isolated / "home"))
    assert corpora.user_data_dir() == isolated / "home" / ".local" / "share" / "flowsim" / "data"


def test_an_interrupted_download_is_named_and_leaves_nothing(mirror, isolated, monkeypatch):
    """Guards issue 83, item 5: Ctrl-C during a download said "interrupted while the command was starting". Now it
    names the fetch, says that the file being downloaded was not kept (exit 130), and leaves no folder behind."""
    def interrupted(url, destination, say):
        raise KeyboardInterrupt

    monkeypatch.setattr(corpora, "_download", interrupted)
    result = CliRunner().invoke(app, ["data", "fetch", "wikitext2", "--to", str(isolated / "out"), "--from", str(mirror)])
    assert result.exit_code == 130, result.output
    assert result.output.strip() == ("flowsim: interrupted while fetching wikitext2: the file being downloaded was not kept "
                                     "(files already complete are); the same command fetches the rest")
    assert not (isolated / "out").exists()
