-- The basic-auth user store lives in its own database beside MLflow's (see compose-auth.ini).
CREATE DATABASE mlflow_auth OWNER mlflow;
