#!/usr/bin/env bash
# Download the wheels that `python -m forkjax.serve` (the serve extra) and NVIDIA aiperf
# (`aiperf profile`, an external benchmark client: scripts/bench_external.sh) need on an offline
# Python 3.12 x86-64 GPU machine that already has jax, numpy, transformers (+ huggingface_hub,
# tokenizers, ...), jinja2, click, anyio and prometheus-client. About 34 MiB in all
# (typing_extensions is carried: pydantic needs >=4.16, newer than what torch may have brought).
# One version of each package: the server and aiperf install into one folder.
#
# Only the runtime closure of `aiperf profile` is fetched: aiperf's plotting,
# dashboard, kubernetes, optuna, accuracy and dataset-hub extras (pandas,
# scipy, pyarrow, datasets, matplotlib, plotly, dash, textual, ...) are
# left out on purpose; they are imported lazily and never on this path.
#
# On the target:  python3 -m pip install -q --no-index --no-deps --no-compile \
#                   --no-cache-dir --target /tmp/site .whl/*.whl
#                 PYTHONPATH=/tmp/site python3 -m aiperf profile ...
# (scripts/bench_external.sh does the PYTHONPATH part itself.)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
mkdir -p "$DEST"
PIP=${PIP:-python3 -m pip}
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DEST" \
  aiperf==0.13.0 \
  aiofiles==24.1.0 aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 \
  annotated-types==0.8.0 attrs==26.1.0 crick==0.0.8 cyclopts==4.25.3 \
  docstring-parser==0.18.0 ffmpeg-python==0.2.0 frozenlist==1.8.0 future==1.0.0 \
  jmespath==1.0.1 markdown-it-py==4.3.0 mdurl==0.1.2 msgspec==0.23.0 \
  multidict==7.2.1 orjson==3.11.9 pillow==12.3.0 prometheus-client==0.23.1 \
  propcache==0.5.4 psutil==7.0.0 pydantic==2.14.4 pydantic-core==2.50.5 \
  pydantic-settings==2.16.3 pygments==2.21.0 python-dotenv==1.2.4 \
  pyzmq==26.4.0 rich==14.1.0 rich-rst==2.2.0 ruamel-yaml==0.18.17 \
  ruamel-yaml-clib==0.2.15 setproctitle==1.3.8 typing-inspection==0.4.5 \
  uvloop==0.23.0 yarl==1.25.1 typing-extensions==4.16.0 \
  httpx==0.29.0 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 annotated-doc==0.0.7 \
  opentelemetry-api==1.45.3 openai==3.63.0 jiter==0.19.0 sniffio==1.3.1 httpx2==2.17.0 \
  httpcore2==2.17.0 truststore==0.10.5 httptools==0.9.0
# (httpx, httpcore, h11, anyio: huggingface_hub's HTTP stack, carried in case the target's lacks
#  them; from fastapi on: the server and its openai client.)
ls "$DEST"/*.whl | wc -l | xargs echo "wheels:"
du -ch "$DEST"/*.whl | tail -1
