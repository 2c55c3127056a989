"""UniEP: deterministic expert-parallel MoE layers. Knows torch and triton, never torchtitan.

Shape letters, one legend for the library (a tensor's name ends in its dims, e.g.
``scores_TK``; each module's docstring names the letters it uses):

    B batch        S sequence     T tokens (T = B*S local)    K experts per token
    P = T*K (token, k) pairs      E experts    El experts per rank    D model dim
    H expert hidden dim           R rows on an owner (expert-major)   M rows (any count)
    W expert-parallel ranks       L ranks per node     Nd nodes       Q sends
    G expert groups (router)      GEMMs: M x N output, Kd reduction   _cap: capacity
"""

from uniep.config import UniEPConfig, UniEPConfigError
from uniep.moe import UniEPMoE
from uniep.plan import RoutingPlan, build_plan

__all__ = ["RoutingPlan", "UniEPConfig", "UniEPConfigError", "UniEPMoE", "build_plan"]
