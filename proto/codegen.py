"""Generate the Python stubs of the contract: `python -m proto.codegen [OUT_ROOT]`.

The stubs are committed so that a clone imports them without a build step; a test regenerates them
into a temporary folder and fails if they differ (stale stubs).
"""

from __future__ import annotations

import sys
from importlib.resources import files
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = "proto/lazyserve/v1/lazyserve.proto"
OUTPUTS = ("lazyserve_pb2.py", "lazyserve_pb2.pyi", "lazyserve_pb2_grpc.py")


def generate(out_root: Path = ROOT) -> list[Path]:
    """Write the stubs under out_root/proto/lazyserve/v1/ and return their paths."""
    from grpc_tools import protoc

    out_root.mkdir(parents=True, exist_ok=True)
    well_known = str(files("grpc_tools") / "_proto")
    code = protoc.main(
        [
            "protoc",
            f"-I{ROOT}",
            f"-I{well_known}",
            f"--python_out={out_root}",
            f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}",
            str(ROOT / PROTO),
        ]
    )
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}")
    folder = out_root / Path(PROTO).parent
    return [folder / name for name in OUTPUTS]


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT):
        print(path)
