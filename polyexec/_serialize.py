"""The plan file: a checked container around `Exported.serialize()` (never pickle).

Layout: MAGIC, an 8-byte little-endian header length, a JSON header, then the payload (the
exported program and any constants). The header carries the payload's SHA-256, so a truncated or
corrupted file is rejected before its bytes reach the flatbuffer parser. This module knows
bytes and fields, not plans: `Plan.save`/`Plan.load` call it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax import export

from ._errors import PolyexecError
from ._logical import RowFloor
from ._spec import LengthVar, Spec
from ._trace import RaisedMin

MAGIC = b"POLYEXEC-PLAN\x00"
FORMAT = 1


def _jsonable(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def save(path, *, name: str, exported: Any, variables: Sequence[LengthVar],
         input_paths: Sequence[str], input_specs: Sequence[Any], out_paths: Sequence[str],
         constants: Sequence[Any], padding_reason: str | None,
         row_floors: Sequence[Any] = (), raised_mins: Sequence[Any] = ()) -> None:
    program = bytes(exported.serialize())
    sections = [program]
    stored = []
    offset = len(program)
    for leaf in constants:
        data = np.ascontiguousarray(np.asarray(leaf))
        raw = data.tobytes()
        stored.append({"offset": offset, "length": len(raw), "dtype": data.dtype.str,
                       "shape": list(data.shape)})
        sections.append(raw)
        offset += len(raw)
    payload = b"".join(sections)
    inputs = []
    for p, spec in zip(input_paths, input_specs):
        if isinstance(spec, Spec):
            inputs.append({"path": p, "dims": [str(d) for d in spec.dims],
                           "dtype": None if spec.dtype is None else spec.dtype.str,
                           "pad": _jsonable(spec.pad), "lengths_of": spec.lengths_of})
        else:
            inputs.append({"path": p, "shape": list(spec[0]), "dtype": np.dtype(spec[1]).str})
    header = {
        "format": FORMAT, "name": name, "jax": jax.__version__,
        "variables": [{"name": v.name, "min": v.min, "max": v.max} for v in variables],
        "inputs": inputs, "outputs": list(out_paths), "padding_reason": padding_reason,
        "row_floors": [dataclasses.asdict(f) for f in row_floors],
        "raised_mins": [dataclasses.asdict(r) for r in raised_mins],
        "program": {"offset": 0, "length": len(program)}, "constants": stored,
        "sha256": hashlib.sha256(payload).hexdigest(),
    }
    blob = json.dumps(header).encode()
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:  # write then rename: a crash never leaves half a plan behind
        f.write(MAGIC + struct.pack("<Q", len(blob)) + blob + payload)
    os.replace(tmp, path)


def _corrupt(path, why: str) -> PolyexecError:
    return PolyexecError(f"{path} is not a valid polyexec plan file: {why}")


def load(path) -> dict[str, Any]:
    """The fields of the `Plan` stored in ``path``, checked; `PolyexecError` for a bad file."""
    with open(path, "rb") as f:
        data = f.read()
    if not data.startswith(MAGIC):
        raise _corrupt(path, "wrong magic bytes (not written by Plan.save)")
    start = len(MAGIC) + 8
    if len(data) < start:
        raise _corrupt(path, "truncated header")
    (n,) = struct.unpack("<Q", data[len(MAGIC):start])
    if start + n > len(data):
        raise _corrupt(path, f"truncated: header says {n} bytes, file has {len(data) - start}")
    try:
        header = json.loads(data[start:start + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _corrupt(path, f"unreadable header ({e})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise _corrupt(path, f"unsupported format {header.get('format') if isinstance(header, dict) else header!r}")
    payload = data[start + n:]
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise _corrupt(path, "checksum mismatch (the file is truncated or corrupted)")
    try:
        prog = header["program"]
        program = bytearray(payload[prog["offset"]:prog["offset"] + prog["length"]])
    except (KeyError, TypeError, ValueError) as e:
        raise _corrupt(path, f"inconsistent header ({type(e).__name__}: {e})") from None
    try:
        # The checksum only proves the bytes are the ones written. A payload that is not a
        # program (a forged checksum, a writer bug) makes the flatbuffer reader fail with
        # struct.error/AttributeError and the StableHLO reader with a runtime error: parse both
        # here, so a bad file fails at load with PolyexecError, not at the first call.
        exported = export.deserialize(program)
        exported.mlir_module()
    except Exception as e:  # noqa: BLE001 - any failure to parse means a bad file
        raise _corrupt(path, f"unreadable program ({type(e).__name__}: "
                             f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})") from None
    try:
        variables = [LengthVar(v["name"], min=v["min"], max=v["max"]) for v in header["variables"]]
        specs, paths = [], []
        for item in header["inputs"]:
            paths.append(item["path"])
            if "dims" in item:
                specs.append(Spec(item["dims"], item["dtype"], pad=item["pad"],
                                  lengths_of=item["lengths_of"]))
            else:
                specs.append((tuple(item["shape"]), np.dtype(item["dtype"])))
        constants = [np.frombuffer(payload, np.dtype(c["dtype"]), int(np.prod(c["shape"])),
                                   c["offset"]).reshape(c["shape"]) for c in header["constants"]]
        fields = dict(name=header["name"], variables=tuple(variables), exported=exported,
                      input_paths=tuple(paths), input_specs=tuple(specs),
                      out_paths=tuple(header["outputs"]),
                      padding_reason=header.get("padding_reason"),
                      row_floors=tuple(RowFloor(**f) for f in header.get("row_floors", ())),
                      raised_mins=tuple(RaisedMin(**r) for r in header.get("raised_mins", ())),
                      constants=tuple(constants) or None)
    except (KeyError, TypeError, ValueError, PolyexecError) as e:
        raise _corrupt(path, f"inconsistent header ({type(e).__name__}: {e})") from None
    return fields
