# The hub on SQLite, its database in the /data volume:
#   docker build -t atropos-hub . && docker run -p 8000:8000 -v atropos-data:/data atropos-hub
# Mount your own config.json / compression.json over the defaults in /etc/atropos.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# The dependencies first, at the exact versions tested (requirements.lock; refreshed by
# scripts/lock_requirements.py): this layer is rebuilt only when they change, not on
# every change to the code.
COPY pyproject.toml requirements.lock ./
RUN pip install -r requirements.lock

# Then the hub itself, without resolving anything again; pip check fails the build if
# pyproject.toml asks for something the lock does not hold.
COPY README.md config.json.example compression.json.example ./
COPY migrations ./migrations
COPY app ./app
RUN pip install --no-deps . \
 && pip check \
 && install -D -m 0644 config.json.example /etc/atropos/config.json \
 && install -D -m 0644 compression.json.example /etc/atropos/compression.json \
 && useradd --system --uid 10001 --home-dir /data --shell /usr/sbin/nologin atropos \
 && mkdir -p /data && chown atropos /data

# Environment overrides (ATROPOS_<SECTION>__<KEY>) beat whatever config is mounted: the
# database and the jsonl target's batch files live in the volume, and the server listens
# where EXPOSE and HEALTHCHECK say.
ENV ATROPOS_TRACE_SERVER__DB_PATH=/data/traces.db \
    ATROPOS_DISTRIBUTOR__OUTPUT_DIR=/data/batches \
    ATROPOS_TRACE_SERVER__HOST=0.0.0.0 \
    ATROPOS_TRACE_SERVER__PORT=8000

USER atropos
WORKDIR /data
# Declared after the chown so that a new named volume starts out owned by atropos.
VOLUME /data
EXPOSE 8000

# slim has no curl: ask /healthz with Python.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]

CMD ["atropos", "serve", "--config", "/etc/atropos/config.json", "--compression", "/etc/atropos/compression.json"]
