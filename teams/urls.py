"""The self-service pages, mounted at /me/: log in and out, one's own page, and the pages of the teams one manages."""

from django.contrib.auth import views as auth_views
from django.urls import path, reverse_lazy

from teams import views

app_name = "me"

urlpatterns = [
    path(
        "login",
        auth_views.LoginView.as_view(
            template_name="teams/login.html", next_page=reverse_lazy("me:home"), redirect_authenticated_user=True
        ),
        name="login",
    ),
    path("logout", auth_views.LogoutView.as_view(next_page=reverse_lazy("me:login")), name="logout"),
    path("", views.home, name="home"),
    path("keys/<int:pk>/revoke", views.revoke_own_key, name="revoke_key"),
    path("teams/<int:pk>/", views.team, name="team"),
    path("teams/<int:pk>/members/<int:membership>/remove", views.remove_member, name="remove_member"),
    path("teams/<int:pk>/keys/<int:key>/revoke", views.revoke_team_key, name="revoke_team_key"),
]
