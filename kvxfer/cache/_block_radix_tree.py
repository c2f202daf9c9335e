"""The reference design's ``_block_radix_tree`` module name, for code written against it: kvxfer's prefix
tree (``radix_tree.PrefixTree``) behind the reference's block interface, and ``Hasher``, the reference's
incremental block-key hash.

``BlockRadixTree`` keeps one root per reuse scope (``add_or_get_existing``); ``Block(tokens, prev)`` adds
a full block under ``prev`` (a root or a block), keyed with the reference's packed chain
(``SHA-256(prev key || pack_key_tokens(tokens))``, as ``sequence_to_blockchain_keys``); ``match`` walks a
token sequence from a scope's root. Blocks made here hold no pages (every life cycle's slot is -1).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer.cache.hashing import (
    HASH_V2_SHA256_PACKED,
    DigestTable,
    ReuseScope,
    TokenIdExt,
    block_keys,
    pack_key_tokens,
)
from kvxfer.cache.radix_tree import BlockNode, PrefixTree
from kvxfer.errors import ConfigError


class Hasher:
    """SHA-256 of a seed then of key tokens (ids as 4 little-endian bytes, digests as themselves):
    ``Hasher(parent_key).update(block_tokens).digest`` is the block's key."""

    __slots__ = ("_hash",)

    def __init__(self, seed: bytes = b"") -> None:
        self._hash = hashlib.sha256(seed)

    def update(self, tokens: Sequence[TokenIdExt]) -> Hasher:
        """Feed ``tokens``; returns self (calls chain)."""
        self._hash.update(pack_key_tokens(tokens))
        return self

    @property
    def digest(self) -> bytes:
        """The 32-byte digest of everything fed so far."""
        return self._hash.digest()


class RootBlock:
    """A reuse scope's root in a ``BlockRadixTree`` (its key is the scope's root key)."""

    tree: BlockRadixTree
    key: bytes
    ordinal: int

    def __init__(self, tree: BlockRadixTree, reuse_scope: ReuseScope) -> None:
        self.tree = tree
        self.reuse_scope = reuse_scope
        self.key = reuse_scope.root_key_for(HASH_V2_SHA256_PACKED)
        self.ordinal = -1


class Block:
    """A full block of ``tokens`` added to ``prev``'s tree under ``prev`` (a ``RootBlock`` or a ``Block``)."""

    tree: BlockRadixTree
    key: bytes
    ordinal: int

    def __init__(self, tokens: Sequence[TokenIdExt], prev: RootBlock | Block) -> None:
        tree = prev.tree
        if len(tokens) != tree.tokens_per_block:
            raise ConfigError(f"Block: a block holds {tree.tokens_per_block} tokens, got {len(tokens)}")
        self.tokens = list(tokens)
        self.prev = prev
        self.tree = tree
        self.key = Hasher(prev.key).update(self.tokens).digest
        self.ordinal = prev.ordinal + 1
        self.node = tree.add_block(self)


@dataclass
class BlockMatch:
    """What ``BlockRadixTree.match`` found: the matched blocks in order (a partially matched one last)
    and the tokens they cover."""

    blocks: list[Block] = field(default_factory=list)
    num_tokens: int = 0


class BlockRadixTree:
    """kvxfer's ``PrefixTree`` with the reference's block interface (``life_cycles.size`` page slots per block)."""

    def __init__(self, life_cycles: Any, tokens_per_block: int) -> None:
        self.tokens_per_block = tokens_per_block
        self.life_cycles = life_cycles
        self._tree = PrefixTree(int(life_cycles.size), tokens_per_block)
        self._digests = DigestTable()
        self._roots: dict[bytes, RootBlock] = {}
        self._blocks: dict[int, Block] = {}

    @property
    def prefix_tree(self) -> PrefixTree:
        """The kvxfer tree underneath."""
        return self._tree

    def add_or_get_existing(self, reuse_scope: ReuseScope) -> RootBlock:
        """The root of ``reuse_scope`` (made on first use)."""
        root = RootBlock(self, reuse_scope)
        return self._roots.setdefault(root.key, root)

    def add_block(self, block: Block) -> BlockNode:
        """Enter ``block`` (what ``Block.__init__`` calls)."""
        root: Any = block
        while isinstance(root, Block):
            root = root.prev
        parent = None if isinstance(block.prev, RootBlock) else block.prev.node
        node = self._tree.insert(root.key, parent, block.key, self._digests.encode(block.tokens, "Block"),
                                 np.full(self._tree.num_layer_groups, -1, dtype=np.int32))
        self._blocks[id(node)] = block
        return node

    def match(self, reuse_scope: ReuseScope, tokens: Sequence[TokenIdExt],
              enable_partial_match: bool = False) -> BlockMatch:
        """The blocks of ``tokens`` present under ``reuse_scope``'s root (and, with ``enable_partial_match``,
        the child sharing the longest token prefix with the next block)."""
        root_key = reuse_scope.root_key_for(HASH_V2_SHA256_PACKED)
        arr = self._digests.encode(list(tokens), "BlockRadixTree.match")
        keys = block_keys(arr, self.tokens_per_block, root_key, algo=HASH_V2_SHA256_PACKED, digests=self._digests)
        found = self._tree.match(root_key, keys, arr, exact_only=not enable_partial_match)
        blocks = [self._blocks[id(node)] for node in found.nodes]
        num_tokens = len(blocks) * self.tokens_per_block
        if found.partial is not None:
            blocks.append(self._blocks[id(found.partial)])
            num_tokens += found.partial_tokens
        return BlockMatch(blocks, num_tokens)


__all__ = ["Block", "BlockMatch", "BlockRadixTree", "Hasher", "ReuseScope", "RootBlock"]
