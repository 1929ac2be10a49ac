"""The JSON Schema of every bus message and KV record, generated from the wire types.

One file per type in ``schemas/events/`` (``Acquire`` -> ``acquire.json``), plus one per union that a
consumer decodes at once (``InputEvent``, ``Notice``, ...). Keys are sorted and every file ends with a
newline, so the output is byte-for-byte stable; a test fails when the files drift from the types::

    python -m timeslice_client._schemas            # (re)write the files
    python -m timeslice_client._schemas --check    # exit 1 and list the files that drifted
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Final, get_args

import msgspec

from . import protocol

__all__ = ["DEFAULT_DIR", "check", "generate", "main", "schema_file_name", "wire_types", "write"]

DIALECT: Final = "https://json-schema.org/draft/2020-12/schema"
DEFAULT_DIR: Final = Path(__file__).resolve().parents[2] / "schemas" / "events"
_COMMENT: Final = "Generated from timeslice_client.protocol by `python -m timeslice_client._schemas`; do not edit."


def _is_struct(obj: object) -> bool:
    return isinstance(obj, type) and issubclass(obj, msgspec.Struct)


def wire_types() -> dict[str, object]:
    """Every :class:`msgspec.Struct` and every union of them that :mod:`protocol` exports, by name."""
    out: dict[str, object] = {}
    for name in protocol.__all__:
        obj = getattr(protocol, name)
        if _is_struct(obj) or (isinstance(obj, types.UnionType) and all(_is_struct(a) for a in get_args(obj))):
            out[name] = obj
    return out


def schema_file_name(type_name: str) -> str:
    """``GroupRecord`` -> ``group_record.json``."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type_name).lower() + ".json"


def generate() -> dict[str, str]:
    """File name -> file text, for every wire type."""
    files: dict[str, str] = {}
    for name, tp in sorted(wire_types().items()):
        schema = dict(msgspec.json.schema(tp))
        schema["$schema"] = DIALECT
        schema["$comment"] = _COMMENT
        schema["title"] = name
        files[schema_file_name(name)] = json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    return files


def check(directory: Path = DEFAULT_DIR) -> list[str]:
    """The files of ``directory`` that differ from :func:`generate`: missing, changed, or stale extras."""
    expected = generate()
    drifted = [
        name
        for name, text in expected.items()
        if not (directory / name).is_file() or (directory / name).read_text(encoding="utf-8") != text
    ]
    if directory.is_dir():
        drifted += [p.name for p in directory.glob("*.json") if p.name not in expected]
    return sorted(drifted)


def write(directory: Path = DEFAULT_DIR) -> list[str]:
    """Bring ``directory`` in line with :func:`generate`; returns the files written or removed."""
    drifted = check(directory)
    directory.mkdir(parents=True, exist_ok=True)
    expected = generate()
    for name in drifted:
        path = directory / name
        if name in expected:
            path.write_text(expected[name], encoding="utf-8")
        else:
            path.unlink()
    return drifted


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m timeslice_client._schemas", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if any file drifted")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"output directory (default: {DEFAULT_DIR})")
    args = parser.parse_args(argv)
    directory: Path = args.dir
    if args.check:
        drifted = check(directory)
        if drifted:
            print(f"{len(drifted)} schema file(s) in {directory} drifted from the wire types:", file=sys.stderr)
            for name in drifted:
                print(f"  {name}", file=sys.stderr)
            print("regenerate them with: python -m timeslice_client._schemas", file=sys.stderr)
            return 1
        print(f"{len(generate())} schema files in {directory} match the wire types")
        return 0
    changed = write(directory)
    for name in changed:
        print(f"updated {directory / name}")
    print(f"{len(generate())} schema files in {directory}, {len(changed)} updated")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
