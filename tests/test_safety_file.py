"""The filesystem side of docs/safety.md: regular files only (a FIFO, a device, a socket or a
directory fails at once, never blocks), a failing mmap names the file, a mapped file changed
in place is detected (check_unchanged, load), replacing by rename is not."""
from __future__ import annotations

import mmap
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

import colibri
from colibri.errors import ColibriError, ColibriFileChangedError, ColibriFormatError
from colibri.format import ColibriFile
from safety_helpers import SHIPPED, resave


def _fifo(tmp_path):
    p = tmp_path / "model.colibri"
    os.mkfifo(p)
    return p


def _socket(tmp_path):
    p = tmp_path / "s.colibri"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(p))
    return p


NON_REGULAR = {
    "fifo": (_fifo, "FIFO"),
    "directory": (lambda t: t, "directory"),
    "char device": (lambda t: "/dev/null", "character device"),
    "socket": (_socket, "socket"),
}


@pytest.mark.parametrize("kind", list(NON_REGULAR))
def test_non_regular_paths_fail_at_once(tmp_path, kind):
    make, word = NON_REGULAR[kind]
    path = make(tmp_path)
    start = time.monotonic()
    with pytest.raises(ColibriFormatError, match=word) as info:
        ColibriFile(path)
    assert str(path) in str(info.value) and "not a regular file" in str(info.value)
    with pytest.raises(ColibriFormatError, match=word):
        colibri.load(path)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("command", [["inspect"], ["inspect", "--validate"],
                                     ["generate", "--prompt", "hi", "-n", "2"]])
def test_cli_on_a_fifo_exits_with_one_line_not_a_hang(tmp_path, command):
    fifo = _fifo(tmp_path)
    argv = [sys.executable, "-m", "colibri", command[0], str(fifo), *command[1:]]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode != 0
    assert "FIFO" in r.stdout + r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_failing_mmap_names_the_file(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")
    monkeypatch.setattr(mmap, "mmap", refuse)
    with pytest.raises(ColibriError) as info:
        ColibriFile(SHIPPED)
    msg = str(info.value)
    assert str(SHIPPED) in msg and "cannot map" in msg and "Cannot allocate memory" in msg


@pytest.fixture
def copy(tmp_path):
    p = tmp_path / "m.colibri"
    shutil.copyfile(SHIPPED, p)
    return p


def test_unchanged_file_passes(copy):
    with ColibriFile(copy) as cf:
        cf.check_unchanged()


@pytest.mark.parametrize("change", ["truncate", "append", "same size overwrite"])
def test_in_place_changes_are_detected(copy, change):
    cf = ColibriFile(copy)
    size = cf.file_size
    if change == "truncate":
        os.truncate(copy, size // 2)
    elif change == "append":
        with open(copy, "ab") as f:
            f.write(b"\0" * 4096)
    else:
        st = os.stat(copy)
        with open(copy, "r+b") as f:             # what `cp other copy` does: same inode
            f.seek(size - 64)
            f.write(os.urandom(64))
        os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))   # coarse clocks
    with pytest.raises(ColibriFileChangedError, match="in place") as info:
        cf.check_unchanged()
    assert str(copy) in str(info.value) and "rename" in str(info.value)
    with pytest.raises(ColibriFileChangedError):       # a long operation refuses too
        cf.validate()
    with pytest.raises(ColibriFileChangedError):       # and so does a model built on it
        colibri.load(cf)
    cf.close()


def test_replace_by_rename_is_not_a_change(copy, tmp_path):
    cf = ColibriFile(copy)
    resave(SHIPPED, tmp_path / "new.colibri", lambda m: m["user"].update(v="2"))
    os.replace(tmp_path / "new.colibri", copy)
    cf.check_unchanged()                       # the mapped inode is untouched
    assert ColibriFile(copy).user_metadata["v"] == "2"
    cf.close()


def test_close_releases_the_descriptor(copy):
    cf = ColibriFile(copy)
    fd = cf._fd
    cf.close()
    with pytest.raises(OSError):
        os.fstat(fd)
    with pytest.raises(ColibriError, match="closed"):
        cf.check_unchanged()
