"""Regenerates engine_pb2.py and engine_pb2_grpc.py from engine.proto (`make proto`).

protoc names imports after the proto's path, so the proto is compiled from a temporary tree where it
sits at kubeinfer/engine/entrypoints/grpc/proto/: the generated stubs then import each other as package modules.
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
PACKAGE_PATH = Path("kubeinfer/engine/entrypoints/grpc/proto")
GENERATED = ("engine_pb2.py", "engine_pb2_grpc.py")


def generate(out_dir: Path = HERE) -> list[Path]:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp)
        (tree / PACKAGE_PATH).mkdir(parents=True)
        shutil.copy(HERE / "engine.proto", tree / PACKAGE_PATH / "engine.proto")
        code = protoc.main(["grpc_tools.protoc", f"-I{tree}", f"--python_out={tree}", f"--grpc_python_out={tree}",
                            str(PACKAGE_PATH / "engine.proto")])
        if code != 0:
            raise RuntimeError(f"protoc failed with exit code {code}")
        out_dir.mkdir(parents=True, exist_ok=True)
        return [Path(shutil.copy(tree / PACKAGE_PATH / name, out_dir / name)) for name in GENERATED]


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE):
        print(f"wrote {path}")
