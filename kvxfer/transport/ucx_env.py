"""UCX environment defaults, applied before a UCX binding (NIXL or ucxx) is first imported.

Both bindings read UCX variables once, at import. kvxfer sets defaults that the measurements in
docs/transport.md call for, and never overrides a variable the user already set.
"""

from __future__ import annotations

import os

#: Defaults: READ on CUDA memory through cuda_ipc zero-copy instead of a tcp emulation. UCX_TLS is
#: left alone (its default offers every transport, tcp included, which connection set-up needs;
#: ``UCX_TLS=sm`` alone breaks it). Endpoint error handling is turned off per endpoint by each
#: backend, which is what lets UCX pick shared memory and CMA on one host.
UCX_DEFAULTS: dict[str, str] = {
    "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}


def apply_ucx_defaults() -> dict[str, str]:
    """Set each default the environment does not already define; return what was set."""
    applied: dict[str, str] = {}
    for key, value in UCX_DEFAULTS.items():
        if key not in os.environ:
            os.environ[key] = value
            applied[key] = value
    return applied
