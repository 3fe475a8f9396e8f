"""What a benchmark run may ask: the bounds for everyone, the tighter ones for members, the level plans.

docs/decisions.md, "Benchmarks: their own queue, and what a member may ask".
"""

from __future__ import annotations

from django.conf import settings

from inference.errors import InputError
from inference.loadgen.loadgen import LevelPlan
from portal.core.errors import ApplicationError
from portal.deployments.models import Deployment

# Bounds for everyone, staff included: past these the load generator itself is the problem
# (one task per virtual user, a day-long level). Members get the tighter BENCHMARK_MEMBER_* settings.
MAX_LEVELS = 16
MAX_REQUESTS_PER_LEVEL = 100_000
MAX_CONCURRENCY = 4096
MAX_REQUEST_RATE = 10_000.0
MAX_LEVEL_S = 86_400.0
MAX_SEED = 2**31 - 1


def level_plans(
    *,
    concurrencies: list[int] | None,
    request_rates: list[float] | None,
    requests_per_level: int | None,
    duration_s: float | None,
    warmup: int | None,
) -> list[LevelPlan]:
    """The run's levels, closed-loop first, then open-loop; ApplicationError for what the plans refuse."""
    if not concurrencies and not request_rates:
        raise ApplicationError("give at least one concurrency level (e.g. 16,32)", field="concurrencies")
    if len(concurrencies or []) + len(request_rates or []) > MAX_LEVELS:
        raise ApplicationError(f"at most {MAX_LEVELS} levels per run", field="concurrencies")
    if requests_per_level is not None and requests_per_level > MAX_REQUESTS_PER_LEVEL:
        raise ApplicationError(
            f"at most {MAX_REQUESTS_PER_LEVEL} requests per level", field="requests_per_level"
        )
    try:
        plans = [
            LevelPlan(concurrency=c, requests=requests_per_level, duration_s=duration_s, warmup=warmup)
            for c in concurrencies or []
        ]
        plans += [
            LevelPlan(request_rate=r, requests=requests_per_level, duration_s=duration_s, warmup=warmup)
            for r in request_rates or []
        ]
    except InputError as error:
        raise ApplicationError.from_input_error(error) from error
    return plans


def plan_to_dict(plan: LevelPlan) -> dict:
    """A level plan as the run's config stores it (`LevelPlan(**stored)` reads it back)."""
    return {
        "concurrency": plan.concurrency,
        "request_rate": plan.request_rate,
        "requests": plan.requests,
        "duration_s": plan.duration_s,
        "warmup": plan.warmup,
    }


def check_bounds(
    *,
    user,
    deployment: Deployment | None,
    concurrencies: list[int],
    request_rates: list[float],
    requests_per_level: int | None,
    duration_s: float | None,
    level_timeout_s: float | None,
    seed: int,
) -> float | None:
    """Refuse what nobody may ask, then what a non-staff user may not; returns the level timeout.

    A member's levels always end: without a timeout of their own they get the longest a member's
    level may run. On a *shared* deployment with a gateway cap, a member's load stays within the
    cap: closed-loop levels up to it, and no open-loop level, whose in-flight count nothing bounds
    (docs/decisions.md, "Benchmarks: their own queue, and what a member may ask").
    """
    if any(not c <= MAX_CONCURRENCY for c in concurrencies):
        raise ApplicationError(f"concurrency levels are at most {MAX_CONCURRENCY}", field="concurrencies")
    if any(not r <= MAX_REQUEST_RATE for r in request_rates):
        raise ApplicationError(f"request rates are at most {MAX_REQUEST_RATE:g}/s", field="request_rates")
    if duration_s is not None and not duration_s <= MAX_LEVEL_S:
        raise ApplicationError(f"a level lasts at most {MAX_LEVEL_S:g} s", field="duration_s")
    if level_timeout_s is not None and not 0 < level_timeout_s <= MAX_LEVEL_S:
        raise ApplicationError(f"a level timeout is at most {MAX_LEVEL_S:g} s", field="level_timeout_s")
    if not 0 <= seed <= MAX_SEED:
        raise ApplicationError(f"the seed is between 0 and {MAX_SEED}", field="seed")
    if user.is_staff:
        return level_timeout_s
    limit: float = settings.BENCHMARK_MEMBER_MAX_LEVELS  # int and float limits below
    if len(concurrencies) + len(request_rates) > limit:
        raise ApplicationError(
            f"at most {limit} levels per run for non-staff users (BENCHMARK_MEMBER_MAX_LEVELS)",
            field="concurrencies",
        )
    limit = settings.BENCHMARK_MEMBER_MAX_CONCURRENCY
    if any(not c <= limit for c in concurrencies):
        raise ApplicationError(
            f"concurrency levels are at most {limit} for non-staff users (BENCHMARK_MEMBER_MAX_CONCURRENCY)",
            field="concurrencies",
        )
    limit = settings.BENCHMARK_MEMBER_MAX_REQUEST_RATE
    if any(not r <= limit for r in request_rates):
        raise ApplicationError(
            f"request rates are at most {limit:g}/s for non-staff users (BENCHMARK_MEMBER_MAX_REQUEST_RATE)",
            field="request_rates",
        )
    limit = settings.BENCHMARK_MEMBER_MAX_REQUESTS_PER_LEVEL
    if requests_per_level is not None and not requests_per_level <= limit:
        raise ApplicationError(
            f"at most {limit} requests per level for non-staff users "
            "(BENCHMARK_MEMBER_MAX_REQUESTS_PER_LEVEL)",
            field="requests_per_level",
        )
    limit = settings.BENCHMARK_MEMBER_MAX_LEVEL_S
    if duration_s is not None and not duration_s <= limit:
        raise ApplicationError(
            f"a level lasts at most {limit:g} s for non-staff users (BENCHMARK_MEMBER_MAX_LEVEL_S)",
            field="duration_s",
        )
    if level_timeout_s is not None and not level_timeout_s <= limit:
        raise ApplicationError(
            f"a level timeout is at most {limit:g} s for non-staff users (BENCHMARK_MEMBER_MAX_LEVEL_S)",
            field="level_timeout_s",
        )
    if deployment is not None and deployment.shared and deployment.concurrency_cap is not None:
        cap = deployment.concurrency_cap
        above = [c for c in concurrencies if c > cap]
        if above:
            raise ApplicationError(
                f"{deployment.name} is shared and its gateway cap is {cap}: a member's levels stay within it "
                f"({', '.join(map(str, above))} {'is' if len(above) == 1 else 'are'} above)",
                field="concurrencies",
            )
        if request_rates:
            raise ApplicationError(
                f"{deployment.name} is shared and capped at {cap} in flight: members run closed-loop "
                "levels there (an open-loop rate has no in-flight bound)",
                field="request_rates",
            )
    return level_timeout_s if level_timeout_s is not None else limit
