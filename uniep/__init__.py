"""UniEP: deterministic expert-parallel MoE layers. Knows torch and triton, never torchtitan."""

from uniep.config import UniEPConfig, UniEPConfigError
from uniep.moe import UniEPMoE
from uniep.plan import RoutingPlan, build_plan

__all__ = ["RoutingPlan", "UniEPConfig", "UniEPConfigError", "UniEPMoE", "build_plan"]
