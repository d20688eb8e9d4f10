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
def mirror(tmp_path):
    folder = tmp_path / "mirror"
    folder.mkdir()
    for name, text in WIKI.items():
        (folder / name).write_text(text)
    (folder / "TinyStories-valid.txt").write_text(STORIES)
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
    with pytest.raises(ConnectionError, match=r"could not download file:///no/such/mirror/valid.txt \(.*\): fetch needs the network"):
        corpora.fetch("wikitext2", to=isolated / "out", base_url="file:///no/such/mirror", say=lambda line: None)
    assert not any(path.is_file() for path in (isolated / "out").rglob("*"))
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
    assert offline.exit_code == 1 and "could not download" in offline.output


def test_tinystories_own_separators_cut_stories_not_paragraphs(isolated, tmp_path):
    """TinyStories' files end each story with an <|endoftext|> line, and a story may hold blank lines (paragraphs):
    the sample keeps whole stories without the markers. A plain folder as --from is read as its file:// URL, and the
    files written are readable like any other (not owner-only)."""
    import os
    import stat

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
