"""factory_boy factories for the core models (shared by every app's tests)."""

from __future__ import annotations

import factory
from django.contrib.auth import get_user_model

from paperclip.models import (
    Agent,
    BoardMembership,
    Company,
    Environment,
    ExecutionWorkspace,
    HeartbeatRun,
    Issue,
    NativeRunFinalization,
    NativeRunResult,
)


class CompanyFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Company

    name = factory.Sequence(lambda n: f"Company {n}")


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        django_get_or_create = ("username",)

    username = factory.Sequence(lambda n: f"user{n}")
    is_staff = True
    password = factory.django.Password("pw-not-used-0")


class BoardMembershipFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = BoardMembership

    user = factory.SubFactory(UserFactory)
    company = factory.SubFactory(CompanyFactory)


class AgentFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Agent

    company = factory.SubFactory(CompanyFactory)
    name = factory.Sequence(lambda n: f"agent-{n}")


class ExecutionWorkspaceFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = ExecutionWorkspace

    company = factory.SubFactory(CompanyFactory)
    name = factory.Sequence(lambda n: f"workspace-{n}")


class EnvironmentFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Environment

    company = factory.SubFactory(CompanyFactory)
    name = factory.Sequence(lambda n: f"env-{n}")
    driver = Environment.Driver.SANDBOX


class IssueFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Issue

    company = factory.SubFactory(CompanyFactory)
    title = factory.Sequence(lambda n: f"Issue {n}")
    status = Issue.Status.IN_PROGRESS


class HeartbeatRunFactory(factory.django.DjangoModelFactory):
    """A run; the agent defaults to one of the same company."""

    class Meta:
        model = HeartbeatRun

    company = factory.SubFactory(CompanyFactory)
    agent = factory.SubFactory(AgentFactory, company=factory.SelfAttribute("..company"))
    status = HeartbeatRun.Status.RUNNING
    runtime_mode = HeartbeatRun.RuntimeMode.LEGACY


class NativeRunFactory(HeartbeatRunFactory):
    """A native run bound to an issue (issue and native_issue both set) with a contract id."""

    issue = factory.SubFactory(IssueFactory, company=factory.SelfAttribute("..company"))
    native_issue = factory.SelfAttribute("issue")
    runtime_mode = HeartbeatRun.RuntimeMode.NATIVE
    completion_contract_id = factory.Faker("uuid4", cast_to=None)


class NativeRunFinalizationFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = NativeRunFinalization

    run = factory.SubFactory(NativeRunFactory)
    company = factory.SelfAttribute("run.company")
    issue = factory.SelfAttribute("run.native_issue")
    phase = NativeRunFinalization.Phase.OBSERVED


class NativeRunResultFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = NativeRunResult

    run = factory.SubFactory(NativeRunFactory)
    company = factory.SelfAttribute("run.company")
    issue = factory.SelfAttribute("run.native_issue")
    completion_contract_id = factory.SelfAttribute("run.completion_contract_id")
    server_fingerprint = factory.Sequence(lambda n: f"fp-{n}")
    schema_status = NativeRunResult.SchemaStatus.ACCEPTED
    result_json = factory.LazyFunction(
        lambda: {"result": {}, "terminal": {"runTerminalState": "succeeded"}}
    )
    canonical_sha256 = factory.Sequence(lambda n: f"{n:064x}")
