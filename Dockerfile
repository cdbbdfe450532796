# AstraFlow, CPU image: every component (`astraflow acquire|raas|policy|trainer|exporter ...`) runs from it;
# docker-compose.yml starts the whole arith-tiny example with it. Built from the locked dependency set
# (requirements/dev.lock, hash-checked) by the same scripts/install.sh the tests use.
#   docker build -t astraflow:cpu .
# GPU variant: start FROM an image with CUDA and a CUDA build of torch (e.g. pytorch/pytorch:*-cuda*-runtime),
# install with `scripts/install.sh gpu` (the gpu lock: SGLang, DeepSpeed), and give the trainer and RaaS
# services GPUs (compose: `deploy.resources.reservations.devices: [{capabilities: [gpu]}]`).
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap curl ca-certificates \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY setup.cfg pyproject.toml README.md ./
COPY requirements/ requirements/
# the locked dependencies first, in a layer of their own: a change to the code rebuilds only the layers after it
COPY scripts/install.sh scripts/uv.sh scripts/venv_stamp.sh scripts/apt_install.sh scripts/
RUN bash scripts/install.sh dev --deps-only && rm -rf /root/.cache/uv
COPY scripts/ scripts/
COPY astraflow/ astraflow/
COPY consumers/ consumers/
COPY policies/ policies/
COPY producers/ producers/
COPY topics/ topics/
COPY trainer/ trainer/
COPY weights/ weights/
COPY examples/ examples/
RUN bash scripts/install.sh dev && rm -rf /root/.cache/uv
# compile the delta codec's kernels (weights/kernels.py) into the image for bf16 and fp32 weights, so that a new
# container's first delta does not wait for numba (a few seconds)
RUN .venv/bin/python -c "import torch; from weights.codec import apply_delta, encode_delta; \
    [apply_delta(encode_delta({'w': torch.zeros(64, dtype=d)}, {'w': torch.ones(64, dtype=d)}, base_version=0, \
    version=1).data, {'w': torch.zeros(64, dtype=d)}) for d in (torch.bfloat16, torch.float32)]"
# build the built-in tiny model (weights/models.py: `model: tiny`, about a minute of SFT on a CPU) into the image's cache, so
# that every container of a run starts from the same model and none spends its start on building it
RUN .venv/bin/python -c "from weights.models import tiny_model_dir; print(tiny_model_dir())"
ENV PATH=/app/.venv/bin:$PATH PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
ENTRYPOINT ["astraflow"]
CMD ["--help"]
