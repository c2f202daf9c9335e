#!/usr/bin/env bash
# Source on the lent GPU machine: installs the carried wheels (see ../shared/tools/device-wheels)
# into per-binding folders, exports the paths, then sources scripts/device_session.sh (the output
# folder, PYTHONPATH with both bindings, the shared helpers). Usage: source scripts/device_setup.sh
set -e
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PIPI="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir"
$PIPI --target /tmp/site_extra .devwheels/extra/*.whl
[ -d .devwheels/nixl ] && $PIPI --target /tmp/site_nixl .devwheels/nixl/*.whl
[ -d .devwheels/ucxx ] && $PIPI --target /tmp/site_ucxx .devwheels/ucxx/*.whl
export KVXFER_SITE_NIXL=/tmp/site_nixl KVXFER_SITE_UCXX=/tmp/site_ucxx
export PYTHONPATH=$PWD:/tmp/site_extra
set +e
source scripts/device_session.sh
