"""yatt-mm: the RL trainer (config, controllers, rollout, rewards, algorithms, checkpoints)."""

import models  # noqa: F401  - installs the CPU runtime import hooks before anything else loads
