"""Who may take part in a run: the allow-list, the allow-file and operator-signed certificates.

An open swarm admits everyone. A closed one (``swarm.allow``, ``swarm.allow_file``
or ``swarm.authority`` set) admits a peer id that is listed, or that holds a
membership certificate for this run and this time signed by the operator's
authority key. Certificates let a swarm grow without handing every member a new
list: the operator signs a peer id once (``gonka-node admit``), the peer carries
the certificate in its heartbeats and serves it to anyone who asks.

Decisions here are pure: ``Membership.admits(peer_id, now)`` reads only what it
was given and what it learned (``learn_cert``); the network code in
``p2p/swarm.py`` gathers certificates and carries the decision out.

A certificate is a msgpack array ``[magic, run_id, peer_id, not_before,
not_after, signature]``; the Ed25519 signature covers the same array without
the signature. Times are Unix seconds (integers).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import datetime, timezone

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from p2p.config import SwarmConfig, _is_peer_id

log = logging.getLogger(__name__)

CERT_MAGIC = "gonka-member-1"
MAX_CERT_BYTES = 512  # a real one is about 200 bytes
MAX_KEY_FILE_BYTES = 4096
MAX_ALLOW_FILE_BYTES = 1 << 20
MAX_LEARNED_CERTS = 4096
AUTHORITY_PREFIX = "ed25519:"
_MAX_TIME = 2**40  # about year 36,800: any time field beyond is garbage
# The allow-file is stat'ed at most this often (seconds).
ALLOW_FILE_CHECK_SECONDS = 1.0


# ---- authority keys ------------------------------------------------------------------


def new_authority() -> tuple[bytes, str]:
    """A new operator key: (private key file contents, public key text for --swarm-authority)."""
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    return pem, authority_text(key.public_key())


def authority_text(public_key: Ed25519PublicKey) -> str:
    """``ed25519:<64 hex digits>``: one shell-safe word."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return AUTHORITY_PREFIX + raw.hex()


def parse_authority(text: str) -> Ed25519PublicKey:
    """The public key of ``authority_text``; ValueError with a short reason."""
    if not isinstance(text, str) or not text.startswith(AUTHORITY_PREFIX):
        raise ValueError(f"expected {AUTHORITY_PREFIX}<64 hex digits> (from gonka-node admit --new-authority)")
    digits = text[len(AUTHORITY_PREFIX):].strip()
    try:
        raw = bytes.fromhex(digits)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise ValueError(f"expected {AUTHORITY_PREFIX} and 64 hex digits, got {len(digits)} characters")
    return Ed25519PublicKey.from_public_bytes(raw)


def load_authority_key(data: bytes) -> Ed25519PrivateKey:
    """The private key of an authority key file; ValueError if it is not one."""
    if len(data) > MAX_KEY_FILE_BYTES:
        raise ValueError("too large for an authority key file")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise ValueError("not an authority key file (a PEM key from gonka-node admit --new-authority)") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError("not an Ed25519 authority key")
    return key


# ---- certificates --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MemberCert:
    """A parsed certificate; ``check_cert`` says whether it is any good."""

    run_id: str
    peer_id: str
    not_before: int
    not_after: int
    signature: bytes
    raw: bytes  # the certificate as received, to pass on unchanged

    def signed_bytes(self) -> bytes:
        return _signed_bytes(self.run_id, self.peer_id, self.not_before, self.not_after)


def _signed_bytes(run_id: str, peer_id: str, not_before: int, not_after: int) -> bytes:
    return msgpack.packb([CERT_MAGIC, run_id, peer_id, not_before, not_after], use_bin_type=True)


def issue_cert(key: Ed25519PrivateKey, run_id: str, peer_id: str, not_before: int, not_after: int) -> bytes:
    """Sign ``peer_id`` into ``run_id`` for [not_before, not_after)."""
    assert _is_peer_id(peer_id) and 0 <= not_before < not_after < _MAX_TIME
    signature = key.sign(_signed_bytes(run_id, peer_id, not_before, not_after))
    data = msgpack.packb([CERT_MAGIC, run_id, peer_id, not_before, not_after, signature], use_bin_type=True)
    assert len(data) <= MAX_CERT_BYTES
    return data


def _is_time(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _MAX_TIME


def parse_cert(data: bytes) -> MemberCert:
    """Check a certificate's shape (sizes, types); ValueError with a short reason."""
    if not isinstance(data, (bytes, bytearray)) or not data:
        raise ValueError("empty")
    if len(data) > MAX_CERT_BYTES:
        raise ValueError(f"larger than {MAX_CERT_BYTES} bytes")
    try:
        items = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, max_str_len=MAX_CERT_BYTES,
                                max_bin_len=MAX_CERT_BYTES, max_array_len=8, max_map_len=0, max_ext_len=0)
    except Exception:
        raise ValueError("not msgpack") from None
    if not isinstance(items, list) or len(items) != 6 or items[0] != CERT_MAGIC:
        raise ValueError("not a membership certificate")
    _, run_id, peer_id, not_before, not_after, signature = items
    if not isinstance(run_id, str) or not 1 <= len(run_id) <= 64:
        raise ValueError("bad run id")
    if not _is_peer_id(peer_id):
        raise ValueError("bad peer id")
    if not (_is_time(not_before) and _is_time(not_after) and not_before < not_after):
        raise ValueError("bad validity period")
    if not isinstance(signature, bytes) or len(signature) != 64:
        raise ValueError("bad signature")
    return MemberCert(run_id, peer_id, not_before, not_after, signature, bytes(data))


def check_cert(cert: MemberCert, authority: Ed25519PublicKey, run_id: str, now: float) -> str:
    """Why ``cert`` does not admit its peer to ``run_id`` at ``now``, or "" if it does."""
    if cert.run_id != run_id:
        return f"issued for run {cert.run_id!r}, not {run_id!r}"
    if now < cert.not_before:
        return f"valid only from {_iso(cert.not_before)}"
    if now >= cert.not_after:
        return f"expired at {_iso(cert.not_after)}"
    try:
        authority.verify(cert.signature, cert.signed_bytes())
    except InvalidSignature:
        return "not signed by the swarm authority"
    return ""


def _iso(t: int) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---- allow-file ----------------------------------------------------------------------


def parse_allow_file(text: str) -> frozenset[str]:
    """Peer ids, one per line; blank lines and ``#`` comments ignored; ValueError naming a bad line."""
    found = set()
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if not _is_peer_id(line):
            raise ValueError(f"line {number}: not a peer id: {line[:60]!r}")
        found.add(line)
    return frozenset(found)


def _read_allow_file(path: str) -> tuple[frozenset[str], tuple[int, int]]:
    """(peer ids, (mtime_ns, size)); OSError or ValueError."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        data = f.read(MAX_ALLOW_FILE_BYTES + 1)
    if len(data) > MAX_ALLOW_FILE_BYTES:
        raise ValueError(f"larger than {MAX_ALLOW_FILE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    return parse_allow_file(text), (st.st_mtime_ns, st.st_size)


# ---- the decision --------------------------------------------------------------------


class Membership:
    """Admission decisions of one run. Build with ``Membership.load``.

    ``admits(peer_id, now)`` is the one question; ``learn_cert`` feeds it the
    certificates other peers present (heartbeats, the member stream)."""

    def __init__(self, run_id: str, *, closed: bool, peer_id: str = "", allow: frozenset[str] = frozenset(),
                 allow_file: str = "", authority: Ed25519PublicKey | None = None, own_cert: bytes = b"") -> None:
        self.run_id = run_id
        self.closed = closed
        self.peer_id = peer_id  # this node: always admitted
        self.allow = allow
        self.allow_file = allow_file
        self.authority = authority
        self.own_cert = own_cert  # this node's certificate, b"" without one
        self._file_ids: frozenset[str] = frozenset()
        self._file_stamp: tuple[int, int] | None = None
        self._file_checked_at = float("-inf")
        self._file_problem = ""  # the last reload problem, logged once
        self._certs: dict[str, MemberCert] = {}

    @classmethod
    def load(cls, config: SwarmConfig, run_id: str, peer_id: str, now: float) -> "Membership":
        """Read the allow-file, the authority key and this node's certificate. ValueError naming
        the setting (``swarm.member_cert: ...``) if any is unusable."""
        authority = None
        if config.authority:
            try:
                authority = parse_authority(config.authority)
            except ValueError as exc:
                raise ValueError(f"swarm.authority: {exc}") from None
        self = cls(run_id, closed=config.closed, peer_id=peer_id, allow=frozenset(config.allow),
                   allow_file=config.allow_file, authority=authority)
        if config.allow_file:
            try:
                self._file_ids, self._file_stamp = _read_allow_file(config.allow_file)
            except OSError as exc:
                raise ValueError(f"swarm.allow_file: {config.allow_file}: cannot read: {exc.strerror or exc}") from None
            except ValueError as exc:
                raise ValueError(f"swarm.allow_file: {config.allow_file}: {exc}") from None
            self._file_checked_at = now
        if config.member_cert:
            self.own_cert = self._load_own_cert(config.member_cert, now)
        return self

    def _load_own_cert(self, path: str, now: float) -> bytes:
        def bad(why: str) -> ValueError:
            return ValueError(f"swarm.member_cert: {path}: {why}")

        try:
            with open(path, "rb") as f:
                data = f.read(MAX_CERT_BYTES + 1)
        except OSError as exc:
            raise bad(f"cannot read: {exc.strerror or exc}") from None
        try:
            cert = parse_cert(data)
        except ValueError as exc:
            raise bad(f"not a membership certificate ({exc})") from None
        if cert.peer_id != self.peer_id:
            raise bad(f"issued to peer {cert.peer_id}, this node is {self.peer_id} "
                      "(start with the --identity it was issued for)")
        assert self.authority is not None  # SwarmConfig requires an authority with a member_cert
        why = check_cert(cert, self.authority, self.run_id, now)
        if why:
            raise bad(why)
        return cert.raw

    def admits(self, peer_id: str, now: float) -> tuple[bool, str]:
        """Whether ``peer_id`` may take part in the run at ``now``, and why (or why not)."""
        if not self.closed:
            return True, "open swarm"
        if peer_id == self.peer_id:
            return True, "this node"
        if peer_id in self.allow:
            return True, "swarm.allow"
        if self.allow_file and peer_id in self._allow_file_ids(now):
            return True, "swarm.allow_file"
        cert = self._certs.get(peer_id)
        if cert is None:
            return False, "not listed and no certificate"
        if not cert.not_before <= now < cert.not_after:
            return False, "certificate not valid now"
        return True, "certificate"

    def learn_cert(self, data: bytes, now: float) -> str:
        """Remember a certificate a peer presented; returns why it was refused, or ""."""
        if self.authority is None:
            return "no swarm authority"
        try:
            cert = parse_cert(data)
        except ValueError as exc:
            return str(exc)
        known = self._certs.get(cert.peer_id)
        if known is not None and known.raw == cert.raw:
            return ""
        why = check_cert(cert, self.authority, self.run_id, now)
        if why:
            return why
        if known is not None and known.not_after > cert.not_after:
            return ""  # keep the one that lasts longer
        self._certs.pop(cert.peer_id, None)
        self._certs[cert.peer_id] = cert
        while len(self._certs) > MAX_LEARNED_CERTS:
            del self._certs[next(iter(self._certs))]  # the least recently learned
        return ""

    def _allow_file_ids(self, now: float) -> frozenset[str]:
        """The allow-file's peer ids, re-read when its mtime or size changed (checked at most
        once a second). A file that became unreadable or invalid keeps the last good list."""
        if now - self._file_checked_at < ALLOW_FILE_CHECK_SECONDS:
            return self._file_ids
        self._file_checked_at = now
        try:
            st = os.stat(self.allow_file)
            if (st.st_mtime_ns, st.st_size) != self._file_stamp:
                self._file_ids, self._file_stamp = _read_allow_file(self.allow_file)
                log.info("swarm.allow_file: %s re-read: %d peer ids", self.allow_file, len(self._file_ids))
                self._file_problem = ""
        except (OSError, ValueError) as exc:
            problem = str(exc)
            if problem != self._file_problem:
                self._file_problem = problem
                log.warning("swarm.allow_file: %s: %s; keeping the last good list (%d peer ids)",
                            self.allow_file, problem, len(self._file_ids))
        return self._file_ids
