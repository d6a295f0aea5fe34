"""The self-service pages under /me/: each view parses, asks teams.access who may see what, calls one function of
teams.selfservice, and renders. Every write is a POST with its CSRF token; a page showing a form with errors
answers 400.

A new key's plaintext is in the answer to the POST that made it and nowhere else: not stored, not in the session,
and the page replaces its history entry so a reload asks for the page again instead of posting a second key.
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse_lazy
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_http_methods, require_POST

from hub import get_hub
from keys.models import ApiKey
from teams import selfservice
from teams.access import is_operator, with_roles
from teams.forms import AddMemberForm, NewKeyForm
from teams.models import Membership, Team

LOGIN_URL = reverse_lazy("me:login")
PUSHED = "every router refuses it within a second"

signed_in = login_required(login_url=LOGIN_URL)


def _render(request: HttpRequest, template: str, context: dict[str, Any], form: Any) -> HttpResponse:
    return render(request, template, {**context, "form": form}, status=400 if form.errors else 200)


@never_cache
@signed_in
@require_http_methods(["GET", "POST"])
def home(request: HttpRequest) -> HttpResponse:
    """/me/: one's teams, keys, usage and budgets; POST makes a key and shows its plaintext this once."""
    form = NewKeyForm(request.user, request.POST or None)
    issued = None
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            issued = selfservice.issue_key(request.user, data["name"], data["team"], data["models"])
        except ValidationError as error:
            form.add_key_error(error)
        else:
            form = NewKeyForm(request.user)  # empty again, for another key
    page = selfservice.my_page(request.user, get_hub(), timezone.now())
    key, plaintext = issued or (None, None)
    return _render(request, "teams/me.html", {"page": page, "new_key": key, "plaintext": plaintext}, form)


@signed_in
@require_POST
def revoke_own_key(request: HttpRequest, pk: int) -> HttpResponseRedirect:
    """Revoke one of one's own keys (another's is a 404: it is not there for them)."""
    key = get_object_or_404(ApiKey, pk=pk, user=request.user)
    selfservice.revoke_key(key)
    messages.success(request, f"Key “{key.name}” revoked: {PUSHED}.")
    return redirect("me:home")


def administered_team(user: Any, pk: int) -> Team:
    """The team, if `user` manages it (its admins, operators). One query. A team they are not in is a 404 (nothing
    of another team shows, not even that it exists); one they are in without administering it, a 403."""
    team = with_roles(Team.objects.filter(pk=pk), user).first()
    operator = is_operator(user)
    if team is None or (team.role is None and not operator):  # type: ignore[attr-defined]
        raise Http404("No such team among yours.")
    if team.role != Membership.Role.ADMIN and not operator:  # type: ignore[attr-defined]
        raise PermissionDenied("Only the team's admins manage it.")
    return team


@never_cache
@signed_in
@require_http_methods(["GET", "POST"])
def team(request: HttpRequest, pk: int) -> HttpResponse:
    """/me/teams/<id>/: the team's members, keys, budgets and usage; POST adds a member."""
    chosen = administered_team(request.user, pk)
    form = AddMemberForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            selfservice.add_member(chosen, data["username"], data["role"])
        except ValidationError as error:
            form.add_member_error(error)
        else:
            messages.success(request, f"{data['username']} is now in the team as {data['role']}.")
            return redirect("me:team", pk=chosen.pk)
    page = selfservice.team_page(chosen, get_hub(), timezone.now())
    return _render(request, "teams/team.html", {"page": page}, form)


@signed_in
@require_POST
def remove_member(request: HttpRequest, pk: int, membership: int) -> HttpResponseRedirect:
    """Take a member out of the team (their keys of the team are revoked)."""
    chosen = administered_team(request.user, pk)
    leaving = get_object_or_404(Membership.objects.select_related("user"), pk=membership, team=chosen)
    try:
        selfservice.remove_member(leaving)
    except ValidationError as error:
        messages.error(request, " ".join(error.messages))
    else:
        messages.success(request, f"{leaving.user} left the team; their keys of it are revoked: {PUSHED}.")
        if leaving.user_id == request.user.pk and not is_operator(request.user):
            return redirect("me:home")  # the team's page is no longer theirs to see
    return redirect("me:team", pk=chosen.pk)


@signed_in
@require_POST
def revoke_team_key(request: HttpRequest, pk: int, key: int) -> HttpResponseRedirect:
    """Revoke any key of a team one manages (a key of another team is a 404)."""
    chosen = administered_team(request.user, pk)
    revoked = get_object_or_404(ApiKey, pk=key, team=chosen)
    selfservice.revoke_key(revoked)
    messages.success(request, f"Key “{revoked.name}” revoked: {PUSHED}.")
    return redirect("me:team", pk=chosen.pk)
