"""Build the Cython kernels.

One extension module, ``colibri._kernels``: ``colibri/_kernels.pyx`` with its
sections ``colibri/pyx/*.pxi``, over the C headers ``colibri/_simd.h`` and
``colibri/csrc/*.h`` (all listed as dependencies: editing any of them rebuilds).
It is compiled for the baseline of the target architecture (no ``-march=native``:
a wheel must run anywhere); the AVX2, AVX-512 and VNNI bodies (``csrc/avx2*.h``,
``csrc/avx512*.h``, ``csrc/vnni.h``) carry their own ``__attribute__((target(...)))`` and
are chosen at run time.

Environment switches:
  COLIBRI_NO_THREADS=1    build without the thread pool (kernels run single-threaded)
  COLIBRI_DEBUG_CYTHON=1  bounds and initialisation checks on, -O0 -g
  COLIBRI_NATIVE=1        add -march=native (local benchmarking only)
"""
import glob
import os
import sys

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup


debug = os.environ.get("COLIBRI_DEBUG_CYTHON") == "1"
extra_compile = ["-O0", "-g"] if debug else ["-O3"]
if sys.platform != "win32":
    extra_compile += ["-fno-strict-aliasing", "-Wno-unused-function"]
# the kernels' thread pool (colibri/csrc/pool.h) uses POSIX threads; without them (Windows, or
# COLIBRI_NO_THREADS=1) every kernel runs on the calling thread
threads_flags = []
if os.environ.get("COLIBRI_NO_THREADS") == "1":
    extra_compile.append("-DCOLIBRI_NO_THREADS")
elif sys.platform != "win32":
    threads_flags = ["-pthread"]
if os.environ.get("COLIBRI_NATIVE") == "1":
    extra_compile.append("-march=native")

# every file the module is built from: a change to any of them rebuilds it
depends = (["colibri/_simd.h"] + sorted(glob.glob("colibri/csrc/*.h"))
           + sorted(glob.glob("colibri/pyx/*.pxi")))

extensions = [
    Extension(
        "colibri._kernels",
        ["colibri/_kernels.pyx"],
        include_dirs=[np.get_include(), "colibri"],   # "_simd.h", "csrc/attend.h", ...
        depends=depends,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_22_API_VERSION")],
        extra_compile_args=extra_compile + threads_flags,
        extra_link_args=threads_flags,
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
