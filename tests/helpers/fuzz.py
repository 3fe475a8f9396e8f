"""Schemathesis without its pytest plugin: every operation of a schema, fuzzed with a fixed seed.

(schemathesis' lazy `from_fixture` does not work with this pytest; driving Hypothesis
directly also lets one test report every failing operation at once.)
"""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import Case, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance

# No 5xx; a documented status must match its schema and content type. Undocumented 4xx are fine.
CHECKS = [not_a_server_error, response_schema_conformance, content_type_conformance]


def fuzz_schema(schema, call: Callable[[Case], None], *, examples: int) -> list[str]:
    """Run `call(case)` on `examples` derandomized cases per operation and generation mode
    (valid and invalid data); returns one line per failing operation and mode."""
    failures = []
    fixed = settings(
        max_examples=examples,
        derandomize=True,  # the same examples on every run: CI is reproducible
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @fixed
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case: Case) -> None:
                call(case)

            try:
                run()
            except BaseException as error:  # schemathesis raises groups; report every failing operation
                if isinstance(error, KeyboardInterrupt | SystemExit):
                    raise
                failures.append(f"{operation.label} [{mode.value}]: {str(error)[:1500]}")
    return failures
