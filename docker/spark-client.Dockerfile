# A PySpark client beside a flightdeck cluster (docker/compose.yaml): Spark 4
# in local mode with flightdeck's Python client and data source. Build from
# the repository root (compose does).
FROM python:3.11-slim-trixie
RUN apt-get update \
    && apt-get install -y --no-install-recommends openjdk-21-jre-headless \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /work
COPY client/python client/python
RUN pip install --no-cache-dir "pyspark>=4.0" "pandas>=2.2,<3" ./client/python
COPY docker/try_cluster.py try_cluster.py
CMD ["python", "try_cluster.py"]
