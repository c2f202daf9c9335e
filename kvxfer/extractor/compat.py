"""Can two published layouts be paired? Checks that name the first incompatible field and both values."""

from __future__ import annotations

from collections.abc import Iterable

from kvxfer.cache.descriptors import BufferId, CacheLayoutDesc
from kvxfer.errors import LayoutMismatch
from kvxfer.extractor.regions import Placement
from kvxfer.extractor.selection import layer_span, refuse_opaque, refuse_recurrent


def paired_layers(src: CacheLayoutDesc, dst: CacheLayoutDesc, layers: Iterable[int] | None) -> list[int]:
    """The layer ids to move: all (both layouts must hold the same ones) or ``layers`` (each in both)."""
    if layers is None:
        if src.layer_ids != dst.layer_ids:
            raise LayoutMismatch(f"layer ids: source has {layer_span(src.layer_ids)}, destination has "
                                 f"{layer_span(dst.layer_ids)}")
        wanted = list(src.layer_ids)
    else:
        wanted = sorted({int(x) for x in layers})
        for side, layout in (("source", src), ("destination", dst)):
            missing = sorted(set(wanted) - set(layout.layer_ids))
            if missing:
                raise LayoutMismatch(f"layer ids: layers {missing} requested, {side} has "
                                     f"{layer_span(layout.layer_ids)}")
    for side, layout in (("source", src), ("destination", dst)):
        refuse_recurrent(layout, wanted, f"transfer plan ({side})")
        refuse_opaque(layout, [b for b, _ in layout.formats if b.layer_id in set(wanted)], f"transfer plan ({side})")
    return wanted


def check_layer_groups(src: CacheLayoutDesc, dst: CacheLayoutDesc, layer_ids: Iterable[int]) -> None:
    """Each layer has the same attention window and sink tokens on both sides."""
    for lid in layer_ids:
        a, b = src.layer_group_of(lid), dst.layer_group_of(lid)
        for name in ("window", "sink_tokens"):
            if getattr(a, name) != getattr(b, name):
                raise LayoutMismatch(f"layer {lid} {name}: source {getattr(a, name)!r} vs destination "
                                     f"{getattr(b, name)!r}")


def buffer_pairs(src: dict[BufferId, Placement], dst: dict[BufferId, Placement],
                 layer_ids: Iterable[int]) -> list[tuple[Placement, Placement]]:
    """(source, destination) placements of every buffer of ``layer_ids``; roles, dtype, head_dim and
    total heads must agree."""
    wanted = set(layer_ids)
    src_roles: dict[int, set[str]] = {}
    dst_roles: dict[int, set[str]] = {}
    for bid in src:
        if bid.layer_id in wanted:
            src_roles.setdefault(bid.layer_id, set()).add(bid.role)
    for bid in dst:
        if bid.layer_id in wanted:
            dst_roles.setdefault(bid.layer_id, set()).add(bid.role)
    pairs: list[tuple[Placement, Placement]] = []
    for lid in sorted(wanted):
        if src_roles.get(lid) != dst_roles.get(lid):
            raise LayoutMismatch(f"layer {lid} roles: source {sorted(src_roles.get(lid, ()))} vs destination "
                                 f"{sorted(dst_roles.get(lid, ()))}")
        for role in sorted(src_roles[lid]):
            bid = BufferId(lid, role)
            a, b = src[bid], dst[bid]
            for name in ("dtype", "head_dim", "total_heads"):
                if getattr(a.fmt, name) != getattr(b.fmt, name):
                    raise LayoutMismatch(f"layer {lid} role {role!r} {name}: source {getattr(a.fmt, name)!r} vs "
                                         f"destination {getattr(b.fmt, name)!r}")
            pairs.append((a, b))
    return pairs
