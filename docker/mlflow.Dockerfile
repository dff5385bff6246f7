# MLflow tracking server for the cluster path: PostgreSQL backend store (psycopg 3, SQLAlchemy 2.1's
# postgresql:// driver), S3 artifacts proxied by the server (boto3), basic-auth (mlflow[auth]).
# Versions are the pin set's (constraints/cpu.txt). Build: docker build -f docker/mlflow.Dockerfile docker/
FROM python:3.11.14-slim-bookworm

# uv installs (pip only bootstraps it), as scripts/install.sh does.
RUN pip install --no-cache-dir "uv==0.13.8" \
    && uv pip install --system --no-cache "mlflow[auth]==3.17.2" "psycopg[binary]==3.3.9" "boto3==1.44.8" \
    && useradd --create-home --uid 1000 mlflow

USER 1000
WORKDIR /home/mlflow
EXPOSE 5000
# The backend store URI (it may hold a password) comes from MLFLOW_BACKEND_STORE_URI, never from argv.
ENV MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false
ENTRYPOINT ["mlflow", "server"]
CMD ["--host", "0.0.0.0", "--port", "5000"]
