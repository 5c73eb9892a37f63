"""A StreamClient's checkpoint state: versioned, validated, with messages that show both values and the fix."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loomdata.schemas.errors import ContractError

__all__ = ["STATE_VERSION", "StreamState"]

STATE_VERSION = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamState:
    """Where a rank's stream stands: the next micro-batch to yield is (`step`, `micro_batch`)."""

    plan_id: str
    dp_rank: int
    step: int
    micro_batch: int
    version: int = STATE_VERSION

    def __post_init__(self) -> None:
        if self.step < 0 or self.micro_batch < 0 or self.dp_rank < 0:
            raise ContractError(f"stream state has a negative position: {self.as_dict()}")

    def as_dict(self) -> dict[str, Any]:
        """The state_dict form (plain ints and strings, safe for torch.save / JSON)."""
        return {
            "plan_id": self.plan_id,
            "dp_rank": self.dp_rank,
            "step": self.step,
            "micro_batch": self.micro_batch,
            "version": self.version,
        }

    @classmethod
    def parse(cls, raw: Mapping[str, Any], *, plan_id: str, dp_rank: int, micro_batches: int) -> StreamState:
        """Validate a saved state against the running plan and rank; ContractError shows both values and the fix."""
        missing = [k for k in ("plan_id", "dp_rank", "step", "micro_batch", "version") if k not in raw]
        if missing:
            raise ContractError(
                f"stream state lacks {', '.join(missing)} (got keys {sorted(raw)}); pass a dict made by "
                "StreamClient.state_dict()"
            )
        if raw["version"] != STATE_VERSION:
            raise ContractError(
                f"stream state version {raw['version']} is not supported (this loomdata writes version "
                f"{STATE_VERSION}); resume with the loomdata version that saved it, or restart from a step "
                "with StreamClient(..., start_step=N)"
            )
        if raw["plan_id"] != plan_id:
            raise ContractError(
                f"stream state is for plan {raw['plan_id']}, but this client streams plan {plan_id}; "
                "open the plan the checkpoint was made with (its plan dir), or re-plan the remaining "
                "steps for this plan and start from a step"
            )
        if int(raw["dp_rank"]) != dp_rank:
            raise ContractError(
                f"stream state is for dp rank {raw['dp_rank']}, but this client is dp rank {dp_rank}; "
                "load each rank's own state (a different world size needs an elastic re-plan)"
            )
        if not 0 <= int(raw["micro_batch"]) < micro_batches:
            raise ContractError(
                f"stream state micro_batch {raw['micro_batch']} is outside 0..{micro_batches - 1} of plan {plan_id}"
            )
        return cls(
            plan_id=str(raw["plan_id"]),
            dp_rank=int(raw["dp_rank"]),
            step=int(raw["step"]),
            micro_batch=int(raw["micro_batch"]),
        )
