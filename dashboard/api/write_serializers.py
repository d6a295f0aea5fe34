"""The REST API's request bodies, on the strict fields of `fields`: the schema they give is what is refused.

Model writes take a catalog file's entry (`catalog apply`); the body is first
checked here field by field (types, lengths, patterns, ranges, choices: what
OpenAPI can say), then by the catalog's own rules, which also judge fields
against each other and against the rest of the catalog (`dashboard.api.writes`).
"""

from decimal import Decimal
from typing import Any, cast

from django.db import models as db
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from catalog.catalog_file import ADAPTER_KEYS, MODEL_KEYS, PROFILE_FIELDS
from catalog.models import Adapter, Model, Profile, price_validator, public_name_validator
from catalog.prices import PRICE_DECIMAL_PLACES, PRICE_MAX_DIGITS
from catalog.rules import INTEGER_MAX
from dashboard.api.fields import StrictCharField, StrictDecimalField, StrictModelSerializer, non_negative_decimal
from dashboard.api.serializers import ENV_HELP
from keys.models import ApiKey
from nodewire.engine_env import MAX_VALUE_LENGTH, MAX_VARIABLES, env_problem
from teams.models import Team

ENV_WRITE_HELP = (
    f"{ENV_HELP} Names: letters, digits and _, not starting with a digit, at most 128 characters, "
    "and not one the agent sets itself (CUDA_VISIBLE_DEVICES, HF_HOME, VLLM_HOST_IP, LLMGW_GPU_MEMORY_MIB)."
)


def public_names(**kwargs) -> serializers.ListField:
    """A list of public names (aliases): the pattern and length of a model's own name."""
    return serializers.ListField(
        child=StrictCharField(max_length=200, validators=[public_name_validator]), required=False, **kwargs
    )


@extend_schema_field(
    {
        "type": "object",
        "additionalProperties": {"type": "string", "maxLength": MAX_VALUE_LENGTH},
        "maxProperties": MAX_VARIABLES,
    }
)
class EnvField(serializers.Field):
    """A profile's engine env as written, on the agent's own rule (nodewire/engine_env.py) and in its words."""

    def __init__(self, **kwargs):
        super().__init__(required=False, help_text=ENV_WRITE_HELP, **kwargs)

    def to_internal_value(self, data):
        if problem := env_problem(data):
            raise serializers.ValidationError(problem)
        return data


@extend_schema_field(non_negative_decimal(PRICE_MAX_DIGITS, PRICE_DECIMAL_PLACES))
class PriceField(StrictDecimalField):
    """A price per million tokens as written: a JSON number (0.15) or the decimal string reads give ("0.150000"),
    taken as the exact decimal it shows; never negative, at most 6 decimal places."""

    def __init__(self, **kwargs):
        super().__init__(
            max_digits=PRICE_MAX_DIGITS,
            decimal_places=PRICE_DECIMAL_PLACES,
            min_value=Decimal(0),
            required=False,
            # The catalog's own words, as admin and `catalog apply` say it.
            error_messages={"min_value": price_validator.message},
            **kwargs,
        )


def price_of(model: type[Model] | type[Adapter], name: str) -> PriceField:
    """The write field of a model's or an adapter's price, with the column's help text (an adapter's may be null)."""
    column = cast(db.DecimalField, model._meta.get_field(name))
    return PriceField(allow_null=column.null, help_text=str(column.help_text))


class ProfileWriteSerializer(StrictModelSerializer):
    """A profile as written: the catalog file's profile fields (order is the list position)."""

    # An empty argument is a real argv item (`--chat-template ""`), so items may be blank.
    engine_args = serializers.ListField(
        child=StrictCharField(allow_blank=True),
        required=False,
        help_text='Extra engine argv, e.g. ["--max-model-len", "8192"].',
    )
    env = EnvField()

    class Meta:
        model = Profile
        fields = list(PROFILE_FIELDS)


class AdapterWriteSerializer(StrictModelSerializer):
    """A LoRA adapter as written with its base model (the catalog file's adapter keys)."""

    aliases = public_names()
    price_input_per_million = price_of(Adapter, "price_input_per_million")
    price_output_per_million = price_of(Adapter, "price_output_per_million")

    class Meta:
        model = Adapter
        fields = list(ADAPTER_KEYS)
        # Name clashes are the catalog's rule, judged on the catalog as the write leaves it.
        extra_kwargs = {"name": {"validators": [public_name_validator]}}


class ModelWriteSerializer(StrictModelSerializer):
    """A model as created by POST: the same entry as in a catalog file (`catalog apply`)."""

    aliases = public_names()
    profiles = ProfileWriteSerializer(many=True)
    adapters = AdapterWriteSerializer(many=True, required=False)
    price_input_per_million = price_of(Model, "price_input_per_million")
    price_output_per_million = price_of(Model, "price_output_per_million")

    class Meta:
        model = Model
        fields = list(MODEL_KEYS)  # a catalog file's entry: the API writes a model as a file gives it
        extra_kwargs: dict[str, dict[str, Any]] = {
            "name": {"validators": [public_name_validator], "help_text": "Public name; cannot change after creation."}
        }


class ModelReplaceSerializer(ModelWriteSerializer):
    """A model as replaced by PUT (or changed by PATCH): `name` may be left out, and is the model's own if given."""

    class Meta(ModelWriteSerializer.Meta):
        extra_kwargs: dict[str, dict[str, Any]] = {
            "name": {
                "validators": [public_name_validator],
                "required": False,
                "help_text": "The model's own name, if given (a model cannot be renamed).",
            }
        }


def body_problems(serializer_class: type[serializers.Serializer], body: Any, *, partial: bool = False) -> list[str]:
    """What is wrong with `body` field by field, each as `where: problem` (`profiles[0].gpus_per_node: …`)."""
    serializer = serializer_class(data=body, partial=partial)
    if serializer.is_valid():
        return []
    return list(_flattened(serializer.errors, ""))


def _flattened(errors: Any, where: str):
    if isinstance(errors, dict):
        for key, value in errors.items():
            if key == "non_field_errors":
                inner = where
            elif isinstance(key, int):  # a ListField's items
                inner = f"{where}[{key}]"
            else:
                inner = f"{where}.{key}" if where else str(key)
            yield from _flattened(value, inner)
    elif isinstance(errors, list) and errors and all(isinstance(e, str) for e in errors):
        # A missing key in the catalog file's words, so the API and `catalog apply` say it alike.
        messages = ["missing (required)" if getattr(e, "code", None) == "required" else str(e) for e in errors]
        yield from (f"{where}: {message}" if where else message for message in messages)
    elif isinstance(errors, list):
        for index, value in enumerate(errors):
            yield from _flattened(value, f"{where}[{index}]")


class ApiKeyWriteSerializer(StrictModelSerializer):
    """An API key as created: its name, scopes, expiry and limits."""

    allowed_models = serializers.ListField(
        child=StrictCharField(),
        required=False,
        help_text='Models (names or aliases) it may use, e.g. ["llama3"]; empty = all.',
    )
    allowed_pools = serializers.ListField(
        child=StrictCharField(), required=False, help_text="Pools whose replicas serve it; empty = any."
    )
    team = serializers.PrimaryKeyRelatedField(
        queryset=Team.objects.all(),
        required=False,
        allow_null=True,
        help_text="The team it belongs to (its id): a member's own key; an operator's may have none.",
    )

    class Meta:
        model = ApiKey
        fields = ["name", "allowed_models", "allowed_pools", "expires_at", "rpm", "tpm", "team", "priority_class"]
        # The column is a 32-bit integer on PostgreSQL.
        extra_kwargs = {"rpm": {"max_value": INTEGER_MAX}, "tpm": {"max_value": INTEGER_MAX}}
