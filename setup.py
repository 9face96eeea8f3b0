"""Build the Cython kernels.

One extension module, ``colibri._kernels``.  It is compiled for the baseline of
the target architecture (no ``-march=native``: a wheel must run anywhere); the
AVX2 and AVX-512 bodies in ``_simd.h`` carry their own
``__attribute__((target(...)))`` and are chosen at run time.

Environment switches:
  COLIBRI_NO_OPENMP=1     build without OpenMP (kernels run single-threaded)
  COLIBRI_DEBUG_CYTHON=1  bounds and initialisation checks on, -O0 -g
  COLIBRI_NATIVE=1        add -march=native (local benchmarking only)
"""
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup


def _compiler_accepts(flag: str) -> bool:
    """True when the C compiler builds and links a trivial OpenMP program with `flag`."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "t.c")
        with open(src, "w") as f:
            f.write("#include <omp.h>\nint main(void){return omp_get_max_threads() > 0 ? 0 : 1;}\n")
        try:
            res = subprocess.run([cc, flag, src, "-o", os.path.join(tmp, "t")],
                                 capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return False
        return res.returncode == 0


def openmp_flags():
    if os.environ.get("COLIBRI_NO_OPENMP") == "1":
        return [], []
    if sys.platform == "win32":
        return ["/openmp"], []
    if sys.platform == "darwin":
        return ["-Xpreprocessor", "-fopenmp"], ["-lomp"]
    if _compiler_accepts("-fopenmp"):
        return ["-fopenmp"], ["-fopenmp"]
    print("colibri: the C compiler has no OpenMP; kernels will run single-threaded", file=sys.stderr)
    return [], []


debug = os.environ.get("COLIBRI_DEBUG_CYTHON") == "1"
omp_compile, omp_link = openmp_flags()
extra_compile = ["-O0", "-g"] if debug else ["-O3"]
if sys.platform != "win32":
    extra_compile += ["-fno-strict-aliasing", "-Wno-unused-function"]
if os.environ.get("COLIBRI_NATIVE") == "1":
    extra_compile.append("-march=native")

extensions = [
    Extension(
        "colibri._kernels",
        ["colibri/_kernels.pyx"],
        include_dirs=[np.get_include(), "colibri"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_22_API_VERSION")],
        extra_compile_args=extra_compile + omp_compile,
        extra_link_args=omp_link,
    )
]

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives={
            "language_level": 3,
            "boundscheck": debug,
            "wraparound": False,
            "initializedcheck": debug,
            "nonecheck": False,
            "cdivision": True,
            "embedsignature": True,
        },
    )
)
