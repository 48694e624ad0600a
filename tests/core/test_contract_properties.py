"""Property tests of the request contract (docs/contract.md, "Request rules" and "The engine request") against
an oracle written from it.

The oracle below never calls ``narwhal_core``: it works on a tagged JSON tree
that the test generates (numbers kept as their literal text) and on Python's
standard ``json`` module, configured to refuse everything RFC 8259 refuses,
as the reference for arbitrary bytes. For every input, :func:`check_request`
must either accept exactly what the oracle accepts, or raise a
:class:`ContractError` equal to the oracle's first failing rule: status,
``param``, ``code`` and envelope ``type``. Nothing else may escape.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from narwhal_core import wire
from narwhal_core.contract import check_request
from narwhal_core.errors import ContractError

from ..corebuild import examples
from ..helpers import ALIAS, CHAT, COMPLETIONS, MODEL

MODEL_NAMES = frozenset({MODEL, ALIAS})
ROUTES = st.sampled_from([COMPLETIONS, CHAT])

# The table of docs/contract.md, "Request rules", in its order (check 3).
TYPED_FIELDS = ("model", "stream", "n", "best_of", "max_tokens", "max_completion_tokens", "prompt", "messages")

SETTINGS = settings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --------------------------------------------------------------------------
# A tagged JSON tree: ("null",) ("bool", b) ("num", literal) ("str", s)
# ("arr", [nodes]) ("obj", [(key, node), ...]) -- objects may repeat keys.
# --------------------------------------------------------------------------

Node = tuple[Any, ...]

NULL: Node = ("null",)
TRUE: Node = ("bool", True)
FALSE: Node = ("bool", False)


def num(text: str) -> Node:
    return ("num", text)


def s(text: str) -> Node:
    return ("str", text)


def arr(*items: Node) -> Node:
    return ("arr", list(items))


def obj(*pairs: tuple[str, Node]) -> Node:
    return ("obj", list(pairs))


def render(node: Node, *, ascii_only: bool = False, spaced: bool = False) -> bytes:
    """The JSON text of a tree, numbers written exactly as their literal."""
    return _render(node, ascii_only, spaced).encode("utf-8")


def _render(node: Node, ascii_only: bool, spaced: bool) -> str:
    tag = node[0]
    if tag == "null":
        return "null"
    if tag == "bool":
        return "true" if node[1] else "false"
    if tag == "num":
        return str(node[1])
    if tag == "str":
        return json.dumps(node[1], ensure_ascii=ascii_only)
    comma, colon = (", ", ": ") if spaced else (",", ":")
    if tag == "arr":
        return "[" + comma.join(_render(n, ascii_only, spaced) for n in node[1]) + "]"
    return (
        "{"
        + comma.join(
            json.dumps(k, ensure_ascii=ascii_only) + colon + _render(v, ascii_only, spaced) for k, v in node[1]
        )
        + "}"
    )


def members(node: Node) -> dict[str, Node]:
    """An object's members as JSON parsers see them: the last value of a key wins."""
    out: dict[str, Node] = {}
    for key, value in node[1]:
        out[key] = value
    return out


def canon_tree(node: Node) -> Any:
    """The JSON value of a tree, comparable by ``==``: numbers as ``Decimal``."""
    tag = node[0]
    if tag == "num":
        return ("num", Decimal(node[1]))
    if tag == "arr":
        return ("arr", tuple(canon_tree(n) for n in node[1]))
    if tag == "obj":
        return ("obj", tuple((k, canon_tree(v)) for k, v in members(node).items()))
    return node


class _Pairs(list):  # type: ignore[type-arg]
    """An object as decoded by the reference parser, members in order."""


class _Number(str):
    """A number as decoded by the reference parser: its literal text, kept exactly."""


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def reference_parse(text: str) -> Any:
    """Python's json, refusing NaN/Infinity and keeping every number as its literal."""
    return json.loads(
        text, object_pairs_hook=_Pairs, parse_float=_Number, parse_int=_Number, parse_constant=_no_constant
    )


def canon_parsed(value: Any) -> Any:
    """The same canonical form as :func:`canon_tree`, from a :func:`reference_parse` result."""
    if isinstance(value, _Pairs):
        out: dict[str, Any] = {}
        for key, item in value:
            out[key] = canon_parsed(item)
        return ("obj", tuple(out.items()))
    if isinstance(value, list):
        return ("arr", tuple(canon_parsed(v) for v in value))
    if value is None:
        return NULL
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, _Number):
        return ("num", Decimal(value))
    assert isinstance(value, str)
    return ("str", value)


def parsed_to_tree(value: Any) -> Node:
    """A reference-parsed value as a tagged tree (numbers as their literal text)."""
    if isinstance(value, _Pairs):
        return ("obj", [(k, parsed_to_tree(v)) for k, v in value])
    if isinstance(value, list):
        return ("arr", [parsed_to_tree(v) for v in value])
    if value is None:
        return NULL
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, _Number):
        return ("num", str.__str__(value))
    return ("str", value)


def depth(node: Node) -> int:
    if node[0] == "arr":
        return 1 + max((depth(n) for n in node[1]), default=0)
    if node[0] == "obj":
        return 1 + max((depth(v) for _, v in node[1]), default=0)
    return 0


def has_lone_surrogate(node: Node) -> bool:
    def bad(text: str) -> bool:
        return any(0xD800 <= ord(c) <= 0xDFFF for c in text)

    tag = node[0]
    if tag == "str":
        return bad(node[1])
    if tag == "arr":
        return any(has_lone_surrogate(n) for n in node[1])
    if tag == "obj":
        return any(bad(k) or has_lone_surrogate(v) for k, v in node[1])
    return False


# --------------------------------------------------------------------------
# The oracle: docs/contract.md, "Request rules", the seven checks in order.
# --------------------------------------------------------------------------

_INTEGER_LITERAL = re.compile(r"-?(?:0|[1-9][0-9]*)\Z")


class Verdict:
    """What docs/contract.md says about one body: accepted, or the first failing rule."""

    def __init__(self, *, status: int | None = None, param: str | None = None, code: str | None = None,
                 rule: int | None = None) -> None:
        self.status = status
        self.param = param
        self.code = code
        self.rule = rule

    @property
    def accepted(self) -> bool:
        return self.status is None

    def __repr__(self) -> str:
        if self.accepted:
            return "Verdict(accepted)"
        return f"Verdict(rule={self.rule}, status={self.status}, param={self.param!r}, code={self.code!r})"


def reject(rule: int, param: str | None, status: int = 400, code: str | None = None) -> Verdict:
    return Verdict(status=status, param=param, code=code, rule=rule)


def is_integer(node: Node) -> bool:
    # docs/contract.md, "Request rules": booleans are not integers and neither is 1.0; a JSON integer
    # is a literal without fraction or exponent.
    return node[0] == "num" and bool(_INTEGER_LITERAL.match(node[1]))


def type_ok(field: str, node: Node) -> bool:
    tag = node[0]
    if field == "model":
        return tag == "str"
    if field == "stream":
        return tag == "bool"
    if field in ("n", "best_of", "max_tokens", "max_completion_tokens"):
        return is_integer(node)
    if field == "prompt":
        return tag in ("str", "arr")
    assert field == "messages"
    return tag == "arr" and all(item[0] == "obj" for item in node[1])


def present(fields: dict[str, Node], name: str) -> bool:
    return name in fields and fields[name] != NULL


def oracle_tree(route: str, tree: Node) -> Verdict:
    """docs/contract.md, "Request rules", for a body that parses to ``tree`` (rules 1 and 2 included)."""
    # 1. Not JSON: lone surrogates and nesting deeper than the limit count as such.
    if has_lone_surrogate(tree) or depth(tree) > wire.MAX_DEPTH:
        return reject(1, None)
    # 2. Not an object.
    if tree[0] != "obj":
        return reject(2, None)
    fields = members(tree)
    # 3. Field types, in the order of the table of docs/contract.md, "Request rules".
    for name in TYPED_FIELDS:
        if present(fields, name) and not type_ok(name, fields[name]):
            return reject(3, name)
    # 4. Nothing to prefill.
    if route == CHAT and not present(fields, "messages"):
        return reject(4, "messages")
    if route == COMPLETIONS and not present(fields, "prompt"):
        return reject(4, "prompt")
    if route == COMPLETIONS and fields["prompt"][0] == "arr":
        # A list: token IDs (one prompt), or strings / token-ID lists, one
        # prompt each; check_request's default allows one (docs/operate.md, "Batch prompts").
        items = fields["prompt"][1]
        if not items:
            return reject(4, "prompt")
        if not all(is_integer(t) for t in items):
            def ids(node: Node) -> bool:
                return node[0] == "arr" and bool(node[1]) and all(is_integer(t) for t in node[1])
            if not (all(t[0] == "str" for t in items) or all(ids(t) for t in items)):
                return reject(4, "prompt")
            if len(items) > 1:
                return reject(4, "prompt")
    # 5. Unknown model.
    if present(fields, "model") and fields["model"][1] not in MODEL_NAMES:
        return reject(5, "model", status=404, code="model_not_found")
    # 6. Sampling width.
    for name in ("n", "best_of"):
        if present(fields, name) and Decimal(fields[name][1]) > 1:
            return reject(6, name)
    # ...and the output length (the prefill leg overrides it): at least 1.
    for name in ("max_tokens", "max_completion_tokens"):
        if present(fields, name) and Decimal(fields[name][1]) < 1:
            return reject(6, name)
    # 7. Output and tool restrictions.
    if present(fields, "audio"):
        return reject(7, "audio")
    if present(fields, "modalities") and fields["modalities"] != arr(s("text")):
        return reject(7, "modalities")
    if present(fields, "tools"):
        tools = fields["tools"]
        if tools[0] != "arr" or not all(t[0] == "obj" for t in tools[1]):
            return reject(7, "tools")
        for i, tool in enumerate(tools[1]):
            if members(tool).get("type") != s("function"):
                return reject(7, f"tools[{i}].type")
    return Verdict()


def oracle_bytes(route: str, body: bytes) -> tuple[Verdict, Node | None]:
    """docs/contract.md, "Request rules", for raw bytes, with Python's strict json as the JSON reference."""
    try:
        text = body.decode("utf-8")  # strict: refuses surrogates encoded in UTF-8 too
        parsed = reference_parse(text)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return reject(1, None), None
    tree = parsed_to_tree(parsed)
    return oracle_tree(route, tree), tree


def is_router_owned(key: str) -> bool:
    # docs/contract.md, "The engine request", names kv_transfer_params, request_id and bootstrap_*.
    return key in ("kv_transfer_params", "request_id") or key.startswith("bootstrap_")


def expected_accepted(tree: Node) -> tuple[Any, tuple[str, ...]]:
    """The canonical engine body and the stripped keys for an accepted body."""
    fields = members(tree)
    stripped = tuple(k for k in fields if is_router_owned(k))
    kept = [(k, canon_tree(v)) for k, v in fields.items() if not is_router_owned(k)]
    if "model" in fields:
        kept = [(k, ("str", MODEL) if k == "model" else v) for k, v in kept]
    else:
        kept.append(("model", ("str", MODEL)))
    return ("obj", tuple(kept)), stripped


# --------------------------------------------------------------------------
# Running the code under test and comparing with the oracle.
# --------------------------------------------------------------------------


def run(route: str, body: bytes) -> Any:
    """``check_request``'s result, or the ContractError it raised; anything else fails."""
    try:
        return check_request(route, body, MODEL_NAMES, MODEL)  # type: ignore[arg-type]
    except ContractError as exc:
        return exc
    except BaseException as exc:  # noqa: BLE001 - the property is that nothing else escapes
        pytest.fail(
            f"check_request raised {type(exc).__name__} (not ContractError): {exc!r}\n"
            f"route={route} body={body[:300]!r}{'...' if len(body) > 300 else ''}"
        )


def assert_matches(route: str, body: bytes, verdict: Verdict, tree: Node | None) -> None:
    event("accepted" if verdict.accepted else f"rule {verdict.rule} ({verdict.param})")
    outcome = run(route, body)
    where = f"route={route} body={body[:400]!r}"
    if not verdict.accepted:
        assert isinstance(outcome, ContractError), f"expected {verdict}, got acceptance; {where}"
        assert type(outcome) is ContractError, f"{type(outcome).__name__}; {where}"
        got = (outcome.status, outcome.param, outcome.code)
        assert got == (verdict.status, verdict.param, verdict.code), f"expected {verdict}, got {outcome!r}; {where}"
        env = outcome.envelope()
        assert set(env) == {"error"}
        assert env["error"] == {
            "message": outcome.message,
            "type": "invalid_request_error",
            "param": verdict.param,
            "code": verdict.code,
        }, where
        assert isinstance(outcome.message, str) and outcome.message, where
        if verdict.rule == 3:
            assert verdict.param in outcome.message, f"message should name the field: {outcome.message!r}"
        # The body is what an adapter sends: it must be the envelope, as JSON.
        assert json.loads(outcome.body()) == env
        return
    assert not isinstance(outcome, ContractError), f"expected acceptance, got {outcome!r}; {where}"
    assert tree is not None
    expected_body, expected_stripped = expected_accepted(tree)
    assert outcome.route == route
    assert outcome.stripped == expected_stripped, where
    encoded = wire.dumps(outcome.body)
    got_body = canon_parsed(reference_parse(encoded.decode("utf-8")))
    assert got_body == expected_body, f"{where}\nengine body: {encoded[:400]!r}"
    fields = members(tree)
    stream = fields.get("stream")
    assert outcome.stream is (stream == TRUE)
    requested = fields.get("model")
    assert outcome.requested_model == (requested[1] if requested not in (None, NULL) else None)


# --------------------------------------------------------------------------
# Strategies.
# --------------------------------------------------------------------------

TRICKY_NUMBERS = [
    "1e400", "-1e400", "1E+400", "1e-400", "0.1000000000000000055511151231257827",
    "123456789012345678901234567890", "-123456789012345678901234567890", "-0.0", "-0", "0",
    "5e-324", "4.9e-325", "1.7976931348623157e308", "1.7976931348623159e308", "9007199254740993",
    "18446744073709551616", "-9223372036854775809", "9223372036854775807", "1.0", "1e0", "1E2",
    "2.5", "100000000000000000000000000000000000000000000000000.5", "0.30000000000000004",
    "3.141592653589793238462643383279502884197", "1e-7", "123456789012345.6",
]


@st.composite
def number_literals(draw: st.DrawFn) -> str:
    if draw(st.booleans()):
        return draw(st.sampled_from(TRICKY_NUMBERS))
    sign = draw(st.sampled_from(["", "-"]))
    whole = draw(st.one_of(st.just("0"), st.from_regex(r"[1-9][0-9]{0,40}", fullmatch=True)))
    frac = draw(st.one_of(st.just(""), st.from_regex(r"\.[0-9]{1,40}", fullmatch=True)))
    exp = draw(st.one_of(st.just(""), st.from_regex(r"[eE][-+]?[0-9]{1,4}", fullmatch=True)))
    return sign + whole + frac + exp


texts = st.text(max_size=12)  # any code point except surrogates
keys = st.one_of(
    st.sampled_from(["a", "temperature", "top_p", "logprobs", "user", "seed", "stop", "é", "\u2603", ""]),
    texts,
)
scalars = st.one_of(
    st.just(NULL), st.just(TRUE), st.just(FALSE), number_literals().map(num), texts.map(s)
)
json_trees = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4).map(lambda xs: ("arr", xs)),
        st.lists(st.tuples(keys, inner), max_size=4).map(lambda ps: ("obj", ps)),
    ),
    max_leaves=12,
)

int_like = st.sampled_from(["-1", "0", "1", "2", "7", "-0", "1.0", "1e0", "0.5", "123456789012345678901234567890"])

FIELD_VALUES: dict[str, st.SearchStrategy[Node]] = {
    "model": st.one_of(
        st.sampled_from([s(MODEL), s(ALIAS), s("gpt-4o"), s(MODEL.lower()), s(""), NULL, TRUE, num("1")]),
        texts.map(s),
        json_trees,
    ),
    "stream": st.sampled_from([TRUE, FALSE, NULL, num("1"), num("0"), s("true"), arr(TRUE)]),
    "n": st.one_of(int_like.map(num), st.sampled_from([TRUE, FALSE, NULL, s("1"), arr(num("1"))])),
    "best_of": st.one_of(int_like.map(num), st.sampled_from([TRUE, FALSE, NULL, s("2")])),
    "max_tokens": st.one_of(
        int_like.map(num), number_literals().map(num), st.sampled_from([TRUE, FALSE, NULL, s("16"), obj()])
    ),
    "prompt": st.one_of(
        texts.map(s),
        st.lists(st.one_of(texts.map(s), number_literals().map(num)), max_size=3).map(lambda xs: ("arr", xs)),
        st.lists(st.lists(number_literals().map(num), max_size=2).map(lambda xs: ("arr", xs)), max_size=3).map(
            lambda xs: ("arr", xs)),
        st.sampled_from([NULL, num("1"), TRUE, obj(("text", s("hi")))]),
    ),
    "messages": st.one_of(
        st.lists(
            st.sampled_from([
                obj(("role", s("user")), ("content", s("hello"))),
                obj(("role", s("system")), ("content", NULL)),
                obj(),
                s("hello"), num("1"), NULL, arr(), TRUE,
            ]),
            max_size=3,
        ).map(lambda xs: ("arr", xs)),
        st.sampled_from([NULL, obj(("role", s("user"))), s("hi"), num("0")]),
    ),
    "audio": st.sampled_from([NULL, obj(("voice", s("alloy")), ("format", s("wav"))), obj(), FALSE, s("")]),
    "modalities": st.sampled_from([
        arr(s("text")), arr(s("text"), s("audio")), arr(s("audio")), arr(), s("text"), NULL,
        arr(s("text"), s("text")), arr(s("Text")), arr(arr(s("text"))),
    ]),
    "tools": st.one_of(
        st.lists(
            st.sampled_from([
                obj(("type", s("function")), ("function", obj(("name", s("f"))))),
                obj(("function", obj(("name", s("g"))))),
                obj(("type", s("code_interpreter"))),
                obj(("type", NULL)),
                obj(("type", s("web_search")), ("type", s("function"))),  # duplicate: last wins
                obj(("type", s("function")), ("type", s("retrieval"))),
                s("function"), NULL, num("1"),
            ]),
            max_size=3,
        ).map(lambda xs: ("arr", xs)),
        st.sampled_from([NULL, obj(("type", s("function"))), s("function")]),
    ),
    "kv_transfer_params": json_trees,
    "request_id": st.one_of(texts.map(s), json_trees),
    "bootstrap_host": st.sampled_from([s("10.0.0.9"), NULL]),
    "bootstrap_room": number_literals().map(num),
    "max_completion_tokens": number_literals().map(num),
    "temperature": number_literals().map(num),
    "stream_options": st.sampled_from([obj(("include_usage", TRUE)), NULL]),
    "logit_bias": st.just(obj(("50256", num("-100")), ("123456789012345678901234567890", num("1e400")))),
}


# Values of the typed fields that pass check 3, so that checks 4-7 get exercised.
WELL_TYPED: dict[str, st.SearchStrategy[Node]] = {
    "model": st.sampled_from([s(MODEL), s(ALIAS), s("gpt-4o"), NULL]),
    "stream": st.sampled_from([TRUE, FALSE, NULL]),
    "n": st.sampled_from(["-1", "0", "1", "1", "2", "-0", "123456789012345678901234567890"]).map(num),
    "best_of": st.sampled_from(["0", "1", "1", "3", NULL]).map(lambda v: v if isinstance(v, tuple) else num(v)),
    "max_tokens": st.sampled_from(["16", "0", "-5", "123456789012345678901234567890"]).map(num),
    "max_completion_tokens": st.sampled_from(["16", "1", "0", "-1"]).map(num),
    "prompt": st.sampled_from([s("hi"), arr(), arr(num("1"), num("2")), NULL]),
    "messages": st.sampled_from([arr(), arr(obj(("role", s("user")), ("content", s("hi")))), NULL]),
}


@st.composite
def request_trees(draw: st.DrawFn, route: str | None = None) -> Node:
    """Bodies shaped like real completion/chat requests, each field sometimes wrong."""
    names = draw(st.lists(st.sampled_from(sorted(FIELD_VALUES)), unique=True, max_size=len(FIELD_VALUES)))
    # Usually something to prefill (for the route, when known), so that later rules get exercised.
    if draw(st.integers(0, 4)) > 0:
        wanted = {COMPLETIONS: "prompt", CHAT: "messages"}.get(route or "")
        extra = wanted if wanted and draw(st.integers(0, 4)) > 0 else draw(st.sampled_from(["prompt", "messages"]))
        if extra not in names:
            names.append(extra)
    well_typed = draw(st.booleans())
    pairs = [
        (name, draw(WELL_TYPED[name] if well_typed and name in WELL_TYPED else FIELD_VALUES[name]))
        for name in names
    ]
    pairs += draw(st.lists(st.tuples(keys, json_trees), max_size=3))
    if pairs and draw(st.integers(0, 5)) == 0:  # a repeated key: the last value wins
        key = draw(st.sampled_from([k for k, _ in pairs]))
        pairs.append((key, draw(FIELD_VALUES.get(key, json_trees))))
    return ("obj", draw(st.permutations(pairs)))


render_options = st.fixed_dictionaries({"ascii_only": st.booleans(), "spaced": st.booleans()})


# --------------------------------------------------------------------------
# The properties.
# --------------------------------------------------------------------------


@SETTINGS
@given(case=ROUTES.flatmap(lambda r: st.tuples(st.just(r), request_trees(r))), options=render_options)
def test_request_shaped_bodies_follow_the_first_failing_rule(case: tuple[str, Node], options: dict[str, bool]) -> None:
    """Duplicate keys: the last value of a repeated key wins (RFC 8259 leaves it open;
    Narwhal validates and forwards the same value, so engines never see a value that
    was not validated). The oracle models that with :func:`members`."""
    route, tree = case
    body = render(tree, **options)
    assert_matches(route, body, oracle_tree(route, tree), tree)


@SETTINGS
@given(route=ROUTES, tree=json_trees, options=render_options)
def test_any_json_value(route: str, tree: Node, options: dict[str, bool]) -> None:
    assert_matches(route, render(tree, **options), oracle_tree(route, tree), tree)


@SETTINGS
@given(
    route=ROUTES,
    base=request_trees(),
    extra=st.lists(st.tuples(keys, json_trees), max_size=2),
    prompt=st.sampled_from([("prompt", s("hi")), ("messages", arr(obj(("role", s("user")))))]),
)
def test_accepted_bodies_keep_every_other_field_exactly(
    route: str, base: Node, extra: list[tuple[str, Node]], prompt: tuple[str, Node]
) -> None:
    """Bodies built to pass (wrong-typed validated fields dropped) pass through exactly."""
    validated = set(TYPED_FIELDS) | {"audio", "modalities", "tools"}
    pairs = [(k, v) for k, v in base[1] if k not in validated] + extra
    pairs = [(k, v) for k, v in pairs if k not in validated]
    pairs.insert(len(pairs) // 2, ("prompt", s("hi")) if route == COMPLETIONS else ("messages", arr(obj())))
    pairs.append(prompt)
    tree: Node = ("obj", pairs)
    verdict = oracle_tree(route, tree)
    assert verdict.accepted, verdict
    assert_matches(route, render(tree), verdict, tree)


@SETTINGS
@given(route=ROUTES, body=st.binary(max_size=200))
def test_arbitrary_bytes(route: str, body: bytes) -> None:
    verdict, tree = oracle_bytes(route, body)
    assert_matches(route, body, verdict, tree)


@st.composite
def mutated_bodies(draw: st.DrawFn) -> bytes:
    """A real-looking body with a few bytes cut, inserted or replaced."""
    body = bytearray(render(draw(request_trees()), spaced=draw(st.booleans())))
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["cut", "insert", "replace", "truncate"]))
        at = draw(st.integers(0, len(body)))
        if kind == "cut" and at < len(body):
            del body[at]
        elif kind == "insert":
            body[at:at] = draw(st.sampled_from([b",", b"}", b"]", b"\"", b"\\", b"\xff", b"\xed\xa0\x80", b"NaN",
                                                b"\x00", b"\n", b" ", b"{", b"[", b"0", b"-", b"e", b"."]))
        elif kind == "replace" and at < len(body):
            body[at] = draw(st.integers(0, 255))
        else:
            del body[at:]
    return bytes(body)


@SETTINGS
@given(route=ROUTES, body=mutated_bodies())
def test_almost_json_bytes(route: str, body: bytes) -> None:
    verdict, tree = oracle_bytes(route, body)
    assert_matches(route, body, verdict, tree)


# --------------------------------------------------------------------------
# Examples docs/contract.md names.
# --------------------------------------------------------------------------

EXACT_NUMBERS = [
    "1e400", "-1e400", "1e-400", "0.1000000000000000055511151231257827", "123456789012345678901234567890",
    "-0.0", "-0", "5e-324", "1.7976931348623159e308", "9007199254740993", "1" * 4300,
    # Subnormals and underflows (orjson: 5e-324 and 0.0), in every spelling of the exponent.
    "4.9e-324", "1E-400", "-2.5e-310", "7e-0000000000000000000400",
    # Exponents orjson keeps by value (written back as 1e+308) or refuses (the exact path).
    "1e308", "1e+308", "-1E+309", "12e0000000000000000000005",
]


@pytest.mark.parametrize("literal", EXACT_NUMBERS)
@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_numbers_pass_through_by_exact_decimal_value(route: str, literal: str) -> None:
    """docs/contract.md, "Request rules": never rounded through a float, never turned into ``Infinity``."""
    body = (
        f'{{"model":"{ALIAS}","prompt":"p","messages":[],"x":{literal},"y":[{literal}],'
        f'"z":{{"k":{literal}}},"w":"1e400"}}'
    ).encode()
    accepted = check_request(route, body, MODEL_NAMES, MODEL)  # type: ignore[arg-type]
    encoded = wire.dumps(accepted.body)
    assert b"Infinity" not in encoded and b"NaN" not in encoded
    back = json.loads(encoded, parse_float=Decimal, parse_int=Decimal, parse_constant=_no_constant)
    value = Decimal(literal)
    assert back["x"] == value and back["y"] == [value] and back["z"] == {"k": value}
    assert back["w"] == "1e400"
    assert back["model"] == MODEL
    assert list(back) == ["model", "prompt", "messages", "x", "y", "z", "w"]


@pytest.mark.parametrize("digits", [4301, 20000])
def test_huge_integer_literal_never_escapes_as_valueerror(digits: int) -> None:
    """An integer literal longer than CPython's int-string limit (4300 digits) is still JSON.

    docs/contract.md, "Request rules", wants it passed through by exact value; at the very least the
    answer must be a ContractError, never a bare ``ValueError``.
    """
    body = b'{"prompt":"p","messages":[],"x":' + b"7" * digits + b"}"
    outcome = run(COMPLETIONS, body)
    if isinstance(outcome, ContractError):
        assert (outcome.status, outcome.param) == (400, None)
    else:
        back = json.loads(wire.dumps(outcome.body), parse_int=lambda t: t)
        assert back["x"] == "7" * digits


INVALID_JSON = [
    b"",
    b" ",
    b"\xff",
    b'{"prompt": "\xff"}',
    b'{"prompt": "\xed\xa0\x80"}',  # a surrogate encoded in UTF-8
    b'{"prompt": "\\ud800"}',  # a lone surrogate escape
    b'{"prompt": "\\udc00"}',
    b'{"prompt": "\\ud800x", "x": 1e400}',  # the exact path too
    b'{"prompt": "a", "\\udfff": 1}',  # in a key
    b'{"prompt": "p", "x": NaN}',
    b'{"prompt": "p", "x": Infinity}',
    b'{"prompt": "p", "x": -Infinity}',
    b'{"prompt": "p", "x": [NaN, 0.1000000000000000055511151231257827]}',
    b'{"prompt": "p",}',
    b"{'prompt': 'p'}",
    b'{"prompt": "p"} x',
    b'{"prompt": "p"}{}',
    b'{"prompt": "\x01"}',
    b'{"prompt": 01}',
    b"\xef\xbb\xbf" + b'{"prompt": "p"}',
    b'{"prompt": "p", "x": +1}',
    b'{"prompt": "p", "x": .5}',
    b'{"prompt": "p", "x": 1.}',
]


@pytest.mark.parametrize("body", INVALID_JSON)
@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_invalid_json_is_400_with_null_param(route: str, body: bytes) -> None:
    outcome = run(route, body)
    assert isinstance(outcome, ContractError), f"accepted {body!r}"
    assert (outcome.status, outcome.param, outcome.code, outcome.type) == (400, None, None, "invalid_request_error")


def nested(levels: int, *, risky: bool = False) -> bytes:
    """An object whose nesting depth (the outer object included) is ``levels``."""
    inner = b"[" * (levels - 1) + (b"1e400" if risky else b"") + b"]" * (levels - 1)
    return b'{"prompt":"p","messages":[{}],"x":' + inner + b"}"


@pytest.mark.parametrize("risky", [False, True], ids=["fast-path", "exact-path"])
@pytest.mark.parametrize("extra", [1, 2, 10, 1000, 5000])
def test_nesting_deeper_than_max_depth_is_400(risky: bool, extra: int) -> None:
    outcome = run(COMPLETIONS, nested(wire.MAX_DEPTH + extra, risky=risky))
    assert isinstance(outcome, ContractError)
    assert (outcome.status, outcome.param) == (400, None)


@pytest.mark.parametrize("risky", [False, True], ids=["fast-path", "exact-path"])
@pytest.mark.parametrize("levels", [wire.MAX_DEPTH - 2, wire.MAX_DEPTH - 1, wire.MAX_DEPTH])
def test_nesting_up_to_max_depth_is_accepted_and_encodable(risky: bool, levels: int) -> None:
    """A body the contract accepts must also be one Narwhal can encode for the engines."""
    body = nested(levels, risky=risky)
    outcome = run(COMPLETIONS, body)
    assert not isinstance(outcome, ContractError), f"depth {levels} (limit {wire.MAX_DEPTH}) refused: {outcome!r}"
    encoded = wire.dumps(outcome.body)
    assert json.loads(encoded)["x"] == json.loads(body)["x"]


@pytest.mark.parametrize("decode", [wire.loads, wire.loads_answer], ids=["loads", "loads_answer"])
def test_the_shortest_documents_past_max_depth_are_refused(decode: Any) -> None:
    """Short documents skip the bracket count: the shortest too deep ones must still be refused."""
    for opener, closer in ((b"[", b"]"), (b'{"a":', b"}")):
        deep = opener * (wire.MAX_DEPTH + 1) + closer * (wire.MAX_DEPTH + 1)
        with pytest.raises(wire.JsonError, match="nesting deeper"):
            decode(deep)
        # Unclosed, or cut short: not JSON, whatever its depth.
        for broken in (opener * (wire.MAX_DEPTH + 1), deep[:-1], opener * 300):
            with pytest.raises(wire.JsonError):
                decode(broken)
    limit = b"[" * wire.MAX_DEPTH + b"]" * wire.MAX_DEPTH
    assert decode(limit) == json.loads(limit)


@settings(max_examples=examples(300), deadline=None)
@given(st.text(alphabet="[]{}:,\"a1 ", max_size=2 * wire.MAX_DEPTH + 1))
def test_short_documents_decode_within_max_depth_or_are_refused(text: str) -> None:
    data = text.encode()
    for decode in (wire.loads, wire.loads_answer):
        try:
            value = decode(data)
        except wire.JsonError:
            continue
        assert value == json.loads(data)
        wire.dumps(value)  # within what the encoder takes


# The number scan (wire._scan) has two implementations: bytes operations (the
# pure build) and one loop over the bytes (compiled: C). Each case: the bytes,
# whether a number orjson could change may be in them, and how many openers.
SCANS = [
    (b"", False, 0),
    (b'{"x": [1, 2.5, {"y": -3}]}', False, 3),
    (b"123456789012345", False, 0),  # 15 digits: a double keeps them
    (b"1234567890123456", True, 0),  # 16
    (b"1.23456789012345", True, 0),  # 16 digits and dots
    (b"[1234567890.12345]", True, 1),
    (b"12345678.9012345 1", True, 0),
    (b"1234567 890123456", False, 0),  # broken by a space
    (b"1e-10", False, 0),  # two exponent digits: still a normal double
    (b"1e-100", True, 0),
    (b"1E-400", True, 0),
    (b"1e-1.2", True, 0),  # as conservative as the byte classes
    (b"1e+100", False, 0),
    (b"1e100", False, 0),
    (b"e -100", False, 0),
    (b"ee-100", True, 0),
    (b"e-e-100", True, 0),
    (b"e--100", False, 0),
    (b"[" * 300 + b"{" * 7, False, 307),
    (b"\xff\x00[\x80{", False, 2),
    # Strings are stepped over: what is in them is no number, no opener.
    (b'"song-100 e-10 [{"', False, 0),
    (b'"type-100"', False, 0),
    (b'{"prompt": "card 4111111111111111, 1e-400 [[{"}', False, 1),
    (b'["12345678", 90123456]', False, 1),  # a string ends a run
    (b'"a\\\\"1234567890123456', True, 0),  # an escaped backslash: the quote after it ends the string
    (b'"\\\\\\\\"[', False, 1),
    (b'"unterminated 1234567890123456 [', False, 0),  # to the end of the bytes
    (b'"ends in a backslash\\', False, 0),
    (b'[1e-100, "x"]', True, 1),
    (b'["x", 1e-100]', True, 1),
    (b'"x"1234567890123456', True, 0),
    (b'1234567890"x"123456', False, 0),
]


@pytest.mark.parametrize("scan", ["_scan_classes", "_scan_loop"])
@pytest.mark.parametrize(("data", "risky", "openers"), SCANS)
def test_number_scan_finds_risky_numbers_and_counts_openers(scan: str, data: bytes, risky: bool, openers: int) -> None:
    assert getattr(wire, scan)(data) == 2 * openers + risky


# Where a quote follows a backslash, the bytes operations keep the strings
# (a more careful verdict); the loop steps over them by JSON's rule.
ESCAPED_QUOTES = [
    # bytes, (risky, openers) of the loop, of the bytes operations
    (b'"a\\\\\\"1234567890123456"', (False, 0), (True, 0)),  # an escaped quote does not end the string
    (b'{"p": "say \\"[1e-100\\" twice"}', (False, 1), (True, 2)),
    (b'["\\"", 12345678901234567]', (True, 1), (True, 1)),
]


@pytest.mark.parametrize(("data", "loop", "classes"), ESCAPED_QUOTES)
def test_where_a_quote_may_be_escaped_the_bytes_operations_look_inside_strings(
        data: bytes, loop: tuple[bool, int], classes: tuple[bool, int]) -> None:
    assert wire._scan_loop(data) == 2 * loop[1] + loop[0]
    assert wire._scan_classes(data) == 2 * classes[1] + classes[0]


@settings(max_examples=examples(500), deadline=None)
@given(st.one_of(st.binary(max_size=300), st.text(alphabet="0123456789.eE-+[]{}\"\\ a", max_size=300).map(str.encode)))
def test_both_number_scans_agree(data: bytes) -> None:
    # Exactly, unless a quote follows a backslash; then the bytes operations are the more careful.
    loop, classes = wire._scan_loop(data), wire._scan_classes(data)
    if b'\\"' not in data:
        assert loop == classes
    else:
        assert classes & 1 >= loop & 1 and classes >> 1 >= loop >> 1


def test_the_compiled_build_scans_with_the_loop() -> None:
    compiled = not wire.__file__.endswith(".py")
    assert wire._scan is (wire._scan_loop if compiled else wire._scan_classes)


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    body = b'{"prompt":"' + b"[{" * 1000 + b'\\"' + b"[" * 10 + b'"}'
    accepted = check_request(COMPLETIONS, body, MODEL_NAMES, MODEL)
    assert accepted.body["prompt"] == "[{" * 1000 + '"' + "[" * 10


@pytest.mark.parametrize(
    ("body", "value"),
    [
        (b'{"prompt":"p","temperature":0.5,"temperature":1.5}', "1.5"),
        (b'{"prompt":"p","temperature":0.5,"temperature":1e400}', "1e400"),
        (b'{"prompt":"p","temperature":1e400,"temperature":0.25}', "0.25"),
    ],
)
def test_duplicate_keys_last_value_wins(body: bytes, value: str) -> None:
    """Duplicate keys: the last value wins, on both decoding paths, and it is the value
    that reaches the engine (so the engine never sees a value that was not validated)."""
    accepted = check_request(COMPLETIONS, body, MODEL_NAMES, MODEL)
    back = json.loads(wire.dumps(accepted.body), parse_float=Decimal)
    assert back["temperature"] == Decimal(value)
    assert list(back) == ["prompt", "temperature", "model"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"prompt":"p","n":2,"n":1}', None),  # validated: the last n is 1
        (b'{"prompt":"p","n":1,"n":2}', "n"),
        (b'{"prompt":"p","max_tokens":5,"max_tokens":true}', "max_tokens"),
        (b'{"prompt":"p","model":"gpt-4o","model":"llama-3.1-8b"}', None),
        (b'{"messages":[],"messages":null}', "messages"),
    ],
)
def test_duplicate_validated_keys_use_the_last_value(body: bytes, param: str | None) -> None:
    route = CHAT if b"messages" in body else COMPLETIONS
    outcome = run(route, body)
    if param is None:
        assert not isinstance(outcome, ContractError), outcome
    else:
        assert isinstance(outcome, ContractError) and outcome.param == param


@pytest.mark.parametrize(
    ("route", "body", "status", "param", "code"),
    [
        (COMPLETIONS, b'{"prompt":"p","max_tokens":"16"}', 400, "max_tokens", None),
        (COMPLETIONS, b'{"prompt":"p","max_tokens":true}', 400, "max_tokens", None),
        (COMPLETIONS, b'{"prompt":"p","n":1.0}', 400, "n", None),
        (COMPLETIONS, b'{"prompt":"p","best_of":false}', 400, "best_of", None),
        (COMPLETIONS, b'{"prompt":"p","stream":1}', 400, "stream", None),
        (COMPLETIONS, b'{"prompt":{"a":1}}', 400, "prompt", None),
        (CHAT, b'{"messages":[{"role":"user"},"x"]}', 400, "messages", None),
        (CHAT, b'{"messages":[{}], "model": 7, "stream": 1}', 400, "model", None),
        (CHAT, b'{"prompt":"p"}', 400, "messages", None),
        (COMPLETIONS, b'{"messages":[]}', 400, "prompt", None),
        (COMPLETIONS, b'{"prompt":null}', 400, "prompt", None),
        (COMPLETIONS, b'{"prompt":"p","model":"gpt-4o","n":5}', 404, "model", "model_not_found"),
        (COMPLETIONS, b'{"model":"gpt-4o"}', 400, "prompt", None),
        (COMPLETIONS, b'{"prompt":"p","n":2,"best_of":3}', 400, "n", None),
        (COMPLETIONS, b'{"prompt":"p","best_of":3,"n":2}', 400, "n", None),
        (COMPLETIONS, b'{"prompt":"p","best_of":2,"audio":{}}', 400, "best_of", None),
        (CHAT, b'{"messages":[],"audio":{"voice":"x"},"modalities":["audio"]}', 400, "audio", None),
        (CHAT, b'{"messages":[],"modalities":["text","audio"]}', 400, "modalities", None),
        (CHAT, b'{"messages":[],"modalities":[]}', 400, "modalities", None),
        (CHAT, b'{"messages":[],"tools":{"type":"function"}}', 400, "tools", None),
        (CHAT, b'{"messages":[],"tools":[{"type":"function"},3]}', 400, "tools", None),
        (CHAT, b'{"messages":[],"tools":[{"type":"function"},{"function":{}}]}', 400, "tools[1].type", None),
        (CHAT, b'{"messages":[],"tools":[{"type":"function"},{"type":"x"},{"type":"y"}]}', 400,
         "tools[1].type", None),
        (CHAT, b'{"messages":[],"tools":[],"modalities":["text"],"audio":null,"n":1,"best_of":-3}', None, None,
         None),
        (CHAT, b'{"messages":[],"n":123456789012345678901234567890}', 400, "n", None),
        (CHAT, b'{"messages":[],"n":-123456789012345678901234567890}', None, None, None),
        (COMPLETIONS, b'[{"prompt":"p"}]', 400, None, None),
        (COMPLETIONS, b'"prompt"', 400, None, None),
        (COMPLETIONS, b"null", 400, None, None),
    ],
)
def test_named_examples(route: str, body: bytes, status: int | None, param: str | None, code: str | None) -> None:
    outcome = run(route, body)
    if status is None:
        assert not isinstance(outcome, ContractError), outcome
    else:
        assert isinstance(outcome, ContractError), f"accepted {body!r}"
        assert (outcome.status, outcome.param, outcome.code) == (status, param, code)
    # The oracle agrees with every named example.
    verdict, _ = oracle_bytes(route, body)
    assert (verdict.status, verdict.param, verdict.code) == (status, param, code)


def test_seed_example_envelope() -> None:
    with pytest.raises(ContractError) as info:
        check_request(COMPLETIONS, b'{"prompt":"p","max_tokens":"x"}', MODEL_NAMES, MODEL)
    assert info.value.envelope() == {
        "error": {
            "message": "max_tokens must be an integer",
            "type": "invalid_request_error",
            "param": "max_tokens",
            "code": None,
        }
    }


@example(route=CHAT, order=["request_id", "bootstrap_room", "kv_transfer_params"])
@settings(max_examples=examples(100), deadline=None)
@given(
    route=ROUTES,
    order=st.permutations(["request_id", "bootstrap_room", "kv_transfer_params", "bootstrap_host", "bootstrap_"]),
)
def test_router_owned_fields_are_stripped_in_body_order(route: str, order: list[str]) -> None:
    pairs = [("prompt", s("p")), ("messages", arr())]
    for i, key in enumerate(order):
        pairs.append((key, num(str(i))))
        pairs.append((f"keep{i}", num(str(i))))
    tree: Node = ("obj", pairs)
    accepted = check_request(route, render(tree), MODEL_NAMES, MODEL)  # type: ignore[arg-type]
    assert accepted.stripped == tuple(order)
    assert list(accepted.body) == ["prompt", "messages"] + [f"keep{i}" for i in range(len(order))] + ["model"]


TOOL_TYPES = st.sampled_from([s("function"), s("function"), s("Function"), s("retrieval"), NULL, num("1"), None])


@settings(max_examples=examples(150), deadline=None)
@given(types=st.lists(TOOL_TYPES, max_size=5), tail=st.lists(st.tuples(keys, json_trees), max_size=2))
def test_tools_first_non_function_type_is_named_with_its_index(
    types: list[Node | None], tail: list[tuple[str, Node]]
) -> None:
    tools = arr(*[obj(("function", obj(("name", s("f"))))) if t is None else obj(("type", t)) for t in types])
    validated = set(TYPED_FIELDS) | {"audio", "modalities", "tools"}
    tree: Node = ("obj", [("messages", arr()), ("tools", tools)] + [(k, v) for k, v in tail if k not in validated])
    bad = [i for i, t in enumerate(types) if t != s("function")]
    verdict = oracle_tree(CHAT, tree)
    assert verdict.param == (f"tools[{bad[0]}].type" if bad else None)
    assert_matches(CHAT, render(tree), verdict, tree)


@settings(max_examples=examples(500), deadline=None)
@given(literals=st.lists(number_literals(), min_size=1, max_size=4), route=ROUTES)
@example(literals=["1e400", "-0.0", "0.1000000000000000055511151231257827"], route=COMPLETIONS)
def test_any_number_literal_passes_through_by_exact_decimal_value(literals: list[str], route: str) -> None:
    """docs/contract.md, "Request rules": numbers outside the validation set reach the engine with the same
    decimal value."""
    values = ",".join(literals)
    body = f'{{"prompt":"p","messages":[],"xs":[{values}],"o":{{"k":{literals[0]}}}}}'.encode()
    accepted = check_request(route, body, MODEL_NAMES, MODEL)  # type: ignore[arg-type]
    back = reference_parse(wire.dumps(accepted.body).decode("utf-8"))
    got = dict(back)
    assert [Decimal(v) for v in got["xs"]] == [Decimal(lit) for lit in literals]
    assert Decimal(dict(got["o"])["k"]) == Decimal(literals[0])
