"""Builds the native kernels (csrc/) into one shared library, once, at `make setup`.

torch's extension builder compiles them with the system's C++ compiler (and ninja) for this
torch; the library and a fingerprint of the sources it came from land in `LIBRARY_DIR`. Nothing
at run time compiles: `shared.kernels` loads the library if its fingerprint matches the sources,
and otherwise runs the torch path and says why.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
LIBRARY_DIR = Path(__file__).parent / "_build"
NAME = "lazyserve_kernels"
FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-Wall"]


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.cpp"))


def fingerprint() -> str:
    """A hash of every source file and of the torch it is built for."""
    import torch

    digest = hashlib.sha256(torch.__version__.encode())
    for path in sorted(CSRC.iterdir()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def library_path() -> Path:
    return LIBRARY_DIR / f"{NAME}.so"


def stamp_path() -> Path:
    return LIBRARY_DIR / "fingerprint"


def build(verbose: bool = False) -> Path:
    """Compile csrc/ into LIBRARY_DIR (ninja rebuilds only what changed) and stamp it."""
    from torch.utils import cpp_extension

    # The builder runs `ninja` from PATH: the one pip installed beside this interpreter first.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    LIBRARY_DIR.mkdir(exist_ok=True)
    stamp_path().unlink(missing_ok=True)
    path = cpp_extension.load(
        name=NAME,
        sources=[str(path) for path in sources()],
        extra_cflags=FLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(LIBRARY_DIR),
        is_python_module=False,
        verbose=verbose,
    )
    stamp_path().write_text(fingerprint())
    return Path(path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path = build(verbose="-v" in argv)
    print(f"built {path}")
    return 0
