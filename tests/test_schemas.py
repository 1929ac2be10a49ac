"""The JSON Schemas in ``schemas/events/`` match the wire types, and decoding is strict.

Regenerate the schemas after changing a wire type with ``python -m timeslice_client._schemas``.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any, get_args

import msgspec
import pytest
from timeslice_client import _schemas, protocol
from timeslice_client.protocol import (
    Acquire,
    GroupRecord,
    InputEvent,
    Notice,
    decode_input,
    decode_notice,
    decode_record,
    encode,
)

from .helpers import run_text

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_DIR = ROOT / "schemas" / "events"


# --------------------------------------------------------------------------- sample values


def _sample(t: msgspec.inspect.Type) -> Any:
    """A value of type ``t`` that differs from every default (so round trips cover every field)."""
    mi = msgspec.inspect
    if isinstance(t, mi.StrType):
        return "s-1"
    if isinstance(t, mi.BoolType):
        return True
    if isinstance(t, mi.IntType):
        return 7
    if isinstance(t, mi.FloatType):
        return 1.5
    if isinstance(t, mi.EnumType):
        return list(t.cls)[-1]
    if isinstance(t, mi.LiteralType):
        return t.values[-1]
    if isinstance(t, mi.UnionType):
        return _sample(next(a for a in t.types if not isinstance(a, mi.NoneType)))
    if isinstance(t, mi.VarTupleType | mi.TupleType | mi.ListType):
        item = t.item_type if not isinstance(t, mi.TupleType) else t.item_types[0]
        value = [_sample(item)]
        return value if isinstance(t, mi.ListType) else tuple(value)
    if isinstance(t, mi.DictType):
        return {"k-1": _sample(t.value_type)}
    if isinstance(t, mi.StructType):
        return t.cls(**{f.name: _sample(f.type) for f in t.fields})
    raise AssertionError(f"no sample for {t!r}; extend _sample")


def sample(cls: type[msgspec.Struct]) -> Any:
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    return _sample(info)


def _structs(union: Any) -> list[type[msgspec.Struct]]:
    return list(get_args(union))


ALL_STRUCTS = sorted((t for t in _schemas.wire_types().values() if isinstance(t, type)), key=lambda t: t.__name__)


# --------------------------------------------------------------------------- drift


def test_schema_files_match_the_wire_types() -> None:
    expected = _schemas.generate()
    on_disk = {p.name: p.read_text(encoding="utf-8") for p in SCHEMA_DIR.glob("*.json")}
    missing = sorted(expected.keys() - on_disk.keys())
    stale = sorted(on_disk.keys() - expected.keys())
    changed = sorted(n for n in expected.keys() & on_disk.keys() if expected[n] != on_disk[n])
    assert not (missing or stale or changed), (
        f"schemas/events drifted from the wire types (missing {missing}, stale {stale}, changed {changed}); "
        "regenerate with: python -m timeslice_client._schemas"
    )
    assert _schemas.check(SCHEMA_DIR) == []


def test_every_exported_struct_and_union_has_a_schema() -> None:
    names = set(_schemas.wire_types())
    structs = {
        n
        for n in protocol.__all__
        if isinstance(getattr(protocol, n), type) and issubclass(getattr(protocol, n), msgspec.Struct)
    }
    assert structs <= names
    assert {"InputEvent", "Notice", "AgentCommand", "GroupRecord", "Acquire", "Granted", "OpResult"} <= names
    for name in names:
        text = (SCHEMA_DIR / _schemas.schema_file_name(name)).read_text(encoding="utf-8")
        assert text.endswith("}\n") and not text.endswith("\n\n")
        doc = json.loads(text)
        assert doc["title"] == name and doc["$schema"].startswith("https://json-schema.org/")
        assert list(doc) == sorted(doc), "keys are sorted"


def test_file_names() -> None:
    assert _schemas.schema_file_name("GroupRecord") == "group_record.json"
    assert _schemas.schema_file_name("Acquire") == "acquire.json"
    assert _schemas.schema_file_name("OpResult") == "op_result.json"


def test_check_and_write_on_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "events"
    assert _schemas.main(["--check", "--dir", str(d)]) == 1
    assert _schemas.main(["--dir", str(d)]) == 0
    assert _schemas.main(["--check", "--dir", str(d)]) == 0
    (d / "acquire.json").write_text("{}\n", encoding="utf-8")
    (d / "gone.json").write_text("{}\n", encoding="utf-8")
    capsys.readouterr()
    assert _schemas.main(["--check", "--dir", str(d)]) == 1
    err = capsys.readouterr().err
    assert "acquire.json" in err and "gone.json" in err and "granted.json" not in err
    assert _schemas.check(d) == ["acquire.json", "gone.json"]
    assert _schemas.write(d) == ["acquire.json", "gone.json"]
    assert not (d / "gone.json").exists() and _schemas.check(d) == []


def test_module_entry_point_checks_the_repository() -> None:
    proc = run_text([sys.executable, "-m", "timeslice_client._schemas", "--check"], timeout=60)
    assert proc.returncode == 0, proc.stderr


# --------------------------------------------------------------------------- strict decoding


def _acquire_json(**extra: Any) -> bytes:
    doc = json.loads(encode(Acquire(group="g", job="a", request_id="r1")))
    doc.update(extra)
    return json.dumps(doc).encode()


def test_unknown_fields_are_rejected() -> None:
    assert decode_input(_acquire_json()) == Acquire(group="g", job="a", request_id="r1")
    with pytest.raises(msgspec.ValidationError, match="surprise"):
        decode_input(_acquire_json(surprise=1))
    notice = json.loads(encode(sample(protocol.Granted)))
    notice["surprise"] = 1
    with pytest.raises(msgspec.ValidationError, match="surprise"):
        decode_notice(json.dumps(notice).encode())
    record = json.loads(encode(sample(GroupRecord)))
    record["surprise"] = 1
    with pytest.raises(msgspec.ValidationError, match="surprise"):
        decode_record(json.dumps(record).encode())
    nested = json.loads(encode(sample(GroupRecord)))
    nested["holder"]["surprise"] = 1
    with pytest.raises(msgspec.ValidationError, match="surprise"):
        decode_record(json.dumps(nested).encode())


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (_acquire_json(type="acquire_v2"), "unknown tag"),
        (b'{"group": "g", "job": "a", "request_id": "r"}', "no tag"),
        (b'{"type": "acquire", "group": "g", "job": "a"}', "missing field"),
        (_acquire_json(lease_ms="30s"), "wrong type"),
        (_acquire_json(type="granted"), "a notice is not an input"),
        (b"[1, 2]", "not an object"),
        (b"{", "not JSON"),
    ],
)
def test_malformed_inputs_are_rejected(data: bytes, why: str) -> None:
    with pytest.raises((msgspec.ValidationError, msgspec.DecodeError)):
        decode_input(data)


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("cls", _structs(InputEvent), ids=lambda c: c.__name__)
def test_every_input_event_round_trips(cls: type[msgspec.Struct]) -> None:
    ev = sample(cls)
    back = decode_input(encode(ev))
    assert type(back) is cls and back == ev
    minimal = msgspec.json.decode(encode(ev), type=cls)
    assert minimal == ev


@pytest.mark.parametrize("cls", _structs(Notice), ids=lambda c: c.__name__)
def test_every_notice_round_trips(cls: type[msgspec.Struct]) -> None:
    n = sample(cls)
    back = decode_notice(encode(n))
    assert type(back) is cls and back == n


def test_group_record_round_trips() -> None:
    rec = sample(GroupRecord)
    assert rec.holder is not None and rec.switch is not None and rec.queue  # every nested part is filled
    assert decode_record(encode(rec)) == rec


@pytest.mark.parametrize("cls", ALL_STRUCTS, ids=lambda c: c.__name__)
def test_every_wire_type_round_trips_and_fits_its_schema(cls: type[msgspec.Struct]) -> None:
    value = sample(cls)
    data = encode(value)
    assert msgspec.json.decode(data, type=cls) == value
    # A shallow check of the encoded object against the published schema: required fields present,
    # nothing outside the declared properties.
    doc = json.loads((SCHEMA_DIR / _schemas.schema_file_name(cls.__name__)).read_text(encoding="utf-8"))
    definition = doc["$defs"][doc["$ref"].rsplit("/", 1)[-1]]
    obj = json.loads(data)
    assert set(definition.get("required", ())) <= obj.keys()
    assert obj.keys() <= definition["properties"].keys()
    assert definition.get("additionalProperties") is False


def test_unions_are_what_the_decoders_accept() -> None:
    assert isinstance(InputEvent, types.UnionType) and isinstance(Notice, types.UnionType)
    doc = json.loads((SCHEMA_DIR / "input_event.json").read_text(encoding="utf-8"))
    tags = set(doc["discriminator"]["mapping"])
    assert tags == {cls.__struct_config__.tag for cls in _structs(InputEvent)}
