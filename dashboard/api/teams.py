"""Teams over REST, for everyone signed in: the teams you belong to, and, for a team's admins (and operators), its
members: listed, added with a role, removed (who leaves a team loses its keys: teams.changes).

What each role sees comes from teams.access; a team someone does not belong to is a 404 to them."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound, PermissionDenied, ValidationError
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response

from dashboard.api.fields import StrictCharField
from dashboard.api.guards import RefuseNulMixin
from teams.access import administered_teams, is_operator, visible_teams, with_roles
from teams.models import Membership, Team


class TeamSerializer(serializers.ModelSerializer):
    """A team as its members see it, with the asker's own role in it."""

    role = serializers.SerializerMethodField(help_text="Your role in it: admin, member, or operator (staff).")

    class Meta:
        model = Team
        fields = ["id", "name", "allowed_models", "weight", "priority_class", "created_at", "role"]

    def get_role(self, team: Team) -> str | None:
        # Annotated by the view's query (teams.access.with_roles): no query per team.
        role: str | None = getattr(team, "role", None)
        if role is None and is_operator(self.context["request"].user):
            return "operator"
        return role


class MemberSerializer(serializers.ModelSerializer):
    """One member of a team: who, and their role."""

    username = serializers.CharField(source="user.get_username", read_only=True)

    class Meta:
        model = Membership
        fields = ["username", "role"]


class NewMemberSerializer(serializers.Serializer):
    """A member to add: an existing user's username and the role to give them."""

    username = StrictCharField(max_length=150)
    role = serializers.ChoiceField(choices=Membership.Role.choices, default=Membership.Role.MEMBER)


@extend_schema_view(
    members=extend_schema(methods=["GET"], responses=MemberSerializer(many=True)),
    remove_member=extend_schema(responses={204: None}),
)
class TeamViewSet(RefuseNulMixin, viewsets.ReadOnlyModelViewSet):
    """The teams you belong to (every team, for an operator); a team's members for its admins."""

    queryset = Team.objects.none()
    serializer_class = TeamSerializer
    permission_classes = [IsAuthenticated]
    lookup_value_regex = "[^/]+"  # any id reaches the view: a JSON 404 for one that is no team's

    def get_queryset(self):
        return with_roles(visible_teams(self.request.user), self.request.user).order_by("name", "id").distinct()

    def _administered(self) -> Team:
        """The team in the URL, if the asker administers it: 404 if they cannot see it, 403 if only a member."""
        team = self.get_object()
        if not administered_teams(self.request.user).filter(pk=team.pk).exists():
            raise PermissionDenied(f"Only an admin of the team “{team.name}” manages its members.")
        return team

    @extend_schema(methods=["POST"], request=NewMemberSerializer, responses={201: MemberSerializer})
    @action(detail=True, methods=["get", "post"])
    def members(self, request: Request, pk: Any = None) -> Response:
        team = self._administered()
        if request.method == "GET":
            rows = team.memberships.select_related("user").order_by("user__username")
            return Response(MemberSerializer(rows, many=True).data)
        wanted = NewMemberSerializer(data=request.data)
        wanted.is_valid(raise_exception=True)
        username = wanted.validated_data["username"]
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise ValidationError({"username": [f"No user is named “{username}”."]})
        try:
            with transaction.atomic():
                membership = Membership.objects.create(team=team, user=user, role=wanted.validated_data["role"])
        except IntegrityError:
            raise ValidationError({"username": [f"{username} is already in the team “{team.name}”."]}) from None
        return Response(MemberSerializer(membership).data, status=status.HTTP_201_CREATED)

    @action(detail=True, methods=["delete"], url_path=r"members/(?P<username>[^/]+)")
    def remove_member(self, request: Request, pk: Any = None, username: str = "") -> Response:
        team = self._administered()
        membership = team.memberships.filter(user__username=username).first()
        if membership is None:
            raise NotFound(f"{username} is not in the team “{team.name}”.")
        membership.delete()  # their keys of the team are revoked (teams.changes)
        return Response(status=status.HTTP_204_NO_CONTENT)
