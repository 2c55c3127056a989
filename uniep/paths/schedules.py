"""The concrete config of each call of an expert path: the layer's config as written,
or with ``config = "auto"`` the tuner's choice for the call's shape and 4096-token
bucket (resolved once per key, logged)."""

from __future__ import annotations

import logging

import torch

from uniep.config import UniEPConfig

logger = logging.getLogger("uniep")


class Schedules:
    def __init__(self, config: UniEPConfig, num_experts: int):
        self.config, self.num_experts = config, num_experts
        self._auto: dict[tuple, UniEPConfig] = {}

    def config_for(self, x_TD: torch.Tensor, w1: torch.Tensor, top_k: int, ep_size: int) -> UniEPConfig:
        """The config of a call on tokens ``x_TD`` (T, D) with local experts ``w1`` (El, H, D)."""
        if self.config.config != "auto":
            return self.config
        from uniep.tune import MoEShape, device_spec, resolve, token_bucket
        from uniep.tune.space import KNOBS

        shape = MoEShape(dim=w1.shape[2], hidden=w1.shape[1], experts=self.num_experts, top_k=top_k)
        key = (shape, token_bucket(x_TD.shape[0]), ep_size, str(x_TD.device))
        if key not in self._auto:
            config, source = resolve(self.config, shape, x_TD.shape[0], device_spec(x_TD.device), ep_size)
            knobs = {k: getattr(config, k) for k in KNOBS}
            logger.info(f"UniEP config = 'auto' for {shape.key()}, {key[1]} tokens, EP {ep_size}: {source} -> {knobs}")
            self._auto[key] = config
        return self._auto[key]
