"""API keys (stored hashed, shown once), the tokens each key spent per model and hour, each model's answers
whose engine broke off per hour, and the budgets of keys, members and teams."""

from decimal import Decimal
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from hub.credentials import hash_secret, new_secret
from hub.priority import PriorityClass

KEY_PREFIX = "sk-llmgw-"


class ApiKeyQuerySet(models.QuerySet["ApiKey"]):
    """Queries over API keys."""

    def active(self) -> "ApiKeyQuerySet":
        """The keys not revoked (expired ones included: expiry is checked where a key is used)."""
        active: ApiKeyQuerySet = self.filter(active=True)
        return active


class ApiKey(models.Model):
    """A bearer key clients send to the router. Only its hash and prefix are stored.

    A key may be limited to some models (names or aliases), to some pools, in
    time (`expires_at`), and in requests and tokens per minute.
    """

    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=24, help_text="The start of the key, to recognise it.")
    key_hash = models.CharField(max_length=64, unique=True)
    active = models.BooleanField(default=True, help_text="Untick to revoke: every router refuses it within a second.")
    created_at = models.DateTimeField(auto_now_add=True)
    allowed_models = models.JSONField(
        default=list, blank=True, help_text='Models (names or aliases) it may use, e.g. ["llama3"]; empty = all.'
    )
    allowed_pools = models.JSONField(default=list, blank=True, help_text="Pools whose replicas serve it; empty = any.")
    expires_at = models.DateTimeField(null=True, blank=True, help_text="Refused from then on; empty = never.")
    rpm = models.PositiveIntegerField(null=True, blank=True, help_text="Requests per minute; empty = no limit.")
    tpm = models.PositiveIntegerField(null=True, blank=True, help_text="Tokens per minute; empty = no limit.")
    priority_class = models.CharField(
        "priority class",
        max_length=12,
        blank=True,
        db_default="",  # rows written by code that predates it (a rolling upgrade): their team's
        choices=PriorityClass.choices,
        help_text="Which of a full model's waiting requests leave first; empty = its team's (standard without one).",
    )
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        related_name="api_keys",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        help_text="Who holds it; empty = an operator's key.",
    )
    team = models.ForeignKey(
        "teams.Team",
        related_name="api_keys",
        null=True,
        blank=True,
        on_delete=models.PROTECT,  # a team's keys are revoked or moved before the team goes
        help_text="The team it belongs to, whose models bound its own; empty = no team (as keys made before teams).",
    )

    objects = ApiKeyQuerySet.as_manager()

    class Meta:
        ordering = ["name", "id"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    def clean(self) -> None:
        """A team's key is held by a member of it, and names no model outside the team's scope (by the names
        written: a key narrows its team's scope, never widens it)."""
        super().clean()
        team = self.team
        if team is None:
            return
        if self.user_id is not None and not team.has_member(self.user_id):
            raise ValidationError({"user": f"{self.user} is not a member of the team “{team.name}”."})
        if team.allowed_models:
            wider = [name for name in self.allowed_models or () if name not in team.allowed_models]
            if wider:
                listed = ", ".join(f"`{name}`" for name in wider)
                raise ValidationError(
                    {"allowed_models": f"the team “{team.name}” may not use {listed}: a key's models are its team's "
                     f"or fewer ({', '.join(team.allowed_models)})."}
                )  # fmt: skip

    @classmethod
    def issue(cls, name: str, key: str | None = None, **fields: Any) -> tuple["ApiKey", str]:
        """Create a key (with any other `fields`: scopes, expiry, limits) and return it with its plaintext,
        which is never stored."""
        plaintext = key or new_secret(KEY_PREFIX)
        # An imported key (another gateway's) shows only its first 6 characters: they may be all it has of random.
        visible = len(KEY_PREFIX) + 6 if plaintext.startswith(KEY_PREFIX) else 6
        api_key = cls.objects.create(name=name, prefix=plaintext[:visible], key_hash=hash_secret(plaintext), **fields)
        return api_key, plaintext


# Spend is kept in millionths of a millionth of the currency unit: tokens times a price per million with six
# decimals is a whole number of them, so sums are exact in any database (SQLite's decimals are floats).
SPEND_UNITS = 10**12


class TokenUsage(models.Model):
    """Tokens one key spent on one model in one hour, as the routers counted them from the answers, and what they
    cost: each answer's tokens at the catalog's prices as the endpoint table that served it carried them (or its
    budgets' settlement, hub.budgets); with the key's team and holder then, so spend stays where it was made if
    the key moves."""

    key = models.ForeignKey(ApiKey, related_name="token_usage", null=True, on_delete=models.SET_NULL)
    key_name = models.CharField(max_length=100, help_text="The key's name when counted (kept if it is deleted).")
    model = models.CharField(max_length=200)
    hour = models.DateTimeField(help_text="Start of the hour (UTC).")
    requests = models.PositiveBigIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    spend_units = models.PositiveBigIntegerField(
        default=0, help_text="What the tokens cost at the prices when counted, in 10⁻¹² of the currency unit."
    )
    team = models.ForeignKey("teams.Team", related_name="token_usage", null=True, blank=True, on_delete=models.SET_NULL)
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, related_name="token_usage", null=True, blank=True, on_delete=models.SET_NULL
    )

    class Meta:
        ordering = ["-hour", "key_name", "model"]
        constraints = [models.UniqueConstraint(fields=["key", "model", "hour"], name="token_usage_one_row_per_hour")]
        # A key's and a team's spend over a window is a sum over these alone (an index-only scan on PostgreSQL,
        # which keeps `spend_units` in them): a month in a few milliseconds whatever else is stored.
        indexes = [
            models.Index(fields=["team", "hour"], include=["spend_units"], name="token_usage_team_hour_spend"),
            models.Index(fields=["key", "hour"], include=["spend_units"], name="token_usage_key_hour_spend"),
        ]

    def __str__(self) -> str:
        return f"{self.key_name} on {self.model} at {self.hour:%Y-%m-%d %H}:00"

    @property
    def spend(self) -> Decimal:
        """What the tokens cost, in the currency unit."""
        return Decimal(self.spend_units) / SPEND_UNITS


class ContinuationHour(models.Model):
    """Answers of one model whose engine broke off in one hour, by what became of them, as the routers counted them
    (hub.contracts.ContinuationCount: each break counts once, as in `llmgw_router_stream_continuations_total`)."""

    model = models.CharField(max_length=200)
    hour = models.DateTimeField(help_text="Start of the hour (UTC).")
    continued = models.PositiveBigIntegerField(
        default=0,
        help_text="The client had its whole answer: continued elsewhere, asked again whole, or lacking only its end.",
    )
    failed = models.PositiveBigIntegerField(
        default=0, help_text="Ended with an error: no other replica, or LLMGW_STREAM_MIGRATIONS reached."
    )
    refused = models.PositiveBigIntegerField(
        default=0, help_text="Ended with an error: going on would change the answer (n > 1, guided, logprobs…)."
    )
    reprocessed_prompt_tokens = models.PositiveBigIntegerField(
        default=0, help_text="Prompt tokens engines read again to continue them (no client's usage)."
    )

    class Meta:
        ordering = ["-hour", "model"]
        constraints = [models.UniqueConstraint(fields=["model", "hour"], name="continuation_hour_one_row_per_model")]

    def __str__(self) -> str:
        return f"{self.model} at {self.hour:%Y-%m-%d %H}:00"


class GpuHour(models.Model):
    """The GPU time one replica held in one hour: its GPUs in use (awake) times the seconds the control plane saw
    it hold them (reconciler.demand.gpu_time), the showback's whole to divide. Kept by replica id, not a foreign
    key: a replica's row outlives the replica."""

    replica_id = models.BigIntegerField()
    model = models.CharField(max_length=200, help_text="The replica's model (public name).")
    hour = models.DateTimeField(help_text="Start of the hour (UTC).")
    gpu_seconds = models.FloatField(default=0)

    class Meta:
        ordering = ["-hour", "model", "replica_id"]
        constraints = [models.UniqueConstraint(fields=["replica_id", "hour"], name="gpu_hour_one_row_per_replica")]
        indexes = [models.Index(fields=["hour"], name="gpu_hour_hour")]

    def __str__(self) -> str:
        return f"replica {self.replica_id} ({self.model}) at {self.hour:%Y-%m-%d %H}:00"


class ReplicaTokens(models.Model):
    """Tokens (prompt and completion) one replica served one key in one hour, as the routers counted them, with the
    key's team then: each key's share of that replica's hour, by which the showback divides its GPU time."""

    replica_id = models.BigIntegerField()
    hour = models.DateTimeField(help_text="Start of the hour (UTC).")
    key = models.ForeignKey(ApiKey, related_name="+", null=True, on_delete=models.SET_NULL, db_index=False)
    team = models.ForeignKey("teams.Team", related_name="+", null=True, blank=True, on_delete=models.SET_NULL)
    tokens = models.PositiveBigIntegerField(default=0)

    class Meta:
        ordering = ["-hour", "replica_id"]
        constraints = [
            models.UniqueConstraint(fields=["replica_id", "hour", "key"], name="replica_tokens_one_row_per_key")
        ]
        indexes = [models.Index(fields=["hour", "replica_id"], name="replica_tokens_hour_replica")]

    def __str__(self) -> str:
        return f"{self.tokens} tokens of replica {self.replica_id} at {self.hour:%Y-%m-%d %H}:00"


class TeamGpuHour(models.Model):
    """One hour of the showback, rolled up once the hour is over (keys.showback.roll_up): a team's GPU seconds on
    one model and the tokens it was shared by (team None: keys of no team), or, `idle`, a model's GPU seconds that
    served no tokens. A month's showback sums these instead of dividing every replica's hour again."""

    hour = models.DateTimeField(help_text="Start of the hour (UTC).")
    model = models.CharField(max_length=200)
    team = models.ForeignKey("teams.Team", related_name="+", null=True, blank=True, on_delete=models.SET_NULL)
    idle = models.BooleanField(default=False, help_text="GPU time of replicas' hours that served no tokens.")
    gpu_seconds = models.FloatField()
    tokens = models.PositiveBigIntegerField(default=0)

    class Meta:
        ordering = ["-hour", "model"]
        indexes = [models.Index(fields=["hour"], name="team_gpu_hour_hour")]

    def __str__(self) -> str:
        return f"{self.gpu_seconds:.0f} GPU seconds of {self.model} at {self.hour:%Y-%m-%d %H}:00"


class Budget(models.Model):
    """What a team, a member within a team, or a key may spend in a window (hub.budgets): a request must fit
    every budget that applies to it, its key's, its member's and its team's.

    Exactly one scope: a key (`key`), a member of a team (`team` and `user`), or a whole team (`team` alone).
    Windows begin at local midnights of `timezone` (a day, a week from Monday, a month from the first) or
    never (`none`: the amount is for all time). At `soft_limit_percent` of the amount one alert per window
    goes to `alert_url`; at the amount, requests are refused (429 budget_exceeded) until the window resets.
    """

    class Window(models.TextChoices):
        DAY = "day", "day"
        WEEK = "week", "week (from Monday)"
        MONTH = "month", "month"
        NONE = "none", "none (for all time)"

    team = models.ForeignKey(
        "teams.Team", related_name="budgets", null=True, blank=True, on_delete=models.CASCADE,
        help_text="The team it limits (with a user: that member's spend within the team).",
    )  # fmt: skip
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, related_name="budgets", null=True, blank=True, on_delete=models.CASCADE,
        help_text="A member of the team whose own spend in it is limited; empty = the whole team.",
    )  # fmt: skip
    key = models.ForeignKey(
        ApiKey, related_name="budgets", null=True, blank=True, on_delete=models.CASCADE,
        help_text="The one key it limits (then no team or user).",
    )  # fmt: skip
    amount = models.DecimalField(
        max_digits=16,
        decimal_places=6,
        validators=[MinValueValidator(Decimal(0), "A budget cannot be negative.")],
        help_text="What may be spent in a window, in the currency unit of the catalog's prices (0 = nothing).",
    )
    window = models.CharField(max_length=8, choices=Window.choices, default=Window.MONTH)
    timezone = models.CharField(
        max_length=64, default="UTC", help_text="Where the window's midnights are, e.g. Europe/Paris."
    )
    soft_limit_percent = models.PositiveSmallIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1), MaxValueValidator(100)],
        help_text="Alert once per window when spend reaches this share of the amount; empty = no alert.",
    )
    alert_url = models.URLField(blank=True, help_text="Where the alert is POSTed (JSON); empty = logged only.")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]
        constraints = [
            models.CheckConstraint(
                name="budget_has_one_scope",
                condition=(
                    models.Q(key__isnull=False, team__isnull=True, user__isnull=True)
                    | models.Q(key__isnull=True, team__isnull=False)
                ),
            ),
            models.UniqueConstraint(
                fields=["key", "window"],
                condition=models.Q(key__isnull=False),
                name="budget_once_per_key_window",
                violation_error_message="This key already has a budget for that window.",
            ),
            models.UniqueConstraint(
                fields=["team", "window"],
                condition=models.Q(team__isnull=False, user__isnull=True),
                name="budget_once_per_team_window",
                violation_error_message="This team already has a budget for that window.",
            ),
            models.UniqueConstraint(
                fields=["team", "user", "window"],
                condition=models.Q(user__isnull=False),
                name="budget_once_per_member_window",
                violation_error_message="This member already has a budget in the team for that window.",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.scope_text()}: {self.amount.normalize():f} per {self.window}"

    def scope_text(self) -> str:
        """Whose budget it is, in words (the 429 and the alerts name it so)."""
        if self.key is not None:
            return f"key “{self.key.name}”"
        team = self.team.name if self.team is not None else "?"
        if self.user_id is not None:
            return f"{self.user} in team “{team}”"
        return f"team “{team}”"

    def clean(self) -> None:
        """One scope; a member's budget is for a member of the team; a time zone that exists."""
        super().clean()
        if self.key_id is not None and (self.team_id is not None or self.user_id is not None):
            raise ValidationError({"key": "A key's budget names no team or user: the key's own are counted apart."})
        if self.key_id is None and self.team_id is None:
            raise ValidationError({"team": "A budget is a team's, a member's within a team, or a key's: name one."})
        if self.user_id is not None and self.team is not None and not self.team.has_member(self.user_id):
            raise ValidationError({"user": f"{self.user} is not a member of the team “{self.team.name}”."})
        try:
            ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError):
            message = f"Unknown time zone “{self.timezone}”: use a name like Europe/Paris."
            raise ValidationError({"timezone": message}) from None


class BudgetAlert(models.Model):
    """A budget's soft limit reached in one window: made once per window (its counter is unique), then POSTed to
    the budget's alert URL until delivered or out of attempts (keys.alerts)."""

    budget = models.ForeignKey(Budget, related_name="alerts", on_delete=models.CASCADE)
    counter = models.CharField(max_length=64, unique=True, help_text="The budget's counter of that window.")
    window_start = models.DateTimeField(null=True, blank=True, help_text="Empty: a budget with no window.")
    used_units = models.PositiveBigIntegerField(help_text="What it held when the alert was made (10⁻¹² units).")
    created_at = models.DateTimeField(auto_now_add=True)
    delivered_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveSmallIntegerField(default=0)
    last_attempt_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.budget}: soft limit reached ({self.counter})"


class RequestRecord(models.Model):
    """One request as its router saw it (hub.contracts.RequestRecord), kept LLMGW_REQUEST_RECORD_DAYS days when
    that is set: the per-request log beside the hourly TokenUsage rows, which every page and report reads.

    Narrow on purpose (well under half a kilobyte a row with its indexes on PostgreSQL: bench/spend_bench.py): the
    key's and team's ids, not their names; no request or answer text."""

    id = models.BigAutoField(primary_key=True)
    at = models.DateTimeField(help_text="When the router received it.")
    key = models.ForeignKey(ApiKey, null=True, on_delete=models.SET_NULL, related_name="+", db_index=False)
    team = models.ForeignKey(
        "teams.Team", null=True, on_delete=models.SET_NULL, related_name="+", db_index=False, db_constraint=False
    )
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+", db_index=False,
        db_constraint=False,
    )  # fmt: skip
    model = models.CharField(max_length=200)
    status = models.PositiveSmallIntegerField()
    prompt_tokens = models.PositiveIntegerField()
    completion_tokens = models.PositiveIntegerField()
    spend_units = models.PositiveBigIntegerField(help_text="What it was charged, in 10⁻¹² of the currency unit.")
    milliseconds = models.PositiveIntegerField()

    class Meta:
        ordering = ["-at"]
        indexes = [
            models.Index(fields=["key", "at"], name="request_record_key_at"),
            models.Index(fields=["team", "at"], name="request_record_team_at"),
            models.Index(fields=["at"], name="request_record_at"),  # the retention's deletes
        ]

    def __str__(self) -> str:
        return f"{self.model} {self.status} at {self.at:%Y-%m-%d %H:%M:%S}"
