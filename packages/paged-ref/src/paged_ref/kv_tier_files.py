"""The disk tier's files: one KV block per file, valid only for the cache that wrote it.

A file is ``MAGIC``, a 4-byte header length, a JSON header and the block's
bytes as stored (every layer's K and V of this rank, scales included). The
header names the cache it belongs to (``fingerprint``: a digest of the
model's identity and weights, dtypes, block size, layer layout, tensor-
parallel rank, format version), the block's key and tokens, and a blake2b
checksum of the bytes: a file from another model or layout, or a truncated
or corrupted one, is refused, never served. Files live in a folder named by
the fingerprint, and are written to a temporary name, then renamed, so a
kill mid-write leaves a ``.tmp`` file that nothing reads.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
MAGIC = b"PAGEDKV\x01"
SUFFIX = ".kvblock"


class BadBlockFile(Exception):
    """A block file that must not be restored (the message says why)."""


def fingerprint(meta: dict[str, Any]) -> str:
    """The digest of what makes a block file valid for this cache (``meta``:
    plain JSON data), the format version included."""
    text = json.dumps({**meta, "format_version": FORMAT_VERSION}, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def block_folder(root: str | Path, fp: str) -> Path:
    """Where this cache's files live under ``root``."""
    return Path(root) / fp


def write_block(folder: Path, fp: str, key: bytes, tokens: tuple[int, ...], payload: bytes) -> None:
    """Write one block atomically (a temporary file, then a rename); raises
    ``OSError`` (a full or read-only disk), leaving no temporary file."""
    header = json.dumps({
        "fingerprint": fp, "key": key.hex(), "tokens": list(tokens), "bytes": len(payload),
        "blake2b": hashlib.blake2b(payload, digest_size=16).hexdigest(),
    }).encode()  # fmt: skip
    path = folder / (key.hex() + SUFFIX)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<I", len(header)) + header)
            f.write(payload)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def _read_header(f: Any, fp: str) -> dict[str, Any]:
    head = f.read(len(MAGIC) + 4)
    if len(head) < len(MAGIC) + 4 or head[: len(MAGIC)] != MAGIC:
        raise BadBlockFile("not a block file of this format version")
    (size,) = struct.unpack("<I", head[len(MAGIC) :])
    try:
        header = json.loads(f.read(size))
    except ValueError as exc:
        raise BadBlockFile(f"unreadable header ({exc})") from exc
    if not isinstance(header, dict) or header.get("fingerprint") != fp:
        raise BadBlockFile("written by another model, dtype, layout, rank or format version")
    return header


def read_block(folder: Path, fp: str, key: bytes, tokens: tuple[int, ...]) -> bytes:
    """The block's bytes, checked (cache, key, tokens, length, checksum);
    ``BadBlockFile`` or ``OSError`` (missing, unreadable) otherwise."""
    with open(folder / (key.hex() + SUFFIX), "rb") as f:
        header = _read_header(f, fp)
        payload = f.read()
    if header.get("key") != key.hex() or tuple(header.get("tokens", ())) != tokens:
        raise BadBlockFile("holds another block")
    if len(payload) != header.get("bytes") or (
        hashlib.blake2b(payload, digest_size=16).hexdigest() != header.get("blake2b")
    ):
        raise BadBlockFile("truncated or corrupted (checksum mismatch)")
    return payload


def scan_blocks(folder: Path, fp: str) -> list[tuple[bytes, tuple[int, ...]]]:
    """``(key, tokens)`` of every file in ``folder`` whose header is this
    cache's, least recently written first; temporary files a dead process
    left (a kill mid-write) are removed. Bodies are checked when fetched."""
    found = []
    for path in folder.glob("*.tmp"):
        pid = path.name.rsplit(".", 2)[-2]
        if not (pid.isdigit() and _alive(int(pid))):
            path.unlink(missing_ok=True)
    for path in folder.glob("*" + SUFFIX):
        try:
            with open(path, "rb") as f:
                header = _read_header(f, fp)
            mtime = path.stat().st_mtime
            found.append((mtime, bytes.fromhex(header["key"]), tuple(header["tokens"])))
        except (OSError, BadBlockFile, KeyError, ValueError, TypeError):
            continue  # another cache's or damaged: never listed, so never restored
    return [(key, tokens) for _, key, tokens in sorted(found)]


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
