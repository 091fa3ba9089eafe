"""Development sessions. Every session installs the pinned CPU torch first, so that pip never
resolves an unpinned torch (which would pull a multi-GB CUDA build on a CPU machine)."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import nox

nox.options.sessions = ["ci"]
nox.options.reuse_existing_virtualenvs = True
nox.options.default_venv_backend = "venv"

PYTHON = "3.11"
DEFAULT_TORCH = os.environ.get("NPUGRAPH_TORCH", "2.13.0")
TORCH_VERSIONS = ["2.13.0", "2.14.1"]
DEFAULT_TRANSFORMERS = os.environ.get("NPUGRAPH_TRANSFORMERS", "4.57.6")
PACKAGES = {
    "npugraph-runtime": [],
    "npugraph-passes": ["npugraph-runtime"],
    "npugraph-cache": [],
    "npugraph-backend": ["npugraph-runtime", "npugraph-passes"],
}
TEST_DEPS = ["pytest>=8", "hypothesis>=6.100"]


def _phase(session: nox.Session, text: str) -> None:
    """One line before each long step: pip and mypy print nothing while they work."""
    session.log(f"[{session.name}] {text}")


def _install_torch(session: nox.Session, version: str = DEFAULT_TORCH) -> None:
    _phase(session, f"installing torch=={version} (pip's output hidden; nox -v shows it)")
    session.install(f"torch=={version}")


def _install_all(session: nox.Session, torch: str = DEFAULT_TORCH, extras: str = "dev,models") -> None:
    _install_torch(session, torch)
    editable = [arg for pkg in PACKAGES for arg in ("-e", f"packages/{pkg}")]
    # transformers pinned for reproducible test models (the extra allows a range);
    # NPUGRAPH_TRANSFORMERS=5.24.0 nox -s tests checks another release
    _phase(session, f"installing the packages (editable) and transformers=={DEFAULT_TRANSFORMERS}")
    session.install(*editable, "-e", f".[{extras}]", f"torch=={torch}",
                    f"transformers=={DEFAULT_TRANSFORMERS}")


def _mypy(session: nox.Session) -> None:
    trees = [f"packages/{pkg}/src" for pkg in PACKAGES] + ["src"]
    _phase(session, f"mypy --strict on {', '.join(trees)} (prints only at the end)")
    session.run("mypy", *trees)


def _pytest(session: nox.Session, *paths: str) -> None:
    args = list(session.posargs) or ["-q", *paths]
    _phase(session, f"pytest {' '.join(args)}")
    session.run("python", "-m", "pytest", *args)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The whole test suite on the default torch (2.13.0; NPUGRAPH_TORCH=2.14.1 for the other)."""
    _install_all(session)
    _pytest(session)


@nox.session(python=PYTHON)
@nox.parametrize("torch", TORCH_VERSIONS)
def tests_matrix(session: nox.Session, torch: str) -> None:
    """The whole test suite on each supported torch release that lies on this machine."""
    _install_all(session, torch)
    _pytest(session)


@nox.session(python=PYTHON)
@nox.parametrize("package", list(PACKAGES))
def tests_pkg(session: nox.Session, package: str) -> None:
    """One package installed alone with only its declared dependencies: proves the layering."""
    _install_torch(session)
    deps = [arg for dep in PACKAGES[package] for arg in ("-e", f"packages/{dep}")]
    session.install(*deps, "-e", f"packages/{package}", *TEST_DEPS, f"torch=={DEFAULT_TORCH}")
    session.chdir(f"packages/{package}")
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                "--import-mode=importlib", "tests", *session.posargs)


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy --strict on every package's src/."""
    _install_all(session)
    _mypy(session)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.5")
    session.run("ruff", "check", ".")


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """Greedy decoding with a small Llama, eager against npugraph_ex (see README)."""
    _install_all(session)
    session.run("npugraph-ex", "demo", *session.posargs)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Side-by-side benchmarks (eager, aot_eager, ours); writes JSON and PNG to bench-results/."""
    _install_all(session)
    session.run("npugraph-ex", "bench", *session.posargs)


@nox.session(python=PYTHON)
def ci(session: nox.Session) -> None:
    """What .ci/run calls: lint, types, the whole test suite, the ``numerics`` tests again under
    a second kernel variant, then `readme` (a clean install as the README gives it)."""
    _install_all(session)
    _phase(session, "ruff check .")
    session.run("ruff", "check", ".")
    _mypy(session)
    # the README's blocks run once, in `readme`, against the packages as the README installs them
    _pytest(session, "--ignore=tests/test_readme_examples.py")
    _pytest_numerics(session)
    session.notify("readme", posargs=[])


def _pytest_numerics(session: nox.Session) -> None:
    """The tests marked ``numerics`` again under ATen's portable kernels: a machine of another
    CPU kind (AVX2 rather than AVX-512, another BLAS path) runs other kernels than this one, and
    no test may depend on which."""
    args = ["-q", "-p", "no:cacheprovider", "-m", "numerics"]
    _phase(session, f"ATEN_CPU_CAPABILITY=default pytest {' '.join(args)} (a second kernel variant)")
    session.run("python", "-m", "pytest", *args, env={"ATEN_CPU_CAPABILITY": "default"})


README_INSTALL = "python -m pip install -r requirements/local.txt"


@nox.session(python=PYTHON, reuse_venv=False)
def readme(session: nox.Session) -> None:
    """A newcomer's path in a clean venv: the README's pip command exactly as written there, then
    `npugraph-ex demo --quick` and every Python block of the README."""
    readme_text = Path("README.md").read_text()
    if README_INSTALL not in readme_text.splitlines():
        session.error(f"README.md no longer gives {README_INSTALL!r} on a line of its own: "
                      "update README_INSTALL in noxfile.py to the documented command")
    _phase(session, f"installing as the README says: {README_INSTALL}")
    session.run(*shlex.split(README_INSTALL), silent=True)  # pip's output shown only if it fails
    _phase(session, "the CLI: npugraph-ex --version, then npugraph-ex demo --quick")
    session.run("npugraph-ex", "--version")
    session.run("npugraph-ex", "demo", "--quick", "--no-progress", "--out",
                f"{session.create_tmp()}/demo-results")
    _phase(session, "pytest on the README's Python blocks (installed packages, not src/)")
    session.install(*TEST_DEPS)
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                "tests/test_readme_examples.py", *session.posargs)


@nox.session(python=False)
def gpu(session: nox.Session) -> None:
    """GPU check on a machine with no network: installs nothing, runs scripts/gpu_check.sh
    (cuda tests, demo and benchmarks on cuda; results in $OUT, default ./gpu-results)."""
    session.run("bash", "scripts/gpu_check.sh", *session.posargs, external=True)
