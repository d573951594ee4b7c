"""The one JSON body parser of the API (docs/api.md#strict-bodies).

Every endpoint reads its body through `StrictJSONParser`, so one rule holds everywhere: a body
is UTF-8 JSON (a `charset` other than UTF-8 is refused, not guessed), nested at most
`MAX_DEPTH` levels, no object with a key twice (which the last would win here and the first
in another parser), with no NUL character, no lone surrogate and no non-finite number anywhere
(PostgreSQL's jsonb stores none of them, and an error message could not echo them back). A
violation is a 400 `invalid_request` whose `details.fields` names where it is (`result.a[2]`),
raised before any view code runs, so nothing is written.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from rest_framework.parsers import JSONParser

from paperclip.errors import InvalidRequest

MAX_DEPTH = 64
_BODY = "body"


def _bad(path: str, message: str) -> InvalidRequest:
    return InvalidRequest(fields={path or _BODY: [message]})


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


class _DuplicateKey(ValueError):
    pass


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object, refused when a key comes twice."""
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        twice = next(key for key, _ in pairs if key in seen or seen.add(key))  # type: ignore[func-returns-value]
        raise _DuplicateKey(twice)
    return value


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("non-finite number")
    return value


def _text_problem(text: str) -> str | None:
    if "\x00" in text:
        return "NUL characters are not allowed."
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return "Lone surrogates (invalid Unicode) are not allowed."
    return None


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def check_json_value(value: Any, path: str = "") -> None:
    """Raise InvalidRequest naming the first place in `value` (parsed JSON) that breaks the
    rules: deeper than MAX_DEPTH, a string or key with NUL or a lone surrogate, a non-finite
    float. Iterative, so no input can exhaust the stack."""
    stack: list[tuple[Any, str, int]] = [(value, path, 1)]
    while stack:
        item, where, depth = stack.pop()
        if isinstance(item, str):
            if (problem := _text_problem(item)) is not None:
                raise _bad(where, problem)
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise _bad(where, "Non-finite numbers are not allowed.")
        elif isinstance(item, Mapping | list):
            if depth > MAX_DEPTH:
                raise _bad(where, f"Nested deeper than {MAX_DEPTH} levels.")
            if isinstance(item, list):
                stack.extend((v, _join(where, i), depth + 1) for i, v in enumerate(item))
            else:
                for key, v in item.items():
                    key_text = str(key)
                    if (problem := _text_problem(key_text)) is not None:
                        raise _bad(where or _BODY, f"A key: {problem}")
                    stack.append((v, _join(where, key_text), depth + 1))


class StrictJSONParser(JSONParser):
    def parse(
        self,
        stream: Any,
        media_type: str | None = None,
        parser_context: Mapping[str, Any] | None = None,
    ) -> Any:
        charset = _charset(media_type)
        if charset is not None and charset not in ("utf-8", "utf8"):
            raise InvalidRequest(
                fields={_BODY: [f"Send UTF-8 JSON; charset {charset!r} is not accepted."]}
            )
        return parse_json_body(stream.read() if stream is not None else b"")


def parse_json_body(raw: bytes) -> Any:
    """`raw` (a request body) as JSON under the rules above; InvalidRequest otherwise. The
    parser's whole work once the media type is settled, shared with the lean claim view
    (leases/api/lean.py), so both are as strict by construction."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _bad("", "The body is not valid UTF-8.") from exc
    try:
        data = json.loads(
            text,
            parse_constant=_reject_constant,
            parse_float=_finite_float,
            object_pairs_hook=_object,
        )
    except RecursionError as exc:
        raise _bad("", f"Nested deeper than {MAX_DEPTH} levels.") from exc
    except _DuplicateKey as exc:
        raise _bad("", f"An object has the key {_short(exc)!r} twice.") from exc
    except ValueError as exc:
        raise _bad("", f"The body is not valid JSON ({_short(exc)}).") from exc
    # Without an escape sequence the text cannot spell a NUL or a lone surrogate: strict UTF-8
    # decoding refuses encoded surrogates and the JSON decoder a raw control character in a
    # string, and the hooks above every non-finite number. Only the depth is left to check,
    # over the containers alone. The full walk, which also names the place, runs otherwise.
    if "\\u" in text or _too_deep(data):
        check_json_value(data)
    return data


def _too_deep(value: Any) -> bool:
    """True when a container in `value` (parsed JSON) is nested deeper than MAX_DEPTH."""
    if type(value) is not dict and type(value) is not list:
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            return True
        for child in item.values() if type(item) is dict else item:
            if type(child) is dict or type(child) is list:
                stack.append((child, depth + 1))
    return False


def _charset(media_type: str | None) -> str | None:
    if not media_type:
        return None
    for part in media_type.split(";")[1:]:
        name, _, value = part.strip().partition("=")
        if name.strip().lower() == "charset":
            return value.strip().strip('"').lower()
    return None


def _short(exc: ValueError) -> str:
    message = str(exc)
    return message.encode("ascii", "backslashreplace").decode("ascii")[:200]
