"""The compiled part of nixl-kv: one Cython extension module, ``nixl_kv._fastpath`` (the request path's compiled
steps, DESIGN section 9). Everything else is in pyproject.toml. Building it needs gcc and the Python headers; Cython
comes from the build requirements (pyproject.toml), or the test extra for builds without isolation."""

from Cython.Build import cythonize
from setuptools import Extension, setup

setup(
    ext_modules=cythonize(
        [Extension("nixl_kv._fastpath", ["nixl_kv/_fastpath.pyx"], extra_compile_args=["-O3", "-g0"])],
        compiler_directives={"language_level": 3},
    )
)
