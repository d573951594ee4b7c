"""The forms of the board's confirmations on recovery actions: the owner-stop confirmation,
the workspace conflict resolution, the export retry and the resolution of any other action."""

from __future__ import annotations

from django import forms

from recovery.services.owner_stop import (
    MAX_STOP_EVIDENCE_CHARS,
    MIN_STOP_EVIDENCE_CHARS,
    nonblank_length,
)


class OwnerStopForm(forms.Form):
    stop_evidence = forms.CharField(
        label="Deployment stop evidence",
        widget=forms.Textarea(attrs={"rows": 6, "cols": 80}),
        max_length=MAX_STOP_EVIDENCE_CHARS,
        strip=False,
        help_text=(
            "What the deployment platform shows: the controller and every copy-back process "
            f"it started have exited (at least {MIN_STOP_EVIDENCE_CHARS} non-blank characters)."
        ),
    )
    confirmed = forms.BooleanField(
        label="I verified that this controller and all its copy-back processes have stopped.",
        required=True,
    )

    def clean_stop_evidence(self) -> str:
        value: str = self.cleaned_data["stop_evidence"]
        if nonblank_length(value) < MIN_STOP_EVIDENCE_CHARS:
            raise forms.ValidationError(
                f"Give at least {MIN_STOP_EVIDENCE_CHARS} non-blank characters of evidence."
            )
        return value


class ConflictResolutionForm(forms.Form):
    resolution = forms.ChoiceField(
        label="Resolution",
        choices=(
            (
                "publish",
                "Publish: the run's side of each conflicting path, merged with every other "
                "change of the run and of the head",
            ),
            (
                "keep_head",
                "Keep the head: the head's side of each conflicting path, and the run's other "
                "changes still published",
            ),
            ("discard", "Discard: commit the run without publishing anything of it"),
        ),
        widget=forms.RadioSelect,
    )
    note = forms.CharField(
        label="Note",
        widget=forms.Textarea(attrs={"rows": 3, "cols": 80}),
        max_length=MAX_STOP_EVIDENCE_CHARS,
        help_text="Why: recorded in the hold's evidence and the audit log.",
    )


class ExportRetryForm(forms.Form):
    repair_note = forms.CharField(
        label="Repair performed",
        widget=forms.Textarea(attrs={"rows": 4, "cols": 80}),
        max_length=MAX_STOP_EVIDENCE_CHARS,
        strip=False,
        help_text=(
            "What you repaired so the export can succeed now (disk space, permissions, the "
            f"workspace cwd, the sandbox): at least {MIN_STOP_EVIDENCE_CHARS} non-blank "
            "characters, kept on the hold and in the audit log."
        ),
    )

    def clean_repair_note(self) -> str:
        value: str = self.cleaned_data["repair_note"]
        if nonblank_length(value) < MIN_STOP_EVIDENCE_CHARS:
            raise forms.ValidationError(
                f"Say what you repaired in at least {MIN_STOP_EVIDENCE_CHARS} non-blank characters."
            )
        return value


class ResolveActionForm(forms.Form):
    outcome = forms.ChoiceField(
        label="Outcome",
        choices=(
            ("restored", "Restored: the problem is fixed and the work can go on"),
            ("false_positive", "False positive: nothing was wrong"),
            ("blocked", "Blocked: it cannot be recovered (the note says why)"),
            ("cancelled", "Cancelled: the work is no longer wanted (the action is cancelled)"),
        ),
        widget=forms.RadioSelect,
    )
    note = forms.CharField(
        label="Note",
        widget=forms.Textarea(attrs={"rows": 3, "cols": 80}),
        max_length=MAX_STOP_EVIDENCE_CHARS,
        strip=True,
        help_text="What you did or found: kept as the action's resolution note and audited.",
    )
