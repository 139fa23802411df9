"""Build script: compiles the Cython planner ``stpipe/_planner.pyx`` and the driver-call
helpers ``stpipe/_calls.pyx``.

``STPIPE_CYTHON_BOUNDSCHECK=1`` at build time turns bounds and wraparound checks on
(for tests of the compiled code); the default build runs without them.
"""
import os

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

_checks = os.environ.get("STPIPE_CYTHON_BOUNDSCHECK", "0") == "1"

directives = {
    "language_level": 3,
    "boundscheck": _checks,
    "wraparound": _checks,
    "initializedcheck": _checks,
    "cdivision": True,
    "embedsignature": True,
}

extensions = [
    Extension(
        "stpipe._planner",
        ["stpipe/_planner.pyx"],
        include_dirs=[np.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=["-O3"],
    ),
    # CUDA driver calls through addresses given at run time, and nogil host packing:
    # no CUDA headers or libraries at build time
    Extension("stpipe._calls", ["stpipe/_calls.pyx"], extra_compile_args=["-O3"]),
]

setup(ext_modules=cythonize(extensions, compiler_directives=directives))
