"""API permissions: signed-in users read, only staff write."""

from rest_framework.permissions import SAFE_METHODS, BasePermission


class StaffWritesAuthenticatedReads(BasePermission):
    def has_permission(self, request, view) -> bool:
        user = request.user
        if not (user and user.is_authenticated):
            return False
        return request.method in SAFE_METHODS or user.is_staff
