"""Thin S3 I/O for promotion: adapter folders, conditional manifest writes, copies that verify sha256."""
from __future__ import annotations

import hashlib
import json
import logging
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Callable

from botocore.exceptions import ClientError
from pydantic import ValidationError
from boto3.s3.transfer import TransferConfig

from rlops.layout import (
    ADAPTER_CONFIG,
    RoutesManifest,
    S3Location,
    model_from_routes_key,
    routes_key,
    routes_prefix,
    routes_stamp_key,
    utc_now,
)

log = logging.getLogger(__name__)

Progress = Callable[[int], None]
CHUNK = 8 * 1024 * 1024
SINGLE_COPY_LIMIT = 5 * 1024**3  # CopyObject's limit; larger objects are copied in parts
SERVER_SIDE_COPY = TransferConfig(multipart_threshold=SINGLE_COPY_LIMIT, multipart_chunksize=512 * 1024**2)
STREAMING = TransferConfig(multipart_threshold=CHUNK, multipart_chunksize=CHUNK, max_concurrency=4)
STATUS_DIR = "_status"


class InvalidManifest(ValueError):
    """A published manifest that fails the schema or the name/folder grammar: read by nobody, rewritten by nobody."""


class ManifestConflict(RuntimeError):
    """Another writer published the manifest since we read it (conditional write failed)."""


@dataclass(frozen=True)
class ObjectRef:
    bucket: str
    key: str


@dataclass(frozen=True)
class FolderObject:
    name: str
    size: int
    last_modified: datetime
    etag: str = ""


def is_missing(exc: ClientError) -> bool:
    return exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound")


def list_folder(client, bucket: str, prefix: str) -> dict[str, FolderObject]:
    """Objects directly or deeply under `prefix/`, by name relative to it."""
    head = prefix.rstrip("/") + "/"
    found: dict[str, FolderObject] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=head):
        for obj in page.get("Contents", []):
            name = obj["Key"][len(head):]
            found[name] = FolderObject(name, obj["Size"], obj["LastModified"], obj.get("ETag", ""))
    return found


def list_subfolders(client, location: S3Location) -> list[str]:
    head = location.key("") + "/" if location.prefix else ""
    names = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=location.bucket, Prefix=head, Delimiter="/"):
        names.extend(p["Prefix"][len(head):].rstrip("/") for p in page.get("CommonPrefixes", []))
    return names


def read_range(client, ref: ObjectRef, start: int, length: int) -> bytes:
    body = client.get_object(Bucket=ref.bucket, Key=ref.key, Range=f"bytes={start}-{start + length - 1}")["Body"]
    return body.read()


def read_object(client, ref: ObjectRef) -> bytes:
    return client.get_object(Bucket=ref.bucket, Key=ref.key)["Body"].read()


def sha256_of(client, ref: ObjectRef, if_match: str | None = None) -> str:
    """sha256 of an object's bytes; with `if_match`, of that ETag's version only (else PreconditionFailed)."""
    digest = hashlib.sha256()
    condition = {"IfMatch": if_match} if if_match else {}
    body = client.get_object(Bucket=ref.bucket, Key=ref.key, **condition)["Body"]
    for chunk in body.iter_chunks(CHUNK):
        digest.update(chunk)
    return digest.hexdigest()


def server_side_copy(client, src: ObjectRef, dst: ObjectRef, size: int, progress: Progress | None = None,
                     if_match: str | None = None) -> str:
    """The bytes never leave the S3 server: one CopyObject, or UploadPartCopy parts above 5 GiB; with
    `if_match`, only of that ETag's version of the source. Returns the new object's ETag ("" when the
    multipart path was used: its ETag depends on the part size, so it proves nothing)."""
    source = {"Bucket": src.bucket, "Key": src.key}
    condition = {"CopySourceIfMatch": if_match} if if_match else {}
    if size >= SINGLE_COPY_LIMIT:
        client.copy(source, dst.bucket, dst.key, ExtraArgs=condition, Config=SERVER_SIDE_COPY, Callback=progress)
        return ""
    response = client.copy_object(CopySource=source, Bucket=dst.bucket, Key=dst.key, **condition)
    if progress is not None:
        progress(size)
    return response.get("CopyObjectResult", {}).get("ETag", "")


def streaming_copy(src_client, src: ObjectRef, dst_client, dst: ObjectRef, progress: Progress | None = None) -> None:
    """GET from one S3 and multipart-PUT into another as the bytes arrive (no temp file, bounded memory)."""
    body = src_client.get_object(Bucket=src.bucket, Key=src.key)["Body"]
    dst_client.upload_fileobj(body, dst.bucket, dst.key, Config=STREAMING, Callback=progress)


def upload_file(client, path: str, dst: ObjectRef, progress: Progress | None = None) -> None:
    client.upload_file(path, dst.bucket, dst.key, Config=STREAMING, Callback=progress)


def delete_keys(client, bucket: str, keys: list[str]) -> None:
    for start in range(0, len(keys), 1000):
        batch = [{"Key": k} for k in keys[start:start + 1000]]
        if batch:
            client.delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})


def delete_folder(client, bucket: str, prefix: str, names: list[str]) -> None:
    """adapter_config.json first, so the folder stops being an adapter before its weights go."""
    head = prefix.rstrip("/") + "/"
    ordered = sorted(names, key=lambda n: n != ADAPTER_CONFIG)
    if ADAPTER_CONFIG in ordered:
        client.delete_object(Bucket=bucket, Key=head + ADAPTER_CONFIG)
    delete_keys(client, bucket, [head + n for n in ordered if n != ADAPTER_CONFIG])


# ------------------------------------------------------------------------------------------------ manifest


def read_manifest(client, location: S3Location, model: str) -> tuple[RoutesManifest, str | None]:
    """The published manifest and its ETag; an empty manifest and None when none exists yet."""
    try:
        obj = client.get_object(Bucket=location.bucket, Key=routes_key(location, model))
    except ClientError as exc:
        if is_missing(exc):
            return RoutesManifest(model=model), None
        raise
    try:
        return RoutesManifest.model_validate_json(obj["Body"].read()), obj["ETag"]
    except ValidationError as exc:
        raise InvalidManifest(f"invalid routes manifest of {model!r} ({exc.error_count()} errors, first: "
                              f"{exc.errors()[0]['msg'][:200]}); syncs of it stop until it is fixed or removed") from None


def write_manifest(client, location: S3Location, manifest: RoutesManifest, etag: str | None) -> str:
    """Publish atomically (one PUT) only if nobody else did since we read `etag` (None: only if absent)."""
    condition = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
    try:
        response = client.put_object(
            Bucket=location.bucket, Key=routes_key(location, manifest.model),
            Body=manifest.model_dump_json(indent=2).encode(), ContentType="application/json", **condition,
        )
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code")
        if code in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409"):
            raise ManifestConflict(f"manifest of {manifest.model} changed concurrently") from None
        raise
    stamp_routes(client, location)
    return response["ETag"]


def delete_manifest(client, location: S3Location, model: str) -> None:
    client.delete_object(Bucket=location.bucket, Key=routes_key(location, model))
    stamp_routes(client, location)


def stamp_routes(client, location: S3Location) -> None:
    """Tell readers that `_routes/` changed (after the change, so a reader that sees the stamp sees the change).
    Best effort: the manifest is already published, and readers relist in full every few seconds anyway."""
    try:
        client.put_object(Bucket=location.bucket, Key=routes_stamp_key(location), Body=f"{utc_now()} {uuid.uuid4().hex}".encode())
    except Exception as exc:  # noqa: BLE001
        log.warning("routes stamp not written (%s): serving sees the change at its next full listing", type(exc).__name__)


def list_manifest_models(client, location: S3Location) -> dict[str, str]:
    """Model -> ETag of every published manifest, from one listing of `_routes/` (1000 keys a request)."""
    models = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=location.bucket, Prefix=routes_prefix(location)):
        for obj in page.get("Contents", []):
            model = model_from_routes_key(location, obj["Key"])
            if model is not None:
                models[model] = obj.get("ETag", "")
    return models


# ------------------------------------------------------------------------------------------ reconciler status


def status_key(location: S3Location, name: str) -> str:
    return location.key(STATUS_DIR, f"{name}.json")


def write_status(client, location: S3Location, name: str, data: dict) -> None:
    client.put_object(Bucket=location.bucket, Key=status_key(location, name), Body=json.dumps(data).encode(),
                      ContentType="application/json")


def read_status(client, location: S3Location, name: str) -> dict | None:
    try:
        return json.loads(read_object(client, ObjectRef(location.bucket, status_key(location, name))))
    except ClientError as exc:
        if is_missing(exc):
            return None
        raise
