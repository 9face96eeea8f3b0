"""`colibri convert` onto a path that a running process maps: the file is replaced by rename
(a new inode), never rewritten in place, so the mapping keeps the old bytes; temporary files
of killed conversions are removed by the next conversion of the same destination, and only
those.

The reader is a real subprocess that maps the file with colibri.open and hashes the mapping
over and over while a real `colibri convert --force` subprocess replaces it.
"""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import colibri
from colibri.convert import convert
from colibri.format import writer as writer_mod

# Maps PATH (mmap, and colibri.load), prints "ready <sha256>", then hashes the mapping in a
# loop until stdin closes; prints "done <iterations> <mismatches> <sha256 at the end>
# <1 if the logits of one forward are unchanged>".
READER = textwrap.dedent("""
    import hashlib, mmap, sys, threading
    import numpy as np
    import colibri
    path = sys.argv[1]
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    first = hashlib.sha256(buf).hexdigest()
    model = colibri.load(path)
    logits = colibri.forward(model, np.array([3, 5, 7]))
    print("ready", first, flush=True)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    n = bad = 0
    while not stop.is_set() or n == 0:
        n += 1
        bad += hashlib.sha256(buf).hexdigest() != first
    again = colibri.forward(model, np.array([3, 5, 7]))
    print("done", n, bad, hashlib.sha256(buf).hexdigest(),
          int(np.array_equal(logits, again)), flush=True)
""")

# Creates a ColibriWriter for PATH (its locked temp file), prints "ready <temp>", then waits.
LIVE_WRITER = textwrap.dedent("""
    import sys, time
    import numpy as np
    from colibri.format import ColibriWriter, TensorSpec
    w = ColibriWriter(sys.argv[1], [TensorSpec("x", "f32", (4,))], {}, n_layers=0,
                      n_experts=0, overwrite=True)
    print("ready", w._tmp, flush=True)
    time.sleep(600)
""")


def temp_files(folder) -> list[str]:
    return sorted(f for f in os.listdir(folder) if ".tmp-" in f)


def start_reader(path) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-c", READER, str(path)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline().split()
    assert line and line[0] == "ready", p.stderr.read()
    return p, line[1]


def stop_reader(p: subprocess.Popen) -> tuple[int, int, str, bool]:
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    _, n, bad, digest, same = out.split()
    return int(n), int(bad), digest, same == "1"


@pytest.fixture
def served(hf_checkpoint, tmp_path):
    """(checkpoint folder, a converted f32 .colibri file in tmp_path/serve)."""
    src = hf_checkpoint("mixtral")
    (tmp_path / "serve").mkdir()
    return src, convert(src, tmp_path / "serve" / "m.colibri", dtype="f32", progress=False)


def test_convert_onto_a_mapped_file_replaces_it_by_rename(served):
    src, dst = served
    old_bytes = dst.read_bytes()
    old_ino = dst.stat().st_ino
    reader, digest = start_reader(dst)
    try:
        assert digest == hashlib.sha256(old_bytes).hexdigest()
        subprocess.run([sys.executable, "-m", "colibri", "convert", str(src), str(dst),
                        "--force", "--dtype", "bf16", "-q"], check=True, timeout=120)
    finally:
        n, bad, end_digest, same_logits = stop_reader(reader)
    assert n > 0 and bad == 0, f"{bad} of {n} hashes of the old mapping changed"
    assert end_digest == digest and same_logits
    assert dst.stat().st_ino != old_ino
    assert dst.read_bytes() != old_bytes          # the new (bf16) file is in place
    colibri.open(dst).validate()
    assert temp_files(dst.parent) == []


def test_the_reader_sees_an_in_place_rewrite(served):
    """The control: writing into the mapped file in place is what the reader detects, so
    the test above can fail."""
    _, dst = served
    reader, _ = start_reader(dst)
    try:
        with open(dst, "r+b") as f:
            f.seek(-64, os.SEEK_END)
            flipped = bytes(b ^ 0xFF for b in f.read(64))
            f.seek(-64, os.SEEK_END)
            f.write(flipped)
        time.sleep(0.2)
    finally:
        n, bad, _, _ = stop_reader(reader)
    assert bad > 0


def test_permission_bits_carry_over(served):
    src, dst = served
    os.chmod(dst, 0o640)
    convert(src, dst, force=True, progress=False)
    assert dst.stat().st_mode & 0o777 == 0o640


def test_killed_conversion_temp_is_removed_live_one_kept(served):
    src, dst = served
    folder = dst.parent
    live = subprocess.Popen([sys.executable, "-c", LIVE_WRITER, str(dst)],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = live.stdout.readline().split()
        assert line and line[0] == "ready"
        live_tmp = line[1]
        stale = folder / f".{dst.name}.tmp-0badc0de"
        stale.write_bytes(b"left by a killed conversion")
        other = [folder / f".{dst.name}.tmp-notmine", folder / ".other.colibri.tmp-0badc0de"]
        for f in other:
            f.write_bytes(b"not a temp file of this destination's writers")
        assert writer_mod.remove_stale_temps(dst) == [str(stale)]
        assert os.path.exists(live_tmp), "a live writer's temp file was removed"

        live.send_signal(signal.SIGKILL)      # now it is a killed conversion's leftover
        live.wait(timeout=30)
        assert os.path.exists(live_tmp)
        convert(src, dst, force=True, progress=False)
        assert not os.path.exists(live_tmp)
    finally:
        live.kill()
        live.wait(timeout=30)
    assert sorted(temp_files(folder)) == sorted(f.name for f in other)


def test_writer_reports_what_it_removed(tmp_path):
    dst = tmp_path / "a.colibri"
    stale = tmp_path / ".a.colibri.tmp-12345678"
    stale.write_bytes(b"x")
    w = writer_mod.ColibriWriter(dst, [writer_mod.TensorSpec("x", "f32", (4,))], {},
                                 n_layers=0, n_experts=0)
    with w:
        w.write("x", np.zeros(4, np.float32))
    assert w.stale_removed == [str(stale)] and temp_files(tmp_path) == []


def test_a_symlinked_destination_is_replaced_not_its_target(served):
    """Converting onto a symlink renames the new file over the link; the file it pointed to
    (maybe mapped by a server under its own name) is untouched."""
    src, target = served
    link = target.with_name("current.colibri")
    link.symlink_to(target.name)
    before = target.read_bytes()
    convert(src, link, force=True, dtype="bf16", progress=False)
    assert not link.is_symlink() and link.read_bytes() != before
    assert target.read_bytes() == before
    assert temp_files(target.parent) == []
