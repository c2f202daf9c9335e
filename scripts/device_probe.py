"""One-shot probe of the GPU machine: versions, CUDA driver APIs, NIXL on VRAM, ucxx import."""
import os
import sys
import time

os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
import torch

print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
from cuda.bindings import driver, runtime  # noqa: E402

print("cuda.bindings has cuMemcpyBatchAsync:", hasattr(driver, "cuMemcpyBatchAsync"),
      "cudaMemcpyBatchAsync:", hasattr(runtime, "cudaMemcpyBatchAsync"))
err, ver = driver.cuDriverGetVersion()
print("driver version", ver)
from kvxfer.cache import CacheConfig, KVCacheManager  # noqa: E402

m = KVCacheManager(CacheConfig.for_model(4, 8, 128, 32, "bfloat16", 64, device="cuda:0"))
v = m.buffer_view(1, "value")
v[3].fill_(2.5)
print("cuda manager ok", m.layout.pool_groups[0].pools[0].memory_kind, float(v[3].float().mean()))
which = sys.argv[1] if len(sys.argv) > 1 else "nixl"
if which == "nixl":
    sys.path.insert(0, os.environ["KVXFER_SITE_NIXL"])
    from kvxfer.transport.ucx_env import load_nixl_api
    nixl_api = load_nixl_api()
    nixl_agent, nixl_agent_config = nixl_api.nixl_agent, nixl_api.nixl_agent_config
    cfg = nixl_agent_config(backends=["UCX"])
    a, b = nixl_agent("A", cfg), nixl_agent("B", cfg)
    src = torch.arange(1 << 24, dtype=torch.uint8, device="cuda")
    dst = torch.zeros(1 << 24, dtype=torch.uint8, device="cuda")
    a.register_memory([(src.data_ptr(), src.numel(), 0, "")], "VRAM")
    b.register_memory([(dst.data_ptr(), dst.numel(), 0, "")], "VRAM")
    a.add_remote_agent(b.get_agent_metadata())
    b.add_remote_agent(a.get_agent_metadata())
    for op in ("WRITE", "READ"):
        dst.zero_()
        ag, loc, rem, peer = (a, src, dst, "B") if op == "WRITE" else (b, dst, src, "A")
        x = ag.initialize_xfer(op, ag.get_xfer_descs([(loc.data_ptr(), 1 << 24, 0)], "VRAM"),
                               ag.get_xfer_descs([(rem.data_ptr(), 1 << 24, 0)], "VRAM"), peer, b"n")
        t = time.perf_counter()
        ag.transfer(x)
        while ag.check_xfer_state(x) not in ("DONE", "ERR"):
            pass
        torch.cuda.synchronize()
        print("nixl", op, ag.check_xfer_state(x), bool((dst == src).all()), f"{(1 << 24) / (time.perf_counter() - t) / 1e9:.1f} GB/s")
else:
    sys.path.insert(0, os.environ["KVXFER_SITE_UCXX"])
    import ucxx
    print("ucxx", ucxx.__version__)
