"""libp2p identity key files: a node's peer id survives restarts.

The file holds a serialized ``crypto_pb2.PrivateKey`` (RSA, as hivemind's own
``P2P.generate_identity`` writes it), the format p2pd's ``-id`` flag reads.
Losing or mangling it would give the node a new peer id, so it is created
atomically, never overwritten, and a file that does not parse is an error
rather than a reason to make a new key.
"""

from __future__ import annotations

import os

from hivemind.p2p.p2p_daemon_bindings.datastructures import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from trainer.files import atomic_write

# Real key files are about 1.2 KB; a much larger file is not one.
_MAX_KEY_BYTES = 64 * 1024


def generate_identity() -> bytes:
    """A new RSA private key, serialized as a key file's contents."""
    key = RSAPrivateKey()
    return crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=key.to_bytes()).SerializeToString()


def peer_id_from_key(data: bytes) -> str:
    """The base58 peer id of a serialized private key; ValueError if it is not one."""
    try:
        message = crypto_pb2.PrivateKey.FromString(data)
    except Exception as exc:
        raise ValueError(f"not a libp2p private key ({exc})") from None
    if message.key_type != crypto_pb2.KeyType.RSA or not message.data:
        raise ValueError("not an RSA libp2p private key")
    try:
        return PeerID.from_identity(data).to_base58()
    except Exception as exc:
        raise ValueError(f"not a valid RSA private key ({exc})") from None


def peer_id_of(path: str) -> str:
    """The peer id of an existing key file; ValueError("node.identity: ...") if unreadable or corrupt."""
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_KEY_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"node.identity: {path}: cannot read: {exc.strerror or exc}") from None
    if len(data) > _MAX_KEY_BYTES:
        raise ValueError(f"node.identity: {path}: larger than {_MAX_KEY_BYTES} bytes, not a key file")
    try:
        return peer_id_from_key(data)
    except ValueError as exc:
        raise ValueError(f"node.identity: {path}: {exc}") from None


def load_or_create_identity(path: str) -> str:
    """Return the peer id of the key at `path`, creating the key file first if there is none."""
    if not os.path.lexists(path):
        try:
            key = generate_identity()
            # The temporary file is created 0600: the key is never readable by others.
            atomic_write(path, lambda f: f.write(key), overwrite=False)
        except FileExistsError:
            # Another process created it first; use theirs.
            pass
        except OSError as exc:
            raise ValueError(f"node.identity: {path}: cannot create: {exc.strerror or exc}") from None
    return peer_id_of(path)
