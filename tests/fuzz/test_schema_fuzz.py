"""Schema-driven fuzzing of the whole API with Schemathesis, against a live HTTP server on the
real (test) PostgreSQL, as an agent and as a board member: every response must conform to the
schema (status code, content type, body, headers) and never be a server error. Bounded by
PAPERCLIP_FUZZ_EXAMPLES per operation (`make fuzz` raises it)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from paperclip.credentials import agent_key_create, board_token_create
from paperclip.models import BoardMembership
from tests.leases.environment.factories import EnvironmentLeaseFactory, ProviderAgentFactory
from tests.leases.factories import claim
from tests.paperclip.factories import UserFactory
from tests.recovery.factories import make_binding

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

EXAMPLES = int(os.environ.get("PAPERCLIP_FUZZ_EXAMPLES", "12"))
# Schema-valid bodies may still break a rule across fields (a native run needs an issue, a
# board force-release needs a reason): those are 400s by design, which this check would call
# a rejection of valid data. Every other check runs.
EXCLUDED_CHECKS = [positive_data_acceptance]


@pytest.fixture
def world(tmp_path: Any) -> dict[str, str]:
    b = make_binding(tmp_path=tmp_path)
    claim(b.run.execution_workspace, b.agent, issue_id=b.issue.pk)
    user = UserFactory(is_staff=True)
    BoardMembership.objects.create(user=user, company=b.company)
    provider = ProviderAgentFactory(company=b.company)
    EnvironmentLeaseFactory(company=b.company, heartbeat_run=b.run, issue=b.issue)
    return {
        "agent": f"Bearer {agent_key_create(agent_id=b.agent.pk).secret}",
        "provider": f"Bearer {agent_key_create(agent_id=provider.pk).secret}",
        "board": f"Bearer {board_token_create(user=user).secret}",
    }


FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
    database=None,
)


def _fuzz(base_url: str, authorization: str, *, paths: str | None = None) -> list[str]:
    """Every operation of the served schema (or those whose path contains `paths`), EXAMPLES
    generated cases each, all checks."""
    schema = schemathesis.openapi.from_url(f"{base_url}/api/schema/?format=json")
    # Valid and invalid data alike; strings as UTF-8 can carry them (no lone surrogates), and
    # no NUL: both are refused by every body (docs/api.md#strict-bodies), as invalid input.
    schema.config.generation.update(modes=["positive", "negative"], allow_x00=False, codec="utf-8")
    failures: list[str] = []
    operations = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        if paths is not None and paths not in operation.path:
            continue
        operations += 1

        @FUZZ
        @given(case=operation.as_strategy())
        def run(case: Any) -> None:
            case.call_and_validate(
                headers={"Authorization": authorization}, excluded_checks=EXCLUDED_CHECKS
            )

        try:
            run()
        except Exception as exc:  # collect every operation's failure, then report them all
            failures.append(f"{operation.label}: {exc}"[:3000])
    assert operations > (25 if paths is None else 5)
    return failures


def test_every_operation_conforms_as_an_agent(live_server: Any, world: dict[str, str]) -> None:
    assert _fuzz(live_server.url, world["agent"]) == []


def test_every_environment_operation_conforms_as_a_provider(
    live_server: Any, world: dict[str, str]
) -> None:
    """The environment-lease and cleanup operations are 403 for a worker agent: fuzz them as a
    provider agent too, so their bodies reach validation and the services."""
    assert _fuzz(live_server.url, world["provider"], paths="environment") == []


def test_every_operation_conforms_as_a_board_member(
    live_server: Any, world: dict[str, str]
) -> None:
    assert _fuzz(live_server.url, world["board"]) == []


def test_stateful_sequences_follow_the_links_between_operations(
    live_server: Any, world: dict[str, str]
) -> None:
    """Schemathesis's stateful mode: sequences of calls where one response feeds the next
    (a created company's id into its agents and issues, a run into its results...), as a
    superuser board member so that creation succeeds."""
    from paperclip.credentials import board_token_create
    from tests.paperclip.factories import UserFactory

    token = (
        f"Bearer {board_token_create(user=UserFactory(is_staff=True, is_superuser=True)).secret}"
    )
    schema = schemathesis.openapi.from_url(f"{live_server.url}/api/schema/?format=json")
    schema.config.generation.update(allow_x00=False, codec="utf-8")
    machine = schema.as_state_machine()
    seen: list[tuple[str, int]] = []

    class Sequences(machine):  # type: ignore[misc,valid-type]
        def get_call_kwargs(self, case: Any) -> dict[str, Any]:
            return {"headers": {"Authorization": token}}

        def validate_response(self, response: Any, case: Any, **kwargs: Any) -> None:
            seen.append((case.operation.label, response.status_code))
            case.validate_response(response, excluded_checks=EXCLUDED_CHECKS)

    Sequences.run(
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=6,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
        )
    )
    created = {label for label, status in seen if status == 201}
    # Not vacuous: sequences ran, and objects were created for later steps to use.
    assert len(seen) > EXAMPLES, seen[:20]
    assert created, sorted(set(seen))[:40]
