"""Owner-bound DHT records: what a node accepts under the run's keys, and how it signs its own.

hivemind's DHT keeps, under each subkey, whichever entry expires later, from
any writer (docs/design.md, known hivemind behaviour). Left alone, anyone could
overwrite another peer's heartbeat or block the whole peer table with a plain
value. ``RunRecordValidator`` is handed to ``DHTNode.create`` and checks every
record this node is asked to store and every record a lookup returns:

- only the run's keys (``gonka:<run>:peers``) are accepted; under the peer
  table only entries whose subkey is a peer id, never a plain value;
- each entry carries its owner's libp2p public key (the RSA identity key p2pd
  uses) and a signature over key, subkey, value and expiration time; the peer
  id derived from that key must be the subkey, so only the owner can write it;
- the expiration time may be at most ``max_ttl`` ahead. Together with
  hivemind keeping the later expiration, a replayed older entry never
  replaces a newer one, and no entry outlives its owner by more than that;
- in a closed swarm the owner must be admitted (``p2p/membership.py``); an
  entry may carry the owner's membership certificate, which is learned.

Signed value layout (msgpack array): ``[value, public_key, signature, cert]``;
the signature (RSASSA-PKCS1-v1_5, SHA-256, as libp2p signs with RSA keys)
covers ``[MAGIC, key, subkey, value, expiration_time, public_key, cert]``.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from typing import Callable

import msgpack
import multihash
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from p2p.membership import Membership

log = logging.getLogger(__name__)

MAGIC = "gonka-record-1"
MAX_VALUE_BYTES = 64 * 1024  # a heartbeat is about 1-2 KB
MAX_PUBLIC_KEY_BYTES = 1024  # RSA-4096 is ~550 bytes serialized
_CACHE_SIZE = 4096
# Allowed on top of 3 heartbeat intervals: clock skew between hosts and a slow store.
EXPIRY_SLACK_SECONDS = 10.0


@functools.lru_cache(maxsize=_CACHE_SIZE)
def rsa_public_key(public_key: bytes) -> rsa.RSAPublicKey | None:
    """The serialized libp2p RSA ``public_key`` (``crypto_pb2.PublicKey``), parsed; None unless it
    is an RSA key of 2048 to 4096 bits. Cached: peers sign with the same few keys over and over."""
    try:
        message = crypto_pb2.PublicKey.FromString(public_key)
        if message.key_type != crypto_pb2.RSA:
            return None
        key = serialization.load_der_public_key(message.data)
    except Exception:  # a key that does not even parse
        return None
    return key if isinstance(key, rsa.RSAPublicKey) and 2048 <= key.key_size <= 4096 else None


def verify_rsa(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is the PKCS#1 v1.5 SHA-256 signature (as libp2p signs with RSA keys)
    of ``message`` by ``public_key`` (see ``rsa_public_key``); False for anything malformed."""
    key = rsa_public_key(public_key)
    if key is None:
        return False
    try:
        key.verify(signature, message, padding.PKCS1v15(), hashes.SHA256())
    except (InvalidSignature, TypeError, ValueError):
        return False
    return True


def peer_table_key(run_id: str) -> str:
    """The DHT key of the run's live peer table (one subkey per peer id)."""
    return f"gonka:{run_id}:peers"


def max_ttl(heartbeat_interval: float) -> float:
    """How far ahead a heartbeat may expire: 3 intervals (a peer silent for 3 is gone) + slack."""
    return 3 * heartbeat_interval + EXPIRY_SLACK_SECONDS


def _key_id(key: str) -> bytes:
    return DHTID.generate(source=key).to_bytes()


def peer_id_of_public_key(public_key: bytes) -> str:
    """The base58 libp2p peer id of a serialized ``crypto_pb2.PublicKey`` (sha2-256 multihash)."""
    return PeerID(multihash.encode(hashlib.sha256(public_key).digest(), "sha2-256")).to_base58()


class RecordSigner:
    """This node's libp2p RSA key, read from the identity file p2pd uses."""

    def __init__(self, private_key: rsa.RSAPrivateKey) -> None:
        self._key = private_key
        der = private_key.public_key().public_bytes(serialization.Encoding.DER,
                                                    serialization.PublicFormat.SubjectPublicKeyInfo)
        self.public_key = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
        self.peer_id = peer_id_of_public_key(self.public_key)

    @classmethod
    def from_identity(cls, data: bytes) -> "RecordSigner":
        """From the contents of an identity key file (``p2p/identity.py``)."""
        message = crypto_pb2.PrivateKey.FromString(data)
        if message.key_type != crypto_pb2.RSA:
            raise ValueError("not an RSA libp2p key")
        key = serialization.load_der_private_key(message.data, password=None)
        if not isinstance(key, rsa.RSAPrivateKey):
            raise ValueError("not an RSA libp2p key")
        return cls(key)

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data, padding.PKCS1v15(), hashes.SHA256())


def _signed_message(key: bytes, subkey: bytes, value: bytes, expiration: float, public_key: bytes,
                    cert: bytes) -> bytes:
    return msgpack.packb([MAGIC, key, subkey, value, float(expiration), public_key, cert], use_bin_type=True)


def _no_ext(code, data):
    raise ValueError("ext type")


def _unpack(data: bytes, max_len: int):
    return msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_no_ext, max_bin_len=max_len,
                           max_str_len=max_len, max_array_len=1024, max_map_len=1024)


class RecordRefused(Exception):
    """Why a record was refused; ``reason`` is a metric label from a fixed set."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class RunRecordValidator(RecordValidatorBase):
    """Accepts only owner-signed peer-table entries of one run; signs this node's own."""

    def __init__(self, run_id: str, signer: RecordSigner, membership: Membership, max_ttl: float, *,
                 on_reject: Callable[[str], None] = lambda reason: None,
                 clock: Callable[[], float] = get_dht_time) -> None:
        self.run_id = run_id
        self.signer = signer
        self.membership = membership
        self.max_ttl = max_ttl
        self.on_reject = on_reject
        self.clock = clock
        self.peers_key = _key_id(peer_table_key(run_id))
        self._own_subkey = MSGPackSerializer.dumps(signer.peer_id)
        self._verified: dict[bytes, None] = {}  # digests of records whose signature checked out

    # ---- RecordValidatorBase ---------------------------------------------------------

    def validate(self, record: DHTRecord) -> bool:
        try:
            self.check(record)
            return True
        except RecordRefused as e:
            self.on_reject(e.reason)
        except Exception as e:  # whatever a peer sends, never an error in the DHT
            log.debug("record check failed: %r", e)
            self.on_reject("record_malformed")
        return False

    def sign_value(self, record: DHTRecord) -> bytes:
        if record.key != self.peers_key or record.subkey != self._own_subkey:
            return record.value  # not ours to sign; validate() refuses it
        cert = self.membership.own_cert
        public_key = self.signer.public_key
        signature = self.signer.sign(_signed_message(record.key, record.subkey, record.value,
                                                     record.expiration_time, public_key, cert))
        return msgpack.packb([record.value, public_key, signature, cert], use_bin_type=True)

    def strip_value(self, record: DHTRecord) -> bytes:
        try:
            return _unpack(record.value, MAX_VALUE_BYTES)[0]
        except Exception:
            return record.value

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False

    # ---- the rules -------------------------------------------------------------------

    def check(self, record: DHTRecord) -> str:
        """The owner's peer id if ``record`` is acceptable; RecordRefused with the reason otherwise."""
        if record.key != self.peers_key:
            raise RecordRefused("record_other_key")
        if record.subkey in (b"", MSGPackSerializer.dumps(None)):
            raise RecordRefused("record_plain_value")
        if len(record.value) > MAX_VALUE_BYTES + MAX_PUBLIC_KEY_BYTES + 2048:
            raise RecordRefused("record_oversized")
        try:
            envelope = _unpack(record.value, MAX_VALUE_BYTES)
            if not (isinstance(envelope, list) and len(envelope) == 4 and all(isinstance(x, bytes) for x in envelope)):
                raise ValueError("not a signed value")
            value, public_key, signature, cert = envelope
        except Exception:
            raise RecordRefused("record_unsigned") from None
        if len(public_key) > MAX_PUBLIC_KEY_BYTES or len(signature) > 1024:
            raise RecordRefused("record_unsigned")
        owner = peer_id_of_public_key(public_key)
        if MSGPackSerializer.dumps(owner) != record.subkey:
            raise RecordRefused("record_foreign_key")
        now = self.clock()
        if not record.expiration_time <= now + self.max_ttl:
            raise RecordRefused("record_far_expiry")
        digest = hashlib.sha256(_signed_message(record.key, record.subkey, value, record.expiration_time,
                                                public_key, cert) + signature).digest()
        if digest in self._verified:
            self._verified[digest] = self._verified.pop(digest)
        else:
            self._verify(public_key, signature, record, value, cert)
            self._remember(self._verified, digest, None)
        if self.membership.closed:
            admitted, _ = self.membership.admits(owner, now)
            if not admitted and cert:
                self.membership.learn_cert(cert, now)
                admitted, _ = self.membership.admits(owner, now)
            if not admitted:
                raise RecordRefused("not_admitted")
        return owner

    def _verify(self, public_key: bytes, signature: bytes, record: DHTRecord, value: bytes, cert: bytes) -> None:
        if not verify_rsa(public_key, _signed_message(record.key, record.subkey, value, record.expiration_time,
                                                      public_key, cert), signature):
            raise RecordRefused("record_bad_signature")
        try:  # the value reaches hivemind's deserializer after strip_value: it must load as a map
            if not isinstance(_unpack(value, MAX_VALUE_BYTES), dict):
                raise ValueError("not a map")
        except Exception:
            raise RecordRefused("record_malformed") from None

    @staticmethod
    def _remember(cache: dict, key, value) -> None:
        cache[key] = value
        while len(cache) > _CACHE_SIZE:
            del cache[next(iter(cache))]
