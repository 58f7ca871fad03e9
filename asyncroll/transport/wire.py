"""Control messages between a weight sender and its receivers, and how they are sealed.

A message travels as two ZeroMQ frames: ``[mac, body]``. ``body`` is msgpack (msgspec) of one of
the typed structs below; ``mac`` is HMAC-SHA256 of ``body`` under a key derived from the job secret
and the direction of travel, so a message can be neither forged nor reflected back to its sender.

Invariants:

* nothing is decoded before its MAC checks out (constant-time compare);
* decoding is msgspec into the structs below, never pickle;
* every message names its connection (a random nonce the receiver picks at hello) and carries a
  sequence number one above the last one accepted on that connection, so a replayed or reordered
  message is rejected as surely as a forged one.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Final

import msgspec

from asyncroll.errors import TransportAuthError

__all__ = [
    "MAC_BYTES",
    "Ack",
    "Bucket",
    "Bye",
    "End",
    "Entry",
    "Hello",
    "Message",
    "Ready",
    "Sealer",
    "Shared",
    "SharedEntry",
    "Welcome",
]

MAC_BYTES: Final = 32
REJECT: Final = b"asyncroll-reject"
"""Unauthenticated one-frame answer to a peer that failed authentication (it carries no data)."""
_TO_SENDER: Final = b"asyncroll/v1/to-sender"
_TO_RECEIVER: Final = b"asyncroll/v1/to-receiver"


class Hello(msgspec.Struct, tag=True, frozen=True):
    """Receiver -> sender: first message of a connection."""

    conn: bytes
    seq: int
    name: str
    pid: int


class Welcome(msgspec.Struct, tag=True, frozen=True):
    """Sender -> receiver: how to import the staging buffers."""

    conn: bytes
    seq: int
    backend: str
    bucket_bytes: int
    buffers: list[bytes]
    copy_events: list[bytes] = []
    """One device-event handle per buffer that the sender records after queuing a bucket's
    copies into it: a receiver that can poll them is signalled while the copies still run
    (``Bucket.copying``). Empty: every bucket is signalled once its copies are done."""


class Ready(msgspec.Struct, tag=True, frozen=True):
    """Receiver -> sender: every staging buffer is mapped (the sender may now unlink names).

    ``events``: one device-event handle per buffer that the receiver records after loading it;
    the sender polls it before copying into that buffer again. Empty: the receiver syncs before
    acking.
    """

    conn: bytes
    seq: int
    events: list[bytes] = []
    polls_copies: bool = False
    """The receiver opened the welcome's copy events and polls them before reading a bucket."""


class Entry(msgspec.Struct, array_like=True, frozen=True):
    """One slot of a bucket, as it travels."""

    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int
    start: int
    total: int
    spanning: bool
    part: list[int] = []
    """Empty, or the tensor is a piece of a larger one: ``[offset, *whole_shape]``
    (``plan.Part``)."""
    columns: list[int] = []
    """Empty, or the piece's ``[first, end)`` columns (``plan.Part.columns``)."""


class Bucket(msgspec.Struct, tag=True, frozen=True):
    """Sender -> receiver: buffer ``buffer`` holds bucket ``index`` of push ``push``."""

    conn: bytes
    seq: int
    push: int
    version: int
    index: int
    buffer: int
    entries: list[Entry]
    completes: list[str]
    copying: bool = False
    """The copies into the buffer may still run: read it once its copy event has fired."""


class SharedEntry(msgspec.Struct, array_like=True, frozen=True):
    """One tensor of a shared push: ``nbytes`` at byte ``offset`` of storage ``storage``."""

    name: str
    dtype: str
    shape: list[int]
    storage: int
    offset: int
    nbytes: int


class Storage(msgspec.Struct, array_like=True, frozen=True):
    """One of the trainer's storages, exported for a shared push (``id`` is stable while the
    sender keeps the storage: a receiver maps a descriptor once)."""

    id: int
    descriptor: bytes
    nbytes: int


class Shared(msgspec.Struct, tag=True, frozen=True):
    """Sender -> receiver: all of push ``push``, read in place from the trainer's tensors
    (one-copy mode). ``storages`` lists every storage the entries use; a receiver maps those it
    has not mapped yet and releases the ones it holds that are not listed. One ack answers it,
    sent once the receiver's reads are finished on the device.

    ``layout`` is the sender's id of this list of storages and entries (a new one for each
    list it builds). ``repeat``: the list is the one of that id, which the receiver's last ack
    said it holds (``Ack.layout``), so ``storages`` and ``entries`` are left empty: a trainer
    that pushes the same tensors every step sends 150 KB less (7B), which the receiver would
    check and decode before its first copy."""

    conn: bytes
    seq: int
    push: int
    version: int
    storages: list[Storage]
    entries: list[SharedEntry]
    layout: int = 0
    repeat: bool = False


class Ack(msgspec.Struct, tag=True, frozen=True):
    """Receiver -> sender: buffer of bucket ``index`` may be reused; ``error`` if loading failed."""

    conn: bytes
    seq: int
    push: int
    index: int
    error: str = ""
    tensor: str = ""
    layout: int = 0
    """The one-copy list (``Shared.layout``) the receiver holds now, mapped and viewed; 0:
    none."""


class End(msgspec.Struct, tag=True, frozen=True):
    """Sender -> receiver: push ``push`` is over; every receiver loaded it unless ``error``."""

    conn: bytes
    seq: int
    push: int
    version: int
    buckets: int
    error: str = ""
    fingerprints: dict[str, bytes] = {}
    """Fingerprints not sent in a ``Prints`` (empty: sent there, or not fingerprinted)."""
    verdict: bool = False
    """The sender waits for each receiver's ``Verdict``: its check of what it loaded."""


class Prints(msgspec.Struct, tag=True, frozen=True):
    """Sender -> receiver: the sender's fingerprint of each tensor of push ``push``
    (``asyncroll.fingerprints``), for the receiver to check what it loaded against. Sent once
    a push, after the signal of its middle bucket (after a shared push's one message), so that
    the receiver decodes it while it waits for the next bucket, not after the last one."""

    conn: bytes
    seq: int
    push: int
    fingerprints: dict[str, bytes]


class Verdict(msgspec.Struct, tag=True, frozen=True):
    """Receiver -> sender: what its check of push ``push`` found, where the End asked for it
    (``End.verdict``); ``error`` is empty when the check passed."""

    conn: bytes
    seq: int
    push: int
    error: str = ""


class Bye(msgspec.Struct, tag=True, frozen=True):
    """Receiver -> sender: mappings released, connection closing."""

    conn: bytes
    seq: int


Message = Hello | Welcome | Ready | Bucket | Shared | Ack | Prints | End | Verdict | Bye

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)


class Sealer:
    """Signs outgoing and checks incoming messages for one side of the transport.

    Holds the keys; never prints them (``__repr__`` shows the role only).
    """

    __slots__ = ("_in_key", "_out_key", "_role")

    def __init__(self, secret: bytes, *, role: str) -> None:
        if len(secret) < 16:
            raise ValueError("the job secret must be at least 16 bytes")
        if role not in ("sender", "receiver"):
            raise ValueError(f"role must be 'sender' or 'receiver', got {role!r}")
        to_sender = _derive(secret, _TO_SENDER)
        to_receiver = _derive(secret, _TO_RECEIVER)
        self._role = role
        self._out_key, self._in_key = (
            (to_receiver, to_sender) if role == "sender" else (to_sender, to_receiver)
        )

    def __repr__(self) -> str:
        return f"<Sealer role={self._role}>"

    def seal(self, message: Message) -> list[bytes]:
        body = _ENCODER.encode(message)
        return [hmac.digest(self._out_key, body, hashlib.sha256), body]

    def open(self, frames: list[bytes]) -> Message:
        """Check the MAC, then decode.

        Raises:
            TransportAuthError: wrong shape, wrong MAC, or (after a good MAC) a malformed body.
        """
        if len(frames) != 2 or len(frames[0]) != MAC_BYTES:
            raise TransportAuthError("malformed frames")
        mac, body = frames
        if not hmac.compare_digest(mac, hmac.digest(self._in_key, body, hashlib.sha256)):
            raise TransportAuthError("bad MAC")
        try:
            message: Message = _DECODER.decode(body)
            return message
        except msgspec.DecodeError as exc:
            raise TransportAuthError(f"authenticated but malformed body: {exc}") from exc


def _derive(secret: bytes, label: bytes) -> bytes:
    return hmac.digest(secret, label, hashlib.sha256)
