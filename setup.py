"""The compiled part of nixl-kv, two Cython extension modules (DESIGN section 9): ``nixl_kv._fastpath``, the request
path's compiled steps (the params' seal, the decoders), and ``nixl_kv._core``, the NIXL data path through NIXL's C API
(``nixl_kv/csrc``: the API opened at run time from the nixl wheel, so nothing of NIXL is needed to build).
Everything else is in pyproject.toml. Building needs gcc and the Python headers; Cython comes from the build
requirements (pyproject.toml), or the test extra for builds without isolation."""

from Cython.Build import cythonize
from setuptools import Extension, setup

FLAGS = ["-O3", "-g0"]

setup(
    ext_modules=cythonize(
        [
            Extension("nixl_kv._fastpath", ["nixl_kv/_fastpath.pyx"], extra_compile_args=FLAGS),
            Extension(
                "nixl_kv._core",
                ["nixl_kv/_core.pyx", "nixl_kv/csrc/nixl_capi.c"],
                include_dirs=["nixl_kv/csrc"],
                extra_compile_args=FLAGS,
                libraries=["dl"],
            ),
        ],
        compiler_directives={"language_level": 3},
    )
)
