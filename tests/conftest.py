"""The suite's root conftest: it only registers the test kit (tests/helpers) as plugins.

Shared fixtures and hooks live in those modules, never in a package's conftest that another
package would have to import (tests/core/test_test_kit.py guards that).
"""

pytest_plugins = [
    "tests.helpers.plugin",
    "tests.helpers.fixtures",
    "tests.helpers.gateway",
    "tests.helpers.deployments",
]
