"""The one exception hierarchy of kvxfer: every error says what, where and the bad value."""

from __future__ import annotations


class KvxferError(Exception):
    """Base class of every error kvxfer raises on purpose."""


# --- configuration and layouts -------------------------------------------------------------------
class ConfigError(KvxferError, ValueError):
    """A configuration field is invalid; the message names the field and the bad value."""


class ConfigContractError(ConfigError, AssertionError):
    """A configuration the reference design rejects with an assertion (for example recurrent layers
    without ``commit_min_snapshot``); a ConfigError that is also an AssertionError."""


class LayoutError(KvxferError, ValueError):
    """A layout descriptor is malformed or inconsistent (overlapping slots, bad offsets, ...)."""


class LayoutMismatch(LayoutError):
    """Two layouts cannot be paired; the message names the field and both values."""


class IndexMathError(KvxferError, ValueError):
    """An integer helper got operands it cannot combine (``exact_div`` of a non-multiple, ...)."""


class DecodeError(KvxferError, ValueError):
    """Bytes from a peer or a file could not be decoded into the expected structure."""


# --- cache manager -------------------------------------------------------------------------------
class KVCacheError(KvxferError):
    """Misuse of a KV cache or the cache manager."""


class CacheClosedError(KVCacheError):
    """An operation on a KV cache that was already closed."""


class CacheStateError(KVCacheError):
    """An operation that the cache's current lifecycle state does not allow."""


class ScratchInUseError(CacheStateError, ValueError):
    """Turning sliding-window scratch reuse off while the current step's blocks need scratch slots
    (a ValueError, as the reference design raises for it)."""


class CapacityError(KVCacheError, ValueError):
    """A token count outside what the cache holds (commit past capacity, negative sizes, ...)."""


class OutOfMemoryError(KVCacheError):
    """A cache tier cannot hold what was asked for (the reference design's ``OutOfMemoryError``)."""


class OutOfPagesError(OutOfMemoryError):
    """No page can be found for a request, even after eviction (the reference's ``OutOfPagesError``)."""


class OutOfSlotsError(OutOfPagesError):
    """No free slot is left in a pool group (after eviction)."""


class CuError(KVCacheError):
    """A CUDA driver call failed; ``error_code`` is the driver's own status (the reference's CuError)."""

    def __init__(self, message: str, error_code: object = None) -> None:
        super().__init__(message)
        self.error_code = error_code


class LogicError(KVCacheError, RuntimeError):
    """A call the manager's state forbids (e.g. clearing reusable blocks while caches are open)."""


class ContractError(LogicError, AssertionError):
    """A call breaking a precondition the reference design asserts (for example a commit that neither
    starts nor ends at ``history_length`` under ``commit_min_snapshot``); also an AssertionError, as
    the reference raises one there."""


class CorruptedError(KVCacheError):
    """The manager found one of its invariants broken; every later public call raises this."""


class ManagerBusyError(LogicError):
    """The manager cannot do this while KV caches are open (shutdown, quota resize, ...)."""


class BlockIdError(KVCacheError, IndexError):
    """A block id outside a pool group's slots."""


class ReadOnlyPageError(BlockIdError):
    """A transfer would write a destination page that is read-only (committed, possibly shared with the
    prefix tree); the message names the block, the slot and the tokens."""


class TierError(KVCacheError):
    """A storage tier cannot be used (missing disk path, quota too small, ...)."""


# --- page tables ---------------------------------------------------------------------------------
class PageTableError(KvxferError, ValueError):
    """A page table is malformed, undecodable, or points outside registered memory."""


# --- transport -----------------------------------------------------------------------------------
class TransportError(KvxferError):
    """Base class of transport failures; messages name the peer and the transfer."""


class BackendUnavailable(TransportError):
    """An optional transport backend is not installed or cannot run on this machine."""


class TransferTimeout(TransportError, TimeoutError):
    """A transfer did not complete within its deadline."""


class TransferCancelled(TransportError):
    """A transfer was cancelled before it completed."""


class PeerUnreachable(TransportError):
    """A peer is unknown, disconnected, or died."""


class TransferFailed(TransportError):
    """A transfer failed for a reason other than timeout, cancellation or a lost peer."""


# --- control plane and serving -------------------------------------------------------------------
class ProtocolError(KvxferError):
    """A control-plane message is malformed, unexpected, or of an unsupported version."""


class HandshakeRefused(ProtocolError):
    """A peer was refused during the handshake; the message carries the reason."""


class AuthenticationError(HandshakeRefused):
    """A peer failed mutual authentication."""


class ControlTimeout(KvxferError, TimeoutError):
    """No control-plane message (reply, handshake step, request) arrived within its deadline."""


class IntegrityError(KvxferError):
    """Bytes that arrived differ from the bytes that were sent (checksum mismatch)."""


class RequestCancelled(KvxferError):
    """A request was cancelled by its caller (``DecodeWorker.cancel`` or a client's ``generate_cancel``)."""


class SessionError(KvxferError):
    """A disaggregated-serving request failed; the message says which request and why."""


class WorkerUnhealthy(KvxferError):
    """A worker hit an error it cannot vouch for recovering from (a bug, CUDA out of memory): its requests
    were failed with the cause and it should be restarted; the message names the cause."""


class WorkerShuttingDown(KvxferError):
    """The worker is stopping (SIGTERM/SIGINT to ``kvxfer serve``, or ``drain``/``close``): it takes no new
    request, and a request it could not finish within its drain deadline fails with this; the message names
    the worker and what stopped it."""
