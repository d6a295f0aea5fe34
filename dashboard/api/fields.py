"""Request fields that take a JSON value only as the OpenAPI schema types it.

DRF's fields convert: a CharField takes 5 as "5", an IntegerField takes "5"
and 5.0, a BooleanField takes "yes". The schema says `string`, `integer`,
`boolean`, so a client reading it (or schemathesis) rightly expects those to be
refused; these fields refuse them with a 400 naming the field and what it got.
Times are RFC 3339, the `date-time` format the schema states.
"""

import re
from datetime import UTC, date, datetime
from typing import Any

from django.db import models as db
from django.utils.dateparse import parse_datetime
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

# RFC 3339 section 5.6: full-date "T" full-time, the offset required ("t"/"z" in any case, as it allows).
DATE_TIME = re.compile(r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d{1,6})?([Zz]|[+-]\d{2}:\d{2})")
FULL_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def kind_of(value: Any) -> str:
    """What a JSON value is, for a message: `a string ('5')`, `a number (5)`, `true (a boolean)`, `null`."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, str):
        return f"a string ({value[:40]!r})"
    if isinstance(value, int | float):
        return f"a number ({value!r})"
    kinds: dict[type, str] = {list: "a list", dict: "an object"}
    return kinds.get(type(value), type(value).__name__)


def _refuse(field: serializers.Field, expected: str, data: Any):
    raise serializers.ValidationError(f"expected {expected}, got {kind_of(data)}", code="invalid")


class StrictCharField(serializers.CharField):
    """A JSON string, taken as given; a number or boolean is refused, not turned into text.

    Not trimmed: the schema's minLength counts the string sent, so "  " is a name, not a blank one.
    """

    def __init__(self, **kwargs):
        kwargs.setdefault("trim_whitespace", False)
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        if not isinstance(data, str):
            _refuse(self, "a string", data)
        return super().to_internal_value(data)


class StrictIntegerField(serializers.IntegerField):
    """A JSON integer; "5", 5.0 and true are refused."""

    def to_internal_value(self, data):
        if not isinstance(data, int) or isinstance(data, bool):
            _refuse(self, "an integer", data)
        return super().to_internal_value(data)


class StrictFloatField(serializers.FloatField):
    """A JSON number; "1.5" and true are refused."""

    def to_internal_value(self, data):
        if not isinstance(data, int | float) or isinstance(data, bool):
            _refuse(self, "a number", data)
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    """true or false; "yes", 1 and "true" are refused."""

    def to_internal_value(self, data):
        if not isinstance(data, bool):
            _refuse(self, "true or false", data)
        return data


class StrictChoiceField(serializers.ChoiceField):
    """One of the choices as the schema's enum lists it: 1 is not "1", "1" is not 1."""

    def to_internal_value(self, data):
        if data == "" and self.allow_blank:
            return ""
        if not any(type(data) is type(choice) and data == choice for choice in self.choices):
            choices = ", ".join(repr(choice) for choice in self.choices)
            raise serializers.ValidationError(f"expected one of {choices}, got {kind_of(data)}", code="invalid_choice")
        return data


def non_negative_decimal(max_digits: int, decimal_places: int) -> dict[str, Any]:
    """The schema of a StrictDecimalField of these digits that refuses negatives: a number below 10^(whole digits),
    or the decimal string reads give (`"0.150000"`)."""
    whole = max_digits - decimal_places
    return {
        "oneOf": [
            {"type": "number", "minimum": 0, "maximum": 10**whole, "exclusiveMaximum": True},
            {"type": "string", "pattern": rf"^\d{{1,{whole}}}(\.\d{{1,{decimal_places}}})?$"},
        ]
    }


class StrictDecimalField(serializers.DecimalField):
    """An exact decimal as written: a JSON number (0.15) or the decimal string reads give ("0.150000"), taken as
    the decimal it shows. Its schema is `non_negative_decimal`'s, set on each subclass (it depends on the digits)."""

    def to_internal_value(self, data):
        # DRF's own field reads a number by its text (0.15, not the double nearest it), but would take true as 1.
        if isinstance(data, bool) or not isinstance(data, int | float | str):
            _refuse(self, 'a number such as 0.15 or a string of one ("0.15")', data)
        return super().to_internal_value(data)


class StrictPrimaryKeyRelatedField(serializers.PrimaryKeyRelatedField):
    """A row's id as a JSON integer, as the schema types it: "5", 5.0 and true are refused (DRF's own takes "5")."""

    def to_internal_value(self, data):
        if not isinstance(data, int) or isinstance(data, bool):
            _refuse(self, "an integer id", data)
        return super().to_internal_value(data)


@extend_schema_field(
    {"anyOf": [{"type": "string", "format": "uri", "maxLength": 200}, {"type": "string", "maxLength": 0}]}
)
class UrlOrBlankField(serializers.URLField):
    """A URL (Django's URLField, 200 characters at most), or "" for none: the schema says both, where
    drf-spectacular's own says a URI only, which "" is not."""

    def __init__(self, **kwargs):
        super().__init__(max_length=200, allow_blank=True, **kwargs)


class Rfc3339DateTimeField(serializers.DateTimeField):
    """An RFC 3339 date-time (`2026-01-31T14:00:00Z`, the offset required): the schema's `date-time` format."""

    def to_internal_value(self, value):
        if not isinstance(value, str) or not DATE_TIME.fullmatch(value):
            _refuse(self, "an RFC 3339 date-time such as 2026-01-31T14:00:00Z", value)
        return super().to_internal_value(value.upper())


def parse_date_or_time(text: str) -> datetime | None:
    """An RFC 3339 date-time, or a full date (its midnight UTC); None when `text` is neither."""
    try:
        if DATE_TIME.fullmatch(text):
            return parse_datetime(text.upper())
        if FULL_DATE.fullmatch(text):
            day = date.fromisoformat(text)
            return datetime(day.year, day.month, day.day, tzinfo=UTC)
    except ValueError:
        pass
    return None


class RefuseUnknownKeys(serializers.Serializer):
    """A body with a key the serializer does not know is refused naming it (the schema says additionalProperties
    false, see `schema.strict_input`), as a catalog file's unknown key is: a typo is not silently dropped."""

    def to_internal_value(self, data):
        if isinstance(data, dict) and (unknown := [key for key in data if key not in self.fields]):
            known = ", ".join(self.fields)
            raise serializers.ValidationError(
                {str(key)[:40]: [f"unknown key (expected one of {known})"] for key in unknown}
            )
        return super().to_internal_value(data)


class StrictModelSerializer(RefuseUnknownKeys, serializers.ModelSerializer):
    """A ModelSerializer whose fields are the strict ones above, so what it accepts is what its schema says."""

    serializer_field_mapping = {
        **serializers.ModelSerializer.serializer_field_mapping,
        db.BigIntegerField: StrictIntegerField,
        db.BooleanField: StrictBooleanField,
        db.CharField: StrictCharField,
        db.DateTimeField: Rfc3339DateTimeField,
        db.FloatField: StrictFloatField,
        db.IntegerField: StrictIntegerField,
        db.PositiveIntegerField: StrictIntegerField,
        db.PositiveSmallIntegerField: StrictIntegerField,
        db.SmallIntegerField: StrictIntegerField,
        db.TextField: StrictCharField,
    }
    serializer_choice_field = StrictChoiceField
