"""Schedule tuning: the parameter space, a roofline cost model, search and a measured cache."""

from uniep.tune.cache import MoEShape, TuneCache, token_bucket
from uniep.tune.device import DeviceSpec, device_spec
from uniep.tune.search import rank, resolve
from uniep.tune.space import describe, full_space

__all__ = ["DeviceSpec", "MoEShape", "TuneCache", "describe", "device_spec", "full_space", "rank", "resolve", "token_bucket"]
