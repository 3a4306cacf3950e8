#!/usr/bin/env python3
"""Installs the linattn Python package from this checkout for the interpreter that runs it:

    python3 python/install.py            # from the repository's root (any directory works)

It first checks that this interpreter can build the extension (Python >= 3.8 with its
development headers, pybind11 >= 2.10, setuptools >= 61, numpy, pip >= 21.3, a C++ compiler,
Eigen); when it cannot, it says what is missing and names an interpreter of this machine that
can (on Debian, /usr/bin/python3 after `bash .ci/bootstrap`), and stops before compiling. Then:

* inside a virtual environment: pip installs into it;
* for an externally managed interpreter (Debian's /usr/bin/python3): into a virtual environment
  that sees the system's packages (numpy, torch), .venv at the repository's root or --venv DIR;
* otherwise (pyenv, conda, a Python built from source): pip installs into the interpreter.

Nothing is downloaded: pip runs with --no-build-isolation --no-deps --no-index on the
interpreter's own pybind11, setuptools and numpy. --jobs N compiles N translation units at once
(default: every core), --portable leaves out -march=native (a module for other machines).
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# The Debian package of each requirement (what `.ci/bootstrap` installs).
NEEDS = (
    ("pybind11", (2, 10), "python3-pybind11"),
    ("setuptools", (61,), "python3-setuptools"),
    ("numpy", None, "python3-numpy"),
    ("pip", (21, 3), "python3-pip"),
)


def version_tuple(text):
    """(2, 10, 3) of "2.10.3", (1, 24) of "1.24rc1": the leading numbers."""
    match = re.match(r"\d+(\.\d+)*", text)
    return tuple(int(n) for n in match.group(0).split(".")) if match else ()


def probe():
    """What this interpreter lacks to build linattn, as a dict (printed as JSON by --probe, so
    that other interpreters can be asked the same). Written for any Python 3: it runs on them."""
    problems = []
    if sys.version_info < (3, 8):
        problems.append("Python {}.{} is older than 3.8".format(*sys.version_info[:2]))
    versions, wanted = {}, []
    for name, least, deb in NEEDS:
        spec = name + (">=" + ".".join(map(str, least)) if least else "")
        try:
            with warnings.catch_warnings():  # setuptools' note on replacing distutils
                warnings.simplefilter("ignore")
                module = __import__(name)
        except Exception:
            problems.append("{} is not importable (Debian: {})".format(name, deb))
            wanted.append(spec)
            continue
        found = getattr(module, "__version__", "0")
        versions[name] = found
        if least and version_tuple(found) < least:
            problems.append("{} {} is older than {} (Debian: {})".format(
                name, found, ".".join(map(str, least)), deb))
            wanted.append(spec)
    # setuptools before 70.1 builds wheels with the wheel package's bdist_wheel.
    if "setuptools" in versions and version_tuple(versions["setuptools"]) < (70, 1):
        try:
            __import__("wheel")
        except Exception:
            problems.append("wheel is not importable (setuptools {} needs it; Debian: "
                            "python3-wheel)".format(versions["setuptools"]))
            wanted.append("wheel")
    include = sysconfig.get_paths().get("include") or ""
    if not os.path.exists(os.path.join(include, "Python.h")):
        problems.append("Python.h is not in {} (the development headers; Debian: "
                        "python3-dev)".format(include or "the interpreter's include directory"))
    cxx = (os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++").split()[0]
    if not shutil.which(cxx):
        problems.append("the C++ compiler {} is not on PATH (Debian: g++)".format(cxx))
    try:
        __import__("torch")
        torch = True
    except Exception:
        torch = False
    stdlib = sysconfig.get_paths().get("stdlib") or ""
    return {
        "executable": os.path.abspath(sys.executable),
        "real": os.path.realpath(sys.executable),
        "version": "{}.{}.{}".format(*sys.version_info[:3]),
        "problems": problems,
        "wanted": wanted,
        "torch": torch,
        "venv": sys.prefix != getattr(sys, "base_prefix", sys.prefix),
        "managed": os.path.exists(os.path.join(stdlib, "EXTERNALLY-MANAGED")),
    }


def probe_of(python):
    """probe() as `python` answers it, or None when it does not run."""
    try:
        out = subprocess.run([python, os.path.abspath(__file__), "--probe"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             universal_newlines=True, timeout=120)
        return json.loads(out.stdout) if out.returncode == 0 else None
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def candidates():
    """The machine's other python3 interpreters: every python3 on PATH, then the usual places."""
    seen = []
    dirs = os.environ.get("PATH", "").split(os.pathsep) + ["/usr/bin", "/usr/local/bin"]
    for d in dirs:
        path = os.path.join(d, "python3")
        if d and os.access(path, os.X_OK) and path not in seen:
            seen.append(path)
    return seen


def eigen_dir():
    for d in (os.environ.get("EIGEN3_INCLUDE_DIR"), "/usr/include/eigen3",
              "/usr/local/include/eigen3"):
        if d and os.path.exists(os.path.join(d, "Eigen", "Core")):
            return d
    return None


def fail(lines):
    sys.stderr.write("\n".join(lines) + "\n")
    sys.exit(1)


def refuse(me, script):
    """Stops with what this interpreter lacks and the interpreter to run this script with."""
    lines = ["linattn: this interpreter, {} (Python {}), cannot build linattn:".format(
        me["executable"], me["version"])]
    lines += ["  - " + p for p in me["problems"]]
    usable = []
    for python in candidates():
        other = probe_of(python)
        if other and not other["problems"] and other["real"] != me["real"] and \
                all(other["real"] != u["real"] for _, u in usable):
            usable.append((python, other))
    # One with torch first: linattn.torch needs it.
    usable.sort(key=lambda u: not u[1]["torch"])
    if usable:
        python, other = usable[0]
        lines += ["{} (Python {}{}) can; install with it:".format(
                      python, other["version"], ", with torch" if other["torch"] else ""),
                  "",
                  "    {} {}".format(python, script),
                  ""]
    else:
        lines += ["No python3 on this machine can. On Debian or Ubuntu, `bash .ci/bootstrap` (or "
                  "apt-get install g++ libeigen3-dev python3-dev python3-pybind11 python3-numpy "
                  "python3-setuptools python3-pip python3-venv) gives /usr/bin/python3 what it "
                  "needs."]
    if me["wanted"] and not me["managed"]:
        lines.append("Or give this interpreter the packages it lacks from PyPI ({} -m pip install "
                     "{}) and run this again.".format(
                         me["executable"], " ".join("'{}'".format(w) for w in me["wanted"])))
    fail(lines)


def make_venv(base, venv):
    """A virtual environment of `base` at `venv` that sees the system's packages; its python."""
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        try:
            __import__("ensurepip")
        except Exception:
            fail(["linattn: {} cannot make a virtual environment with pip (Debian: "
                  "python3-venv)".format(base)])
        print("linattn: making the virtual environment {} (with the system's packages)".format(
            venv))
        subprocess.run([base, "-m", "venv", "--system-site-packages", venv], check=True)
        # The environment ignores itself, so that git status stays clean in a clone.
        with open(os.path.join(venv, ".gitignore"), "w") as f:
            f.write("*\n")
    return python


def main():
    parser = argparse.ArgumentParser(description="Install the linattn Python package from this "
                                     "checkout for the interpreter that runs this script.")
    parser.add_argument("--venv", metavar="DIR", help="install into the virtual environment DIR "
                        "(made with the system's packages if it does not exist); the default for "
                        "an externally managed interpreter is .venv at the repository's root")
    parser.add_argument("--jobs", type=int, metavar="N",
                        help="translation units compiled at once (default: every core)")
    parser.add_argument("--portable", action="store_true",
                        help="compile without -march=native (a module for other machines)")
    parser.add_argument("--quiet", action="store_true", help="pass --quiet to pip")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe()))
        return
    script = os.path.relpath(os.path.abspath(__file__))
    me = probe()
    if me["problems"]:
        refuse(me, script)
    if not os.path.exists(os.path.join(ROOT, "include", "linattn", "version.hpp")):
        fail(["linattn: the C++ headers are not at {}: run this script from a clone of the "
              "repository".format(os.path.join(ROOT, "include"))])
    if not eigen_dir():
        fail(["linattn: Eigen 3.4 not found (Debian: apt-get install libeigen3-dev; or set "
              "EIGEN3_INCLUDE_DIR)"])

    python = sys.executable
    venv = args.venv
    if venv is None and me["managed"] and not me["venv"]:
        venv = os.path.join(ROOT, ".venv")
    if venv is not None:
        venv = os.path.abspath(venv)
        python = make_venv(sys.executable, venv)
        inside = probe_of(python)
        if inside is None or inside["problems"]:
            fail(["linattn: the virtual environment {} cannot build linattn{}".format(
                      venv, ":" if inside else " (its python does not run)")] +
                 ["  - " + p for p in (inside or {}).get("problems", [])] +
                 ["Remove it, or pick another with --venv DIR (it is made with "
                  "--system-site-packages, to see the system's pybind11 and numpy)."])

    env = dict(os.environ)
    if args.jobs is not None:
        env["LINATTN_JOBS"] = str(args.jobs)
    if args.portable:
        env["LINATTN_PORTABLE"] = "1"
    print("linattn: building and installing for {} (8 translation units at -O3{}; minutes, "
          "not seconds)".format(python, "" if args.portable else " -march=native"))
    sys.stdout.flush()
    cmd = [python, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index"]
    if args.quiet:
        cmd.append("--quiet")
    if subprocess.run(cmd + [HERE], env=env).returncode != 0:
        fail(["linattn: pip failed (its output is above)"])

    # From another directory: python/linattn of the checkout has no compiled module.
    check = ("import numpy, linattn; q = numpy.ones((4, 2), numpy.float32); "
             "linattn.linear_attention(q, q, q, causal=True); print(linattn.__version__)")
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([python, "-c", check], cwd=tmp, capture_output=True, text=True)
        if done.returncode != 0:
            fail(["linattn: installed, but `import linattn` fails for {}:".format(python),
                  done.stderr])
        torch = subprocess.run([python, "-c", "import linattn.torch"], cwd=tmp,
                               capture_output=True).returncode == 0
    lines = ["linattn {} is installed for {}{}.".format(
        done.stdout.strip(), python,
        " (linattn.torch too)" if torch else " (linattn.torch needs torch, which it lacks)")]
    if venv is not None:
        lines.append("Run it with {0}, or after `source {1}`.".format(
            python, os.path.relpath(os.path.join(venv, "bin", "activate"))))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
