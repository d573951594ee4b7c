"""The strict JSON body rules as plain functions (paperclip/api/parsers.py), no database and no
request: every value JSON can carry passes unless it holds a NUL, a lone surrogate, a
non-finite number or too deep a nesting, and then the error names exactly where. The API-level
tests (test_strict_bodies.py) check that every endpoint reads its body through these rules."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paperclip.api.parsers import MAX_DEPTH, StrictJSONParser, check_json_value
from paperclip.errors import InvalidRequest

# Text PostgreSQL's jsonb can store: no NUL, no surrogate code points.
SAFE_TEXT = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"))
SAFE_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | SAFE_TEXT,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(SAFE_TEXT, children, max_size=4)
    ),
    max_leaves=20,
)
# No deadline or speed check: under a loaded pytest-xdist run they would fail by luck.
UNTIMED = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
BAD_LEAVES = [
    ("a\x00b", "NUL characters are not allowed."),
    ("a\ud800", "Lone surrogates (invalid Unicode) are not allowed."),
    (float("nan"), "Non-finite numbers are not allowed."),
    (float("-inf"), "Non-finite numbers are not allowed."),
]


def fields(value: Any) -> dict[str, list[str]]:
    with pytest.raises(InvalidRequest) as refused:
        check_json_value(value)
    return refused.value.details["fields"]


@UNTIMED
@given(SAFE_JSON)
def test_every_storable_value_passes(value: Any) -> None:
    check_json_value(value)


@UNTIMED
@given(SAFE_JSON, st.sampled_from(BAD_LEAVES), st.data())
def test_a_bad_leaf_anywhere_is_refused_naming_its_path(
    value: Any, bad: tuple[Any, str], data: st.DataObject
) -> None:
    """The bad leaf is planted under a path of keys and indexes the test chooses; the error
    names that path and the rule it breaks."""
    leaf, message = bad
    steps = data.draw(
        st.lists(
            st.one_of(st.integers(0, 2), st.from_regex(r"[a-z]{1,3}", fullmatch=True)),
            max_size=MAX_DEPTH - 1,
        )
    )
    planted: Any = leaf
    path = ""
    for step in reversed(steps):
        planted = [value] * step + [planted] if isinstance(step, int) else {step: planted}
    for step in steps:
        path = f"{path}[{step}]" if isinstance(step, int) else (f"{path}.{step}" if path else step)
    assert fields(planted) == {path or "body": [message]}


def test_a_bad_key_is_refused_at_its_object() -> None:
    assert fields({"a": {"k\x00": 1}}) == {"a": ["A key: NUL characters are not allowed."]}
    assert fields({"\udfff": 1}) == {
        "body": ["A key: Lone surrogates (invalid Unicode) are not allowed."]
    }


def test_the_depth_limit_counts_the_body_itself() -> None:
    def nested(depth: int) -> Any:
        value: Any = 1
        for _ in range(depth):
            value = [value]
        return value

    check_json_value(nested(MAX_DEPTH))
    assert fields(nested(MAX_DEPTH + 1)) == {
        "[0]" * MAX_DEPTH: [f"Nested deeper than {MAX_DEPTH} levels."]
    }
    # Iterative: far deeper input than the recursion limit is refused, not a RecursionError.
    deep: Any = 1
    for _ in range(100_000):
        deep = {"a": deep}
    assert list(fields(deep).values()) == [[f"Nested deeper than {MAX_DEPTH} levels."]]


def parse(raw: bytes, media_type: str | None = "application/json") -> Any:
    return StrictJSONParser().parse(io.BytesIO(raw), media_type)


@pytest.mark.parametrize(
    ("raw", "media_type", "message"),
    [
        (b'{"a": 1}', "application/json; charset=latin-1", "charset 'latin-1' is not accepted"),
        (b'{"a": "\xff"}', None, "The body is not valid UTF-8."),
        (b'{"a": NaN}', None, "The body is not valid JSON (non-finite number NaN)"),
        (b'{"a": 1e999}', None, "The body is not valid JSON (non-finite number)"),
        (b'{"a": ', None, "The body is not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, None, f"Nested deeper than {MAX_DEPTH} levels."),
        (json.dumps({"a": "\x00"}).encode(), None, "NUL characters are not allowed."),
    ],
)
def test_the_parser_refuses_what_jsonb_or_utf8_cannot_hold(
    raw: bytes, media_type: str | None, message: str
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse(raw, media_type)
    (messages,) = refused.value.details["fields"].values()
    assert message in messages[0]


def test_the_parser_returns_what_it_accepts() -> None:
    assert parse(b'{"a": [1, 2.5, "x", null]}', "application/json; charset=UTF-8") == {
        "a": [1, 2.5, "x", None]
    }


@pytest.mark.parametrize(
    ("raw", "where", "message"),
    [
        # Nested one level too deep, in plain text: only the depth check can refuse it.
        (
            b'{"a": ' + b"[" * MAX_DEPTH + b"1" + b"]" * MAX_DEPTH + b"}",
            "a" + "[0]" * (MAX_DEPTH - 1),
            f"Nested deeper than {MAX_DEPTH} levels.",
        ),
        # A raw NUL byte or an encoded surrogate never reaches the checks: the decoders refuse.
        (b'{"a": "x\x00y"}', "body", "The body is not valid JSON"),
        (b'{"a": "\xed\xa0\x80"}', "body", "The body is not valid UTF-8."),
        (b'{"k\\u0000": 1}', "body", "A key: NUL characters are not allowed."),
        (b'["ok", {"b": "\\ud800"}]', "[1].b", "Lone surrogates (invalid Unicode)"),
    ],
)
def test_the_parser_names_where_a_plain_or_escaped_body_breaks_a_rule(
    raw: bytes, where: str, message: str
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse(raw)
    fields = refused.value.details["fields"]
    assert list(fields) == [where]
    assert message in fields[where][0]


@UNTIMED
@given(
    SAFE_JSON,
    st.sampled_from([None, *BAD_LEAVES[:2]]),
    st.integers(0, MAX_DEPTH + 2),
    st.booleans(),
)
def test_the_parser_judges_a_body_as_the_full_walk_does(
    value: Any, bad: tuple[Any, str] | None, depth: int, ascii_only: bool
) -> None:
    """Whatever the text's spelling (escapes or raw UTF-8), the parser accepts exactly what
    `check_json_value` accepts and refuses the rest with the same error: the shortcut for text
    without escapes changes nothing but the time."""
    planted: Any = [value, bad[0]] if bad else value
    for _ in range(depth):
        planted = {"n": planted}
    try:
        raw = json.dumps(planted, ensure_ascii=ascii_only).encode()
    except UnicodeEncodeError:  # a lone surrogate has no UTF-8 spelling: only escaped
        raw = json.dumps(planted, ensure_ascii=True).encode()
    expected: dict[str, Any] | None = None
    try:
        check_json_value(json.loads(raw))
    except InvalidRequest as walked:
        expected = walked.details
    if expected is None:
        assert parse(raw) == json.loads(raw)
    else:
        with pytest.raises(InvalidRequest) as refused:
            parse(raw)
        assert refused.value.details == expected
