"""The plan's spec as the typed `Spec`, read in one place by the serving actors."""

from __future__ import annotations

from loomdata.schemas.plan import PlanMeta
from loomdata.schemas.spec import Spec

__all__ = ["plan_spec"]


def plan_spec(meta: PlanMeta) -> Spec:
    """`meta.spec` validated into a `Spec` (plan.json stores it as a dict; a typed one passes through)."""
    spec: object = meta.spec
    return spec if isinstance(spec, Spec) else Spec.model_validate(spec)
