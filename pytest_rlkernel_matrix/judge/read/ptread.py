"""The one reader of every `.pt` file the plugin reads, with `torch.load(weights_only=True)`'s
semantics: a file is read to the values torch gives it, bit for bit, or handed to torch.load.

Two layers, neither a parser of our own:

- **the container** is parsed by the standard library's `zipfile`; `_records` then holds it to
  the layout torch's writer (miniz) gives a file, field for field, so that miniz (what
  torch.load reads with) and `zipfile` cannot see two different archives in it: the end record
  at the very end, without comment, torch's zip64 end record and locator right before it and
  agreeing with it, the central directory right before those, exactly its entries; the entries
  in directory order tiling the file from byte 0 (local header, name, torch's alignment extra,
  data, data descriptor); every header field as torch writes it (flags 0x808, stored, no
  extra or comment in the directory, zero versions, times and attributes), local headers and
  descriptors agreeing with the directory; printable ASCII names of one archive folder, none
  twice even ignoring case (miniz looks names up ignoring it), each a record torch writes, the
  small ones with torch's content. CRCs are not checked: torch's reader checks none either
  (tests/test_ptread.py), so both read the same bytes.
- **the pickle** is read by the C unpickler (`pickle.Unpickler`) with `find_class` and
  `persistent_load` restricted to what torch.save writes for plain data and CPU tensors of the
  ten plain dtypes (`torch._utils._rebuild_tensor_v2`, an empty `collections.OrderedDict` as
  backward hooks, `torch.<Type>Storage` in `('storage', type, key, 'cpu', numel)` ids),
  answered by this module's own objects (no real global is ever looked up). `_scan` refuses,
  before it runs, any opcode outside those torch's weights-only unpickler implements and
  Python's protocol-2 pickler writes for such values (and a memo index no stream of its size
  needs: the C unpickler would allocate a table that large first). After it, the stream must
  be byte for byte what that pickler writes for the values it gave (`_canonical`): no SETITEM
  on a list, no mark left open, nothing torch's own unpickler would read otherwise.

Anything outside raises `Unsupported` naming the file; `read_pt` and `pt_dict` then call
`torch.load(weights_only=True)` on the same bytes, so the outcome is torch's.

Reading is bounded in memory and time, not only in bytes (`OutOfBounds`, final: such a file is
never handed to torch.load, and torch.load's own result is held to the same bounds, `bounded`):
before anything is materialised each tensor's element count, storage size and strides are
checked against the file (a view with stride 0 in a dimension of more than one element, one
that addresses more elements than its storage holds or reaches past it is refused), the values
all tensors address together, counted per reference, stay within `ADDRESS_FACTOR` x the file's
storage bytes + `ADDRESS_SLACK`; a file holds at most `MAX_VALUES` values (counted per
reference, so a shared container counts each time it is reachable) nested at most `MAX_NEST`
deep; and at most `MAX_BIG_INTS` integers past 32 bits (Python hashes an int modulo 2**61 - 1:
a dict of many colliding ones takes time quadratic in their count to build, so they are counted
in the stream before the unpickler builds anything). Keys nobody reads are walked, never copied:
the numpy path's tensors are views of the file's bytes. torch is imported
only to build torch tensors or to fall back, never at module load; `load_arrays` gives numpy
arrays (bfloat16 widened exactly) without torch. docs/benchmarks.md has the measurements.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import io
import pickle
import re
import struct
import sys
import zipfile
from pathlib import Path
from typing import Any

from pytest_rlkernel_matrix.store.safeio import Refused, read_bytes

_MOD = __name__.encode()
_INT_LIMIT = 1 << 63

# torch.<Type>Storage -> (torch dtype name, item size, numpy dtype or None)
_STORAGES = {
    "FloatStorage": ("float32", 4, "<f4"), "DoubleStorage": ("float64", 8, "<f8"),
    "HalfStorage": ("float16", 2, None), "BFloat16Storage": ("bfloat16", 2, None),
    "LongStorage": ("int64", 8, "<i8"), "IntStorage": ("int32", 4, "<i4"),
    "ShortStorage": ("int16", 2, "<i2"), "CharStorage": ("int8", 1, "i1"),
    "ByteStorage": ("uint8", 1, "u1"), "BoolStorage": ("bool", 1, "?"),
}
# the records torch writes besides data.pkl and data/<key>, with the only content accepted
_RECORDS = {"byteorder": b"little", "version": b"3\n", ".data/version": b"3\n",
            ".format_version": b"1", ".storage_alignment": b"64", ".data/serialization_id": None}
_FOLDER = re.compile(r"[!-.0-~]+\Z")  # printable ASCII, no space, no "/"
_INNERS = re.compile(r"(?:(?:data/[0-9]{{1,12}}|data\.pkl|{})\n)*\Z".format("|".join(
    map(re.escape, _RECORDS))))
_LOCAL = struct.Struct(zipfile.structFileHeader)
_CENTRAL = struct.Struct(zipfile.structCentralDir)
_DESCRIPTOR = struct.Struct("<4s3I")  # the data descriptor torch writes after each record


class Unsupported(Exception):
    """Outside what this reader reads (the message names the file); torch.load decides."""


class OutOfBounds(Unsupported):
    """Outside the reading bounds (the message names the file and what is out of bounds):
    refused, never handed to torch.load (`read_pt` raises it)."""


MAX_VALUES = 1 << 22
MAX_NEST = 64
MAX_BIG_INTS = 1024
ADDRESS_FACTOR = 4
ADDRESS_SLACK = 16 * 2**20


# -- the container ------------------------------------------------------------------------------

def _records(raw: bytes) -> dict[str, memoryview]:
    """{name inside the archive folder: the record's bytes} of a zip laid out as torch's."""
    if not raw.startswith(zipfile.stringFileHeader):
        raise Unsupported("not a zip file")
    try:
        infos = zipfile.ZipFile(io.BytesIO(raw)).infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError) as exc:
        raise Unsupported(f"zipfile: {exc}") from None
    end = len(raw) - zipfile.sizeEndCentDir
    (sig, disk, disk_cd, here, total, cd_size, cd_off,
     comment) = struct.unpack_from(zipfile.structEndArchive, raw, end)
    if sig != zipfile.stringEndArchive or disk or disk_cd or here != total or comment:
        raise Unsupported("zip end record is not a single-disk one without comment at the end")
    loc_at = end - zipfile.sizeEndCentDir64Locator
    cd_end = loc_at - zipfile.sizeEndCentDir64  # torch's writer always writes zip64 records
    if cd_end < 0:
        raise Unsupported("zip too short for torch's end records")
    loc = struct.unpack_from(zipfile.structEndArchive64Locator, raw, loc_at)
    z64 = struct.unpack_from(zipfile.structEndArchive64, raw, cd_end)
    if (loc != (zipfile.stringEndArchive64Locator, 0, cd_end, 1)
            or z64[:6] != (zipfile.stringEndArchive64, zipfile.sizeEndCentDir64 - 12, 0x31E, 45,
                           0, 0) or z64[6] != z64[7]
            or any(classic != min(full, big) for classic, full, big in (
                (here, z64[6], 0xFFFF), (cd_size, z64[8], 0xFFFFFFFF),
                (cd_off, z64[9], 0xFFFFFFFF)))):  # (the classic fields or, past them, their max)
        raise Unsupported("zip64 end records are not torch's, or disagree with the end record")
    total, cd_size, cd_off = z64[7:]  # what miniz and zipfile read
    if cd_off + cd_size != cd_end or len(infos) != total:
        raise Unsupported("zip central directory is not right before its end records")
    names = [info.orig_filename for info in infos]
    folder = names[0].partition("/")[0] if names else ""
    inners = [name[len(folder) + 1:] for name in names]
    joined = "\n".join(inners) + "\n"
    if (not _FOLDER.match(folder) or not all(name.startswith(folder + "/") for name in names)
            or joined.count("\n") != len(inners) or not _INNERS.match(joined)):
        raise Unsupported("zip entries are not records torch writes, in one archive folder")
    if len({name.lower() for name in names}) != len(names):
        raise Unsupported("zip entry names twice (miniz ignores their case)")
    records: dict[str, memoryview] = {}
    view, pos, central = memoryview(raw), 0, []
    for info, inner in zip(infos, inners, strict=True):  # each header: torch's, field for field
        size, crc, name = info.file_size, info.CRC, info.orig_filename.encode()
        flags = 0x808 if size else 0x800  # an empty record has no data descriptor
        xlen = int.from_bytes(raw[pos + 28:pos + 30], "little")  # (torch's alignment padding)
        start = pos + zipfile.sizeFileHeader + len(name) + xlen
        if not (raw.startswith(_LOCAL.pack(zipfile.stringFileHeader, 0, 0, flags, 0, 0, 0, 0, 0,
                                           0, len(name), xlen) + name, pos)
                and (not size or raw.startswith(_DESCRIPTOR.pack(b"PK\x07\x08", crc, size,
                                                                 size), start + size))):
            raise Unsupported(f"zip entry {name[:80]!r} is not laid out as torch writes it")
        central.append(_CENTRAL.pack(zipfile.stringCentralDir, 0, 0, 0, 0, flags, 0, 0, 0, crc,
                                     size, size, len(name), 0, 0, 0, 0, 0, pos) + name)
        records[inner] = view[start:start + size]
        pos = start + size + (_DESCRIPTOR.size if size else 0)
    if pos != cd_off or raw[cd_off:cd_end] != b"".join(central):
        raise Unsupported("zip central directory is not torch's for these records, or bytes lie "
                          "between them")
    for inner, want in _RECORDS.items():
        if want is not None and inner in records and records[inner] != want:
            raise Unsupported(f"zip record {inner!r} is not {want!r}")
    for need in ("data.pkl", "byteorder", "version"):
        if need not in records:
            raise Unsupported(f"zip has no {need} record")
    return records


# -- the pickle ---------------------------------------------------------------------------------

class _StorageType:
    """What `torch.<Type>Storage` unpickles to here: a marker, never called."""

    __slots__ = ("dtype", "itemsize", "name", "numpy")

    def __init__(self, name: str) -> None:
        self.name = name
        self.dtype, self.itemsize, self.numpy = _STORAGES[name]

    def __reduce__(self) -> str:
        return self.name  # pickled by reference, as this module's global of that name


for _name in _STORAGES:
    globals()[_name] = _StorageType(_name)
_TYPES = {name: globals()[name] for name in _STORAGES}


class _Storage:
    """A persistent id's storage: the record's bytes (a memoryview of the file)."""

    __slots__ = ("data", "kind", "pid")

    def __init__(self, pid: tuple[Any, ...], kind: _StorageType, data: memoryview) -> None:
        self.pid, self.kind, self.data = pid, kind, data


class _Hooks:
    """An empty backward-hooks dict (`collections.OrderedDict()`)."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, ...]:
        return (OrderedDict, ())


class _Tensor:
    """A checked `_rebuild_tensor_v2` call: (storage, offset, size, stride, False, hooks)."""

    __slots__ = ("args",)

    def __init__(self, args: tuple[Any, ...]) -> None:
        self.args = args

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_tensor_v2, self.args)


def _ints(value: Any) -> bool:
    return type(value) is tuple and all(type(v) is int and 0 <= v < _INT_LIMIT for v in value)


def _rebuild_tensor_v2(*args: Any) -> _Tensor:
    if len(args) == 6:  # a 1-d tensor inside its storage, the common case, sooner
        storage, offset, size, stride, requires_grad, hooks = args
        if (type(storage) is _Storage and type(offset) is int and type(size) is tuple
                and type(stride) is tuple and len(size) == 1 and len(stride) == 1
                and requires_grad is False and type(hooks) is _Hooks):
            n, step = size[0], stride[0]
            if (type(n) is int and type(step) is int and 0 < n < _INT_LIMIT
                    and (0 < step < _INT_LIMIT or n == 1) and offset >= 0
                    and offset + (n - 1) * step < len(storage.data) // storage.kind.itemsize):
                return _Tensor(args)
    return _rebuild_checked(*args)


def _rebuild_checked(*args: Any) -> _Tensor:
    if len(args) != 6:
        raise Unsupported(f"_rebuild_tensor_v2 with {len(args)} arguments (6 read here)")
    storage, offset, size, stride, requires_grad, hooks = args
    if (type(storage) is not _Storage or type(offset) is not int or not 0 <= offset < _INT_LIMIT
            or not _ints(size) or not _ints(stride) or len(size) != len(stride)
            or requires_grad is not False or type(hooks) is not _Hooks):
        raise Unsupported("_rebuild_tensor_v2 arguments are not a CPU tensor's")
    _check_view(size, stride, offset, len(storage.data) // storage.kind.itemsize)
    return _Tensor(args)


def _check_view(size: tuple[int, ...], stride: tuple[int, ...], offset: int, items: int) -> None:
    """`OutOfBounds` for a view that would address more than its storage holds: a stride 0 in
    a dimension of more than one element (an expanded tensor), more elements than the storage
    holds (overlapping strides), or an extent past the storage's end."""
    if 0 in size:
        if offset > items:
            raise OutOfBounds(f"tensor (offset {offset}, size {size}) outside its storage of "
                              f"{items} items")
        return
    for n, s in zip(size, stride, strict=True):
        if s == 0 and n > 1:
            raise OutOfBounds(f"tensor of size {size} has stride 0 in a dimension of {n} "
                              "elements (an expanded view: it would be materialised "
                              f"{n} times from {items} stored items)")
    numel = 1
    for n in size:
        numel *= n
    if numel > items:
        raise OutOfBounds(f"tensor of size {size}, stride {stride} addresses {numel} elements, "
                          f"more than the {items} items of its storage: outside its storage "
                          "or overlapping")
    last = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    if last >= items or offset < 0:
        raise OutOfBounds(f"tensor (offset {offset}, size {size}, stride {stride}) outside "
                          f"its storage of {items} items")


def OrderedDict(*args: Any) -> _Hooks:
    """What `_Hooks` pickles as (by reference, renamed `collections.OrderedDict`)."""
    if args:
        raise Unsupported("collections.OrderedDict with arguments")
    return _Hooks()


_GLOBALS = {("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
            # (`_Hooks` itself: made without a Python call; with arguments it raises TypeError)
            ("collections", "OrderedDict"): _Hooks,
            **{("torch", name): kind for name, kind in _TYPES.items()}}


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, records: dict[str, memoryview]) -> None:
        super().__init__(io.BytesIO(data))
        self._records = records
        self._used: dict[str, tuple[_StorageType, int]] = {}

    def find_class(self, module: str, name: str) -> Any:
        found = _GLOBALS.get((module, name))
        if found is None:
            raise Unsupported(f"global {module[:80]}.{name[:80]} is not in the allowlist")
        return found

    def persistent_load(self, pid: Any) -> Any:
        if (type(pid) is not tuple or len(pid) != 5 or type(pid[0]) is not str
                or pid[0] != "storage" or type(pid[1]) is not _StorageType
                or type(pid[2]) is not str or type(pid[3]) is not str or pid[3] != "cpu"
                or type(pid[4]) is not int):
            raise Unsupported(f"persistent id {str(pid)[:80]} is not a CPU storage")
        _, kind, key, _, numel = pid
        data = self._records.get("data/" + key)
        if data is None or numel * kind.itemsize != len(data) or numel < 0:
            raise Unsupported(f"storage {key[:20]!r}: no record of {numel} x {kind.itemsize}"
                              " bytes")
        if self._used.setdefault(key, (kind, numel)) != (kind, numel):
            raise Unsupported(f"storage {key[:20]!r} used with two types or sizes")
        return _Storage(pid, kind, data)


class _Canonical(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if type(obj) is _Storage else None


def _canonical(obj: Any) -> bytes:
    """What torch.save's pickler (protocol 2) writes for `obj`, globals named as torch's."""
    buf = io.BytesIO()
    _Canonical(buf, protocol=2).dump(obj)
    mod = b"c" + _MOD + b"\n"
    return (buf.getvalue()
            .replace(mod + b"_rebuild_tensor_v2\n", b"ctorch._utils\n_rebuild_tensor_v2\n")
            .replace(mod + b"OrderedDict\n", b"ccollections\nOrderedDict\n")
            .replace(mod, b"ctorch\n"))


# The opcodes accepted, each with its argument: a fixed count of bytes, or -4 (a 4-byte length,
# then that many bytes), -1 (a 1-byte length, then that many), -2 (two lines): those torch's
# weights-only unpickler implements that Python's protocol-2 pickler writes for the values
# above (no LONG4, SHORT_BINUNICODE, FRAME, MEMOIZE, POP, DUP, BINBYTES, ...).
_OPCODES: dict[int, int] = {
    **dict.fromkeys(b"}])(useat\x85\x86\x87\x88\x89NRQ.", 0),
    **{ord("q"): 1, ord("h"): 1, ord("K"): 1, ord("M"): 2, ord("J"): 4, ord("j"): 4,
       ord("r"): 4, ord("G"): 8, 0x80: 1},
    ord("X"): -4, 0x8A: -1, ord("c"): -2,
}
_ARGS = [_OPCODES.get(op) for op in range(256)]
# Runs of fixed-size opcodes other than STOP, LONG_BINPUTs below 65,536 (a memo table of at
# most 1 MiB) and BINUNICODEs shorter than 256 bytes, skipped in C; `_scan` steps through the
# rest.
_FIXED = re.compile(b"(?:" + b"|".join(
    b"[" + re.escape(bytes(ops)) + b"]" + (b".{%d}" % size if size else b"")
    for size in (0, 1, 2, 4, 8)
    if (ops := [op for op, n in _OPCODES.items() if n == size and op not in (0x2E, 0x72)])
) + b"|X(?:" + b"|".join(re.escape(bytes([n, 0, 0, 0])) + (b".{%d}" % n if n else b"")
                         for n in range(256)) + b")|r..\0\0)*", re.DOTALL)


def _scan(pkl: bytes) -> None:
    """Refuse opcodes outside `_OPCODES`, and LONG_BINPUT indices past 65,536 and the stream's
    size (no stream needs them; the C unpickler would first allocate a table that large)."""
    i, n, args, skip = 0, len(pkl), _ARGS, _FIXED.match
    big = 0
    while i < n:
        i = skip(pkl, i).end()
        if i >= n:
            break
        op = pkl[i]
        size = args[op]
        if size is None:
            raise Unsupported(f"data.pkl opcode {bytes([op])!r} at {i} is not one torch.save's "
                              "pickler writes for plain data and tensors")
        i += 1
        if size > 0:
            if op == 0x72 and int.from_bytes(pkl[i:i + 4], "little") >= max(n, 1 << 16):
                raise Unsupported(f"data.pkl memo index at {i - 1} past the stream's size")
            i += size
        elif size == -4:
            i += 4 + int.from_bytes(pkl[i:i + 4], "little")
        elif size == -1:
            i += 1 + pkl[i] if i < n else 1
            big += 1  # LONG1: an int past 32 bits
            if big > MAX_BIG_INTS:
                raise OutOfBounds(f"data.pkl holds more than {MAX_BIG_INTS} integers past 32 "
                                  "bits (many colliding ones as dict keys take quadratic time "
                                  "to build)")
        elif size == -2:
            first = pkl.find(b"\n", i)
            i = pkl.find(b"\n", first + 1) + 1 if first >= 0 else 0
            if i == 0:
                raise Unsupported("data.pkl GLOBAL is not two lines")
        elif op == 0x2E:  # STOP
            if i != n:
                raise Unsupported("data.pkl has bytes after its STOP")
            return
    raise Unsupported("data.pkl has no STOP")


# -- the bounds ---------------------------------------------------------------------------------

def _fast_view(obj: Any) -> tuple[tuple[int, ...], tuple[int, ...], int, int, int, int] | None:
    """(size, stride, offset, storage items, item size, storage id) of this reader's tensor."""
    if type(obj) is not _Tensor:
        return None
    st, offset, size, stride = obj.args[:4]
    return size, stride, offset, len(st.data) // st.kind.itemsize, st.kind.itemsize, id(st.data)


def _torch_view(obj: Any) -> tuple[tuple[int, ...], tuple[int, ...], int, int, int, int] | None:
    """The same of a torch tensor (torch.load's result)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, torch.Tensor):
        return None
    item = obj.element_size()
    storage = obj.untyped_storage()
    return (tuple(obj.shape), tuple(obj.stride()), int(obj.storage_offset()),
            storage.nbytes() // item, item, storage.data_ptr())


def bounded(obj: Any, view: Any = _torch_view) -> None:
    """`OutOfBounds` unless `obj` (a file's loaded object) keeps the reading bounds (module
    doc). Iterative; every reference counted (a container reachable twice counts twice)."""
    values = 0
    addressed = 0
    storages: dict[int, int] = {}
    stack: list[tuple[Any, int, str]] = [(obj, 0, "")]
    while stack:
        item, depth, path = stack.pop()
        got = view(item)
        if got is not None:
            size, stride, offset, items, itemsize, sid = got
            try:
                _check_view(size, stride, offset, items)
            except OutOfBounds as exc:
                raise OutOfBounds(f"{path or 'the object'}: {exc}") from None
            storages[sid] = items * itemsize
            numel = 1
            for n in size:
                numel *= n
            addressed += numel * itemsize
            continue
        kind = type(item)
        if kind is dict:
            children: Any = item.values()
            label = [f"{path}[{k!r}]" for k in item] if depth < 8 else None
        elif kind is list or kind is tuple:
            children, label = item, None
        else:
            continue
        values += len(item)
        if values > MAX_VALUES:
            raise OutOfBounds(f"holds more than {MAX_VALUES} values (counted per reference)")
        if depth >= MAX_NEST:
            raise OutOfBounds(f"{path or 'the object'}: nested deeper than {MAX_NEST}")
        for i, child in enumerate(children):
            if type(child) in _PLAIN:
                continue
            stack.append((child, depth + 1, label[i] if label else f"{path}[{i}]"))
    stored = sum(storages.values())
    if addressed > ADDRESS_FACTOR * stored + ADDRESS_SLACK:
        raise OutOfBounds(f"its tensors address {addressed} bytes (counted per reference), "
                          f"more than {ADDRESS_FACTOR} x the {stored} bytes it stores")


# -- the values ---------------------------------------------------------------------------------

_PLAIN = frozenset((str, int, float, bool, type(None)))


def _values(obj: Any, tensor: Any, memo: dict[int, Any], active: set[int]) -> Any:
    """`obj` with `tensor(t)` in place of each `_Tensor` (lists and dicts changed in place);
    `Unsupported` for any other type of ours and for cycles (torch reads those the torch way)."""
    kind = type(obj)
    if kind in _PLAIN:
        return obj
    key = id(obj)
    if key in memo:
        return memo[key]
    if kind is _Tensor:
        memo[key] = tensor(obj)
        return memo[key]
    if kind not in (dict, list, tuple):
        raise Unsupported(f"a value of type {kind.__name__}")
    if key in active:
        raise Unsupported("a cycle")
    active.add(key)
    if kind is dict:
        for k, v in obj.items():
            if type(k) not in _PLAIN:
                raise Unsupported(f"a dict key of type {type(k).__name__}")
            if type(v) not in _PLAIN:
                obj[k] = _values(v, tensor, memo, active)
    elif kind is list:
        for i, v in enumerate(obj):
            if type(v) not in _PLAIN:
                obj[i] = _values(v, tensor, memo, active)
    else:
        obj = tuple([_values(v, tensor, memo, active) for v in obj])
    active.discard(key)
    memo[key] = obj
    return obj


def _numpy(bases: dict[str, Any]) -> Any:
    """Each tensor as a read-only numpy view of its record's bytes: torch's dtype (bfloat16
    widened exactly to float32: its bits shifted up 16, what torch's `.float()` gives for all
    65,536 patterns; numpy has none), size, stride and storage offset. float16 is read the torch
    way: torch's `.float()` quiets a signalling NaN in one loop and not in another (measured).
    A widened bfloat16 array's dtype says so in its metadata (`{"torch": "bfloat16"}`; it
    compares equal to float32), so readers can tell the dtype it was stored in."""
    import numpy as np

    bf16_as_f32 = np.dtype("<f4", metadata={"torch": "bfloat16"})

    def tensor(t: _Tensor) -> Any:
        st, offset, size, stride = t.args[:4]
        kind, buffer = st.kind, st.data
        if kind.numpy is None:
            if kind.dtype != "bfloat16":
                raise Unsupported(f"{kind.dtype} tensors are read the torch way")
            buffer = bases.get(st.pid[2])
            if buffer is None:
                buffer = (np.frombuffer(st.data, "<u2").astype(np.uint32) << 16).view(np.float32)
                buffer.flags.writeable = False
                bases[st.pid[2]] = buffer
        item = 4 if kind.numpy is None else kind.itemsize
        return np.ndarray(size, kind.numpy or bf16_as_f32, buffer, offset * item,
                          (stride[0] * item,) if len(stride) == 1 else tuple(
                              s * item for s in stride))
    return tensor


def _torch(bases: dict[str, Any]) -> Any:
    """Each tensor as torch's rebuild gives it: a copy of the record, viewed."""
    import torch

    def tensor(t: _Tensor) -> Any:
        st, offset, size, stride = t.args[:4]
        base = bases.get(st.pid[2])
        if base is None:
            dtype = getattr(torch, st.kind.dtype)
            base = (torch.frombuffer(bytearray(st.data), dtype=dtype) if len(st.data)
                    else torch.empty(0, dtype=dtype))
            bases[st.pid[2]] = base
        value = base.as_strided(size, stride, offset)
        value._backward_hooks = collections.OrderedDict()  # as torch's rebuild sets it
        return value
    return tensor


def load(raw: bytes, name: str = "<bytes>", *, arrays: str = "torch") -> Any:
    """The object a `.pt` file holds, as `torch.load(raw, weights_only=True)` gives it, CPU
    tensors; `Unsupported` (naming `name`) for anything this reader does not read.
    ``arrays="numpy"``: each tensor a read-only numpy array instead; torch is not imported."""
    if arrays not in ("torch", "numpy"):
        raise ValueError(f"arrays={arrays!r}: 'torch' or 'numpy'")
    collecting = gc.isenabled()
    gc.disable()  # (a file of N records makes O(N) objects: collections in between cost O(N^2))
    try:
        if sys.byteorder != "little":
            raise Unsupported("this machine is big-endian (torch swaps bytes, this reader not)")
        records = _records(raw)
        pkl = bytes(records["data.pkl"])
        if _MOD in pkl:
            raise Unsupported("data.pkl names this reader's module")
        _scan(pkl)
        obj = _Unpickler(pkl, records).load()
        bounded(obj, _fast_view)
        if _canonical(obj) != pkl:
            raise Unsupported("data.pkl is not what torch.save's pickler writes for its values")
        return _values(obj, (_numpy if arrays == "numpy" else _torch)({}), {}, set())
    except Unsupported as exc:  # (OutOfBounds included, kept as such)
        raise type(exc)(f"{name}: {exc}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError,
            AttributeError, struct.error, RecursionError, OverflowError, MemoryError,
            UnicodeDecodeError, RuntimeError) as exc:
        raise Unsupported(f"{name}: {type(exc).__name__}: {str(exc)[:200]}") from None
    finally:
        if collecting:
            gc.enable()


# -- the calls ----------------------------------------------------------------------------------

COUNTS = {"fast": 0, "torch.load": 0}  # files read by each path in this process


def read_pt(raw: bytes, torch: Any, name: str = "<bytes>") -> Any:
    """A `.pt` file's object: `load`, or where it says `Unsupported`,
    `torch.load(weights_only=True)` on the same bytes; CPU tensors either way."""
    try:
        obj = load(raw, name)
    except OutOfBounds:
        raise
    except Exception:  # Unsupported, or anything unforeseen: torch's answer, never ours
        COUNTS["torch.load"] += 1
        _big_ints_before_torch(raw, name)
        obj = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        try:
            bounded(obj)
        except OutOfBounds as exc:
            raise OutOfBounds(f"{name}: {exc}") from None
        return obj
    COUNTS["fast"] += 1
    return obj


def _big_ints_before_torch(raw: bytes, name: str) -> None:
    """The `MAX_BIG_INTS` bound on a file this reader hands to torch.load, counted in its
    pickle's opcodes before torch's unpickler builds anything (a file whose pickle cannot be
    found or parsed here is torch's to refuse)."""
    import pickletools

    pkl = b""
    with contextlib.suppress(Exception), zipfile.ZipFile(io.BytesIO(raw)) as zf:
        names = [n for n in zf.namelist() if n.endswith("data.pkl")]
        pkl = zf.read(names[0]) if len(names) == 1 else b""
    if pkl.count(b"\x8a") + pkl.count(b"\x8b") <= MAX_BIG_INTS:
        return
    big = 0
    with contextlib.suppress(Exception):
        for op, _, _ in pickletools.genops(pkl):
            if op.name in ("LONG1", "LONG4", "LONG"):
                big += 1
    if big > MAX_BIG_INTS:
        raise OutOfBounds(f"{name}: data.pkl holds more than {MAX_BIG_INTS} integers past 32 "
                          "bits (many colliding ones as dict keys take quadratic time to build)")


def load_arrays(raw: bytes, name: str = "<bytes>") -> Any | None:
    """`load(raw, name, arrays="numpy")`, or None where this reader does not read the file
    (the caller then reads the same bytes the torch way: `pt_dict`)."""
    try:
        obj = load(raw, name, arrays="numpy")
    except Exception:  # Unsupported, or anything unforeseen (or out of bounds: `pt_dict`
        return None    # then says why): torch's way decides
    COUNTS["fast"] += 1
    return obj


def _import_torch(name: str, problems: list[str], what: str) -> Any:
    """The torch module, or None with the reason in `problems`."""
    try:
        import torch
    except ImportError:
        problems.append(f"cannot read {what}{name}: torch is not installed in the plugin's "
                        "Python")
        return None
    return torch


def pt_dict(raw: bytes, name: str, problems: list[str], what: str = "") -> dict[str, Any] | None:
    """The dict a `.pt` file's bytes hold, with torch tensors (`read_pt`), or None with the
    reason in `problems`."""
    torch = _import_torch(name, problems, what)
    if torch is None:
        return None
    try:
        data = read_pt(raw, torch, name)
    except Exception as exc:  # torch raises many types for a bad pickle
        problems.append(f"{what}{name}: unreadable: {type(exc).__name__}: {str(exc)[:200]}")
        return None
    if not isinstance(data, dict):
        problems.append(f"{what}{name}: not a dict")
        return None
    return data


def read_pt_dict(path: Path, root: Path, max_bytes: int, problems: list[str],
                 what: str = "") -> tuple[dict[str, Any], bytes] | None:
    """(object, bytes) of a `.pt` file under `root` that must hold a dict, read through
    `store.safeio` (capped, regular, inside `root`) and `read_pt`; or None with the reason in
    `problems` (``what`` prefixes the file's name there: ``"probe "``)."""
    if _import_torch(path.name, problems, what) is None:  # said before the file is read
        return None
    try:
        raw = read_bytes(path, root, max_bytes)
    except Refused as exc:
        problems.append(str(exc))
        return None
    data = pt_dict(raw, path.name, problems, what)
    return None if data is None else (data, raw)
