"""UCX environment defaults, applied before a UCX binding (NIXL or ucxx) is first imported.

Both bindings read UCX variables once, when their UCX library loads. kvxfer sets defaults that the
measurements in docs/transport.md call for, and never overrides a variable the user already set.
``load_nixl_api`` is the one way kvxfer loads NIXL, so no process can load it before the defaults.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

#: Import names of the NIXL wheels, in order of preference (nixl-cu13, nixl-cu12, the meta package).
NIXL_MODULES = ("nixl_cu13", "nixl_cu12", "nixl")

#: Defaults: READ on CUDA memory through cuda_ipc zero-copy instead of a tcp emulation. UCX_TLS is
#: left alone (its default offers every transport, tcp included, which connection set-up needs;
#: ``UCX_TLS=sm`` alone breaks it). Endpoint error handling is turned off per endpoint by each
#: backend, which is what lets UCX pick shared memory and CMA on one host.
#:
#: ``UCX_MODULES=^efa``: the NIXL wheels bundle their own rdma-core and libnl, but UCX's EFA module
#: links the host's ``libefa``, which pulls in the host's ``libibverbs`` and ``libnl-route-3``. Two
#: copies of libnl-route then share one symbol scope, and at process exit the host copy's destructor
#: runs the bundled ``rtnl_tc_unregister`` on its own (differently laid out) structures: SIGSEGV (exit
#: 139) after everything else succeeded, on every host with ``libibverbs1`` installed. No release of
#: agents or memory avoids it (the crash is in library destructors, after Python is gone), so the
#: module that loads the second copy is not loaded. NIXL reaches EFA through its LIBFABRIC backend;
#: a user who wants UCX's EFA transport sets UCX_MODULES and owns that exit.
UCX_DEFAULTS: dict[str, str] = {
    "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "UCX_MODULES": "^efa",
}


def apply_ucx_defaults() -> dict[str, str]:
    """Set each default the environment does not already define; return what was set."""
    applied: dict[str, str] = {}
    for key, value in UCX_DEFAULTS.items():
        if key not in os.environ:
            os.environ[key] = value
            applied[key] = value
    return applied


def nixl_module() -> str | None:
    """The import name of the installed NIXL binding (found without importing it), or None."""
    for name in NIXL_MODULES:
        if importlib.util.find_spec(name) is not None:
            return name
    return None


def load_nixl_api() -> ModuleType:
    """NIXL's Python API module (``nixl_agent``, ``nixl_agent_config``), imported after the UCX defaults
    are in the environment. ImportError when no binding is installed, as importing it would raise."""
    module = nixl_module()
    if module is None:
        raise ImportError(f"no NIXL binding is installed (tried {', '.join(NIXL_MODULES)})")
    apply_ucx_defaults()
    return importlib.import_module(f"{module}._api")
