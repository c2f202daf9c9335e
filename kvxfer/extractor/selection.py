"""Which buffers of a layout a caller selected (layers, roles), checked against the layout."""

from __future__ import annotations

from collections.abc import Iterable

from kvxfer.cache.descriptors import BufferId, CacheLayoutDesc
from kvxfer.errors import LayoutError


def select_buffers(layout: CacheLayoutDesc, layers: Iterable[int] | None = None,
                   roles: Iterable[str] | None = None) -> frozenset[BufferId]:
    """The buffers of ``layers`` x ``roles`` (None: all); raises LayoutError naming an unknown layer or role."""
    every = [bid for bid, _ in layout.formats]
    if layers is not None:
        wanted = {int(x) for x in layers}
        known = set(layout.layer_ids)
        missing = sorted(wanted - known)
        if missing:
            raise LayoutError(f"layers {missing} are not in this layout (layers {layer_span(layout.layer_ids)})")
        every = [b for b in every if b.layer_id in wanted]
    if roles is not None:
        wanted_roles = set(roles)
        known_roles = {bid.role for bid, _ in layout.formats}
        unknown = sorted(wanted_roles - known_roles)
        if unknown:
            raise LayoutError(f"roles {unknown} are not in this layout (roles {sorted(known_roles)})")
        every = [b for b in every if b.role in wanted_roles]
    refuse_recurrent(layout, {b.layer_id for b in every}, "extract")
    refuse_opaque(layout, every, "extract")
    return frozenset(every)


def refuse_opaque(layout: CacheLayoutDesc, buffers: Iterable[BufferId], what: str) -> None:
    """LayoutError naming the first opaque buffer (``BufferFormat.block_bytes``) among ``buffers``: its
    page has no (head, token) structure, so kvxfer cannot tell which of its bytes hold which tokens,
    and a token range or a pairing with another layout would move the wrong bytes (select the other
    roles or layers with ``roles=`` / ``layers=``)."""
    formats = dict(layout.formats)
    for bid in sorted(buffers):
        fmt = formats.get(bid)
        if fmt is not None and fmt.opaque:
            raise LayoutError(f"{what}: buffer {bid} is opaque ({fmt.block_bytes} bytes per page of "
                              f"{fmt.tokens_per_block} tokens, no per-token rows): kvxfer does not know which of its "
                              f"bytes hold which tokens; leave it out with layers= or roles=")


def refuse_recurrent(layout: CacheLayoutDesc, layer_ids: Iterable[int], what: str) -> None:
    """LayoutError when ``layer_ids`` reach a recurrent (SSM) layer group: its block-id list is one state
    slot per request, not pages per token block, so token ranges, page tables and transfer plans do not
    describe it (select the attention layers with ``layers=``)."""
    wanted = set(layer_ids)
    for lg in layout.layer_groups:
        if lg.recurrent and wanted.intersection(lg.layer_ids):
            raise LayoutError(f"{what}: layers {sorted(wanted.intersection(lg.layer_ids))} are recurrent (SSM) "
                              f"layers (layer group {lg.layer_group_id}): their state is one slot per request, "
                              f"not pages per token block, and kvxfer moves paged attention KV only; select the "
                              f"attention layers with layers=")


def layer_span(ids: tuple[int, ...]) -> str:
    """A short text for a list of layer ids."""
    if ids and list(ids) == list(range(ids[0], ids[0] + len(ids))):
        return f"{ids[0]}..{ids[-1]}"
    return str(list(ids[:16])) + ("..." if len(ids) > 16 else "")
