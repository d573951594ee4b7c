"""The stop-only intents on a lease's metadata, read strictly: the export-resume marker and
the generic `sandboxStopAndRetain` intent (docs/environment.md#stop-only-cleanup-intent). A
reader returns the validated intent; its `_problem` twin names the first failed check."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from leases.environment.export_resume.binding import binding_problem, lease_metadata, nonempty_str
from leases.environment.export_resume.keys import (
    EXPORT_RESUME_KEY,
    EXPORT_RESUME_SCHEMAS,
    EXPORT_RESUME_V1,
    STOP_AND_RETAIN_KEY,
    STOP_AND_RETAIN_SCHEMA,
)
from leases.models import EnvironmentLease


@dataclass(frozen=True, slots=True)
class ExportResumeMarker:
    """A validated export-resume marker, with its normalized request, result and plugin pin."""

    schema: str
    request_id: str
    result_id: str
    plugin_id: str
    purpose: str | None
    raw: Mapping[str, Any]


def export_resume_has(lease: EnvironmentLease) -> bool:
    """True when the lease metadata has the marker key at all, whatever its validity."""
    return EXPORT_RESUME_KEY in lease_metadata(lease)


def export_resume_read(lease: EnvironmentLease) -> ExportResumeMarker | None:
    """The lease's export-resume marker if every binding field equals the row; else None.

    Rules: schema v1 or v2; company, run, lease, provider and provider allocation equal the
    row's (which must have a run, a provider and an allocation); non-empty `requestId` and
    `resultId`; plugin pin: a v1 marker *without* a `pluginId` key falls back to the lease's
    `metadata.pluginId` (v1 predates the explicit pin), otherwise the marker's own `pluginId`
    is used even when invalid (an explicit pin is never overridden); the pin must be a
    non-empty string equal to `metadata.pluginId`. `export_resume_problem` names the failed
    rule: both read the same checks.
    """
    return _export_resume_check(lease)[0]


def export_resume_problem(lease: EnvironmentLease) -> str | None:
    """Why the lease's export-resume marker is unreadable, in words (the first failed check),
    or None when it is absent or valid."""
    if not export_resume_has(lease):
        return None
    return _export_resume_check(lease)[1]


def _export_resume_check(lease: EnvironmentLease) -> tuple[ExportResumeMarker | None, str | None]:
    metadata = lease_metadata(lease)
    marker = metadata.get(EXPORT_RESUME_KEY)
    if not isinstance(marker, dict):
        return None, "the marker is not a JSON object"
    schema = marker.get("schema")
    request_id = marker.get("requestId")
    result_id = marker.get("resultId")
    if schema not in EXPORT_RESUME_SCHEMAS:
        return None, f"unknown schema {schema!r}"
    if problem := binding_problem(marker, lease):
        return None, problem
    if not isinstance(request_id, str) or not request_id:
        return None, "requestId is missing or empty"
    if not isinstance(result_id, str) or not result_id:
        return None, "resultId is missing or empty"
    lease_plugin = metadata.get("pluginId")
    pin = (
        lease_plugin
        if schema == EXPORT_RESUME_V1 and "pluginId" not in marker
        else marker.get("pluginId")
    )
    if not isinstance(pin, str) or not pin:
        return None, "the plugin pin (pluginId) is missing or empty"
    if pin != lease_plugin:
        return None, f"the plugin pin {pin!r} does not equal the lease's pluginId {lease_plugin!r}"
    purpose = marker.get("purpose")
    return (
        ExportResumeMarker(
            schema=str(schema),
            request_id=request_id,
            result_id=result_id,
            plugin_id=pin,
            purpose=purpose if isinstance(purpose, str) else None,
            raw=marker,
        ),
        None,
    )


@dataclass(frozen=True, slots=True)
class StopOnlyIntent:
    """A validated stop-only cleanup intent (docs/environment.md#stop-only-cleanup-intent): stop the
    allocation, never destroy it."""

    kind: Literal["export_resume", "sandbox_stop_and_retain"]
    request_id: str
    plugin_id: str | None
    builtin_provider: str | None


def stop_only_cleanup_has(lease: EnvironmentLease) -> bool:
    """True when either stop-only intent key is present, valid or not."""
    metadata = lease_metadata(lease)
    return EXPORT_RESUME_KEY in metadata or STOP_AND_RETAIN_KEY in metadata


def stop_only_cleanup_read(lease: EnvironmentLease) -> StopOnlyIntent | None:
    """The lease's stop-only intent, or None when it is absent or does not bind to the row.

    An export-resume marker, when present, decides alone (even when invalid). Otherwise the
    generic `sandboxStopAndRetain` intent must carry its schema, bind to company, run, lease,
    provider and allocation, have a non-empty `requestId`, and name exactly one owner: a
    built-in provider equal to `lease.provider` (no plugin pins anywhere), or a `pluginId`
    equal to the lease's `metadata.pluginId`. `stop_only_cleanup_problem` names the failed
    rule: both read the same checks.
    """
    return _stop_only_check(lease)[0]


def stop_only_cleanup_problem(lease: EnvironmentLease) -> str | None:
    """Why a present stop-only intent is invalid, in words (`<key>: <first failed check>`), or
    None when there is none or it is valid. Such a lease is never cleaned up automatically."""
    if not stop_only_cleanup_has(lease):
        return None
    return _stop_only_check(lease)[1]


def _stop_only_check(lease: EnvironmentLease) -> tuple[StopOnlyIntent | None, str | None]:
    if export_resume_has(lease):
        marker, problem = _export_resume_check(lease)
        if marker is None:
            return None, f"{EXPORT_RESUME_KEY}: {problem}"
        return StopOnlyIntent("export_resume", marker.request_id, marker.plugin_id, None), None
    metadata = lease_metadata(lease)
    if STOP_AND_RETAIN_KEY not in metadata:
        return None, None
    intent, problem = _stop_and_retain_check(metadata.get(STOP_AND_RETAIN_KEY), lease, metadata)
    return intent, None if problem is None else f"{STOP_AND_RETAIN_KEY}: {problem}"


def _stop_and_retain_check(
    intent: object, lease: EnvironmentLease, metadata: Mapping[str, Any]
) -> tuple[StopOnlyIntent | None, str | None]:
    """The `sandboxStopAndRetain` intent: its form and binding, then its one owner."""
    if not isinstance(intent, dict):
        return None, "the intent is not a JSON object"
    if intent.get("schema") != STOP_AND_RETAIN_SCHEMA:
        return None, f"unknown schema {intent.get('schema')!r}"
    if problem := binding_problem(intent, lease):
        return None, problem
    if not nonempty_str(intent.get("requestId")):
        return None, "requestId is missing or empty"
    return _stop_and_retain_owner(intent, lease, metadata.get("pluginId"))


def _stop_and_retain_owner(
    intent: Mapping[str, Any], lease: EnvironmentLease, lease_plugin: object
) -> tuple[StopOnlyIntent | None, str | None]:
    """Exactly one owner: a built-in provider equal to the lease's (no plugin pin anywhere), or
    a plugin equal to the lease's pin."""
    builtin, plugin = intent.get("builtinProvider"), intent.get("pluginId")
    if builtin is not None and "pluginId" not in intent and lease_plugin is None:
        if builtin != lease.provider:
            return None, f"builtinProvider {builtin!r} is not the lease's provider"
        return StopOnlyIntent("sandbox_stop_and_retain", intent["requestId"], None, builtin), None
    if "builtinProvider" in intent:
        return None, "names both a built-in provider and a plugin (or a plugin pin exists)"
    if not nonempty_str(plugin):
        return None, "names no owner (builtinProvider or pluginId)"
    if plugin != lease_plugin:
        return None, f"pluginId {plugin!r} does not equal the lease's pluginId {lease_plugin!r}"
    return StopOnlyIntent("sandbox_stop_and_retain", intent["requestId"], plugin, None), None
