"""Property tests of what a request can carry: whatever values arrive, sampling parameters and the
request models either accept them or refuse them with the error the server turns into a 400 naming
the field, never another exception (which would be a 500).

Derandomized, so CI runs the same examples every time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from ember.sampling.params import SamplingParams
from ember.server.protocol import ChatCompletionRequest, CompletionRequest

SETTINGS = settings(
    max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)

# Integers at every scale, including past what floats and 64-bit ints hold, and their boundaries.
INTS = st.one_of(
    st.integers(-3, 40),
    st.integers(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**400, -(10**400)]),
)
FLOATS = st.one_of(st.floats(), st.floats(-3, 3), st.sampled_from([0.0, -0.0, 1e-300, 1e308, 5e-324]))
SCALARS = st.one_of(
    st.none(), st.booleans(), INTS, FLOATS, st.text(max_size=8), st.sampled_from([Fraction(1, 3), b"x", object()])
)
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=4), st.dictionaries(st.text(max_size=4), SCALARS, max_size=3))

# JSON as `json.loads` reads it (NaN and Infinity included, as the server's parser accepts them).
JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), INTS, st.floats(), st.text(max_size=10)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)

SAMPLING_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]


def _names_a_field(message: str, fields: set[str]) -> bool:
    """Whether the message starts with one of `fields` (how errors.value_error finds the request's `param`)."""
    match = re.match(r"\w+", message)
    return match is not None and match.group(0) in fields


# ---- SamplingParams -------------------------------------------------------------------------


@pytest.mark.parametrize("field", SAMPLING_FIELDS)
@SETTINGS
@given(value=VALUES)
def test_sampling_params_field_is_accepted_or_a_value_error_naming_it(field, value):
    try:
        params = SamplingParams(**{field: value})
    except ValueError as e:
        assert type(e) is ValueError and str(e).startswith(field), (field, value, e)
        return
    except Exception as e:  # noqa: BLE001 - anything but a ValueError fails the property
        pytest.fail(f"SamplingParams({field}={value!r}) raised {type(e).__name__}: {e}")
    _check_normalised(params)


@SETTINGS
@given(values=st.dictionaries(st.sampled_from(SAMPLING_FIELDS), VALUES, max_size=6))
def test_sampling_params_any_fields_are_accepted_or_a_value_error_naming_one(values):
    try:
        params = SamplingParams(**values)
    except ValueError as e:
        assert type(e) is ValueError and _names_a_field(str(e), set(values)), (values, e)
        return
    except Exception as e:  # noqa: BLE001 - anything but a ValueError fails the property
        pytest.fail(f"SamplingParams(**{values!r}) raised {type(e).__name__}: {e}")
    _check_normalised(params)


def _check_normalised(p: SamplingParams) -> None:
    """What the engine trusts without checking again."""
    for name in ("n", "top_k", "min_tokens"):
        assert type(getattr(p, name)) is int
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = getattr(p, name)
        assert type(value) is float and math.isfinite(value), name
    for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
        assert getattr(p, name) is None or type(getattr(p, name)) is int, name
    assert p.n >= 1 and p.top_k >= 0 and 0 < p.top_p <= 1 and 0 <= p.min_p <= 1
    assert p.seed is None or -(2**63) <= p.seed < 2**63
    assert all(type(s) is str and s for s in p.stop)
    assert all(type(t) is int and 0 <= t < 2**31 for t in p.stop_token_ids)
    for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
        assert type(getattr(p, name)) is bool, name


# ---- request models -------------------------------------------------------------------------

# The parts of structured outputs, response formats and stream options, in one object.
OPTIONS = st.fixed_dictionaries(
    {},
    optional={
        "json": JSON,
        "regex": st.text(max_size=8),
        "choice": st.lists(st.text(max_size=4), max_size=3),
        "grammar": st.text(max_size=8),
        "json_object": st.booleans(),
        "type": st.sampled_from(["text", "json_object", "json_schema"]),
        "include_usage": st.booleans(),
        "json_schema": st.fixed_dictionaries({}, optional={"name": st.text(max_size=4), "schema": JSON}),
    },
)
# A value of each JSON Schema type, near the limits the server checks more often than random JSON is.
OF_TYPE = {
    "integer": INTS,
    "number": st.one_of(INTS, st.floats()),
    "boolean": st.booleans(),
    "string": st.text(max_size=8),
    "null": st.none(),
    "array": st.lists(st.one_of(INTS, st.text(max_size=4)), max_size=3),
    "object": st.one_of(OPTIONS, st.dictionaries(st.text(max_size=4), JSON, max_size=3)),
}


def _shaped(field_schema: dict) -> st.SearchStrategy:
    """Values of the types a field's schema names (anywhere in it), else any JSON."""
    text = json.dumps(field_schema)
    types = sorted(set(re.findall(r'"type": "(\w+)"', text)) | ({"object"} if '"$ref"' in text else set()))
    return st.one_of([OF_TYPE[t] for t in types if t in OF_TYPE] or [JSON])


def _bodies(model, required: dict) -> st.SearchStrategy:
    """Any JSON, and objects with the model's required and optional fields: any JSON as values, or values
    of the types the model's JSON schema gives them."""
    properties = model.model_json_schema()["properties"]
    shaped = {name: _shaped(properties[name]) for name in model.model_fields if name not in required}
    return st.one_of(
        JSON,
        st.fixed_dictionaries(required, optional=dict.fromkeys(shaped, JSON)),
        st.fixed_dictionaries(required, optional=shaped),
        # a few fields at a time, so that more bodies validate and reach to_sampling_params
        st.lists(st.sampled_from(sorted(shaped)), max_size=3, unique=True).flatmap(
            lambda names: st.fixed_dictionaries({**required, **{n: shaped[n] for n in names}})
        ),
    )


PROMPTS = st.one_of(
    st.text(max_size=8),
    st.lists(INTS, max_size=3),
    st.lists(st.text(max_size=4), max_size=2),
    st.lists(st.lists(INTS, max_size=2), max_size=2),
    JSON,
)
MESSAGES = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"])},
            optional={"content": st.one_of(st.none(), st.text(max_size=8)), "name": st.text(max_size=4)},
        ),
        max_size=3,
    ),
    JSON,
)


@pytest.mark.parametrize(
    "model,required",
    [(CompletionRequest, {"prompt": PROMPTS}), (ChatCompletionRequest, {"messages": MESSAGES})],
    ids=["completion", "chat"],
)
@settings(SETTINGS, max_examples=400)
@given(data=st.data())
def test_request_models_validate_or_refuse_and_sampling_params_follow(model, required, data):
    body = data.draw(_bodies(model, required))
    try:
        request = model.model_validate(body)
    except ValidationError:
        event("refused by the model")
        return
    except Exception as e:  # noqa: BLE001 - anything but a validation error fails the property
        pytest.fail(f"{model.__name__}.model_validate({body!r}) raised {type(e).__name__}: {e}")
    try:
        request.to_sampling_params(SamplingParams())
    except ValidationError as e:
        pytest.fail(f"to_sampling_params raised a pydantic error: {e} for {body!r}")
    except ValueError as e:
        event("refused by to_sampling_params")
        fields = set(model.model_fields) | set(SAMPLING_FIELDS)
        assert _names_a_field(str(e), fields), (body, e)
    except Exception as e:  # noqa: BLE001 - anything but a ValueError fails the property
        pytest.fail(f"to_sampling_params of {body!r} raised {type(e).__name__}: {e}")
    else:
        event("accepted")
