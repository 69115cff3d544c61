"""A fast, restricted reader of `torch.save` zip files that hold only plain data and tensors.

`torch.load(weights_only=True)` spends about 100 us per tensor in its pure-Python unpickler;
an RL-Kernel sidecar holds three small tensors per sample, so reading a 200-step root is mostly
that. `load_plain` reads the same files with the C unpickler restricted to an allowlist that is
a strict subset of what `weights_only=True` accepts:

- globals: `torch._utils._rebuild_tensor_v2` (answered by our own builder, which checks every
  argument), `collections.OrderedDict` (only for the empty backward-hooks dict) and the typed
  storage classes `torch.<Type>Storage` (answered by dtype markers, never called);
- persistent ids: `('storage', <storage marker>, key, location, numel)`, the storage read as a
  view of the file's bytes (the zip entry must be stored uncompressed, inside the file, aligned);
- the result: dicts, lists, tuples, str, int, float, bool, None and tensors; nothing else.

Anything outside that (another global, an unknown persistent id, a compressed entry, big-endian
data, tensors with hooks or requires_grad, a legacy non-zip file) raises `Unsupported` and the
caller falls back to `torch.load(weights_only=True)`: the fast path never accepts a file that
path would refuse and never gives other values (the tensors' bytes are the file's bytes).
torch is imported inside `load_plain` only.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import zipfile
from typing import Any

_DTYPES = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
    "BoolStorage": "bool",
}
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., name length, extra length


class Unsupported(Exception):
    """The file is outside what the fast path reads; use torch.load(weights_only=True)."""


class _StorageType:
    __slots__ = ("dtype",)

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype


class _TensorRef:
    """What the unpickler builds for a tensor; checked and turned into a tensor afterwards."""

    __slots__ = ("args",)

    def __init__(self, args: tuple[Any, ...]) -> None:
        self.args = args


def _rebuild_tensor_v2(*args: Any) -> _TensorRef:
    return _TensorRef(args)


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, storage: Any) -> None:
        super().__init__(io.BytesIO(data))
        self._storage = storage

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor_v2
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch" and name in _DTYPES:
            return _StorageType(_DTYPES[name])
        raise Unsupported(f"global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if (not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage"
                or not isinstance(pid[1], _StorageType) or not isinstance(pid[2], str)
                or not isinstance(pid[3], str) or type(pid[4]) is not int):
            raise Unsupported(f"persistent id {str(pid)[:80]}")
        return self._storage(pid[1].dtype, pid[2], pid[4])


def _entry_offset(raw: bytes | bytearray, info: zipfile.ZipInfo) -> int:
    if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
        raise Unsupported(f"{info.filename} is compressed")
    sig, name_len, extra_len = _LOCAL_HEADER.unpack_from(raw, info.header_offset)
    if sig != b"PK\x03\x04":
        raise Unsupported(f"{info.filename}: bad local header")
    start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    if start + info.file_size > len(raw):
        raise Unsupported(f"{info.filename} runs past the end of the file")
    return start


_PLAIN = (str, int, float, bool, type(None))


def load_plain(raw: bytes | bytearray) -> Any:
    """The object a plain-data `torch.save` file holds, tensors as CPU views of `raw`'s bytes
    (copied once into a writable buffer); `Unsupported` for anything the fast path does not read.
    """
    import torch

    try:
        zf = zipfile.ZipFile(io.BytesIO(raw))
        infos = {i.filename: i for i in zf.infolist()}
    except (zipfile.BadZipFile, ValueError, struct.error) as exc:
        raise Unsupported(f"not a zip file: {exc}") from None
    pkl = [n for n in infos if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pkl) != 1:
        raise Unsupported("no single <archive>/data.pkl")
    prefix = pkl[0][: -len("data.pkl")]
    order = infos.get(prefix + "byteorder")
    if order is None or zf.read(order) != b"little":
        raise Unsupported("byte order not recorded as little")
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else None
    storages: dict[str, Any] = {}

    def storage(dtype: str, key: str, numel: int) -> Any:
        if key in storages:
            got = storages[key]
            if str(got.dtype) != f"torch.{dtype}" or got.numel() != numel:
                raise Unsupported(f"storage {key} used with two types")
            return got
        info = infos.get(f"{prefix}data/{key}")
        if info is None or buf is None:
            raise Unsupported(f"storage {key} missing")
        start = _entry_offset(raw, info)
        kind = getattr(torch, dtype)
        size = kind.itemsize
        if numel < 0 or numel * size != info.file_size or start % size:
            raise Unsupported(f"storage {key}: {numel} x {size} bytes vs {info.file_size}")
        storages[key] = buf[start:start + info.file_size].view(kind)
        return storages[key]

    try:
        obj = _Unpickler(zf.read(infos[pkl[0]]), storage).load()
    except Unsupported:
        raise
    except Exception as exc:  # a malformed pickle: let torch's own loader say what it is
        raise Unsupported(f"unpickling: {type(exc).__name__}: {str(exc)[:200]}") from None
    return _finish(obj, torch)


def _tensor(ref: _TensorRef, torch: Any) -> Any:
    args = ref.args
    if len(args) not in (6, 7):
        raise Unsupported("tensor rebuilt with an unexpected argument count")
    st, offset, size, stride, requires_grad, hooks = args[:6]
    if not isinstance(st, torch.Tensor) or type(offset) is not int or requires_grad is not False:
        raise Unsupported("tensor arguments")
    if type(hooks) is not collections.OrderedDict or hooks:
        raise Unsupported("tensor with backward hooks")
    if len(args) == 7 and args[6] not in (None, {}):
        raise Unsupported("tensor metadata")
    if not (isinstance(size, tuple) and isinstance(stride, tuple) and len(size) == len(stride)
            and all(type(v) is int and v >= 0 for v in size + stride)):
        raise Unsupported("tensor size/stride")
    if offset < 0 or (all(size) and offset + sum((n - 1) * s for n, s in zip(size, stride,
                                                                             strict=True))
                      >= st.numel()):
        raise Unsupported("tensor outside its storage")
    return st.as_strided(size, stride, st.storage_offset() + offset)  # offsets: in the file


def _finish(obj: Any, torch: Any) -> Any:
    if isinstance(obj, _TensorRef):
        return _tensor(obj, torch)
    kind = type(obj)
    if kind in _PLAIN:
        return obj
    if kind is list:
        return [_finish(v, torch) for v in obj]
    if kind is tuple:
        return tuple(_finish(v, torch) for v in obj)
    if kind is dict:
        out = {}
        for k, v in obj.items():
            if type(k) not in _PLAIN:
                raise Unsupported(f"dict key of type {type(k).__name__}")
            out[k] = _finish(v, torch)
        return out
    raise Unsupported(f"value of type {kind.__name__}")
