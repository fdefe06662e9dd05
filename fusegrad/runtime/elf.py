"""Whether compiled binaries are whole ELF files: the dynamic loader maps a shared object's segments without looking
at the file's size, so a truncated one (a full disk, a cache entry cut short) must be caught before it is loaded."""
from __future__ import annotations
import struct
from typing import Any

def _table(lib: bytes, fmt: str, offset: int, entsize: int, n: int) -> Any:
    """The n entries of a header table (entries may be longer than the layout this reads)."""
    if entsize == struct.calcsize(fmt): return struct.iter_unpack(fmt, memoryview(lib)[offset:offset + n * entsize])
    return (struct.unpack_from(fmt, lib, offset + i * entsize) for i in range(n))

ET_REL, ET_DYN = 1, 3   # ELF file types: an object file (LLVM's output), a shared object (the C compiler's)

def elf_is_whole(lib: bytes, elf_type: int) -> bool:
    """Whether `lib` is an ELF file of type `elf_type` whose program and section header tables, and the contents its
    loader reads (a shared object's segments, an object file's sections), lie within it. The dynamic loader maps
    segments without looking at the file's size, so a truncated shared object passes dlopen and then crashes the
    process (SIGBUS) when the missing pages are touched."""
    if len(lib) < 52 or lib[:4] != b"\x7fELF" or lib[4] not in (1, 2) or lib[5] not in (1, 2) or lib[6] != 1:
        return False
    wide, end = lib[4] == 2, "<" if lib[5] == 1 else ">"
    if wide and len(lib) < 64: return False
    if struct.unpack_from(end + "H", lib, 16)[0] != elf_type: return False
    phoff, shoff = struct.unpack_from(end + ("QQ" if wide else "II"), lib, 32 if wide else 28)
    phentsize, phnum, shentsize, shnum, shstrndx = struct.unpack_from(end + "HHHHH", lib, 54 if wide else 42)
    # (header sizes and layouts: Elf64_Phdr, Elf64_Shdr / Elf32_Phdr, Elf32_Shdr)
    ph_size, sh_size, ph_fmt, sh_fmt = (56, 64, "IIQQQQQQ", "IIQQQQIIQQ") if wide else (32, 40, "8I", "10I")
    if phnum and (phentsize < ph_size or phoff + phnum * phentsize > len(lib)): return False
    if shnum and (shentsize < sh_size or shoff + shnum * shentsize > len(lib) or shstrndx >= shnum): return False
    loads = 0
    for ph in _table(lib, end + ph_fmt, phoff, phentsize, phnum):
        p_type, offset, filesz, memsz = (ph[0], ph[2], ph[5], ph[6]) if wide else (ph[0], ph[1], ph[4], ph[5])
        if offset + filesz > len(lib): return False
        if p_type == 1:   # PT_LOAD
            if filesz > memsz: return False
            loads += 1
    # (the dynamic loader reads segments only; an object file is loaded by its sections)
    for sh in _table(lib, end + sh_fmt, shoff, shentsize, shnum if elf_type == ET_REL else 0):
        if sh[1] not in (0, 8) and sh[4] + sh[5] > len(lib): return False   # (SHT_NULL, SHT_NOBITS: no contents)
    return loads > 0 if elf_type == ET_DYN else shnum > 0
