"""The plan file: a checked container around `Exported.serialize()` (never pickle).

Layout: MAGIC, an 8-byte little-endian header length, a JSON header, then the payload (the
exported program and any constants). The header carries the payload's SHA-256, so a truncated or
corrupted file is rejected before its bytes reach the flatbuffer parser.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from typing import Any

import jax
import numpy as np
from jax import export

from ._errors import PolyexecError, SpecError
from ._vars import LengthVar, Spec

MAGIC = b"POLYEXEC-PLAN\x00"
FORMAT = 1


def _jsonable(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def save_plan(plan, path) -> None:
    if plan.exported is None:
        raise PolyexecError(f"cannot save plan {plan.name}: reshaping is impossible, so there is "
                            f"no size-independent program ({plan.reason})")
    program = bytes(plan.exported.serialize())
    sections = [program]
    constants = []
    offset = len(program)
    for leaf in plan.constants or ():
        data = np.ascontiguousarray(np.asarray(leaf))
        raw = data.tobytes()
        constants.append({"offset": offset, "length": len(raw), "dtype": data.dtype.str,
                          "shape": list(data.shape)})
        sections.append(raw)
        offset += len(raw)
    payload = b"".join(sections)
    inputs = []
    for p, spec in zip(plan.input_paths, plan.input_specs):
        if isinstance(spec, Spec):
            inputs.append({"path": p, "dims": [str(d) for d in spec.dims],
                           "dtype": None if spec.dtype is None else spec.dtype.str,
                           "pad": _jsonable(spec.pad), "lengths_of": spec.lengths_of})
        else:
            inputs.append({"path": p, "shape": list(spec[0]), "dtype": np.dtype(spec[1]).str})
    header = {
        "format": FORMAT, "name": plan.name, "jax": jax.__version__,
        "variables": [{"name": v.name, "min": v.min, "max": v.max} for v in plan.variables],
        "inputs": inputs, "outputs": list(plan.out_paths),
        "program": {"offset": 0, "length": len(program)}, "constants": constants,
        "sha256": hashlib.sha256(payload).hexdigest(),
    }
    blob = json.dumps(header).encode()
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:  # write then rename: a crash never leaves half a plan behind
        f.write(MAGIC + struct.pack("<Q", len(blob)) + blob + payload)
    os.replace(tmp, path)


def _corrupt(path, why: str) -> PolyexecError:
    return PolyexecError(f"{path} is not a valid polyexec plan file: {why}")


def load_plan(path):
    from ._plan import Plan

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
        variables = [LengthVar._unregistered(v["name"], v["min"], v["max"]) for v in header["variables"]]
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
    except (KeyError, TypeError, ValueError) as e:
        raise _corrupt(path, f"inconsistent header ({type(e).__name__}: {e})") from None
    out_tree = jax.tree_util.tree_structure(tuple(range(len(exported.out_avals))))
    return Plan(name=header["name"], variables=variables, signature=None, exported=exported,
                jaxpr=None, reason=None, out_tree=out_tree, out_paths=header["outputs"],
                input_paths=paths, input_specs=specs, constants=constants or None)


def bucketed_plan(plan, buckets=None, **options):
    """A bucketed executor for a loaded plan: Spec inputs padded, outputs whose symbolic dims are
    plain variables sliced back."""
    from ._executor import Bucketed
    from ._layout import Signature

    specs = list(plan.input_specs)
    in_specs = [s if isinstance(s, Spec) else None for s in specs]
    constants = list(plan.constants or ())
    policies = {v: (buckets or {}).get(v, (buckets or {}).get(v.name)) for v in plan.variables}

    class LoadedBucketed(Bucketed):
        def __call__(self, *args):
            expected = len(specs) - len(constants)
            if len(args) != expected:
                raise SpecError(f"plan {plan.name}: expected {expected} positional arguments, "
                                f"received {len(args)}")
            try:
                out = super().__call__(*constants, *args)
            except SpecError as e:
                # The stored constants are prepended: name the caller's own argument positions.
                shifted = re.sub(r"\bargs\[(\d+)\]",
                                 lambda m: f"args[{int(m.group(1)) - len(constants)}]", str(e))
                raise type(e)(shifted) from None
            return out[0] if len(out) == 1 else out

        def _trace(self, signature: Signature):
            expected = [s for s in specs if not isinstance(s, Spec)]
            for path, (shape, dtype), want in zip(signature.leaf_paths("array"),
                                                  signature.array_avals, expected):
                if (tuple(shape), np.dtype(dtype)) != (tuple(want[0]), np.dtype(want[1])):
                    raise SpecError(f"{path}: expected {np.dtype(want[1]).name}{list(want[0])}, "
                                    f"received {np.dtype(dtype).name}{list(shape)}")
            plan.signature = signature
            return plan

        def _unflatten(self, plan, leaves, sizes):
            # Each output is cut to its symbolic shape evaluated at the real sizes (``T - 1`` at
            # T=5 is 4), so no padding leaks out of a loaded plan.
            env = {n: int(s) for n, s in sizes.items()}
            out = []
            for leaf, aval in zip(leaves, plan.exported.out_avals):
                real = tuple(int(d._evaluate(env)) if export.is_symbolic_dim(d) else int(d)
                             for d in aval.shape)
                out.append(leaf if real == tuple(leaf.shape) else
                           np.asarray(leaf)[tuple(slice(0, n) for n in real)])
            return tuple(out)

    return LoadedBucketed(plan, in_specs, None, policies, name=plan.name, **options)
