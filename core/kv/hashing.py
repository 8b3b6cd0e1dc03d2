"""Block hashes for prefix caching: a chain over full blocks, stable across processes.

The hash of full block ``i`` of a request is::

    H(hash of block i-1 (NONE_HASH for i = 0) || u32 n || n token ids as int64 LE
      || encode(extra keys of block i))

so equal hashes mean equal tokens *and* equal prefixes. ``H`` is sha256 by default,
or xxh3-128 (``algo="xxhash"``, needs the ``xxhash`` package): about as fast to
call from Python but not collision-resistant against someone who chooses tokens.
The byte encoding is ours (not pickle, whose output changes between versions), so
a hash computed in one process or machine equals the one computed in any other.

The chain's seed: ``NONE_HASH = H(encode(("pagedkv-none-hash", seed)))`` with
``seed`` the manager's ``hash_seed`` argument, else ``$PAGEDKV_HASH_SEED``, else
"". Processes that share cached blocks (or hashes, e.g. for KV transfer) must use
the same seed; a secret seed keeps hashes unpredictable to clients.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable

from pagedkv.errors import KVCacheUsageError
from pagedkv.kv.block import BlockHash
from pagedkv.kv.request import Request

HashFn = Callable[[bytes], bytes]
HASH_SEED_ENV = "PAGEDKV_HASH_SEED"


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def get_hash_fn(algo: str) -> HashFn:
    """The digest function called ``algo``: "sha256" or "xxhash" (xxh3-128)."""
    if algo == "sha256":
        return _sha256
    if algo == "xxhash":
        try:
            import xxhash
        except ImportError:
            raise KVCacheUsageError(
                "hash algo 'xxhash' needs the xxhash package (pip install xxhash); "
                "use algo='sha256' otherwise"
            ) from None
        return xxhash.xxh3_128_digest
    raise KVCacheUsageError(f"unknown hash algo {algo!r}: expected 'sha256' or 'xxhash'")


# -- canonical encoding ----------------------------------------------------------------


def encode(obj: object) -> bytes:
    """A canonical, self-delimiting byte encoding of None/bool/int/str/bytes/tuple/list.

    Equal values give equal bytes in every process and Python version; different
    values (or types: 1 vs "1" vs True) give different bytes.
    """
    out = bytearray()
    _encode_into(obj, out)
    return bytes(out)


def _encode_into(obj: object, out: bytearray) -> None:
    if obj is None:
        out += b"N"
    elif obj is True:
        out += b"T"
    elif obj is False:
        out += b"F"
    elif isinstance(obj, int):
        raw = obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True)
        out += b"I" + struct.pack("<I", len(raw)) + raw
    elif isinstance(obj, str):
        raw = obj.encode("utf-8")
        out += b"S" + struct.pack("<I", len(raw)) + raw
    elif isinstance(obj, bytes):
        out += b"B" + struct.pack("<I", len(obj)) + obj
    elif isinstance(obj, tuple | list):
        out += b"L" + struct.pack("<I", len(obj))
        for item in obj:
            _encode_into(item, out)
    else:
        raise KVCacheUsageError(
            f"cannot hash a {type(obj).__name__} in a block's extra keys: "
            "expected None, bool, int, str, bytes, or tuples/lists of them"
        )


def encode_token_ids(token_ids: object) -> bytes:
    """Token ids as little-endian int64 (one struct call; no per-token objects)."""
    ids = list(token_ids)  # type: ignore[call-overload]
    try:
        return struct.pack(f"<{len(ids)}q", *ids)
    except struct.error:
        raise KVCacheUsageError("token ids must be ints in the int64 range") from None


# -- the chain ---------------------------------------------------------------------------


def block_extra_keys(request: Request, block_index: int, block_size: int) -> tuple:
    """What besides the token ids makes block ``block_index`` of ``request`` distinct.

    ("cache_salt", s) on the first block only (the chain carries it to the rest);
    ("lora", name) on every block, since an adapter changes the K/V; ("mm", id,
    offset from the block start) for each multimodal span overlapping the block.
    """
    keys: list[tuple] = []
    if block_index == 0 and request.cache_salt is not None:
        keys.append(("cache_salt", request.cache_salt))
    if request.lora_name is not None:
        keys.append(("lora", request.lora_name))
    if request.mm_spans:
        start = block_index * block_size
        end = start + block_size
        for span in request.mm_spans:
            if span.offset >= end:
                break
            if span.offset + span.length > start:
                keys.append(("mm", span.identifier, span.offset - start))
    return tuple(keys)


class BlockHasher:
    """Computes and caches the hash chain of a request's full blocks."""

    def __init__(self, block_size: int, algo: str = "sha256", seed: str | None = None) -> None:
        if block_size <= 0:
            raise KVCacheUsageError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.algo = algo
        self.hash_fn = get_hash_fn(algo)
        self.seed = os.environ.get(HASH_SEED_ENV, "") if seed is None else seed
        self.none_hash: BlockHash = self.hash_fn(encode(("pagedkv-none-hash", self.seed)))
        self._num_tokens_prefix = struct.pack("<I", block_size)

    def update(self, request: Request) -> list[BlockHash]:
        """Extend ``request.block_hashes`` to cover all its full blocks of known tokens
        (none that holds a placeholder); return it."""
        hashes = request.block_hashes
        first = len(hashes)
        num_full = request.num_known_tokens // self.block_size
        if first >= num_full:
            return hashes
        size = self.block_size
        stride = 8 * size
        token_bytes = encode_token_ids(request.all_token_ids[first * size : num_full * size])
        parent = hashes[-1] if hashes else self.none_hash
        prefix = self._num_tokens_prefix
        hash_fn = self.hash_fn
        plain = request.cache_salt is None and request.lora_name is None and not request.mm_spans
        no_keys = encode(())
        for i in range(first, num_full):
            chunk = token_bytes[(i - first) * stride : (i - first + 1) * stride]
            keys = no_keys if plain else encode(block_extra_keys(request, i, size))
            parent = hash_fn(parent + prefix + chunk + keys)
            hashes.append(parent)
        return hashes
