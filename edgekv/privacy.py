"""The one place for the key that seals what the device keeps on flash (``privacy:`` in the config).

Snapshots (edgekv/state.py) — and so the memory of everything seen — are encrypted at rest with AES-256-GCM
(``cryptography``'s AEAD, NIST SP 800-38D) when a key is configured. The key is 32 random bytes, given as a file
(``privacy.key_file``: raw 32 bytes, or 64 hex digits, or base64), an environment variable (``privacy.key_env``:
hex or base64), or a systemd credential (``privacy.key_credential``: the name under ``$CREDENTIALS_DIRECTORY``,
``LoadCredentialEncrypted=`` in the unit keeps it sealed by the TPM or the host key on disk). Make one with
``head -c 32 /dev/urandom > /etc/edgekv/memory.key`` (mode 0400, owned by the service user).

Each sealed file names its key by id (the first 8 bytes of the key's SHA-256), so a wrong key is told from a
damaged file: a wrong or missing key is a one-line error naming the file and the key ids, and the file is left as
it is. Key rotation: put the new key in ``key_file`` and the old one in ``previous_key_files``; files sealed with
the old key still open, every new snapshot is sealed with the new one, and after ``state.every_s`` (two
generations) no file needs the old key any more: remove it from the config.

Sealing is in chunks (``CHUNK`` bytes of plaintext each, 16-byte tag), so a snapshot is written and read one layer
at a time as before, and each chunk is authenticated on its own: nonce = the file's random 8-byte salt + the
chunk's 4-byte index (never reused under one key: a new salt per file), associated data = the file's header and
the chunk's index (a chunk moved, dropped or swapped fails its tag).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("edgekv.privacy")

CHUNK = 1 << 20
TAG = 16
KEY_BYTES = 32


class SealError(ValueError):
    """A key that cannot be loaded or does not open a file; the message names the file (or variable)."""


@dataclass(frozen=True)
class Key:
    material: bytes
    source: str  # where it came from, for messages

    @property
    def id(self) -> bytes:
        return hashlib.sha256(self.material).digest()[:8]


def _decode(raw: bytes, source: str) -> Key:
    text = raw.strip()
    if len(raw) == KEY_BYTES and not all(32 <= b < 127 for b in raw):
        return Key(bytes(raw), source)
    for decode in (lambda t: bytes.fromhex(t.decode()), lambda t: base64.b64decode(t, validate=True)):
        try:
            material = decode(text)
        except (ValueError, binascii.Error, UnicodeDecodeError):
            continue
        if len(material) == KEY_BYTES:
            return Key(material, source)
    raise SealError(f"{source}: not a 256-bit key (32 raw bytes, 64 hex digits or base64 of 32 bytes); make one "
                    "with: head -c 32 /dev/urandom > FILE")


def _read(path: str | Path, source: str) -> Key:
    path = Path(path).expanduser()
    try:
        key = _decode(path.read_bytes(), f"{source} {path}")
        mode = path.stat().st_mode & 0o777
    except FileNotFoundError:
        raise SealError(f"{source} {path}: no such key file") from None
    except PermissionError:
        raise SealError(f"{source} {path}: not readable by this user") from None
    except OSError as exc:  # a directory, an I/O error: said as "[Errno 21] Is a directory: '...'", no key named
        raise SealError(f"{source} {path}: cannot read the key file ({exc.strerror or exc})") from None
    if mode & 0o077:  # `head -c 32 /dev/urandom > FILE` under the usual umask 022 makes it world-readable
        log.warning("%s %s: the key file is readable by other users (mode %o): any local account can read the "
                    "memory it seals; chmod 400 it (owned by the service's user)", source, path, mode)
    return key


class KeyRing:
    """The key new files are sealed with (``current``) and every key files may be opened with."""

    def __init__(self, current: Key | None, previous: list[Key] = ()) -> None:
        self.current = current
        self.keys = {key.id: key for key in ([current] if current else []) + list(previous)}

    @classmethod
    def from_section(cls, section) -> "KeyRing":
        current = None
        if section.key_file:
            current = _read(section.key_file, "privacy.key_file")
        elif section.key_env:
            value = os.environ.get(section.key_env)
            if not value:
                raise SealError(f"privacy.key_env: the environment variable {section.key_env} is not set")
            current = _decode(value.encode(), f"privacy.key_env {section.key_env}")
        elif section.key_credential:
            folder = os.environ.get("CREDENTIALS_DIRECTORY")
            if not folder:
                raise SealError(f"privacy.key_credential {section.key_credential}: no $CREDENTIALS_DIRECTORY (set "
                                "LoadCredential= or LoadCredentialEncrypted= in the systemd unit)")
            current = _read(Path(folder) / section.key_credential, "privacy.key_credential")
        previous = [_read(path, "privacy.previous_key_files") for path in section.previous_key_files]
        return cls(current, previous)

    @property
    def enabled(self) -> bool:
        return self.current is not None

    def key(self, key_id: bytes, what: str) -> Key:
        try:
            return self.keys[key_id]
        except KeyError:
            known = ", ".join(k.hex() for k in self.keys) or "none configured"
            raise SealError(f"{what}: sealed with key {key_id.hex()}, which this deployment does not have (keys: "
                            f"{known}); set privacy.key_file (or previous_key_files) to that key. The file is "
                            "left as it is") from None


class Sealer:
    """AES-256-GCM over numbered chunks of one file (see the module docstring)."""

    HEADER = struct.Struct("<8s8s")  # key id, salt

    def __init__(self, key: Key, salt: bytes | None = None) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self.key = key
        self.salt = os.urandom(8) if salt is None else salt
        self.aead = AESGCM(key.material)
        self.header = self.HEADER.pack(key.id, self.salt)

    @classmethod
    def for_header(cls, header: bytes, keys: KeyRing, what: str) -> "Sealer":
        key_id, salt = cls.HEADER.unpack(header)
        return cls(keys.key(key_id, what), salt)

    def _nonce_aad(self, index: int) -> tuple[bytes, bytes]:
        counter = struct.pack("<I", index)
        return self.salt + counter, self.header + counter

    def seal(self, index: int, plain: bytes) -> bytes:
        nonce, aad = self._nonce_aad(index)
        return self.aead.encrypt(nonce, bytes(plain), aad)

    def open(self, index: int, sealed: bytes, what: str) -> bytes:
        from cryptography.exceptions import InvalidTag

        nonce, aad = self._nonce_aad(index)
        try:
            return self.aead.decrypt(nonce, bytes(sealed), aad)
        except InvalidTag:
            raise SealError(f"{what}: chunk {index} does not authenticate under key {self.key.id.hex()} (damaged, "
                            "or sealed with another key of the same id)") from None


def sealed_size(plain: int) -> int:
    """Bytes of ``plain`` bytes once sealed in chunks."""
    chunks = -(-plain // CHUNK) if plain else 0
    return plain + TAG * chunks


BLOB_MAGIC = b"EDGEKV-SEALBLOB\x01"  # a small file sealed whole: magic, Sealer header, one sealed chunk


def seal_blob(keys: KeyRing, plain: bytes) -> bytes:
    """``plain`` sealed whole with ``keys.current`` under a new random salt (a small file: one chunk, index 0)."""
    sealer = Sealer(keys.current)
    return BLOB_MAGIC + sealer.header + sealer.seal(0, plain)


def blob_key_id(data: bytes) -> str | None:
    """The id of the key a ``seal_blob`` file was sealed with; None when the file is not sealed or is cut short
    before its header ends."""
    header = data[len(BLOB_MAGIC):len(BLOB_MAGIC) + Sealer.HEADER.size]
    if not data.startswith(BLOB_MAGIC) or len(header) != Sealer.HEADER.size:
        return None
    return Sealer.HEADER.unpack(header)[0]


def refuse_unknown_blob_key(keys: KeyRing | None, data: bytes, what: str) -> None:
    """``SealError`` naming ``what`` when ``data`` is sealed whole with a key ``keys`` lacks (a deployment without
    its key: the start stops, the file is left); nothing otherwise — a damaged file is its reader's to set aside."""
    key_id = blob_key_id(data)
    if key_id is not None and (keys is None or key_id not in keys.keys):
        open_blob(keys, data, what)  # raises, naming the file and the key


def open_blob(keys: KeyRing | None, data: bytes, what: str) -> bytes:
    """The plaintext of a ``seal_blob`` file; ``SealError`` naming ``what`` when no key of ``keys`` opens it."""
    if not data.startswith(BLOB_MAGIC):
        raise SealError(f"{what}: not a sealed file")
    if keys is None or not keys.keys:
        raise SealError(f"{what}: sealed (encrypted) and this deployment has no key; set privacy.key_file (or "
                        "key_env, key_credential) to its key. The file is left as it is")
    header = data[len(BLOB_MAGIC):len(BLOB_MAGIC) + Sealer.HEADER.size]
    if len(header) != Sealer.HEADER.size:
        raise SealError(f"{what}: cut short")
    return Sealer.for_header(header, keys, what).open(0, data[len(BLOB_MAGIC) + Sealer.HEADER.size:], what)
