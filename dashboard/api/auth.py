"""API authentication: DRF tokens sent as `Authorization: Token …` or `Authorization: Bearer …`.

Scripts and HTTP clients (curl, the OpenAPI tools, schemathesis) default to
`Bearer`; DRF's own scheme is `Token`. Both name the same DRF token row.
"""

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework.authentication import TokenAuthentication, get_authorization_header

KEYWORDS = ("Token", "Bearer")


class TokenOrBearerAuthentication(TokenAuthentication):
    """DRF's TokenAuthentication, accepting either keyword; a 401 asks for `Bearer`."""

    keyword = "Bearer"

    def authenticate(self, request):
        parts = get_authorization_header(request).split()
        if parts:
            # Authenticators are made per request, so setting the keyword on this instance is safe.
            said = parts[0].decode("latin-1").lower()
            self.keyword = next((k for k in KEYWORDS if k.lower() == said), type(self).keyword)
        return super().authenticate(request)


class TokenOrBearerScheme(OpenApiAuthenticationExtension):
    """Documents the token as an HTTP bearer scheme (`Token` works too)."""

    target_class = "dashboard.api.auth.TokenOrBearerAuthentication"
    name = "tokenAuth"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "A staff user's API token (`manage.py create_api_token USER`); "
            "send `Authorization: Bearer <token>` (or `Token <token>`).",
        }
