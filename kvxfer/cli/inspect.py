"""`kvxfer inspect`: build a cache layout from model dimensions and show it as a table or JSON."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from kvxfer.cache.config import CacheConfig, RoleSpec
from kvxfer.cache.descriptors import CacheLayoutDesc
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
    pool_table = Table(title="Pools")
    for col in ("pool", "slots", "slot bytes", "buffer bytes", "per slot", "MiB", "first buffers"):
        pool_table.add_column(col, justify="right" if col != "first buffers" else "left")
    total = 0
    for pg in layout.pool_groups:
        for pool, slot in zip(pg.pools, pg.slots, strict=True):
            total += pool.nbytes
            first = ", ".join(f"L{e.buffer_id.layer_id}.{e.buffer_id.role}@{e.offset}" for e in slot.expanded()[:3])
            pool_table.add_row(f"{pg.pool_group_index}.{pool.pool_index}", str(pool.num_slots), str(pool.slot_bytes),
                               str(slot.coalesced.single_buffer_size), str(slot.buffers_per_slot),
                               f"{pool.nbytes / 2**20:.1f}", first + (", ..." if len(slot.expanded()) > 3 else ""))
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


def main(a: argparse.Namespace) -> int:
    """Run `kvxfer inspect` with parsed options."""
    layout = plan_layout(config_from_args(a))
    if a.json:
        print(layout.to_json())
    else:
        console = Console()
        render(layout, console if console.is_terminal else Console(width=132))
    return 0
