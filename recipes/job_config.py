"""TorchTitan custom config module: adds the ``[uniep]`` section to the job config.

Point TorchTitan at it with ``[job] custom_config_module = "recipes.job_config"``. The
section is ``uniep.UniEPConfig`` itself, so TOML keys, CLI flags (``--uniep.backend``)
and the library share one definition and one validation.
"""

from dataclasses import dataclass, field

from uniep import UniEPConfig


@dataclass
class JobConfig:
    uniep: UniEPConfig = field(default_factory=UniEPConfig)
