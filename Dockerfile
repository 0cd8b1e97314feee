# One image for every slinfer service: the compose file picks the service with `slinfer <command>`.
#   docker build -t slinfer .                                         # CPU torch
#   docker build -t slinfer:gpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SLINFER_DATA_DIR=/data

# torch first and on its own layer: it is the big one and changes least.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY sim ./sim
RUN pip install . && slinfer --help >/dev/null

# Unprivileged user; /data (models, profiles) is created here so a named volume mounted on it
# starts out owned by that user.
RUN useradd --create-home --uid 10001 slinfer && mkdir -p /data && chown slinfer:slinfer /data
USER slinfer
VOLUME ["/data"]
EXPOSE 8000

CMD ["slinfer", "--help"]
