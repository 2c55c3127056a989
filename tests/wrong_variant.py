"""A deliberately wrong UniEP, the parity tests' negative control: every router score
scaled by 0.98. A training loads it with ``--experimental.custom_import tests.wrong_variant``."""

from uniep.router import TopKRouter

_forward = TopKRouter.forward


def _scores_scaled(self, *args, **kwargs):
    scores_TK, topk_TK = _forward(self, *args, **kwargs)
    return scores_TK * 0.98, topk_TK


TopKRouter.forward = _scores_scaled
