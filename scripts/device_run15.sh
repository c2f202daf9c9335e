#!/usr/bin/env bash
# Issue 17, H200 run 15: the GPU transport tests on the final tree (driver launch, torch events), and a
# mutation (the copier's stream no longer waits for the model's stream: its test must fail).
source scripts/device_setup.sh >/dev/null 2>&1
echo "=== test_transport_gpu"
PYTHONPATH=$PYTHONPATH:/tmp/site_nixl:/tmp/site_ucxx timeout 150 python3 -m pytest -q -rf -p no:cacheprovider \
  tests/test_transport_gpu.py 2>&1 | grep -v "NIXL INFO" | tail -4
echo "=== mutation: the copy does not wait for the model's stream (its test must fail)"
rm -rf /tmp/mut && mkdir /tmp/mut && cp -r kvxfer tests pyproject.toml /tmp/mut/
sed -i '/self.stream.wait_event(self._model_done)/d' /tmp/mut/kvxfer/transport/cuda_copy.py
grep -c "wait_event(self._model_done)" /tmp/mut/kvxfer/transport/cuda_copy.py
(cd /tmp/mut && PYTHONPATH=/tmp/mut:/tmp/site_extra timeout 60 python3 -m pytest -q -p no:cacheprovider \
  tests/test_transport_gpu.py -k "models_stream" 2>&1 | grep -E "^E .*Error|passed|failed" | tail -4)
