# The router's image: `narwhal serve` on the config mounted at
# /etc/narwhal/narwhal.toml (deploy/kubernetes/ mounts it from a ConfigMap).
#
#   docker build -t narwhal:0.1.0 .
#   docker run --rm -v "$PWD/narwhal.toml:/etc/narwhal/narwhal.toml:ro" -p 8000:8000 narwhal:0.1.0
#   docker run --rm -v ... narwhal:0.1.0 serve --config /etc/narwhal/narwhal.toml --check-config
#
# Two stages: the first installs Narwhal exactly as the README's set-up line
# does, with a C compiler at hand so that setup.py compiles the core's hot
# modules (docs/operate.md, "Compiled core"); the second is the same base
# image without the compiler, with the installed tree copied over.

FROM python:3.11-slim AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY . .
# The README's install line (README.md, "Set up"), without its last step,
# `narwhal demo`, which would serve instead of finishing the build.
RUN python3.11 -m venv .venv && . .venv/bin/activate && pip install -e . \
 && python -m compileall -q narwhal narwhal_build narwhal_core narwhal_runtime narwhal_trio narwhal_asyncio narwhal_sim narwhal_bench \
 && rm -rf build

FROM python:3.11-slim
# A user of its own, with no login shell and no home to write to, and the
# directory of the journal the deploy/kubernetes/ config names (there an
# emptyDir volume is mounted on it; without one, `docker run` writes it in
# the container's own layer).
RUN groupadd --system --gid 10001 narwhal \
 && useradd --system --uid 10001 --gid narwhal --no-create-home --shell /usr/sbin/nologin narwhal \
 && mkdir -p /var/lib/narwhal && chown narwhal:narwhal /var/lib/narwhal
# The same path as in the build stage: the virtual environment and the
# editable install name /app. COPY keeps the files' times, so the compiled
# modules stay newer than their sources (no core_stale at start-up).
COPY --from=build /app /app
ENV PATH=/app/.venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
WORKDIR /app
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["narwhal"]
CMD ["serve", "--config", "/etc/narwhal/narwhal.toml"]
