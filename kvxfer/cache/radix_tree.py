"""Prefix tree of committed blocks: full-block matching by key, partial matching by tokens, and
eviction order (lowest priority first, then least recently used, leaves before their parents).

The tree knows pages only as ids (one per layer group, -1 where a sliding-window page was not kept);
reference counts and memory belong to the cache manager, which decides whether a candidate is free
to evict.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvxfer.errors import ConfigError, KVCacheError

IntArray = npt.NDArray[np.int32]
TierArray = npt.NDArray[np.int8]
TokenArray = npt.NDArray[np.int64]

#: Padding of a tail block's row in the partial-match table: no token id or digest code equals it.
_NO_TOKEN = np.iinfo(np.int64).min

MIN_PRIORITY = 0
MAX_PRIORITY = 100
DEFAULT_PRIORITY = 35


def check_priority(priority: int, what: str) -> int:
    """``priority`` validated into [0, 100] (ConfigError otherwise)."""
    if isinstance(priority, bool) or not isinstance(priority, int | np.integer) \
            or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ConfigError(f"{what}: priority must be an int in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {priority!r}")
    return int(priority)


@dataclass(eq=False)
class BlockNode:
    """One committed block: its key, its tokens and the page holding it in each layer group.

    ``pages[lg]`` is a slot of tier ``tiers[lg]`` (0 = primary; the cache manager moves pages
    between tiers and rewrites both). ``coverage[lg]`` is the tokens of the block that page holds
    (its recorded token count): the block's own length, or fewer for a page a shorter sibling
    handed over when this block replaced it (see ``page_coverage``). A root node (``key`` = the
    scope's root key, ``depth`` -1) holds no tokens and no pages.
    """

    key: bytes
    parent: BlockNode | None
    depth: int
    tokens: TokenArray
    pages: IntArray
    tiers: TierArray = field(default_factory=lambda: np.empty(0, dtype=np.int8))
    has_extra_key: bool = False
    priority: int = DEFAULT_PRIORITY
    last_used: int = 0
    children: dict[bytes, BlockNode] = field(default_factory=dict)
    removed: bool = False
    _version: int = 0
    _child_tokens: TokenArray | None = None
    _child_list: list[BlockNode] | None = None
    coverage: IntArray = field(default_factory=lambda: np.empty(0, dtype=np.int32))

    def __post_init__(self) -> None:
        if self.coverage.size != self.pages.size:
            self.coverage = np.full(self.pages.size, self.tokens.size, dtype=np.int32)

    def page_coverage(self, layer_group: int) -> int:
        """Tokens of this block that layer group ``layer_group``'s page holds (0: no page). For an
        attention group a prefix of the block; for a recurrent one the exact position of its snapshot."""
        return int(self.coverage[layer_group]) if self.pages[layer_group] >= 0 else 0

    @property
    def is_root(self) -> bool:
        """Whether this is a scope's root (no block of its own)."""
        return self.parent is None

    @property
    def is_leaf(self) -> bool:
        """Whether no committed block continues this one."""
        return not self.children

    @property
    def num_tokens(self) -> int:
        """Tokens the block holds: ``tokens_per_block``, or fewer for a request's partial last block
        (a tail block: always a leaf, nothing continues it)."""
        return int(self.tokens.size)


@dataclass(frozen=True)
class PrefixMatch:
    """The result of matching a request against the tree: full-block nodes in order, and
    optionally a node whose first ``partial_tokens`` tokens continue the match."""

    nodes: tuple[BlockNode, ...]
    partial: BlockNode | None = None
    partial_tokens: int = 0


class PrefixTree:
    """Blocks keyed by their chain key under one root per reuse scope."""

    def __init__(self, num_layer_groups: int, tokens_per_block: int) -> None:
        self.num_layer_groups = num_layer_groups
        self.tokens_per_block = tokens_per_block
        self._roots: dict[bytes, BlockNode] = {}
        self._num_blocks = 0
        self._clock = itertools.count(1)
        self._seq = itertools.count()
        self._heap: list[tuple[int, int, int, int, BlockNode]] = []

    # --- queries ------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Blocks (non-root nodes) in the tree."""
        return self._num_blocks

    def root(self, root_key: bytes) -> BlockNode | None:
        """The root of a scope, if it has any block."""
        return self._roots.get(root_key)

    def nodes(self) -> Iterator[BlockNode]:
        """Every block node, parents before children."""
        stack = [n for r in self._roots.values() for n in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def child(self, root_key: bytes, parent: BlockNode | None, key: bytes) -> BlockNode | None:
        """The block ``key`` directly under ``parent`` (None: under the scope's root), if present."""
        if parent is None:
            parent = self._roots.get(root_key)
        return None if parent is None else parent.children.get(key)

    def match(self, root_key: bytes, keys: Sequence[bytes], tokens: TokenArray | None = None,
              max_tokens: int | None = None, *, exact_only: bool = False) -> PrefixMatch:
        """The longest run of ``keys`` present from ``root_key``; when ``tokens`` is given, also the
        child of the last matched node sharing the longest token prefix with the next block (capped so
        that at most ``max_tokens`` tokens are matched in all). ``exact_only``: only a tail block holding
        exactly the rest of the (capped) tokens, as its key would match (no partial match)."""
        tpb = self.tokens_per_block
        node = self._roots.get(root_key)
        if node is None:
            return PrefixMatch(())
        limit = len(keys) if max_tokens is None else min(len(keys), max_tokens // tpb)
        path: list[BlockNode] = []
        for key in keys[:limit]:
            child = node.children.get(key)
            if child is None:
                break
            path.append(child)
            node = child
        if tokens is None:
            return PrefixMatch(tuple(path))
        start = len(path) * tpb
        stop = min(start + tpb, tokens.size if max_tokens is None else min(tokens.size, max_tokens))
        if stop <= start or not node.children:
            return PrefixMatch(tuple(path))
        best, common = self._best_partial(node, tokens[start:stop])
        if best is None or common == 0 or (exact_only and not common == best.num_tokens == stop - start):
            return PrefixMatch(tuple(path))
        return PrefixMatch(tuple(path), best, common)

    def _best_partial(self, parent: BlockNode, query: TokenArray) -> tuple[BlockNode | None, int]:
        """The child of ``parent`` (without an extra key) whose tokens share the longest prefix with
        ``query``; ties go to the child inserted first. One vectorised compare over all children."""
        if parent._child_tokens is None or parent._child_list is None:
            kids = [c for c in parent.children.values() if not c.has_extra_key]
            parent._child_list = kids
            rows = np.full((len(kids), self.tokens_per_block), _NO_TOKEN, dtype=np.int64)
            for i, c in enumerate(kids):       # a tail block's row ends early: its padding matches nothing
                rows[i, :c.tokens.size] = c.tokens
            parent._child_tokens = rows
        if not parent._child_list:
            return None, 0
        same = parent._child_tokens[:, :query.size] == query[None, :]
        common = np.cumprod(same, axis=1).sum(axis=1)
        i = int(np.argmax(common))
        return parent._child_list[i], int(common[i])

    # --- updates --------------------------------------------------------------------------------
    def tick(self) -> int:
        """The next value of the tree's LRU clock (for ordering other pages against its blocks)."""
        return next(self._clock)

    def touch(self, node: BlockNode) -> None:
        """Mark ``node`` used now (LRU) and make it an eviction candidate again."""
        if node.removed or node.is_root:
            return
        node.last_used = next(self._clock)
        self._push(node)

    def touch_all(self, nodes: Iterable[BlockNode | None]) -> None:
        """``touch`` each node in order (None skipped): the same stamps and queue, less call overhead."""
        for node in nodes:
            if node is None or node.removed or node.parent is None:
                continue
            node.last_used = next(self._clock)
            if node.children:
                continue                      # queued when it becomes a leaf (see _push)
            node._version += 1
            heapq.heappush(self._heap, (node.priority, node.last_used, next(self._seq), node._version, node))
            if len(self._heap) > 4 * self._num_blocks + 1024:
                self._rebuild_heap()

    def requeue(self, node: BlockNode) -> None:
        """Make ``node`` an eviction candidate again without marking it used (a candidate that
        ``pop_leaf`` returned and the caller chose to keep)."""
        if not node.removed and not node.is_root:
            self._push(node)

    def set_priority(self, node: BlockNode, priority: int) -> bool:
        """Change a node's priority; True when it changed."""
        priority = check_priority(priority, "PrefixTree.set_priority")
        if node.removed or node.is_root or node.priority == priority:
            return False
        node.priority = priority
        self._push(node)
        return True

    def insert(self, root_key: bytes, parent: BlockNode | None, key: bytes, tokens: TokenArray,
               pages: IntArray, *, has_extra_key: bool = False, priority: int = DEFAULT_PRIORITY) -> BlockNode:
        """Add a block under ``parent`` (None: under the scope's root). The key must be new there.
        ``tokens`` is a full block, or 1 to ``tokens_per_block - 1`` tokens for a tail block (a
        request's partial last block), which nothing can continue."""
        priority = check_priority(priority, "PrefixTree.insert")
        if parent is None:
            parent = self._roots.get(root_key)
            if parent is None:
                parent = BlockNode(root_key, None, -1, np.empty(0, dtype=np.int64),
                                   np.empty(0, dtype=np.int32))
                self._roots[root_key] = parent
        if parent.removed:
            raise KVCacheError(f"PrefixTree.insert: parent block {parent.key.hex()[:16]} was removed")
        if not parent.is_root and parent.num_tokens < self.tokens_per_block:
            raise KVCacheError(f"PrefixTree.insert: parent block {parent.key.hex()[:16]} is a tail block "
                               f"({parent.num_tokens} of {self.tokens_per_block} tokens); nothing continues it")
        if key in parent.children:
            raise KVCacheError(f"PrefixTree.insert: block {key.hex()[:16]} is already in the tree")
        if tokens.ndim != 1 or not 0 < tokens.size <= self.tokens_per_block \
                or pages.shape != (self.num_layer_groups,):
            raise KVCacheError(f"PrefixTree.insert: expected 1 to {self.tokens_per_block} tokens and "
                               f"{self.num_layer_groups} pages, got {tokens.shape} and {pages.shape}")
        node = BlockNode(key, parent, parent.depth + 1, tokens.astype(np.int64, copy=True),
                         pages.astype(np.int32, copy=True), np.zeros(self.num_layer_groups, dtype=np.int8),
                         has_extra_key, priority)
        parent.children[key] = node
        parent._child_tokens = parent._child_list = None
        self._num_blocks += 1
        self.touch(node)
        return node

    def insert_chain(self, root_key: bytes, parent: BlockNode | None, keys: Sequence[bytes], tokens: TokenArray,
                     pages: IntArray, has_extra_key: Sequence[bool], *,
                     priority: int = DEFAULT_PRIORITY) -> list[BlockNode]:
        """Add a chain of new blocks, each the child of the one before, the first under ``parent``
        (None: the scope's root): ``tokens[i]`` / ``pages[i]`` are block i's rows. The same as one
        ``insert`` per block in order (same LRU stamps, same eviction queue), without per-block checks."""
        priority = check_priority(priority, "PrefixTree.insert_chain")
        n = len(keys)
        if tokens.shape != (n, self.tokens_per_block) or pages.shape != (n, self.num_layer_groups) \
                or len(has_extra_key) != n:
            raise KVCacheError(f"PrefixTree.insert_chain: expected {n} x {self.tokens_per_block} tokens, {n} x "
                               f"{self.num_layer_groups} pages and {n} extra-key flags, got {tokens.shape}, "
                               f"{pages.shape} and {len(has_extra_key)}")
        if not n:
            return []
        if parent is None:
            parent = self._roots.get(root_key)
            if parent is None:
                parent = BlockNode(root_key, None, -1, np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int32))
                self._roots[root_key] = parent
        if parent.removed:
            raise KVCacheError(f"PrefixTree.insert_chain: parent block {parent.key.hex()[:16]} was removed")
        if not parent.is_root and parent.num_tokens < self.tokens_per_block:
            raise KVCacheError(f"PrefixTree.insert_chain: parent block {parent.key.hex()[:16]} is a tail block; "
                               f"nothing continues it")
        if keys[0] in parent.children:
            raise KVCacheError(f"PrefixTree.insert_chain: block {keys[0].hex()[:16]} is already in the tree")
        parent._child_tokens = parent._child_list = None
        # One array per block (copies of the rows): a node must not keep a whole chain's rows alive.
        tok_rows = list(tokens.astype(np.int64, copy=False))
        page_rows = list(pages.astype(np.int32, copy=False))
        zero_tiers = np.zeros(self.num_layer_groups, dtype=np.int8)
        nodes: list[BlockNode] = []
        depth = parent.depth
        for key, tok, page, extra in zip(keys, tok_rows, page_rows, has_extra_key, strict=True):
            depth += 1
            node = BlockNode(key, parent, depth, tok.copy(), page.copy(), zero_tiers.copy(), extra, priority,
                             next(self._clock))
            parent.children[key] = node
            self._num_blocks += 1
            nodes.append(node)
            parent = node
        self._push(nodes[-1])         # the chain's one leaf (see _push)
        return nodes

    def remove(self, node: BlockNode) -> None:
        """Take a leaf block out of the tree (its pages are the caller's to release)."""
        if node.is_root or node.removed:
            raise KVCacheError("PrefixTree.remove: not a block of the tree")
        if node.children:
            raise KVCacheError(f"PrefixTree.remove: block {node.key.hex()[:16]} still has "
                               f"{len(node.children)} children (leaves go first)")
        parent = node.parent
        assert parent is not None
        siblings = parent.children
        del siblings[node.key]
        parent._child_tokens = parent._child_list = None
        node.removed = True
        self._num_blocks -= 1
        if siblings:
            return
        if parent.parent is None:          # a root left without blocks
            del self._roots[parent.key]
        else:                              # a block that just became a leaf
            self._push(parent)

    def clear(self) -> list[BlockNode]:
        """Remove every block; returns them (children before parents)."""
        order = list(self.nodes())[::-1]
        for node in order:
            node.removed = True
            node.children.clear()
        self._roots.clear()
        self._heap.clear()
        self._num_blocks = 0
        return order

    # --- eviction order ---------------------------------------------------------------------------
    def _push(self, node: BlockNode) -> None:
        """Queue ``node`` as an eviction candidate (superseding its older entries). Only leaves are
        candidates: a block with children is not queued, it is when it becomes a leaf (``remove``)."""
        if node.children:
            return
        node._version += 1
        heapq.heappush(self._heap, (node.priority, node.last_used, next(self._seq), node._version, node))
        if len(self._heap) > 4 * self._num_blocks + 1024:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        self._heap = []
        for node in self.nodes():
            if node.is_leaf:
                node._version += 1
                self._heap.append((node.priority, node.last_used, next(self._seq), node._version, node))
        heapq.heapify(self._heap)

    def pop_leaf(self) -> BlockNode | None:
        """The next leaf in eviction order, taken off the candidate queue; None when there is none.

        A candidate the caller cannot evict (a request still holds a page) may simply be dropped:
        it is queued again when touched (a request releases it) or when it becomes a leaf again.
        """
        while self._heap:
            _, _, _, version, node = heapq.heappop(self._heap)
            if node.removed or version != node._version or node.children:
                continue
            return node
        return None
