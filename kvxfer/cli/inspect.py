"""`kvxfer inspect`: build a cache layout from model dimensions and show it as a table or JSON."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from kvxfer.cache.config import CacheConfig, RoleSpec
from kvxfer.cache.descriptors import CacheLayoutDesc, plain
from kvxfer.cache.layout import plan_layout


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Model-shape options shared by `inspect` (defaults: Llama-3-8B)."""
    p.add_argument("--layers", type=int, default=32, help="number of attention layers (default 32)")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads of the whole model (default 8)")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension (default 128)")
    p.add_argument("--tokens-per-block", type=int, default=32, help="tokens per block (default 32)")
    p.add_argument("--dtype", default="bfloat16", help="KV dtype (default bfloat16)")
    p.add_argument("--blocks", type=int, default=1024, help="blocks per layer group (default 1024)")
    p.add_argument("--window", type=int, default=None,
                   help="sliding window (tokens) for every other layer, starting at layer 0")
    p.add_argument("--sink-tokens", type=int, default=0, help="sink tokens of sliding-window layers")
    p.add_argument("--scale-role", action="store_true", help="add a float32 per-token-head 'key_scale' role")
    p.add_argument("--head-order", choices=("HND", "NHD"), default="HND")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--tp-rank", type=int, default=0)
    p.add_argument("--no-coalesce", action="store_true", help="one pool per buffer (expanded layout)")
    p.add_argument("--json", action="store_true", help="print the CacheLayoutDesc as JSON")


def config_from_args(a: argparse.Namespace) -> CacheConfig:
    """The CacheConfig the options describe."""
    roles: tuple[str | RoleSpec, ...] = ("key", "value")
    if a.scale_role:
        roles = (*roles, RoleSpec("key_scale", head_dim=1, dtype="float32"))
    return CacheConfig.for_model(
        a.layers, a.kv_heads, a.head_dim, a.tokens_per_block, a.dtype, a.blocks,
        windows=[a.window, None] if a.window else None, sink_tokens=a.sink_tokens, roles=roles,
        head_order=a.head_order, tp_size=a.tp_size, tp_rank=a.tp_rank, coalesce=not a.no_coalesce)


def render(layout: CacheLayoutDesc, console: Console) -> None:
    """Print a layout as readable tables."""
    console.print(f"[bold]CacheLayoutDesc[/] v{layout.version}  tokens_per_block={layout.tokens_per_block}  "
                  f"fingerprint={layout.fingerprint.hex()[:16]}")
    lg_table = Table(title="Layer groups")
    for col in ("id", "layers", "window", "sink", "pool group"):
        lg_table.add_column(col)
    for lg in layout.layer_groups:
        ids = lg.layer_ids
        shown = ",".join(map(str, ids)) if len(ids) <= 8 else f"{ids[0]},{ids[1]},...,{ids[-1]} ({len(ids)})"
        lg_table.add_row(str(lg.layer_group_id), shown, str(lg.window or "full"), str(lg.sink_tokens),
                         str(lg.pool_group_index))
    console.print(lg_table)
    pool_table = Table(title="Pools (one row per layer group's variant of each pool)")
    for col in ("pool", "layer group", "slots", "slot bytes", "buffer bytes", "buffers", "MiB", "first buffers"):
        pool_table.add_column(col, justify="right" if col != "first buffers" else "left")
    total = 0
    for pg in layout.pool_groups:
        total += sum(pool.nbytes for pool in pg.pools)
        for variant in pg.slot_desc.variants:
            for pool, cb in zip(pg.pools, variant.coalesced_buffers, strict=True):
                first = ", ".join(f"L{b.layer_id}.{b.role}@{i * cb.single_buffer_size}"
                                  for i, b in enumerate(cb.buffer_ids[:3]))
                pool_table.add_row(f"{pg.pool_group_index}.{pool.pool_index}", str(variant.layer_group_id),
                                   str(pool.num_slots), str(pool.slot_bytes), str(cb.single_buffer_size),
                                   str(cb.num_buffers), f"{pool.nbytes / 2**20:.1f}",
                                   first + (", ..." if cb.num_buffers > 3 else ""))
    console.print(pool_table)
    fmts = {f for _, f in layout.formats}
    fmt_table = Table(title="Buffer formats")
    for col in ("dtype", "heads (start+n / total)", "tokens", "head_dim", "order", "bytes"):
        fmt_table.add_column(col)
    for f in sorted(fmts, key=lambda f: -f.nbytes):
        fmt_table.add_row(f.dtype, f"{f.head_start}+{f.num_heads} / {f.total_heads}", str(f.tokens_per_block),
                          str(f.head_dim), f.order, str(f.nbytes))
    console.print(fmt_table)
    console.print(f"total pool memory: {total / 2**30:.3f} GiB")


def describe(layout: CacheLayoutDesc) -> dict[str, Any]:
    """The layout's wire dictionary (named fields only) plus the derived values a reader wants: each
    coalesced buffer's ``size``/``num_buffers``, each slot's ``slot_size_list``, and per layer group
    its buffers' pool, offset, size and ``expansion``. ``CacheLayoutDesc.from_dict`` reads it back."""
    d = layout.to_dict()
    for pg_wire, pg in zip(d["pool_groups"], layout.pool_groups, strict=True):
        pg_wire["slot_desc"]["slot_size_list"] = list(pg.slot_desc.slot_size_list)
        for v_wire, v in zip(pg_wire["slot_desc"]["variants"], pg.slot_desc.variants, strict=True):
            v_wire["slot_size_list"] = list(v.slot_size_list)
            for cb_wire, cb in zip(v_wire["coalesced_buffers"], v.coalesced_buffers, strict=True):
                cb_wire["size"], cb_wire["num_buffers"] = cb.size, cb.num_buffers
            v_wire["buffer_spans"] = [
                {"buffer_id": plain(s.buffer_id), "pool_index": s.pool_index, "offset": s.offset, "size": s.size,
                 "expansion": layout.expansion_of(s.buffer_id)} for s in v.buffer_spans()]
    return d


def main(a: argparse.Namespace) -> int:
    """Run `kvxfer inspect` with parsed options."""
    layout = plan_layout(config_from_args(a))
    if a.json:
        print(json.dumps(describe(layout), indent=2))
    else:
        console = Console()
        render(layout, console if console.is_terminal else Console(width=132))
    return 0
