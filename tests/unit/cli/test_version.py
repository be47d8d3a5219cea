"""`lazyserve --version` says which kernels a decode step runs here."""

from __future__ import annotations

import subprocess
import sys

from shared import kernels


def test_version_names_the_kernels_this_host_runs():
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "--version"], capture_output=True, text=True, timeout=120, check=True
    )
    # A fresh process selects the default, native where built: what this one's build status says.
    built = kernels.status().built
    expected = f"kernels native ({kernels.status().isa})" if built else "kernels torch ("
    assert done.stdout.startswith("lazyserve ") and expected in done.stdout, done.stdout
