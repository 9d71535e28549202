"""The 20 JSON schemas of the structured-output tests and benchmark: nested objects, arrays, enums,
anyOf, bounded numbers, string patterns, required and optional keys. Strings and arrays are bounded
so that even a small model's output closes within a few dozen tokens."""

NAME = {"type": "string", "maxLength": 12}

SCHEMAS: list[dict] = [
    {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
    },
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["score"]},
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3}
        },
        "required": ["tags"],
    },
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]},
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999}, "name": NAME},
                "required": ["id", "name"],
            }
        },
        "required": ["user"],
    },
    {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}},
        "required": ["value"],
    },
    {
        "type": "object",
        "properties": {"title": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
        "required": ["title"],
    },
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4},
    {
        "type": "object",
        "properties": {"point": {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2}},
        "required": ["point"],
    },
    {
        "type": "object",
        "properties": {"status": {"enum": ["open", "closed"]}, "count": {"type": "integer", "minimum": 0}},
        "required": ["status", "count"],
    },
    {
        "type": "object",
        "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.com$"}},
        "required": ["email"],
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                },
            }
        },
        "required": ["items"],
    },
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 5}},
        "required": ["a"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "shape": {
                "anyOf": [
                    {"type": "object", "properties": {"r": {"type": "number", "minimum": 0}}, "required": ["r"]},
                    {
                        "type": "object",
                        "properties": {"w": {"type": "integer"}, "h": {"type": "integer"}},
                        "required": ["w", "h"],
                    },
                ]
            }
        },
        "required": ["shape"],
    },
    {
        "type": "object",
        "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}, "note": NAME},
        "required": ["level"],
    },
    {
        "type": "object",
        "properties": {"temp": {"type": "number", "exclusiveMinimum": -50, "maximum": 60}},
        "required": ["temp"],
    },
    {
        "type": "object",
        "properties": {
            "meta": {
                "type": "object",
                "properties": {"lang": {"enum": ["en", "fr", "de"]}, "rtl": {"type": "boolean"}},
                "required": ["lang", "rtl"],
            },
            "words": {"type": "integer", "minimum": 0, "maximum": 1000},
        },
        "required": ["meta", "words"],
    },
    {
        "type": "object",
        "properties": {
            "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
            "done": {"type": "boolean"},
        },
        "required": ["date", "done"],
    },
]

assert len(SCHEMAS) == 20
