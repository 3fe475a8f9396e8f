"""The REST API's Basic authentication, with every failed guess counted by django-axes."""

from __future__ import annotations

from drf_spectacular.authentication import BasicScheme
from rest_framework import authentication


class BasicAuthentication(authentication.BasicAuthentication):
    """DRF's Basic auth, parsing the body before the password is checked.

    axes reads the request's form data when it records a failure; a body DRF cannot parse would
    raise there, before the failure is counted, and the answer (a 400 for a wrong password, a 200
    for the right one on a GET) would become a guessing oracle that is never throttled. Parsed
    first, such a body is a 400 whatever the password.
    """

    def authenticate_credentials(self, userid, password, request=None):
        if request is not None:
            request.POST  # noqa: B018  (parses the body; a ParseError answers 400 here)
        return super().authenticate_credentials(userid, password, request)


class BasicAuthenticationScheme(BasicScheme):
    """The OpenAPI schema describes it as the HTTP Basic scheme it is."""

    target_class = "portal.core.authentication.BasicAuthentication"
