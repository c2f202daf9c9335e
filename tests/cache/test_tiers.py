"""Host and disk tiers: slot layout equal to the primary's, own allocators, addressing, disk files and errors."""

from __future__ import annotations

import os
import re
import stat
import subprocess

import numpy as np
import pytest
import torch

from kvxfer.cache.config import DiskTier, HostTier
from kvxfer.cache.manager import KVCacheManager
from kvxfer.cache.tiers import (
    DISK_ADDRESS_BASE,
    DiskTierStorage,
    open_host_tier,
    primary_tier_of,
)
from kvxfer.errors import BlockIdError, ConfigError, TierError
from tests.support.tier_helpers import fill_random, multi_pool_config, slot_bytes_of


@pytest.fixture
def config(tmp_path):  # type: ignore[no-untyped-def]
    return multi_pool_config(str(tmp_path))


def test_host_tier_has_the_primary_slot_layout_and_its_own_quota(config) -> None:  # type: ignore[no-untyped-def]
    manager = KVCacheManager(config)
    primary = primary_tier_of(manager)
    with open_host_tier(config) as host:
        assert host.layout.fingerprint == primary.layout.fingerprint
        assert [pg.num_slots for pg in primary.layout.pool_groups] == [24, 24]
        assert [pg.num_slots for pg in host.layout.pool_groups] == [16, 16]
        for hpg, ppg in zip(host.layout.pool_groups, primary.layout.pool_groups, strict=True):
            assert [p.slot_bytes for p in hpg.pools] == [p.slot_bytes for p in ppg.pools]
        assert len(host.layout.pool_groups[0].pools) == 2  # key/value pool + scale pool
        expected_kind = "pinned" if torch.cuda.is_available() else "cpu"
        assert host.memory_kind == expected_kind
        assert {p.memory_kind for pg in host.layout.pool_groups for p in pg.pools} == {expected_kind}


def test_host_tier_pinned_true_without_cuda_is_a_clear_error(config) -> None:  # type: ignore[no-untyped-def]
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA, so pinned=True is valid here")
    with pytest.raises(TierError, match="pinned=True needs CUDA"):
        open_host_tier(config, HostTier(config.tiers[1].quota_bytes, pinned=True))


def test_host_tier_quota_below_one_block_is_a_tier_error(config) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TierError, match=r"HostTier.quota_bytes=100: .*holds no block"):
        open_host_tier(config, HostTier(100))


def test_missing_host_tier_in_config_is_named(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvxfer.cache.config import CacheConfig

    cfg = CacheConfig.for_model(2, 2, 32, 16, "float16", 8)
    with pytest.raises(ConfigError, match="no HostTier"):
        open_host_tier(cfg)


def test_slot_addresses_are_base_plus_slot_times_slot_bytes(config) -> None:  # type: ignore[no-untyped-def]
    with open_host_tier(config) as host:
        for pg in host.layout.pool_groups:
            for p in pg.pools:
                slots = np.array([0, 5, 15, 3])
                addr = host.slot_addresses(pg.pool_group_index, p.pool_index, slots)
                assert addr.dtype == np.uint64
                assert addr.tolist() == [p.base_address + int(s) * p.slot_bytes for s in slots]
                assert p.base_address == host.pool_tensor(pg.pool_group_index, p.pool_index).data_ptr()
        with pytest.raises(BlockIdError, match=r"slot id .*16.* outside \[0, 16\)"):
            host.slot_addresses(0, 0, [16])
        with pytest.raises(TierError, match=r"no pool 0.7"):
            host.slot_addresses(0, 7, [0])


def test_tier_allocators_are_independent_of_the_primary(config) -> None:  # type: ignore[no-untyped-def]
    manager = KVCacheManager(config)
    primary = primary_tier_of(manager)
    with open_host_tier(config) as host:
        got = host.allocator(1).alloc(10)
        assert got.tolist() == list(range(10))
        assert primary.allocator(1).num_free == 24 and manager.num_free_slots(1) == 24
        assert primary.allocator(1) is manager.allocator(1)
        stats = host.stats()
        assert stats.slots_used == (0, 10) and stats.slots_total == (16, 16)
        assert stats.total_bytes == sum(p.nbytes for pg in host.layout.pool_groups for p in pg.pools)
        with pytest.raises(TierError, match="no pool group 2"):
            host.allocator(2)


def test_pool_of_rejects_ranges_outside_or_across_pools(config) -> None:  # type: ignore[no-untyped-def]
    with open_host_tier(config) as host:
        p = host.layout.pool_groups[0].pools[0]
        ok = host.pool_of(np.array([p.base_address, p.end_address - 10], dtype=np.uint64),
                          np.array([p.nbytes, 10], dtype=np.uint64))
        assert ok.tolist() == [0, 0]
        with pytest.raises(TierError, match=r"range 1 \[.*\+11\) is not inside one pool"):
            host.pool_of(np.array([p.base_address, p.end_address - 10], dtype=np.uint64),
                         np.array([1, 11], dtype=np.uint64))
        with pytest.raises(TierError, match="range 0"):
            host.pool_of(np.array([p.base_address - 1], dtype=np.uint64), np.array([1], dtype=np.uint64))


def test_closed_tier_refuses_use(config) -> None:  # type: ignore[no-untyped-def]
    host = open_host_tier(config)
    host.close()
    host.close()
    with pytest.raises(TierError, match="host tier is closed"):
        host.slot_addresses(0, 0, [0])


# --- disk tier -------------------------------------------------------------------------------------
def test_disk_tier_preallocates_one_file_per_pool_and_removes_them_on_close(config, tmp_path) -> None:  # type: ignore[no-untyped-def]
    disk = DiskTierStorage(config)
    pools = [p for pg in disk.layout.pool_groups for p in pg.pools]
    assert len(disk.file_paths) == len(pools) == 4
    for path, p in zip(disk.file_paths, pools, strict=True):
        assert os.path.dirname(path) == str(tmp_path)
        st = os.stat(path)
        assert st.st_size == p.nbytes == p.slot_bytes * 20
        assert st.st_blocks * 512 >= p.nbytes  # really allocated, not sparse
        assert stat.S_IMODE(st.st_mode) == 0o600
    assert disk.memory_kind == "disk" and disk.is_file
    assert pools[0].base_address == DISK_ADDRESS_BASE
    ends = [p.end_address for p in pools]
    assert all(b.base_address > e for e, b in zip(ends, pools[1:], strict=False))  # gaps between files
    disk.close()
    assert os.listdir(tmp_path) == []
    disk.close()


def test_disk_tier_resolve_maps_addresses_to_file_offsets(config) -> None:  # type: ignore[no-untyped-def]
    with DiskTierStorage(config) as disk:
        addr = np.concatenate([disk.slot_addresses(1, 1, [3, 0]), disk.slot_addresses(0, 0, [19])])
        sizes = np.array([5, 5, 5], dtype=np.uint64)
        files, offsets = disk.resolve(addr, sizes)
        p11, p00 = disk.layout.pool_groups[1].pools[1], disk.layout.pool_groups[0].pools[0]
        assert files.tolist() == [3, 3, 0]
        assert offsets.tolist() == [3 * p11.slot_bytes, 0, 19 * p00.slot_bytes]
        with pytest.raises(TierError, match="not inside one pool"):
            disk.resolve(np.array([p00.end_address], dtype=np.uint64), np.array([1], dtype=np.uint64))


@pytest.mark.parametrize("direct", [None, False])
def test_disk_read_write_exact_bytes_aligned_and_unaligned(config, direct) -> None:  # type: ignore[no-untyped-def]
    with DiskTierStorage(config, direct_io=direct) as disk:
        if direct is False:
            assert not disk.direct_io
        rng = np.random.default_rng(7)
        scratch = torch.empty(3 * 4096 + 4096, dtype=torch.uint8)
        skew = (-scratch.data_ptr()) % 4096
        buf = scratch[skew:skew + 3 * 4096].numpy()
        buf[:] = rng.integers(0, 256, buf.size, dtype=np.uint8)
        disk.write_from(0, 4096, buf.data)           # aligned: O_DIRECT where available
        disk.write_from(0, 100, buf[:77].data)        # unaligned: buffered
        out = np.zeros(3 * 4096 + 4096, dtype=np.uint8)
        disk.read_into(0, 0, out.data)
        expected = np.zeros_like(out)
        expected[4096:4 * 4096] = buf
        expected[100:177] = buf[:77]
        assert np.array_equal(out, expected)
        with pytest.raises(TierError, match=r"range \[.*\) outside its"):
            disk.read_into(0, disk.layout.pool_groups[0].pools[0].nbytes - 10, out[:11].data)


def test_disk_tier_on_o_direct_filesystem_uses_it(config) -> None:  # type: ignore[no-untyped-def]
    with DiskTierStorage(config) as disk:
        probe = os.open(disk.file_paths[0], os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        os.close(probe)
        assert disk.direct_io is bool(getattr(os, "O_DIRECT", 0))


def test_missing_directory_fails_at_construction(tmp_path, config) -> None:  # type: ignore[no-untyped-def]
    missing = str(tmp_path / "nope")
    with pytest.raises(TierError, match=r"DiskTier.path '.*nope' does not exist"):
        DiskTierStorage(config, DiskTier(1 << 20, missing))


def test_path_that_is_a_file_fails_at_construction(tmp_path, config) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "afile"
    f.write_bytes(b"x")
    with pytest.raises(TierError, match="is not a directory"):
        DiskTierStorage(config, DiskTier(1 << 20, str(f)))


def test_read_only_directory_fails_at_construction_and_leaves_nothing(tmp_path, config) -> None:  # type: ignore[no-untyped-def]
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() == 0:
        # root ignores permission bits; the immutable attribute still refuses new files
        if subprocess.run(["chattr", "+i", str(ro)], capture_output=True).returncode != 0:
            pytest.skip("running as root without chattr +i support: cannot make a read-only directory")
    else:
        ro.chmod(0o555)
    try:
        with pytest.raises(TierError, match=r"not writable|cannot create pool file"):
            DiskTierStorage(config, DiskTier(1 << 20, str(ro)))
        assert os.listdir(ro) == []
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(ro)], check=True)
        else:
            ro.chmod(0o755)


def test_disk_quota_below_one_block_is_a_tier_error(tmp_path, config) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TierError, match=r"DiskTier.quota_bytes=10: .*holds no block"):
        DiskTierStorage(config, DiskTier(10, str(tmp_path)))
    assert os.listdir(tmp_path) == []


def test_removed_or_truncated_file_is_detected(config) -> None:  # type: ignore[no-untyped-def]
    with DiskTierStorage(config) as disk:
        disk.check_files()
        os.truncate(disk.file_paths[1], 100)
        with pytest.raises(TierError, match=r"truncated to 100 bytes"):
            disk.check_files()
    with DiskTierStorage(config) as disk:
        os.unlink(disk.file_paths[2])
        with pytest.raises(TierError, match=re.escape(disk.file_paths[2]) + " was removed"):
            disk.check_files()


def test_disk_tier_bytes_helper_sees_written_slots(config) -> None:  # type: ignore[no-untyped-def]
    with DiskTierStorage(config) as disk:
        fill_random(disk, 3)
        p = disk.layout.pool_groups[1].pools[1]
        with open(disk.file_paths[3], "rb") as f:
            raw = f.read()
        assert slot_bytes_of(disk, 1, 1, np.array([2])).tobytes() == raw[2 * p.slot_bytes:3 * p.slot_bytes]


_OWNER = """
import sys, time
from kvxfer.cache.tiers import DiskTierStorage
from tests.support.tier_helpers import multi_pool_config
disk = DiskTierStorage(multi_pool_config(sys.argv[1]))
print("\\n".join(disk.file_paths), flush=True)
time.sleep(120)
"""


def test_pool_files_of_a_killed_process_are_removed_by_the_next_disk_tier(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    owner = subprocess.Popen([os.sys.executable, "-c", _OWNER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        left = [owner.stdout.readline().strip() for _ in range(4)]   # type: ignore[union-attr]
    finally:
        owner.kill()
        assert owner.wait(timeout=30) == -9
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in left)   # a SIGKILL leaves them
    monkeypatch.setattr("kvxfer.cache.tiers.ORPHAN_MIN_AGE_S", 0.0)
    disk = DiskTierStorage(multi_pool_config(str(tmp_path)))
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in disk.file_paths)
    disk.close()
    assert os.listdir(tmp_path) == []


def test_pool_files_of_a_live_disk_tier_are_kept_and_young_orphans_too(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    first = DiskTierStorage(multi_pool_config(str(tmp_path)))
    stray = tmp_path / "kvxfer-1-0123456789ab-pg0-pool0.kv"   # unlocked, but just made
    stray.write_bytes(b"x")
    other = tmp_path / "notes-pg0-pool0.kv"                    # not a pool file's name: never touched
    other.write_bytes(b"x")
    second = DiskTierStorage(multi_pool_config(str(tmp_path)))
    assert all(os.path.exists(p) for p in first.file_paths) and stray.exists()
    monkeypatch.setattr("kvxfer.cache.tiers.ORPHAN_MIN_AGE_S", 0.0)
    third = DiskTierStorage(multi_pool_config(str(tmp_path)))
    assert all(os.path.exists(p) for p in first.file_paths + second.file_paths)   # their owner lives
    assert not stray.exists() and other.exists()
    for disk in (first, second, third):
        disk.close()
    assert os.listdir(tmp_path) == [other.name]
