"""The kinds of lease a batch renew knows (`POST /api/leases/renew`, docs/leases.md#batch-renew).

The runtime lease lives in `leases`, the controller lease in `checkpoints`, and neither app may
import the other (tests/test_layout.py). Each registers its kind here from its `ready()`, as
the apps register their dashboard tiles (paperclip/attention.py); the batch view (leases/api/
batch.py) reads this table and knows no kind by name. A kind brings:

- `parse(item)`: one item of the body (a dict, `kind` included) as the values its renewer
  takes, or the field errors that make the whole body a 400 (nothing is renewed then);
- `renew(company_id=, agent_id=, items=)`: renew every parsed item of the kind for the calling
  agent in one statement, answering per item, in the items' order, the lease's JSON as text
  (what the kind's single renew endpoint answers, rendered by PostgreSQL from the row, so a
  batch costs no per-item rendering in Python) or the DomainError that endpoint would raise;
- `item_serializer` / `lease_serializer`: the item's and the answer's OpenAPI components;
- `key(values)`: what two items of one batch must not share (the lease they name).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from rest_framework import serializers

from paperclip.errors import DomainError

# The answer for one item: the lease's JSON (text, an object), or the error its single
# endpoint would give.
RenewAnswer = str | DomainError
FieldErrors = dict[str, list[str]]


@dataclass(frozen=True, slots=True)
class RenewKind:
    name: str  # the item's `kind`
    parse: Callable[[dict[str, Any]], tuple[Any, FieldErrors]]
    renew: Callable[..., list[RenewAnswer]]  # (*, company_id, agent_id, items) -> answers
    key: Callable[[Any], Hashable]
    item_serializer: type[serializers.Serializer[Any]]
    lease_serializer: type[serializers.Serializer[Any]]


_KINDS: dict[str, RenewKind] = {}


def renew_kind_register(kind: RenewKind) -> None:
    """Called from an app's `ready()`; a second registration of a name replaces the first
    (a test's reload), it never adds a second entry."""
    _KINDS[kind.name] = kind


def renew_kinds() -> dict[str, RenewKind]:
    """The registered kinds by name, sorted (the OpenAPI document lists them in this order)."""
    return dict(sorted(_KINDS.items()))


def renew_batch(
    *, company_id: UUID, agent_id: UUID, parsed: Sequence[tuple[str, Any]]
) -> list[RenewAnswer]:
    """Renew every parsed `(kind, values)` item for the agent: one call per kind (one
    statement each), the answers put back in the items' order."""
    by_kind: dict[str, list[int]] = {}
    for index, (name, _) in enumerate(parsed):
        by_kind.setdefault(name, []).append(index)
    answers: list[RenewAnswer | None] = [None] * len(parsed)
    for name, indexes in sorted(by_kind.items()):
        kind = _KINDS[name]
        renewed = kind.renew(
            company_id=company_id, agent_id=agent_id, items=[parsed[i][1] for i in indexes]
        )
        if len(renewed) != len(indexes):  # pragma: no cover - a renewer answers every item
            raise RuntimeError(f"the {name} renewer answered {len(renewed)} of {len(indexes)}")
        for index, answer in zip(indexes, renewed, strict=True):
            answers[index] = answer
    return [answer for answer in answers if answer is not None]
