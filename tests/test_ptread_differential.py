"""judge/read/ptread.py against `torch.load(weights_only=True)`, differentially: structure-level
mutations of the zip container and a corpus of hostile pickles. For every file, whatever the
reader makes of it, (1) a value it gives is the value torch gives, bit for bit (never a file
torch refuses, never other values), and (2) `read_pt` (the reader, else torch.load) ends as
torch.load does: the same values or an exception."""

from __future__ import annotations

import io
import random
import struct
import warnings
import zipfile
import zlib
from typing import Any

import pytest
import torch
from ptzip import entries_of as _entries
from ptzip import entry as _entry
from ptzip import members as _members
from ptzip import write as _write
from test_ptread import _raw, _saved

from pytest_rlkernel_matrix.judge.read import ptread

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

BASE = {"schema_version": "rlkernel.vime_rocm_attention_mismatch_sidecar.v1", "rank": 1,
        "call_index": 7, "train_log_probs": [torch.arange(8, dtype=torch.float32),
                                             torch.arange(4, dtype=torch.float32) / 3],
        "loss_masks": [torch.ones(8)], "total_lengths": [12, 9]}


def _torch_load(raw: bytes) -> tuple[bool, Any]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return True, torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types
        return False, exc


def _agree(raw: bytes) -> tuple[bool, bool, Any]:
    """(the reader read it, torch read it, torch's value); asserts (1) and (2) above, and the
    same of `load_arrays` (numpy) where the reader reads it."""
    ok, want = _torch_load(raw)
    try:
        got = ptread.load(raw, "m.pt")
    except ptread.OutOfBounds as exc:  # outside the reading bounds: refused, whatever torch does
        assert str(exc).startswith("m.pt: ")
        with pytest.raises(ptread.OutOfBounds):
            ptread.read_pt(raw, torch, "m.pt")
        return False, ok, want
    except ptread.Unsupported as exc:
        assert str(exc).startswith("m.pt: ")
        ours = False
    else:
        ours = True
        assert ok, f"the reader read a file torch.load refuses ({want!r})"
        assert _same(got, want), "the reader's values differ from torch.load's"
        arrays = ptread.load_arrays(raw, "m.pt")
        assert arrays is not None and _same_arrays(arrays, want)
    if ok:
        assert _same(ptread.read_pt(raw, torch, "m.pt"), want)
    else:
        with pytest.raises(Exception):  # noqa: B017 (torch's own exception, whatever it is)
            ptread.read_pt(raw, torch, "m.pt")
    return ours, ok, want


def _same(a: Any, b: Any, seen: set[tuple[int, int]] | None = None) -> bool:
    """Bitwise equality of two loaded objects: tensors (dtype, geometry, bytes), storages,
    containers in order (keys too), cycles and shared objects included."""
    seen = set() if seen is None else seen
    if (id(a), id(b)) in seen:
        return True
    seen.add((id(a), id(b)))
    if type(a) is not type(b):
        return False
    if isinstance(b, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
                and a.storage_offset() == b.storage_offset()
                and a.requires_grad == b.requires_grad and _raw(a) == _raw(b))
    if isinstance(b, torch.storage.TypedStorage):
        return a.dtype == b.dtype and bytes(a._untyped_storage) == bytes(b._untyped_storage)
    if isinstance(b, torch.UntypedStorage):
        return bytes(a) == bytes(b)
    if isinstance(b, dict):
        return len(a) == len(b) and all(
            _same(ka, kb, seen) and _same(a[ka], b[kb], seen) for ka, kb in zip(a, b, strict=False))
    if isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y, seen) for x, y in zip(a, b, strict=False))
    if isinstance(b, (set, frozenset)):
        return a == b
    if isinstance(b, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    return bool(a == b)


def _same_arrays(a: Any, b: Any) -> bool:
    if isinstance(b, torch.Tensor):
        want = (b.float() if b.dtype == torch.bfloat16 else b).numpy()
        return (a.shape == want.shape and a.dtype == want.dtype
                and a.tobytes() == want.tobytes())
    if isinstance(b, dict):
        return list(a) == list(b) and all(_same_arrays(a[k], b[k]) for k in b)
    if isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same_arrays, a, b))
    return _same(a, b)


RAW = _saved(BASE)


def test_the_writer_writes_torch_s_layout_byte_for_byte() -> None:
    assert _write(_entries(RAW)) == RAW
    assert _agree(RAW)[:2] == (True, True)


def _with(i: int, **kw: Any) -> bytes:
    entries = _entries(RAW)
    entries[i].update(kw)
    return _write(entries)


def _index(suffix: str) -> int:
    return next(i for i, (n, _) in enumerate(_members(RAW)) if n.endswith(suffix))


def _tensor_record() -> tuple[int, int]:
    """The indices of data/0 and data/1 (the first two tensors' records)."""
    return _index("/data/0"), _index("/data/1")


def test_zip64_end_records_in_a_central_directory_entry_s_comment() -> None:
    """Issue 35's differential: the last directory entry's comment holds a second central
    directory, a zip64 end record pointing at it and its locator, right before the end record.
    miniz follows the locator and reads the second directory (whose data/0 is another record);
    the classic directory names the original one. torch reads other values; so must we or
    refuse: we refuse, and read_pt gives torch's values."""
    entries = _entries(RAW)
    d0, _ = _tensor_record()
    other = dict(entries[d0], data=(torch.arange(8, dtype=torch.float32) + 0.05).numpy()
                 .tobytes())
    other["crc"] = zlib.crc32(other["data"])
    plain = _write(entries, zip64=False)
    cd_off = struct.unpack_from("<L", plain, len(plain) - 6)[0]
    # the second record right before the directory, a second directory naming it as data/0
    records = bytearray(plain[:cd_off])
    other_at = len(records)
    lextra = b"FB\x00\x00"
    records += struct.pack("<4s2B4HL2L2H", b"PK\x03\x04", 0, 0, 0x808, 0, 0, 0, 0, 0, 0,
                           len(other["name"]), len(lextra)) + other["name"] + lextra
    records += other["data"] + struct.pack("<4s3L", b"PK\x07\x08", other["crc"],
                                           len(other["data"]), len(other["data"]))
    first = _write(entries, zip64=False)  # its directory's entries, offsets as in `plain`
    cd1 = bytearray(first[cd_off:len(first) - 22])
    offsets = [struct.unpack_from("<L", cd1, at + 42)[0] for at in _walk(cd1)]
    cd2 = bytearray()
    for k, at in enumerate(_walk(cd1)):
        nlen = struct.unpack_from("<H", cd1, at + 28)[0]
        head = bytearray(cd1[at:at + 46 + nlen])
        struct.pack_into("<H", head, 32, 0)  # no comment
        if k == d0:
            struct.pack_into("<L", head, 16, other["crc"])
            struct.pack_into("<L", head, 42, other_at)
        else:
            struct.pack_into("<L", head, 42, offsets[k])
        cd2 += head
    cd1_at = len(records)
    n = len(entries)
    # the last entry's comment: cd2, then the zip64 end record (-> cd2), then its locator
    comment_len = len(cd2) + 56 + 20
    last = list(_walk(cd1))[-1]
    struct.pack_into("<H", cd1, last + 32, comment_len)
    cd2_at = cd1_at + len(cd1)
    z64_at = cd2_at + len(cd2)
    comment = (bytes(cd2) + struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 798, 45, 0, 0, n, n,
                                        len(cd2), cd2_at)
               + struct.pack("<4sLQL", b"PK\x06\x07", 0, z64_at, 1))
    body = bytes(records) + bytes(cd1) + comment
    raw = body + struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, n, n, len(cd1) + len(comment),
                             cd1_at, 0)
    ours, ok, want = _agree(raw)
    assert ok and not ours
    assert torch.equal(want["train_log_probs"][0], torch.arange(8, dtype=torch.float32) + 0.05)


def _walk(cd: bytes | bytearray) -> Any:
    at = 0
    while at < len(cd):
        yield at
        nlen, xlen, clen = struct.unpack_from("<3H", cd, at + 28)
        at += 46 + nlen + xlen + clen


def _cases() -> dict[str, bytes]:
    d0, d1 = _tensor_record()
    pkl = _index("/data.pkl")
    last = len(_members(RAW)) - 1
    entries = _entries(RAW)
    swapped = _entries(RAW)
    plain = [dict(e, flags=0, descriptor=False) for e in _entries(RAW)]
    cases = {
        "python zipfile's layout (no descriptors, no zip64)": _write(plain, zip64=False),
        "no zip64 end records": _write(entries, zip64=False),
        "local name differs": _with(d0, lname=entries[d0]["name"][:-1] + b"7"),
        "local name of another case": _with(pkl, lname=entries[pkl]["name"].upper()),
        "local flags differ": _with(d0, lflags=0x8),
        "local method deflate": _with(d0, lmethod=8),
        "local sizes set, other values": _with(d0, lsizes=(1, 2, 3)),
        "local sizes set, right values": _with(d0, lsizes=(entries[d0]["crc"],
                                                           len(entries[d0]["data"]),
                                                           len(entries[d0]["data"]))),
        "local extra not torch's padding": _with(d0, lextra=b"\x99\x99\x02\x00ab"),
        "central extra field": _with(d0, cextra=b"\x99\x99\x02\x00ab"),
        "central zip64 extra field": _with(d0, cextra=struct.pack("<2HQ", 1, 8, 32)),
        "entry comment": _with(d0, comment=b"hello"),
        "entry comment holding a zip64 end record": _with(
            last, comment=struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 798, 45, 0, 0, 1, 1,
                                      46, 0)),
        "archive comment": _write(entries, comment=b"hi"),
        "archive comment holding zip64 records": _write(
            entries, zip64=False, comment=struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 798,
                                                      45, 0, 0, 1, 1, 46, 0)
            + struct.pack("<4sLQL", b"PK\x06\x07", 0, 0, 1)),
        "zip64 count disagrees": _write(entries, count=len(entries) - 1),
        "bytes before the zip64 end record": _write(entries, tail=b"\0" * 8),
        "bytes before the first record": _write(entries, prepend=b"\0" * 64),
        "bytes between records and directory": _write(entries, gap=b"PK\x05\x06" + b"\0" * 18),
        "bytes after a record": _with(d0, after=b"\0" * 4),
        "trailing bytes": RAW + b"\0",
        "compressed tensor record": _deflated(d0),
        "compressed data.pkl": _deflated(pkl),
        "descriptor with another CRC": _with(d0, descriptor=struct.pack(
            "<4s3L", b"PK\x07\x08", 1, len(entries[d0]["data"]), len(entries[d0]["data"]))),
        "descriptor without its signature": _with(d0, descriptor=struct.pack(
            "<3L", entries[d0]["crc"], len(entries[d0]["data"]), len(entries[d0]["data"]))),
        "zip64 descriptor": _with(d0, descriptor=struct.pack(
            "<4sL2Q", b"PK\x07\x08", entries[d0]["crc"], len(entries[d0]["data"]),
            len(entries[d0]["data"]))),
        "descriptor flag, no descriptor": _with(d0, descriptor=False),
        "no descriptor flag, a descriptor": _with(d0, flags=0x800, lsizes=(
            entries[d0]["crc"], len(entries[d0]["data"]), len(entries[d0]["data"]))),
        "central CRC wrong": _with(d0, crc=entries[d0]["crc"] ^ 1),
        "central compressed size differs": _with(d0, csize=len(entries[d0]["data"]) + 4),
        "two entries with one name": _write([*entries, dict(
            entries[d0], name=entries[d0]["name"], data=entries[d1]["data"][:32])]),
        "two entries whose names differ in case": _write(
            [*entries, dict(entries[pkl], name=entries[pkl]["name"].replace(b"data", b"DATA"))]),
        "data.pkl named in upper case": _with(pkl, name=entries[pkl]["name"].upper()),
        "a record torch does not write": _write([*entries, _entry("archive/constants.pkl", b"")]),
        "another archive folder": _with(d0, name=b"other/data/0"),
        "a name holding a newline": _with(d0, name=entries[d0]["name"] + b"\ndata/9"),
        "no byteorder": _write([e for e in entries if not e["name"].endswith(b"byteorder")]),
        "no version": _write([e for e in entries if not e["name"].endswith(b"/version")]),
    }
    swapped[d0]["offset"], swapped[d1]["offset"] = 0, 0
    cases["two entries at one offset"] = _write(swapped)
    for flag in (0x1, 0x2, 0x4, 0x10, 0x20, 0x40, 0x2000, 0x4000):
        cases[f"flag {flag:#x}"] = _with(d0, flags=0x808 | flag)
    return cases


def _deflated(i: int) -> bytes:
    entries = _entries(RAW)
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    data = comp.compress(entries[i]["data"]) + comp.flush()
    entries[i].update(method=8, data=data, crc=zlib.crc32(entries[i]["data"]))
    raw = bytearray(_write(entries))
    return bytes(raw)


def test_more_than_65535_records_zip64_counts() -> None:
    """Past 65,535 entries the end record holds the maximum and the zip64 one the count, as
    torch writes them (a probe file of 100,000 operators): read, to torch's values; the same
    file with a classic count that is not the maximum: refused."""
    entries = _entries(RAW)
    entries += [_entry(f"archive/data/{i}", b"") for i in range(100, 100 + 65_600)]
    raw = _write(entries)
    assert _agree(raw)[:2] == (True, True)
    end = len(raw) - 22
    wrong = raw[:end + 8] + struct.pack("<2H", 65_000, 65_000) + raw[end + 12:]
    assert not _agree(wrong)[0]


@pytest.mark.parametrize("name", list(_cases()))
def test_structure_level_container_mutations(name: str) -> None:
    raw = _cases()[name]
    ours, ok, _ = _agree(raw)
    if name.startswith("flag 0x20") or name == "flag 0x2000":  # torch refuses these (issue 35)
        assert not ok and not ours
    if name in ("python zipfile's layout (no descriptors, no zip64)", "no zip64 end records"):
        assert ok and not ours  # read, but by torch: not torch's own layout


def test_byte_flips_in_every_header_field() -> None:
    """Each byte of the container's own structures (local headers, descriptors, directory,
    end records), flipped: the reader reads a file only to torch's values."""
    rng = random.Random(35)
    with zipfile.ZipFile(io.BytesIO(RAW)) as zf:
        infos = zf.infolist()
        cd_off = zf.start_dir
    spans = [(i.header_offset, i.header_offset + 30 + len(i.filename) + 4) for i in infos]
    spans.append((cd_off, len(RAW)))
    positions = [p for lo, hi in spans for p in range(lo, hi)]
    read = 0
    for at in rng.sample(positions, 400):
        raw = bytearray(RAW)
        raw[at] ^= 1 << rng.randrange(8)
        read += _agree(bytes(raw))[0]
    assert read > 0  # some flips land in fields neither reader looks at


# -- hostile pickles ----------------------------------------------------------------------------

def _in_container(pkl: bytes) -> bytes:
    entries = _entries(_saved({"t": torch.arange(8, dtype=torch.float32)}))
    for e in entries:
        if e["name"].endswith(b"/data.pkl"):
            e.update(data=pkl, crc=zlib.crc32(pkl))
    return _write(entries)


S = b"X\x07\x00\x00\x00storage"
CPU = b"X\x03\x00\x00\x00cpu"
FLOAT = b"ctorch\nFloatStorage\n"
REBUILD = b"ctorch._utils\n_rebuild_tensor_v2\n"
HOOKS = b"ccollections\nOrderedDict\n)R"


def _pid(kind: bytes = FLOAT, key: bytes = b"X\x01\x00\x00\x000", loc: bytes = CPU,
         numel: bytes = b"K\x08") -> bytes:
    return b"(" + S + kind + key + loc + numel + b"tQ"


def _tensor(pid: bytes | None = None, offset: bytes = b"K\x00", size: bytes = b"K\x08\x85",
            stride: bytes = b"K\x01\x85", grad: bytes = b"\x89", hooks: bytes = HOOKS,
            extra: bytes = b"") -> bytes:
    return (REBUILD + b"(" + (pid or _pid()) + offset + size + stride + grad + hooks + extra
            + b"tR")


HOSTILE = {
    "os.system": b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00true\x85R.",
    "posix.system": b"\x80\x02cposix\nsystem\nX\x04\x00\x00\x00true\x85R.",
    "builtins.eval": b"\x80\x02c__builtin__\neval\nX\x03\x00\x00\x001+1\x85R.",
    "a set through __builtin__": b"\x80\x02c__builtin__\nset\n]K\x01a\x85R.",
    "INST": b"\x80\x02(X\x01\x00\x00\x00aios\nsystem\n.",
    "OBJ": b"\x80\x02(cos\nsystem\nX\x01\x00\x00\x00ao.",
    "STACK_GLOBAL": b"\x80\x02X\x02\x00\x00\x00osX\x06\x00\x00\x00system\x93.",
    "NEWOBJ on the hooks": b"\x80\x02ccollections\nOrderedDict\n)\x81.",
    "BUILD on the hooks": b"\x80\x02" + HOOKS + b"}b.",
    "BUILD on a tensor": b"\x80\x02" + _tensor() + b"Nb.",
    "EXT1": b"\x80\x02\x82\x01.",
    "FRAME": b"\x80\x04\x95\x03\x00\x00\x00\x00\x00\x00\x00K\x01.",
    "MEMOIZE": b"\x80\x04K\x01\x94.",
    "SHORT_BINUNICODE": b"\x80\x04\x8c\x01a.",
    "BINBYTES": b"\x80\x03B\x01\x00\x00\x00a.",
    "SHORT_BINSTRING": b"\x80\x02U\x01a.",
    "LONG4": b"\x80\x02\x8b\x01\x00\x00\x00\x01.",
    "LONG1 beyond 64 bits": b"\x80\x02\x8a\x09" + b"\x01" * 9 + b".",
    "text INT": b"\x80\x02I5\n.",
    "text FLOAT": b"\x80\x02F1.5\n.",
    "STRING": b"\x80\x02S'a'\n.",
    "UNICODE": b"\x80\x02Va\n.",
    "DICT": b"\x80\x02(X\x01\x00\x00\x00aK\x01d.",
    "LIST": b"\x80\x02(K\x01l.",
    "POP": b"\x80\x02K\x01K\x020.",
    "DUP": b"\x80\x02K\x012\x86.",
    "POP_MARK": b"\x80\x02K\x01(K\x021.",
    "EMPTY_SET + ADDITEMS": b"\x80\x04\x8f(K\x01\x90.",
    "FROZENSET": b"\x80\x04(K\x01\x91.",
    "text PERSID": b"\x80\x02P0\n.",
    "BINPERSID of an int": b"\x80\x02K\x00Q.",
    "SETITEM on a list": b"\x80\x02]K\x00aK\x00K\x07s.",
    "SETITEMS on a list": b"\x80\x02]K\x00a(K\x00K\x07u.",
    "APPEND on a dict": b"\x80\x02}K\x01a.",
    "a dict key twice": b"\x80\x02}(X\x01\x00\x00\x00aK\x01X\x01\x00\x00\x00aK\x02u.",
    "a memo index of 2**26": b"\x80\x02Nr" + (1 << 26).to_bytes(4, "little") + b".",
    "BINGET of nothing": b"\x80\x02h\x05.",
    "a mark left open at STOP": b"\x80\x02(K\x01.",
    "more than one item at STOP": b"\x80\x02K\x01K\x02.",
    "nothing at STOP": b"\x80\x02.",
    "protocol 4": b"\x80\x04K\x01.",
    "protocol 5": b"\x80\x05K\x01.",
    "protocol 9": b"\x80\x09K\x01.",
    "no PROTO": b"K\x01.",
    "bytes after STOP": b"\x80\x02K\x01.junk",
    "no STOP": b"\x80\x02K\x01",
    "a tensor, not memoised": b"\x80\x02" + _tensor() + b".",
    "storage named by bytes": b"\x80\x02" + _tensor(pid=b"(U\x07storage" + FLOAT
                                                     + b"X\x01\x00\x00\x000" + CPU + b"K\x08tQ")
    + b".",
    "storage on cuda": b"\x80\x02" + _tensor(pid=_pid(loc=b"X\x06\x00\x00\x00cuda:0")) + b".",
    "storage of 9 items in 8": b"\x80\x02" + _tensor(pid=_pid(numel=b"K\x09")) + b".",
    "storage of 4 items in 8": b"\x80\x02" + _tensor(pid=_pid(numel=b"K\x04"),
                                                     size=b"K\x04\x85") + b".",
    "storage with no record": b"\x80\x02" + _tensor(pid=_pid(key=b"X\x01\x00\x00\x009")) + b".",
    "a storage as two types": b"\x80\x02" + _tensor() + _tensor(pid=_pid(
        kind=b"ctorch\nIntStorage\n")) + b"\x86.",
    "requires_grad": b"\x80\x02" + _tensor(grad=b"\x88") + b".",
    "hooks with an entry": b"\x80\x02" + _tensor(
        hooks=b"ccollections\nOrderedDict\n]](K\x01K\x02ea\x85R") + b".",
    "metadata argument": b"\x80\x02" + _tensor(extra=b"}") + b".",
    "negative stride": b"\x80\x02" + _tensor(size=b"K\x02\x85", stride=b"J\xff\xff\xff\xff\x85")
    + b".",
    "size as a list": b"\x80\x02" + _tensor(size=b"]K\x08a") + b".",
    "size of a bool": b"\x80\x02" + _tensor(size=b"\x88\x85") + b".",
    "size past the storage": b"\x80\x02" + _tensor(size=b"K\x09\x85") + b".",
    "offset past the storage": b"\x80\x02" + _tensor(offset=b"K\x09", size=b"K\x00\x85")
    + b".",
    "stride of 2**63 on an empty tensor": b"\x80\x02" + _tensor(
        size=b"K\x00\x85", stride=b"\x8a\x09" + b"\x00" * 7 + b"\x80\x00\x85") + b".",
    "a persistent id's tuple again by BINGET, as a storage": b"\x80\x02" + _tensor(
        pid=_pid()[:-1] + b"q\x05Q") + _tensor(pid=b"h\x05") + b"\x86.",
    "a persistent id's tuple again by BINGET, as a value": b"\x80\x02" + _tensor(
        pid=_pid()[:-1] + b"q\x05Q") + b"h\x05\x86.",
    "a BINPERSID's storage memoised, two tensors on it": b"\x80\x02" + _tensor(
        pid=_pid() + b"q\x06") + _tensor(pid=b"h\x06") + b"\x86.",
    "one persistent id, two BINPERSIDs": b"\x80\x02" + _tensor(
        pid=_pid()[:-1] + b"q\x05Q") + _tensor(pid=b"h\x05Q") + b"\x86.",
    "a tensor as a dict key": b"\x80\x02}" + _tensor() + b"K\x01s.",
    "a list holding itself": b"\x80\x02]q\x00h\x00a.",
    "a storage type as a value": b"\x80\x02" + FLOAT + b".",
    "the hooks as a value": b"\x80\x02" + HOOKS + b".",
    "this reader's module": b"\x80\x02c" + ptread.__name__.encode() + b"\nFloatStorage\n.",
    "a lone surrogate": b"\x80\x02X\x03\x00\x00\x00\xed\xa0\x80.",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_pickles(name: str) -> None:
    _agree(_in_container(HOSTILE[name]))


def test_canonical_streams_of_the_corpus_read_and_agree() -> None:
    """What torch.save writes for values next to the hostile ones: read, to torch's values."""
    for obj in ({"t": torch.arange(8.0)}, {"s": "\ud800x"}, [[1, 2], {"a": (1.5, None)}],
                {"v": torch.arange(8.0)[2:5], "w": torch.arange(8.0).view(2, 4).t()},
                {"e": torch.zeros(0), "z": torch.tensor(2.0), "n": -(2**63)}):
        assert _agree(_saved(obj))[:2] == (True, True)


def test_random_mutations_of_a_sidecar_s_pickle() -> None:
    rng = random.Random(3505)
    pkl = _members(RAW)[_index("/data.pkl")][1]
    alphabet = bytes(range(256))
    read = 0
    for _ in range(300):
        b = bytearray(pkl)
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(b))
            kind = rng.random()
            if kind < 0.6:
                b[at] = rng.choice(alphabet)
            elif kind < 0.8:
                del b[at:at + rng.randint(1, 6)]
            else:
                b[at:at] = bytes(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
        entries = _entries(RAW)
        entries[_index("/data.pkl")].update(data=bytes(b), crc=zlib.crc32(bytes(b)))
        read += _agree(_write(entries))[0]
    assert read > 0
