"""The converter side of docs/safety.md: config values range-checked, a garbage tokenizer or a
deeply nested config.json refused before any byte is written; SIGTERM / SIGKILL at random
moments leave no partial destination and no file that validates, and the next run cleans up;
a full disk gives an error naming the bytes needed and leaves nothing behind."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from colibri.convert import convert
from colibri.errors import ColibriError
from colibri.format import ColibriFile, ColibriWriter, TensorSpec
from colibri.tools.inspect import validate
from hf_factory import copy_checkpoint, make_hf_checkpoint


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _edit_config(src, tmp_path, edit):
    ck = copy_checkpoint(src, tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    edit(cfg)
    (ck / "config.json").write_text(json.dumps(cfg))
    return ck


def _theta(value):
    def edit(cfg):
        cfg["rope_theta"] = value
        if isinstance(cfg.get("rope_parameters"), dict):
            cfg["rope_parameters"]["rope_theta"] = value
    return edit


@pytest.mark.parametrize("edit,fragment", [
    (lambda c: c.update(rms_norm_eps=-1e-6), "rms_norm_eps"),
    (lambda c: c.update(rms_norm_eps=0.5), "rms_norm_eps"),
    (_theta(0), "rope_theta"),
    (lambda c: c.update(num_experts_per_tok=99), "num_experts_per_tok"),
    (lambda c: c.update(sliding_window=1), "sliding_window"),
    (lambda c: c.update(num_hidden_layers="2"), "num_hidden_layers"),
])
def test_bad_config_values_are_refused_before_writing(hf_checkpoint, tmp_path, edit, fragment):
    ck = _edit_config(hf_checkpoint("mixtral"), tmp_path, edit)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ColibriError, match=fragment):
        convert(ck, out / "m.colibri", progress=False)
    assert leftovers(out) == []


def test_a_deeply_nested_config_json_is_a_clear_error(hf_checkpoint, tmp_path):
    ck = copy_checkpoint(hf_checkpoint("mixtral"), tmp_path / "ck")
    text = (ck / "config.json").read_text()
    (ck / "config.json").write_text(text[:-1].rstrip() + ', "x": ' + "[" * 100000
                                    + "]" * 100000 + "}")
    with pytest.raises(ColibriError, match=r"nests \d+ levels deep"):
        convert(ck, tmp_path / "m.colibri", progress=False)
    assert not (tmp_path / "m.colibri").exists()


@pytest.mark.parametrize("text", ["{ garbage", '{"model": {"type": "BPE", "vocab": 3}}',
                                  '{"version": "1.0"}'])
def test_a_garbage_tokenizer_json_is_refused_before_writing(hf_checkpoint, tmp_path, text):
    ck = copy_checkpoint(hf_checkpoint("mixtral"), tmp_path / "ck")
    (ck / "tokenizer.json").write_text(text)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ColibriError, match="tokenizer"):
        convert(ck, out / "m.colibri", progress=False)
    assert leftovers(out) == []


def test_the_converted_file_is_validated_before_the_rename(hf_checkpoint, tmp_path,
                                                           monkeypatch):
    """A problem only a full read finds (here: validate made to report one) keeps the
    destination from appearing."""
    from colibri.convert import checks as convert_guard
    monkeypatch.setattr(convert_guard.validation, "validate", lambda cf: ["tensor 'x': bad"])
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ColibriError, match="fails validation and was not written"):
        convert(hf_checkpoint("mixtral"), out / "m.colibri", progress=False)
    assert leftovers(out) == []


# --- signals -------------------------------------------------------------------------------

CONVERT = [sys.executable, "-m", "colibri", "convert", "-q", "--force"]


def _kill_at(src: Path, dst: Path, sig: int, delay: float) -> int:
    proc = subprocess.Popen(CONVERT + [str(src), str(dst)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=dst.parent)
    time.sleep(delay)
    proc.send_signal(sig)
    return proc.wait(timeout=120)


def _temps(folder: Path, dst: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.name.startswith(f".{dst.name}.tmp-")]


@pytest.fixture(scope="module")
def timed(tmp_path_factory):
    """A checkpoint and how long one `colibri convert` of it takes in a subprocess."""
    src = make_hf_checkpoint(tmp_path_factory.mktemp("ck") / "model", "mixtral",
                             hidden_size=128, intermediate_size=256, num_local_experts=8)
    dst = tmp_path_factory.mktemp("t") / "m.colibri"
    start = time.monotonic()
    # (away from the checkout: `python -m colibri` there would import the source folder)
    subprocess.run(CONVERT + [str(src), str(dst)], check=True, cwd=dst.parent)
    return src, time.monotonic() - start


def _check_after_kill(folder: Path, dst: Path) -> tuple[int, int]:
    """(partial destinations, files that validate among the partial ones and the temps)."""
    partial = valid = 0
    if dst.exists():
        try:
            with ColibriFile(dst) as cf:
                ok = validate(cf) == []
        except ColibriError:
            ok = False
        partial += not ok
    for t in _temps(folder, dst):
        try:
            with ColibriFile(t) as cf:
                valid += validate(cf) == []
        except ColibriError:
            pass
    return partial, valid


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_kills_at_random_moments_leave_no_partial_file(timed, tmp_path, sig):
    src, seconds = timed
    rng = np.random.default_rng(int(sig))
    for k in range(3):
        folder = tmp_path / f"k{k}"
        folder.mkdir()
        dst = folder / "m.colibri"
        _kill_at(src, dst, sig, float(rng.uniform(0.2, 1.0)) * seconds)
        partial, valid = _check_after_kill(folder, dst)
        assert (partial, valid) == (0, 0)
        if sig != signal.SIGKILL:                      # handlers ran the cleanup
            assert _temps(folder, dst) == []
        convert(src, dst, progress=False, force=True)  # the next run removes the rest
        assert _temps(folder, dst) == [] and ColibriFile(dst).validate() == []


def test_a_temp_file_killed_mid_write_never_validates(timed, tmp_path):
    """A SIGKILL while the writer is inside its data (the temp file full size, header still
    zero): the copy of it fails to open, whatever a later user calls it."""
    src, seconds = timed
    dst = tmp_path / "m.colibri"
    proc = subprocess.Popen(CONVERT + [str(src), str(dst)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=tmp_path)
    deadline = time.monotonic() + 5 * seconds + 30
    while not _temps(tmp_path, dst) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    proc.kill()
    proc.wait()
    temps = _temps(tmp_path, dst)
    if not temps:
        pytest.skip("the conversion finished before a temp file was seen")
    with pytest.raises(ColibriError):
        ColibriFile(temps[0])


# --- full disk -----------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                       capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_full_disk_names_the_bytes_needed_and_leaves_nothing(timed, small_disk):
    src, _ = timed
    with pytest.raises(ColibriError, match=r"not enough disk space: the file needs \d+ bytes"):
        convert(src, small_disk / "m.colibri", progress=False)
    assert leftovers(small_disk) == []


def test_running_out_of_space_while_writing_is_the_same_clear_error(small_disk, monkeypatch):
    """The space check passed (another writer filled the disk after it): ENOSPC mid-write."""
    real = os.statvfs

    class Roomy:
        def __init__(self, st):
            self.f_frsize, self.f_bavail = st.f_frsize, 1 << 40
    monkeypatch.setattr(os, "statvfs", lambda p: Roomy(real(p)))
    t = {f"t{i}": np.ones((256, 1024), np.float32) for i in range(3)}    # 3 MB > 2 MB
    specs = [TensorSpec.infer(n, "f32", a.shape) for n, a in t.items()]
    with pytest.raises(ColibriError, match=r"needs \d+ bytes"):
        with ColibriWriter(small_disk / "m.colibri", specs, {}, n_layers=0,
                           n_experts=0) as w:
            for n, a in t.items():
                w.write(n, a)
    assert leftovers(small_disk) == []
