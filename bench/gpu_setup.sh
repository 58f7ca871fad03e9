#!/usr/bin/env bash
# Install what the lent GPU machines lack (vLLM 0.24 and its imports, our small wheels, and
# optionally Ray), from chunk folders already copied to /root/ws (docs/gpu.md).
#   bench/gpu_setup.sh            then run with:
#   PYTHONPATH=/root/site2:/root/site:/root/site3:$PWD:$PWD/bench \
#   VLLM_WORKER_MULTIPROC_METHOD=spawn VLLM_USE_FLASHINFER_SAMPLER=0 python ...
set -euo pipefail
wheels=${1:-.whl}
cd /root/ws
cat part* | tar xf -
python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site2 "$OLDPWD/$wheels"/*.whl
if ls rpart* >/dev/null 2>&1; then  # Ray: its own wheel, and only the imports the machine lacks
  cat rpart* | tar xf -
  python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site3 rwhl/ray-*.whl
  for pair in click:click filelock:filelock jsonschema:jsonschema msgpack:msgpack \
              google.protobuf:protobuf yaml:pyyaml requests:requests attrs:attrs \
              referencing:referencing rpds:rpds_py jsonschema_specifications:jsonschema_specifications \
              charset_normalizer:charset_normalizer idna:idna urllib3:urllib3 certifi:certifi; do
    module=${pair%%:*}; wheel=${pair##*:}
    if ! PYTHONPATH=/root/site2:/root/site python3 -c "import $module" 2>/dev/null; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site3 rwhl/${wheel}-*.whl
    fi
  done
fi
cd "$OLDPWD"
PYTHONPATH=/root/site2:/root/site:/root/site3 python3 -c "import vllm, zmq; print('vllm', vllm.__version__)"
PYTHONPATH=/root/site2:/root/site:/root/site3 python3 -c "import ray; print('ray', ray.__version__)" || true
