"""Chained block hash shared by the router and every worker.

A full block of `block_size` token ids is identified by
    hash_i = H(root if i == 0 else hash_{i-1}, token_ids of block i)
so equal hashes imply equal token prefixes (up to collisions of a 128-bit digest).
The hash is deterministic across processes and machines: blake2b over a fixed
little-endian encoding, never Python's randomized `hash()`.

`root` is the seed's root hash, or for a request with a cache salt (vLLM's `cache_salt`) the
salted root H(seed root, salt): the salt enters the first block's hash only, and the chain
carries it to every later block, so requests share cached blocks iff they have the same salt
(or both none). Router and workers hash through BlockHasher alone, so their hashes agree.

A request that runs with a LoRA adapter starts from the adapter's root H(root or salted root, adapter name):
the same tokens under two adapters (or under one and the base model) compute different KV, so they must never
share a block. The router hashes with the adapter name the OpenAI `model` field selected, the workers with the
name of the request's LoRARequest: the same rule, so their hashes agree.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from splitserve.common.errors import InvalidRequestError, json_excerpt

BlockHash = int

_DIGEST_BYTES = 16


def root_hash(seed: int) -> BlockHash:
    """The parent hash of a sequence's first block, derived from the configured seed."""
    digest = hashlib.blake2b(b"splitserve-root" + struct.pack("<q", seed), digest_size=_DIGEST_BYTES)
    return int.from_bytes(digest.digest(), "little")


def salted_root(root: BlockHash, cache_salt: str) -> BlockHash:
    """The parent hash of a salted sequence's first block: `root` (the seed's) and the salt's UTF-8 bytes.

    The "splitserve-salt" prefix keeps it apart from every block hash (whose input is a parent
    hash and whole int64 token ids). A lone surrogate (JSON may carry one: "\\ud800") is encoded
    as its code point's 3 bytes ("surrogatepass"), never a UTF-8 encoding of a valid string."""
    salt_bytes = cache_salt.encode("utf-8", "surrogatepass")
    payload = b"splitserve-salt" + root.to_bytes(_DIGEST_BYTES, "little") + salt_bytes
    return int.from_bytes(hashlib.blake2b(payload, digest_size=_DIGEST_BYTES).digest(), "little")


def adapter_root(root: BlockHash, lora_name: str) -> BlockHash:
    """The parent hash of the first block of a sequence run with the LoRA adapter `lora_name` (`root`: the seed's
    or the salted root). The "splitserve-lora" prefix keeps it apart from salted roots and block hashes."""
    payload = b"splitserve-lora" + root.to_bytes(_DIGEST_BYTES, "little") + lora_name.encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(payload, digest_size=_DIGEST_BYTES).digest(), "little")


def check_cache_salt(cache_salt: object) -> None:
    """InvalidRequestError naming `cache_salt` unless it is None (unsalted) or a non-empty string (vLLM's rule)."""
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise InvalidRequestError("cache_salt", f"must be a non-empty string, got {json_excerpt(cache_salt)}")


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

    def root_for(self, cache_salt: str | None, lora_name: str | None = None) -> BlockHash:
        """The parent hash of the first block of a sequence with this salt (None: unsalted) run with this LoRA
        adapter (None: the base model)."""
        root = self.root if cache_salt is None else salted_root(self.root, cache_salt)
        return root if lora_name is None else adapter_root(root, lora_name)

    def extend(self, hashes: list[BlockHash], token_ids: Sequence[int],
               cache_salt: str | None = None, lora_name: str | None = None) -> list[BlockHash]:
        """Append hashes for the full blocks of `token_ids` not yet in `hashes` (in place).

        `hashes[i]` covers token_ids[i*block_size:(i+1)*block_size]; a trailing partial
        block gets no hash. `cache_salt` and `lora_name` must be the ones `hashes` was started with.
        """
        num_full = len(token_ids) // self.block_size
        for i in range(len(hashes), num_full):
            parent = hashes[i - 1] if i > 0 else self.root_for(cache_salt, lora_name)
            hashes.append(hash_block(parent, token_ids[i * self.block_size : (i + 1) * self.block_size]))
        return hashes

    def hash_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None,
                    lora_name: str | None = None) -> list[BlockHash]:
        """Hashes of every full block of `token_ids`, salted with `cache_salt` (None: unsalted), run with the LoRA
        adapter `lora_name` (None: the base model)."""
        return self.extend([], token_ids, cache_salt, lora_name)
