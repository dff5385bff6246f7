"""The one sync: make the served routes manifest of a registered model match its registry aliases.

Order of effects, which is what makes a crash at any point safe and a rerun complete:
1. for each alias target: copy the version's files into its immutable folder (weights first,
   adapter_config.json last), verifying each copy's sha256 against what the tracker recorded;
2. read the manifest (M), re-read the registry (R), and publish with a conditional PUT on M's ETag (P).
A manifest therefore only ever names verified folders, and since every publish re-reads the registry
after the manifest it replaces, an older intent cannot overwrite a newer one (a lost race retries).
"""
from __future__ import annotations

import functools
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Protocol

import boto3
import mlflow
from botocore.config import Config as BotoConfig

from registry_hooks import registry, storage
from registry_hooks.adapter import (
    AdapterPolicy,
    InvalidAdapter,
    check_adapter_config,
    check_files,
    check_safetensors_header,
    copy_order,
    parse_adapter_config,
    safetensors_header_length,
)
from registry_hooks.plan import (
    guardrail_refusal,
    newly_promoted,
    next_manifest,
    parse_time,
    promotion_record,
    served_aliases,
    served_targets,
    with_preview,
)
from rlops.config import Config, artifacts_s3_client_kwargs, s3_client_kwargs
from rlops.layout import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    REGISTRY_ACTOR,
    AliasRoute,
    RoutesManifest,
    S3Location,
    TAG_FORCE,
    parse_s3_uri,
    utc_now,
    version_folder,
)
from tracker.lineage import base_files, content_digest

MAX_ROUNDS = 8
HEADER_PROBE_BYTES = 1024 * 1024
TAG_VALUE_LIMIT = 5000
BOTO = BotoConfig(retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=5, read_timeout=60)


class PromotionError(RuntimeError):
    """A promotion/sync problem with a message for the user; `exit_code` is what the CLI exits with."""

    exit_code = 1


class NotFound(PromotionError):
    exit_code = 3


class Refused(PromotionError):
    exit_code = 4


class SyncConflict(PromotionError):
    exit_code = 5


class Forbidden(PromotionError):
    """MLflow refused the authenticated user the permission the move needs (403); nothing was changed."""

    exit_code = 8


@dataclass
class SyncReport:
    model: str
    trigger: str
    generation: int = 0
    changed: bool = False
    served: dict[str, int] = field(default_factory=dict)
    canaries: dict[str, dict] = field(default_factory=dict)  # alias -> {"version", "weight"}
    shadows: dict[str, dict] = field(default_factory=dict)  # alias -> {"version", "percent"}
    promoted: dict[str, int] = field(default_factory=dict)
    refused: dict[str, dict] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)
    copy_mode: str | None = None
    bytes_copied: int = 0
    seconds: float = 0.0
    seconds_to_publish: float | None = None  # sync start -> manifest PUT done (None: nothing published)
    verify: dict | None = None  # the live eval gate's figures (`--verify`)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


class SourceFiles(Protocol):
    """One version's adapter files wherever they are; `copy_to` puts one file into the serving bucket."""

    sizes: dict[str, int]

    def read(self, name: str) -> bytes: ...
    def read_range(self, name: str, start: int, length: int) -> bytes: ...

    def copy_to(self, name: str, dst: storage.ObjectRef) -> str | None:
        """Copy one file; return the copy's sha256 when the copy path itself proved it, else None."""


class S3SourceFiles:
    def __init__(self, promoter: "Promoter", location: S3Location, mode: str):
        self.p, self.location, self.mode = promoter, location, mode
        self.objects = storage.list_folder(promoter.source, location.bucket, location.prefix)
        self.sizes = {n: o.size for n, o in self.objects.items()}

    def _ref(self, name: str) -> storage.ObjectRef:
        return storage.ObjectRef(self.location.bucket, self.location.key(name))

    def read(self, name: str) -> bytes:
        return storage.read_object(self.p.source, self._ref(name))

    def read_range(self, name: str, start: int, length: int) -> bytes:
        return storage.read_range(self.p.source, self._ref(name), start, length)

    def copy_to(self, name: str, dst: storage.ObjectRef) -> str | None:
        if self.mode != "server_side":
            storage.streaming_copy(self.p.source, self._ref(name), self.p.dest, dst, self.p.on_bytes)
            return None
        # Hash the source while the server copies that same version of it (both conditional on the listed
        # ETag). A copy with the source's ETag (MD5 or multipart MD5-of-parts) holds the bytes just hashed,
        # so nothing is read back; any other ETag and the caller reads the copy back.
        source_etag = self.objects[name].etag
        with ThreadPoolExecutor(max_workers=1) as pool:
            source_sha256 = pool.submit(storage.sha256_of, self.p.source, self._ref(name), source_etag)
            copied_etag = storage.server_side_copy(self.p.dest, self._ref(name), dst, self.sizes[name],
                                                   self.p.on_bytes, if_match=source_etag)
            digest = source_sha256.result()
        same = source_etag and copied_etag.strip('"') == source_etag.strip('"')  # quoted in listings, not in copies
        return digest if same else None


class DownloadedFiles:
    """Files fetched through MLflow's artifact proxy (an artifact store that is not S3)."""

    def __init__(self, promoter: "Promoter", root: Path):
        self.p, self.root = promoter, root
        self.sizes = {str(f.relative_to(root)): f.stat().st_size for f in root.rglob("*") if f.is_file()}

    def read(self, name: str) -> bytes:
        return (self.root / name).read_bytes()

    def read_range(self, name: str, start: int, length: int) -> bytes:
        with open(self.root / name, "rb") as fh:
            fh.seek(start)
            return fh.read(length)

    def copy_to(self, name: str, dst: storage.ObjectRef) -> str | None:
        storage.upload_file(self.p.dest, str(self.root / name), dst, self.p.on_bytes)
        return None


def adapter_policy(config: Config) -> AdapterPolicy:
    return AdapterPolicy(
        max_rank=config.serving.max_lora_rank,
        base_models=frozenset([config.base_model_source, config.serving.base_model_id,
                               *config.registry.accepted_base_models]),
        target_modules=frozenset(config.registry.allowed_target_modules),
        tower_connector_lora=config.serving.enable_tower_connector_lora,
        base_sha256=served_base_digest(config.base_model_source),
    )


def served_base_digest(source: str) -> str | None:
    """The served base's content digest (None: not a local folder), hashed again only when its files change."""
    folder = Path(source)
    if not folder.is_dir():
        return None
    stats = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in base_files(folder))
    return _digest_of(str(folder.resolve()), stats)


@functools.lru_cache(maxsize=8)
def _digest_of(folder: str, stats: tuple) -> str | None:  # stats: part of the cache key only
    return content_digest(folder)


class Promoter:
    """Clients and policy for one command or loop iteration. Tests pass their own (hooked) clients."""

    def __init__(self, config: Config, *, mlflow_client=None, dest_s3=None, source_s3=None, progress=None):
        self.config = config
        self.location = parse_s3_uri(config.lora_path)
        self.mlflow = mlflow_client or registry.mlflow_client(config)
        dest_kwargs, source_kwargs = s3_client_kwargs(config), artifacts_s3_client_kwargs(config)
        self.same_s3 = dest_kwargs == source_kwargs
        self.dest = dest_s3 or boto3.client("s3", config=BOTO, **dest_kwargs)
        self.source = source_s3 or (self.dest if self.same_s3 else boto3.client("s3", config=BOTO, **source_kwargs))
        self.policy = adapter_policy(config)
        self.progress = progress
        self.bytes_copied = 0
        self.last_mode: str | None = None
        self.copied_at: dict[tuple[str, int], float] = {}  # folders this promoter wrote, by first write time

    def on_bytes(self, n: int) -> None:
        self.bytes_copied += n
        if self.progress is not None:
            self.progress(n)

    def copy_mode(self, source_location: S3Location | None) -> str:
        mode = self.config.registry.copy_mode
        if source_location is None:
            return "proxy"
        if mode == "auto":
            return "server_side" if self.same_s3 else "streaming"
        if mode == "server_side" and not self.same_s3:
            raise PromotionError("registry.copy_mode server_side needs MLflow's artifacts in the serving S3 "
                                 "(same endpoint and credentials); use auto or streaming")
        return mode

    def check_model(self, model: str) -> None:
        if model not in self.config.registry.models:
            raise NotFound(f"registered model {model!r} is not served (registry.models: "
                           f"{', '.join(self.config.registry.models)})")

    # ------------------------------------------------------------------------------------ one version

    def validate(self, files: SourceFiles, source: registry.VersionSource) -> dict[str, str]:
        """Raise InvalidAdapter unless the version is a servable adapter; return its files' sha256."""
        check_files(files.sizes, source.checksums)
        rank = check_adapter_config(parse_adapter_config(files.read(ADAPTER_CONFIG)), self.policy, source.base_model,
                                    source.base_sha256)
        head = files.read_range(ADAPTER_WEIGHTS, 0, HEADER_PROBE_BYTES)  # one request for most headers
        length = safetensors_header_length(head[:8])
        header = head[8:8 + length] if len(head) >= 8 + length else files.read_range(ADAPTER_WEIGHTS, 8, length)
        check_safetensors_header(header, rank, self.policy)
        return {name: source.checksums[name] for name in files.sizes}

    @contextmanager
    def source_files(self, model: str, version: int) -> Iterator[tuple[SourceFiles, registry.VersionSource]]:
        """The version's files: in S3 (copied server-side or streamed), else fetched through MLflow's proxy."""
        source = registry.version_source(self.mlflow, model, version)
        source_location = registry.artifact_s3_location(self.config, source.artifact_uri)
        mode = self.last_mode = self.copy_mode(source_location)
        if mode != "proxy":
            yield S3SourceFiles(self, source_location, mode), source
            return
        with tempfile.TemporaryDirectory(prefix="rlops-promote-") as tmp:
            local = mlflow.artifacts.download_artifacts(
                artifact_uri=source.artifact_uri, dst_path=tmp, tracking_uri=self.config.tracking_uri)
            yield DownloadedFiles(self, Path(local)), source

    def inspect(self, model: str, version: int) -> dict[str, str]:
        """Validate a version without copying anything (dry runs); return its files' sha256."""
        with self.source_files(model, version) as (files, source):
            return self.validate(files, source)

    def prepare(self, model: str, version: int, *, collected: bool = False) -> AliasRoute:
        """Make `<model>-v<version>/` complete and verified; raise InvalidAdapter if the version can't be served.
        `collected`: gc marked the version, so whatever is left of its folder is copied over again."""
        with self.source_files(model, version) as (files, source):
            return self._prepare_from(files, model, version, source, collected)

    def _prepare_from(self, files: SourceFiles, model: str, version: int, source: registry.VersionSource,
                      collected: bool = False) -> AliasRoute:
        checksums = self.validate(files, source)
        folder = version_folder(model, version)
        prefix = self.location.key(folder)
        route = AliasRoute(version=version, folder=folder, files=checksums, promoted_at=utc_now(), trigger="")
        existing = storage.list_folder(self.dest, self.location.bucket, prefix)
        # A collected version's remains may be a gc stopped half-way: every file is copied again over them, never
        # deleted first, since a concurrent sync (the webhook's beside a promote's) may just have copied and
        # published this same folder; the bytes written are the same, so a reader sees one file or the other.
        if ADAPTER_CONFIG in existing and not collected:
            self._verify_complete(prefix, existing, checksums)
            return route
        copy_started = time.monotonic()
        for name in copy_order(checksums):
            dst = storage.ObjectRef(self.location.bucket, f"{prefix}/{name}")
            digest = files.copy_to(name, dst) or storage.sha256_of(self.dest, dst)
            if digest != checksums[name]:
                written = copy_order(checksums)[: copy_order(checksums).index(name) + 1]
                storage.delete_folder(self.dest, self.location.bucket, prefix, written)
                raise InvalidAdapter(f"checksum mismatch for {name}: the stored file differs from the sha256 "
                                     "the tracker recorded")
        self.copied_at[(model, version)] = copy_started
        return route

    def _verify_complete(self, prefix: str, existing: dict, checksums: dict[str, str]) -> None:
        """A complete folder is never rewritten (replicas may have cached it): it must already be right."""
        # Reasons never name the folder: refusals may reach clients, folder names must not.
        if set(existing) != set(checksums):
            raise InvalidAdapter("this version's serving folder already exists with other files; not rewritten")
        for name, digest in checksums.items():
            if storage.sha256_of(self.dest, storage.ObjectRef(self.location.bucket, f"{prefix}/{name}")) != digest:
                raise InvalidAdapter(f"this version's serving folder already holds a different {name}; not rewritten")

    def _may_be_collected(self, model: str, version: int) -> bool:
        """gc never deletes a folder younger than its grace period: only an older one needs a re-check."""
        copied = self.copied_at.get((model, version))
        if copied is not None and time.monotonic() - copied < self.config.registry.gc_grace_s:
            return False
        return not self.folder_complete(model, version)

    # ------------------------------------------------------------------------------------ policy of a move

    def check_owner(self, manifest: RoutesManifest) -> None:
        """Only the deployment that owns a manifest writes it (one written before owners is adopted)."""
        ours = self.config.registry_owner
        if manifest.owner not in (None, ours):
            raise Refused(f"the routes manifest of {manifest.model!r} belongs to deployment {manifest.owner!r}, not "
                          f"this one ({ours!r}); set registry.owner to {manifest.owner!r} to take it over deliberately")

    def guard_refusal(self, model: str, version: int, served: int | None) -> str | None:
        """Why a guarded alias must not move from the served version to `version` (None: it may). A version
        tagged rlops.force skips the check, so an override is visible in the registry, whoever made it."""
        if served is None or served == version:
            return None
        candidate = registry.version_source(self.mlflow, model, version)
        if TAG_FORCE in candidate.tags:
            return None
        try:
            current = registry.version_source(self.mlflow, model, served)
        except (registry.RegistryNotFound, InvalidAdapter):
            return None  # the served version is gone from the registry: nothing to compare against
        policy = self.config.registry
        return guardrail_refusal(candidate, current, direction=policy.guardrail_direction,
                                 min_delta=policy.guardrail_min_delta)

    def collecting_reason(self, manifest: RoutesManifest, version: int) -> str | None:
        """A version gc marked collected within the lease may still be losing files: never copy into it yet."""
        lease = self.config.registry.gc_lease_s
        for entry in manifest.collected:
            age = time.time() - parse_time(entry.at).timestamp()
            if entry.version == version and age < lease:
                return f"v{version} is being garbage-collected (since {entry.at}); it is copied again after {lease:g}s"
        return None

    def folder_complete(self, model: str, version: int) -> bool:
        prefix = self.location.key(version_folder(model, version))
        return ADAPTER_CONFIG in storage.list_folder(self.dest, self.location.bucket, prefix)

    def publish_preview(self, model: str, version: int, *, alias: str, trigger: str, actor: str | None = None,
                        reason: str | None = None) -> bool:
        """Make `@v<version>` servable without moving an alias (a `preview` history entry, see plan.with_preview):
        copy and verify its folder, then publish conditionally. True when a new manifest was published.
        Raises Refused (folder being collected, another deployment's manifest) or InvalidAdapter."""
        manifest, _ = storage.read_manifest(self.dest, self.location, model)
        if version not in manifest.published_versions():
            collecting = self.collecting_reason(manifest, version)
            if collecting:
                raise Refused(collecting)
            self.prepare(model, version, collected=version in manifest.collected_versions())
        for _ in range(MAX_ROUNDS):
            manifest, etag = storage.read_manifest(self.dest, self.location, model)
            self.check_owner(manifest)
            new = with_preview(manifest, version, alias=alias, trigger=trigger, now=utc_now(), actor=actor,
                               reason=reason, history_limit=self.config.registry.history_limit,
                               owner=self.config.registry_owner)
            if new is manifest:
                return False
            if self._may_be_collected(model, version):
                self.prepare(model, version, collected=True)  # gc took the folder meanwhile: copy it again
                continue
            try:
                storage.write_manifest(self.dest, self.location, new, etag)
                return True
            except storage.ManifestConflict:
                continue
        raise SyncConflict(f"publishing @v{version} of {model!r} did not converge after {MAX_ROUNDS} rounds: "
                           "other writers kept publishing; rerun it")

    # ------------------------------------------------------------------------------------ whole model

    def sync(self, model: str, *, trigger: str) -> SyncReport:
        """Publish the model's registry intent. `trigger` names this publisher; who moved each alias comes
        from the registry's move notes (plan.next_manifest)."""
        self.check_model(model)
        started = time.monotonic()
        report = SyncReport(model=model, trigger=trigger)
        prepared: dict[int, AliasRoute] = {}
        refusals: dict[int, str] = {}
        new_refusals: set[int] = set()
        for _ in range(MAX_ROUNDS):
            intent = registry.read_intent(self.mlflow, model, self.config.registry.served_aliases) or {}
            manifest, etag = storage.read_manifest(self.dest, self.location, model)
            self.check_owner(manifest)
            held: dict[str, tuple[str, str]] = {}  # alias -> (kind, reason): refused for that alias only
            served = served_targets(manifest)
            for alias, version in intent.items():
                current = served.get(alias)
                if current == version or version in refusals:
                    continue
                collecting = self.collecting_reason(manifest, version)
                if collecting:
                    held[alias] = ("collecting", collecting)
                    continue
                try:
                    # The same policy for every trigger: the eval guardrail runs here, not in the CLI only.
                    guarded = alias in self.config.registry.guarded_aliases
                    losing = guarded and self.guard_refusal(model, version, current)
                    if losing:
                        held[alias] = ("guardrail", f"{losing}; to override, tag v{version} "
                                                    f"{TAG_FORCE}='<who>: <why>' (promote --force does)")
                        continue
                    collected = version in manifest.collected_versions()  # gc came after an earlier round
                    if version in prepared and not collected:
                        continue
                    earlier = manifest.refused.get(alias)
                    if (earlier is not None and earlier.kind == "adapter" and earlier.version == version
                            and not self.folder_complete(model, version)):
                        refusals[version] = earlier.reason  # sticky until the alias moves or a promote retries it
                        continue
                    prepared[version] = self.prepare(model, version, collected=collected)
                except InvalidAdapter as exc:
                    refusals[version] = str(exc)
                    new_refusals.add(version)
            # Publish: the manifest read above (M), the registry re-read now (R), a PUT conditional on M (P).
            latest = registry.read_intent(self.mlflow, model, self.config.registry.served_aliases) or {}
            if latest != intent:
                continue  # the registry moved while we copied: prepare the new targets
            new = next_manifest(manifest, intent, prepared, refusals, trigger=trigger, now=utc_now(),
                                history_limit=self.config.registry.history_limit, held=held,
                                owner=self.config.registry_owner)
            if any(self._may_be_collected(model, r.version) for r in newly_promoted(manifest, new).values()):
                prepared.clear()  # a folder vanished after we verified it (gc): copy again before naming it
                continue
            if new is not manifest:
                try:
                    storage.write_manifest(self.dest, self.location, new, etag)
                except storage.ManifestConflict:
                    continue
                report.seconds_to_publish = round(time.monotonic() - started, 3)
            self._fill_report(report, manifest, new, intent)
            self._audit(model, manifest, new, refusals, new_refusals, report)
            report.seconds = round(time.monotonic() - started, 3)
            return report
        raise SyncConflict(f"sync of {model!r} did not converge after {MAX_ROUNDS} rounds: the alias kept moving "
                           "or other writers kept publishing; rerun it")

    def _fill_report(self, report: SyncReport, old, new, intent: dict[str, int]) -> None:
        report.changed = new is not old
        report.generation = new.generation
        report.served = {a: r.version for a, r in new.aliases.items()}
        report.canaries = {a: {"version": c.version, "weight": c.weight} for a, c in new.canaries.items()}
        report.shadows = {a: {"version": c.version, "percent": c.percent} for a, c in new.shadows.items()}
        report.promoted = {a: r.version for a, r in newly_promoted(old, new).items()}
        report.refused = {a: {"version": r.version, "reason": r.reason} for a, r in new.refused.items()}
        report.removed = sorted(set(old.aliases) - set(intent))
        report.copy_mode = self.last_mode
        report.bytes_copied = self.bytes_copied

    def _audit(self, model, old, new, refusals, new_refusals, report) -> None:
        """Version tags are the audit trail; the manifest is already published, so failures only warn."""
        try:
            for alias, route in newly_promoted(old, new).items():
                # the entry this publication added for it (the newest of that alias and version)
                entry = next(h for h in reversed(new.history) if h.alias == alias and h.version == route.version)
                registry.set_tags(self.mlflow, model, route.version, {
                    registry.FOLDER_TAG: route.folder, registry.PROMOTED_AT_TAG: route.promoted_at,
                    registry.PROMOTED_BY_TAG: entry.actor or REGISTRY_ACTOR, registry.TRIGGER_TAG: entry.trigger,
                })
                if route.version not in new_refusals:  # an earlier refusal is over: the version is served now
                    registry.delete_tag(self.mlflow, model, route.version, registry.REFUSED_TAG)
            moved = {r.version for r in [*old.aliases.values(), *new.aliases.values()]}
            for version in sorted(v for v in moved if served_aliases(old, v) != served_aliases(new, v)):
                served_as, history = promotion_record(new, version, TAG_VALUE_LIMIT)
                registry.set_tags(self.mlflow, model, version,
                                  {registry.SERVED_AS_TAG: served_as, registry.HISTORY_TAG: history})
            for version in new_refusals:
                registry.set_tags(self.mlflow, model, version, {registry.REFUSED_TAG: refusals[version][:TAG_VALUE_LIMIT]})
            for alias, refusal in new.refused.items():
                if refusal.kind == "guardrail" and old.refused.get(alias) != refusal:
                    registry.set_tags(self.mlflow, model, refusal.version,
                                      {registry.REFUSED_TAG: f"{alias}: {refusal.reason}"[:TAG_VALUE_LIMIT]})
        except Exception as exc:  # noqa: BLE001 - audit must not undo a publish
            report.warnings.append(f"audit tags not written: {exc}")


def sync_model(config: Config, model: str, *, trigger: str) -> SyncReport:
    """Make `_routes/<model>.json` serve the model's registry aliases (idempotent; safe to run concurrently)."""
    return Promoter(config).sync(model, trigger=trigger)

