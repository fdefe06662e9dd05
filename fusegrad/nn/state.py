"""Model state: parameters and state dicts, safetensors, PyTorch checkpoints, GGUF, zip and tar archives.

Files are mapped (mmap), never read whole into Python objects: each tensor's byte range is checked against the file
and copied once from the mapping into device memory. Every length, offset and count a file declares is checked
before it is used, so a truncated or hostile file raises a ValueError naming what is wrong instead of reading out of
bounds or allocating what it asks for.

What a file may expand to beyond its own bytes (deflated archive members, compressed tar streams, tensor views
larger than their storage through strides of 0) is bounded by the sizes the file declares and by MAX_INFLATED_BYTES,
which a caller may raise (or pass `max_inflated=` to the loaders that take it)."""
from __future__ import annotations
import contextlib
import io
import json
import mmap
import os
import pickle
import re
import struct
import tarfile
import zipfile
import zlib
from collections import OrderedDict
from typing import Any, Callable, Iterable, Iterator, TypeVar
from fusegrad.device import Device
from fusegrad.dtype import DType, dtypes
from fusegrad.helpers import prod
from fusegrad.tensor import Tensor

__all__ = ["get_parameters", "get_state_dict", "load_state_dict", "safe_save", "safe_load", "safe_load_metadata",
           "torch_load", "zip_extract", "tar_extract", "gguf_load", "accept_filename"]

T = TypeVar("T")

MAX_INFLATED_BYTES = 256 << 20
"""The most bytes one load may create beyond the bytes its file holds: deflated zip members, the decompressed stream
of a compressed tar, and tensor views that read more elements than their storage holds (strides of 0). Raise it to
load larger ones; `torch_load`, `zip_extract` and `tar_extract` also take `max_inflated=` for one call."""
MAX_DIMS = 64  # the most dimensions a loaded tensor may have (as torch's own tensors)

# *** walking models ***

def get_state_dict(obj: Any, prefix: str = "", tensor_type: type = Tensor) -> dict[str, Tensor]:
    """Every tensor reachable from `obj` through attributes, lists, tuples and dicts, named like PyTorch's state-dict
    keys (`layers.0.weight`)."""
    if isinstance(obj, tensor_type): return {prefix.strip("."): obj}
    if hasattr(obj, "_asdict"): return get_state_dict(obj._asdict(), prefix, tensor_type)  # namedtuples
    if isinstance(obj, OrderedDict | dict):
        return {k: v for key, val in obj.items()
                for k, v in get_state_dict(val, f"{prefix}{key}.", tensor_type).items()}
    if isinstance(obj, list | tuple):
        return {k: v for i, x in enumerate(obj) for k, v in get_state_dict(x, f"{prefix}{i}.", tensor_type).items()}
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return get_state_dict(vars(obj), prefix, tensor_type)
    return {}

def get_parameters(obj: Any) -> list[Tensor]:
    """Every distinct tensor reachable from `obj` (see get_state_dict), in state-dict order."""
    return list(dict.fromkeys(get_state_dict(obj).values()))

def _progress(items: Iterable[T], total: int, desc: str, enabled: bool) -> Iterable[T]:
    """A tqdm progress bar when tqdm is installed and `enabled`; the items unchanged otherwise."""
    if enabled:
        try:
            from tqdm import tqdm
            return tqdm(items, total=total, desc=desc, leave=False)
        except ImportError: pass
    return items

def load_state_dict(model: Any, state_dict: dict[str, Tensor], strict: bool = True, verbose: bool = True,
                    consume: bool = False, realize: bool = True) -> list[Tensor]:
    """Copy `state_dict` into the model's tensors (values of another float dtype are cast; a value of shape () and a
    target of shape (1,), or the reverse, are reshaped; a sharded target gets the value laid out as the target is,
    split along its axis or replicated, whatever the value's own layout). strict: missing and unexpected keys are
    errors (else missing keys are kept and reported with verbose); a BatchNorm's `num_batches_tracked` that the model
    doesn't keep is never an error (PyTorch writes it, tinygrad's and others' models may not have it). A shape
    mismatch is always an error naming the key. consume: delete each entry from state_dict once loaded. Returns the
    loaded tensors."""
    model_state = get_state_dict(model)
    missing = [k for k in model_state if k not in state_dict]
    unexpected = [k for k in state_dict if k not in model_state and k.rsplit(".", 1)[-1] != "num_batches_tracked"]
    if strict and (missing or unexpected):
        raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
    if verbose and missing: print(f"load_state_dict: {len(missing)} keys not in the state dict, kept: {missing[:8]}")
    loaded: list[Tensor] = []
    keys = [k for k in model_state if k in state_dict]
    for k in _progress(keys, len(keys), "loading", verbose and len(keys) > 16):
        target, value = model_state[k], state_dict[k]
        if not isinstance(value, Tensor):
            raise TypeError(f"load_state_dict: {k} is a {type(value).__name__}, not a Tensor")
        if {value.shape, target.shape} == {(), (1,)}: value = value.reshape(target.shape)
        if value.shape != target.shape:
            raise ValueError(f"load_state_dict: shape mismatch for {k}: the model has {target.shape}, the state dict "
                             f"{value.shape}")
        if value.dtype != target.dtype:
            if dtypes.is_float(value.dtype) != dtypes.is_float(target.dtype):
                raise TypeError(f"load_state_dict: dtype mismatch for {k}: the model has {target.dtype}, the state "
                                f"dict {value.dtype}")
            value = value.cast(target.dtype)
        # a sharded target keeps its layout (axis and shard bounds), whatever the value's: on the same devices a value
        # split along another axis, or replicated, is laid out again
        if isinstance(target.device, tuple): value = value.shard_like(target)
        else: value = value.to(target.device)
        target.replace(value.contiguous())
        loaded.append(target)
        if consume: del state_dict[k]
    if realize and loaded: Tensor.realize(*loaded)
    return loaded

# *** reading files ***

class _Mapped:
    """A read-only file mapping with bounds-checked slicing."""
    def __init__(self, fn: str | os.PathLike):
        with open(fn, "rb") as f:
            self.size = os.fstat(f.fileno()).st_size
            self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self.size else None
        self.name = str(fn)

    def view(self, start: int, end: int, what: str) -> memoryview:
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= self.size):
            raise ValueError(f"{self.name}: {what} spans bytes [{start}, {end}) outside the file of {self.size} bytes")
        return memoryview(self.mm)[start:end] if self.mm is not None else memoryview(b"")

def _source(fn: Any) -> _Mapped | memoryview:
    if isinstance(fn, Tensor):
        if fn.dtype != dtypes.uint8: raise TypeError(f"expected a uint8 tensor of file bytes, got {fn.dtype}")
        return memoryview(bytes(fn.data()))
    if isinstance(fn, bytes | bytearray | memoryview): return memoryview(fn)
    if not isinstance(fn, str | os.PathLike): raise TypeError(f"expected a file name, got {type(fn).__name__}")
    return _Mapped(fn)

def _bytes(src: _Mapped | memoryview, start: int, end: int, what: str) -> memoryview:
    if isinstance(src, _Mapped): return src.view(start, end, what)
    if not (0 <= start <= end <= len(src)):
        raise ValueError(f"{what} spans bytes [{start}, {end}) outside the data of {len(src)} bytes")
    return src[start:end]

def _size(src: _Mapped | memoryview) -> int: return src.size if isinstance(src, _Mapped) else len(src)

def _tensor(raw: memoryview, shape: tuple[int, ...], dtype: DType, device: str | None = None) -> Tensor:
    if len(raw) != prod(shape) * dtype.itemsize:
        raise ValueError(f"{len(raw)} bytes can't hold a {dtype} tensor of shape {shape}")
    return Tensor(Tensor._from_bytes(raw, shape, dtype, Device.DEFAULT if device is None else device))

def _is_int(x: Any) -> bool: return type(x) is int  # bool is an int subclass but never a valid size or offset

def _countable(shape: Iterable[int]) -> bool:
    """Whether the sizes (ints >= 0) make a shape torch and numpy can hold: the product of the nonzero ones fits an
    int64 (a size-0 dim leaves no elements, but the others still count)."""
    return prod(max(s, 1) for s in shape) < 2**63

class _Budget:
    """The bytes a load may still create beyond what its file holds (see MAX_INFLATED_BYTES)."""
    def __init__(self, limit: int | None):
        self.limit = MAX_INFLATED_BYTES if limit is None else limit
        if not _is_int(self.limit) or self.limit < 0:
            raise TypeError(f"max_inflated must be an int >= 0, not {limit!r}")
        self.left = self.limit

    def spend(self, n: int, what: str) -> None:
        if n > self.left:
            raise ValueError(f"{what} expands to {n} bytes, past the limit of {self.limit} bytes expanded per load "
                             "(raise fusegrad.nn.state.MAX_INFLATED_BYTES or pass max_inflated= to load it)")
        self.left -= n

# what the parsing libraries raise on malformed input; translated to ValueError at each loader's boundary
_PARSE_ERRORS = (pickle.UnpicklingError, EOFError, UnicodeDecodeError, TypeError, AttributeError, IndexError,
                 KeyError, RecursionError, struct.error, OverflowError, zipfile.BadZipFile, zlib.error,
                 tarfile.TarError, NotImplementedError, OSError)

@contextlib.contextmanager
def _malformed(what: str) -> Iterator[None]:
    try: yield
    except UnicodeDecodeError as e: raise ValueError(f"{what}: malformed file: undecodable text ({e})") from e
    except ValueError: raise
    except _PARSE_ERRORS as e: raise ValueError(f"{what}: malformed file ({type(e).__name__}: {e!s:.200})") from e

_CHUNK = 1 << 20  # bytes of compressed input inflated at a time

def _read_member(src: _Mapped | memoryview, info: zipfile.ZipInfo, budget: _Budget, what: str,
                 expect: int | None = None) -> memoryview:
    """The bytes of a zip member, its sizes checked before anything is decompressed: `expect` (the size the content
    declares) if given, the archive for stored bytes (a view of them, not a copy), the budget for deflated ones.
    Inflated in bounded chunks and stopped one byte past the declared size, so a directory that understates the
    size can't make it inflate further."""
    name = info.filename
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise ValueError(f"{what}: {name!r} uses compression method {info.compress_type} (only stored and deflated "
                         "members are read)")
    if info.flag_bits & 0x2061:  # encrypted, strongly encrypted, a patch, a masked local header
        raise ValueError(f"{what}: {name!r} is encrypted or a patch (flags {info.flag_bits:#x})")
    if info.external_attr & 0x10:  # the MS-DOS directory attribute: other readers (torch's) read no bytes then
        raise ValueError(f"{what}: {name!r} is marked as a directory but holds data")
    if expect is not None and info.file_size != expect:
        raise ValueError(f"{what}: {name!r} holds {info.file_size} bytes, expected {expect}")
    if info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size:
        raise ValueError(f"{what}: stored member {name!r} claims {info.file_size} bytes but spans {info.compress_size}")
    head = _bytes(src, info.header_offset, info.header_offset + 30, f"{what}: the local header of {name!r}")
    n_name, n_extra = struct.unpack("<HH", head[26:30])
    start = info.header_offset + 30 + n_name + n_extra
    raw_name = info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")
    if head[:4] != b"PK\x03\x04" or _bytes(src, start - n_extra - n_name, start - n_extra, what) != raw_name:
        raise ValueError(f"{what}: the central directory's entry for {name!r} points at no local header of it")
    data = _bytes(src, start, start + info.compress_size, f"{what}: the data of {name!r}")
    if info.compress_type == zipfile.ZIP_DEFLATED:
        budget.spend(info.file_size, f"{what}: deflated member {name!r}")
        data = _inflate(data, info.file_size, f"{what}: deflated member {name!r}")
    if zlib.crc32(data) != info.CRC: raise ValueError(f"{what}: {name!r} fails its CRC check")
    return data

def _inflate(comp: memoryview, size: int, what: str) -> memoryview:
    """The `size` bytes a raw deflate stream holds; an error if it holds more, fewer or is cut short."""
    d, out = zlib.decompressobj(-zlib.MAX_WBITS), bytearray()
    try:
        for i in range(0, len(comp), _CHUNK):
            buf = comp[i:i + _CHUNK]
            while buf and not d.eof:
                out += d.decompress(buf, size + 1 - len(out))  # at most one byte past the declared size
                if len(out) > size: raise ValueError(f"{what} inflates past its declared {size} bytes")
                buf = d.unconsumed_tail
            if d.eof: break
    except zlib.error as e: raise ValueError(f"{what} is not a valid deflate stream ({e})") from e
    if not d.eof or len(out) != size:
        raise ValueError(f"{what} inflates to {len(out)} bytes{'' if d.eof else ' and is cut short'}, not {size}")
    return memoryview(out)

def _open_zip(src: _Mapped | memoryview, what: str) -> zipfile.ZipFile:
    # python's zipfile ignores the disk numbers of the end record (it checks zip64's, where these read 0xFFFF)
    tail = bytes(_bytes(src, max(0, _size(src) - 22 - 0xFFFF), _size(src), f"{what}: the end of the archive"))
    if (at := tail.rfind(b"PK\x05\x06")) >= 0 and len(tail) - at >= 22:
        disk, cd_disk, here, total = struct.unpack("<HHHH", tail[at + 4:at + 12])
        if 0xFFFF not in (disk, cd_disk, here, total) and (disk or cd_disk or here != total):
            raise ValueError(f"{what}: the archive spans several disks (not supported)")
        # nor the zip64 end record's, which its locator (just before the end record) points to
        if at >= 20 and tail[at - 20:at - 16] == b"PK\x06\x07":
            (rec,) = struct.unpack("<Q", tail[at - 12:at - 4])
            head = bytes(_bytes(src, rec, rec + 56, f"{what}: the zip64 end record"))
            disk, cd_disk, here, total = struct.unpack("<IIQQ", head[16:40])
            if head[:4] != b"PK\x06\x06" or disk or cd_disk or here != total:
                raise ValueError(f"{what}: a bad zip64 end record (or one of an archive spanning several disks)")
    with _malformed(what):
        zf = zipfile.ZipFile(src.name if isinstance(src, _Mapped) else io.BytesIO(src))
    infos, problem = zf.infolist(), None
    if len({info.filename for info in infos}) != len(infos): problem = "the archive names a member twice"
    elif any(info.volume for info in infos): problem = "the archive spans several disks (not supported)"
    # (python's zipfile cuts a name at a NUL byte)
    elif any("\0" in info.orig_filename for info in infos): problem = "a member's name holds a NUL byte"
    if problem is not None:
        zf.close()
        raise ValueError(f"{what}: {problem}")
    return zf

def accept_filename(func: Callable[[Any], T]) -> Callable[[Any], T]:
    """Let a loader taking a tensor of file bytes take a file name too (the file is mapped, not read)."""
    return func

# *** safetensors ***

_SAFE_DTYPES: dict[str, DType] = {"F64": dtypes.float64, "F32": dtypes.float32, "F16": dtypes.float16,
                                  "BF16": dtypes.bfloat16, "I64": dtypes.int64, "I32": dtypes.int32,
                                  "I16": dtypes.int16, "I8": dtypes.int8, "U8": dtypes.uint8, "BOOL": dtypes.bool,
                                  "U16": dtypes.uint16, "U32": dtypes.uint32, "U64": dtypes.uint64}
_SAFE_NAMES = {v: k for k, v in _SAFE_DTYPES.items()}
_MAX_HEADER = 100 << 20  # the safetensors format's own bound on the JSON header

def safe_load_metadata(t: Any) -> tuple[Any, int, dict[str, Any]]:
    """(the file source, the JSON header length, the parsed header) of a safetensors file or byte tensor."""
    src = _source(t)
    if _size(src) < 8: raise ValueError(f"safetensors: file too short ({_size(src)} bytes) for its 8-byte header size")
    (n,) = struct.unpack("<Q", _bytes(src, 0, 8, "header size"))
    if n > _MAX_HEADER or 8 + n > _size(src):
        raise ValueError(f"safetensors: header length {n} runs past the end of the file ({_size(src)} bytes)")
    try: header = json.loads(bytes(_bytes(src, 8, 8 + n, "header")))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"safetensors: malformed header: {e}") from e
    except RecursionError as e: raise ValueError("safetensors: the header nests too deeply") from e
    if not isinstance(header, dict): raise ValueError("safetensors: the header is not a JSON object")
    meta = header.get("__metadata__", {})
    if not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise ValueError("safetensors: __metadata__ is not a map of strings to strings")
    return src, n, header

def _safe_entry(name: str, info: Any, data_len: int) -> tuple[int, int, str, DType, tuple[int, ...]]:
    """(start, end, name, dtype, shape) of a header entry, each field checked."""
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise ValueError(f"safetensors: entry {name!r} lacks dtype, shape or data_offsets")
    dtype, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _SAFE_DTYPES:
        raise ValueError(f"safetensors: {name!r} has unknown dtype {dtype!r:.80}")
    if not (isinstance(shape, list) and len(shape) <= MAX_DIMS and all(_is_int(s) and s >= 0 for s in shape)
            and _countable(shape)):
        raise ValueError(f"safetensors: {name!r} has a bad shape {shape!r:.80} (at most {MAX_DIMS} ints >= 0)")
    if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs)
            and 0 <= offs[0] <= offs[1] <= data_len):
        raise ValueError(f"safetensors: {name!r} has data offsets {offs!r:.80} outside the data ({data_len} bytes)")
    dt = _SAFE_DTYPES[dtype]
    if offs[1] - offs[0] != prod(shape) * dt.itemsize:
        raise ValueError(f"safetensors: {name!r} spans {offs[1] - offs[0]} bytes but {dtype} {shape} "
                         f"needs {prod(shape) * dt.itemsize}")
    return offs[0], offs[1], name, dt, tuple(shape)

def safe_load(fn: Any) -> dict[str, Tensor]:
    """The tensors of a safetensors file (name -> tensor on the default device); every entry is validated first, and
    the entries must cover the data exactly (no overlaps, gaps or trailing bytes), as the format requires."""
    src, n, header = safe_load_metadata(fn)
    data_start, data_len = 8 + n, _size(src) - 8 - n
    entries = sorted(_safe_entry(name, info, data_len) for name, info in header.items() if name != "__metadata__")
    end, last = 0, None
    for b, e, name, *_ in entries:
        if b < end: raise ValueError(f"safetensors: the data of {last!r} and {name!r} overlap")
        if b > end: raise ValueError(f"safetensors: bytes [{end}, {b}) of the data belong to no tensor")
        end, last = e, name
    if end != data_len: raise ValueError(f"safetensors: bytes [{end}, {data_len}) of the data belong to no tensor")
    return {name: _tensor(_bytes(src, data_start + b, data_start + e, name), shape, dt)
            for b, e, name, dt, shape in entries}

def safe_save(tensors: dict[str, Tensor], fn: str, metadata: dict[str, Any] | None = None) -> None:
    """Write `tensors` (and string metadata) as a safetensors file."""
    header: dict[str, Any] = {}
    if metadata is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("safetensors metadata must map strings to strings")
        header["__metadata__"] = metadata
    offset, blobs = 0, []
    for name, t in tensors.items():
        if not isinstance(t, Tensor): raise TypeError(f"safe_save: {name!r} is a {type(t).__name__}, not a Tensor")
        if t.dtype not in _SAFE_NAMES:
            raise TypeError(f"safe_save: {name!r} has dtype {t.dtype}, which safetensors lacks")
        raw = bytes(t.contiguous().to("CPU")._buffer().as_buffer()) if t.numel() else b""
        header[name] = {"dtype": _SAFE_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    hdr = json.dumps(header, separators=(",", ":")).encode()
    hdr += b" " * (-len(hdr) % 8)  # the data starts 8-byte aligned, as the reference writer does
    with open(fn, "wb") as f:
        f.write(struct.pack("<Q", len(hdr)) + hdr)
        for b in blobs: f.write(b)

# *** archives ***

def zip_extract(t: Any, max_inflated: int | None = None) -> dict[str, Tensor]:
    """name -> uint8 tensor of each member of a zip archive (stored or deflated members). The deflated members may
    inflate to max_inflated bytes in all (MAX_INFLATED_BYTES by default)."""
    src, budget = _source(t), _Budget(max_inflated)
    with _malformed("zip_extract"), _open_zip(src, "zip_extract") as zf:
        return {info.filename: _tensor(_read_member(src, info, budget, "zip_extract"), (info.file_size,),
                                       dtypes.uint8)
                for info in zf.infolist() if not info.is_dir()}

def tar_extract(t: Any, max_inflated: int | None = None) -> dict[str, Tensor]:
    """name -> uint8 tensor of each regular file of a tar archive (a later member of the same name replaces an earlier
    one, as when extracting). A compressed archive may decompress to max_inflated bytes (MAX_INFLATED_BYTES by
    default)."""
    src, budget = _source(t), _Budget(max_inflated)
    fobj = open(src.name, "rb") if isinstance(src, _Mapped) else io.BytesIO(src)
    with fobj, _malformed("tar_extract"):
        try: tf = tarfile.open(fileobj=fobj)
        except tarfile.TarError as e: raise ValueError(f"tar_extract: not a tar archive: {e}") from e
        with tf:
            # an uncompressed archive can't hold more than the file; a compressed one is bounded as it is read
            compressed, out = tf.fileobj is not fobj, {}
            bound, what = (budget.limit, "the decompressed archive") if compressed else (_size(src), "the archive")
            members = []
            while (m := tf.next()) is not None:
                if m.issparse(): raise ValueError(f"tar_extract: {m.name!r} is a sparse file (not supported)")
                if max(tf.offset, m.offset_data + m.size) > bound:
                    raise ValueError(f"tar_extract: {m.name!r} ends at byte {m.offset_data + m.size}, past {what} "
                                     f"({bound} bytes" + (", raise MAX_INFLATED_BYTES or pass max_inflated= to read it)"
                                                          if compressed else ")"))
                members.append(m)
            # python's tarfile stops at the first header it can't parse: only zeros may follow the last member
            pos = tf.offset
            tf.fileobj.seek(pos)
            while tail := tf.fileobj.read(min(_CHUNK, max(bound - pos, 1))):
                if tail.count(0) != len(tail): raise ValueError(f"tar_extract: a damaged header after byte {pos}")
                pos += len(tail)
                if pos > bound: raise ValueError(f"tar_extract: the archive runs past {what} ({bound} bytes)")
            for m in members:
                if not m.isfile(): continue
                f = tf.extractfile(m)
                if f is None: raise ValueError(f"tar_extract: {m.name!r} has no data")
                data = f.read(m.size)
                if len(data) != m.size:
                    raise ValueError(f"tar_extract: {m.name!r} ends after {len(data)} of its {m.size} bytes")
                out[m.name] = _tensor(memoryview(data), (m.size,), dtypes.uint8)
            return out

# *** PyTorch checkpoints ***

_TORCH_STORAGES: dict[str, DType] = {
    "DoubleStorage": dtypes.float64, "FloatStorage": dtypes.float32, "HalfStorage": dtypes.float16,
    "BFloat16Storage": dtypes.bfloat16, "LongStorage": dtypes.int64, "IntStorage": dtypes.int32,
    "ShortStorage": dtypes.int16, "CharStorage": dtypes.int8, "ByteStorage": dtypes.uint8, "BoolStorage": dtypes.bool}

class _StorageType:
    def __init__(self, dtype: DType): self.dtype = dtype

class _Storage:
    """A storage's bytes, read on demand by the loader that owns it."""
    def __init__(self, dtype: DType, numel: int, read: Callable[[], memoryview] | None, budget: _Budget):
        # read is None while the bytes are still ahead in the file (the legacy format stores them after the pickle)
        self.dtype, self.numel, self._read, self.budget, self._tensor = dtype, numel, read, budget, None
    def tensor(self) -> Tensor:
        if self._tensor is None:
            if self._read is None: raise ValueError("torch_load: a tensor's storage is missing from the checkpoint")
            raw = self._read()
            if len(raw) != self.numel * self.dtype.itemsize:
                raise ValueError(f"torch_load: a storage of {self.numel} {self.dtype} holds {len(raw)} bytes")
            self._tensor = _tensor(raw, (self.numel,), self.dtype)
        return self._tensor

def _storage_id(pid: tuple) -> tuple[str, DType, int]:
    """(key, dtype, element count) of a persistent storage id ('storage', type, key, location, numel, ...)."""
    if len(pid) < 5: raise ValueError(f"torch_load: short storage id {pid!r:.80}")
    key, location, numel = pid[2], pid[3], pid[4]
    if not isinstance(key, str) or not _is_int(numel) or not 0 <= numel < 2**63:
        raise ValueError(f"torch_load: bad storage id {pid!r:.80} (needs a string key and an element count >= 0)")
    if not (isinstance(location, str) and re.fullmatch(r"(cpu|cuda|mps|xpu)(:\d+)?", location)):
        raise ValueError(f"torch_load: storage {key} has an unknown location {location!r:.40}")
    return key, pid[1].dtype, numel

class _Pending:
    """A tensor whose storage bytes come later in the file."""
    def __init__(self, *args: Any): self.args = args

def _rebuild_tensor_v2(storage: _Storage, offset: int, size: tuple, stride: tuple, requires_grad: Any,
                       backward_hooks: Any, metadata: Any = None) -> Tensor | _Pending:
    return _rebuild_tensor(storage, offset, size, stride)

def _rebuild_tensor(storage: _Storage, offset: int, size: tuple, stride: tuple) -> Tensor | _Pending:
    if not isinstance(storage, _Storage):
        raise ValueError("torch_load: a tensor is rebuilt from something not a storage")
    size, stride = _check_view(storage, offset, size, stride)
    if storage._read is None: return _Pending(storage, offset, size, stride)
    return _build_tensor(storage, offset, size, stride)

def _check_view(storage: _Storage, offset: Any, size: Any, stride: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(size, stride) of a tensor view, checked against its storage before any view is built: ints >= 0, at most
    MAX_DIMS of them, every element inside the storage, and what it reads beyond the storage within the budget."""
    if not (isinstance(size, tuple | list) and isinstance(stride, tuple | list) and len(size) == len(stride)
            and len(size) <= MAX_DIMS and all(_is_int(x) and x >= 0 for x in (*size, *stride))
            and _is_int(offset) and offset >= 0 and _countable(size)):
        raise ValueError(f"torch_load: bad tensor geometry size={size!r:.200} stride={stride!r:.200} "
                         f"offset={offset!r:.40} (at most {MAX_DIMS} dims, ints >= 0, under 2**63 elements)")
    size, stride = tuple(size), tuple(stride)
    n = prod(size)
    if n == 0: return size, stride
    last = offset + sum((s - 1) * st for s, st in zip(size, stride))
    if last >= storage.numel:
        raise ValueError(f"torch_load: a tensor of size {size} and stride {stride} at offset {offset} reads past its "
                         f"storage of {storage.numel} elements")
    if n > storage.numel:  # strides of 0 (an expanded tensor) or overlapping rows: the view is larger than the storage
        storage.budget.spend((n - storage.numel) * storage.dtype.itemsize,
                             f"torch_load: a tensor of size {size} and stride {stride} over {storage.numel} elements")
    return size, stride

def _build_tensor(storage: _Storage, offset: int, size: tuple[int, ...], stride: tuple[int, ...]) -> Tensor:
    if prod(size) == 0: return Tensor.zeros(*size, dtype=storage.dtype)
    # dims of size 1 read nothing and dims of stride 0 repeat: only the others index the storage
    keep = [i for i, (s, st) in enumerate(zip(size, stride)) if s > 1 and st > 0]
    t = _strided(storage.tensor(), offset, [size[i] for i in keep], [stride[i] for i in keep])
    return t.reshape(tuple(size[i] if i in keep else 1 for i in range(len(size)))).expand(size)

def _strided(flat: Tensor, offset: int, size: list[int], stride: list[int]) -> Tensor:
    """The elements a view of sizes > 1 and strides > 0 reads from `flat`, as a tensor of shape `size`."""
    n = prod(size)
    # strides that are a permutation of a contiguous layout: shrink, reshape and permute (no gather)
    order = sorted(range(len(size)), key=lambda i: (stride[i], size[i]), reverse=True)
    contiguous, expect = True, 1
    for i in reversed(order):
        if stride[i] != expect: contiguous = False
        expect *= size[i]
    if contiguous:
        t = flat[offset:offset + n].reshape(tuple(size[i] for i in order))
        return t.permute(tuple(order.index(i) for i in range(len(size))))
    # a gather: neighbouring dims that step through memory as one are merged first, so the index has few dims
    msize, mstride = [], []
    for s, st in zip(size, stride):
        if mstride and mstride[-1] == st * s: msize[-1], mstride[-1] = msize[-1] * s, st
        else: msize, mstride = msize + [s], mstride + [st]
    idx = Tensor.full(tuple(msize), offset, dtype=dtypes.int64)
    for d, (s, st) in enumerate(zip(msize, mstride)):
        along = tuple(s if i == d else 1 for i in range(len(msize)))
        idx = idx + Tensor.arange(s, dtype=dtypes.int64).reshape(along) * st
    return flat.contiguous()[idx.flatten()].reshape(tuple(size))

def _rebuild_parameter(data: Any, *args: Any) -> Tensor | _Pending:
    if not isinstance(data, Tensor | _Pending): raise ValueError("torch_load: a parameter holds something not a tensor")
    return data

class _TorchUnpickler(pickle._Unpickler):
    """Unpickles tensor storage and containers only: any other global is refused (a checkpoint can't run code).
    Python's own unpickler rather than the C one: its memo is a dict, where the C one allocates an array up to the
    largest memo index a pickle names (gigabytes for one hostile opcode)."""
    ALLOWED: dict[tuple[str, str], Any] = {
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
        ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter, ("collections", "OrderedDict"): OrderedDict,
        ("torch", "Size"): tuple}

    # protocol 5's out-of-band buffers are refused (a checkpoint has none): BYTEARRAY8 allocates what it declares
    dispatch = {op: fn for op, fn in pickle._Unpickler.dispatch.items()  # type: ignore[attr-defined]
                if op not in (pickle.BYTEARRAY8[0], pickle.NEXT_BUFFER[0], pickle.READONLY_BUFFER[0])}

    def __init__(self, f: Any, storages: Callable[[tuple], _Storage]):
        super().__init__(f)
        self.storages = storages

    def load(self) -> Any:
        try: return super().load()
        except KeyError as e:  # python's unpickler looks opcodes and memo entries up in dicts
            raise ValueError(f"torch_load: the pickle names an unknown opcode or memo entry ({e})") from e

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED: return self.ALLOWED[(module, name)]
        if module == "torch" and name in _TORCH_STORAGES: return _StorageType(_TORCH_STORAGES[name])
        raise ValueError(f"torch_load: refusing to load global {module}.{name} (only tensor storage and containers "
                         "are allowed)")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) > 1 and pid[0] == "storage" and isinstance(pid[1], _StorageType)):
            raise ValueError(f"torch_load: unknown persistent id {pid!r:.80}")
        return self.storages(pid)

def torch_load(t: Any, max_inflated: int | None = None) -> Any:
    """The object saved by torch.save (a state dict, possibly nested) with tensors as fusegrad tensors; both the zip
    format and the legacy format, parsed without importing torch. Deflated members and views larger than their
    storage may expand to max_inflated bytes in all (MAX_INFLATED_BYTES by default)."""
    src, budget = _source(t), _Budget(max_inflated)
    head = bytes(_bytes(src, 0, min(4, _size(src)), "magic"))
    with _malformed("torch_load"):
        if head == b"PK\x03\x04": return _torch_load_zip(src, budget)
        return _torch_load_legacy(src, budget)

def _torch_load_zip(src: _Mapped | memoryview, budget: _Budget) -> Any:
    with _open_zip(src, "torch_load") as zf:
        infos = {info.filename: info for info in zf.infolist()}
        # every record lives in the directory the first one names, as torch's reader expects
        first = zf.infolist()[0].filename if infos else ""
        prefix = first[:first.find("/") + 1]
        if not prefix or f"{prefix}data.pkl" not in infos: raise ValueError("torch_load: the archive has no data.pkl")
        if (stray := next((n for n in infos if not n.startswith(prefix)), None)) is not None:
            raise ValueError(f"torch_load: {stray!r} is outside the archive's directory {prefix!r}")
        def member(name: str, expect: int | None = None) -> memoryview:
            return _read_member(src, infos[name], budget, "torch_load", expect)
        # the records besides the storages are read and checked as torch reads them (each read checks its CRC)
        records = {n[len(prefix):]: bytes(member(n)) for n in infos
                   if n.startswith(prefix) and not n.startswith(f"{prefix}data/")}
        for name, body in records.items():
            if name != "data.pkl" and not body.isascii():
                raise ValueError(f"torch_load: record {name!r} is not text")
        version = records.get(".data/version", records.get("version", b""))
        if not (re.fullmatch(rb"\d{1,4}\n?", version) and 1 <= int(version) <= 10):
            raise ValueError(f"torch_load: unsupported archive version {version!r:.40}")
        if records.get("byteorder", b"little") != b"little":
            raise ValueError(f"torch_load: the checkpoint's byte order is {records['byteorder']!r:.40}, not little")
        if not re.fullmatch(rb"\d{1,8}", records.get(".storage_alignment", b"64")):
            raise ValueError(f"torch_load: bad storage alignment {records['.storage_alignment']!r:.40}")
        raw: dict[str, memoryview] = {}
        cache: dict[tuple[str, DType], _Storage] = {}
        def storage(pid: tuple) -> _Storage:
            key, dtype, numel = _storage_id(pid)
            name = f"{prefix}data/{key}"
            if name not in infos: raise ValueError(f"torch_load: storage {key} is missing from the archive")
            if numel * dtype.itemsize != infos[name].file_size:  # the same bytes may be viewed as several dtypes
                raise ValueError(f"torch_load: storage {key} holds {infos[name].file_size} bytes, not the "
                                 f"{numel} {dtype} its tensor declares")
            if (key, dtype) not in cache:
                def read(k: str = key, m: str = name, nbytes: int = numel * dtype.itemsize) -> memoryview:
                    if k not in raw: raw[k] = member(m, nbytes)
                    return raw[k]
                cache[(key, dtype)] = _Storage(dtype, numel, read, budget)
            return cache[(key, dtype)]
        obj = _TorchUnpickler(io.BytesIO(records["data.pkl"]), storage).load()
        return _materialize(obj)

_MAX_NESTING = 100  # containers within containers in a checkpoint's object (a state dict nests a few)

def _materialize(obj: Any) -> Any:
    """`obj` with each pending tensor built and every tensor realized (while the archive is open to read storages).
    Shared containers are walked once; nesting deeper than _MAX_NESTING (a container holding itself included) is
    refused."""
    done: dict[int, Any] = {}
    tensors: list[Tensor] = []
    def build(x: Any, depth: int) -> Any:
        if id(x) in done: return done[id(x)]
        if depth > _MAX_NESTING:
            raise ValueError(f"torch_load: the object nests containers more than {_MAX_NESTING} deep (or holds itself)")
        out = x
        if isinstance(x, _Pending): out = _build_tensor(*x.args)
        if isinstance(out, Tensor): tensors.append(out)
        elif isinstance(x, dict):
            for k, v in x.items(): x[k] = build(v, depth + 1)
        elif isinstance(x, list): x[:] = [build(v, depth + 1) for v in x]
        elif isinstance(x, tuple | set | frozenset): out = type(x)(build(v, depth + 1) for v in x)
        done[id(x)] = out
        return out
    obj = build(obj, 0)
    if tensors: Tensor.realize(*[t.contiguous() for t in tensors])
    return obj

def _no_storage(pid: tuple) -> _Storage: raise ValueError("torch_load: a storage where none belongs")

_LEGACY_MAGIC, _LEGACY_PROTOCOL = 0x1950a86a20f9469cfc6c, 1001

def _torch_load_legacy(src: _Mapped | memoryview, budget: _Budget) -> Any:
    data = _bytes(src, 0, _size(src), "checkpoint")
    f = io.BytesIO(data)
    def plain_load() -> Any:
        try: return _TorchUnpickler(f, _no_storage).load()
        except (EOFError, pickle.UnpicklingError, ValueError, IndexError) as e:
            raise ValueError(f"torch_load: not a PyTorch checkpoint ({e})") from e
    if plain_load() != _LEGACY_MAGIC: raise ValueError("torch_load: bad magic number: not a PyTorch checkpoint")
    if (version := plain_load()) != _LEGACY_PROTOCOL:
        raise ValueError(f"torch_load: unsupported legacy protocol version {version!r:.40}")
    info = plain_load()
    if not (isinstance(info, dict) and info.get("little_endian") is True):
        raise ValueError("torch_load: the checkpoint is not little-endian")
    storages: dict[str, _Storage] = {}
    def storage(pid: tuple) -> _Storage:
        key, dtype, numel = _storage_id(pid)
        if len(pid) > 5 and pid[5] is not None: raise ValueError(f"torch_load: storage {key} is a view (unsupported)")
        if key not in storages: storages[key] = _Storage(dtype, numel, None, budget)
        if (storages[key].dtype, storages[key].numel) != (dtype, numel):
            raise ValueError(f"torch_load: storage {key} is declared with two types or sizes")
        return storages[key]
    try: obj = _TorchUnpickler(f, storage).load()
    except EOFError as e: raise ValueError("torch_load: the checkpoint is truncated") from e
    keys = plain_load()
    if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys) and len(set(keys)) == len(keys)):
        raise ValueError("torch_load: bad storage key list")
    if set(keys) != set(storages): raise ValueError("torch_load: the storage key list doesn't match the tensors")
    pos = f.tell()
    for key in keys:
        st = storages[key]
        (numel,) = struct.unpack("<q", _bytes(data, pos, pos + 8, f"storage {key} size"))
        if numel != st.numel: raise ValueError(f"torch_load: storage {key} holds {numel} elements, expected {st.numel}")
        nbytes = numel * st.dtype.itemsize
        raw = _bytes(data, pos + 8, pos + 8 + nbytes, f"storage {key}")
        st._read = lambda r=raw: r
        pos += 8 + nbytes
    return _materialize(obj)

# *** GGUF ***

_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
# ggml type -> (elements per block, bytes per block)
_GGML_BLOCKS = {0: (1, 4), 1: (1, 2), 30: (1, 2), 2: (32, 18), 3: (32, 20), 8: (32, 34), 14: (256, 210)}

class _Reader:
    def __init__(self, src: _Mapped | memoryview): self.src, self.pos = src, 0
    def take(self, n: int, what: str) -> memoryview:
        out = _bytes(self.src, self.pos, self.pos + n, f"gguf {what}")
        self.pos += n
        return out
    def scalar(self, fmt: str, what: str) -> Any: return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]
    def string(self) -> str:
        n = self.scalar("<Q", "string length")
        try: return bytes(self.take(n, "string")).decode("utf-8")
        except UnicodeDecodeError as e: raise ValueError(f"gguf: a string at byte {self.pos - n} is not UTF-8") from e
    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype in _GGUF_SCALARS: return self.scalar(_GGUF_SCALARS[vtype], "value")
        if vtype == 8: return self.string()
        if vtype == 9 and depth < 4:
            itype, n = self.scalar("<I", "array type"), self.scalar("<Q", "array length")
            if n > _size(self.src): raise ValueError(f"gguf: array of {n} items is longer than the file")
            return [self.value(itype, depth + 1) for _ in range(n)]
        raise ValueError(f"gguf: unknown value type {vtype}")

def _f16_from_bytes(lo: Tensor, hi: Tensor) -> Tensor:
    """float16 values from their little-endian byte pairs (uint8 tensors), as float32."""
    return (lo.cast(dtypes.uint16) | (hi.cast(dtypes.uint16) << 8)).bitcast(dtypes.float16).float()

def _dequantize(blocks: Tensor, ggml_type: int) -> Tensor:
    """float32 values of (n_blocks, block_bytes) uint8 quantized blocks, computed with tensor ops on the device."""
    nb = blocks.shape[0]
    if ggml_type == 8:  # Q8_0: d, 32 x int8
        d = _f16_from_bytes(blocks[:, 0:1], blocks[:, 1:2])
        return (blocks[:, 2:34].bitcast(dtypes.int8).float() * d).flatten()
    if ggml_type in (2, 3):  # Q4_0: d, 16 bytes of nibbles (value (q-8)*d); Q4_1: d, m, nibbles (value q*d+m)
        d = _f16_from_bytes(blocks[:, 0:1], blocks[:, 1:2])
        qs = blocks[:, 4:20] if ggml_type == 3 else blocks[:, 2:18]
        q = (qs & 15).cat(qs >> 4, dim=1).float()  # low nibbles are elements 0..15, high ones 16..31
        if ggml_type == 2: return ((q - 8) * d).flatten()
        return (q * d + _f16_from_bytes(blocks[:, 2:3], blocks[:, 3:4])).flatten()
    if ggml_type == 14:  # Q6_K: ql[128], qh[64], scales int8[16], d; two halves of 128 values
        ql, qh = blocks[:, 0:128].reshape(nb, 2, 64), blocks[:, 128:192].reshape(nb, 2, 32)
        sc = blocks[:, 192:208].bitcast(dtypes.int8).float().reshape(nb, 2, 4, 2, 1)
        d = _f16_from_bytes(blocks[:, 208:209], blocks[:, 209:210]).reshape(nb, 1, 1, 1, 1)
        lo, hi = ql[:, :, :32], ql[:, :, 32:]
        q = Tensor.stack(lo & 15 | (qh & 3) << 4, hi & 15 | ((qh >> 2) & 3) << 4,
                         lo >> 4 | ((qh >> 4) & 3) << 4, hi >> 4 | ((qh >> 6) & 3) << 4, dim=2)  # (nb, 2, 4, 32)
        return (d * sc * (q.float() - 32).reshape(nb, 2, 4, 2, 16)).flatten()
    raise ValueError(f"gguf: unsupported tensor type {ggml_type}")

def gguf_load(fn: Any) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(metadata, tensors) of a GGUF v2/v3 file; F32, F16, BF16, Q8_0, Q4_0, Q4_1 and Q6_K tensors come back
    dequantized to float32 (except F16 and BF16, kept as they are), in PyTorch's dim order."""
    src = _source(fn)
    with _malformed("gguf"): return _gguf_load(src)

def _gguf_load(src: _Mapped | memoryview) -> tuple[dict[str, Any], dict[str, Tensor]]:
    r = _Reader(src)
    if bytes(r.take(4, "magic")) != b"GGUF": raise ValueError("gguf: bad magic: not a GGUF file")
    version = r.scalar("<I", "version")
    if version not in (2, 3): raise ValueError(f"gguf: unsupported version {version}")
    n_tensors, n_kv = r.scalar("<Q", "tensor count"), r.scalar("<Q", "metadata count")
    # each entry takes at least 8 bytes, so larger counts can't be honest
    if n_tensors > _size(src) // 8 or n_kv > _size(src) // 8:
        raise ValueError(f"gguf: {n_tensors} tensors / {n_kv} metadata entries can't fit in {_size(src)} bytes")
    kv, types = {}, {}
    for _ in range(n_kv):
        key = r.string()
        if key in kv: raise ValueError(f"gguf: metadata key {key!r} appears twice")
        types[key] = r.scalar("<I", "value type")
        kv[key] = r.value(types[key])
    infos, names = [], set()
    for _ in range(n_tensors):
        name, ndim = r.string(), r.scalar("<I", "dims")
        if name in names: raise ValueError(f"gguf: tensor {name!r} appears twice")
        names.add(name)
        if ndim > 8: raise ValueError(f"gguf: tensor {name!r} has {ndim} dims")
        dims = [r.scalar("<Q", "dim") for _ in range(ndim)]
        if not _countable(dims): raise ValueError(f"gguf: tensor {name!r} has dims {dims} past 2**63 elements")
        infos.append((name, tuple(reversed(dims)), r.scalar("<I", "type"), r.scalar("<Q", "offset")))
    align = kv.get("general.alignment", 32)
    if types.get("general.alignment", 4) != 4 or align <= 0 or align & (align - 1):  # a uint32 power of two
        raise ValueError(f"gguf: bad alignment {align!r:.40}")
    data_start = -(-r.pos // align) * align
    tensors, spans = {}, []
    for name, shape, ggml_type, offset in infos:
        if ggml_type not in _GGML_BLOCKS: raise ValueError(f"gguf: tensor {name!r} has unsupported type {ggml_type}")
        per, nbytes_block = _GGML_BLOCKS[ggml_type]
        n = prod(shape)
        if (shape[-1] if shape else 1) % per:
            raise ValueError(f"gguf: tensor {name!r} of shape {shape} has rows that are not whole blocks of {per}")
        start = data_start + offset
        raw = _bytes(src, start, start + n // per * nbytes_block, f"data of tensor {name!r}")
        spans.append((start, start + len(raw), name))
        if ggml_type in (0, 1, 30):
            dt = {0: dtypes.float32, 1: dtypes.float16, 30: dtypes.bfloat16}[ggml_type]
            tensors[name] = _tensor(raw, shape, dt)
        else:
            blocks = _tensor(raw, (n // per, nbytes_block), dtypes.uint8)
            tensors[name] = _dequantize(blocks, ggml_type).reshape(shape)
    spans.sort()
    for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0: raise ValueError(f"gguf: the data of {n0!r} and {n1!r} overlap")
    return kv, tensors

def fs_load(t: Tensor, size: int) -> Tensor:
    """Not available: fusegrad has no content-addressed tensor store."""
    raise NotImplementedError("fs_load: fusegrad has no content-addressed tensor store")

def fs_store(t: Tensor) -> Tensor:
    """Not available: fusegrad has no content-addressed tensor store."""
    raise NotImplementedError("fs_store: fusegrad has no content-addressed tensor store")
