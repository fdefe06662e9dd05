"""atomic_write (helpers.py): the one way the caches and downloads write a file that other processes may read."""
import os
import time
import pytest
from fusegrad.helpers import STALE_ANY_S, atomic_write

@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "fusegrad"

def test_writes_the_whole_file_or_nothing(cache):
    path = cache / "sub" / "entry"
    with atomic_write(path) as f: f.write(b"first")
    assert path.read_bytes() == b"first"
    with pytest.raises(RuntimeError):
        with atomic_write(path) as f:
            f.write(b"half")
            raise RuntimeError("killed")
    assert path.read_bytes() == b"first" and os.listdir(path.parent) == ["entry"]
    with atomic_write(path, "w") as f: f.write("text")
    assert path.read_text() == "text"

def test_stale_temporary_files_are_removed_only_in_the_cache(cache, tmp_path):
    old = time.time() - STALE_ANY_S - 60
    for folder in (cache / "beam", tmp_path / "mine"):
        folder.mkdir(parents=True)
        (folder / ".tmp-1-left").write_bytes(b"x")
        os.utime(folder / ".tmp-1-left", (old, old))
        with atomic_write(folder / "new") as f: f.write(b"y")
    assert sorted(os.listdir(cache / "beam")) == ["new"]
    assert sorted(os.listdir(tmp_path / "mine")) == [".tmp-1-left", "new"]
