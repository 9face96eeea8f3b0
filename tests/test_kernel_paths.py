"""Which path each matmul class runs on (colibri.kernels.kernel_paths: `colibri inspect --kernels`,
the `colibri bench` header), and the AMX self-check's failure path, drilled through the tile
emulation (the real check needs AMX hardware: amx against amx-emu)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from colibri import _kernels
from colibri.kernels import runtime
from colibri.api import default_model_path
from colibri.kernels.kernel_paths import format_kernel_paths, kernel_paths, matmul_formats

from cli_helpers import run

CLASSES = ["decode matvec", "prefill GEMM", "grouped expert FFN", "head"]
FORMATS = {"dense": "q4", "experts": "q4", "head": "q8"}


def _python(code: str, **env) -> subprocess.CompletedProcess:
    full = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full, timeout=120)


def test_inspect_kernels_names_each_class_and_the_wider_paths(capsys):
    code, out, err = run(capsys, "inspect", str(default_model_path()), "--kernels")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"kernels: ISA {runtime.get_isa()}, int16 activations"
    for cls in CLASSES:
        assert any(line.strip().startswith(cls) for line in lines), cls
    wider = runtime.ISAS[runtime.ISAS.index(runtime.get_isa()) + 1:]
    if wider:
        assert "wider paths not chosen" in lines[-1]
        for name in wider:
            assert f"{name}: " in lines[-1]
    code, out, err = run(capsys, "inspect", str(default_model_path()), "--kernels", "--json",
                         "-a", "f32")
    data = json.loads(out)
    assert [r["class"] for r in data["kernels"]] == CLASSES
    assert all("f32" in r["body"] for r in data["kernels"])


def test_row_and_gemm_bodies_follow_the_crossover():
    isa = runtime.get_isa()
    rows = {r["class"]: r for r in kernel_paths(FORMATS, "int16", isa)}
    assert rows["head"]["format"] == "q8" and rows["decode matvec"]["path"] == isa
    start = runtime.igemm_crossover(isa, "int16")
    ffn = rows["grouped expert FFN"]["body"]
    if start is None:
        assert "at every token count" in ffn and not re.search(r"from \d+ tokens", ffn)
    else:
        assert f"from {start}" in ffn and f"from {start} tokens" in rows["prefill GEMM"]["body"]
    if isa in ("avx512vnni", "amx", "amx-emu"):
        assert "small-M row kernel" in rows["decode matvec"]["body"]
    assert "f32 GEMM" in kernel_paths(FORMATS, "f32", isa)[1]["body"]


def test_amx_reason_is_the_cpu_or_the_build_when_not_usable():
    code = runtime.ISAS.index("amx")
    why = _kernels.isa_why_not(code)
    assert (why == "") == ("amx" in runtime.available_isas())
    lines = format_kernel_paths(FORMATS, "int16", "avx2")
    assert "amx: " in lines[-1] and ("avx512vnni: " in lines[-1])
    if "avx512vnni" in runtime.available_isas():
        assert "avx512vnni: runs here, not selected" in lines[-1]


def test_forced_path_is_reported_in_a_fresh_interpreter():
    if "avx2" not in runtime.available_isas():
        pytest.skip("no avx2 path on this CPU")
    p = _python("from colibri.kernels.kernel_paths import format_kernel_paths as f\n"
                "print('\\n'.join(f({'dense': 'q4', 'experts': 'q4', 'head': 'q4'})))",
                COLIBRI_ISA="avx2")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("kernels: ISA avx2, int16 activations")
    assert "avx2 row kernel (int16 codes)" in p.stdout


def test_matmul_formats_of_a_file():
    from colibri.format import ColibriFile
    with ColibriFile(default_model_path()) as cf:
        f = matmul_formats(cf.tensors)
    assert set(f) == {"dense", "experts", "head"} and f["experts"] == "q4"


def test_amx_selfcheck_mismatch_disables_amx_with_one_warning():
    """The self-check's verdict path (csrc/amx.h colibri_amx_verdict) with the emulation on
    both sides: the same bits pass silently; a flipped output bit disables amx for the
    process, says why, and warns once however often it fails."""
    if "avx512vnni" not in runtime.available_isas():
        pytest.skip("the tile emulation needs the avx512vnni path")
    p = _python("from colibri import _kernels\nfrom colibri.kernels import runtime\n"
                "print(_kernels._amx_selfcheck_drill(False))\n"
                "print(_kernels._amx_selfcheck_drill(True), _kernels._amx_selfcheck_drill(True))\n"
                "print('amx' in runtime.available_isas())\n"
                "print(_kernels.isa_why_not(runtime.ISAS.index('amx')))\n"
                "print('amx-emu' in runtime.available_isas())")
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["True", "False False", "False",
                                     "the self-check against the emulation failed", "True"]
    warnings = [line for line in p.stderr.splitlines() if "AMX disabled" in line]
    assert warnings == ["colibri: AMX disabled: the tile bodies' self-check against their "
                        "emulation gave other bits; using avx512vnni"]


def test_bench_table_is_followed_by_the_paths_of_each_activations_mode():
    from colibri.tools.bench import format_markdown, run_bench
    rows = run_bench(default_model_path(), n_prompt=0, n_gen=2, threads=1, reps=1,
                     bandwidth_bytes=0, activations=["int16", "f32"])
    assert [r["class"] for r in rows[0]["kernel_paths"]] == CLASSES
    lines = format_markdown(rows).splitlines()
    heads = [line for line in lines if line.startswith("kernels: ")]
    assert heads == [f"kernels: ISA {runtime.get_isa()}, int16 activations",
                     f"kernels: ISA {runtime.get_isa()}, f32 activations"]
