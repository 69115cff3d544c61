"""A zip writer for the `.pt` reader's tests: torch's own layout by default (byte for byte what
torch.save writes, tests/test_ptread_differential.py checks it), or any other one."""

from __future__ import annotations

import io
import struct
import zipfile
import zlib
from typing import Any


def members(raw: bytes) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(io.BytesIO(raw)) as zf:
        return [(i.filename, zf.read(i)) for i in zf.infolist()]


def entry(name: str, data: bytes, **kw: Any) -> dict[str, Any]:
    e = {"name": name.encode(), "data": data, "flags": 0x808 if data else 0x800, "method": 0,
         "cextra": b"", "comment": b"", "lextra": None, "descriptor": bool(data),
         "crc": zlib.crc32(data)}
    e.update(kw)
    return e


def write(entries: list[dict[str, Any]], *, zip64: bool = True, prepend: bytes = b"",
           gap: bytes = b"", count: int | None = None, tail: bytes = b"",
           comment: bytes = b"") -> bytes:
    """Local records (header, name, torch's 64-byte alignment padding, data, data descriptor),
    the central directory, the zip64 end record and locator, the end record: torch's layout
    with the defaults (tests check it is byte for byte torch's own)."""
    out = bytearray(prepend)
    offsets = []
    for e in entries:
        offsets.append(len(out))
        lname = e.get("lname", e["name"])
        lextra = e["lextra"]
        if lextra is None:
            pad = -(len(out) + 30 + len(lname) + 4) % 64
            lextra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
        desc = e["descriptor"]
        lsizes = e.get("lsizes", (0, 0, 0) if desc else (e["crc"], len(e["data"]),
                                                          len(e["data"])))
        out += struct.pack("<4s2B4HL2L2H", b"PK\x03\x04", 0, 0, e.get("lflags", e["flags"]),
                           e.get("lmethod", e["method"]), 0, 0, *lsizes, len(lname),
                           len(lextra))
        out += lname + lextra + e["data"]
        if desc is True:
            out += struct.pack("<4s3L", b"PK\x07\x08", e["crc"], len(e["data"]), len(e["data"]))
        elif desc:
            out += desc
        out += e.get("after", b"")
    out += gap
    cd_off = len(out)
    for e, off in zip(entries, offsets, strict=True):
        out += struct.pack("<4s4B4HL2L5H2L", b"PK\x01\x02", 0, 0, 0, 0, e["flags"], e["method"],
                           0, 0, e["crc"], e.get("csize", len(e["data"])), len(e["data"]),
                           len(e["name"]), len(e["cextra"]), len(e["comment"]), 0, 0, 0,
                           e.get("offset", off))
        out += e["name"] + e["cextra"] + e["comment"]
    cd_size = len(out) - cd_off
    n = len(entries) if count is None else count
    out += tail
    if zip64:
        z64 = len(out)
        out += struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 798, 45, 0, 0, n, n, cd_size,
                           cd_off)
        out += struct.pack("<4sLQL", b"PK\x06\x07", 0, z64, 1)
    classic = min(n, 0xFFFF) if zip64 else n  # past 65,535 entries: the maximum, as miniz
    out += struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, classic, classic, cd_size, cd_off,
                       len(comment))
    return bytes(out + comment)


def entries_of(raw: bytes) -> list[dict[str, Any]]:
    return [entry(name, data) for name, data in members(raw)]


def rezip(raw: bytes, pkl: bytes | None = None, *, deflate: bool = False,
          extra: dict[str, bytes] | None = None) -> bytes:
    """`raw`'s archive written again in torch's layout: data.pkl replaced by `pkl`, the records
    in `extra` (names inside the archive folder) replaced or added, all deflated with
    `deflate`."""
    entries = entries_of(raw)
    prefix = entries[0]["name"].split(b"/")[0].decode()
    new = dict(extra or {})
    if pkl is not None:
        new["data.pkl"] = pkl
    for e in entries:
        inner = e["name"].decode().split("/", 1)[1]
        if inner in new:
            e.update(data=new.pop(inner))
            e["crc"] = zlib.crc32(e["data"])
    entries += [entry(f"{prefix}/{inner}", data) for inner, data in new.items()]
    if deflate:
        for e in entries:
            comp = zlib.compressobj(9, zlib.DEFLATED, -15)
            e.update(method=8, data=comp.compress(e["data"]) + comp.flush())
    return write(entries)
