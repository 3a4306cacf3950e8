"""The linattn package with its extension module, compiled from the headers of this checkout
(../include) with the interpreter's pybind11 and numpy (Debian: python3-pybind11,
python3-numpy) and Eigen (libeigen3-dev), nothing downloaded. Installed by
`python3 python/install.py`, which checks the interpreter first and then runs
`pip install --no-build-isolation --no-deps --no-index ./python`.

Environment: LINATTN_PORTABLE=1 compiles without -march=native (a module for other machines);
LINATTN_JOBS=N compiles N translation units at once (default: every core); EIGEN3_INCLUDE_DIR
points at Eigen when it is not in /usr/include/eigen3. The CMake build (LINATTN_PYTHON) makes
the same module for the tests and benchmarks.
"""

import os
import re
import sys
from pathlib import Path

try:
    from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
except ImportError:
    # With --no-build-isolation the build uses this interpreter's pybind11: say which one lacks it.
    sys.exit(f"linattn: {sys.executable} cannot import pybind11; `python3 python/install.py` "
             f"checks what an interpreter lacks and names one of this machine that has it")
from setuptools import setup

HERE = Path(__file__).resolve().parent
INCLUDE = HERE.parent / "include"
if not (INCLUDE / "linattn" / "version.hpp").exists():
    sys.exit(f"linattn: the C++ headers are not at {INCLUDE}: install from a checkout of the repository "
             f"(pip install --no-build-isolation ./python from its root)")


def eigen_dir() -> str:
    for d in (os.environ.get("EIGEN3_INCLUDE_DIR"), "/usr/include/eigen3", "/usr/local/include/eigen3"):
        if d and (Path(d) / "Eigen" / "Core").exists():
            return d
    sys.exit("linattn: Eigen 3.4 not found (Debian: apt-get install libeigen3-dev; or set EIGEN3_INCLUDE_DIR)")


version = re.search(r'LINATTN_VERSION_STRING "([^"]+)"', (INCLUDE / "linattn" / "version.hpp").read_text()).group(1)
flags = ["-O3", "-DNDEBUG", "-fopenmp"]
if os.environ.get("LINATTN_PORTABLE", "0") != "1":
    flags.append("-march=native")  # as the CMake build with LINATTN_NATIVE: the module runs here

# The module's translation units compile in parallel (setuptools alone compiles them one by one).
ParallelCompile("LINATTN_JOBS", default=0).install()


def flags_stamp() -> str:
    """A file in the build tree that changes when the flags or the compiler do, so that setuptools,
    which skips an extension newer than its sources and `depends`, rebuilds it then."""
    stamp = HERE / "build" / "linattn_flags.txt"
    compilers = [os.environ.get("CXX", ""), os.environ.get("CC", "")]
    text = " ".join(flags + compilers + [sys.version]) + "\n"
    if not stamp.exists() or stamp.read_text() != text:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(text)
    return str(stamp)


# Every header the module compiles from: setuptools compares only the listed files' times.
headers = sorted(str(p) for p in [*INCLUDE.rglob("*.hpp"), *(HERE / "src").glob("*.hpp")])

module = Pybind11Extension(
    "linattn._linattn",
    sorted(str(p.relative_to(HERE)) for p in (HERE / "src").glob("*.cpp")),
    depends=headers + [flags_stamp()],
    include_dirs=[str(INCLUDE), eigen_dir()],
    cxx_std=17,
    extra_compile_args=flags,
    extra_link_args=["-fopenmp"],
)

setup(
    name="linattn",
    version=version,
    description="Linear attention (Transformers are RNNs) on the CPU: numpy and PyTorch bindings of the "
                "linattn C++ library",
    license="MIT",
    packages=["linattn"],
    ext_modules=[module],
    cmdclass={"build_ext": build_ext},
    python_requires=">=3.8",
    install_requires=["numpy"],
    zip_safe=False,
)
