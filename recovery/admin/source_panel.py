"""The recovery-source panel of a recovery action's page: the inspection of its recorded
source, or why none is usable."""

from __future__ import annotations

from typing import Any

from django.template.loader import render_to_string

from paperclip.ids import parse_uuid
from recovery.errors import SourceFailure, SourceInspectionLimit
from recovery.models import IssueRecoveryAction
from recovery.selectors.source.inspection import MAXIMUM_SOURCES, recovery_source_inspect


def source_panel_html(action: IssueRecoveryAction) -> str:
    """The inspection of `action`'s recorded source as safe HTML for its admin page: the
    sources, or the failure with its code, reason and disposition. The run is the one named
    by `action.evidence.runId`."""
    evidence = action.evidence if isinstance(action.evidence, dict) else {}
    raw_run = evidence.get("runId")
    context: dict[str, Any] = {"action": action, "run_id": raw_run}
    run_id = parse_uuid(raw_run)
    if run_id is None:
        context["missing_run"] = True
        return render_to_string("admin/recovery/source_panel.html", context)
    try:
        inspection = recovery_source_inspect(
            company_id=action.company_id,
            issue_id=action.source_issue_id,
            run_id=run_id,
            action_id=action.pk,
            maximum_sources=MAXIMUM_SOURCES,
        )
    except SourceFailure as failure:
        context["failure"] = {
            "code": failure.code,
            "message": failure.text,
            "reason": failure.reason,
            "disposition": failure.disposition,
            "observed_lease_policy": failure.observed_lease_policy,
        }
    except SourceInspectionLimit as limit:
        context["failure"] = {
            "code": limit.code,
            "message": limit.text,
            "reason": None,
            "disposition": None,
            "observed_lease_policy": None,
        }
    else:
        context["sources"] = inspection.sources
    return render_to_string("admin/recovery/source_panel.html", context)
