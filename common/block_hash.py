"""Chained block hash shared by the router and every worker.

A full block of `block_size` token ids is identified by
    hash_i = H(seed_root if i == 0 else hash_{i-1}, token_ids of block i)
so equal hashes imply equal token prefixes (up to collisions of a 128-bit digest).
The hash is deterministic across processes and machines: blake2b over a fixed
little-endian encoding, never Python's randomized `hash()`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = int

_DIGEST_BYTES = 16


def root_hash(seed: int) -> BlockHash:
    """The parent hash of a sequence's first block, derived from the configured seed."""
    digest = hashlib.blake2b(b"splitserve-root" + struct.pack("<q", seed), digest_size=_DIGEST_BYTES)
    return int.from_bytes(digest.digest(), "little")


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash one full block given its parent's hash."""
    payload = parent.to_bytes(_DIGEST_BYTES, "little") + struct.pack(f"<{len(token_ids)}q", *token_ids)
    return int.from_bytes(hashlib.blake2b(payload, digest_size=_DIGEST_BYTES).digest(), "little")


class BlockHasher:
    """Computes chained hashes of the full blocks of a token sequence."""

    def __init__(self, block_size: int, seed: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.root = root_hash(seed)

    def extend(self, hashes: list[BlockHash], token_ids: Sequence[int]) -> list[BlockHash]:
        """Append hashes for the full blocks of `token_ids` not yet in `hashes` (in place).

        `hashes[i]` covers token_ids[i*block_size:(i+1)*block_size]; a trailing partial
        block gets no hash.
        """
        num_full = len(token_ids) // self.block_size
        for i in range(len(hashes), num_full):
            parent = hashes[i - 1] if i > 0 else self.root
            hashes.append(hash_block(parent, token_ids[i * self.block_size : (i + 1) * self.block_size]))
        return hashes

    def hash_prefix(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """Hashes of every full block of `token_ids`."""
        return self.extend([], token_ids)
