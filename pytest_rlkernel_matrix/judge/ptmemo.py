"""What one `.pt` file proved to the fast reader (`judge/ptread.py`), kept for the next file.

A 200-step root holds thousands of sidecars written by one writer: within a run directory
their zips are laid out alike (the archive folder named after each file aside) and their
data.pkl streams differ only in a few ints (rank, call index, the CP slice's sizes). Each
keeper here lets the next such file skip a pass whose outcome it can prove is the same, while
every check that depends on the file's own bytes (CRCs, record contents, the unpickled
values) still runs on it:

- `Layout`: the zip's first pass (`ptread._zip_records`), for a file whose bytes are equal in
  every place that pass reads, CRCs and the folder's name aside;
- `like_proven`: the opcode scan and the subset proof's re-pickle (`ptread.load`), for a
  data.pkl equal to one proven but for K, M and J arguments, each still one Python's pickler
  writes with that opcode.

`tests/test_ptread.py` reads mutated files with and without anything kept, to the same outcome.
"""

from __future__ import annotations

import re
import struct

KEY = re.compile(r"[0-9]{1,12}\Z")  # a tensor's record: data/<key>
LOCAL = struct.Struct("<4s5H3I2H")  # a zip local file header
LAYOUTS: dict[tuple[int, int], Layout] = {}  # by (file size, central directory offset)


class Layout:
    """What `ptread._zip_records`' first pass read of one file and found sound, for the next file
    of the same size and central directory offset (`LAYOUTS`): the bytes from the central
    directory to the end and each local header's, apart from two kinds of fields: the CRCs
    (their values only feed the CRC checks of the second pass, made on each file's own) and
    the archive folder of each record's name (torch names it after the file). A file whose
    bytes are equal in all other places, and whose records all name one folder of the same
    length, in ASCII and without a "/", takes every branch of the first pass the same way (it
    reads no other byte), so its records lie where this file's do."""

    __slots__ = ("cd_off", "crcs", "first", "items", "keep", "locals", "segments", "width")

    def __init__(self, raw: bytes, cd_off: int, prefix: str,
                 items: list[tuple[str, int, int, int, int, int]]) -> None:
        width = len(prefix)
        self.cd_off, self.width, self.first = cd_off, width, items[0][4]
        keep = (1 << (8 * (len(raw) - cd_off))) - 1
        for item in items:  # (the CRC field of each central header)
            keep &= ~(0xFFFFFFFF << (8 * (item[3] - cd_off)))
        self.keep = keep
        cuts = [at for item in items for at in (item[4], item[4] + width)]
        edges = [cd_off, *cuts, len(raw)]
        self.segments = [raw[lo:hi] for lo, hi in zip(edges[::2], edges[1::2], strict=True)]
        self.locals = []
        for item in items:
            off = item[5]
            name_at = off + LOCAL.size
            end = name_at + int.from_bytes(raw[off + 26:off + 28], "little")
            self.locals.append((off, raw[off:off + 14], off + 18, raw[off + 18:name_at],
                                name_at, name_at + width, raw[name_at + width:end]))
        self.items = [(inner, start, size) for inner, start, size, _, _, _ in items]
        self.crcs = [(inner, crc_at) for inner, _, _, crc_at, _, _ in items
                     if not (inner.startswith("data/") and KEY.match(inner[5:]))]

    def records(self, raw: bytes) -> tuple[str, dict[str, memoryview], dict[str, int]] | None:
        """(folder, records, CRCs of the records the second pass checks) of `raw`, or None
        where a byte the first pass reads differs from this layout's file."""
        folder = raw[self.first:self.first + self.width]
        if not folder.isascii() or b"/" in folder:
            return None
        if (int.from_bytes(raw[self.cd_off:], "little") ^ int.from_bytes(
                folder.join(self.segments), "little")) & self.keep:
            return None
        starts = raw.startswith
        for off, head, at, sizes, name_at, inner_at, inner in self.locals:
            if not (starts(head, off) and starts(sizes, at) and starts(folder, name_at)
                    and starts(inner, inner_at)):
                return None
        view = memoryview(raw)
        return (folder.decode("ascii"),
                {inner: view[start:start + size] for inner, start, size in self.items},
                {inner: int.from_bytes(raw[at:at + 4], "little") for inner, at in self.crcs})


# Subset proofs kept for the next file (`like_proven`): data.pkl streams that passed the scan
# and the proof, by length, each with where its BININT1, BININT2 and BININT arguments lie.
PROVEN: dict[int, list[tuple[bytes, dict[int, tuple[int, int]]]]] = {}
PROVEN_KEPT = 4  # streams per length
_INT_OPS = {ord("K"): 1, ord("M"): 2, ord("J"): 4}


def int_args(pkl: bytes, args: list[int | None]) -> dict[int, tuple[int, int]]:
    """{position: (its argument's first byte, opcode)} of every byte of a K, M or J argument
    of a stream `_scan` accepted (stepped through opcode by opcode, as `_scan` does)."""
    out: dict[int, tuple[int, int]] = {}
    i, n = 0, len(pkl)
    while i < n:
        op = pkl[i]
        size = args[op]
        i += 1
        if op in _INT_OPS:
            for at in range(i, i + size):  # type: ignore[operator]
                out[at] = (i, op)
        if size is None or op == 0x2E:
            break
        if size > 0:
            i += size
        elif size == -4:
            i += 4 + int.from_bytes(pkl[i:i + 4], "little")
        elif size == -1:
            i += 1 + pkl[i]
        elif size == -2:
            i = pkl.find(b"\n", pkl.find(b"\n", i) + 1) + 1
    return out


def like_proven(pkl: bytes) -> bool:
    """Whether `pkl` is a stream proven before (`remember_proven`) with at most the values of
    some K, M and J arguments changed, each to a value Python's pickler writes with that
    opcode (K: 0..255, M: 256..65535, J: any other 32-bit int). Such a stream holds the same
    opcodes (the scan's outcome is the same) and unpickles to the same object but for those
    ints; the pickler does not memoise ints, so it writes that object as the proven stream with
    the new values: `pkl` itself, and the proof holds for it without pickling it again."""
    for known, ints in PROVEN.get(len(pkl), ()):
        if known == pkl:
            return True
        diff = int.from_bytes(known, "little") ^ int.from_bytes(pkl, "little")
        base, spans = 0, set()
        while diff:
            skip = ((diff & -diff).bit_length() - 1) >> 3  # the next differing byte
            span = ints.get(base + skip)
            if span is None or len(spans) > 32:
                break
            spans.add(span)
            diff >>= 8 * (skip + 1)
            base += skip + 1
        else:
            if all(op == 0x4B or (op == 0x4D and int.from_bytes(pkl[at:at + 2], "little") > 0xFF)
                   or (op == 0x4A and not 0 <= int.from_bytes(pkl[at:at + 4], "little",
                                                              signed=True) <= 0xFFFF)
                   for at, op in spans):
                return True
    return False


def remember_proven(pkl: bytes, args: list[int | None]) -> None:
    """Keep `pkl` (scanned, proven) for `like_proven`."""
    kept = PROVEN.setdefault(len(pkl), [])
    if len(PROVEN) > 256:
        PROVEN.clear()
        kept = PROVEN.setdefault(len(pkl), [])
    kept.insert(0, (pkl, int_args(pkl, args)))
    del kept[PROVEN_KEPT:]
